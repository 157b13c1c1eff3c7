"""The training loop: data, model, optimiser, schedule, epochs, checkpoints.

Read :func:`train` top to bottom; it is one function on purpose (in the spirit
of nanoGPT's ``train.py``), with small helpers below it. One run writes into
``cfg.out_dir`` (the files are described in :mod:`~qsv_pyg.training.run_files`)::

    config.json     the full TrainConfig of the run
    log.jsonl       one JSON line per finished epoch (losses, accuracies, lr, β, timing)
    checkpoint.pt   the latest state (model, optimiser, schedule, RNG, position)
    metrics.json    final summary, written when the run ends

The folder is locked while the run is alive, checked before the data is loaded,
and every file in it is written atomically.

Resuming (``--resume``) is exact: the data order and augmentation are functions
of ``(seed, epoch, rank, batch)`` (see :class:`~qsv_pyg.data.DeviceLoader`), and
the checkpoint holds everything else that changes during training, including
the RNG state of every rank and the running sums of a half-finished epoch. On
the CPU, an interrupted and resumed run writes the same ``log.jsonl`` as an
uninterrupted one, bit for bit, apart from the timing fields
(:data:`TIMING_FIELDS`).

Stopping early:

* **Ctrl-C / SIGTERM**: the first signal only sets a flag; the loop notices it
  at the next step boundary (or after the current evaluation), writes a
  mid-epoch checkpoint holding the batch index and raises
  :class:`TrainingInterrupted`. A ``KeyboardInterrupt`` raised *between*
  steps (e.g. a second Ctrl-C during data preparation or evaluation) is saved
  the same way; one raised in the middle of an optimiser step cannot be saved
  exactly, so then nothing is written and the last checkpoint stays the
  resume point. Under torchrun repeated signals are absorbed, because the
  launcher forwards its own copy of the signal to the workers.
* **Time budget** (``cfg.time_budget`` minutes of wall time since
  :func:`train` started): checked before every step; the run saves a
  mid-epoch checkpoint, evaluates and writes ``metrics.json`` with
  ``stopped_early: true``. Resume it with a new (or no) budget.
* **Non-finite loss**: :class:`NonFiniteLossError` naming the epoch and step;
  no checkpoint is written after the bad step, so the last good one survives.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import random
import signal
import sys
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from qsv_pyg.data import BatchAugment, DataError, DeviceLoader, ImageDataset, load_cifar
from qsv_pyg.models import available_models, build_model
from qsv_pyg.utils import resolve_device

from .checkpoint import (
    CheckpointError,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from .config import ABLATION_FLAGS, ConfigError, TrainConfig
from .distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    cleanup_distributed,
    init_distributed,
)
from .optim import build_optimizer, optimizer_backend
from .run_files import (
    CHECKPOINT_NAME,
    CONFIG_NAME,
    LOG_NAME,
    METRICS_NAME,
    RunFolderError,
    append_jsonl,
    check_free_space,
    truncate_log,
    write_json,
    write_text,
)
from .run_lock import lock_out_dir
from .schedule import warmup_cosine, warmup_cosine_factor

__all__ = [
    "NonFiniteLossError",
    "RESUME_OVERRIDABLE",
    "TIMING_FIELDS",
    "TrainingInterrupted",
    "WithAuxiliaryLoss",
    "config_for_resume",
    "evaluate",
    "train",
]

#: Log fields that measure wall time; everything else in a log line is reproducible.
TIMING_FIELDS = ("seconds", "images_per_s")

#: Options that may differ from the checkpoint's when resuming: where and how fast
#: the run goes, not what it computes.
RESUME_OVERRIDABLE = frozenset({"out_dir", "data_dir", "download", "device", "time_budget",
                                "threads",
                                "progress", "compile"})

_NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
_POSTFIX_EVERY = 10  # steps between progress-bar refreshes (each one is a host sync)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite.

    Attributes:
        epoch: 1-based epoch of the bad step.
        step: 0-based global optimiser step of the bad step.
        value: the loss value.
    """

    def __init__(self, message: str, epoch: int, step: int, value: float):
        super().__init__(message)
        self.epoch, self.step, self.value = epoch, step, value


