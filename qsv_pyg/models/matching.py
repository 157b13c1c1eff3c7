"""Match a model's parameter count to a target by scaling its widths.

Controls are compared with QSV at (almost) equal parameter counts: their convs
have different numbers of weights per width, so their widths are scaled until
the totals agree within a tolerance.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Sequence, Tuple

from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def scale_widths(widths: Sequence[int], scale: float, multiple: int) -> Tuple[int, ...]:
    """``widths`` times ``scale``, each rounded to a positive multiple of ``multiple``.

    The rounding is dithered: level ``i`` of ``L`` rounds ``w·scale/multiple`` at
    the threshold ``0.5 - ((i + 0.5) / L - 0.5)`` instead of ``0.5``. Levels of
    equal width then step up at different scales, one at a time, so the reachable
    parameter counts are much finer than with plain rounding (where, say, three
    levels of width 128 jump to 144 together). ``scale = 1`` returns multiples of
    ``multiple`` unchanged, and every width is non-decreasing in ``scale``, so the
    parameter count is too (what bisection needs).
    """
    if multiple < 1:
        raise ValueError(f"multiple must be positive, got {multiple}")
    n = len(widths)
    out = []
    for i, w in enumerate(widths):
        dither = (i + 0.5) / n - 0.5  # in (-0.5, 0.5)
        out.append(max(multiple, multiple * math.floor(w * scale / multiple + dither + 0.5)))
    return tuple(out)


def match_width(build: Callable[[float], nn.Module], target_params: int,
                tol: float = 0.05, max_iter: int = 40) -> Tuple[nn.Module, float]:
    """Find a width scale whose model has ``target_params`` parameters within ``tol``.

    The parameter count must be non-decreasing in the scale (true when ``build``
    scales its widths with :func:`scale_widths`). The scale is bracketed by
    doubling/halving from 1 and then bisected; of all models built, the one whose
    count is closest to the target is returned.

    Args:
        build: ``scale -> model``.
        target_params: parameter count to match.
        tol: accepted relative deviation, ``|n - target| <= tol * target``.
        max_iter: bisection steps.

    Returns:
        ``(model, scale)``.

    Raises:
        ValueError: when no scale gets within ``tol`` (width rounding too coarse for
            the target, or the target outside the reachable range).
    """
    if target_params <= 0:
        raise ValueError(f"target_params must be positive, got {target_params}")
    if not 0 <= tol < 1:
        raise ValueError(f"tol must be in [0, 1), got {tol}")
    counts: Dict[float, int] = {}
    best: Dict[str, object] = {}

    def evaluate(scale: float) -> int:
        if scale not in counts:
            model = build(scale)
            n = count_parameters(model)
            counts[scale] = n
            if not best or abs(n - target_params) < abs(best["n"] - target_params):
                best.update(model=model, scale=scale, n=n)
        return counts[scale]

    def good() -> bool:
        return abs(best["n"] - target_params) <= tol * target_params

    lo = hi = 1.0
    evaluate(1.0)
    for _ in range(20):  # bracket: count(lo) <= target <= count(hi)
        if evaluate(hi) >= target_params:
            break
        lo, hi = hi, hi * 2.0
    for _ in range(20):
        if evaluate(lo) <= target_params:
            break
        hi, lo = lo, lo / 2.0
    for _ in range(max_iter):
        # Width rounding makes the count a step function of the scale: once the
        # bracket is narrower than any rounding step, further steps change nothing.
        if best["n"] == target_params or hi - lo < 1e-3 * hi:
            break
        mid = 0.5 * (lo + hi)
        if evaluate(mid) < target_params:
            lo = mid
        else:
            hi = mid
    if not good():
        raise ValueError(
            f"no width scale gives {target_params:,} parameters within {tol:.0%}: the "
            f"closest is {best['n']:,} at scale {best['scale']:.4f} (width rounding is "
            f"too coarse for this target; use larger widths or a larger tolerance)")
    return best["model"], float(best["scale"])
