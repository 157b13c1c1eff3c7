"""Process-group helpers for data-parallel training under ``torchrun``.

``torchrun --nproc_per_node=N script.py`` starts N copies of the script with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (and the rendezvous address) in the
environment. :func:`init_distributed` reads them and joins the process group
(NCCL on CUDA, Gloo on CPU); launched without them it is a no-op and every
helper below degrades to the single-process behaviour, so the training loop has
no ``if distributed`` branches around collectives.

Small agreements between the ranks at every step (stop now? evaluate at a budget
mark?) go through :func:`all_reduce_max_host`: a Gloo all-reduce of a CPU
tensor. Under NCCL a device tensor would have to be created from host data and
read back, two host-device syncs per step that stall the CUDA queue; the Gloo
reduction only waits for the other ranks' *host* threads, which run ahead of
their GPUs.
"""
from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_max_host",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "cleanup_distributed",
    "init_distributed",
    "launched_by_torchrun",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global index of this process, ``0 <= rank < world_size``.
        local_rank: index on this machine (selects the GPU).
        world_size: number of processes.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, checkpoints and metrics."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the torchrun environment variables are present."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_type: str, timeout_minutes: float = 30.0) -> DistInfo:
    """Join the process group when launched by torchrun.

    Args:
        device_type: ``"cuda"`` selects NCCL (and ``cuda:LOCAL_RANK`` as the current
            device), anything else Gloo.
        timeout_minutes: collective timeout; generous because rank 0 may spend a
            while writing a checkpoint while the others wait.

    Returns:
        This process's :class:`DistInfo` (``world_size == 1`` when not launched by
        torchrun or launched with a single process).
    """
    if not launched_by_torchrun():
        return DistInfo()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world_size <= 1:
        return DistInfo(rank, local_rank, world_size)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    _host_group()  # collective: created here, with the group, by every rank
    return DistInfo(rank, local_rank, world_size)


def cleanup_distributed() -> None:
    """Leave the process group (no-op when none was joined).

    First a barrier and a short pause, both without the GIL: gloo's worker
    threads free the last collectives' work objects, whose tensors need the
    GIL, and the group's destructor (here, or DDP's reducer's later) joins
    those threads while holding it. Without them a two-process CPU run hung
    at exit in 2 of 7 tries (gdb: ``~ProcessGroupGloo`` joining
    ``pt_gloo_runloop``, which waited for the GIL in ``~AsyncAllgatherWork``).
    """
    global _HOST_GROUP
    _HOST_GROUP = None
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
            time.sleep(0.05)
        gc.collect()  # DDP's reducer (and its group reference) goes now, not at exit
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over all ranks, in place."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


#: The Gloo group of :func:`all_reduce_max_host` when the default group is not Gloo.
_HOST_GROUP: Optional[Any] = None


def _host_group() -> Optional[Any]:
    """A process group whose collectives run on CPU tensors (``None``: the default one).

    Created by :func:`init_distributed` (or, for a group joined elsewhere, on
    first use); creating it is collective, so every rank must get there.
    """
    global _HOST_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.new_group(backend="gloo")
    return _HOST_GROUP


def all_reduce_max_host(values: Sequence[int]) -> List[int]:
    """Element-wise maximum of small integers over all ranks, on the host.

    A CPU tensor reduced over Gloo: nothing is copied to or from a GPU, so the
    CUDA queue keeps running (the call waits only for the other ranks' host
    threads). Use it for per-step agreements; ``values`` itself when alone.
    """
    if not _active():
        return [int(v) for v in values]
    box = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=_host_group())
    return box.tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (picklable objects only)."""
    if not _active():
        return obj
    box: List[Any] = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> List[Any]:
    """List of every rank's ``obj``, indexed by rank (``[obj]`` when alone)."""
    if not _active():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait until every rank arrives here."""
    if _active():
        dist.barrier()
