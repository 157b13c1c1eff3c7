"""The two figures of a table report: accuracy per variant and the β probe.

``matplotlib`` is imported inside the functions, so reading and tabulating
results works without it. Both take the summary of
:func:`qsv_pyg.experiments.run_reader.collect`.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

from qsv_pyg.training.run_files import atomic_write

__all__ = ["beta_series", "plot_accuracy", "plot_beta_probe", "save_figure"]


def _figure(width: float, height: float):
    # A bare Figure renders through Agg without touching pyplot's global backend.
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig, path: "str | Path") -> None:
    """Write ``fig`` as a PNG to ``path`` atomically (a kill leaves the old file)."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)


def _colors(n: int) -> List[Any]:
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_accuracy(summary: Dict[str, Any], path: "str | Path") -> None:
    """Bars of the mean test accuracy per variant, ±1 std, seed dots, paper markers."""
    rows = summary["rows"]
    fig = _figure(max(6.0, 1.2 * len(rows) + 2.0), 4.6)
    ax = fig.add_subplot()
    xs = list(range(len(rows)))
    colors = _colors(len(rows))  # same colour per row as in the β probe
    paper_shown = seeds_shown = False
    for x, e, color in zip(xs, rows, colors):
        m = e["measured"]
        if m["test_acc_mean"] is None:
            ax.text(x, 0.5, "no runs", ha="center", va="bottom", rotation=90, fontsize=8,
                    color="0.4")
            continue
        ax.bar(x, m["test_acc_mean"], width=0.6, color=color, alpha=0.55,
               yerr=m["test_acc_std"] or 0.0, capsize=4, error_kw={"elinewidth": 1})
        n = len(m["test_acc_per_seed"])
        # Small deterministic jitter keeps equal seed values visible side by side.
        offsets = [0.0] if n == 1 else [-0.15 + 0.3 * i / (n - 1) for i in range(n)]
        ax.scatter([x + o for o in offsets], m["test_acc_per_seed"], s=18, color="black",
                   zorder=3, label=None if seeds_shown else "seeds (measured)")
        seeds_shown = True
        if e["paper"]["acc"] is not None:
            ax.scatter([x], [e["paper"]["acc"]], marker="D", s=36, facecolors="none",
                       edgecolors="crimson", zorder=4,
                       label=None if paper_shown else "paper (reported, full scale)")
            paper_shown = True
    for x, e in zip(xs, rows):
        if e["paper"]["acc"] is None and e["paper"]["delta"] is not None:
            ax.annotate(f"paper: {e['paper']['text']}", (x, 0), xytext=(0, 4),
                        textcoords="offset points", ha="center", fontsize=7, color="crimson")
    ref = next((e for e in rows if e["slug"] == summary["reference"]), None)
    if ref is not None and ref["measured"]["test_acc_mean"] is not None:
        ax.axhline(ref["measured"]["test_acc_mean"], color="0.3", lw=0.8, ls=":",
                   label=f"{ref['label']} (measured mean)")
    ax.set_xticks(xs, [e["label"] for e in rows], rotation=25, ha="right")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{summary['title']}: measured, mean ± std over seeds")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def _group_of(layer: str) -> str:
    """Panel of a QSV layer: ``cross<k>`` alone, every ``within<k>`` together."""
    if re.fullmatch(r"within\d*", layer):
        return "within"
    return layer


def _group_order(group: str) -> Tuple[int, int, str]:
    m = re.fullmatch(r"cross(\d+)", group)
    if m:
        return (0, int(m.group(1)), group)
    return (1 if group == "within" else 2, 0, group)


def beta_series(entry: Dict[str, Any]) -> Dict[str, Dict[int, List[float]]]:
    """β values of one variant: group → epoch → every head value (all seeds, all layers)."""
    series: Dict[str, Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
    for _seed, history in entry.get("_betas", []):
        for epoch, betas in history:
            for layer, heads in betas.items():
                values = heads if isinstance(heads, list) else [heads]
                series[_group_of(layer)][int(epoch)].extend(float(v) for v in values)
    return series


def plot_beta_probe(summary: Dict[str, Any], path: "str | Path") -> None:
    """The routing-temperature probe: β per head over training, one panel per layer group."""
    # Colours follow the row order of the table, as in the accuracy figure.
    row_colors = dict(zip([e["slug"] for e in summary["rows"]], _colors(len(summary["rows"]))))
    variants = [(e, beta_series(e)) for e in summary["rows"]]
    variants = [(e, s) for e, s in variants if s]
    groups = sorted({g for _, s in variants for g in s}, key=_group_order)
    if not groups:
        fig = _figure(6.0, 3.0)
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no routing temperatures logged\n(no finished epochs of a QSV row)",
                ha="center", va="center")
        save_figure(fig, path)
        return
    from matplotlib.ticker import MaxNLocator
    ncols = min(3, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig = _figure(4.2 * ncols, 3.2 * nrows + 0.6)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    for i, group in enumerate(groups):
        ax = axes[i // ncols][i % ncols]
        for entry, series in variants:
            per_epoch = series.get(group)
            if not per_epoch:
                continue
            epochs = sorted(per_epoch)
            mean = [statistics.fmean(per_epoch[t]) for t in epochs]
            lo = [min(per_epoch[t]) for t in epochs]
            hi = [max(per_epoch[t]) for t in epochs]
            color = row_colors[entry["slug"]]
            # As floats: an integer beyond int64 would make numpy's array an object
            # array, which fill_between cannot mask (a TypeError, issue 28 item 14).
            x = [float(t) for t in epochs]
            ax.plot(x, mean, color=color, lw=1.5, marker="o" if len(x) < 3 else None,
                    ms=3, label=entry["label"])
            ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)
        ax.set_title(f"{group} (all rounds)" if group == "within" else group, fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("β")
        ax.grid(alpha=0.3)
    for j in range(len(groups), nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    seen: Dict[str, Any] = {}  # one legend entry per variant, from whichever panel has it
    for row in axes:
        for ax in row:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center",
               ncols=min(4, len(seen)), fontsize=8)
    fig.suptitle("Routing temperature β per head: mean (line), min–max over heads (band)",
                 fontsize=11)
    save_figure(fig, path)
