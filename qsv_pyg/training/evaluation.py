"""Evaluation: the test-set pass, the training forward with its auxiliary loss, β values."""
from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from qsv_pyg.data import DeviceLoader

from .distributed import all_reduce_sum

__all__ = ["WithAuxiliaryLoss", "betas", "evaluate"]


class WithAuxiliaryLoss(nn.Module):
    """``images -> (logits, model.auxiliary_loss())`` in one forward call.

    Regularisers (field repulsion, β prior) then belong to the forward pass that
    DDP and ``torch.compile`` see. Models without ``auxiliary_loss`` get ``0``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(images)
        aux = getattr(self.model, "auxiliary_loss", None)
        return logits, (aux() if callable(aux) else logits.new_zeros(()))


@torch.no_grad()
def evaluate(model: nn.Module, loader: DeviceLoader, autocast=contextlib.nullcontext
             ) -> Dict[str, float]:
    """Mean cross-entropy (no label smoothing) and accuracy over a loader, all ranks.

    Args:
        model: the classifier (put in eval mode for the duration of the call).
        loader: this rank's evaluation shard.
        autocast: zero-argument context manager factory for mixed precision.

    Returns:
        ``{"loss", "acc", "seen"}`` summed over every rank's shard.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=loader.device)
    for images, labels in loader.epoch(0):
        with autocast():
            logits = model(images)
        sums[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        sums[1] += (logits.argmax(dim=1) == labels).sum()
        sums[2] += labels.numel()
    model.train(was_training)
    loss_sum, correct, seen = all_reduce_sum(sums).tolist()
    return {"loss": loss_sum / max(seen, 1), "acc": correct / max(seen, 1), "seen": seen}


def betas(model: nn.Module) -> Dict[str, List[float]]:
    """Routing temperatures per layer (every head), for the log; ``{}`` without any."""
    fn = getattr(model, "betas", None)
    if not callable(fn):
        return {}
    return {name: value.detach().float().cpu().reshape(-1).tolist()
            for name, value in fn().items()}
