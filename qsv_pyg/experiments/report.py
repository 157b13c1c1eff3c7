"""Report of a finished table: markdown, CSV, JSON and two figures.

:func:`write_report` reads the run folders of one table (see
:func:`qsv_pyg.experiments.runner.run_dir`) with
:func:`~qsv_pyg.experiments.run_reader.collect` (which checks them, and is
re-exported here) and writes into ``<root>/<table>/``:

* ``table.md`` and ``table.csv``: the paper's layout: variant, parameters, test
  accuracy (mean ± sample standard deviation over seeds, in %), Δ from the
  reference row (QSV / full kernel; paired by seed), epochs done, and the paper's
  reported value in a separate, labelled column; where a row has several seeds,
  every run with its steps and CPU below it, and a warning where the same budget
  bought different amounts of training.
* ``results.json``: the same with every seed's numbers and the settings.
* ``accuracy.png``: accuracy per variant: bars at the mean, error bars of one
  standard deviation, one dot per seed (paper values as separate markers).
* ``beta_probe.png``: the routing-temperature probe: β over the epochs
  (``log.jsonl``), one panel per layer group: each cross-shell layer
  (``cross0``, ``cross1``, ...) on its own, all within-shell rounds
  (``within*``) together. Per variant, a line at the mean over heads (and
  seeds, and within rounds) with a band from the smallest to the largest head.

Which runs count, and how a damaged or invalid run is reported, is
:mod:`qsv_pyg.experiments.run_reader`'s part. Measured numbers come only from
the run folders; the paper's numbers only from
:mod:`qsv_pyg.experiments.tables`. ``results.json`` is strict JSON: a number
that is not finite is written as ``null``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from qsv_pyg.training.run_files import write_csv, write_text

from .block_report import write_block_report
from .budget_curve import write_budget_curves
from .figures import plot_accuracy, plot_beta_probe
from .run_reader import collect
from .tables import BLOCK, PAPER_SOURCE, Table

__all__ = ["REPORT_FILES", "collect", "format_markdown", "plot_accuracy", "plot_beta_probe",
           "write_report"]

#: Files :func:`write_report` writes into the table folder.
REPORT_FILES = ("table.md", "table.csv", "results.json", "accuracy.png", "beta_probe.png")


# ============================================================================ text


def _fmt_params(params: Any) -> str:
    if params is None:
        return "—"
    if isinstance(params, list):
        return "–".join(_fmt_params(p) for p in (params[0], params[-1]))
    return f"{params / 1e6:.3f}M" if params >= 100_000 else f"{params:,}"


def _fmt_acc(mean: Optional[float], std: Optional[float], n_invalid: int = 0) -> str:
    if mean is None:
        return "n/a" if n_invalid else "—"  # n/a: there are runs, none of them valid
    return f"{mean:.2f} ± {std:.2f}" if std is not None else f"{mean:.2f}"


def _fmt_delta(entry: Dict[str, Any], reference: str) -> str:
    if entry["slug"] == reference:
        return "ref" if entry["measured"]["n"] else "—"
    delta = entry["measured"]["delta"]
    return "—" if delta is None else _fmt_signed(delta)


def _fmt_signed(points: float) -> str:
    """``+1.23`` / ``−1.23`` (a true minus sign)."""
    return f"{'−' if points < 0 else '+'}{abs(points):.2f}"


def _fmt_epochs(m: Dict[str, Any]) -> str:
    done = m["epochs_done"]
    if not done:
        return "—"
    lo, hi = min(done), max(done)
    text = str(lo) if lo == hi else f"{lo}–{hi}"
    planned = m["epochs_planned"]
    if planned:
        text += "/" + ",".join(map(str, planned))
    if m["n_stopped_by_budget"]:
        text += f" (budget: {m['n_stopped_by_budget']}/{m['n']})"
    return text


def _fmt_seeds(m: Dict[str, Any]) -> str:
    n_invalid = m.get("n_invalid", 0)
    return f"{m['n']} (+{n_invalid} invalid)" if n_invalid else str(m["n"])


def _settings_line(summary: Dict[str, Any]) -> str:
    s = summary["settings"]
    parts = []
    if s.get("time_budget") is not None:
        clock = "CPU (process) time" if s.get("budget_clock") == "process" else "wall time"
        parts.append(f"budget {s['time_budget']} min of {clock} per run")
    if s.get("threads"):
        parts.append(f"{s['threads']} CPU thread(s) per run")
    for key, label in (("epochs", "epochs planned"), ("batch_size", "batch"), ("lr", "lr"),
                       ("subset", "train subset"), ("test_subset", "test subset"),
                       ("dataset", "dataset"), ("device", "device")):
        if s.get(key) is not None:
            parts.append(f"{label} {s[key]}")
    return ", ".join(parts) if parts else "no finished runs"


def _model_args_lines(summary: Dict[str, Any]) -> List[str]:
    """The model keywords (sizes) of each model, as a paragraph; none when all defaults."""
    model_args = summary["settings"].get("model_args")
    if not model_args:
        return []
    text = "; ".join(f"{model} {json.dumps(kw, separators=(',', ':'))}"
                     for model, kw in model_args.items())
    return [f"Model keywords (sizes): {text}.", ""]


def format_markdown(summary: Dict[str, Any]) -> str:
    """The ``table.md`` text of a :func:`collect` summary."""
    ref_label = next((e["label"] for e in summary["rows"] if e["slug"] == summary["reference"]),
                     summary["reference"])
    lines = [
        f"# {summary['title']}",
        "",
        f"Measured here: seeds {summary['seeds'] or '—'}; {_settings_line(summary)}. "
        f"Test accuracy is the mean ± sample std over seeds (%); Δ is the mean difference "
        f"from \"{ref_label}\" over the seeds both rows ran (each run against the run of "
        f"the same seed), in points; epochs are those finished (of those planned).",
        "",
        f"Last column, \"Paper (reported)\": {PAPER_SOURCE}; reference values only, "
        "not results of these runs.",
        "",
        *_model_args_lines(summary),
        "| Variant | Model | Params | Seeds | Test acc. (%) | Δ (pts) | Epochs | "
        "Paper (reported) |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    notes: Dict[str, List[str]] = {}  # note -> labels of the rows it applies to
    for e in summary["rows"]:
        m = e["measured"]
        paper = e["paper"]["text"]
        if e["paper"]["note"]:
            notes.setdefault(e["paper"]["note"], []).append(e["label"])
            paper += "¹"
        label = e["label"].replace("|", "\\|")  # a literal "|" would split the cell
        acc = _fmt_acc(m["test_acc_mean"], m["test_acc_std"], m.get("n_invalid", 0))
        lines.append(f"| {label} | {e['model']} | {_fmt_params(m['params'])} | "
                     f"{_fmt_seeds(m)} | {acc} | "
                     f"{_fmt_delta(e, summary['reference'])} | {_fmt_epochs(m)} | {paper} |")
    if notes:
        lines += ["", "¹ Paper column: " + " ".join(f"{', '.join(labels)}: {note}."
                                                    for note, labels in notes.items())]
    if any(e["paper"]["approx"] for e in summary["rows"]):
        lines += ["", "≈: the paper gives this value only approximately."]
    if any(e["measured"]["n_stopped_by_budget"] for e in summary["rows"]):
        lines += ["", "\"budget\": runs stopped by the time budget before their "
                      "planned epochs (count of seeds)."]
    if any(e["measured"].get("n_invalid") for e in summary["rows"]):
        lines += ["", "\"invalid\": runs whose metrics.json or config.json is damaged or holds "
                      "a value of the wrong type; they are left out of the means and the "
                      "warnings below name the file and the field."]
    lines += _per_seed_lines(summary)
    if summary["warnings"]:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in summary["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


def _per_seed_lines(summary: Dict[str, Any]) -> List[str]:
    """Where some row has several seeds: every finished run, with its Δ from the
    reference row's run of the same seed (a paired difference) and its steps, and
    every invalid run, marked so."""
    if not any(e["measured"]["n"] + e["measured"].get("n_invalid", 0) > 1
               for e in summary["rows"]):
        return []
    done = {(e["slug"], r["seed"]): r for e in summary["rows"]
            for r in e["measured"]["runs"] if r["status"] == "done"}
    lines = ["", "Per seed (Δ: from the reference row's run of the same seed):", "",
             "| Variant | Seed | Test acc. (%) | Δ same seed (pts) | Steps | CPU |",
             "|---|---:|---:|---:|---:|---|"]
    for e in summary["rows"]:
        for r in e["measured"]["runs"]:
            if r["status"] == "invalid":
                label = e["label"].replace("|", "\\|")
                lines.append(f"| {label} | {r['seed']} | invalid | — | — | — |")
                continue
            if r["status"] != "done":
                continue
            ref = done.get((summary["reference"], r["seed"]))
            if e["slug"] == summary["reference"]:
                delta = "ref"
            elif ref is None:
                delta = "—"
            else:
                delta = _fmt_signed(r["test_acc"] - ref["test_acc"])
            steps = f"{r['steps']:,}" if r.get("steps") else "—"
            label = e["label"].replace("|", "\\|")
            lines.append(f"| {label} | {r['seed']} | {r['test_acc']:.2f} | {delta} | {steps} | "
                         f"{r.get('cpu') or 'not recorded'} |")
    return lines


_CSV_FIELDS = ("slug", "label", "model", "switches", "params", "n_seeds", "n_invalid",
               "seeds", "test_acc_mean_pct", "test_acc_std_pct", "delta_pts",
               "test_acc_per_seed_pct", "best_test_acc_mean_pct", "epochs_done_min",
               "epochs_done_max", "epochs_planned", "n_stopped_by_budget", "paper_acc_pct",
               "paper_delta_pts", "paper_approx", "paper_note")


def _csv_rows(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for e in summary["rows"]:
        m, p = e["measured"], e["paper"]
        out.append({
            "slug": e["slug"], "label": e["label"], "model": e["model"],
            "switches": ";".join(f"{k}={v}" for k, v in e["switches"].items()),
            "params": m["params"] if not isinstance(m["params"], list)
            else ";".join(map(str, m["params"])),
            "n_seeds": m["n"], "n_invalid": m.get("n_invalid", 0),
            "seeds": ";".join(map(str, m["seeds"])),
            "test_acc_mean_pct": _round(m["test_acc_mean"]),
            "test_acc_std_pct": _round(m["test_acc_std"]),
            "delta_pts": _round(m["delta"]),
            "test_acc_per_seed_pct": ";".join(f"{a:.4f}" for a in m["test_acc_per_seed"]),
            "best_test_acc_mean_pct": _round(m["best_test_acc_mean"]),
            "epochs_done_min": min(m["epochs_done"]) if m["epochs_done"] else None,
            "epochs_done_max": max(m["epochs_done"]) if m["epochs_done"] else None,
            "epochs_planned": ";".join(map(str, m["epochs_planned"])),
            "n_stopped_by_budget": m["n_stopped_by_budget"],
            "paper_acc_pct": p["acc"], "paper_delta_pts": p["delta"],
            "paper_approx": p["approx"], "paper_note": p["note"],
        })
    return out


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else round(value, 4)


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _strict_json(data: Any) -> str:
    """``data`` as indented, strict JSON (``NaN``/``Infinity`` written as ``null``)."""
    return json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n"


# ============================================================================ write


def write_report(table: Table, root: "str | Path", rows: Optional[Sequence[str]] = None,
                 seeds: Optional[Sequence[int]] = None,
                 warn: Optional[Callable[[str], None]] = None) -> Dict[str, Path]:
    """Write every report file of ``table`` into ``<root>/<table>/``.

    Args:
        table: the table.
        root: output root of the runner.
        rows: row slugs to include (``None``: all).
        seeds: seeds to include (``None``: every seed folder on disk).
        warn: called with the warning of each invalid run (damaged run files),
            e.g. to print it; the warnings are in ``table.md`` either way.

    Returns:
        File name (see :data:`REPORT_FILES`) → path written.
    """
    summary = collect(table, root, rows, seeds)
    if warn is not None:
        for e in summary["rows"]:
            for r in e["measured"]["runs"]:
                if r["status"] == "invalid":
                    warn(f"{e['slug']}/seed{r['seed']}: invalid run, left out of the means: "
                         + "; ".join(r["problems"]))
    folder = Path(root) / table.name
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in REPORT_FILES}
    write_text(paths["table.md"], format_markdown(summary))

    write_csv(paths["table.csv"], _CSV_FIELDS, _csv_rows(summary))
    public = dict(summary, rows=[{k: v for k, v in e.items() if not k.startswith("_")}
                                 for e in summary["rows"]])
    write_text(paths["results.json"], _strict_json(public))
    plot_accuracy(summary, paths["accuracy.png"])
    plot_beta_probe(summary, paths["beta_probe.png"])
    paths.update(write_budget_curves(summary, folder))
    if table.name == BLOCK.name:  # each kernel switch's cost within its block variant
        paths.update(write_block_report(summary, folder))
    return paths
