"""Registered graph models: QSV, its attention controls and the lattice control.

* ``qsv``: :class:`GraphNet` on Fibonacci shells with QSVConv.
* ``attention-gat`` / ``attention-gatv2`` / ``attention-transformer``: the same
  network with the conv swapped for PyG's ``GATConv`` / ``GATv2Conv`` /
  ``TransformerConv``; the widths are scaled so the parameter count is within
  ``match_tol`` (5%) of the QSV model built with the same shared overrides.

Heads: ``heads`` is QSV's head count (quaternions per node; default 16, the
paper's). A control has its own head count, ``control_heads`` (default
:data:`CONTROL_HEADS` = 4), and is matched to the QSV model of ``qsv_heads``
heads and ``qsv_widths`` widths (default: ``qsv``'s). A shared description of the
models of a comparison (:func:`model_overrides_for`, ``reproduce.py
--model-overrides``) gives QSV's ``heads``, which a control takes as its
``qsv_heads``. (``heads`` given to a control itself is the old spelling of
``control_heads``: still accepted, with a :class:`FutureWarning`.)
* ``lattice``: QSV on flat square grids with the same node counts and widths.

Overrides are validated by name: a typo raises :class:`TypeError` rather than
silently training the default model.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from ..geometry import (
    Hierarchy,
    LatticeSpec,
    ShellSpec,
    build_lattice_hierarchy,
    build_shell_hierarchy,
)
from .graph_net import (
    DEFAULT_HEADS,
    DEFAULT_WIDTHS,
    QSV_DEFAULTS,
    GraphNet,
    graph_net_default,
)
from .matching import count_parameters, match_width, scale_widths
from .registry import available_models, register_model

# Overrides every graph model takes (geometry knobs are added per model).
SHARED = ("k_cross", "k_inner", "heads", "patch_size", "image_size", "mlp_ratio",
          "within_rounds")
SHELL_KEYS = ("shell_sizes", "shell_radii")
LATTICE_KEYS = ("lattice_sides", )
QSV_KEYS = ("widths", "check_finite") + tuple(QSV_DEFAULTS)
#: Model keywords that no longer exist, with what to pass instead. ``beta_prior`` was
#: GraphNet's name of the prior's centre but the training configuration's (and
#: ``--beta-prior``'s) of its weight; it now has that one meaning, as an old name read
#: by the configuration only (``qsv_pyg.training.config.RENAMED_FIELDS``), so a
#: model refuses it rather than guess.
RETIRED_KEYWORDS = {
    "beta_prior": "pass beta_prior_centre (what a model's beta_prior set before issue 21: "
                  "the centre of the log-β prior) or beta_prior_weight (the prior's weight)",
}
CONTROL_KEYS = ("widths", "qsv_widths", "qsv_heads", "control_heads", "match_tol")
#: ``control_heads``: heads of the attention controls unless overridden, their own
#: setting from before QSV moved to the paper's 16 heads (16 heads of 4-8 channels
#: would be a choice against dot-product attention, which the matched comparison
#: must not make).
CONTROL_HEADS = 4
#: ``match_tol``: relative distance of a control's parameter count to its QSV reference.
MATCH_TOL = 0.05

# Overrides each family of graph models accepts.
_ACCEPTS = {
    "qsv": frozenset(SHARED + SHELL_KEYS + QSV_KEYS),
    "lattice": frozenset(SHARED + LATTICE_KEYS + QSV_KEYS),
    "attention": frozenset(SHARED + SHELL_KEYS + CONTROL_KEYS),
}
_GRAPH_KEYS = frozenset().union(*_ACCEPTS.values())


def _check_overrides(model: str, overrides: Dict[str, Any], accepted: Iterable[str]) -> None:
    accepted = tuple(accepted)
    unknown = sorted(set(overrides) - set(accepted))
    for key in unknown:
        if key in RETIRED_KEYWORDS:
            raise TypeError(f"{model}() got the retired keyword {key!r}: "
                            f"{RETIRED_KEYWORDS[key]}")
    if unknown:
        raise TypeError(f"{model}() got unexpected override(s) "
                        f"{', '.join(map(repr, unknown))}; accepted: num_classes, "
                        f"{', '.join(sorted(accepted))}")


def _freeze(value: Any) -> Any:
    """Lists (e.g. from a JSON/CLI override) become tuples, so overrides hash."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _default_radii(n: int) -> Tuple[float, ...]:
    # Evenly spaced from 1 inwards: (1.0, 0.8, 0.6, 0.4, 0.2) for five shells.
    return tuple((n - s) / n for s in range(n))