class TrainingInterrupted(Exception):
    """Training stopped on Ctrl-C / SIGTERM.

    Attributes:
        checkpoint: path of the checkpoint to resume from (``None`` if none exists).
        saved: whether the current state was written (``False`` when the
            interrupt arrived in the middle of an optimiser step).
    """

    def __init__(self, message: str, checkpoint: Optional[str], saved: bool):
        super().__init__(message)
        self.checkpoint, self.saved = checkpoint, saved


# ============================================================================ train


def train(cfg: TrainConfig, resume_from: "str | os.PathLike[str] | None" = None) -> Dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.dataset`` and return the final metrics.

    Args:
        cfg: the run configuration (validated here).
        resume_from: a checkpoint written by a previous run; its configuration must
            equal ``cfg`` except for :data:`RESUME_OVERRIDABLE` fields (build ``cfg``
            with :func:`config_for_resume`).

    Returns:
        The contents of ``metrics.json`` (on every rank).

    Raises:
        ConfigError: invalid options, unusable data, a model that rejects the
            requested ablations, or an unusable checkpoint.
        NonFiniteLossError: the loss became NaN/inf.
        TrainingInterrupted: Ctrl-C or SIGTERM (after saving a checkpoint).
    """
    cfg = TrainConfig.from_dict(cfg.to_dict()).validate()  # private copy
    t_start = _clock()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.model not in available_models():
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of "
                          f"{', '.join(available_models())}")

    # ---------------------------------------------------------------- 1. processes and device
    device = _resolve_device(cfg.device)
    dist_info = init_distributed(device.type)
    try:
        with contextlib.ExitStack() as run_folder:  # holds the out-dir's lock
            return _train(cfg, resume_from, device, dist_info, t_start, run_folder)
    finally:
        cleanup_distributed()


def _train(cfg: TrainConfig, resume_from, device: torch.device, dist_info: DistInfo,
           t_start: float, run_folder: contextlib.ExitStack) -> Dict[str, Any]:
    rank, world_size, is_main = dist_info.rank, dist_info.world_size, dist_info.is_main
    if device.type == "cuda":
        # An explicit index everywhere (set_device and DDP need one); torchrun picks it.
        index = dist_info.local_rank if dist_info.enabled else device.index
        device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    say = functools.partial(_say, enabled=is_main)
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]
    if amp_dtype is not None and device.type != "cuda":
        say(f"note: --amp {cfg.amp} is only used on CUDA; training in float32 on {device}")
        amp_dtype = None
    autocast = functools.partial(_autocast, device.type, amp_dtype)

    # ---------------------------------------------------------------- 2. run folder, checkpoint
    if resume_from is not None:
        ckpt = _load_resume_state(resume_from, cfg, world_size)
    else:
        ckpt = None
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
    num_classes = _NUM_CLASSES[cfg.dataset]
    raw_model = _build_model(cfg, num_classes)
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
    raw_model.to(device)
    n_params = _num_parameters(raw_model)
    _on_main_rank(is_main, lambda: check_free_space(out_dir, _checkpoint_bytes(raw_model)))

    # ---------------------------------------------------------------- 4. data
    train_set, test_set = _load_data(cfg)
    if len(train_set.classes) != num_classes:
        raise ConfigError(f"{cfg.dataset} has {num_classes} classes but the data on disk has "
                          f"{len(train_set.classes)}")
    if len(train_set) < world_size:
        raise ConfigError(f"{len(train_set)} training images cannot be shared by "
                          f"{world_size} processes")
    train_loader = DeviceLoader(
        train_set, cfg.batch_size, augment=BatchAugment.for_dataset(cfg.dataset, train=True),
        device=device, shuffle=True, seed=cfg.seed, drop_last=True, rank=rank,
        world_size=world_size)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the "
                          f"{train_loader.shard_size} training images per process; lower it")
    # Every rank evaluates a disjoint, interleaved slice; together they cover the test set.
    test_shard = ImageDataset(test_set.images[rank::world_size], test_set.labels[rank::world_size],
                              list(test_set.classes))
    test_loader = DeviceLoader(
        test_shard, cfg.eval_batch_size, augment=BatchAugment.for_dataset(cfg.dataset, train=False),
        device=device, shuffle=False)

    # ---------------------------------------------------------------- 5. optimiser, schedule
    find_unused = False
    if dist_info.enabled:
        # Ablations can leave parameters out of the graph (e.g. β with uniform
        # routing); DDP then needs find_unused_parameters, which costs a little.
        images, labels = next(iter(train_loader.epoch(0)))
        find_unused = _has_unused_parameters(raw_model, images, labels, autocast)
    optimizer = build_optimizer(raw_model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                backend=cfg.optimizer, sphere_lr_scale=cfg.field_lr_scale)
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = min(total_steps, int(round(cfg.warmup_epochs * steps_per_epoch)))
    scheduler = warmup_cosine(optimizer, warmup_steps, total_steps, cfg.min_lr_ratio)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    def lr_at(step: int) -> float:
        if anneal_to_budget:
            return optimizer.param_groups[0]["lr"]
        return cfg.lr * warmup_cosine_factor(step, warmup_steps, total_steps, cfg.min_lr_ratio)

    # With --anneal-to-budget the cosine follows whichever runs out first, the
    # epochs or the time budget, so a budget-stopped run still ends annealed and
    # models of different speed get the same schedule shape. Time-dependent, so
    # such runs are not bit-reproducible.
    anneal_to_budget = bool(cfg.anneal_to_budget and cfg.time_budget)

    def set_budget_lr(next_step: int) -> None:
        if next_step < warmup_steps:
            return  # the step-based warm-up stays as it is
        used = (budget_clock() - budget_origin - eval_charge) / (60.0 * cfg.time_budget)
        by_steps = (next_step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(1.0, max(used, by_steps))
        factor = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor  # keeps each group's own ratio

    # ---------------------------------------------------------------- 6. restore or seed
    start_epoch, start_batch = 0, 0
    run = _empty_partial()  # running sums of the current epoch on this rank
    best = {"test_acc": None, "epoch": None}
    total_seconds, last_eval = 0.0, None
    # Test evaluations at marks of the budget clock (--eval-at-minutes); their cost
    # is added to the deadline, so they do not take training time from the run.
    # The marks count the budget used by the whole run, across resumes.
    budget_evals: List[Dict[str, Any]] = []
    budget_offset = 0.0  # budget-clock seconds of training before this process
    eval_seconds_before = 0.0  # mark evaluations before this process
    eval_charge = 0.0  # mark evaluations of this process
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_batch = int(ckpt["epoch"]), int(ckpt["batch"])
        run = dict(ckpt["partial"][rank])
        best = dict(ckpt["best"])
        total_seconds, last_eval = float(ckpt["total_seconds"]), ckpt["last_eval"]
        budget_evals = list(ckpt.get("budget_evals", []))
        budget_offset = float(ckpt.get("budget_used_s", 0.0))
        eval_seconds_before = float(ckpt.get("budget_eval_seconds", 0.0))
        restore_rng_state(ckpt["rng"][rank])
        say(f"resumed from {resume_from}: " + (
            f"epoch {start_epoch + 1}, batch {start_batch}/{steps_per_epoch}"
            if start_epoch < cfg.epochs else f"all {cfg.epochs} epochs were already done"))
    else:
        # Distinct streams per rank for anything random inside the model (dropout).
        torch.manual_seed(cfg.seed + rank)

    # ---------------------------------------------------------------- 7. wrap for speed / DDP
    # The wrapper returns (logits, auxiliary loss) from one forward, so DDP sees the
    # regulariser's parameters as used by the forward pass too.
    train_model: nn.Module = WithAuxiliaryLoss(raw_model)
    if dist_info.enabled:
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None,
                          find_unused_parameters=find_unused)
    eval_model: nn.Module = raw_model  # never DDP: evaluation shards differ in size
    if cfg.compile:
        # Every block of a GraphNet has its own shapes: allow a recompile per block
        # instead of falling back to eager after dynamo's default limit of 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        train_model = torch.compile(train_model)
        eval_model = torch.compile(raw_model)

    # ---------------------------------------------------------------- 8. files
    if is_main:
        # The log first: it must never run ahead of the checkpoint, even when
        # writing the config fails.
        truncate_log(out_dir / LOG_NAME, keep_epochs=start_epoch if ckpt is not None else 0)
        write_text(out_dir / CONFIG_NAME, cfg.to_json() + "\n")
    backend = optimizer_backend(optimizer)
    say(f"{_summary(raw_model)} | {cfg.dataset}: {len(train_set):,} train / "
        f"{len(test_set):,} test images | device {device} x{world_size} | optimizer {backend} | "
        f"{steps_per_epoch} steps/epoch x {cfg.epochs} epochs | out {out_dir}")

    def save(epoch: int, batch: int) -> None:
        """Checkpoint position ``(epoch, batch)``; collective, rank 0 writes."""
        rng_all = all_gather_object(capture_rng_state())
        partial_all = all_gather_object(dict(run))
        if is_main:
            save_checkpoint(ckpt_path, {
                "config": cfg.to_dict(), "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch, "batch": batch,
                "partial": partial_all, "rng": rng_all, "world_size": world_size,
                "best": dict(best), "total_seconds": total_seconds, "last_eval": last_eval,
                "steps_per_epoch": steps_per_epoch, "optimizer_backend": backend,
                "budget_evals": list(budget_evals), "budget_used_s": budget_used(),
                "budget_eval_seconds": eval_seconds_before + eval_charge})

    # ---------------------------------------------------------------- 9. the loop
    # The budget's clock: wall time, or this process's CPU time (equal compute
    # per run when other work shares the machine).
    budget_clock = _process_clock if cfg.budget_clock == "process" else _clock
    budget_origin = t_start if budget_clock is _clock else 0.0
    deadline = budget_origin + 60.0 * cfg.time_budget if cfg.time_budget else None
    done = {e["minutes"] for e in budget_evals}
    marks = [m for m in cfg.eval_at_minutes
             if 60.0 * m < budget_offset + 60.0 * (cfg.time_budget or 0) and m not in done]

    def budget_used() -> float:
        """Budget-clock seconds of training of the whole run (mark evaluations excluded)."""
        return budget_offset + budget_clock() - budget_origin - eval_charge

    def evaluate_at_mark() -> None:
        """Evaluate if the budget clock passed the next mark (every rank agrees)."""
        nonlocal deadline, eval_charge
        due = 1 if marks and budget_used() >= 60.0 * marks[0] else 0
        if dist_info.enabled:
            due = int(all_reduce_max(torch.tensor([due], device=device)).item())
        if not due:
            return
        t0 = budget_clock()
        stats = evaluate(eval_model, test_loader, autocast)
        entry = {"minutes": marks.pop(0), "test_acc": stats["acc"], "test_loss": stats["loss"],
                 "epoch": epoch, "batch": batch, "step": step, "betas": _betas(raw_model)}
        budget_evals.append(entry)
        cost = budget_clock() - t0
        eval_charge += cost
        deadline += cost
        say(f"budget mark {entry['minutes']:g} min: test acc {stats['acc']:.4f} "
            f"(epoch {epoch + 1}, batch {batch}/{steps_per_epoch})")
    epoch, batch = start_epoch, start_batch  # position: next batch to run
    step = epoch * steps_per_epoch + batch  # global optimiser step
    pending = None  # (step, loss/correct tensor) of the last step, checked one step late
    stop_reason: Optional[str] = None
    in_step = False  # inside forward/backward/optimiser step: not resumable if interrupted
    t_epoch: Optional[float] = None  # perf_counter origin of this epoch's training time
    last_train: Optional[Dict[str, float]] = None

    def absorb() -> None:
        """Check the pending step's loss and add it to the running sums."""
        nonlocal pending
        if pending is None:
            return
        bad_step, bad_batch, values = pending
        loss_value, correct = values.tolist()
        pending = None
        if not math.isfinite(loss_value):
            where = (f"a checkpoint ({ckpt_path}) holds the last good state"
                     if ckpt_path.exists() else "no checkpoint had been written yet")
            raise NonFiniteLossError(
                f"non-finite training loss ({loss_value}) at epoch {epoch + 1}, step {bad_step} "
                f"(batch {bad_batch + 1}/{steps_per_epoch}); training stopped and nothing was "
                f"saved after the bad step, {where}. Try a lower --lr or --amp none.",
                epoch=epoch + 1, step=bad_step, value=loss_value)
        run["loss_sum"] += loss_value * cfg.batch_size
        run["correct"] += correct
        run["seen"] += cfg.batch_size

    with _InterruptFlag(distributed=dist_info.enabled) as interrupt:
        try:
            while epoch < cfg.epochs:
                # ---- train one epoch (from `batch`, which is > 0 only after a resume)
                raw_model.train()
                t_epoch = time.perf_counter() - run["train_seconds"]
                show_bar = cfg.progress and is_main
                with tqdm(total=steps_per_epoch, initial=batch, disable=not show_bar,
                          desc=f"epoch {epoch + 1}/{cfg.epochs}", dynamic_ncols=True,
                          leave=False, file=sys.stderr) as bar:
                    for images, labels in train_loader.epoch(epoch, start_batch=batch):
                        if marks:
                            evaluate_at_mark()
                        stop_reason = _stop_requested(interrupt, deadline, device,
                                                      dist_info.enabled, budget_clock)
                        if stop_reason:
                            break
                        in_step = True
                        with autocast():
                            logits, aux_loss = train_model(images)
                            loss = F.cross_entropy(logits, labels,
                                                   label_smoothing=cfg.label_smoothing) + aux_loss
                        optimizer.zero_grad(set_to_none=True)
                        scaler.scale(loss).backward()
                        scaler.step(optimizer)
                        scaler.update()
                        scheduler.step()
                        if anneal_to_budget:
                            set_budget_lr(step + 1)
                        correct = (logits.argmax(dim=1) == labels).sum()
                        in_step = False
                        # Reading the previous step's loss now lets the GPU run ahead by one step.
                        absorb()
                        pending = (step, batch, torch.stack([loss.detach().float(),
                                                             correct.float()]))
                        batch += 1
                        step += 1
                        bar.update()
                        if batch % _POSTFIX_EVERY == 0 and run["seen"]:
                            seconds = time.perf_counter() - t_epoch
                            bar.set_postfix(loss=f"{run['loss_sum'] / run['seen']:.4f}",
                                            acc=f"{run['correct'] / run['seen']:.3f}",
                                            img_s=f"{run['seen'] * world_size / seconds:,.0f}")
                    absorb()
                    run["train_seconds"] = time.perf_counter() - t_epoch
                    t_epoch = None
                if stop_reason:
                    break

                # ---- evaluate, log, checkpoint
                t_eval = time.perf_counter()
                train_stats = _reduce_partial(run, device)
                test_stats = evaluate(eval_model, test_loader, autocast)
                seconds = run["train_seconds"] + time.perf_counter() - t_eval
                record = {
                    "epoch": epoch + 1, "step": step,
                    "train_loss": train_stats["loss"], "train_acc": train_stats["acc"],
                    "test_loss": test_stats["loss"], "test_acc": test_stats["acc"],
                    "lr": lr_at(step - 1), "betas": _betas(raw_model),
                    "seconds": seconds,
                    "images_per_s": train_stats["seen"] / max(run["train_seconds"], 1e-9),
                }
                # Log first, then advance the position: an interrupt before this point
                # re-evaluates the epoch on resume (and rewrites its line), one after
                # it finds the finished epoch in the checkpoint.
                if is_main:
                    append_jsonl(out_dir / LOG_NAME, record)
                if best["test_acc"] is None or test_stats["acc"] > best["test_acc"]:
                    best = {"test_acc": test_stats["acc"], "epoch": epoch + 1}
                total_seconds += seconds
                last_eval = {"epoch": epoch + 1, "train_loss": train_stats["loss"],
                             "train_acc": train_stats["acc"], "test_loss": test_stats["loss"],
                             "test_acc": test_stats["acc"]}
                last_train = {"loss": train_stats["loss"], "acc": train_stats["acc"]}
                epoch, batch, run = epoch + 1, 0, _empty_partial()
                save(epoch, batch)
                say(f"epoch {record['epoch']}/{cfg.epochs} | train loss {record['train_loss']:.4f} "
                    f"acc {record['train_acc']:.4f} | test loss {record['test_loss']:.4f} "
                    f"acc {record['test_acc']:.4f} | lr {record['lr']:.2e} | "
                    f"{seconds:.1f}s {record['images_per_s']:,.0f} img/s")
        except KeyboardInterrupt:
            if in_step or dist_info.enabled:
                # Half an optimiser step cannot be resumed exactly, and with several
                # processes the others are not at this point: keep the last checkpoint.
                have = ckpt_path if ckpt_path.exists() else None
                raise TrainingInterrupted(
                    "interrupted in the middle of a step; nothing new was saved"
                    + (f", resume from {have}" if have else ""),
                    checkpoint=str(have) if have else None, saved=False) from None
            stop_reason = "interrupt"
            if t_epoch is not None:  # interrupted between two training steps
                run["train_seconds"] = time.perf_counter() - t_epoch

    # ---------------------------------------------------------------- 10. early stop or finish
    if stop_reason:
        absorb()
        save(epoch, batch)
        if stop_reason == "interrupt":
            raise TrainingInterrupted(
                f"interrupted: saved {ckpt_path} at epoch {epoch + 1}, batch "
                f"{batch}/{steps_per_epoch}; continue with --resume {ckpt_path}",
                checkpoint=str(ckpt_path), saved=True)
        say(f"time budget of {cfg.time_budget} min reached at epoch {epoch + 1}, batch "
            f"{batch}/{steps_per_epoch}; saved {ckpt_path}")
        if run["seen"]:
            partial = _reduce_partial(run, device)
            last_train = {"loss": partial["loss"], "acc": partial["acc"]}
            total_seconds += run["train_seconds"]

    if stop_reason or last_eval is None:
        # Stopped early: the model changed since the last evaluation.
        test_stats = evaluate(eval_model, test_loader, autocast)
        final_test = {"loss": test_stats["loss"], "acc": test_stats["acc"]}
        if best["test_acc"] is None or final_test["acc"] > best["test_acc"]:
            best = {"test_acc": final_test["acc"], "epoch": epoch + (batch > 0)}
    else:
        final_test = {"loss": last_eval["test_loss"], "acc": last_eval["test_acc"]}
    if last_train is None and last_eval is not None:
        last_train = {"loss": last_eval["train_loss"], "acc": last_eval["train_acc"]}

    images_seen = (epoch * steps_per_epoch + batch) * cfg.batch_size * world_size
    metrics = {
        "model": cfg.model, "dataset": cfg.dataset, "preset": cfg.preset,
        "test_acc": final_test["acc"], "test_loss": final_test["loss"],
        "train_acc": last_train["acc"] if last_train else None,
        "train_loss": last_train["loss"] if last_train else None,
        "best_test_acc": best["test_acc"], "best_epoch": best["epoch"],
        "epochs": epoch, "epochs_planned": cfg.epochs, "steps": step,
        "params": n_params, "seconds": total_seconds,
        "images_per_s": images_seen / total_seconds if total_seconds > 0 else None,
        "stopped_early": stop_reason is not None, "stop_reason": stop_reason,
        "optimizer_backend": backend, "device": str(device), "world_size": world_size,
        "amp": {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype],
        "compile": cfg.compile, "train_images": len(train_set), "test_images": len(test_set),
        "betas": _betas(raw_model), "torch": torch.__version__,
        "budget_evals": budget_evals, "budget_used_s": budget_used(),
        "budget_eval_seconds": eval_seconds_before + eval_charge,
        "wall_seconds_this_process": _clock() - t_start,
    }
    if is_main:
        write_json(out_dir / METRICS_NAME, metrics)
        say(f"done: test acc {metrics['test_acc']:.4f} (best {metrics['best_test_acc']:.4f}) "
            f"after {epoch} epoch(s); metrics in {out_dir / METRICS_NAME}")
    return metrics


