"""The block study's own report: what each kernel switch costs inside each block variant.

The block table (:data:`~qsv_pyg.experiments.tables.BLOCK`) trains QSV with parts
of its block removed (root weight, MLP, both) and, for each block variant, the
kernel with both switches off (and, for the kernel-only block, transport →
identity). The question it answers is whether the kernel's switches cost more
as the candidate substitutes are removed, so every cost is measured *within* one
block variant: ``acc(variant, switch) − acc(variant, QSV)``, paired by seed.

:func:`write_block_report` writes into the table folder, next to the generic
report of :func:`~qsv_pyg.experiments.report.write_report`:

* ``block_costs.md`` / ``block_costs.csv`` / ``block_costs.json``: per variant,
  parameters and accuracy of each kernel setting and each switch's cost, with the
  paper's costs (−21.8 both off, ≈ −4.2 identity, full model) beside them;
* ``block_costs.png``: the cost against the block variant, one dot per seed.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

from qsv_pyg.training.run_files import write_csv, write_text

from .figures import _figure, save_figure
from .tables import BLOCK, BLOCK_KERNELS, BLOCK_VARIANTS, block_slug

__all__ = ["BLOCK_FILES", "PAPER_COSTS", "block_costs", "format_block_markdown",
           "plot_block_costs", "write_block_report"]

#: Files :func:`write_block_report` writes into the block table's folder.
BLOCK_FILES = ("block_costs.md", "block_costs.csv", "block_costs.json", "block_costs.png")
#: The paper's costs of the kernel switches (points of CIFAR-10 test accuracy, full
#: model and schedule): both off 64.1 vs 85.9, transport → identity ≈81.7 vs 85.9.
PAPER_COSTS = {"both-off": -21.8, "identity": -4.2}
#: Switches whose cost is measured (every kernel but the reference, QSV).
SWITCHES = tuple(k for k in BLOCK_KERNELS if k != "qsv")


def _per_seed(entry: Optional[Dict[str, Any]]) -> Dict[int, float]:
    if entry is None:
        return {}
    m = entry["measured"]
    return dict(zip(m["seeds"], m["test_acc_per_seed"]))


def _mean_std(values: List[float]):
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def block_costs(summary: Dict[str, Any]) -> Dict[str, Any]:
    """Per block variant: accuracy of every kernel setting and each switch's cost.

    Args:
        summary: :func:`~qsv_pyg.experiments.run_reader.collect` of the block table.

    Returns:
        ``{"variants": [...], "paper": PAPER_COSTS, "statistics": ...}``; each
        variant has ``kernels`` (slug → seeds, accuracies, mean, params) and
        ``costs`` (switch → per-seed cost paired with the variant's QSV run of the
        same seed, mean, std, seeds), ``None`` where a run is missing.
    """
    by_slug = {e["slug"]: e for e in summary["rows"]}
    variants = []
    for variant, (label, switches) in BLOCK_VARIANTS.items():
        kernels: Dict[str, Any] = {}
        for kernel in BLOCK_KERNELS:
            entry = by_slug.get(block_slug(variant, kernel))
            if entry is None:
                continue  # this (variant, kernel) pair is not in the table's plan
            accs = _per_seed(entry)
            kernels[kernel] = {"slug": entry["slug"], "seeds": sorted(accs),
                               "test_acc_per_seed": [accs[s] for s in sorted(accs)],
                               "test_acc_mean": _mean_std(list(accs.values()))[0],
                               "params": entry["measured"]["params"]}
        ref = _per_seed(by_slug.get(block_slug(variant, "qsv")))
        costs: Dict[str, Any] = {}
        for switch in SWITCHES:
            if switch not in kernels:
                continue
            accs = _per_seed(by_slug[block_slug(variant, switch)])
            seeds = sorted(set(accs) & set(ref))
            per_seed = [accs[s] - ref[s] for s in seeds]
            mean, std = _mean_std(per_seed)
            costs[switch] = {"seeds": seeds, "per_seed": per_seed, "mean": mean, "std": std}
        variants.append({"variant": variant, "label": label, "switches": dict(switches),
                         "kernels": kernels, "costs": costs})
    return {"table": summary["table"], "variants": variants, "paper": dict(PAPER_COSTS),
            "settings": summary.get("settings", {}), "warnings": summary.get("warnings", []),
            "statistics": "cost = accuracy of the switch minus accuracy of QSV with the same "
                          "block, paired by seed, in points; mean and sample standard "
                          "deviation (n-1) over the paired seeds"}


def _acc(k: Optional[Dict[str, Any]]) -> str:
    if k is None or k["test_acc_mean"] is None:
        return "—"
    seeds = len(k["seeds"])
    return f"{k['test_acc_mean']:.2f}" + (f" (n={seeds})" if seeds > 1 else "")


def _cost(c: Optional[Dict[str, Any]]) -> str:
    if c is None or c["mean"] is None:
        return "—"
    sign = "−" if c["mean"] < 0 else "+"
    text = f"{sign}{abs(c['mean']):.2f}"
    if c["std"] is not None:
        text += f" ± {c['std']:.2f}"
    return text + (f" (n={len(c['seeds'])})" if len(c["seeds"]) > 1 else "")


def _params(k: Optional[Dict[str, Any]]) -> str:
    if k is None or k["params"] is None:
        return "—"
    p = k["params"]
    return f"{p:,}" if isinstance(p, int) else ", ".join(f"{x:,}" for x in p)


def format_block_markdown(costs: Dict[str, Any]) -> str:
    """The cost table as markdown (one row per block variant)."""
    lines = [
        "# Cost of the kernel switches per block variant (CIFAR-10)", "",
        "| block | parameters (QSV) | QSV | both off | cost of both off | identity | "
        "cost of identity |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in costs["variants"]:
        k, c = v["kernels"], v["costs"]
        lines.append(f"| {v['label']} | {_params(k.get('qsv'))} | {_acc(k.get('qsv'))} | "
                     f"{_acc(k.get('both-off'))} | {_cost(c.get('both-off'))} | "
                     f"{_acc(k.get('identity'))} | {_cost(c.get('identity'))} |")
    paper = costs["paper"]
    lines += [
        f"| paper (full model and schedule) | — | 85.9 | 64.1 | "
        f"{paper['both-off']:+.1f} | ≈81.7 | ≈{paper['identity']:+.1f} |".replace("-", "−"),
        "", f"Accuracies are test accuracy in %; {costs['statistics']}. "
        "A dash is a run not (yet) done or not in the plan.", ""]
    if costs["warnings"]:
        lines += ["Notes:", ""] + [f"- {w}" for w in costs["warnings"]] + [""]
    return "\n".join(lines)


_CSV_FIELDS = ("variant", "kernel", "slug", "params", "seeds", "test_acc_mean",
               "cost_mean", "cost_std", "cost_seeds", "paper_cost")


def _csv_rows(costs: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for v in costs["variants"]:
        for kernel, k in v["kernels"].items():
            c = v["costs"].get(kernel, {})
            out.append({"variant": v["variant"], "kernel": kernel, "slug": k["slug"],
                        "params": k["params"], "seeds": " ".join(map(str, k["seeds"])),
                        "test_acc_mean": k["test_acc_mean"], "cost_mean": c.get("mean"),
                        "cost_std": c.get("std"),
                        "cost_seeds": " ".join(map(str, c.get("seeds", []))),
                        "paper_cost": costs["paper"].get(kernel)})
    return out


def plot_block_costs(costs: Dict[str, Any], path: "str | Path") -> None:
    """Each switch's cost against the block variant: a dot per seed, a line at the
    means, and the paper's costs as dashed lines."""
    variants = costs["variants"]
    fig = _figure(7.0, 4.4)
    ax = fig.add_subplot()
    xs = list(range(len(variants)))
    styles = {"both-off": ("tab:red", "o"), "identity": ("tab:blue", "s")}
    for switch in SWITCHES:
        color, marker = styles.get(switch, ("0.3", "^"))
        label = BLOCK_KERNELS[switch][0]
        mx, my = [], []
        for x, v in zip(xs, variants):
            c = v["costs"].get(switch)
            if not c or c["mean"] is None:
                continue
            n = len(c["per_seed"])
            offs = [0.0] if n == 1 else [-0.08 + 0.16 * i / (n - 1) for i in range(n)]
            ax.scatter([x + o for o in offs], c["per_seed"], color=color, marker=marker,
                       s=28, zorder=3)
            mx.append(x)
            my.append(c["mean"])
        if mx:
            ax.plot(mx, my, color=color, marker=marker, lw=1.5, label=f"{label} (measured)")
        if switch in costs["paper"]:
            ax.axhline(costs["paper"][switch], color=color, ls="--", lw=1,
                       label=f"{label}: paper {costs['paper'][switch]:+.1f}")
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_xticks(xs, [v["label"].replace(" (", "\n(") for v in variants], fontsize=8)
    ax.set_ylabel("cost vs QSV with the same block (points)")
    ax.set_title("Kernel switches: cost per block variant (CIFAR-10, CPU scale)")
    ax.legend(fontsize=7, loc="lower left")
    save_figure(fig, path)


def write_block_report(summary: Dict[str, Any], folder: "str | Path") -> Dict[str, Path]:
    """Write :data:`BLOCK_FILES` into ``folder`` from the block table's summary.

    Returns:
        File name → path written.
    """
    if summary["table"] != BLOCK.name:
        raise ValueError(f"the block report needs the {BLOCK.name!r} table, got "
                         f"{summary['table']!r}")
    costs = block_costs(summary)
    folder = Path(folder)
    paths = {name: folder / name for name in BLOCK_FILES}
    write_text(paths["block_costs.md"], format_block_markdown(costs))

    write_csv(paths["block_costs.csv"], _CSV_FIELDS, _csv_rows(costs))
    # Strict JSON: every number here is a difference of finite accuracies.
    write_text(paths["block_costs.json"], json.dumps(costs, indent=2, allow_nan=False) + "\n")
    plot_block_costs(costs, paths["block_costs.png"])
    return paths
