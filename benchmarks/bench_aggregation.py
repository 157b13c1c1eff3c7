"""The attention-weighted neighbour sum, implemented five ways, side by side.

The kernel of every attention layer is ``z_i = sum_j alpha_ij x_j`` over a graph
with ``k`` incoming edges per target. This measures forward+backward (w.r.t.
both ``alpha`` and ``x``) of the candidates that QSVConv's design was chosen from:

* ``spmm``: one CSR matrix per head, SpMM forward, SpMM + SDDMM backward
  (QSVConv's fixed-degree kernel when the routing is shared by the batch);
* ``gather``: ``index_select`` + multiply + sum, custom backward with
  ``index_add_`` (QSVConv's fixed-degree kernel otherwise);
* ``index_add``: per-edge messages and a ``torch.index_add`` scatter (autograd);
* ``torch-scatter``: per-edge messages and ``torch_scatter.scatter`` (sum);
* ``segment-csr``: per-edge messages sorted by target and
  ``torch_scatter.segment_csr`` (edges already target-sorted, so no permutation).

    python benchmarks/bench_aggregation.py --sizes 4096 16384 --k 16
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, median_time, resolve_device, write_json  # noqa: E402

from qsv_pyg.nn.fixed_degree import _WeightedNeighborSum, weighted_neighbor_sum  # noqa: E402


def candidates():
    import torch_scatter

    def spmm(alpha, x, nbr, ptr):
        return weighted_neighbor_sum(alpha, x, nbr)

    def gather(alpha, x, nbr, ptr):
        return _WeightedNeighborSum.apply(alpha, x, nbr)

    def messages(alpha, x, nbr):
        n, k = nbr.shape
        return (alpha.reshape(n * k, -1, 1) * x.index_select(0, nbr.reshape(-1)))

    def index_add(alpha, x, nbr, ptr):
        dst = torch.arange(nbr.size(0), device=x.device).repeat_interleave(nbr.size(1))
        return torch.zeros(nbr.size(0), *x.shape[1:], device=x.device, dtype=x.dtype) \
            .index_add(0, dst, messages(alpha, x, nbr))

    def scatter(alpha, x, nbr, ptr):
        dst = torch.arange(nbr.size(0), device=x.device).repeat_interleave(nbr.size(1))
        return torch_scatter.scatter(messages(alpha, x, nbr), dst, dim=0,
                                     dim_size=nbr.size(0), reduce="sum")

    def segment(alpha, x, nbr, ptr):
        return torch_scatter.segment_csr(messages(alpha, x, nbr), ptr, reduce="sum")

    return {"spmm": spmm, "gather": gather, "index_add": index_add,
            "torch-scatter": scatter, "segment-csr": segment}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=16, help="per head")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="benchmarks/out/bench_aggregation.json")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    funcs = candidates()
    rows = []
    for n in args.sizes:
        gen = torch.Generator().manual_seed(0)
        nbr = torch.randint(0, n, (n, args.k), generator=gen).to(device)
        ptr = torch.arange(0, n * args.k + 1, args.k, device=device)
        alpha = torch.softmax(torch.randn(n, args.k, args.heads, generator=gen), 1).to(device)
        x = torch.randn(n, args.heads, args.channels, generator=gen).to(device)
        ref = funcs["gather"](alpha, x, nbr, ptr)
        row = {"n": n, "k": args.k}
        for name, fn in funcs.items():
            a = alpha.clone().requires_grad_(True)
            v = x.clone().requires_grad_(True)
            assert torch.allclose(fn(a, v, nbr, ptr), ref, atol=1e-5), name

            def run():
                fn(a, v, nbr, ptr).sum().backward()
                a.grad = v.grad = None
            row[name] = 1e3 * median_time(run, device, args.repeats)
        rows.append(row)
    names = list(funcs)
    print(f"\nforward+backward ms (median), heads={args.heads}, channels/head={args.channels}, "
          f"device={device}, threads={torch.get_num_threads()}")
    print("| N | k | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2))
    for r in rows:
        print(f"| {r['n']} | {r['k']} | " + " | ".join(f"{r[m]:.2f}" for m in names) + " |")
    payload = {"args": vars(args), "machine": machine_info(device), "results": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
