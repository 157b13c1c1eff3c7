"""QSVConv against PyG's attention layers, a bare SpMM and a spherical peer.

Graph families (``--graphs``): ``knn`` (``knn_within`` on a Fibonacci sphere,
target-sorted, exactly ``k`` edges per target), ``random`` (``N * k`` edges
with uniform random sources and targets: variable in-degree, shuffled order)
and ``s2`` (the equiangular grids of torch-harmonics' ``NeighborhoodAttentionS2``,
with QSVConv on a kNN graph of the same number of points and mean neighbour
count; skipped when torch-harmonics is not installed: ``pip install --no-deps
torch-harmonics``). Every layer sees the same graph, features, heads and width.
``spmm`` is the floor: one CSR sparse-dense product of the features over the
same edges (and its transposed product in the backward). Reported per graph:
median forward and forward+backward times, memory, and each layer's time as a
ratio to QSVConv's, measured side by side in one run.

Examples::

    python benchmarks/bench_conv.py                       # N in {1k, 4k, 16k}, k in {8, 16, 32}
    python benchmarks/bench_conv.py --quick               # a 1-minute smoke run
    python benchmarks/bench_conv.py --graphs random --channels 64 --heads 16
    python benchmarks/bench_conv.py --graphs s2 --s2-nlat 32 --s2-cutoffs 0.1 0.16
    python benchmarks/bench_conv.py --device cuda --amp bf16   # under bf16 autocast

A layer that fails on a graph (e.g. no kernel for a dtype) is left out of that
graph's timings; its error is kept in the row's ``errors``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (interleaved_median_times, machine_info, memory_of,  # noqa: E402
                    resolve_device, write_json)

from torch_geometric.nn import GATConv, GATv2Conv, SimpleConv, TransformerConv  # noqa: E402

from qsv_pyg.geometry import fibonacci_sphere, knn_within  # noqa: E402
from qsv_pyg.nn import QSVConv  # noqa: E402

LAYERS = ("qsv", "qsv-composed", "qsv-field", "gat", "gatv2", "transformer", "simple-sum",
          "spmm")
AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAPHS = ("knn", "random", "s2")
S2_LAYERS = ("qsv", "qsv-field", "nattn-s2", "spmm")


def random_graph(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``n * k`` edges, sources and targets uniform: variable in-degree, shuffled."""
    return torch.randint(0, n, (2, n * k), generator=gen)


def _csr(rows: torch.Tensor, cols: torch.Tensor, n: int) -> torch.Tensor:
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=n)
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.sparse_csr_tensor(crow, cols[order], torch.ones(rows.numel()), (n, n))


class _AdjacencyProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, adj, adj_t):
        ctx.adj_t = adj_t
        return adj @ x

    @staticmethod
    def backward(ctx, grad):
        return ctx.adj_t @ grad, None, None


class SpMM(torch.nn.Module):
    """The floor: ``A @ x`` with ``A`` the graph's CSR adjacency (ones); the
    backward is one SpMM with the precomputed ``A^T``."""

    def __init__(self, edge_index: torch.Tensor, n: int):
        super().__init__()
        self.adj = _csr(edge_index[1], edge_index[0], n)
        self.adj_t = _csr(edge_index[0], edge_index[1], n)

    def _apply(self, fn, *args, **kwargs):
        self.adj, self.adj_t = fn(self.adj), fn(self.adj_t)
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AdjacencyProduct.apply(x, self.adj, self.adj_t)


#: The layers that take edge features (``--edge-dim``): built with ``edge_dim``
#: and called with ``edge_attr``; the others run without them.
EDGE_LAYERS = ("qsv", "qsv-composed", "qsv-field", "gat", "gatv2", "transformer")


class Composed(torch.nn.Module):
    """A QSVConv whose calls compose ``qsv_pyg::attend`` with the layer's own ops
    (``QSV_PYG_FUSED_LAYER=0`` while it runs): on the Triton path, the same layer
    as ``"qsv"`` without the one-operator layer (``qsv_pyg.nn.fused_layer``), so
    one run measures what that operator gains; elsewhere the same as ``"qsv"``."""

    def __init__(self, layer: QSVConv):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        from qsv_pyg.nn.fused_layer import FUSED_LAYER_ENV
        old = os.environ.get(FUSED_LAYER_ENV)
        os.environ[FUSED_LAYER_ENV] = "0"
        try:
            return self.layer(*args, **kwargs)
        finally:
            if old is None:
                del os.environ[FUSED_LAYER_ENV]
            else:
                os.environ[FUSED_LAYER_ENV] = old


