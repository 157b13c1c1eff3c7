"""Reading and checking the run folders of one table: :func:`collect`.

:func:`collect` reads the run folders of a table (see
:func:`qsv_pyg.experiments.runner.run_dir`) into one JSON-serialisable summary:
per row, every seed's accuracy, steps, CPU time and settings, the mean ± sample
standard deviation over seeds, Δ from the reference row (paired by seed), and the
warnings of the table; :mod:`qsv_pyg.experiments.report` writes it out.

Only runs with a ``metrics.json`` count; missing, incomplete and failed runs
are listed in the notes. A run whose ``metrics.json`` or ``config.json`` is
damaged (not JSON, not an object) or holds a value of the wrong type (e.g.
``"test_acc": "high"``, ``NaN``, ``"epochs": "two"``) is *invalid*: it is left
out of the means, its row counts it (``1 (+1 invalid)``) and a warning names the
file and the field. Measured numbers come only from the run folders; the
paper's numbers only from :mod:`qsv_pyg.experiments.tables`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from qsv_pyg.training.config import SHARED, TrainConfig, fields_with_role
from qsv_pyg.training.fields import ConfigError, check_value, is_number
from qsv_pyg.training.run_files import (
    CHECKPOINT_NAME,
    CONFIG_NAME,
    LOG_NAME,
    METRICS_NAME,
    read_log,
)

from .runner import RUNNER_NAME, run_dir
from .tables import PAPER_SOURCE, Row, Table

__all__ = ["collect"]

# Settings that should be equal across the runs of one table for a fair comparison.
_SHARED_SETTINGS = fields_with_role(SHARED)


# ============================================================================ collect


def _show(value: Any) -> str:
    """A value of a run file as a warning shows it (as JSON would write it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or isinstance(value, (list, dict)):
        return "null" if value is None else _json_kind(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _load(path: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(object, None)``, ``(None, None)`` when missing, ``(None, problem)`` when damaged."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return None, f"{path.name}: cannot be read ({reason})"
    try:
        value = json.loads(text)
    except ValueError as err:
        return None, f"{path.name}: not valid JSON ({err})"
    if not isinstance(value, dict):
        return None, f"{path.name}: holds {_json_kind(value)}, not a JSON object"
    return value, None


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "a JSON list"
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, str):
        return "a JSON string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a JSON boolean"
    return "a JSON number"


def _fraction(v: Any) -> bool:
    return is_number(v) and math.isfinite(v) and 0.0 <= v <= 1.0


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _duration(v: Any) -> bool:
    return is_number(v) and math.isfinite(v) and v >= 0


def _budget_evals(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(e, dict) and _duration(e.get("minutes")) and _fraction(e.get("test_acc"))
        for e in v)


#: metrics.json fields the report reads: check, and what it expects (for the warning).
_METRIC_CHECKS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "test_acc": (_fraction, "a number in [0, 1]"),
    "best_test_acc": (_fraction, "a number in [0, 1]"),
    "train_acc": (_fraction, "a number in [0, 1]"),
    "params": (_count, "a non-negative integer"),
    "epochs": (_count, "a non-negative integer"),
    "epochs_planned": (_count, "a non-negative integer"),
    "steps": (_count, "a non-negative integer"),
    "seconds": (_duration, "a non-negative number"),
    "stopped_early": (lambda v: isinstance(v, bool), "true or false"),
    "device": (lambda v: isinstance(v, str), "a string"),
    "cpu": (lambda v: isinstance(v, str), "a string"),
    "budget_evals": (_budget_evals, 'a list of {"minutes": number >= 0, '
                                    '"test_acc": number in [0, 1]} objects'),
}

_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _metrics_problems(metrics: Dict[str, Any]) -> List[str]:
    if "test_acc" not in metrics or metrics["test_acc"] is None:
        problems = [f"{METRICS_NAME}: test_acc is missing"]
    else:
        problems = []
    for key, (ok, expected) in _METRIC_CHECKS.items():
        value = metrics.get(key)
        if value is not None and not ok(value):
            problems.append(f"{METRICS_NAME}: {key} is {_show(value)}, expected {expected}")
    return problems


def _config_problems(config: Dict[str, Any]) -> List[str]:
    """Type and range of the settings the report reads (as ``qsv-train`` checks them)."""
    problems = []
    for key in _SHARED_SETTINGS:
        value = config.get(key)
        if value is None:
            continue
        try:
            check_value(_CONFIG_FIELDS[key], value)
        except ConfigError:
            problems.append(f"{CONFIG_NAME}: {key} is {_show(value)}, expected "
                            f"{_expected_setting(key)}")
    model_args = config.get("model_args")
    if model_args is not None and not isinstance(model_args, dict):
        problems.append(f"{CONFIG_NAME}: model_args is {_show(model_args)}, expected a JSON "
                        "object of model keywords")
    return problems


def _expected_setting(key: str) -> str:
    f = _CONFIG_FIELDS[key]
    meta = f.metadata
    kind = f.type.replace("Optional[", "").rstrip("]")
    if meta.get("choices"):
        return "one of " + ", ".join(meta["choices"])
    what = {"int": "an integer", "float": "a finite number", "str": "a string",
            "bool": "true or false"}.get(kind, kind)
    if meta.get("lo") is not None and meta.get("hi") is None:
        what += f" {'>' if meta['lo_open'] else '>='} {meta['lo']:g}"
    elif meta.get("hi") is not None:
        what += (f" in {'(' if meta['lo_open'] else '['}{meta['lo']:g}, {meta['hi']:g}"
                 f"{')' if meta['hi_open'] else ']'}")
    return what


def _runner_record(folder: Path, notes: List[str]) -> Dict[str, Any]:
    """runner.json, or ``{}`` (with a note) when it is damaged: only bookkeeping."""
    record, problem = _load(folder / RUNNER_NAME)
    if problem:
        notes.append(f"{problem}; ignored")
        return {}
    record = record or {}
    launches = record.get("launches")
    if launches is not None and not (isinstance(launches, list)
                                     and all(isinstance(x, dict) for x in launches)):
        notes.append(f"{RUNNER_NAME}: launches is {_show(launches)}, expected a list of "
                     "objects; ignored")
        record = dict(record, launches=[])
    budget = record.get("time_budget")
    if budget is not None:
        try:
            check_value(_CONFIG_FIELDS["time_budget"], budget)
        except ConfigError:
            notes.append(f"{RUNNER_NAME}: time_budget is {_show(budget)}, expected "
                         f"{_expected_setting('time_budget')}; ignored")
            record = {k: v for k, v in record.items() if k != "time_budget"}
    return record


def _finite(v: Any) -> bool:
    return is_number(v) and math.isfinite(v)


def _betas(folder: Path, notes: List[str],
           planned: Optional[int] = None) -> List[Tuple[int, Dict[str, Any]]]:
    """β per epoch from log.jsonl; records with a malformed epoch or β are skipped, and
    so are epochs beyond the ``planned`` ones (``config.json``'s ``epochs``): a
    hand-edited ``"epoch": 1e30``-sized integer never reaches the figure."""
    out, skipped, beyond = [], 0, []
    for rec in read_log(folder / LOG_NAME):
        if "epoch" not in rec:
            continue
        epoch, betas = rec["epoch"], rec.get("betas") or {}
        good = (_count(epoch) and isinstance(betas, dict) and all(
            _finite(v) or (isinstance(v, list) and all(_finite(x) for x in v))
            for v in betas.values()))
        if not good:
            skipped += 1
        elif planned is not None and epoch > planned:
            beyond.append(epoch)
        else:
            out.append((epoch, betas))
    if skipped:
        notes.append(f"{LOG_NAME}: {skipped} record(s) with a malformed epoch or β skipped "
                     "in the β probe")
    if beyond:
        more = f" (and {len(beyond) - 1} more record(s))" if len(beyond) > 1 else ""
        notes.append(f"{LOG_NAME}: epoch is {_show(beyond[0])}{more}, beyond the run's "
                     f"{planned} planned epochs ({CONFIG_NAME}: epochs); left out of the β probe")
    return out


def _seeds_on_disk(folder: Path) -> List[int]:
    found = []
    for p in folder.glob("seed*"):
        if p.is_dir() and p.name[4:].isdigit():
            found.append(int(p.name[4:]))
    return sorted(found)


def _run_info(root: Path, table: Table, row: Row, seed: int) -> Dict[str, Any]:
    """One run folder: ``status`` done, invalid (damaged run files, with ``problems``),
    failed, incomplete or missing; ``notes``: lesser damage that was worked around."""
    folder = run_dir(root, table.name, row.slug, seed)
    notes: List[str] = []
    problems: List[str] = []
    metrics, problem = _load(folder / METRICS_NAME)
    if problem:
        problems.append(problem)
    elif metrics is not None:
        problems += _metrics_problems(metrics)
    config: Dict[str, Any] = {}
    if metrics is not None or problems:
        config, problem = _load(folder / CONFIG_NAME)
        if problem:
            problems.append(problem)
        config = config or {}
        problems += _config_problems(config)
    record = _runner_record(folder, notes)
    launches = record.get("launches") or []
    last_rc = launches[-1].get("exit_code") if launches else None
    if problems:
        status = "invalid"
    elif metrics is not None:
        status = "done"
    elif isinstance(last_rc, int) and last_rc not in (0, 130):
        status = f"failed (exit {last_rc})"
    elif (folder / CHECKPOINT_NAME).is_file():
        status = "incomplete"
    else:
        status = "missing"
    info: Dict[str, Any] = {"seed": seed, "out_dir": str(folder), "status": status}
    if problems:
        info["problems"] = problems
    if status == "done":
        assert metrics is not None
        info.update({
            "test_acc": 100.0 * metrics["test_acc"],
            "best_test_acc": (100.0 * metrics["best_test_acc"]
                              if metrics.get("best_test_acc") is not None else None),
            "train_acc": (100.0 * metrics["train_acc"]
                          if metrics.get("train_acc") is not None else None),
            "params": metrics.get("params"), "epochs": metrics.get("epochs"),
            "epochs_planned": metrics.get("epochs_planned"),
            "stopped_early": bool(metrics.get("stopped_early")),
            "seconds": metrics.get("seconds"), "device": metrics.get("device"),
            "steps": metrics.get("steps"), "cpu": metrics.get("cpu"),
            "budget_evals": metrics.get("budget_evals") or [],
        })
        budget = record.get("time_budget", config.get("time_budget"))
        info["settings"] = {k: config.get(k) for k in _SHARED_SETTINGS}
        info["settings"]["time_budget"] = budget
        info["settings"]["budget_clock"] = config.get("budget_clock", "wall")
        info["settings"]["threads"] = config.get("threads")
        info["model_args"] = config.get("model_args", {})
        planned = next((v for v in (config.get("epochs"), metrics.get("epochs_planned"))
                        if _count(v) and v >= 1), None)
        info["betas"] = _betas(folder, notes, planned)
    if notes:
        info["notes"] = notes
    return info


def _stats(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    mean = statistics.fmean(values)
    # Sample standard deviation: the seeds are a sample of training outcomes.
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def _row_entry(table: Table, row: Row, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row of the summary from its runs (finished or not)."""
    done = [r for r in runs if r["status"] == "done"]
    accs = [r["test_acc"] for r in done]
    mean, std = _stats(accs)
    params = sorted({r["params"] for r in done if r["params"] is not None})
    return {
        "slug": row.slug, "label": row.label, "model": row.model,
        "switches": dict(row.switches),
        "measured": {
            "n": len(done), "seeds": [r["seed"] for r in done],
            "n_invalid": sum(r["status"] == "invalid" for r in runs),
            "test_acc_mean": mean, "test_acc_std": std, "delta": None,
            "test_acc_per_seed": accs,
            "best_test_acc_mean": _stats([r["best_test_acc"] for r in done
                                          if r["best_test_acc"] is not None])[0],
            "params": params[0] if len(params) == 1 else (params or None),
            "epochs_done": [r["epochs"] for r in done if r["epochs"] is not None],
            "epochs_planned": sorted({r["epochs_planned"] for r in done
                                      if r["epochs_planned"] is not None}),
            "n_stopped_by_budget": sum(r["stopped_early"] for r in done),
            "runs": [{k: v for k, v in r.items() if k != "betas"} for r in runs],
        },
        "paper": {"acc": row.paper.acc, "delta": row.paper.delta,
                  "approx": row.paper.approx, "note": row.paper.note,
                  "text": row.paper.text(reference=row.slug == table.reference)},
        "_betas": [(r["seed"], r["betas"]) for r in done if r.get("betas")],
    }


def _settings(summary_rows: List[Dict[str, Any]], warnings: List[str]) -> Dict[str, Any]:
    """The settings the runs share; a setting that differs is listed and warned about."""
    settings: Dict[str, Any] = {}
    for key in _SHARED_SETTINGS:
        values = {json.dumps(r["settings"][key]) for e in summary_rows
                  for r in e["measured"]["runs"] if "settings" in r}
        if len(values) == 1:
            settings[key] = json.loads(values.pop())
        elif len(values) > 1:
            settings[key] = sorted(json.loads(v) for v in values if v != "null") or None
            warnings.append(f"runs differ in {key}: {sorted(values)}")
    devices = sorted({r["device"] for e in summary_rows for r in e["measured"]["runs"]
                      if r.get("device")})
    if devices:
        settings["device"] = devices[0] if len(devices) == 1 else devices
    model_args: Dict[str, Any] = {}
    for e in summary_rows:
        for r in e["measured"]["runs"]:
            if r.get("model_args"):
                model_args.setdefault(e["model"], r["model_args"])
    if model_args:
        settings["model_args"] = model_args
    return settings


#: Seeds of one row whose budget-stopped runs made more than this fraction fewer
#: optimiser steps than the row's most are warned about (different compute).
STEP_SPREAD = 0.15


def _compute_warnings(summary_rows: List[Dict[str, Any]]) -> List[str]:
    """Runs that got different compute from the same budget: other CPUs, fewer steps.

    A time budget (CPU or wall) buys as many steps as the machine makes in it, so
    runs from different processors, or under different load, are not equal budgets.
    """
    out = []
    cpus = sorted({r["cpu"] for e in summary_rows for r in e["measured"]["runs"]
                   if r.get("cpu")})
    unrecorded = sum(1 for e in summary_rows for r in e["measured"]["runs"]
                     if r["status"] == "done" and not r.get("cpu"))
    if len(cpus) > 1:
        out.append(f"runs ran on different CPUs ({'; '.join(cpus)}): a time budget buys "
                   "different amounts of training on each")
    if cpus and unrecorded:
        out.append(f"{unrecorded} run(s) recorded no CPU (older trainer): the CPUs of the "
                   "table's runs cannot all be compared")
    for e in summary_rows:
        runs = [r for r in e["measured"]["runs"] if r["status"] == "done"
                and r.get("stopped_early") and r.get("steps")]
        if len(runs) < 2:
            continue
        most = max(r["steps"] for r in runs)
        short = [r for r in runs if r["steps"] < (1 - STEP_SPREAD) * most]
        if short:
            steps = ", ".join(f"seed {r['seed']} {r['steps']:,}" for r in runs)
            out.append(f"{e['slug']}: its seeds made different numbers of optimiser steps "
                       f"in the same budget ({steps}): they got different compute (another "
                       "machine or other load); compare rows within one seed")
    return out


def collect(table: Table, root: "str | Path", rows: Optional[Sequence[str]] = None,
            seeds: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Gather the measured results of ``table`` from its run folders.

    Args:
        table: the table.
        root: output root of the runner.
        rows: row slugs to include (``None``: all), in table order.
        seeds: seeds to include (``None``: every ``seed<k>`` folder on disk).

    Returns:
        A JSON-serialisable summary (the contents of ``results.json``, plus
        per-run β histories under the private key ``_betas``).
    """
    root = Path(root)
    selected = table.select(rows)
    summary_rows, warnings = [], []
    by_slug: Dict[str, Dict[str, Any]] = {}
    for row in selected:
        row_seeds = list(seeds) if seeds is not None else _seeds_on_disk(
            root / table.name / row.slug)
        runs = [_run_info(root, table, row, s) for s in row_seeds]
        entry = _row_entry(table, row, runs)
        for r in runs:
            where = f"{row.slug}/seed{r['seed']}"
            if r["status"] == "invalid":
                warnings.append(f"{where}: invalid run, left out of the means: "
                                + "; ".join(r["problems"]))
            elif r["status"] != "done":
                warnings.append(f"{where}: {r['status']}")
            warnings.extend(f"{where}: {note}" for note in r.get("notes", ()))
        summary_rows.append(entry)
        by_slug[row.slug] = entry

    # Δ pairs each run with the reference row's run of the same seed: where the rows
    # ran different seeds (or seeds on different machines) a difference of means
    # would compare unlike runs.
    ref = by_slug.get(table.reference)
    ref_acc = {} if ref is None else dict(zip(ref["measured"]["seeds"],
                                              ref["measured"]["test_acc_per_seed"]))
    for entry in summary_rows:
        m = entry["measured"]
        pairs = [(acc, ref_acc[seed]) for seed, acc in zip(m["seeds"], m["test_acc_per_seed"])
                 if seed in ref_acc]
        m["delta_seeds"] = [seed for seed in m["seeds"] if seed in ref_acc]
        if pairs:
            m["delta"] = statistics.fmean(a - b for a, b in pairs)

    settings = _settings(summary_rows, warnings)
    warnings.extend(_compute_warnings(summary_rows))
    counts = [p for e in summary_rows for p in ([e["measured"]["params"]]
              if not isinstance(e["measured"]["params"], list) else e["measured"]["params"])
              if p]
    if counts and max(counts) > 1.5 * min(counts):
        # E.g. a CPU-scale study shrinks the graph models but not ResNet-20.
        warnings.append(f"parameter counts range from {min(counts):,} to {max(counts):,}: "
                        "the rows are not parameter-matched at this scale")
    all_seeds = sorted({r["seed"] for e in summary_rows for r in e["measured"]["runs"]})
    return {
        "table": table.name, "title": table.title, "reference": table.reference,
        "generated": datetime.now().isoformat(timespec="seconds"), "root": str(root),
        "seeds": all_seeds, "settings": settings,
        "statistics": "mean and sample standard deviation (n-1) over seeds; accuracies in %; "
                      "delta = mean over the seeds both rows ran of the difference from "
                      "the reference row's run of the same seed, in points",
        "paper_source": PAPER_SOURCE, "rows": summary_rows, "warnings": warnings,
    }
