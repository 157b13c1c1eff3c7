"""Per-step learning-rate schedule: linear warm-up followed by cosine decay."""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
                         min_progress: float = 0.0) -> float:
    """LR multiplier at optimiser step ``step`` (0-based).

    * ``step < warmup_steps``: ``(step + 1) / warmup_steps``, rising linearly to 1
      (starting at ``1/warmup_steps`` rather than 0 so the first step is not wasted).
    * afterwards: cosine from 1 down to ``min_lr_ratio``, reached at
      ``step == total_steps`` and held beyond it.

    ``min_progress`` moves the cosine at least that far (a fraction of the decay
    in ``[0, 1]``): ``--anneal-to-budget`` passes the used fraction of the time
    budget, so the decay ends with the epochs or the budget, whichever ends first.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    by_steps = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(min_progress, by_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Warm-up + cosine schedule, stepped once per optimiser step.

    Usage::

        sched = warmup_cosine(opt, warmup_steps=500, total_steps=len(loader) * epochs)
        for ...:
            opt.step(); sched.step()

    The LR of each param group is ``base_lr * factor(k)`` where ``k`` counts
    ``sched.step()`` calls (see :func:`warmup_cosine_factor`): the first
    optimiser step uses ``base_lr / warmup_steps``, and after ``total_steps``
    scheduler steps the LR equals ``min_lr_ratio * base_lr``.

    Args:
        optimizer: the optimiser to schedule (all of its param groups).
        warmup_steps: number of linear warm-up steps, ``0 <= warmup_steps <= total_steps``.
        total_steps: total number of optimiser steps in the run (``> 0``).
        min_lr_ratio: final LR as a fraction of the peak LR, in ``[0, 1]``.

    Returns:
        A :class:`torch.optim.lr_scheduler.LambdaLR`; its ``state_dict`` round-trips.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        return warmup_cosine_factor(step, warmup_steps, total_steps, min_lr_ratio)

    return LambdaLR(optimizer, factor)