# ============================================================================ evaluation


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


# ============================================================================ resume helpers


def config_for_resume(checkpoint: "str | os.PathLike[str]", overrides: Dict[str, Any]
                      ) -> TrainConfig:
    """The configuration stored in ``checkpoint`` with the allowed ``overrides``.

    Args:
        checkpoint: checkpoint file.
        overrides: config fields given explicitly for the resumed run. Fields in
            :data:`RESUME_OVERRIDABLE` replace the stored values; any other field
            must equal the stored value. ``out_dir`` defaults to the checkpoint's folder.

    Raises:
        ConfigError: unreadable checkpoint, or an override that would change what
            the run computes.
    """
    state = _read_checkpoint(checkpoint)
    cfg = TrainConfig.from_dict(state["config"])
    changed = sorted(k for k, v in overrides.items()
                     if k not in RESUME_OVERRIDABLE and getattr(cfg, k) != v)
    if changed:
        details = ", ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)!r} -> {overrides[k]!r}"
                            for k in changed)
        allowed = ", ".join("--" + k.replace("_", "-") for k in sorted(RESUME_OVERRIDABLE))
        raise ConfigError(f"cannot change {details} when resuming {checkpoint}; only {allowed} "
                          "may differ (start a new run instead)")
    cfg = cfg.replace(**{k: v for k, v in overrides.items() if k in RESUME_OVERRIDABLE})
    if not overrides.get("out_dir"):
        cfg.out_dir = str(Path(checkpoint).parent)
    return cfg


