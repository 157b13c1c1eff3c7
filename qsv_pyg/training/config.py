"""Training configuration: one flat dataclass whose fields describe themselves.

Every command-line option of ``qsv-train`` is a field of :class:`TrainConfig`;
the same object is written to ``config.json`` and into every checkpoint, so a
run can always be reproduced (and resumed) from its own files.

Each field carries, as dataclass field metadata (see :func:`option`), its help
text, its command-line group, the values it accepts and its *roles*. Everything
that lists fields is a query on that metadata, so a new option is one
declaration:

* the ``qsv-train`` parser (:func:`qsv_pyg.training.cli.build_parser`);
* :func:`resume_overridable`: what ``--resume`` may change;
* :func:`ablation_fields`: the QSV switches and the model keywords they set;
* :func:`fields_with_role` ``(TABLE)``: what the experiment runner sets per run;
* :func:`fields_with_role` ``(SHARED)``: what a table's runs must share;
* :meth:`TrainConfig.validate`: type, choice and range checks, and the model name
  (against the registry: the one place it is checked).

One concept, one word: an ablation field, its flag, the model keyword it sets and
its key in a table row are the same word (``beta_prior_weight``,
``--beta-prior-weight``); only ``frozen_beta`` sets the negation ``learn_beta``.
Old names are read where they arrive, each with a :class:`DeprecationWarning`
(:data:`RENAMED_FIELDS`: as flags, as keys of a stored ``config.json`` or
checkpoint, of :meth:`TrainConfig.replace` and of a table row), and so are old
spellings of values (``--quat-source both``); nothing else uses them. Each old
name has one meaning: ``beta_prior`` is the old name of ``beta_prior_weight``
(the prior's centre is ``beta_prior_centre``; no model takes ``beta_prior``).
Defaults are not retyped here: the schedule's come from :data:`~qsv_pyg.training.presets.DEFAULT_SCHEDULE`,
the models' (shown in the help) from :func:`~qsv_pyg.models.graph_net.graph_net_default`.

A configuration is assembled in three layers, later ones winning::

    TrainConfig() defaults  <  PRESETS[--config NAME]  <  explicit command-line flags

Example:
    >>> cfg = preset_config("paper-qsv", epochs=1, subset=256)
    >>> TrainConfig.from_json(cfg.to_json()) == cfg
    True
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

from qsv_pyg.data import NUM_CLASSES
from qsv_pyg.data.cifar import CIFAR_NAMES
from qsv_pyg.models import available_models
# The model's option names, so a flag accepts exactly what the model does.
from qsv_pyg.models.field import FIELD_INITS
from qsv_pyg.models.graph_net import DEFAULT_HEADS, GRAPHNET_QUAT_SOURCES, graph_net_default
from qsv_pyg.models.zoo import CONTROL_HEADS
from qsv_pyg.nn.qsv_conv import ROUTINGS, TRANSPORTS
from qsv_pyg.nn.quat_sources import QUAT_SOURCE_ALIASES

from . import fields as _fields
from .fields import RESUME, ROW, SHARED, TABLE, ConfigError, flag_of, option
from .optim import OPTIMIZER_BACKENDS
from .presets import (
    AUTO_PRESETS,
    CPU_SCALE_MODEL_ARGS,
    CPU_SCALE_SCHEDULE,
    DEFAULT_SCHEDULE,
    PRESETS,
)
from .run_files import write_text

__all__ = [
    "AMP_MODES",
    "AUTO_PRESETS",
    "CPU_SCALE_MODEL_ARGS",
    "CPU_SCALE_SCHEDULE",
    "ConfigError",
    "FIELD_INITS",
    "GRAPHNET_QUAT_SOURCES",
    "OPTIMIZER_BACKENDS",
    "PRESETS",
    "RENAMED_FIELDS",
    "RESUME",
    "ROW",
    "ROUTINGS",
    "SHARED",
    "TABLE",
    "TRANSPORTS",
    "TrainConfig",
    "ablation_fields",
    "field_kind",
    "fields_with_role",
    "flag_of",
    "option",
    "preset_config",
    "resume_overridable",
    "to_argv",
    "upgrade_keys",
]

AMP_MODES = ("none", "bf16", "fp16")
BUDGET_CLOCKS = ("wall", "process")


# Command-line groups, in --help order.
_WHAT, _QSV, _OPTIM, _RUNTIME = ("what to train",
                                 "QSV ablations (graph models with QSV convolutions only)",
                                 "optimisation", "runtime")
#: Largest seed: torch seeds are 64-bit, and each process adds its rank.
MAX_SEED = 2**63 - 1


def _ablation(help: str, model_key: str, **kwargs: Any) -> Any:
    """A QSV ablation field (default ``None``: the model's own) that sets the model
    keyword ``model_key`` (the field's own name, but for ``frozen_beta``).

    ``{default}`` in ``help`` becomes the model's default, read from the model
    (:func:`~qsv_pyg.models.graph_net.graph_net_default`), never retyped.
    """
    text = help.format(default=graph_net_default(model_key)) if "{default}" in help else help
    return option(None, text, group=_QSV, model_key=model_key, **kwargs)


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    ``None`` in an ablation field means "the model's own default"; only fields
    that are set are forwarded to the model constructor, so an ablation flag on
    a model that has no such switch fails loudly (see :meth:`model_overrides`).
    Every field is described by its help text: ``qsv-train --help``, or
    :meth:`describe`.
    """

    # ---------------------------------------------------------------- what to train, on what
    model: str = option("qsv", "model to train (a registered name)", group=_WHAT,
                        roles=(TABLE,), metavar="NAME")
    dataset: str = option("cifar10", "dataset", group=_WHAT, roles=(TABLE, SHARED),
                          choices=tuple(CIFAR_NAMES))
    data_dir: Optional[str] = option(
        None, "folder containing cifar-10-batches-py/ or cifar-100-python/ "
        "(default: $QSV_DATA_DIR)", group=_WHAT, roles=(RESUME, TABLE), metavar="DIR")
    download: bool = option(False, "download the dataset into --data-dir when missing",
                            group=_WHAT, roles=(RESUME,))
    download_url: Optional[str] = option(
        None, "fetch the dataset from this URL or local path when it is missing (a mirror "
        "or a file:// copy; implies --download)", group=_WHAT, roles=(RESUME,), metavar="URL")
    subset: Optional[int] = option(None, "train on a class-balanced subset of N images",
                                   group=_WHAT, roles=(TABLE, SHARED), lo=1, metavar="N")
    test_subset: Optional[int] = option(None, "evaluate on a class-balanced subset of M images",
                                        group=_WHAT, roles=(TABLE, SHARED), lo=1, metavar="M")
    # ---------------------------------------------------------------- QSV ablations
    routing: Optional[str] = _ablation("attention routing (model default: {default})",
                                       "routing", choices=ROUTINGS)
    transport: Optional[str] = _ablation("message transport (model default: {default})",
                                         "transport", choices=TRANSPORTS)
    quat_source: Optional[str] = _ablation(
        "origin of the quaternions (model default: {default})", "quat_source",
        choices=GRAPHNET_QUAT_SOURCES, value_aliases=QUAT_SOURCE_ALIASES)
    frozen_field: Optional[bool] = _ablation(
        "keep the quaternion fields at their random initialisation", "frozen_field")
    field_per_head: Optional[bool] = _ablation(
        "QSV: one field quaternion per node and head (default) or, with "
        "--no-field-per-head, one per node shared by the heads", "field_per_head")
    field_init: Optional[str] = _ablation(
        "initial quaternion field: uniform (Haar-random) or identity (model default: "
        "{default})", "field_init", choices=FIELD_INITS)
    beta_init: Optional[float] = _ablation(
        "initial routing temperature β (model default: {default})", "beta_init", lo=0.0,
        lo_open=True, metavar="B")
    frozen_beta: Optional[bool] = _ablation("do not learn β", "learn_beta", negate=True)
    beta_prior_weight: Optional[float] = _ablation(
        "weight of the log-β prior (model default: {default}; 0 turns it off)",
        "beta_prior_weight", lo=0.0, metavar="W", aliases=("beta_prior",))
    beta_prior_centre: Optional[float] = _ablation(
        "β at the centre of the log-β prior (model default: {default})", "beta_prior_centre",
        lo=0.0, lo_open=True, metavar="B")
    repulsion_k: Optional[int] = _ablation(
        "neighbours in the field repulsion regulariser (model default: {default})",
        "repulsion_k", lo=1, metavar="K")
    repulsion_weight: Optional[float] = _ablation(
        "weight of the field repulsion regulariser (model default: {default})",
        "repulsion_weight", lo=0.0, metavar="W")
    root_weight: Optional[bool] = _ablation(
        "QSV: add the root weight W_r x_i in every QSVConv (model default); "
        "--no-root-weight leaves the target's features to the residual", "root_weight")
    mlp_ratio: Optional[float] = _ablation(
        "hidden size of every block's MLP relative to its width (any graph model; "
        "model default {default}); 0 removes the MLPs", "mlp_ratio", lo=0.0, metavar="R")
    model_args: Dict[str, Any] = option(
        help="extra model keyword, VALUE parsed as JSON (e.g. widths=[32,32]); repeatable. "
        f"heads is QSV's head count (qsv and lattice; default {DEFAULT_HEADS}). An attention "
        "control is parameter-matched to the QSV model of qsv_heads heads and qsv_widths "
        f"widths (default: qsv's) and has its own control_heads (default {CONTROL_HEADS})",
        group=_QSV, roles=(TABLE,), metavar="KEY=VALUE", factory=dict)
    # ---------------------------------------------------------------- optimisation
    epochs: int = option(DEFAULT_SCHEDULE["epochs"], "training epochs", group=_OPTIM,
                         roles=(TABLE, SHARED), lo=1)
    batch_size: int = option(DEFAULT_SCHEDULE["batch_size"], "images per step and process",
                             group=_OPTIM, roles=(TABLE, SHARED), lo=1)
    eval_batch_size: int = option(500, "images per evaluation batch", group=_OPTIM, lo=1)
    lr: float = option(DEFAULT_SCHEDULE["lr"], "peak learning rate", group=_OPTIM,
                       roles=(TABLE, SHARED), lo=0.0, lo_open=True)
    weight_decay: float = option(DEFAULT_SCHEDULE["weight_decay"], "decoupled weight decay",
                                 group=_OPTIM, roles=(SHARED,), lo=0.0)
    warmup_epochs: float = option(
        DEFAULT_SCHEDULE["warmup_epochs"], "linear warm-up epochs (fractions allowed; capped "
        "at --epochs)", group=_OPTIM, roles=(SHARED,), lo=0.0)
    min_lr_ratio: float = option(DEFAULT_SCHEDULE["min_lr_ratio"],
                                 "final lr / peak lr of the cosine", group=_OPTIM,
                                 roles=(SHARED,), lo=0.0, hi=1.0)
    label_smoothing: float = option(DEFAULT_SCHEDULE["label_smoothing"], "label smoothing",
                                    group=_OPTIM, roles=(SHARED,), lo=0.0, hi=1.0,
                                    hi_open=True)
    optimizer: str = option("auto", "sphere backend for the quaternion fields", group=_OPTIM,
                            choices=OPTIMIZER_BACKENDS)
    # 20: the best of 0.2, 1, 5 and 20 in the field probe of docs/results.md; 1 is
    # the behaviour before that probe.
    field_lr_scale: float = option(
        20.0, "learning rate of the quaternion fields relative to --lr", group=_OPTIM,
        roles=(ROW,), lo=0.0, lo_open=True, metavar="S")
    seed: int = option(0, "seed of init, data order, augmentation", group=_OPTIM,
                       roles=(TABLE,), lo=0, hi=MAX_SEED)
    # ---------------------------------------------------------------- runtime
    device: str = option("auto", "auto (CUDA if available), cpu, cuda, cuda:N", group=_RUNTIME,
                         roles=(RESUME, TABLE))
    amp: str = option("none", "mixed precision, CUDA only", group=_RUNTIME, choices=AMP_MODES)
    tf32: bool = option(
        False, "allow TF32 (10-bit mantissa) in float32 matmuls and cuDNN convolutions on "
        "CUDA (Ampere or newer): faster, less exact; off: full float32. Ignored off CUDA",
        group=_RUNTIME, roles=(RESUME,))
    compile: bool = option(False, "wrap the model in torch.compile", group=_RUNTIME,
                           roles=(RESUME,))
    time_budget: Optional[float] = option(
        None, "stop cleanly (checkpoint, evaluation, metrics) after this much time",
        group=_RUNTIME, roles=(RESUME, TABLE, SHARED), lo=0.0, lo_open=True, metavar="MINUTES")
    budget_clock: str = option(
        "wall", "what --time-budget counts: wall time, or this process's CPU time (equal "
        "compute per run on a shared machine)", group=_RUNTIME, roles=(SHARED,),
        choices=BUDGET_CLOCKS)
    anneal_to_budget: bool = option(
        False, "end the cosine decay when the time budget ends, if that is sooner",
        group=_RUNTIME)
    eval_at_minutes: List[float] = option(
        help="also evaluate on the test set at these marks of the budget clock "
        "(metrics.json: budget_evals; not charged to the budget)", group=_RUNTIME,
        metavar="M", factory=list)
    threads: Optional[int] = option(None, "torch CPU threads (default: torch's choice)",
                                    group=_RUNTIME, roles=(RESUME, SHARED), lo=1, metavar="N")
    out_dir: Optional[str] = option(None, "run folder (default: runs/<model>-<timestamp>)",
                                    group=_RUNTIME, roles=(RESUME, TABLE), metavar="DIR")
    progress: bool = option(True, "show progress bars", group=_RUNTIME, roles=(RESUME, TABLE))
    preset: Optional[str] = option(None, "name of the preset the run started from", group=None)

    # ------------------------------------------------------------ conversions
    def to_dict(self) -> Dict[str, Any]:
        """Plain-JSON dict of every field (``model_args`` is copied)."""
        out = dataclasses.asdict(self)
        out["model_args"] = json.loads(json.dumps(self.model_args))  # tuples -> lists
        out["eval_at_minutes"] = list(self.eval_at_minutes)
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainConfig":
        """Inverse of :meth:`to_dict`; reads the ``config.json`` of older runs too.

        Old field names and value spellings are replaced first (:func:`upgrade_keys`:
        the ``beta_prior`` of a configuration written before issue 21 is the prior's
        weight, now ``beta_prior_weight``), then fields the configuration predates
        take their behaviour from before they existed.

        Raises:
            ConfigError: ``data`` holds keys that are not fields.
        """
        data = upgrade_keys(data)
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"unknown configuration key(s) {unknown}; known: {sorted(_FIELDS)}")
        # A config saved before a field existed ran with that field's old behaviour.
        return cls(**{**_BEFORE_FIELD_EXISTED, **data})

    def to_json(self) -> str:
        """The configuration as an indented JSON document."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write :meth:`to_json` to ``path`` atomically."""
        write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: "str | os.PathLike[str]") -> "TrainConfig":
        """Read a ``config.json`` written by :meth:`save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes`` applied (old names accepted, :func:`upgrade_keys`;
        unknown names raise :class:`ConfigError`)."""
        changes = upgrade_keys(changes)
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"unknown configuration key(s) {unknown}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def describe(cls) -> Dict[str, str]:
        """Field name -> help text, for every field."""
        return {name: f.metadata["help"] for name, f in _FIELDS.items()}

    # ------------------------------------------------------------ model kwargs
    def ablation_flags(self) -> Dict[str, Any]:
        """Command-line flag -> value of every ablation that is set."""
        return {flag_of(name): getattr(self, name) for name in ablation_fields()
                if getattr(self, name) is not None}

    def model_overrides(self) -> Dict[str, Any]:
        """Keyword arguments for ``build_model(self.model, num_classes, **overrides)``.

        Only ablations that are set are included, translated to the model's
        keyword names; ``model_args`` are added last (lists become tuples).
        """
        out: Dict[str, Any] = {}
        for name, key in ablation_fields().items():
            value = getattr(self, name)
            if value is not None:
                out[key] = (not value) if _FIELDS[name].metadata["negate"] else value
        for key, value in self.model_args.items():
            out[key] = _tuplify(value)
        return out

    # ------------------------------------------------------------ validation
    def validate(self) -> "TrainConfig":
        """Check types, choices and ranges of every field (from their metadata).

        Returns:
            ``self``, for chaining.

        Raises:
            ConfigError: naming the offending option and the accepted values.
        """
        key = str(self.dataset).lower().replace("-", "").replace("_", "")
        self.dataset = key if key in CIFAR_NAMES else self.dataset
        for name, f in _FIELDS.items():
            setattr(self, name, _spelled_today(name, getattr(self, name)))
            _fields.check_value(f, getattr(self, name))
        _need(isinstance(self.model_args, dict)
              and all(isinstance(k, str) for k in self.model_args),
              "model_args must be a dict with string keys")
        for key, value in self.model_args.items():
            _need(_fields.all_finite(value), f"--model-arg {key} must be finite; got {value!r}")
        marks = self.eval_at_minutes
        _need(isinstance(marks, (list, tuple)) and all(
            _fields.is_number(m) and math.isfinite(m) and m > 0 for m in marks),
            f"--eval-at-minutes must be positive numbers of minutes; got {marks!r}")
        self.eval_at_minutes = sorted(float(m) for m in marks)
        _need(not marks or self.time_budget is not None,
              "--eval-at-minutes needs --time-budget (the marks count on its clock)")
        _need(self.model in available_models(), f"unknown model {self.model!r}; choose one of "
                                                 f"{', '.join(available_models())}")
        _need(bool(self.device), f"--device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        self._validated = self.to_dict()
        return self

    def is_validated(self) -> bool:
        """Whether :meth:`validate` passed and nothing changed since (a copy made with
        :func:`copy.deepcopy` keeps this; :meth:`replace` and :meth:`from_dict` do not),
        so a configuration is checked once on its way to the trainer."""
        return getattr(self, "_validated", None) == self.to_dict()

    @property
    def num_classes(self) -> int:
        """Classes of :attr:`dataset` (the size of the classifier's output)."""
        return NUM_CLASSES[self.dataset]


# ---------------------------------------------------------------------------- field queries

_FIELDS: Dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
#: Old field name -> field (issue 21: ``beta_prior`` was the prior's weight). Read, with
#: a :class:`DeprecationWarning`, as a flag, as a key of a stored configuration, of
#: ``replace()`` and of a table row.
RENAMED_FIELDS: Dict[str, str] = {old: name for name, f in _FIELDS.items()
                                  for old in f.metadata["aliases"]}
#: Values that reproduce the behaviour of configs saved before these fields existed
#: (``config.json`` from older runs lacks them; their defaults have since changed).
#: (``tf32``: TF32 was switched on for every CUDA run before it became an option.)
_BEFORE_FIELD_EXISTED: Dict[str, Any] = {"field_lr_scale": 1.0, "tf32": True}


def upgrade_keys(values: Mapping[str, Any]) -> Dict[str, Any]:
    """``values`` (field name -> value) with old names and old value spellings replaced.

    Old names are those of :data:`RENAMED_FIELDS`; old values those a field lists
    as ``value_aliases`` (``quat_source`` ``"both"`` -> ``"composed"``); each one
    read is a :class:`DeprecationWarning`. Every old name has one meaning in every
    configuration ever written, so no format version is needed.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     upgrade_keys({"beta_prior": 0.0, "quat_source": "both"})
        {'beta_prior_weight': 0.0, 'quat_source': 'composed'}

    Raises:
        ConfigError: a field given by its old and its new name.
    """
    out: Dict[str, Any] = {}
    for key, value in values.items():
        name = RENAMED_FIELDS.get(key, key)
        if name != key:
            if name in values:
                raise ConfigError(f"{key!r} is the old name of {name!r}; give only {name!r}")
            warnings.warn(f"{key!r} is the old name of {name!r}", DeprecationWarning,
                          stacklevel=3)
        out[name] = _spelled_today(name, value)
    return out


def _spelled_today(name: str, value: Any) -> Any:
    """``value`` of field ``name``, an old spelling of it replaced (``"both"``, with a
    :class:`DeprecationWarning`)."""
    aliases = _FIELDS[name].metadata["value_aliases"] if name in _FIELDS else {}
    if not isinstance(value, str) or value not in aliases:
        return value
    warnings.warn(f"{name}={value!r} is an old spelling of {aliases[value]!r}",
                  DeprecationWarning, stacklevel=4)
    return aliases[value]


def field_kind(name: str) -> Tuple[type, bool]:
    """``(type, optional)`` of a field, e.g. ``(float, True)`` for ``Optional[float]``."""
    return _fields.field_kind(_FIELDS[name])


def to_argv(values: Mapping[str, Any]) -> List[str]:
    """``qsv-train`` flags that set ``values`` (field name -> value; ``None`` is skipped).

    Example:
        >>> to_argv({"model": "qsv", "beta_init": 5.0, "frozen_beta": True})
        ['--model', 'qsv', '--beta-init', '5.0', '--frozen-beta']
    """
    return _fields.to_argv(_FIELDS, values)


def fields_with_role(role: str) -> Tuple[str, ...]:
    """Fields with ``role`` (:data:`RESUME`, :data:`TABLE`, :data:`SHARED`, :data:`ROW`).

    The runner's per-run fields (:data:`TABLE`) include every field a table row
    may switch: the ablations and the :data:`ROW` fields. In declaration order.
    """
    roles = {TABLE, ROW} if role == TABLE else {role}
    return tuple(name for name, f in _FIELDS.items() if roles & f.metadata["roles"]
                 or (role == TABLE and f.metadata["model_key"]))


def resume_overridable() -> FrozenSet[str]:
    """Fields that may differ from the checkpoint's when resuming."""
    return frozenset(fields_with_role(RESUME))


def ablation_fields() -> Dict[str, str]:
    """Ablation field -> the model keyword it sets (``frozen_beta`` is negated)."""
    return {name: f.metadata["model_key"] for name, f in _FIELDS.items()
            if f.metadata["model_key"]}


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _tuplify(value: Any) -> Any:
    # Model constructors document tuples (shell sizes, widths); JSON only has lists.
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


# ---------------------------------------------------------------------------- presets


def preset_config(name: str, **overrides: Any) -> TrainConfig:
    """The configuration of preset ``name`` with ``overrides`` applied.

    Args:
        name: a key of :data:`PRESETS`.
        **overrides: field values that win over the preset.

    Returns:
        A new :class:`TrainConfig` (not yet validated) with ``preset=name``.

    Raises:
        ConfigError: unknown preset or unknown field name.
    """
    if name not in PRESETS:
        known = sorted(PRESETS) + sorted(AUTO_PRESETS)
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(known)}")
    values = dict(PRESETS[name], preset=name)
    values.update(overrides)
    return TrainConfig().replace(**values)
