"""Analyse a trained QSV model: routing entropy, rotation angles, interventions.

Given a checkpoint (or the run folder holding ``checkpoint.pt``)::

    python examples/analyze.py runs/qsv-seed0 --data-dir ../shared/data \\
        --test-subset 2000 --batch-size 250 --device auto

it measures, on the CIFAR test split of the run's dataset:

* per QSV layer and head, the routing entropy relative to uniform (``H / log k``,
  1 = uniform) and ``KL(alpha || uniform)`` in nats, averaged over the targets
  and the images of the first ``--stat-batches`` test batches;
* the distribution of relative rotation angles ``2 acos|Re r_ij|`` (degrees) over
  every edge and head (first test image when the quaternions depend on it);
* the test accuracy with every layer's routing made uniform, its transport made
  the identity, or both, at test time, and the change from the unmodified model.

It prints two markdown tables and writes ``analysis.json``, ``analysis.md``,
``routing_entropy.png`` and ``rotation_angles.png`` into ``--out`` (default:
``<run folder>/analysis``). Exit codes: 0 done, 2 unusable checkpoint, data or
model (the message says which file or what is missing).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

try:
    import qsv_pyg  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qsv_pyg.analysis import (  # noqa: E402
    INTERVENTIONS,
    NotQSVModelError,
    intervention_accuracy,
    load_model,
    qsv_layers,
    rotation_angles,
    routing_statistics,
    summarize_angles,
)
from qsv_pyg.data import BatchAugment, DataError, DeviceLoader, load_cifar  # noqa: E402
from qsv_pyg.utils import resolve_device  # noqa: E402
from qsv_pyg.training.checkpoint import CheckpointError  # noqa: E402

OUTPUT_FILES = ("analysis.json", "analysis.md", "routing_entropy.png", "rotation_angles.png")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="analyze.py",
        description="Routing entropy, rotation angles and test-time interventions of a "
                    "trained QSV model.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR",
                   help="checkpoint.pt, or a run folder that holds one")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="folder containing cifar-10-batches-py/ or cifar-100-python/ "
                        "(default: the run's data_dir, then $QSV_DATA_DIR)")
    p.add_argument("--test-subset", type=int, metavar="M", default=None,
                   help="evaluate on a class-balanced subset of M test images (default: all)")
    p.add_argument("--batch-size", type=int, metavar="B", default=250,
                   help="test images per batch (default: 250)")
    p.add_argument("--stat-batches", type=int, metavar="N", default=4,
                   help="test batches the routing statistics average over (default: 4)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available), cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default: <run folder>/analysis)")
    return p


# ============================================================================ analysis


def analyze(args: argparse.Namespace) -> Dict[str, Any]:
    """Run every measurement and return the report (see :func:`write_outputs`)."""
    for name in ("batch_size", "stat_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    device = resolve_device(args.device)
    model, cfg, file = load_model(args.checkpoint, device)
    layers = qsv_layers(model)  # fails clearly for ResNet-20 and the attention controls

    test_set = load_cifar(cfg.dataset, "test", args.data_dir or cfg.data_dir)
    if args.test_subset:
        test_set = test_set.subset(args.test_subset, seed=cfg.seed)
    loader = DeviceLoader(test_set, args.batch_size, device=device,
                          augment=BatchAugment.for_dataset(cfg.dataset, train=False))

    stat_batches: List[torch.Tensor] = []
    for images, _ in loader.epoch(0):
        stat_batches.append(images)
        if len(stat_batches) == args.stat_batches:
            break
    routing = routing_statistics(model, stat_batches)
    angles = {name: summarize_angles(a)
              for name, a in rotation_angles(model, stat_batches[0]).items()}

    interventions: Dict[str, Dict[str, float]] = {}
    for mode in INTERVENTIONS:  # "none" first: the reference of every delta
        acc = intervention_accuracy(model, loader, mode)
        interventions[mode] = {"acc": acc, "delta": acc - interventions.get(
            "none", {"acc": acc})["acc"]}

    return {
        "checkpoint": str(file),
        "model": cfg.model,
        "dataset": cfg.dataset,
        "description": model.describe() if hasattr(model, "describe") else cfg.model,
        "device": str(device),
        "test_images": len(test_set),
        "stat_images": sum(b.size(0) for b in stat_batches),
        "layers": list(layers),
        "routing": routing,
        "angles": angles,
        "interventions": interventions,
    }


# ============================================================================ outputs


def format_markdown(report: Dict[str, Any]) -> str:
    """The two tables (per layer and head; interventions) with a short header."""
    lines = [f"# Routing analysis: {report['model']} on {report['dataset']}", "",
             f"Checkpoint `{report['checkpoint']}`; {report['description']}.", "",
             f"Routing statistics over {report['stat_images']} test images; rotation "
             f"angles `2 acos|Re r_ij|` over every edge; accuracies over "
             f"{report['test_images']} test images.", "",
             "## Routing per layer and head", "",
             "| layer | head | routing | transport | k | β | H / log k | KL (nats) "
             "| median angle (°) | mean angle (°) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for layer in report["routing"]:
        ang = report["angles"][layer["layer"]]
        for h in range(layer["heads"]):
            lines.append(
                f"| {layer['layer']} | {h} | {layer['routing']} | {layer['transport']} "
                f"| {layer['degree']:g} | {layer['beta'][h]:.3f} "
                f"| {layer['entropy_ratio'][h]:.4f} | {layer['kl'][h]:.4f} "
                f"| {ang['median'][h]:.1f} | {ang['mean'][h]:.1f} |")
    lines += ["", "## Test-time interventions (every QSV layer)", "",
              "| intervention | test accuracy (%) | Δ vs none (pp) |",
              "|---|---:|---:|"]
    for mode, r in report["interventions"].items():
        lines.append(f"| {mode} | {100 * r['acc']:.2f} | {100 * r['delta']:+.2f} |")
    return "\n".join(lines) + "\n"


def _figure(width: float, height: float):
    # An explicit Agg canvas: no display and no change to pyplot's global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_entropy(report: Dict[str, Any], path: Path) -> None:
    """One bar per layer and head of ``H / log k``, with the uniform line at 1."""
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    bars = [(layer["layer"], h, v) for layer in report["routing"]
            for h, v in enumerate(layer["entropy_ratio"])]
    fig = _figure(max(6.0, 0.35 * len(bars) + 2.0), 4.0)
    ax = fig.add_subplot()
    xs: List[float] = []
    groups: Dict[str, List[float]] = {}
    x, prev = 0.0, None
    for name, _, _ in bars:
        if prev is not None and name != prev:
            x += 0.6  # a gap between layers
        xs.append(x)
        groups.setdefault(name, []).append(x)
        prev, x = name, x + 1.0
    for h in sorted({h for _, h, _ in bars}):
        sel = [i for i, (_, hh, _) in enumerate(bars) if hh == h]
        ax.bar([xs[i] for i in sel], [bars[i][2] for i in sel], width=0.85,
               color=cmap(h % 10), label=f"head {h}")
    ax.axhline(1.0, color="0.2", linestyle="--", linewidth=1, label="uniform (H = log k)")
    ax.set_xticks([sum(v) / len(v) for v in groups.values()], list(groups))
    ax.set_ylim(0.0, 1.25)  # room for the legend above the uniform line
    ax.set_ylabel("routing entropy  H / log k")
    ax.set_title("Routing entropy per layer and head")
    ax.legend(loc="upper right", fontsize=8, ncols=3)
    fig.savefig(path, dpi=120)


def plot_angles(report: Dict[str, Any], path: Path) -> None:
    """One histogram panel per layer: relative rotation angles, one line per head."""
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    names = list(report["angles"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = _figure(4.0 * cols, 2.8 * rows)
    for i, name in enumerate(names):
        a = report["angles"][name]
        ax = fig.add_subplot(rows, cols, i + 1)
        edges = a["bins"]
        for h, counts in enumerate(a["counts"]):
            ax.stairs(counts, edges, color=cmap(h % 10),
                      label=f"head {h} (median {a['median'][h]:.0f}°)")
        ax.set_xlim(0, 180)
        ax.set_title(name)
        ax.set_xlabel("rotation angle 2·acos|Re r| (°)")
        ax.set_ylabel("edges")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def write_outputs(report: Dict[str, Any], out: Path) -> Dict[str, Path]:
    """Write :data:`OUTPUT_FILES` into ``out``; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in OUTPUT_FILES}
    paths["analysis.json"].write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    paths["analysis.md"].write_text(format_markdown(report), encoding="utf-8")
    plot_entropy(report, paths["routing_entropy.png"])
    plot_angles(report, paths["rotation_angles.png"])
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = analyze(args)
    except NotQSVModelError as err:
        print(f"analyze.py: error: {args.checkpoint}: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, CheckpointError, DataError, ValueError) as err:
        print(f"analyze.py: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(report["checkpoint"]).parent / "analysis"
    paths = write_outputs(report, out)
    print(format_markdown(report))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
