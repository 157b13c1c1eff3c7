"""Timing and memory helpers shared by the benchmark scripts.

Timings are medians of repeats after warm-up, with CUDA synchronisation when the
device is a GPU. Memory: the bytes autograd saves for backward, the activation
memory that dominates a layer's training footprint, counted with saved-tensor
hooks on every device; on CUDA also the allocator's peak.

Importing this module puts the checkout that holds it first on ``sys.path`` (the
scripts import it before ``qsv_pyg``): a script run from another checkout (a
worktree at an older commit, for an A/B) then times that checkout's package, not
the installed one (an editable install would otherwise win, and both sides of the
A/B would time the same code).
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [CHECKOUT]:
    sys.path.insert(0, CHECKOUT)

import torch  # noqa: E402

from qsv_pyg.training import run_files  # noqa: E402
from qsv_pyg.utils import cpu_name  # noqa: E402
from qsv_pyg.utils import resolve_device  # noqa: E402,F401  (the scripts import it from here)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], None], device: torch.device, repeats: int,
                warmup: int = 2, min_time: float = 0.0) -> float:
    """Median wall time of ``fn`` in seconds (at least ``repeats`` runs, more while
    the total is below ``min_time``)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start) < min_time:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * max(repeats, 1):
            break
    return statistics.median(times)


def interleaved_median_times(fns: Dict[str, Callable[[], None]], device: torch.device,
                             repeats: int, warmup: int = 2, min_time: float = 0.0,
                             inner: int = 3) -> Dict[str, float]:
    """Median wall time (seconds) of one call of every function, measured round-robin.

    Each round runs every function ``inner`` times in a row (each call timed),
    so a burst of load on a shared machine slows all of them alike and the
    ratios between them stay honest, while the first call after a switch (cold
    caches) does not set the median; rounds continue until each function ran
    ``repeats`` rounds and the rounds took ``min_time`` per function in total
    (capped at ``10 * repeats`` rounds).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: Dict[str, list] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or (time.perf_counter() - start) < min_time * len(fns):
        for name, fn in fns.items():
            for _ in range(inner):
                t0 = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - t0)
        rounds += 1
        if rounds >= 10 * max(repeats, 1):
            break
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory_of(fn: Callable[[], torch.Tensor], device: torch.device) -> Dict[str, float]:
    """Memory of one forward (+ backward of the returned scalar) in MiB.

    ``saved_mib``: the bytes autograd saves for backward (activation memory),
    every device; ``peak_mib`` (CUDA only): the allocator's peak above what was
    allocated before the call.
    """
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        # Count each storage once: many ops save views of the same tensor.
        try:
            key = t.untyped_storage().data_ptr()
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        return t

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    out = {"saved_mib": sum(seen.values()) / 2**20}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return out


def machine_info(device: torch.device) -> Dict[str, object]:
    import torch_geometric

    info: Dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_geometric": torch_geometric.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        import torch_scatter
        info["torch_scatter"] = torch_scatter.__version__
    except ImportError:
        info["torch_scatter"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = cpu_name()
    return info


def write_json(path: str, payload: dict) -> None:
    """Atomically write ``payload`` as JSON to ``path`` (its folder is created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    run_files.write_json(path, payload)