@functools.lru_cache(maxsize=32)
def _hierarchy(geometry: str, sizes: Tuple, radii: Tuple, k_cross: int,
               k_inner: int) -> Hierarchy:
    """Cached geometry: building a control solves its widths with many builds."""
    if geometry == "shells":
        spec = ShellSpec() if sizes is None else ShellSpec(
            sizes=sizes, radii=_default_radii(len(sizes)) if radii is None else radii)
        return build_shell_hierarchy(spec, k_cross=k_cross, k_inner=k_inner)
    spec = LatticeSpec() if sizes is None else LatticeSpec(sides=sizes)
    return build_lattice_hierarchy(spec, k_cross=k_cross, k_inner=k_inner)


def _split(overrides: Dict[str, Any], geometry: str) -> Tuple[Hierarchy, Dict[str, Any]]:
    """Pop the geometry overrides and return the (cached) hierarchy and the rest."""
    rest = {k: _freeze(v) for k, v in overrides.items()}
    if geometry == "shells":
        sizes, radii = rest.pop("shell_sizes", None), rest.pop("shell_radii", None)
        if sizes is None and radii is not None:
            raise ValueError("shell_radii needs shell_sizes")
    else:
        sizes, radii = rest.pop("lattice_sides", None), None
    hierarchy = _hierarchy(geometry, sizes, radii,
                           rest.pop("k_cross", graph_net_default("k_cross")),
                           rest.pop("k_inner", graph_net_default("k_inner")))
    return hierarchy, rest


def _graph_net(num_classes: int, geometry: str, **overrides) -> GraphNet:
    hierarchy, rest = _split(overrides, geometry)
    return GraphNet(num_classes, hierarchy=hierarchy, **rest)


@register_model("qsv")
def qsv(num_classes: int = 10, **overrides) -> GraphNet:
    """QSV on concentric Fibonacci shells (default ≈0.57M parameters).

    Overrides: ``shell_sizes``, ``shell_radii`` (default: evenly spaced from 1),
    ``k_cross``, ``k_inner``, ``heads``, ``patch_size``, ``image_size``,
    ``mlp_ratio``, ``within_rounds``, ``widths``, ``check_finite`` and every
    QSV-only :class:`GraphNet` argument (``routing``, ``transport``,
    ``quat_source``, ``frozen_field``, ``field_init``, ``field_per_head``,
    ``beta_init``, ``learn_beta``, ``beta_prior_centre``, ``beta_prior_weight``,
    ``repulsion_k``, ``repulsion_weight``, ``root_weight``).
    """
    _check_overrides("qsv", overrides, SHARED + SHELL_KEYS + QSV_KEYS)
    return _graph_net(num_classes, "shells", conv="qsv", **overrides)


@register_model("lattice")
def lattice(num_classes: int = 10, **overrides) -> GraphNet:
    """QSV on flat square grids (16-12-8-6-4 sides: the shells' node counts).

    Same widths and overrides as ``qsv``, with ``lattice_sides`` instead of the
    shell geometry. With equal node counts and widths the parameter count equals
    ``qsv``'s exactly; only the positions and the kNN graphs differ.
    """
    _check_overrides("lattice", overrides, SHARED + LATTICE_KEYS + QSV_KEYS)
    return _graph_net(num_classes, "lattice", conv="qsv", **overrides)


