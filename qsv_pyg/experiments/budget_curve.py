"""Accuracy against training budget: the evaluations a run made at budget marks.

A run trained with ``--time-budget T --eval-at-minutes m1 m2 ...`` stores a test
evaluation at each mark in ``metrics.json`` (``budget_evals``) and ends with its
final evaluation at ``T``. This module turns the runs of one table into

* ``budget_curve.md`` / ``budget_curve.csv``: test accuracy (%) per row at every
  mark (mean over seeds, the seeds' values in the CSV);
* ``budget_curve.png``: accuracy against budget minutes, one colour per row and
  one line per seed (first seed solid, the next dashed).

It reads only what :func:`qsv_pyg.experiments.run_reader.collect` gathered.
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any, Dict, List

from qsv_pyg.training.run_files import atomic_write, write_text

from .figures import save_figure

__all__ = ["BUDGET_FILES", "budget_points", "format_budget_markdown", "plot_budget_curves",
           "write_budget_curves"]

#: Files :func:`write_budget_curves` writes into the table folder.
BUDGET_FILES = ("budget_curve.md", "budget_curve.csv", "budget_curve.png")


def budget_points(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per row: ``{"slug", "label", "paper", "points": {minutes: [acc % per seed]},
    "per_seed": {seed: {minutes: acc %}}}``.

    The final evaluation of a run that the budget stopped counts as the point at
    its budget; a run that finished its epochs earlier contributes its marks only.
    Rows without any run that has marks are left out.
    """
    out = []
    for entry in summary["rows"]:
        points: Dict[float, List[float]] = {}
        per_seed: Dict[int, Dict[float, float]] = {}
        for run in entry["measured"]["runs"]:
            evals = run.get("budget_evals") or []
            if not evals:
                continue
            curve = {float(e["minutes"]): 100.0 * e["test_acc"] for e in evals}
            budget = (run.get("settings") or {}).get("time_budget")
            if run.get("stopped_early") and budget:
                curve[float(budget)] = run["test_acc"]
            for minutes, acc in curve.items():
                points.setdefault(minutes, []).append(acc)
            per_seed[run["seed"]] = dict(sorted(curve.items()))
        if points:
            out.append({"slug": entry["slug"], "label": entry["label"],
                        "paper": entry["paper"]["acc"], "points": dict(sorted(points.items())),
                        "per_seed": dict(sorted(per_seed.items()))})
    return out


def format_budget_markdown(curves: List[Dict[str, Any]]) -> str:
    """A markdown table: one row per variant, one column per budget mark."""
    marks = sorted({m for c in curves for m in c["points"]})
    head = "| Variant | " + " | ".join(f"{m:g} min" for m in marks) + " | Paper |"
    lines = [head, "|---|" + "---:|" * (len(marks) + 1)]
    for c in curves:
        cells = []
        for m in marks:
            accs = c["points"].get(m)
            if not accs:
                cells.append("—")
            elif len(accs) == 1:
                cells.append(f"{accs[0]:.2f}")
            else:
                cells.append(f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}")
        paper = "—" if c["paper"] is None else f"{c['paper']:.1f}"
        lines.append(f"| {c['label']} | " + " | ".join(cells) + f" | {paper} |")
    return "\n".join(lines) + "\n"


#: Line styles of a row's seeds, in seed order (the first seed solid).
_SEED_STYLES = ("-", "--", ":", "-.")


def plot_budget_curves(curves: List[Dict[str, Any]], path: "str | Path") -> None:
    """Accuracy (%) against budget minutes: one colour per row, one line per seed.

    Seeds are drawn as their own lines (the first seed solid, the next dashed, ...),
    not averaged: seeds run on other machines or under other load get different
    compute from the same budget, and a mean would mix the two.
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.lines import Line2D
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.get_cmap("tab10")
    seeds = sorted({seed for c in curves for seed in c["per_seed"]})
    style = {seed: _SEED_STYLES[i % len(_SEED_STYLES)] for i, seed in enumerate(seeds)}
    for i, c in enumerate(curves):
        color = colors(i % 10)
        for k, (seed, curve) in enumerate(c["per_seed"].items()):
            ax.plot(list(curve), list(curve.values()), marker="o", markersize=4,
                    linestyle=style[seed], color=color, label=None if k else c["label"])
    ax.set_xlabel("training budget (CPU-minutes, one thread)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if len(seeds) > 1:
        handles += [Line2D([], [], color="black", linestyle=style[s], label=f"seed {s}")
                    for s in seeds]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def write_budget_curves(summary: Dict[str, Any], folder: "str | Path") -> Dict[str, Path]:
    """Write :data:`BUDGET_FILES` into ``folder`` if any run has budget marks.

    Returns:
        File name → path written (empty when no run has marks).
    """
    curves = budget_points(summary)
    if not curves:
        return {}
    folder = Path(folder)
    paths = {name: folder / name for name in BUDGET_FILES}
    write_text(paths["budget_curve.md"], format_budget_markdown(curves))
    marks = sorted({m for c in curves for m in c["points"]})

    def write_csv(f) -> None:
        writer = csv.writer(f)
        writer.writerow(["slug", "label", "minutes", "n_seeds", "test_acc_mean_pct",
                         "test_acc_per_seed_pct"])
        for c in curves:
            for m in marks:
                accs = c["points"].get(m, [])
                writer.writerow([c["slug"], c["label"], m, len(accs),
                                 round(statistics.mean(accs), 2) if accs else "",
                                 ";".join(f"{a:.2f}" for a in accs)])

    atomic_write(paths["budget_curve.csv"], write_csv)
    plot_budget_curves(curves, paths["budget_curve.png"])
    return paths
