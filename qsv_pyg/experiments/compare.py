"""Shared parts of the comparison examples (``examples/node_classification.py``,
``graph_classification.py``, ``point_clouds.py``) and of the real-data tables
(:mod:`~qsv_pyg.experiments.citation_table`, :mod:`~qsv_pyg.experiments.tu_table`,
``benchmarks/modelnet_legacy.py``).

The models: PyG's ``GAT`` (GATConv), ``GAT(v2=True)`` (GATv2Conv), a ``BasicGNN`` of
TransformerConv layers, and :class:`qsv_pyg.nn.models.QSV`, all with the same depth,
heads, dropout and normalisation; each control's hidden width is chosen so that its
parameter count is closest to the QSV model's. Results print as a markdown table of
mean ± std over seeds.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from torch_geometric.nn import TransformerConv, global_mean_pool
from torch_geometric.nn.models import GAT
from torch_geometric.nn.models.basic_gnn import BasicGNN

from ..models.matching import count_parameters, match_width
from ..nn import unit_quaternion
from ..nn.models import QSV
from ..training.run_files import write_csv, write_json, write_text
from .units import (NUMBER, add_data_dir_arg, check_folder, dataset_copy, default_data_dir,
                    fail, finished_unit, read_units, run_in_workers, run_unit)


class Transformer(BasicGNN):
    """``BasicGNN`` of :class:`~torch_geometric.nn.conv.TransformerConv` layers, built
    like PyG's ``GAT`` (concatenated heads, averaged in a layer mapping to the output)."""
    supports_edge_weight = False
    supports_edge_attr = True

    def init_conv(self, in_channels, out_channels, **kwargs):
        heads = kwargs.pop("heads", 1)
        concat = not getattr(self, "_is_conv_to_out", False)
        if concat:
            out_channels = out_channels // heads
        return TransformerConv(in_channels, out_channels, heads=heads, concat=concat,
                               dropout=self.dropout.p, **kwargs)


def _controls() -> Dict[str, Callable[..., BasicGNN]]:
    return {
        "GAT": lambda *a, **kw: GAT(*a, **kw),
        "GATv2": lambda *a, **kw: GAT(*a, v2=True, **kw),
        "Transformer": lambda *a, **kw: Transformer(*a, **kw),
    }


CONTROLS = tuple(_controls())


def matched_width(build: Callable[[int], torch.nn.Module], target: int, step: int = 1,
                  base: int = 64) -> torch.nn.Module:
    """``build(width)`` at the width (a positive multiple of ``step``) whose parameter
    count is closest to ``target``: :func:`~qsv_pyg.models.matching.match_width`
    over the scale of ``base``. The search runs under a forked RNG and the chosen
    width is built once more after it, so the model's initial weights depend on
    the seed alone, not on how many candidates the search built."""
    def width(scale: float) -> int:
        return step * max(1, round(base * scale / step))

    with torch.random.fork_rng(devices=[]):
        _, scale = match_width(lambda s: build(width(s)), target, tol=0.5)
    return build(width(scale))


def matched_control(name: str, in_channels: int, target: int, num_layers: int,
                    out_channels: Optional[int], heads: int, **kwargs) -> BasicGNN:
    """The control ``name`` whose hidden width (a multiple of ``heads``) gives the
    parameter count closest to ``target`` (:func:`matched_width`)."""
    build = _controls()[name]
    return matched_width(lambda w: build(in_channels, w, num_layers, out_channels,
                                         heads=heads, **kwargs), target, step=heads)


class PoolClassifier(torch.nn.Module):
    """Graph classification: ``gnn`` node embeddings, mean-pooled per graph, then a
    linear map to the classes. ``inputs(batch)`` gives extra keyword arguments of
    the GNN's forward (e.g. ``quat``)."""

    def __init__(self, gnn: BasicGNN, num_classes: int,
                 inputs: Optional[Callable[[object], dict]] = None) -> None:
        super().__init__()
        self.gnn = gnn
        self.head = torch.nn.Linear(gnn.out_channels, num_classes)
        self.inputs = inputs

    def forward(self, batch) -> torch.Tensor:
        extra = self.inputs(batch) if self.inputs is not None else {}
        h = self.gnn(batch.x, batch.edge_index, **extra)
        return self.head(global_mean_pool(h, batch.batch))