@functools.lru_cache(maxsize=64)
def _solve_widths(conv: str, num_classes: int, shared: Tuple[Tuple[str, Any], ...],
                  qsv_widths: Tuple[int, ...], qsv_heads: int,
                  tol: float) -> Tuple[Tuple[int, ...], int]:
    """Control widths matched to the QSV reference; memoised on the overrides.

    Returns:
        ``(widths, target)`` with ``target`` the reference QSV parameter count.
    """
    shared_kw = dict(shared)
    heads = shared_kw.pop("heads")
    target = count_parameters(_graph_net(num_classes, "shells", conv="qsv", widths=qsv_widths,
                                         heads=qsv_heads, **shared_kw))

    def build(scale: float) -> GraphNet:
        # Rounded to multiples of the heads only (what the convs need): QSV's
        # widths are multiples of 64 at 16 heads, far too coarse to match within 5%.
        widths = scale_widths(qsv_widths, scale, heads)
        return _graph_net(num_classes, "shells", conv=conv, widths=widths, heads=heads,
                          **shared_kw)

    model, _ = match_width(build, target, tol=tol)
    return model.widths, target


def _control(conv: str, name: str, num_classes: int, overrides: Dict[str, Any]) -> GraphNet:
    _check_overrides(name, overrides, SHARED + SHELL_KEYS + CONTROL_KEYS)
    overrides = {k: _freeze(v) for k, v in overrides.items()}
    if "widths" in overrides and "qsv_widths" in overrides:
        raise ValueError("pass either widths (used as given) or qsv_widths (matched)")
    if "heads" in overrides:
        overrides["control_heads"] = _old_control_heads(name, overrides.pop("heads"),
                                                        overrides.get("control_heads"))
    widths = overrides.pop("widths", None)
    qsv_widths = overrides.pop("qsv_widths", DEFAULT_WIDTHS)
    qsv_heads = overrides.pop("qsv_heads", DEFAULT_HEADS)
    tol = overrides.pop("match_tol", MATCH_TOL)
    # From here on, GraphNet's keywords: its heads are the control's own.
    overrides["heads"] = overrides.pop("control_heads", CONTROL_HEADS)
    if widths is None:
        # The reference is the QSV model (qsv_widths, qsv_heads) with the overrides
        # both models share.
        widths, _ = _solve_widths(conv, num_classes, tuple(sorted(overrides.items())),
                                  tuple(qsv_widths), int(qsv_heads), float(tol))
    return _graph_net(num_classes, "shells", conv=conv, widths=widths, **overrides)


def _old_control_heads(name: str, heads: Any, control_heads: Any) -> Any:
    """``heads`` given to a control: the old spelling of its ``control_heads``."""
    if control_heads is not None:
        raise ValueError(f"{name}: pass control_heads (its own heads) and qsv_heads (the QSV "
                         "reference's), not heads")
    warnings.warn(f"{name}(heads={heads!r}): a control's own head count is now "
                  f"control_heads={heads!r}; heads is QSV's head count (a control is matched "
                  "to the QSV model of qsv_heads heads)", FutureWarning, stacklevel=4)
    return heads


@register_model("attention-gat")
def attention_gat(num_classes: int = 10, **overrides) -> GraphNet:
    """QSV's network with ``GATConv``; parameters matched to ``qsv`` within 5%.

    Overrides: the shared ones of ``qsv`` but ``heads`` (geometry, k's, patch
    size, MLP ratio, within rounds) plus ``control_heads`` (its own heads, default
    :data:`CONTROL_HEADS` = 4), ``qsv_widths`` and ``qsv_heads`` (widths and
    heads of the QSV reference to match, default ``qsv``'s), ``match_tol``
    (default :data:`MATCH_TOL` = 0.05) or ``widths`` (use exactly these widths,
    no matching). ``heads`` is the old spelling of ``control_heads`` (a
    :class:`FutureWarning`): everywhere else it is QSV's head count.
    """
    return _control("gat", "attention-gat", num_classes, overrides)


@register_model("attention-gatv2")
def attention_gatv2(num_classes: int = 10, **overrides) -> GraphNet:
    """QSV's network with ``GATv2Conv``; see :func:`attention_gat`."""
    return _control("gatv2", "attention-gatv2", num_classes, overrides)


