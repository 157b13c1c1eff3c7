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

Each run is launched by :mod:`~qsv_pyg.experiments.launch` (a fresh
interpreter by default); the command line is :mod:`~qsv_pyg.experiments.cli`.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tqdm import tqdm

from qsv_pyg.models import build_model, zoo
from qsv_pyg.training import cli as train_cli
from qsv_pyg.training.checkpoint import CheckpointError, load_checkpoint
from qsv_pyg.training.config import ConfigError, TrainConfig, resume_overridable, to_argv
from qsv_pyg.training.config import upgrade_keys
from qsv_pyg.training.run_files import CHECKPOINT_NAME, CONFIG_NAME, METRICS_NAME, write_json
from qsv_pyg.training.run_files import LOCK_NAME, RunFolderError
from qsv_pyg.training.run_files import read_json as _read_json
from qsv_pyg.training.run_lock import RunLock, live_holder

from .launch import LAUNCHERS, OUTPUT_NAME, launch_training, tail
from .side_by_side import run_side_by_side
from .tables import Row, Table

__all__ = [
    "ExperimentError",
    "ExperimentInterrupted",
    "LAUNCHERS",
    "OUTPUT_NAME",
    "RUNNER_NAME",
    "RunResult",
    "RunSettings",
    "RunSpec",
    "config_differences",
    "plan_runs",
    "run_dir",
    "run_table",
]

RUNNER_NAME = "runner.json"

