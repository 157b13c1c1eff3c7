"""QSVConv against PyG's attention layers on the same Fibonacci kNN graphs.

Every layer sees the same graph (``knn_within`` on a Fibonacci sphere, no
self-loops), the same node features, the same number of heads and the same
input/output width. Reported per (N, k): median forward and forward+backward
times, memory, and each layer's time as a ratio to QSVConv's, measured side by
side in one run.

Examples::

    python benchmarks/bench_conv.py                       # N in {1k, 4k, 16k}, k in {8, 16, 32}
    python benchmarks/bench_conv.py --quick               # a 1-minute smoke run
    python benchmarks/bench_conv.py --sizes 1024 4096 16384 65536 --ks 16 --plot out.png
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (interleaved_median_times, machine_info, memory_of,  # noqa: E402
                    resolve_device, write_json)

from torch_geometric.nn import GATConv, GATv2Conv, SimpleConv, TransformerConv  # noqa: E402

from qsv_pyg.geometry import fibonacci_sphere, knn_within  # noqa: E402
from qsv_pyg.nn import QSVConv  # noqa: E402

LAYERS = ("qsv", "qsv-field", "gat", "gatv2", "transformer", "simple-sum")


def make_layer(name: str, channels: int, heads: int) -> torch.nn.Module:
    out = channels // heads
    if name in ("qsv", "qsv-field"):
        # "qsv": quaternions from the features (the drop-in layer);
        # "qsv-field": quaternions given per node, as QSVNet's learned field.
        return QSVConv(channels, out, heads=heads,
                       quat_source="features" if name == "qsv" else "given",
                       check_finite=False)
    if name == "gat":
        return GATConv(channels, out, heads=heads, add_self_loops=False)
    if name == "gatv2":
        return GATv2Conv(channels, out, heads=heads, add_self_loops=False)
    if name == "transformer":
        return TransformerConv(channels, out, heads=heads)
    if name == "simple-sum":
        return SimpleConv(aggr="sum")
    raise ValueError(f"unknown layer {name!r}; choose from {LAYERS}")


def bench_graph(n: int, k: int, layers: List[str], channels: int, heads: int,
                device: torch.device, repeats: int, min_time: float,
                seed: int = 0) -> Dict[str, Dict[str, float]]:
    gen = torch.Generator().manual_seed(seed)
    pos = fibonacci_sphere(n)
    edge_index = knn_within(pos, k).to(device)
    x = torch.randn(n, channels, generator=gen).to(device)
    quat = torch.randn(n, heads, 4, generator=gen).to(device)
    fwd: Dict[str, Callable[[], None]] = {}
    fwd_bwd: Dict[str, Callable[[], None]] = {}
    runs: Dict[str, Callable[[], torch.Tensor]] = {}
    for name in layers:
        torch.manual_seed(seed)
        layer = make_layer(name, channels, heads).to(device)
        xin = x.clone().requires_grad_(True)

        def run(layer=layer, xin=xin, name=name) -> torch.Tensor:
            if name == "qsv-field":
                return layer(xin, edge_index, quat=quat)
            return layer(xin, edge_index)

        def forward(run=run) -> None:
            with torch.no_grad():
                run()

        def forward_backward(run=run, xin=xin, layer=layer) -> None:
            out = run()
            out.sum().backward()
            xin.grad = None
            layer.zero_grad(set_to_none=True)

        runs[name], fwd[name], fwd_bwd[name] = run, forward, forward_backward
    # Layers alternate within every round of timing (see interleaved_median_times).
    t_fwd = interleaved_median_times(fwd, device, repeats, min_time=min_time)
    t_fwd_bwd = interleaved_median_times(fwd_bwd, device, repeats, min_time=min_time)
    results: Dict[str, Dict[str, float]] = {}
    for name in layers:
        results[name] = {"forward_ms": 1e3 * t_fwd[name], "fwd_bwd_ms": 1e3 * t_fwd_bwd[name]}
        results[name].update(memory_of(lambda: runs[name]().sum(), device))
    return results


def format_table(rows: List[dict], layers: List[str], key: str) -> str:
    ref = "qsv"
    head = ["N", "k"] + [f"{name} ms" for name in layers] + \
        [f"qsv/{name}" for name in layers if name != ref]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row["layers"]
        cells = [str(row["n"]), str(row["k"])]
        cells += [f"{r[name][key]:.2f}" for name in layers]
        cells += [f"{r[ref][key] / r[name][key]:.2f}" for name in layers if name != ref]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_time_vs_n(rows: List[dict], layers: List[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({row["k"] for row in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        sub = sorted((r for r in rows if r["k"] == k), key=lambda r: r["n"])
        for name in layers:
            ax.loglog([r["n"] for r in sub], [r["layers"][name]["fwd_bwd_ms"] for r in sub],
                      marker="o", label=name)
        ax.set_xlabel("nodes N")
        ax.set_ylabel("forward+backward (ms)")
        ax.set_title(f"k = {k}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="keep repeating until this many seconds were measured")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="N=1024, k=8/16, 3 repeats")
    parser.add_argument("--out", default="benchmarks/out/bench_conv.json")
    parser.add_argument("--plot", default=None, help="write a log-log time-vs-N figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.ks, args.repeats, args.min_time = [1024], [8, 16], 3, 0.0
    if "qsv" not in args.layers:
        args.layers = ["qsv"] + args.layers
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)

    from tqdm import tqdm
    rows = []
    grid = [(n, k) for n in args.sizes for k in args.ks]
    for n, k in tqdm(grid, desc="graphs"):
        rows.append({"n": n, "k": k, "layers": bench_graph(
            n, k, args.layers, args.channels, args.heads, device, args.repeats,
            args.min_time)})

    print(f"\nchannels={args.channels} heads={args.heads} device={device} "
          f"threads={torch.get_num_threads()}")
    print("\nforward + backward (median ms; ratio < 1 means QSVConv is faster)")
    print(format_table(rows, args.layers, "fwd_bwd_ms"))
    print("\nforward only (median ms)")
    print(format_table(rows, args.layers, "forward_ms"))
    mem_key = "peak_mib" if device.type == "cuda" else "saved_mib"
    print(f"\nmemory ({mem_key}, MiB)")
    head = ["N", "k"] + args.layers
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join([str(row["n"]), str(row["k"])] + [
            f"{row['layers'][name][mem_key]:.1f}" for name in args.layers]) + " |")

    payload = {"args": vars(args), "machine": machine_info(device), "results": rows}
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")
    if args.plot:
        plot_time_vs_n(rows, args.layers, args.plot)
        print(f"wrote {args.plot}")
    return payload


if __name__ == "__main__":
    main()
