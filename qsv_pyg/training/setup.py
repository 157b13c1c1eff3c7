"""Setting a training run up: device, run folder, model, data, optimiser, schedule.

:func:`build_run` does it in numbered steps and returns a :class:`Run` (what
the loop trains with) and the :class:`~qsv_pyg.training.state.LoopState` to
start from (fresh, or restored from a checkpoint by
:mod:`~qsv_pyg.training.resume`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from qsv_pyg.data import BatchAugment, DataError, DeviceLoader, ImageDataset, load_cifar
from qsv_pyg.models import build_model
from qsv_pyg.utils import resolve_device as _resolve_device

from . import resume as resuming
from .config import ConfigError, TrainConfig, ablation_fields, flag_of
from .distributed import DistInfo, broadcast_object
from .evaluation import WithAuxiliaryLoss
from .optim import build_optimizer, optimizer_backend
from .run_files import CHECKPOINT_NAME, CONFIG_NAME, LOG_NAME, RunFolderError, check_free_space
from .run_files import truncate_log, write_text
from .run_lock import lock_out_dir
from .schedule import warmup_cosine
from .state import LoopState
from .stopping import TimeBudget

__all__ = ["Run", "build_run", "resolve_device"]

_AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class Run:
    """Everything a training run is built from (fixed once the loop starts,
    apart from the budget's charged-off time and the remaining budget marks)."""

    cfg: TrainConfig
    device: torch.device
    dist: DistInfo
    t_start: float
    say: Callable[[str], None]
    autocast: Callable[[], Any]
    amp: str  # the precision actually used ("none" off CUDA)
    out_dir: Path
    ckpt_path: Path
    model: nn.Module  # the bare model (saved, evaluated)
    train_model: nn.Module  # wrapped: auxiliary loss, DDP, torch.compile
    eval_model: nn.Module
    n_params: int
    train_loader: DeviceLoader
    test_loader: DeviceLoader
    steps_per_epoch: int
    data_facts: Dict[str, Any]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    backend: str
    warmup_steps: int
    total_steps: int
    budget: TimeBudget
    anneal: bool  # --anneal-to-budget with a budget
    marks: List[float]  # budget marks (minutes) still to evaluate at


def resolve_device(spec: str) -> torch.device:
    """``--device`` as a :class:`torch.device` (a bad spec is a :class:`ConfigError`)."""
    try:
        return _resolve_device(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_run(cfg: TrainConfig, resume_from, device: torch.device, dist_info: DistInfo,
              t_start: float, run_folder: contextlib.ExitStack,
              cpu_start: Optional[float] = None) -> Tuple[Run, LoopState]:
    """Set a run up; ``run_folder`` holds the out-dir's lock until training ends.

    One function on purpose (over 80 lines): the steps read top to bottom and
    their order matters (the seed before the model, the RNG restored after the
    optimiser is built, the log cut back before ``config.json`` is written).
    """
    rank, world_size, is_main = dist_info.rank, dist_info.world_size, dist_info.is_main
    # ---------------------------------------------------------------- 1. device, precision
    say = functools.partial(_say, enabled=is_main)
    device = _place(device, dist_info)
    amp = cfg.amp if device.type == "cuda" else "none"
    if amp != cfg.amp:
        say(f"note: --amp {cfg.amp} is only used on CUDA; training in float32 on {device}")
    _set_tf32(cfg.tf32, device, say)
    autocast = functools.partial(_autocast, device.type, _AMP[amp])

    # ---------------------------------------------------------------- 2. run folder, checkpoint
    ckpt = (resuming.load_for_resume(resume_from, cfg, world_size)
            if resume_from is not None else None)
    out_dir = Path(broadcast_object(cfg.out_dir or _default_out_dir(cfg.model)))
    cfg.out_dir = str(out_dir)
    # Lock the folder (one run at a time), check it is writable and remove temp
    # files of a killed run, all before the slow data loading.
    _on_main_rank(is_main, lambda: run_folder.enter_context(lock_out_dir(out_dir)))
    ckpt_path = out_dir / CHECKPOINT_NAME
    if ckpt is None and ckpt_path.exists():
        raise ConfigError(f"{out_dir} already holds a run ({ckpt_path}); continue it with "
                          f"--resume --out-dir {out_dir}, or pick another --out-dir")

    # ---------------------------------------------------------------- 3. model
    # Same seed on every rank: identical initial weights (DDP checks them too).
    _seed_everything(cfg.seed)
    model = _build_model(cfg)
    if ckpt is not None:
        resuming.restore_model(model, ckpt, cfg.model)
    model.to(device)
    _on_main_rank(is_main, lambda: check_free_space(out_dir, _checkpoint_bytes(model)))

    # ---------------------------------------------------------------- 4. data
    train_set, test_set = _load_data(cfg, world_size)
    train_loader, test_loader = _loaders(cfg, train_set, test_set, device, dist_info)
    steps_per_epoch = len(train_loader)
    facts = resuming.data_facts(cfg.dataset, train_set.labels, test_set.labels, steps_per_epoch)
    if ckpt is not None:
        resuming.check_data(ckpt, facts, cfg.epochs, world_size)

    # ---------------------------------------------------------------- 5. optimiser, schedule
    find_unused = False
    if dist_info.enabled:
        # Ablations can leave parameters out of the graph (e.g. β with uniform
        # routing); DDP then needs find_unused_parameters, which costs a little.
        images, labels = next(iter(train_loader.epoch(0)))
        find_unused = _has_unused_parameters(model, images, labels, autocast)
    optimizer, scheduler, warmup_steps, total_steps = _optimisation(cfg, model,
                                                                    steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")

    # ---------------------------------------------------------------- 6. restore or seed
    if ckpt is not None:
        state = resuming.restore(ckpt, rank, optimizer, scheduler, scaler, steps_per_epoch,
                                 world_size)
        say(f"resumed from {resume_from}: " + (
            f"epoch {state.epoch + 1}, batch {state.batch}/{steps_per_epoch}"
            if state.epoch < cfg.epochs else f"all {cfg.epochs} epochs were already done"))
    else:
        state = LoopState()
        # Distinct streams per rank for anything random inside the model (dropout).
        torch.manual_seed(cfg.seed + rank)

    # ---------------------------------------------------------------- 7. wrap for speed / DDP
    train_model, eval_model = _wrap(model, cfg, dist_info, device, find_unused)

    # The run's budget count continues across resumes (for marks and the runner).
    budget = TimeBudget(cfg.time_budget, cfg.budget_clock, t_start,
                        *resuming.budget_so_far(ckpt) if ckpt is not None else (),
                        cpu_start=cpu_start)

    # ---------------------------------------------------------------- 8. files
    backend = optimizer_backend(optimizer)
    if is_main:
        _write_run_start(out_dir, cfg, state)
    say(f"{_summary(model)} | {cfg.dataset}: {len(train_set):,} train / "
        f"{len(test_set):,} test images | device {device} x{world_size} | optimizer {backend} | "
        f"{steps_per_epoch} steps/epoch x {cfg.epochs} epochs | out {out_dir}")
    run = Run(
        cfg=cfg, device=device, dist=dist_info, t_start=t_start, say=say, autocast=autocast,
        amp=amp, out_dir=out_dir, ckpt_path=ckpt_path, model=model, train_model=train_model,
        eval_model=eval_model, n_params=_num_parameters(model), train_loader=train_loader,
        test_loader=test_loader, steps_per_epoch=steps_per_epoch, data_facts=facts,
        optimizer=optimizer, scheduler=scheduler, scaler=scaler, backend=backend,
        warmup_steps=warmup_steps, total_steps=total_steps,
        budget=budget, anneal=bool(cfg.anneal_to_budget and cfg.time_budget),
        marks=_marks_left(cfg, state, budget))
    return run, state


# ============================================================================ helpers


def _loaders(cfg: TrainConfig, train_set: ImageDataset, test_set: ImageDataset,
             device: torch.device, dist_info: DistInfo) -> Tuple[DeviceLoader, DeviceLoader]:
    """This rank's training loader and its slice of the test set."""
    rank, world_size = dist_info.rank, dist_info.world_size
    train_loader = DeviceLoader(
        train_set, cfg.batch_size, augment=BatchAugment.for_dataset(cfg.dataset, train=True),
        device=device, shuffle=True, seed=cfg.seed, drop_last=True, rank=rank,
        world_size=world_size)
    if len(train_loader) == 0:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the "
                          f"{train_loader.shard_size} training images per process; lower it")
    # Every rank evaluates a disjoint, interleaved slice; together they cover the test set.
    test_shard = ImageDataset(test_set.images[rank::world_size], test_set.labels[rank::world_size],
                              list(test_set.classes))
    test_loader = DeviceLoader(
        test_shard, cfg.eval_batch_size, augment=BatchAugment.for_dataset(cfg.dataset, train=False),
        device=device, shuffle=False)
    return train_loader, test_loader


def _optimisation(cfg: TrainConfig, model: nn.Module, steps_per_epoch: int):
    """``(optimizer, scheduler, warmup_steps, total_steps)``: warm-up then cosine, per step."""
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                backend=cfg.optimizer, sphere_lr_scale=cfg.field_lr_scale)
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = min(total_steps, int(round(cfg.warmup_epochs * steps_per_epoch)))
    scheduler = warmup_cosine(optimizer, warmup_steps, total_steps, cfg.min_lr_ratio)
    return optimizer, scheduler, warmup_steps, total_steps


def _write_run_start(out_dir: Path, cfg: TrainConfig, state: LoopState) -> None:
    """The log cut back to the checkpoint, then ``config.json`` (rank 0)."""
    # The log first: it must never run ahead of the checkpoint, even when
    # writing the config fails.
    truncate_log(out_dir / LOG_NAME, keep_epochs=state.epoch)
    write_text(out_dir / CONFIG_NAME, cfg.to_json() + "\n")


def _marks_left(cfg: TrainConfig, state: LoopState, budget: TimeBudget) -> List[float]:
    """Budget marks (``--eval-at-minutes``, counted over the whole run) that this
    process's budget reaches and that were not evaluated yet."""
    done = {e["minutes"] for e in state.budget_evals}
    end = budget.used_before + 60.0 * (cfg.time_budget or 0)
    return [m for m in cfg.eval_at_minutes if 60.0 * m < end and m not in done]


def _place(device: torch.device, dist_info: DistInfo) -> torch.device:
    """The device of this process (an explicit CUDA index: set_device and DDP need one)."""
    if device.type != "cuda":
        return device
    index = dist_info.local_rank if dist_info.enabled else device.index  # torchrun picks it
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    torch.cuda.set_device(device)
    return device


def _set_tf32(enabled: bool, device: torch.device, say: Callable[[str], None] = print) -> None:
    """``--tf32``: TF32 in float32 matmuls and cuDNN convolutions, on CUDA only.

    On CUDA both switches are set to ``enabled`` (off by default: full float32,
    whatever an earlier run in this process chose); elsewhere nothing changes.
    """
    if device.type != "cuda":
        if enabled:
            say(f"note: --tf32 is only used on CUDA; nothing changes on {device}")
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _say(message: str, enabled: bool = True) -> None:
    if enabled:
        tqdm.write(message, file=sys.stdout)


def _autocast(device_type: str, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _default_out_dir(model: str) -> str:
    base = Path("runs") / f"{model}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while path.exists():  # two runs started within the same second
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _build_model(cfg: TrainConfig) -> nn.Module:
    overrides = cfg.model_overrides()
    try:
        return build_model(cfg.model, cfg.num_classes, **overrides)
    except (TypeError, ValueError, ArithmeticError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        # Name the command-line flag when the model rejected an ablation switch.
        rejected = [flag_of(name) for name, key in ablation_fields().items()
                    if getattr(cfg, name) is not None and repr(key) in reason]
        if rejected:
            raise ConfigError(f"{', '.join(rejected)} does not apply to model {cfg.model!r} "
                              f"({reason})") from None
        raise ConfigError(f"cannot build model {cfg.model!r} with {overrides}: {reason}") from None


def _load_data(cfg: TrainConfig, world_size: int) -> Tuple[ImageDataset, ImageDataset]:
    try:
        # --download-url implies --download.
        fetch = dict(download=True, url=cfg.download_url) if cfg.download_url else dict(
            download=cfg.download)
        fetch["progress"] = cfg.progress  # the download bar follows --no-progress
        train_set = load_cifar(cfg.dataset, "train", cfg.data_dir, **fetch)
        test_set = load_cifar(cfg.dataset, "test", cfg.data_dir, **fetch)
    except (DataError, FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if cfg.subset:
        train_set = train_set.subset(cfg.subset, seed=cfg.seed)
    if cfg.test_subset:
        test_set = test_set.subset(cfg.test_subset, seed=cfg.seed)
    if len(train_set.classes) != cfg.num_classes:
        raise ConfigError(f"{cfg.dataset} has {cfg.num_classes} classes but the data on disk "
                          f"has {len(train_set.classes)}")
    if len(train_set) < world_size:
        raise ConfigError(f"{len(train_set)} training images cannot be shared by "
                          f"{world_size} processes")
    return train_set, test_set


def _wrap(model: nn.Module, cfg: TrainConfig, dist_info: DistInfo, device: torch.device,
          find_unused: bool) -> Tuple[nn.Module, nn.Module]:
    """``(train_model, eval_model)``: auxiliary loss in the forward, DDP, torch.compile."""
    # The wrapper returns (logits, auxiliary loss) from one forward, so DDP sees the
    # regulariser's parameters as used by the forward pass too.
    train_model: nn.Module = WithAuxiliaryLoss(model)
    if dist_info.enabled:
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None,
                          find_unused_parameters=find_unused)
    eval_model: nn.Module = model  # never DDP: evaluation shards differ in size
    if cfg.compile:
        # Every block of a GraphNet has its own shapes: allow a recompile per block
        # instead of falling back to eager after dynamo's default limit of 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        train_model = torch.compile(train_model)
        eval_model = torch.compile(model)
    return train_model, eval_model


def _num_parameters(model: nn.Module) -> int:
    fn = getattr(model, "num_parameters", None)
    return int(fn()) if callable(fn) else sum(p.numel() for p in model.parameters())


def _summary(model: nn.Module) -> str:
    fn = getattr(model, "summary", None)
    if callable(fn):
        return fn()
    return f"{type(model).__name__}: {_num_parameters(model):,} parameters"


def _has_unused_parameters(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                           autocast) -> bool:
    """Whether one training step leaves a trainable parameter without a gradient.

    Runs on a copy under a forked RNG, so the real model and random streams are
    untouched.
    """
    probe = WithAuxiliaryLoss(copy.deepcopy(model)).train()
    devices = [images.device] if images.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        with autocast():
            logits, aux_loss = probe(images)
            loss = F.cross_entropy(logits, labels) + aux_loss
        loss.backward()
    return any(p.requires_grad and p.grad is None for p in probe.parameters())


def _on_main_rank(is_main: bool, action) -> None:
    """Run ``action()`` on rank 0; its :class:`RunFolderError` is raised on every rank."""
    error = None
    if is_main:
        try:
            action()
        except RunFolderError as err:
            error = err
    message = broadcast_object(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise RunFolderError(message)


def _checkpoint_bytes(model: nn.Module) -> int:
    """Disk space a checkpoint needs: the weights plus up to two optimiser moments each."""
    return 3 * sum(t.numel() * t.element_size() for t in model.state_dict().values())