def train_graphs(model: torch.nn.Module, train_loader, test_loaders: Dict[str, object],
                 epochs: int, lr: float = 0.01) -> dict:
    """Adam on cross-entropy; returns the accuracy on every test loader after the
    last epoch and the mean seconds per training epoch."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    timer = Timer()
    warm_up(lambda: model(next(iter(train_loader))).sum(), model)

    def one_epoch() -> None:
        model.train()
        for batch in train_loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(batch), batch.y).backward()
            optimizer.step()

    for _ in range(epochs):
        timer.epoch(one_epoch)
    model.eval()
    result = {"time": timer.per_epoch}
    with torch.no_grad():
        for name, loader in test_loaders.items():
            correct = total = 0
            for batch in loader:
                correct += int((model(batch).argmax(-1) == batch.y).sum())
                total += batch.y.numel()
            result[name] = correct / total
    return result


def rotation_angle(model: QSV, x: torch.Tensor, edge_index: torch.Tensor,
                   quat: Optional[torch.Tensor] = None) -> float:
    """Mean angle in degrees, over the edges and heads, of the relative rotations
    :math:`r_{ij} = q_i^* q_j` of ``model``'s first layer: ``2 acos |Re r|``."""
    conv = model.convs[0]
    with torch.no_grad():
        if model.quat_field is not None:
            q = model.quat_field
        elif quat is not None:
            q = quat.view(quat.size(0), -1, 4)
        else:
            q = conv.lin_quat(x).view(x.size(0), conv.heads, 4)
        q = unit_quaternion(q)
        src, dst = edge_index
        re = (q[dst] * q[src]).sum(-1).abs().clamp(max=1.0)
        return float(torch.rad2deg(2 * re.acos()).mean())


def warm_up(loss: Callable[[], torch.Tensor], model: torch.nn.Module) -> None:
    """One untimed forward and backward (no step): one-off costs such as building
    a kernel on first use stay out of the time per epoch."""
    loss().backward()
    model.zero_grad()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)


class Timer:
    """Accumulates the CPU seconds of the training epochs (this process's CPU
    time: on cores shared with other jobs it varies less than wall time; with
    ``--threads 1`` it is close to the wall time of a quiet machine)."""

    def __init__(self) -> None:
        self.seconds: List[float] = []

    def epoch(self, fn: Callable[[], None]) -> None:
        start = time.process_time()
        fn()
        self.seconds.append(time.process_time() - start)

    @property
    def per_epoch(self) -> float:
        return sum(self.seconds) / max(len(self.seconds), 1)


def fmt(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std``; a single value alone (one seed has no spread to show, and
    ``± 0.0`` would read as a measured zero)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def print_table(title: str, rows: List[dict], metrics: Sequence[str]) -> None:
    """One markdown table: a row per model, ``metrics`` as mean ± std over seeds."""
    print(f"\n### {title}\n")
    print("| model | params | " + " | ".join(metrics) + " | CPU s/epoch |")
    print("|---|---:|" + "---:|" * len(metrics) + "---:|")
    for row in rows:
        # Angles (degrees) to one decimal, accuracies to three.
        cells = [fmt(row[m], 1 if "°" in m else 3) if m in row else "–" for m in metrics]
        print(f"| {row['model']} | {row['params']:,} | " + " | ".join(cells)
              + f" | {fmt(row['time'], 4)} |")


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (default 3)")
    parser.add_argument("--small", action="store_true",
                        help="tiny sizes for a test run of a few seconds")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1)")
    parser.add_argument("--models", default=None,
                        help="comma-separated prefixes: run only the rows whose model "
                             "name starts with one of them (e.g. 'QSV,GAT')")
    return parser