def make_layer(name: str, channels: int, heads: int,
               edge_dim: Optional[int] = None) -> torch.nn.Module:
    out = channels // heads
    edge = {"edge_dim": edge_dim} if edge_dim and name in EDGE_LAYERS else {}
    if name in ("qsv", "qsv-composed", "qsv-field"):
        # "qsv": quaternions from the features (the drop-in layer); "qsv-composed":
        # the same, composed (class Composed); "qsv-field": quaternions given per
        # node, as QSVNet's learned field.
        layer = QSVConv(channels, out, heads=heads,
                        quat_source="given" if name == "qsv-field" else "features",
                        check_finite=False, **edge)
        return Composed(layer) if name == "qsv-composed" else layer
    if name == "gat":
        return GATConv(channels, out, heads=heads, add_self_loops=False, **edge)
    if name == "gatv2":
        return GATv2Conv(channels, out, heads=heads, add_self_loops=False, **edge)
    if name == "transformer":
        return TransformerConv(channels, out, heads=heads, **edge)
    if name == "simple-sum":
        return SimpleConv(aggr="sum")
    if name in ("spmm", "nattn-s2"):
        raise ValueError(f"layer {name!r} is built per graph (see bench_graph)")
    raise ValueError(f"unknown layer {name!r}; choose from {LAYERS}")


def s2_peer(nlat: int, cutoff: float, channels: int, heads: int):
    """torch-harmonics' neighbourhood attention on an ``nlat x 2 nlat`` grid, and
    its mean neighbour count (or ``None`` when torch-harmonics is absent)."""
    try:
        from torch_harmonics import NeighborhoodAttentionS2
    except ImportError:
        return None, 0
    layer = NeighborhoodAttentionS2(channels, in_shape=(nlat, 2 * nlat),
                                    out_shape=(nlat, 2 * nlat), num_heads=heads,
                                    theta_cutoff=cutoff)
    # psi lists the neighbours of one output point per latitude (longitude shifts).
    return layer, round(layer.psi_col_idx.numel() / nlat)


