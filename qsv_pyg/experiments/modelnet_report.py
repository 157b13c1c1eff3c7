r"""The ModelNet10 rotation table's report: ``table.{md,csv}``, ``results.json``,
``accuracy.png``, ``budget.png``, ``per_class.md`` and ``published_modelnet40.md`` from the
finished run folders
(:mod:`qsv_pyg.experiments.units` reads them; damaged run files are named and left
out). :mod:`qsv_pyg.experiments.modelnet_table` runs the table and calls
:func:`report`.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..training.run_files import atomic_write, read_json, write_csv, write_json, write_text
from .modelnet_data import COLUMNS, LABEL, TESTS, VOTE_TESTS
from .units import NUMBER, fail, read_units

__all__ = ["PUBLISHED", "PUBLISHED_NOTE", "VOTES_FILE", "budget_curves", "collect",
           "per_class", "voting", "report"]

#: A unit's test-time voting results (``python -m qsv_pyg.experiments.modelnet_table
#: --vote N``), beside its ``metrics.json``.
VOTES_FILE = "votes.json"

#: Published context, ModelNet40 (40 classes), NOT ModelNet10:
#: Deng et al., "Vector Neurons: A General Framework for SO(3)-Equivariant
#: Networks", ICCV 2021 (arXiv:2104.12229), Table 1 (z/z, z/SO3, SO3/SO3) and the
#: appendix (trained aligned, tested SO3: I/SO3).
PUBLISHED = [
    {"model": "PointNet", "z/z": "85.9", "z/SO3": "19.6", "SO3/SO3": "74.7", "I/SO3": "–"},
    {"model": "DGCNN", "z/z": "90.3", "z/SO3": "33.8", "SO3/SO3": "88.6", "I/SO3": "16.6"},
    {"model": "VN-PointNet", "z/z": "77.5", "z/SO3": "77.5", "SO3/SO3": "–", "I/SO3": "–"},
    {"model": "VN-DGCNN", "z/z": "89.5", "z/SO3": "89.5", "SO3/SO3": "90.2", "I/SO3": "90.0"},
]
PUBLISHED_NOTE = (
    "ModelNet40 (40 classes, 1,024 points), NOT ModelNet10: test accuracy (%) from "
    "Deng et al., Vector Neurons, ICCV 2021 (arXiv:2104.12229), Table 1 (z/z, z/SO3, "
    "SO3/SO3) and its appendix (I/SO3: trained aligned, tested SO3). The z/SO3 "
    "column and VN-DGCNN's z/z and SO3/SO3: two independent secondary sources agree "
    "(notes on the paper, p. 6, and a later paper's copy of Table 1); PointNet's and "
    "DGCNN's z/z and SO3/SO3, VN-PointNet and the I/SO3 column: one secondary source "
    "each; none checked against the PDF itself. '–': not checked here.")


CONFIG_FIELDS = {"row": str, "train": str, "seed": int, "num_classes": int,
                 "budget_cpu_s": NUMBER}
METRICS_FIELDS = {"params": int, "cpu_seconds_per_epoch": NUMBER, "epochs_trained": NUMBER,
                  "test": dict, "val": NUMBER}


def _unit_problem(cfg: Dict[str, Any], metrics: Dict[str, Any]) -> Optional[str]:
    if cfg["train"] not in TESTS:
        return f"unknown train protocol {cfg['train']!r} in its config.json"
    for protocol, acc in metrics["test"].items():
        if protocol not in TESTS[cfg["train"]]:
            return f"field 'test' holds an unknown protocol {protocol!r}"
        if isinstance(acc, bool) or not isinstance(acc, (int, float)):
            return f"field 'test.{protocol}' is not a number ({type(acc).__name__})"
    return None


def fmt(values: Sequence[float], scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± std`` (of ``values * scale``); one value alone."""
    v = [x * scale for x in values if not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "–"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.fmean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}"