@register_model("attention-transformer")
def attention_transformer(num_classes: int = 10, **overrides) -> GraphNet:
    """QSV's network with ``TransformerConv``; see :func:`attention_gat`."""
    return _control("transformer", "attention-transformer", num_classes, overrides)


# ---------------------------------------------------------------------------- shared overrides


def model_overrides_for(model: str, overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """The keywords of ``model`` that one shared description of the graph models gives.

    A CPU-scale study shrinks every graph model the same way, but the models
    spell some sizes differently; the shared description is translated:

    * ``qsv``: used as given.
    * ``lattice``: ``shell_sizes`` become ``lattice_sides`` (square roots: a
      grid with the shells' node counts; the sizes must be perfect squares unless
      ``lattice_sides`` is given); ``shell_radii`` is dropped.
    * ``attention-*``: ``widths`` and ``heads`` (QSV's) become ``qsv_widths`` and
      ``qsv_heads``, so the control is parameter-matched to the QSV model of those
      widths and heads, as at full scale, with its own ``control_heads``
      (default :data:`CONTROL_HEADS`); QSV-only keywords (routing, field, β,
      repulsion) are dropped.
    * other models (``resnet20``): nothing of the shared part.

    A key equal to a model name holds a dict of keywords for that model only,
    applied last and as given (e.g. ``{"attention-gat": {"match_tol": 0.2}}``, or
    ``{"attention-gat": {"control_heads": 8}}`` for the control's own heads).

    Args:
        model: a registered model name.
        overrides: the shared description (e.g. ``--model-overrides`` of
            ``examples/reproduce.py``).

    Returns:
        The keyword arguments for ``build_model(model, ...)``.

    Raises:
        ValueError: a key no graph model accepts, a per-model entry that is not
            a dict, or shell sizes without square roots for the lattice.
    """
    models = set(available_models())
    common = {k: v for k, v in overrides.items() if k not in models}
    unknown = sorted(set(common) - _GRAPH_KEYS)
    if unknown:
        raise ValueError(
            f"--model-overrides: unknown key(s) {', '.join(map(repr, unknown))}; graph-model "
            f"keys: {', '.join(sorted(_GRAPH_KEYS))}; or a model name "
            f"({', '.join(sorted(models))}) mapping to that model's own keywords")
    for name in models & set(overrides):
        if not isinstance(overrides[name], dict):
            raise ValueError(f"--model-overrides: {name!r} must map to an object of "
                             f"keywords, got {overrides[name]!r}")
    nested = dict(overrides.get(model, {}))

    kind = "attention" if model.startswith("attention-") else model
    accepted = accepted_overrides(model)
    if accepted is None:
        return nested
    if kind == "lattice" and "shell_sizes" in common and "lattice_sides" not in common \
            and "lattice_sides" not in nested:
        common["lattice_sides"] = _square_sides(common["shell_sizes"])
    if kind == "attention" and "widths" in common and "qsv_widths" not in common:
        common["qsv_widths"] = common.pop("widths")
    if kind == "attention" and "heads" in common and "qsv_heads" not in common:
        common["qsv_heads"] = common.pop("heads")  # QSV's; the control keeps control_heads
    out = {k: v for k, v in common.items() if k in accepted}
    if kind == "attention" and "widths" in nested:
        out.pop("qsv_widths", None)  # explicit control widths: no matching
    out.update(nested)
    return out


def accepted_overrides(model: str) -> Optional[FrozenSet[str]]:
    """The overrides a registered graph model accepts (``None`` for another model).

    Example:
        >>> "repulsion_k" in accepted_overrides("lattice"), accepted_overrides("resnet20")
        (True, None)
    """
    return _ACCEPTS.get("attention" if model.startswith("attention-") else model)


def _square_sides(sizes: Any) -> List[int]:
    try:
        sides = [math.isqrt(int(n)) for n in sizes]
        ok = all(s * s == int(n) for s, n in zip(sides, sizes))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"--model-overrides: the lattice needs square node counts to mirror shell_sizes "
            f"{sizes!r}; add \"lattice\": {{\"lattice_sides\": [...]}} to --model-overrides")
    return sides