def selected(specs: List[tuple], models: Optional[str]) -> List[tuple]:
    """The ``(name, ...)`` rows of ``specs`` chosen by ``--models``."""
    if models is None:
        return specs
    prefixes = tuple(m.strip() for m in models.split(",") if m.strip())
    chosen = [spec for spec in specs if spec[0].startswith(prefixes)]
    if not chosen:
        print(f"error: --models {models!r} matches none of: "
              f"{', '.join(spec[0] for spec in specs)}", file=sys.stderr)
        raise SystemExit(2)
    return chosen


def collect(results: Dict[str, dict], name: str, params: int, time_per_epoch: float,
            **metrics: float) -> None:
    """Append one seed's numbers to the row ``name`` of ``results``."""
    row = results.setdefault(name, {"model": name, "params": params, "time": []})
    row["time"].append(time_per_epoch)
    for key, value in metrics.items():
        row.setdefault(key, []).append(value)


# ------------------------------------------------------------ real-data tables
# citation_table, tu_table and benchmarks/modelnet_legacy.py train every unit of their table (one
# model on one seed, fold or protocol) in its own run folder under --out-root
# (config.json, log.jsonl, metrics.json; run.lock while it trains). The machinery
# (the unit's lock, reuse and restart, --report-only's reading, the dataset
# cache, the worker pool) is qsv_pyg.experiments.units; a rerun of the same
# command reuses finished units and restarts unfinished ones, so a table can be
# built in pieces and rebuilt from committed files (--report-only).


def source_commit() -> str:
    """The git commit of the qsv_pyg checkout (``-dirty`` with local changes to the
    package), or ``"unknown"``: a layer's speed depends on its code, so the example
    scripts record it in every unit's ``metrics.json``."""
    import qsv_pyg

    package = Path(qsv_pyg.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=package,
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=package,
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def write_table(stem: Path, columns: Sequence[str], rows: List[Dict[str, Any]],
                title: str = "") -> str:
    """Write ``rows`` (dicts keyed by ``columns``) as ``stem.md`` (a markdown table
    under ``title``), ``stem.csv`` and ``stem.json``; returns the markdown."""
    check_folder(stem.parent, "--out-root")
    stem.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "–")) for c in columns) + " |"
              for row in rows]
    text = "\n".join(lines) + "\n"
    try:
        write_text(stem.with_suffix(".md"), text)
        write_csv(stem.with_suffix(".csv"), columns, rows)
        write_json(stem.with_suffix(".json"), {"title": title, "columns": list(columns),
                                               "rows": rows})
    except OSError as error:  # a read-only or full --out-root: one line
        fail(f"cannot write the table {stem}: {error}")
    return text


def mean_std(values: Sequence[float], scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± std`` of ``values`` times ``scale`` (accuracies in %)."""
    return fmt([v * scale for v in values], digits)


def add_data_args(parser: argparse.ArgumentParser, dataset: str, out_root: str) -> None:
    """``--data-dir`` (``--data-root``: its deprecated alias), ``--dataset``,
    ``--out-root`` and ``--report-only`` of the real-data tables."""
    add_data_dir_arg(parser)
    parser.add_argument("--dataset", default=dataset, help=f"dataset (default {dataset})")
    parser.add_argument("--out-root", type=Path, default=Path(out_root),
                        help=f"run folders and the table (default {out_root})")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the table from the run folders without training")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


__all__ = ["QSV", "Transformer", "PoolClassifier", "train_graphs", "CONTROLS",
           "count_parameters", "matched_width", "matched_control", "seed_all",
           "rotation_angle", "Timer", "warm_up", "fmt", "print_table", "base_parser",
           "selected", "collect", "default_data_dir", "fail", "finished_unit",
           "run_unit", "read_units", "write_table", "dataset_copy", "check_folder",
           "run_in_workers", "NUMBER", "mean_std", "add_data_args"]