def bench_graph(n: int, k: int, layers: List[str], channels: int, heads: int,
                device: torch.device, repeats: int, min_time: float, graph: str = "knn",
                peer: torch.nn.Module = None, seed: int = 0, amp: str = "none",
                errors: Dict[str, str] = None,
                edge_dim: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    gen = torch.Generator().manual_seed(seed)
    dtype = AMP[amp]

    def autocast():
        return (torch.autocast(device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    if graph == "random":
        edge_index = random_graph(n, k, gen).to(device)
    else:
        # Built on the device: exact kNN of 64k points is seconds on a CPU without
        # torch-cluster, milliseconds on a GPU (on the CPU this is what it was).
        edge_index = knn_within(fibonacci_sphere(n).to(device), k)
    x = torch.randn(n, channels, generator=gen).to(device)
    quat = torch.randn(n, heads, 4, generator=gen).to(device)
    edge_attr = (torch.randn(edge_index.size(1), edge_dim, generator=gen).to(device)
                 if edge_dim else None)
    fwd: Dict[str, Callable[[], None]] = {}
    fwd_bwd: Dict[str, Callable[[], None]] = {}
    runs: Dict[str, Callable[[], torch.Tensor]] = {}
    for name in layers:
        torch.manual_seed(seed)
        if name == "spmm":
            layer = SpMM(edge_index.cpu(), n).to(device)
        elif name == "nattn-s2":
            layer = peer.to(device)
        else:
            layer = make_layer(name, channels, heads, edge_dim).to(device)
        xin = x.clone().requires_grad_(True)
        if name == "nattn-s2":  # [1, C, nlat, nlon]
            nlat = layer.nlat_in
            xin = x.t().reshape(1, channels, nlat, 2 * nlat).clone().requires_grad_(True)

        def run(layer=layer, xin=xin, name=name) -> torch.Tensor:
            edge = {"edge_attr": edge_attr} if edge_dim and name in EDGE_LAYERS else {}
            with autocast():
                if name == "qsv-field":
                    return layer(xin, edge_index, quat=quat, **edge).float()
                if name in ("spmm", "nattn-s2"):
                    return layer(xin).float()
                return layer(xin, edge_index, **edge).float()

        def forward(run=run) -> None:
            with torch.no_grad():
                run()

        def forward_backward(run=run, xin=xin, layer=layer) -> None:
            out = run()
            out.sum().backward()
            xin.grad = None
            layer.zero_grad(set_to_none=True)

        try:  # one untimed call: a layer that cannot run here is left out
            forward_backward()
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
            if errors is None:
                raise
            errors[name] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            continue
        runs[name], fwd[name], fwd_bwd[name] = run, forward, forward_backward
    # Layers alternate within every round of timing (see interleaved_median_times).
    t_fwd = interleaved_median_times(fwd, device, repeats, min_time=min_time)
    t_fwd_bwd = interleaved_median_times(fwd_bwd, device, repeats, min_time=min_time)
    results: Dict[str, Dict[str, float]] = {}
    for name in runs:
        results[name] = {"forward_ms": 1e3 * t_fwd[name], "fwd_bwd_ms": 1e3 * t_fwd_bwd[name]}
        results[name].update(memory_of(lambda: runs[name]().sum(), device))
    return results


def format_table(rows: List[dict], layers: List[str], key: str) -> str:
    ref = "qsv"
    head = ["graph", "N", "k"] + [f"{name} ms" for name in layers] + \
        [f"qsv/{name}" for name in layers if name != ref]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row["layers"]
        cells = [row["graph"], str(row["n"]), str(row["k"])]
        cells += [f"{r[name][key]:.2f}" if name in r else "-" for name in layers]
        cells += [f"{r[ref][key] / r[name][key]:.2f}" if name in r and ref in r else "-"
                  for name in layers if name != ref]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_time_vs_n(rows: List[dict], layers: List[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({row["k"] for row in rows if row["graph"] == "knn"}) or [0]
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        sub = sorted((r for r in rows if r["k"] == k and r["graph"] == "knn"),
                     key=lambda r: r["n"])
        for name in layers:
            if not all(name in r["layers"] for r in sub):
                continue
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
    parser.add_argument("--graphs", nargs="+", default=["knn", "random"], choices=GRAPHS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--s2-nlat", type=int, nargs="+", default=[32],
                        help="s2 graphs: latitudes of the equiangular grid (2 nlat^2 points)")
    parser.add_argument("--s2-cutoffs", type=float, nargs="+", default=[0.1, 0.16],
                        help="s2 graphs: neighbourhood radii (radians)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="keep repeating until this many seconds were measured")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--amp", default="none", choices=list(AMP),
                        help="run the layers under autocast to this dtype (CUDA)")
    parser.add_argument("--edge-dim", type=int, default=None,
                        help="give the layers that take edge features (%s) random "
                             "edge features of this width" % ", ".join(EDGE_LAYERS))
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
    if args.amp != "none" and device.type != "cuda":
        parser.error("--amp needs a CUDA device")

    from tqdm import tqdm
    rows = []
    grid = [(g, n, k) for g in args.graphs if g != "s2" for n in args.sizes for k in args.ks]
    for g, n, k in tqdm(grid, desc="graphs"):
        errors: Dict[str, str] = {}
        rows.append({"graph": g, "n": n, "k": k, "layers": bench_graph(
            n, k, args.layers, args.channels, args.heads, device, args.repeats,
            args.min_time, graph=g, amp=args.amp, errors=errors, edge_dim=args.edge_dim)})
        if errors:
            rows[-1]["errors"] = errors
            print(f"{g} N={n} k={k}: left out {errors}")
    if "s2" in args.graphs:
        for nlat in args.s2_nlat:
            for cutoff in args.s2_cutoffs:
                peer, k = s2_peer(nlat, cutoff, args.channels, args.heads)
                if peer is None:
                    print("torch-harmonics is not installed: s2 graphs skipped "
                          "(pip install --no-deps torch-harmonics)")
                    break
                layers = [x for x in S2_LAYERS if x in args.layers + ["nattn-s2"]]
                rows.append({"graph": "s2", "n": 2 * nlat * nlat, "k": k, "cutoff": cutoff,
                             "layers": bench_graph(2 * nlat * nlat, k, layers, args.channels,
                                                   args.heads, device, args.repeats,
                                                   args.min_time, graph="s2", peer=peer)})

    print(f"\nchannels={args.channels} heads={args.heads} device={device} "
          f"threads={torch.get_num_threads()} edge_dim={args.edge_dim}")
    print("\nforward + backward (median ms; ratio < 1 means QSVConv is faster)")
    layers = list(dict.fromkeys(x for row in rows for x in row["layers"]))
    print(format_table(rows, layers, "fwd_bwd_ms"))
    print("\nforward only (median ms)")
    print(format_table(rows, layers, "forward_ms"))
    mem_key = "peak_mib" if device.type == "cuda" else "saved_mib"
    print(f"\nmemory ({mem_key}, MiB)")
    head = ["graph", "N", "k"] + layers
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join([row["graph"], str(row["n"]), str(row["k"])] + [
            f"{row['layers'][name][mem_key]:.1f}" if name in row["layers"] else "-"
            for name in layers]) + " |")

    from qsv_pyg.nn import triton_kernel
    # the Triton row kernels' tuned launch configurations (issue 32 item 8d), if any
    payload = {"args": vars(args), "machine": machine_info(device), "results": rows,
               "triton_tuned": triton_kernel.tuned()}
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")
    if args.plot:
        plot_time_vs_n(rows, layers, args.plot)
        print(f"wrote {args.plot}")
    return payload


if __name__ == "__main__":
    main()