#: A resumed run whose budget is used up still gets this much, so it can
#: evaluate and write its metrics.
_MIN_RESUME_MINUTES = 0.05


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
            model by :func:`qsv_pyg.models.zoo.model_overrides_for`; a key naming a model (e.g.
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

    def location(self) -> Dict[str, Any]:
        """Fields that a resumed run may (and should) repeat: device, data folder, no bars."""
        return {"device": self.device, "progress": False, "data_dir": self.data_dir}

    def fields(self) -> Dict[str, Any]:
        """Configuration fields of a fresh run shared by every row, except model overrides.

        Raises:
            ExperimentError: ``train_args`` that ``qsv-train`` rejects.
        """
        out = {"dataset": self.dataset, "time_budget": float(self.budget_minutes),
               "epochs": self.epochs, "batch_size": self.batch_size,
               "lr": None if self.lr is None else float(self.lr), "subset": self.subset,
               "test_subset": self.test_subset, **self.location()}
        try:
            given = train_cli.parse_fields(self.train_args)
        except ConfigError as exc:
            raise ExperimentError(f"invalid training flags {shlex.join(self.train_args)}: "
                                  f"{exc}") from None
        return {**{k: v for k, v in out.items() if v is not None}, **given}


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


def plan_runs(table: Table, seeds: Optional[Sequence[int]], root: "str | os.PathLike[str]",
              settings: RunSettings, rows: Optional[Sequence[str]] = None,
              validate_models: bool = True) -> List[RunSpec]:
    """Every run of ``table`` (rows × seeds), with flags and configurations checked.

    Args:
        table: the table.
        seeds: training seeds (each row runs once per seed); ``None``: the table's
            own plan (:meth:`~qsv_pyg.experiments.tables.Table.seeds_of` per row).
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
    if seeds is not None:
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
    shared = settings.fields()
    specs: List[RunSpec] = []
    built: Dict[str, None] = {}
    for row in selected:
        try:
            overrides = zoo.model_overrides_for(row.model, settings.model_overrides)
        except ValueError as exc:
            raise ExperimentError(str(exc)) from None
        for seed in (table.seeds_of(row.slug) if seeds is None else seeds):
            out_dir = run_dir(root, table.name, row.slug, seed)
            values = {"model": row.model, "seed": seed, "out_dir": str(out_dir), **shared,
                      **dict(row.switches), "model_args": dict(overrides)}
            try:
                cfg = TrainConfig().replace(**values).validate()
            except ConfigError as exc:
                raise ExperimentError(f"row {row.slug!r}: {exc}") from None
            specs.append(RunSpec(table.name, row, seed, out_dir, to_argv(values), cfg))
            key = json.dumps([cfg.model, cfg.dataset, cfg.model_args, row.flags()],
                             sort_keys=True)
            if validate_models and key not in built:
                _check_model(row, cfg)
                built[key] = None
    return specs


def _check_model(row: Row, cfg: TrainConfig) -> None:
    try:
        build_model(cfg.model, cfg.num_classes, **cfg.model_overrides())
    except (TypeError, ValueError) as exc:
        raise ExperimentError(f"row {row.slug!r} ({row.label}): cannot build {cfg.model!r} "
                              f"with {cfg.model_overrides()}: {exc}") from None


# ============================================================================ decisions


def config_differences(requested: TrainConfig, saved: Mapping[str, Any],
                       saved_budget: Any) -> List[str]:
    """Fields in which a saved run differs from the request (empty: it matches).

    Args:
        requested: the configuration the runner would train now.
        saved: the run's ``config.json`` (old field names count as today's fields).
        saved_budget: the budget the run was started with (``runner.json``),
            compared with ``requested.time_budget``.

    Returns:
        ``"field: saved X, requested Y"`` strings.
    """
    want = requested.to_dict()
    try:
        saved = upgrade_keys(saved)
    except ConfigError as exc:
        return [str(exc)]
    defaults = TrainConfig().to_dict()
    # Where and how a run executes may differ, not what it computes; the budget
    # is compared through runner.json below.
    ignored = resume_overridable()
    diffs = []
    for key in sorted(set(want) | set(saved)):
        if key in ignored:
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


# ============================================================================ running


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


def _in_use(out_dir: Path, holder: str) -> ExperimentError:
    return ExperimentError(f"--overwrite would delete {out_dir}, but a live run holds it "
                           f"({holder}, lock file {out_dir / LOCK_NAME}); nothing was "
                           "deleted: wait for that run to finish or stop it")


def _remove_run_folder(out_dir: Path) -> None:
    """Delete a run folder for ``--overwrite``, holding its run lock meanwhile, so a
    run that holds it (started since the plan was checked) keeps its folder."""
    try:
        lock = RunLock(out_dir).acquire()
    except RunFolderError as exc:
        holder = live_holder(out_dir)
        if holder is None:  # not busy: the lock file cannot be written
            raise ExperimentError(f"--overwrite cannot delete {out_dir}: {exc}") from None
        raise _in_use(out_dir, holder) from None
    try:
        shutil.rmtree(out_dir)
    finally:
        lock.release()


def _execute(spec: RunSpec, action: str, settings: RunSettings, launcher: str) -> RunResult:
    metrics_path = spec.out_dir / METRICS_NAME
    if action == "reuse":
        return RunResult(spec, "reused", _read_json(metrics_path))
    if action == "retrain":
        _remove_run_folder(spec.out_dir)
    if action == "resume":
        try:
            used = _used_minutes(spec.out_dir / CHECKPOINT_NAME)
        except (CheckpointError, OSError, KeyError, TypeError, ValueError) as exc:
            raise ExperimentError(f"{spec.name}: cannot read its checkpoint to resume ({exc}); "
                                  "rerun with --overwrite to start it again") from None
        remaining = max(spec.config.time_budget - used, _MIN_RESUME_MINUTES)
        argv = ["--resume", *to_argv({"out_dir": str(spec.out_dir),
                                      "time_budget": round(remaining, 4), **settings.location()})]
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
                              f"in {output}:\n{tail(output)}")
    metrics = _read_json(metrics_path) if rc == 0 else None
    if metrics is None:
        why = f"exit code {rc}" if rc else f"no readable {METRICS_NAME}"
        return RunResult(spec, "failed", None, f"{why}; last output in {output}:\n{tail(output)}")
    return RunResult(spec, "resumed" if action == "resume" else "trained", metrics)


def run_table(table: Table, seeds: Optional[Sequence[int]], root: "str | os.PathLike[str]",
              settings: RunSettings, *, rows: Optional[Sequence[str]] = None,
              launcher: str = "subprocess", overwrite: bool = False,
              progress: bool = True, validate_models: bool = True,
              jobs: int = 1) -> List[RunResult]:
    """Train (or reuse, or resume) every run of ``table``.

    Args:
        table: the table.
        seeds: training seeds (``None``: the table's own plan, see :func:`plan_runs`).
        root: output root.
        settings: shared training settings (same budget for every run).
        rows: row slugs to run (``None``: all).
        launcher: ``"subprocess"`` (default) or ``"in-process"``.
        overwrite: delete and retrain runs whose saved configuration differs
            from the request, instead of stopping with an error.
        progress: show a progress bar over the runs.
        validate_models: see :func:`plan_runs`.
        jobs: how many runs train side by side (each in its own subprocess, in
            plan order); more than one needs the ``"subprocess"`` launcher.

    Returns:
        One :class:`RunResult` per run, in table order then seed order.

    Raises:
        ExperimentError: bad settings, mismatched existing runs, or a run the
            trainer rejects as a usage error. With ``jobs > 1`` the runs already
            started finish first; none is started after the error.
        ExperimentInterrupted: a run was interrupted (its checkpoint is kept).
    """
    if launcher not in LAUNCHERS:
        raise ExperimentError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ExperimentError(f"--jobs must be a positive integer; got {jobs!r}")
    if jobs > 1 and launcher != "subprocess":
        raise ExperimentError("--jobs above 1 needs the subprocess launcher: in-process runs "
                              "share this interpreter's output streams and threads")
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
    # --overwrite never deletes the folder of a live run (issue 28, item 8): checked for
    # every folder before anything starts, and again under the lock when it is deleted.
    for spec, action in plan:
        holder = live_holder(spec.out_dir) if action == "retrain" else None
        if holder is not None:
            raise _in_use(spec.out_dir, holder)

    with tqdm(total=len(plan), desc=table.name, unit="run", disable=not progress,
              dynamic_ncols=True, file=sys.stderr) as bar:

        def report(spec: RunSpec, result: RunResult) -> None:
            bar.write(f"{spec.name}: {result.summary()}", file=sys.stdout)
            bar.update()

        if jobs > 1:
            return run_side_by_side(
                lambda item: _execute(*item, settings, launcher), plan, jobs,
                stop_on=(ExperimentError, ExperimentInterrupted),
                on_result=lambda item, result: report(item[0], result),
                interrupted=lambda: ExperimentInterrupted(
                    "interrupted; run the same command again to resume the unfinished runs"))
        # One at a time in this thread: the in-process launcher installs the trainer's
        # signal handlers, which only the main thread may do.
        results: List[RunResult] = []
        for spec, action in plan:
            bar.set_postfix_str(f"{spec.name} ({action})")
            results.append(_execute(spec, action, settings, launcher))
            report(spec, results[-1])
        return results
