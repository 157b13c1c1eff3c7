"""In-process A/B of two builds of the C++ CPU kernel, at the layer level.

QSVConv's forward+backward is timed with each build swapped in turn (the
module that :func:`qsv_pyg.nn._cpu_ext.cpu_kernel` returns), GATConv interleaved
on the same graph and features, round-robin in one process: on a shared VM,
where the same command's times move by tens of percent between runs, a
kernel change shows here and not in two separate runs of ``bench_conv.py``.

A build is a compiled kernel library (``.so``), or a checkout whose
``qsv_pyg/csrc/qsv_kernel_cpu.cpp`` is built here with that checkout's own
flags (the first time: about a minute each, cached under the torch extensions
folder). Example, the kernel at an older commit against this checkout's::

    git worktree add /tmp/old <commit>
    python benchmarks/ab_cpu_kernel.py /tmp/old . --ks 8 16 --rounds 45 --out ab.json

or one checkout's baseline (SSE2) build against its own choice of flags::

    python benchmarks/ab_cpu_kernel.py . . --flags-a "" --heads 8
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import sys
import time
from types import ModuleType
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402

import torch  # noqa: E402
from torch_geometric.nn import GATConv  # noqa: E402

import qsv_pyg.nn._cpu_ext as cpu_ext  # noqa: E402
from qsv_pyg.geometry import fibonacci_sphere, knn_within  # noqa: E402
from qsv_pyg.nn import QSVConv  # noqa: E402


def checkout_flags(path: str, extra: Optional[str] = None) -> tuple:
    """The compiler flags that checkout's own ``_cpu_ext`` builds with on this
    machine (its ``cflags()``, or its ``CFLAGS`` before that existed); with
    ``extra``, its base ``CFLAGS`` and these instead (``""``: the baseline build)."""
    spec = importlib.util.spec_from_file_location(
        "_ab_cpu_ext", os.path.join(path, "qsv_pyg", "nn", "_cpu_ext.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if extra is not None:
        return tuple(module.CFLAGS) + tuple(extra.split())
    return module.cflags() if hasattr(module, "cflags") else tuple(module.CFLAGS)


def load_build(path: str, extra_flags: Optional[str] = None) -> ModuleType:
    """A kernel library, or a checkout's kernel source built with the flags of
    that checkout (:func:`checkout_flags`)."""
    if os.path.isfile(path):
        name = os.path.basename(path).split(".")[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    source = os.path.join(path, "qsv_pyg", "csrc", "qsv_kernel_cpu.cpp")
    if not os.path.isfile(source):
        raise ValueError(f"{path} is neither a kernel library nor a checkout (no {source})")
    from torch.utils import cpp_extension

    flags = list(checkout_flags(path, extra_flags))
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(flags).encode()).hexdigest()[:12]
    name = f"qsv_pyg_ab_kernel_{digest}"
    directory = cpu_ext.build_directory(name)
    os.makedirs(directory, exist_ok=True)
    print(f"building {source} ({name}) ...", flush=True)
    return cpp_extension.load(name=name, sources=[source], extra_cflags=flags,
                              extra_ldflags=list(cpu_ext.LDFLAGS), build_directory=directory)


def run(builds: dict, n: int, k: int, channels: int, heads: int, rounds: int,
        skip: int) -> dict:
    torch.manual_seed(0)
    edge_index = knn_within(fibonacci_sphere(n), k)
    x = torch.randn(n, channels, requires_grad=True)
    layers = {"qsv": QSVConv(channels, channels // heads, heads=heads, check_finite=False),
              "gat": GATConv(channels, channels // heads, heads=heads)}
    names = list(builds) + ["gat"]
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 else names[::-1]:
            if name != "gat":
                cpu_ext._STATE.update(tried=True, module=builds[name])
            layer = layers["gat" if name == "gat" else "qsv"]
            t0 = time.perf_counter()
            out = layer(x, edge_index)
            out.backward(torch.ones_like(out))
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * statistics.median(t[skip:]) for name, t in times.items()}
    a, b = list(builds)
    return {"n": n, "k": k, "ms": ms, "b_over_a": ms[b] / ms[a],
            "a_over_gat": ms[a] / ms["gat"], "b_over_gat": ms[b] / ms["gat"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="build A: a kernel library (.so) or a checkout")
    parser.add_argument("b", help="build B: a kernel library (.so) or a checkout")
    parser.add_argument("--flags-a", default=None,
                        help="build A from its checkout's base CFLAGS plus these (\"\": "
                             "the baseline build) instead of its own choice")
    parser.add_argument("--flags-b", default=None, help="the same for build B")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=45)
    parser.add_argument("--skip", type=int, default=5, help="first rounds left out (warm-up)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="JSON file of the results")
    args = parser.parse_args(argv)
    if args.rounds <= args.skip:
        parser.error("--rounds must exceed --skip")
    torch.set_num_threads(args.threads)
    try:
        builds = {"a": load_build(args.a, args.flags_a), "b": load_build(args.b, args.flags_b)}
    except ValueError as exc:
        parser.error(str(exc))
    rows = []
    print("| k | A ms | B ms | GATConv ms | B / A | A / GATConv | B / GATConv |")
    print("|---|---|---|---|---|---|---|")
    for k in args.ks:
        row = run(builds, args.n, k, args.channels, args.heads, args.rounds, args.skip)
        rows.append(row)
        ms = row["ms"]
        print(f"| {k} | {ms['a']:.2f} | {ms['b']:.2f} | {ms['gat']:.2f} | {row['b_over_a']:.2f} "
              f"| {row['a_over_gat']:.2f} | {row['b_over_gat']:.2f} |", flush=True)
    if args.out:
        write_json(args.out, {"args": vars(args), "machine": machine_info(torch.device("cpu")),
                              "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