def _read_checkpoint(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    try:
        state = load_checkpoint(path, map_location="cpu")
    except (FileNotFoundError, CheckpointError) as err:
        raise ConfigError(str(err)) from None
    missing = {"config", "model", "optimizer", "epoch", "batch", "rng"} - set(state)
    if missing:
        raise ConfigError(f"{path} is not a training checkpoint (missing {sorted(missing)})")
    return state


def _load_resume_state(path, cfg: TrainConfig, world_size: int) -> Dict[str, Any]:
    state = _read_checkpoint(path)
    saved = TrainConfig.from_dict(state["config"])
    differ = sorted(k for k, v in saved.to_dict().items()
                    if k not in RESUME_OVERRIDABLE and cfg.to_dict()[k] != v)
    if differ:
        raise ConfigError(f"the configuration differs from the checkpoint's in {differ}; "
                          "build it with config_for_resume()")
    if state["world_size"] != world_size:
        if state["batch"] != 0:
            raise ConfigError(
                f"{path} was saved mid-epoch by {state['world_size']} process(es); resume it "
                f"with the same number of processes (now {world_size})")
        warnings.warn(f"resuming a {state['world_size']}-process run with {world_size} "
                      "process(es): the batches differ from an uninterrupted run")
        # Every rank starts from rank 0's RNG and an empty epoch.
        state["rng"] = [state["rng"][0]] * world_size
        state["partial"] = [_empty_partial() for _ in range(world_size)]
    return state


# ============================================================================ small helpers


def _clock() -> float:
    """Monotonic wall clock of the time budget (a function so tests can replace it)."""
    return time.monotonic()


def _process_clock() -> float:
    """CPU seconds of this process, all threads (``--budget-clock process``)."""
    return time.process_time()


def _say(message: str, enabled: bool = True) -> None:
    if enabled:
        tqdm.write(message, file=sys.stdout)


def _autocast(device_type: str, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _resolve_device(spec: str) -> torch.device:
    try:
        return resolve_device(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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


def _build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    overrides = cfg.model_overrides()
    try:
        return build_model(cfg.model, num_classes, **overrides)
    except (TypeError, ValueError) as err:
        # Name the command-line flag when the model rejected an ablation switch.
        rejected = [flag for name, (flag, key) in ABLATION_FLAGS.items()
                    if getattr(cfg, name) is not None and repr(key) in str(err)]
        if rejected:
            raise ConfigError(f"{', '.join(rejected)} does not apply to model {cfg.model!r} "
                              f"({err})") from None
        raise ConfigError(f"cannot build model {cfg.model!r} with {overrides}: {err}") from None


def _load_data(cfg: TrainConfig) -> Tuple[ImageDataset, ImageDataset]:
    try:
        train_set = load_cifar(cfg.dataset, "train", cfg.data_dir, download=cfg.download)
        test_set = load_cifar(cfg.dataset, "test", cfg.data_dir, download=cfg.download)
    except (DataError, FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    except OSError as err:  # a failed download
        raise ConfigError(str(err)) from None
    if cfg.subset:
        train_set = train_set.subset(cfg.subset, seed=cfg.seed)
    if cfg.test_subset:
        test_set = test_set.subset(cfg.test_subset, seed=cfg.seed)
    return train_set, test_set


def _num_parameters(model: nn.Module) -> int:
    fn = getattr(model, "num_parameters", None)
    return int(fn()) if callable(fn) else sum(p.numel() for p in model.parameters())


def _summary(model: nn.Module) -> str:
    fn = getattr(model, "summary", None)
    if callable(fn):
        return fn()
    return f"{type(model).__name__}: {_num_parameters(model):,} parameters"


def _betas(model: nn.Module) -> Dict[str, List[float]]:
    fn = getattr(model, "betas", None)
    if not callable(fn):
        return {}
    return {name: value.detach().float().cpu().reshape(-1).tolist()
            for name, value in fn().items()}


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


def _empty_partial() -> Dict[str, float]:
    return {"loss_sum": 0.0, "correct": 0.0, "seen": 0, "train_seconds": 0.0}


def _reduce_partial(run: Dict[str, float], device: torch.device) -> Dict[str, float]:
    """Mean training loss / accuracy of the current epoch over all ranks."""
    sums = torch.tensor([run["loss_sum"], run["correct"], run["seen"]], dtype=torch.float64,
                        device=device)
    loss_sum, correct, seen = all_reduce_sum(sums).tolist()
    return {"loss": loss_sum / max(seen, 1), "acc": correct / max(seen, 1), "seen": seen}


def _stop_requested(interrupt: "_InterruptFlag", deadline: Optional[float],
                    device: torch.device, distributed: bool,
                    clock=None) -> Optional[str]:
    """``"interrupt"``, ``"time_budget"`` or ``None``, agreed on by every rank."""
    now = (clock or _clock)()
    code = 2 if interrupt.requested else 1 if deadline is not None and now > deadline else 0
    if distributed:
        # All ranks must stop at the same step, or the next all-reduce would hang.
        code = int(all_reduce_max(torch.tensor([code], device=device)).item())
    return {0: None, 1: "time_budget", 2: "interrupt"}[code]


class _InterruptFlag:
    """Turns the first SIGINT/SIGTERM into a flag the loop polls between steps.

    A second signal in a single process raises ``KeyboardInterrupt`` at once (the
    user insists); under torchrun it is ignored, since the launcher forwards its
    own copy of every signal and kills the workers after a grace period anyway.
    Handlers can only be installed from the main thread; elsewhere signals keep
    their default behaviour.
    """

    def __init__(self, distributed: bool):
        self.distributed = distributed
        self.requested = False
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.requested and not self.distributed:
            raise KeyboardInterrupt
        self.requested = True
        # os.write, not print: a handler must not re-enter buffered stdout.
        os.write(2, f"\n{signal.Signals(signum).name} received: stopping at the next step "
                    "boundary and saving a checkpoint (Ctrl-C again to abort without saving)\n"
                 .encode())

    def __enter__(self) -> "_InterruptFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