def collect(dataset_root: Path, order: Sequence[str] = ()
            ) -> Tuple[Dict[str, Dict[str, Any]], List[dict]]:
    """Per row (in ``order``, rows not in it last) its parameters, times, epochs,
    validation and test accuracies over the finished units; and the units."""
    rows: Dict[str, Dict[str, Any]] = {}
    units = []
    for cfg, metrics in read_units(dataset_root, CONFIG_FIELDS, METRICS_FIELDS,
                                   keep=lambda c: "budget_cpu_s" in c,
                                   check=_unit_problem):
        units.append({"config": cfg, "metrics": metrics})
        row = rows.setdefault(cfg["row"], {"params": metrics["params"], "time": [],
                                           "epochs": [], "val": {}, "val_balanced": {},
                                           "seeds": set(),
                                           "budget": set(),
                                           "columns": {c: [] for c in COLUMNS}})
        row["time"].append(metrics["cpu_seconds_per_epoch"])
        row["epochs"].append(metrics["epochs_trained"])
        row["seeds"].add(cfg["seed"])
        row["budget"].add(cfg["budget_cpu_s"])
        row["val"].setdefault(cfg["train"], []).append(metrics["val"])
        if isinstance(metrics.get("val_balanced"), (int, float)):  # units since stop 46
            row["val_balanced"].setdefault(cfg["train"], []).append(metrics["val_balanced"])
        for protocol, acc in metrics["test"].items():
            row["columns"][f"{LABEL[cfg['train']]}/{LABEL[protocol]}"].append(acc)
    rank = {name: i for i, name in enumerate(order)}
    rows = dict(sorted(rows.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    return rows, units


#: The names of the model families (``config.json``'s ``family``) in the budget figure.
FAMILY_LABEL = {"qsv": "QSV-geometric", "vn": "VN-DGCNN", "dgcnn": "DGCNN",
                "pointnet2": "PointNet++"}
#: What makes two SO3-trained units the same recipe at different budgets.
RECIPE_KEYS = ("family", "model_kwargs", "augment", "class_weights", "lr", "points",
               "batch_size", "n_train", "npz")


def budget_curves(units: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The SO3/SO3 accuracy of every recipe trained at two or more budgets: SO3-trained
    units grouped by :data:`RECIPE_KEYS` (so only the budget differs), each group as
    ``{"label", "params", "rows", "budgets": {budget: {"test": [...], "val": [...],
    "seeds": [...]}}}`` (budgets ascending, units in seed order)."""
    groups: Dict[str, Dict[str, Any]] = {}
    for unit in units:
        cfg, metrics = unit["config"], unit["metrics"]
        if cfg["train"] != "so3" or "so3" not in metrics["test"]:
            continue
        key = json.dumps([cfg.get(k) for k in RECIPE_KEYS], sort_keys=True)
        kw = cfg.get("model_kwargs") or {}
        label = " ".join([FAMILY_LABEL.get(cfg.get("family"), str(cfg.get("family"))),
                          f"{metrics['params']:,} params",
                          *(f"{k}={v}" for k, v in sorted(kw.items())
                            if k != "hidden_channels"),
                          {None: "not augmented", "resample+scale": "augmented"}.get(
                              cfg.get("augment"), f"augment={cfg.get('augment')}"),
                          *([f"class_weights={cfg['class_weights']}"]
                            if cfg.get("class_weights") else [])])
        group = groups.setdefault(key, {"label": label, "params": metrics["params"],
                                        "rows": [], "budgets": {}})
        if cfg["row"] not in group["rows"]:
            group["rows"].append(cfg["row"])
        at = group["budgets"].setdefault(float(cfg["budget_cpu_s"]),
                                         {"test": [], "val": [], "seeds": []})
        at["test"].append(metrics["test"]["so3"])
        at["val"].append(metrics["val"])
        at["seeds"].append(cfg["seed"])
    curves = []
    for group in groups.values():
        if len(group["budgets"]) < 2:
            continue
        group["budgets"] = dict(sorted(group["budgets"].items()))
        curves.append(group)
    return sorted(curves, key=lambda g: (g["label"].split()[0], g["params"], g["label"]))


def per_class(units: Sequence[Dict[str, Any]], order: Sequence[str] = ()) -> str:
    """``per_class.md``: per row and protocol column, the test (and validation)
    accuracy of every class, mean over the seeds, for the units that recorded
    per-class results (those trained since stop 46); "" when none did."""
    groups: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for unit in units:
        cfg, metrics = unit["config"], unit["metrics"]
        classes = metrics.get("classes")
        tests = metrics.get("test_per_class")
        if not isinstance(classes, list) or not isinstance(tests, dict):
            continue
        for protocol, per in tests.items():
            column = f"{LABEL[cfg['train']]}/{LABEL[protocol]}"
            group = groups.setdefault((cfg["row"], column), {
                "classes": classes, "test": [], "val": [], "seeds": []})
            group["test"].append(per)
            group["val"].append(metrics.get("val_per_class"))
            group["seeds"].append(cfg["seed"])
    if not groups:
        return ""
    rank = {name: i for i, name in enumerate(order)}
    lines = ["### Per-class accuracy (%): test (validation in brackets), mean over seeds; "
             "units with per-class results only", ""]
    classes: Optional[List[str]] = None
    for (row, column), g in sorted(groups.items(),
                                   key=lambda kv: (rank.get(kv[0][0], len(rank)), kv[0])):
        if g["classes"] != classes:
            classes = g["classes"]
            head = ["model", "train/test", "seeds", *classes]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

        def mean(lists: List[Any], c: int) -> float:
            vals = [v[c] for v in lists if isinstance(v, list) and v[c] == v[c]]
            return 100 * statistics.fmean(vals) if vals else float("nan")

        cells = [f"{mean(g['test'], c):.1f} ({mean(g['val'], c):.1f})"
                 for c in range(len(classes))]
        lines.append("| " + " | ".join([row, column, str(len(g["seeds"])), *cells]) + " |")
    return "\n".join(lines) + "\n"


def plot_budget(path: Path, curves: Sequence[Dict[str, Any]], title: str) -> None:
    """``budget.png``: SO3/SO3 test accuracy (solid, mean ± std over seeds) and
    validation accuracy (dashed) against the CPU budget per unit, one colour per
    recipe of :func:`budget_curves`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 6))
    colours = plt.get_cmap("tab10").colors
    for i, curve in enumerate(curves):
        budgets = list(curve["budgets"])
        colour = colours[i % len(colours)]
        for field, style in (("test", "-o"), ("val", "--")):
            vals = [curve["budgets"][b][field] for b in budgets]
            means = [100 * statistics.fmean(v) for v in vals]
            stds = [100 * statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
            ax.errorbar(budgets, means, yerr=stds, fmt=style, color=colour, capsize=3,
                        label=curve["label"] + (" (val)" if field == "val" else ""))
    ax.set_xscale("log")
    ticks = sorted({b for curve in curves for b in curve["budgets"]})
    ax.set_xticks(ticks, [f"{b:g}" for b in ticks])
    ax.minorticks_off()
    ax.set_xlabel("CPU budget per unit (process-clock seconds)")
    ax.set_ylabel("SO3/SO3 accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def plot(path: Path, rows: Dict[str, Dict[str, Any]], chance: float, title: str,
         figsize: Tuple[float, float] = (12, 5), legend_columns: int = 4) -> None:
    """``accuracy.png``: test accuracy per protocol column (bars: rows, mean ± std
    over seeds), chance dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    x = np.arange(len(COLUMNS))
    width = 0.8 / max(len(rows), 1)
    # one colour per row (the default cycle repeats after ten rows)
    colours = (plt.get_cmap("tab20").colors if len(rows) <= 20
               else plt.get_cmap("turbo")(np.linspace(0, 1, len(rows))))
    for i, (name, row) in enumerate(rows.items()):
        vals = [row["columns"][c] for c in COLUMNS]
        means = [100 * statistics.fmean(v) if v else np.nan for v in vals]
        stds = [100 * statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, means, width, yerr=stds, label=name,
               capsize=2, color=colours[i])
    ax.axhline(100 * chance, ls="--", color="gray", lw=1, label="chance")
    ax.set_xticks(x, [f"train {c.split('/')[0]}\ntest {c.split('/')[1]}" for c in COLUMNS])
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    ax.legend(ncol=legend_columns, fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.16))
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def voting(dataset_root: Path, order: Sequence[str] = ()
           ) -> Tuple[str, List[Dict[str, Any]]]:
    """``voting.md`` (empty without any ``votes.json``) and its rows: per row, train
    protocol and number of draws, the validation and test accuracies of one draw
    and of voting on the same weights, mean ± std over seeds, and the mean paired
    gain. A ``votes.json`` that is unreadable or lacks a field is named and left out."""
    groups: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
    for path in sorted(Path(dataset_root).glob(f"**/{VOTES_FILE}")):
        data = read_json(path)
        try:
            key = (str(data["row"]), str(data["train"]), int(data["votes"]))
            entry = {"seed": int(data["seed"]), "final": bool(data["weights"]["final"]),
                     "val": (float(data["val"]["single"]), float(data["val"]["voted"])),
                     "test": {p: (float(v["single"]), float(v["voted"]))
                              for p, v in data["test"].items()}}
        except (TypeError, KeyError, ValueError, AttributeError) as error:
            print(f"warning: {path}: unreadable or incomplete ({type(error).__name__}: "
                  f"{error}); left out", file=sys.stderr)
            continue
        groups.setdefault(key, []).append(entry)
    if not groups:
        return "", []
    rank = {name: i for i, name in enumerate(order)}
    rows = []
    for (row, train, votes), entries in sorted(
            groups.items(), key=lambda kv: (rank.get(kv[0][0], len(rank)), kv[0])):
        cells = {"model": row, "train": LABEL[train], "votes": votes,
                 "seeds": len(entries),
                 "weights": "final" if all(e["final"] for e in entries) else
                 "last full epoch" if not any(e["final"] for e in entries) else "mixed"}
        parts = [("val", [e["val"] for e in entries])]
        parts += [(f"test {LABEL[train]}/{LABEL[p]}", [e["test"][p] for e in entries])
                  for p in VOTE_TESTS if all(p in e["test"] for e in entries)]
        for name, pairs in parts:
            cells[f"{name} single"] = fmt([a for a, _ in pairs])
            cells[f"{name} voted"] = fmt([b for _, b in pairs])
            cells[f"{name} gain"] = f"{100 * statistics.fmean(b - a for a, b in pairs):+.1f}"
        rows.append(cells)
    columns = list(dict.fromkeys(c for r in rows for c in r))
    lines = ["### Test-time voting: accuracy (%) of one draw of the points and of the mean "
             "softmax over N fresh draws, on the same weights (mean ± std over seeds; gain: "
             "mean paired difference)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "–")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n", rows


def report(out_root: Path, dataset: str, quiet: bool = False, order: Sequence[str] = ()
           ) -> Dict[str, Dict[str, Any]]:
    """``out_root/table.{md,csv}``, ``results.json``, ``accuracy.png`` and (with a
    recipe trained at two budgets or more) ``budget.png`` from the finished units
    under ``out_root/dataset``, rows in ``order``."""
    out_root = Path(out_root)
    rows, units = collect(out_root / dataset, order)
    if not rows:
        fail(f"no finished units under {out_root / dataset} (run without --report-only)")
    num_classes = max(u["config"]["num_classes"] for u in units)
    keys = ("points", "batch_size", "lr", "n_train", "n_val", "n_test")
    settings = ", ".join(f"{k} " + "/".join(sorted({str(u['config'].get(k)) for u in units}))
                         for k in keys)
    budgets = "/".join(f"{b:g}" for b in sorted({u["config"]["budget_cpu_s"] for u in units}))
    title = (f"{dataset} under rotations at equal CPU time per unit ({budgets} CPU-s, "
             f"process clock, encoding included): test accuracy (%) after the budget, "
             f"mean ± std over seeds; {settings}; chance {100 / num_classes:.1f} %")
    columns = ["model", "params", *COLUMNS, "val aligned", "val SO3", "val SO3 balanced",
               "CPU-s/epoch", "epochs", "budget CPU-s", "seeds"]
    table = []
    for name, row in rows.items():
        cells = {"model": name, "params": f"{row['params']:,}",
                 "CPU-s/epoch": f"{statistics.fmean(row['time']):.1f}",
                 "epochs": f"{statistics.fmean(row['epochs']):.1f}",
                 "budget CPU-s": "/".join(f"{b:g}" for b in sorted(row["budget"])),
                 "seeds": str(len(row["seeds"])),
                 "val aligned": fmt(row["val"].get("aligned", [])),
                 "val SO3": fmt(row["val"].get("so3", [])),
                 "val SO3 balanced": fmt(row["val_balanced"].get("so3", []))}
        for c in COLUMNS:
            cells[c] = fmt(row["columns"][c])
        table.append(cells)
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "–")) for c in columns) + " |" for r in table]
    text = "\n".join(lines) + "\n"
    try:
        out_root.mkdir(parents=True, exist_ok=True)
        write_text(out_root / "table.md", text)
        write_csv(out_root / "table.csv", columns, table)
        curves = budget_curves(units)
        votes_text, votes_rows = voting(out_root / dataset, order)
        if votes_text:
            write_text(out_root / "voting.md", votes_text)
        write_json(out_root / "results.json", {"title": title, "columns": columns,
                                               "rows": table, "units": units,
                                               "budget_curves": curves,
                                               "voting": votes_rows})
        classes_text = per_class(units, order)
        if classes_text:
            write_text(out_root / "per_class.md", classes_text)
        pub_cols = ["model", "z/z", "z/SO3", "SO3/SO3", "I/SO3"]
        pub = [f"### Published context: {PUBLISHED_NOTE}", "",
               "| " + " | ".join(pub_cols) + " |", "|" + "---|" * len(pub_cols)]
        pub += ["| " + " | ".join(r[c] for c in pub_cols) + " |" for r in PUBLISHED]
        write_text(out_root / "published_modelnet40.md", "\n".join(pub) + "\n")
        plot(out_root / "accuracy.png", rows, 1 / num_classes,
             f"{dataset}, {budgets} CPU-s per unit; {settings}")
        if curves:
            plot_budget(out_root / "budget.png", curves,
                        f"{dataset}: SO3/SO3 accuracy against the CPU budget per unit "
                        f"(test solid, validation dashed; mean ± std)")
    except OSError as error:
        fail(f"cannot write the report under {out_root}: {error}")
    if not quiet:
        print("\n" + text)
    return rows
