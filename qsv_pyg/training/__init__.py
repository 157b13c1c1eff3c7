"""Training: optimizer (Riemannian or projected on S³), schedule, checkpoints, loop, CLI."""
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .optim import build_optimizer, optimizer_backend
from .schedule import warmup_cosine

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint", "build_optimizer",
           "optimizer_backend", "warmup_cosine"]
