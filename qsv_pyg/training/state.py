"""The training loop's own state: where it is and what it has measured so far.

Together with the model, optimiser, scheduler, gradient scaler and RNG states,
:class:`LoopState` is everything a checkpoint needs to continue a run exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .distributed import all_reduce_sum

__all__ = ["LoopState", "empty_partial", "reduce_partial"]


def empty_partial() -> Dict[str, float]:
    """Running sums of an epoch that has not started on this rank."""
    return {"loss_sum": 0.0, "correct": 0.0, "seen": 0, "train_seconds": 0.0}


def reduce_partial(partial: Dict[str, float], device: torch.device) -> Dict[str, float]:
    """Mean training loss / accuracy of the current epoch over all ranks."""
    sums = torch.tensor([partial["loss_sum"], partial["correct"], partial["seen"]],
                        dtype=torch.float64, device=device)
    loss_sum, correct, seen = all_reduce_sum(sums).tolist()
    return {"loss": loss_sum / max(seen, 1), "acc": correct / max(seen, 1), "seen": seen}


@dataclass
class LoopState:
    """Position and bookkeeping of a training run (one per process).

    Attributes:
        epoch: the epoch to run next (0-based; ``epochs`` when all are done).
        batch: the batch of that epoch to run next (``> 0`` only mid-epoch).
        partial: this rank's running sums of the current epoch (loss, correct,
            images seen, training seconds).
        best: best test accuracy so far and its (1-based) epoch.
        total_seconds: training and evaluation time of the finished epochs.
        last_eval: the last end-of-epoch losses and accuracies.
        budget_evals: test evaluations at marks of the budget clock.
    """

    epoch: int = 0
    batch: int = 0
    partial: Dict[str, float] = field(default_factory=empty_partial)
    best: Dict[str, Any] = field(default_factory=lambda: {"test_acc": None, "epoch": None})
    total_seconds: float = 0.0
    last_eval: Optional[Dict[str, Any]] = None
    budget_evals: List[Dict[str, Any]] = field(default_factory=list)

    def step(self, steps_per_epoch: int) -> int:
        """The global optimiser step of the position."""
        return self.epoch * steps_per_epoch + self.batch

    def state_dict(self) -> Dict[str, Any]:
        """The checkpoint entries of this state (``partial`` is gathered from every
        rank by the caller and stored as a list)."""
        return {"epoch": self.epoch, "batch": self.batch, "best": dict(self.best),
                "total_seconds": self.total_seconds, "last_eval": self.last_eval,
                "budget_evals": list(self.budget_evals)}

    @classmethod
    def from_checkpoint(cls, state: Dict[str, Any], rank: int) -> "LoopState":
        """The state a checkpoint holds for process ``rank``.

        ``budget_evals`` is optional (checkpoints written before evaluations at
        budget marks existed).
        """
        return cls(epoch=int(state["epoch"]), batch=int(state["batch"]),
                   partial=dict(state["partial"][rank]), best=dict(state["best"]),
                   total_seconds=float(state["total_seconds"]), last_eval=state["last_eval"],
                   budget_evals=list(state.get("budget_evals", [])))

    def finish_epoch(self, stats: Dict[str, Any], seconds: float) -> None:
        """Record a finished epoch's evaluation and move to the next epoch."""
        if self.best["test_acc"] is None or stats["test_acc"] > self.best["test_acc"]:
            self.best = {"test_acc": stats["test_acc"], "epoch": self.epoch + 1}
        self.total_seconds += seconds
        self.last_eval = {"epoch": self.epoch + 1, **{k: stats[k] for k in (
            "train_loss", "train_acc", "test_loss", "test_acc")}}
        self.epoch, self.batch, self.partial = self.epoch + 1, 0, empty_partial()
