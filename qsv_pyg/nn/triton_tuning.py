r"""Launch configurations of the Triton row kernels (:mod:`qsv_pyg.nn.triton_kernel`)
and their tuning.

Launch configurations (:class:`Config`: ``BE`` edges per step, ``TARGETS``
rows per program, ``num_warps``): the heuristic one by default (``BE`` and the
warps from the tile size, one row per program); on CUDA each row kernel is
tuned once per key (:func:`tuning_key`: heads, blocks of four, key width, mean
degree bucket, dtype and flags) over at most five :func:`candidates` and the
fastest kept (:data:`TUNED`, :func:`tuned` for reports). ``QSV_PYG_AUTOTUNE``
(``auto``/``1``/``0``) controls it; never in deterministic mode or while a
CUDA graph is captured (the heuristic configuration: bit-identical reruns).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


#: Blocks of four channels per warp a program's tile is given (issue 32 item 8b).
BLOCKS_PER_WARP = 128
MAX_WARPS = 8


def num_warps_for(tile: int) -> int:
    """Warps of a program whose tile holds ``tile`` blocks of four channels (or
    quaternions) per step: one per :data:`BLOCKS_PER_WARP` blocks, a power of
    two between 1 and :data:`MAX_WARPS` (small tiles, few channels and heads,
    take one or two warps rather than a fixed four, so more programs fit on a
    multiprocessor and no warp idles on masked lanes; the widest, 1024-block
    tiles eight). A heuristic: not yet timed on a GPU."""
    tile = max(int(tile), 1)
    return max(1, min(MAX_WARPS, _pow2(-(-tile // BLOCKS_PER_WARP))))


# ------------------------------------------------------- launch configurations
@dataclass(frozen=True)
class Config:
    """How a row kernel (``forward_rows``, ``backward_rows``, ``backward_cols``)
    is launched: ``BE`` edges per step of a row walk, ``TARGETS`` consecutive
    rows (targets; sources in pass B) per program, ``warps`` per program."""
    BE: int
    TARGETS: int
    warps: int


#: Rows of at most this mean degree may share a program (issue 32 item 8c).
SHARED_ROWS_DEGREE = 32
TARGETS_CHOICES = (2, 4)
#: ``QSV_PYG_AUTOTUNE``: ``auto`` (default: tune on CUDA), ``1`` (also the
#: interpreter: tests), ``0`` (the heuristic configuration only). Read at every call.
AUTOTUNE_ENV = "QSV_PYG_AUTOTUNE"
#: Tuned choices: key -> :class:`Config` (:func:`tuning_key`).
TUNED: Dict[tuple, Config] = {}
#: What each tuning measured: key -> ``{config: seconds}`` (for reports).
TIMINGS: Dict[tuple, Dict[Config, float]] = {}
TUNE_REPEATS = 3


def degree_bucket(edges: int, rows: int) -> int:
    """The mean degree ``edges / rows`` rounded to a power of two (a tuning key)."""
    return _pow2(max(1, round(edges / max(rows, 1))))


def candidates(s, degree: int) -> List[Config]:
    """The configurations tried for a row kernel with ``s``'s tiles over rows of
    mean degree ``degree`` (:func:`degree_bucket`); the first is the heuristic
    one, launched untuned: one row per program, ``s.BE`` edges per step.

    The others (at most four more): a step no longer than the degree (a
    degree-8 row walked 16 edges at a time leaves half the lanes masked),
    several rows per program for low degrees (the dependent loads of a row,
    ``rowptr -> col -> features``, overlap with the next row's; per-program
    loads of β and the head tile are shared), and twice the warps."""
    base = Config(s.BE, 1, s.warps)
    be = max(1, min(s.BE, degree))
    warps = num_warps_for(be * s.BH * s.BM)
    out = [base]
    if be < s.BE:
        out.append(Config(be, 1, warps))
    if degree <= SHARED_ROWS_DEGREE:
        out += [Config(be, t, warps) for t in TARGETS_CHOICES]
    if s.warps < MAX_WARPS:
        out.append(Config(s.BE, 1, 2 * s.warps))
    return list(dict.fromkeys(out))


def tuning_key(kernel: str, device: torch.device, dtype: torch.dtype, s,
               degree: int, flags: Dict[str, object]) -> tuple:
    """Heads, blocks of four channels and key width (``H, M, D``), the mean
    degree's bucket, and what else makes another binary or other work: the
    kernel, the device, the storage dtype and the constexpr flags."""
    return (kernel, str(device), str(dtype), s.H, s.M, s.D, degree,
            tuple(sorted(flags.items())))


def tuning_enabled(device: torch.device) -> bool:
    """Whether a new key is timed (:data:`AUTOTUNE_ENV`). Never in deterministic
    mode (another step length sums in another order: a rerun must choose the
    same configuration, the heuristic one) nor while a CUDA graph is captured."""
    m = os.environ.get(AUTOTUNE_ENV, "auto")
    if m == "0" or torch.are_deterministic_algorithms_enabled():
        return False
    if device.type == "cuda":
        return not torch.cuda.is_current_stream_capturing()
    return m == "1"


def _seconds(run: Callable[[], None], device: torch.device) -> float:
    """Median wall time of one launch over :data:`TUNE_REPEATS` (compiled by a
    first, untimed one)."""
    run()
    times = []
    for _ in range(TUNE_REPEATS):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] if times else 0.0  # 0 repeats: untimed


def launch_tuned(key: tuple, configs: List[Config], launch: Callable[[Config], None],
                 device: torch.device) -> Config:
    """Launch a row kernel with its configuration and return it: the tuned one
    for ``key`` (timed once per key on first sight, every candidate launched
    on the same arguments: the kernels only write their outputs, so a rerun
    leaves the same result), else the heuristic ``configs[0]``. Tuning waits
    for the device: once per key, never again for it."""
    if not tuning_enabled(device) or len(configs) == 1:
        launch(configs[0])
        return configs[0]
    best = TUNED.get(key)
    if best is None:
        timings = {c: _seconds(lambda c=c: launch(c), device) for c in configs}
        best = min(configs, key=lambda c: timings[c])  # ties: the earlier candidate
        TUNED[key], TIMINGS[key] = best, timings
    launch(best)
    return best


def tuned() -> List[dict]:
    """The tuned configurations so far, as JSON rows (for benchmark reports)."""
    rows = []
    for key, best in TUNED.items():
        kernel, device, dtype, H, M, D, degree, flags = key
        rows.append({"kernel": kernel, "device": device, "dtype": dtype, "H": H, "M": M,
                     "D": D, "degree": degree, "flags": dict(flags),
                     "chosen": vars(best).copy(),
                     "timings_us": [{**vars(c), "us": round(t * 1e6, 2)}
                                    for c, t in TIMINGS[key].items()]})
    return rows
