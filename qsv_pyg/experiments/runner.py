"""Run a comparison table: every row × seed under one wall-clock budget, reusing finished runs.

Each run lives in ``<root>/<table>/<row-slug>/seed<k>`` and is an ordinary
``qsv-train`` run folder (``config.json``, ``log.jsonl``, ``checkpoint.pt``,
``metrics.json``) plus two files of the runner:

* ``runner.json``: the requested run (table, row, seed, training flags, the
  wall-clock budget) and one entry per launch (fresh or resumed, exit code).
* ``output.txt``: everything the training printed.

For every run the runner decides, before anything is trained:

* **reuse**: ``metrics.json`` exists and the saved configuration matches the
  requested one; nothing is recomputed.
* **resume**: a checkpoint but no ``metrics.json`` (an interrupted run). The
  resumed process gets the *rest* of the budget (budget minus the training time
  the checkpoint records), so every run gets the same total budget.
* **train**: nothing there yet (or only a ``config.json`` from a run that died
  before its first checkpoint).

"Matches" compares every :class:`~qsv_pyg.training.config.TrainConfig` field
except those that do not change what is computed (data folder, device, output
folder, progress bars, compile) and compares the budget through
``runner.json``. A run folder whose configuration differs stops the whole
table before any training (so a changed setting never silently reuses or
destroys results), unless ``overwrite=True`` deletes and retrains it.

Runs are launched in a subprocess (``python -m qsv_pyg.training.cli``) by
default: every run then starts from a fresh interpreter (no model, data or
allocator state leaks from one run into the next, a crash or out-of-memory kill
stays in its run, and Ctrl-C reaches the trainer, which checkpoints). The
``in-process`` launcher calls :func:`qsv_pyg.training.cli.main` directly; it
saves the interpreter start-up (a few seconds per run) and suits tiny runs and
tests.

Exit codes of :func:`main`: 0 every run finished, 1 some run failed (e.g. a
non-finite loss; the others still ran and the report marks it), 2 usage error,
130 interrupted (run the same command again to resume).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tqdm import tqdm

from qsv_pyg.models import available_models, build_model, zoo
from qsv_pyg.training import cli as train_cli
from qsv_pyg.training.checkpoint import CheckpointError, load_checkpoint
from qsv_pyg.training.config import ABLATION_FLAGS, ConfigError, TrainConfig
from qsv_pyg.training.run_files import CHECKPOINT_NAME, CONFIG_NAME, METRICS_NAME, write_json
from qsv_pyg.training.run_files import read_json as _read_json
from qsv_pyg.training.trainer import RESUME_OVERRIDABLE

from .tables import TABLES, Row, Table, get_table

__all__ = [
    "ExperimentError",
    "ExperimentInterrupted",
    "LAUNCHERS",
    "OUTPUT_NAME",
    "RUNNER_NAME",
    "RunResult",
    "RunSettings",
    "RunSpec",
    "build_parser",
    "config_differences",
    "launch_training",
    "main",
    "model_overrides_for",
    "plan_runs",
    "run_dir",
    "run_table",
]

RUNNER_NAME = "runner.json"
OUTPUT_NAME = "output.txt"
LAUNCHERS = ("subprocess", "in-process")

#: Config fields that may differ between a saved run and the request (where and
#: how the run executes, not what it computes). The budget is compared separately.
IGNORED_FIELDS = frozenset(RESUME_OVERRIDABLE)

#: A resumed run whose budget is used up still gets this much, so it can
#: evaluate and write its metrics.
_MIN_RESUME_MINUTES = 0.05

#: Flags the runner sets itself, per run; ``--train-args`` may not contain them.
_RESERVED_TRAIN_FIELDS = frozenset(
    {"model", "config", "list_presets", "out_dir", "seed", "time_budget", "resume",
     "progress", "model_args", "epochs", "batch_size", "lr", "subset", "test_subset",
     "device", "data_dir", "dataset"} | set(ABLATION_FLAGS))

# Overrides each graph model accepts (the zoo's own lists, so they stay in sync).
_ACCEPTS = {
    "qsv": frozenset(zoo.SHARED + zoo.SHELL_KEYS + zoo.QSV_KEYS),
    "lattice": frozenset(zoo.SHARED + zoo.LATTICE_KEYS + zoo.QSV_KEYS),
    "attention": frozenset(zoo.SHARED + zoo.SHELL_KEYS + zoo.CONTROL_KEYS),
}
_GRAPH_KEYS = frozenset().union(*_ACCEPTS.values())


class ExperimentError(RuntimeError):
    """A user error: bad options, a mismatched existing run, a rejected configuration."""


class ExperimentInterrupted(RuntimeError):
    """A run was interrupted (Ctrl-C / SIGTERM); running the table again resumes it."""


# ============================================================================ settings


@dataclass
class RunSettings:
    """Training settings shared by every run of a table.

    Attributes:
        budget_minutes: wall-clock budget of every run (``--time-budget``).
        data_dir: folder containing ``cifar-10-batches-py/`` (``None``: ``$QSV_DATA_DIR``).
        dataset: ``"cifar10"`` or ``"cifar100"``.
        epochs: planned epochs (``None``: the trainer's default). The budget may
            stop a run earlier.
        batch_size: training batch size (``None``: the trainer's default).
        lr: peak learning rate (``None``: the trainer's default).
        subset: train on a class-balanced subset of this many images.
        test_subset: evaluate on a class-balanced subset of this many images.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        model_overrides: model keywords for every graph model, translated per
            model by :func:`model_overrides_for`; a key naming a model (e.g.
            ``"resnet20"``) holds keywords for that model only.
        train_args: further ``qsv-train`` flags for every run (e.g.
            ``("--warmup-epochs", "1")``); flags the runner sets are refused.
    """

    budget_minutes: float
    data_dir: Optional[str] = None
    dataset: str = "cifar10"
    epochs: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    subset: Optional[int] = None
    test_subset: Optional[int] = None
    device: str = "auto"
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    train_args: Tuple[str, ...] = ()

    def location_flags(self) -> List[str]:
        """Flags that a resumed run may (and should) repeat: data folder and device."""
        out = ["--device", self.device, "--no-progress"]
        if self.data_dir is not None:
            out += ["--data-dir", str(self.data_dir)]
        return out

    def common_flags(self) -> List[str]:
        """Flags of a fresh run shared by every row, except model overrides."""
        out = ["--dataset", self.dataset, "--time-budget", _num(self.budget_minutes)]
        for flag, value in (("--epochs", self.epochs), ("--batch-size", self.batch_size),
                            ("--lr", self.lr), ("--subset", self.subset),
                            ("--test-subset", self.test_subset)):
            if value is not None:
                out += [flag, _num(value)]
        return out + self.location_flags() + list(self.train_args)


def _num(value: Any) -> str:
    # repr keeps floats exact through the command line (str would too, but be explicit).
    return repr(value) if isinstance(value, float) else str(value)


def model_overrides_for(model: str, overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """The model keywords that ``overrides`` (from ``--model-overrides``) give ``model``.

    A CPU-scale study shrinks every graph model the same way, but the models
    spell some sizes differently; the shared description is translated:

    * ``qsv``: used as given.
    * ``lattice``: ``shell_sizes`` become ``lattice_sides`` (square roots: a
      grid with the shells' node counts; the sizes must be perfect squares unless
      ``lattice_sides`` is given); ``shell_radii`` is dropped.
    * ``attention-*``: ``widths`` and ``heads`` become ``qsv_widths`` and
      ``qsv_heads``, so the control is parameter-matched to the QSV model of those
      widths and heads, as at full scale, with its own head count;
      QSV-only keywords (routing, field, β, repulsion) are dropped.
    * other models (``resnet20``): nothing of the shared part.

    A key equal to a model name holds a dict of keywords for that model only,
    applied last and as given (e.g. ``{"attention-gat": {"match_tol": 0.2}}``).

    Raises:
        ExperimentError: a key no graph model accepts, a per-model entry that is
            not a dict, or shell sizes without square roots for the lattice.
    """
    models = set(available_models())
    common = {k: v for k, v in overrides.items() if k not in models}
    unknown = sorted(set(common) - _GRAPH_KEYS)
    if unknown:
        raise ExperimentError(
            f"--model-overrides: unknown key(s) {', '.join(map(repr, unknown))}; graph-model "
            f"keys: {', '.join(sorted(_GRAPH_KEYS))}; or a model name "
            f"({', '.join(sorted(models))}) mapping to that model's own keywords")
    for name in models & set(overrides):
        if not isinstance(overrides[name], dict):
            raise ExperimentError(f"--model-overrides: {name!r} must map to an object of "
                                  f"keywords, got {overrides[name]!r}")
    nested = dict(overrides.get(model, {}))

    kind = "attention" if model.startswith("attention-") else model
    accepted = _ACCEPTS.get(kind)
    if accepted is None:
        return nested
    common = dict(common)
    if kind == "lattice" and "shell_sizes" in common and "lattice_sides" not in common \
            and "lattice_sides" not in nested:
        common["lattice_sides"] = _square_sides(common["shell_sizes"])
    if kind == "attention" and "widths" in common and "qsv_widths" not in common:
        common["qsv_widths"] = common.pop("widths")
    if kind == "attention" and "heads" in common and "qsv_heads" not in common:
        common["qsv_heads"] = common.pop("heads")  # the controls keep their own heads
    out = {k: v for k, v in common.items() if k in accepted}
    if kind == "attention" and "widths" in nested:
        out.pop("qsv_widths", None)  # explicit control widths: no matching
    out.update(nested)
    return out


def _square_sides(sizes: Any) -> List[int]:
    try:
        sides = [math.isqrt(int(n)) for n in sizes]
        ok = all(s * s == int(n) for s, n in zip(sides, sizes))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ExperimentError(
            f"--model-overrides: the lattice needs square node counts to mirror shell_sizes "
            f"{sizes!r}; add \"lattice\": {{\"lattice_sides\": [...]}} to --model-overrides")
    return sides


# ============================================================================ planning


@dataclass
class RunSpec:
    """One run of a table: a row, a seed, its folder and its fresh-run flags.

    Attributes:
        table: table name.
        row: the table row.
        seed: training seed.
        out_dir: the run folder.
        argv: ``qsv-train`` arguments of a fresh run.
        config: the configuration those arguments produce.
    """

    table: str
    row: Row
    seed: int
    out_dir: Path
    argv: List[str]
    config: TrainConfig

    @property
    def name(self) -> str:
        """``"<row-slug>/seed<k>"``."""
        return f"{self.row.slug}/seed{self.seed}"


@dataclass
class RunResult:
    """Outcome of one run.

    Attributes:
        spec: the run.
        status: ``"reused"``, ``"trained"``, ``"resumed"`` or ``"failed"``.
        metrics: contents of ``metrics.json`` (``None`` when failed).
        message: for failures, the reason and the end of the training output.
    """

    spec: RunSpec
    status: str
    metrics: Optional[Dict[str, Any]] = None
    message: str = ""

    def summary(self) -> str:
        """One line, e.g. ``"trained: test acc 41.20% after 3/100 epochs"``."""
        if self.metrics is None:
            return f"{self.status}: {self.message.splitlines()[0] if self.message else ''}"
        m = self.metrics
        early = " (budget)" if m.get("stopped_early") else ""
        return (f"{self.status}: test acc {100 * m['test_acc']:.2f}% after "
                f"{m.get('epochs')}/{m.get('epochs_planned')} epochs{early}")


def run_dir(root: "str | os.PathLike[str]", table: str, slug: str, seed: int) -> Path:
    """The folder of one run: ``<root>/<table>/<slug>/seed<seed>``."""
    return Path(root) / table / slug / f"seed{seed}"


def requested_config(argv: Sequence[str]) -> TrainConfig:
    """The :class:`TrainConfig` that ``qsv-train argv`` would train (nothing is run).

    Raises:
        ExperimentError: the trainer rejects the flags (its message included).
    """
    parser = train_cli.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(list(argv))
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise ExperimentError(f"invalid training flags {shlex.join(argv)}: "
                              f"{lines[-1] if lines else 'rejected'}") from None
    explicit = vars(args)
    explicit.pop("list_presets", None)
    try:
        cfg, _ = train_cli.config_from_args(explicit)
    except ConfigError as exc:
        raise ExperimentError(str(exc)) from None
    return cfg


def _model_arg_flags(overrides: Mapping[str, Any]) -> List[str]:
    out: List[str] = []
    for key, value in overrides.items():
        out += ["--model-arg", f"{key}={json.dumps(value)}"]
    return out


def plan_runs(table: Table, seeds: Sequence[int], root: "str | os.PathLike[str]",
              settings: RunSettings, rows: Optional[Sequence[str]] = None,
              validate_models: bool = True) -> List[RunSpec]:
    """Every run of ``table`` (rows × seeds), with flags and configurations checked.

    Args:
        table: the table.
        seeds: training seeds (each row runs once per seed).
        root: output root; runs go to :func:`run_dir`.
        settings: shared training settings.
        rows: row slugs to run (``None``: all), reported in table order.
        validate_models: build every distinct model once on the CPU, so a bad
            override fails now rather than after hours of other runs.

    Raises:
        ExperimentError: unknown rows, bad seeds, flags or model overrides.
    """
    try:
        selected = table.select(rows)
    except KeyError as exc:
        raise ExperimentError(exc.args[0]) from None
    seeds = list(dict.fromkeys(seeds))
    if not seeds:
        raise ExperimentError("give at least one seed")
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise ExperimentError(f"seeds must be non-negative integers; got {bad}")
    if not (isinstance(settings.budget_minutes, (int, float))
            and math.isfinite(settings.budget_minutes) and settings.budget_minutes > 0):
        raise ExperimentError(f"--budget-minutes must be a positive number of minutes; "
                              f"got {settings.budget_minutes!r}")
    # Absolute run folders: a subprocess or a later resume may run from another directory.
    root = Path(root).expanduser().absolute()
    specs: List[RunSpec] = []
    built: Dict[str, None] = {}
    for row in selected:
        overrides = model_overrides_for(row.model, settings.model_overrides)
        for seed in seeds:
            out_dir = run_dir(root, table.name, row.slug, seed)
            argv = (["--model", row.model, "--seed", str(seed), "--out-dir", str(out_dir)]
                    + settings.common_flags() + row.flags() + _model_arg_flags(overrides))
            try:
                cfg = requested_config(argv)
            except ExperimentError as exc:
                raise ExperimentError(f"row {row.slug!r}: {exc}") from None
            specs.append(RunSpec(table.name, row, seed, out_dir, argv, cfg))
            key = json.dumps([cfg.model, cfg.dataset, cfg.model_args, row.flags()],
                             sort_keys=True)
            if validate_models and key not in built:
                _check_model(row, cfg)
                built[key] = None
    return specs


def _check_model(row: Row, cfg: TrainConfig) -> None:
    num_classes = 100 if cfg.dataset == "cifar100" else 10
    try:
        build_model(cfg.model, num_classes, **cfg.model_overrides())
    except (TypeError, ValueError) as exc:
        raise ExperimentError(f"row {row.slug!r} ({row.label}): cannot build {cfg.model!r} "
                              f"with {cfg.model_overrides()}: {exc}") from None


# ============================================================================ decisions




def config_differences(requested: TrainConfig, saved: Mapping[str, Any],
                       saved_budget: Any) -> List[str]:
    """Fields in which a saved run differs from the request (empty: it matches).

    Args:
        requested: the configuration the runner would train now.
        saved: the run's ``config.json``.
        saved_budget: the budget the run was started with (``runner.json``),
            compared with ``requested.time_budget``.

    Returns:
        ``"field: saved X, requested Y"`` strings.
    """
    want = requested.to_dict()
    defaults = TrainConfig().to_dict()
    diffs = []
    for key in sorted(set(want) | set(saved)):
        if key in IGNORED_FIELDS:
            continue
        # A field missing on either side (another trainer version) counts as its default.
        mine, theirs = want.get(key, defaults.get(key)), saved.get(key, defaults.get(key))
        if mine != theirs:
            diffs.append(f"{key}: saved {theirs!r}, requested {mine!r}")
    if saved_budget != requested.time_budget:
        diffs.append(f"time_budget: saved {saved_budget!r}, requested {requested.time_budget!r}")
    return diffs


def _decide(spec: RunSpec) -> Tuple[str, List[str]]:
    """``("train" | "resume" | "reuse", differences)`` for an existing or new run folder."""
    out = spec.out_dir
    has_metrics = (out / METRICS_NAME).is_file()
    has_ckpt = (out / CHECKPOINT_NAME).is_file()
    if not (has_metrics or has_ckpt):
        # Nothing worth keeping (at most the files of a run that died before its
        # first checkpoint): the trainer starts afresh in the same folder.
        return "train", []
    saved = _read_json(out / CONFIG_NAME)
    if saved is None:
        return "train", [f"{CONFIG_NAME} is missing or unreadable"]
    record = _read_json(out / RUNNER_NAME) or {}
    budget = record.get("time_budget", saved.get("time_budget"))
    diffs = config_differences(spec.config, saved, budget)
    if diffs:
        return "train", diffs
    return ("reuse" if has_metrics else "resume"), []


def _used_minutes(checkpoint: Path) -> float:
    """Budget used by a run so far: its budget clock's count when the checkpoint has
    one (process CPU time for ``--budget-clock process``), else the training time of
    its finished epochs plus the partial one."""
    state = load_checkpoint(checkpoint, map_location="cpu")
    if "budget_used_s" in state:  # measured on the run's own budget clock
        return float(state["budget_used_s"]) / 60.0
    used = float(state.get("total_seconds") or 0.0)
    partial = state.get("partial") or []
    if partial:
        used += float(partial[0].get("train_seconds", 0.0))
    return used / 60.0


# ============================================================================ launching


def launch_training(argv: Sequence[str], out_dir: Path, launcher: str = "subprocess") -> int:
    """Run ``qsv-train argv`` with its output appended to ``out_dir/output.txt``.

    Args:
        argv: ``qsv-train`` arguments.
        out_dir: the run folder (created).
        launcher: ``"subprocess"`` or ``"in-process"`` (see the module docstring).

    Returns:
        The trainer's exit code (0 done, 1 failed, 2 usage error, 130 interrupted).
    """
    if launcher not in LAUNCHERS:
        raise ExperimentError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / OUTPUT_NAME, "a", encoding="utf-8") as log:
        log.write(f"# {datetime.now():%Y-%m-%d %H:%M:%S} qsv-train {shlex.join(argv)}\n")
        log.flush()
        if launcher == "subprocess":
            return _run_subprocess(argv, log)
        return _run_in_process(argv, log)


def _run_subprocess(argv: Sequence[str], log) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The child imports this very checkout even when the package is not installed.
    source_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "qsv_pyg.training.cli", *argv],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The child got the same Ctrl-C and is writing its checkpoint: let it finish.
        try:
            proc.wait(timeout=300)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        return 130


def _run_in_process(argv: Sequence[str], log) -> int:
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            return train_cli.main(list(argv))
        except KeyboardInterrupt:
            return 130
        except Exception:  # a crash of one run must not take the table down
            traceback.print_exc()
            return 1


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _record_launch(spec: RunSpec, action: str, argv: Sequence[str], launcher: str,
                   rc: Optional[int], started: float) -> None:
    path = spec.out_dir / RUNNER_NAME
    record = _read_json(path) or {}
    record.update({
        "table": spec.table, "row": spec.row.slug, "label": spec.row.label,
        "model": spec.row.model, "switches": dict(spec.row.switches), "seed": spec.seed,
        "time_budget": spec.config.time_budget, "argv": list(spec.argv),
    })
    launches = record.setdefault("launches", [])
    entry = {"action": action, "argv": list(argv), "launcher": launcher,
             "started": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
             "exit_code": rc}
    if rc is not None and launches and launches[-1].get("exit_code") is None:
        entry["wall_seconds"] = round(time.time() - started, 3)
        launches[-1] = entry  # completes the entry written before the launch
    else:
        launches.append(entry)
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, record)


def _execute(spec: RunSpec, action: str, settings: RunSettings, launcher: str) -> RunResult:
    metrics_path = spec.out_dir / METRICS_NAME
    if action == "reuse":
        return RunResult(spec, "reused", _read_json(metrics_path))
    if action == "retrain":
        shutil.rmtree(spec.out_dir)
    if action == "resume":
        try:
            used = _used_minutes(spec.out_dir / CHECKPOINT_NAME)
        except (CheckpointError, OSError, KeyError, TypeError, ValueError) as exc:
            raise ExperimentError(f"{spec.name}: cannot read its checkpoint to resume ({exc}); "
                                  "rerun with --overwrite to start it again") from None
        remaining = max(spec.config.time_budget - used, _MIN_RESUME_MINUTES)
        argv = (["--resume", "--out-dir", str(spec.out_dir),
                 "--time-budget", _num(round(remaining, 4))] + settings.location_flags())
    else:
        argv = list(spec.argv)
    started = time.time()
    _record_launch(spec, action, argv, launcher, None, started)
    rc = launch_training(argv, spec.out_dir, launcher)
    _record_launch(spec, action, argv, launcher, rc, started)
    output = spec.out_dir / OUTPUT_NAME
    if rc == 130:
        raise ExperimentInterrupted(f"{spec.name} was interrupted; run the same command again "
                                    "to resume it")
    if rc == 2:
        raise ExperimentError(f"{spec.name}: the trainer rejected the run (exit 2); last output "
                              f"in {output}:\n{_tail(output)}")
    metrics = _read_json(metrics_path) if rc == 0 else None
    if metrics is None:
        why = f"exit code {rc}" if rc else f"no readable {METRICS_NAME}"
        return RunResult(spec, "failed", None, f"{why}; last output in {output}:\n{_tail(output)}")
    return RunResult(spec, "resumed" if action == "resume" else "trained", metrics)


def run_table(table: Table, seeds: Sequence[int], root: "str | os.PathLike[str]",
              settings: RunSettings, *, rows: Optional[Sequence[str]] = None,
              launcher: str = "subprocess", overwrite: bool = False,
              progress: bool = True, validate_models: bool = True) -> List[RunResult]:
    """Train (or reuse, or resume) every run of ``table``.

    Args:
        table: the table.
        seeds: training seeds.
        root: output root.
        settings: shared training settings (same budget for every run).
        rows: row slugs to run (``None``: all).
        launcher: ``"subprocess"`` (default) or ``"in-process"``.
        overwrite: delete and retrain runs whose saved configuration differs
            from the request, instead of stopping with an error.
        progress: show a progress bar over the runs.
        validate_models: see :func:`plan_runs`.

    Returns:
        One :class:`RunResult` per run, in table order then seed order.

    Raises:
        ExperimentError: bad settings, mismatched existing runs, or a run the
            trainer rejects as a usage error.
        ExperimentInterrupted: a run was interrupted (its checkpoint is kept).
    """
    if launcher not in LAUNCHERS:
        raise ExperimentError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    specs = plan_runs(table, seeds, root, settings, rows, validate_models=validate_models)
    plan, conflicts = [], []
    for spec in specs:
        action, diffs = _decide(spec)
        if diffs:
            if not overwrite:
                conflicts.append(f"  {spec.out_dir}: " + "; ".join(diffs))
            action = "retrain"
        plan.append((spec, action))
    if conflicts:
        raise ExperimentError(
            "existing run folder(s) hold a different configuration:\n" + "\n".join(conflicts)
            + "\nuse another --out-root, or --overwrite to delete and retrain them")

    results: List[RunResult] = []
    with tqdm(total=len(plan), desc=table.name, unit="run", disable=not progress,
              dynamic_ncols=True, file=sys.stderr) as bar:
        for spec, action in plan:
            bar.set_postfix_str(f"{spec.name} ({action})")
            result = _execute(spec, action, settings, launcher)
            results.append(result)
            bar.write(f"{spec.name}: {result.summary()}", file=sys.stdout)
            bar.update()
    return results


# ============================================================================ command line


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f"'{{\"widths\": [32, 32]}}', got {text!r}")
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "number" if kind is float else "integer"
            raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    return parse


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``examples/reproduce.py``."""
    rows = "; ".join(f"{t.name}: {', '.join(t.slugs)}" for t in TABLES.values())
    p = argparse.ArgumentParser(
        prog="reproduce.py",
        description="Train every row × seed of a paper table under one wall-clock budget, "
                    "then write table.md/.csv, results.json, accuracy.png and beta_probe.png.",
        epilog=f"Rows: {rows}. Exit codes: 0 done, 1 some run failed, 2 usage error, "
               "130 interrupted (run again to resume).")
    p.add_argument("--table", required=True, choices=sorted(TABLES), help="which table")
    p.add_argument("--rows", nargs="+", metavar="SLUG", help="only these rows (default: all)")
    p.add_argument("--seeds", nargs="+", type=_seed, metavar="K",
                   help="training seeds (default: 0; with --report-only: every seed on disk)")
    p.add_argument("--out-root", default="runs/reproduce", metavar="DIR",
                   help="runs go to DIR/<table>/<row>/seed<k> (default: runs/reproduce)")
    p.add_argument("--report-only", action="store_true",
                   help="only write the report from the runs on disk (training flags are ignored)")

    g = p.add_argument_group("training (the same for every run)")
    g.add_argument("--data-dir", metavar="DIR",
                   help="folder containing cifar-10-batches-py/ (default: $QSV_DATA_DIR)")
    g.add_argument("--dataset", default="cifar10", choices=("cifar10", "cifar100"),
                   help="dataset (the paper column is CIFAR-10; default: cifar10)")
    g.add_argument("--budget-minutes", type=_positive(float), metavar="M",
                   help="wall-clock budget of every run, in minutes (required to train)")
    g.add_argument("--epochs", type=_positive(int), metavar="E",
                   help="planned epochs (default: the trainer's)")
    g.add_argument("--batch-size", type=_positive(int), metavar="B")
    g.add_argument("--lr", type=_positive(float), metavar="LR")
    g.add_argument("--subset", type=_positive(int), metavar="N",
                   help="class-balanced subset of N training images")
    g.add_argument("--test-subset", type=_positive(int), metavar="M",
                   help="class-balanced subset of M test images")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    g.add_argument("--model-overrides", type=_json_object, default={}, metavar="JSON",
                   help="model keywords for every graph model, e.g. '{\"shell_sizes\": [64, 16], "
                        "\"widths\": [32, 32], \"heads\": 2}'; a model-name key holds keywords "
                        "for that model only, e.g. '{\"attention-gat\": {\"match_tol\": 0.2}}'")
    g.add_argument("--train-args", default="", metavar="'FLAGS'",
                   help="further qsv-train flags for every run, e.g. "
                        "'--warmup-epochs 1 --amp bf16' (a lone flag needs the = form: "
                        "--train-args=--compile)")

    g = p.add_argument_group("runner")
    g.add_argument("--launcher", choices=LAUNCHERS, default="subprocess",
                   help="run each training in a fresh subprocess (default) or in this process")
    g.add_argument("--overwrite", action="store_true",
                   help="delete and retrain runs whose saved configuration differs")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bar over the runs (default: on)")
    return p


def _train_args(text: str) -> Tuple[str, ...]:
    """Split and check ``--train-args``: valid trainer flags, none the runner sets."""
    try:
        args = tuple(shlex.split(text))
    except ValueError as exc:
        raise ExperimentError(f"--train-args: {exc}") from None
    if not args:
        return ()
    parser = train_cli.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            given = vars(parser.parse_args(["--model", "qsv", *args]))
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise ExperimentError(f"--train-args {text!r}: "
                              f"{lines[-1] if lines else 'rejected by qsv-train'}") from None
    given.pop("model")
    reserved = sorted(_RESERVED_TRAIN_FIELDS & set(given))
    if reserved:
        names = ", ".join("--" + k.replace("_", "-") for k in reserved)
        raise ExperimentError(f"--train-args may not contain {names}: the runner sets these "
                              "itself (use its own options, or the table rows for ablations)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``examples/reproduce.py``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed usage and the error
        return exc.code if isinstance(exc.code, int) else 2
    from . import report  # matplotlib is only needed once there is something to report

    table = get_table(args.table)
    try:
        rows = [r.slug for r in table.select(args.rows)]
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    try:
        if args.report_only:
            paths = report.write_report(table, args.out_root, rows=rows, seeds=args.seeds)
            print(f"report: {paths['table.md'].parent}")
            return 0
        if args.budget_minutes is None:
            raise ExperimentError("--budget-minutes is required to train (or pass --report-only)")
        data_dir = args.data_dir or os.environ.get("QSV_DATA_DIR")
        if not data_dir:
            raise ExperimentError("--data-dir is required (or set $QSV_DATA_DIR)")
        if not Path(data_dir).expanduser().is_dir():
            raise ExperimentError(f"--data-dir {data_dir}: no such folder")
        settings = RunSettings(
            budget_minutes=args.budget_minutes,
            data_dir=str(Path(data_dir).expanduser().resolve()), dataset=args.dataset,
            epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, subset=args.subset,
            test_subset=args.test_subset, device=args.device,
            model_overrides=args.model_overrides, train_args=_train_args(args.train_args))
        seeds = args.seeds if args.seeds is not None else [0]
        results = run_table(table, seeds, args.out_root, settings, rows=rows,
                            launcher=args.launcher, overwrite=args.overwrite,
                            progress=args.progress)
        paths = report.write_report(table, args.out_root, rows=rows, seeds=seeds)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ExperimentInterrupted as exc:
        print(str(exc), file=sys.stderr)
        return 130
    failed = [r for r in results if r.status == "failed"]
    counts = {s: sum(r.status == s for r in results)
              for s in ("trained", "resumed", "reused", "failed")}
    print(f"{table.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f"; report in {paths['table.md'].parent}")
    for r in failed:
        print(f"failed: {r.spec.name}: {r.message}", file=sys.stderr)
    return 1 if failed else 0
