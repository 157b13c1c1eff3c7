"""Rebuild a trained model from its checkpoint or run folder, for analysis."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

import torch
from torch import nn

from ..data import NUM_CLASSES
from ..models import build_model
from ..training.checkpoint import load_checkpoint
from ..training.config import TrainConfig
from ..training.run_files import checkpoint_file

__all__ = ["load_model"]


def load_model(path: "str | os.PathLike[str]", device: "str | torch.device" = "cpu"
               ) -> Tuple[nn.Module, TrainConfig, Path]:
    """Rebuild the model of a training checkpoint (a file or a run folder).

    Args:
        path: ``checkpoint.pt`` or a run folder holding one.
        device: where to put the model.

    Returns:
        ``(model in eval mode, TrainConfig, checkpoint file)``.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (the message names the file).
        ValueError: the file is not a training checkpoint, or its model cannot be
            rebuilt.
        CheckpointError: the file is corrupt (a ``RuntimeError``, re-raised as is).
    """
    file = checkpoint_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {file} (pass a checkpoint.pt "
                                f"or a run folder that holds one)")
    state = load_checkpoint(file, map_location="cpu")
    missing = sorted({"config", "model"} - set(state))
    if missing:
        raise ValueError(f"{file} is not a training checkpoint (missing {missing})")
    try:
        cfg = TrainConfig.from_dict(state["config"])
        model = build_model(cfg.model, NUM_CLASSES[cfg.dataset], **cfg.model_overrides())
        model.load_state_dict(state["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{file}: cannot rebuild the model from the checkpoint "
                         f"({type(err).__name__}: {err})") from err
    return model.to(device).eval(), cfg, file
