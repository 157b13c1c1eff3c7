"""The training loop: data, model, optimiser, schedule, epochs, checkpoints.

Read :func:`train` and then :func:`_fit` top to bottom, in the spirit of
nanoGPT's ``train.py``: :func:`~qsv_pyg.training.setup.build_run` sets a run up
in numbered steps, the loop trains, evaluates, logs and checkpoints, and
:func:`_finish` writes the metrics.
One run writes into ``cfg.out_dir`` (the files are described in
:mod:`~qsv_pyg.training.run_files`)::

    config.json     the full TrainConfig of the run
    log.jsonl       one JSON line per finished epoch (losses, accuracies, lr, β, timing)
    checkpoint.pt   the latest state (model, optimiser, schedule, RNG, loop state)
    metrics.json    final summary, written when the run ends

The folder is locked while the run is alive, checked before the data is loaded,
and every file in it is written atomically.

Resuming (``--resume``, :mod:`~qsv_pyg.training.resume`) is exact: the data
order and augmentation are functions of ``(seed, epoch, rank, batch)`` (see
:class:`~qsv_pyg.data.DeviceLoader`), and the checkpoint holds everything else
that changes during training (:class:`~qsv_pyg.training.state.LoopState`, the
RNG state of every rank). On the CPU, an interrupted and resumed run writes the
same ``log.jsonl`` as an uninterrupted one, bit for bit, apart from the timing
fields (:data:`TIMING_FIELDS`). That holds on the CPU only. On CUDA a resumed
run continues from exactly the saved state, but its later steps are not
guaranteed to match an uninterrupted run bit for bit: reductions by float
atomics (``index_add`` and ``scatter`` in PyG's attention layers and in the
PyTorch path of the QSV operator), cuBLAS/cuDNN algorithm choice, and TF32
(``--tf32``) or bf16 (``--amp``) rounding vary from run to run.
``torch.use_deterministic_algorithms(True)`` is no general way out: the CUDA
backward of ``grid_sample`` (the patch embedding,
:mod:`qsv_pyg.models.embedding`) has no deterministic kernel and raises, when
it runs (only if the images or the sampling grid require a gradient; training
does not). ``benchmarks/check_determinism.py`` measures it on a GPU.

Stopping early (:mod:`~qsv_pyg.training.stopping`):

* **Ctrl-C / SIGTERM**: the first signal only sets a flag; the loop notices it
  at the next step boundary (or after the current evaluation), writes a
  mid-epoch checkpoint holding the batch index and raises
  :class:`TrainingInterrupted`. The handlers stay installed until that save
  is complete; a signal during a save is ignored. A ``KeyboardInterrupt``
  raised *between* steps (e.g. a second Ctrl-C during data preparation or
  evaluation) is saved the same way; one raised in the middle of an optimiser
  step cannot be saved exactly, so then nothing is written and the last
  checkpoint stays the resume point.
* **The C++ CPU kernel** of QSV attention (:mod:`qsv_pyg.nn._cpu_ext`) is
  built (about a minute, once per machine) or loaded before the first step
  (:func:`_build_kernel`), not inside it. A Ctrl-C during the compile, which
  stops the compiler too, makes this process use the PyTorch implementation;
  the loop then stops at its first step boundary and saves, and a second
  Ctrl-C there is a ``KeyboardInterrupt`` between steps, saved the same way.
* **Time budget** (``cfg.time_budget`` minutes of ``cfg.budget_clock``):
  checked before every step; the run saves a mid-epoch checkpoint, evaluates
  and writes ``metrics.json`` with ``stopped_early: true``.
* **Non-finite loss**: :class:`NonFiniteLossError` naming the epoch and step;
  no checkpoint is written after the bad step, so the last good one survives.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import time
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from qsv_pyg.data import DeviceLoader
from qsv_pyg.nn import QSVConv, _cpu_ext
from qsv_pyg.utils import cpu_name

from . import stopping
from .checkpoint import capture_rng_state, save_checkpoint
from .config import TrainConfig
from .distributed import all_gather_object, all_reduce_max_host, cleanup_distributed
from .distributed import init_distributed
from .run_files import LOG_NAME, METRICS_NAME, RunFolderError, append_jsonl, truncate_log
from .run_files import write_json
from .schedule import warmup_cosine_factor
from .evaluation import WithAuxiliaryLoss, betas, evaluate
from .setup import Run, build_run, resolve_device
from .readback import Readback
from .state import LoopState, reduce_partial

__all__ = ["NonFiniteLossError", "TIMING_FIELDS", "TrainingInterrupted", "WithAuxiliaryLoss",
           "evaluate", "train"]

#: Log fields that measure wall time; everything else in a log line is reproducible.
TIMING_FIELDS = ("seconds", "images_per_s")

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
        cfg: the run configuration (validated here, unless it comes validated and
            unchanged, as from :func:`~qsv_pyg.training.cli.config_from_args`;
            the run works on a private copy).
        resume_from: a checkpoint written by a previous run; its configuration must
            equal ``cfg`` except for the resume-overridable fields (build ``cfg``
            with :func:`~qsv_pyg.training.resume.config_for_resume`).

    Returns:
        The contents of ``metrics.json`` (on every rank).

    Raises:
        ConfigError: invalid options, unusable data, a model that rejects the
            requested ablations, or a checkpoint that does not fit the run.
        RunFolderError: the run folder cannot be locked or written.
        NonFiniteLossError: the loss became NaN/inf.
        TrainingInterrupted: Ctrl-C or SIGTERM (after saving a checkpoint).
    """
    cfg = copy.deepcopy(cfg)  # private: the run sets its out_dir
    if not cfg.is_validated():
        cfg.validate()
    t_start, cpu_start = stopping.wall_clock(), stopping.process_clock()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    dist_info = init_distributed(device.type)
    try:
        with contextlib.ExitStack() as run_folder:  # holds the out-dir's lock
            run, state = build_run(cfg, resume_from, device, dist_info, t_start, run_folder,
                                   cpu_start=cpu_start)
            progress = _Progress()
            with stopping.InterruptFlag(distributed=dist_info.enabled) as interrupt:
                stop_reason = _fit(run, state, progress, interrupt)
                if stop_reason:
                    # Still inside the handlers: a further signal cannot cut this save.
                    _absorb(run, state, progress)
                    _save(run, state, interrupt)
            if stop_reason == "interrupt":
                raise TrainingInterrupted(
                    f"interrupted: saved {run.ckpt_path} at epoch {state.epoch + 1}, batch "
                    f"{state.batch}/{run.steps_per_epoch}; continue with --resume "
                    f"{run.ckpt_path}", checkpoint=str(run.ckpt_path), saved=True)
            return _finish(run, state, progress.last_train, stop_reason)
    finally:
        cleanup_distributed()


# ============================================================================ the loop


@dataclasses.dataclass
class _Progress:
    """What the loop tracks besides :class:`LoopState` (never saved)."""

    in_step: bool = False  # inside forward/backward/optimiser step: not resumable if interrupted
    t_epoch: Optional[float] = None  # perf_counter origin of this epoch's training time
    pending: Optional[tuple] = None  # (step, batch, readback slot) checked one step late
    last_train: Optional[Dict[str, float]] = None
    readback: Optional[Readback] = None  # the host copies of the steps' metrics


def _fit(run: Run, state: LoopState, progress: _Progress,
         interrupt: stopping.InterruptFlag) -> Optional[str]:
    """Train until the planned epochs are done or something stops the run.

    Returns:
        ``None`` (all epochs done), ``"time_budget"`` or ``"interrupt"``.
    """
    try:
        _build_kernel(run, interrupt)
        while state.epoch < run.cfg.epochs:
            # ---- train one epoch (from state.batch, which is > 0 only after a resume)
            stop_reason = _train_epoch(run, state, progress, interrupt)
            if stop_reason:
                return stop_reason
            # ---- evaluate, log, checkpoint
            _end_epoch(run, state, progress, interrupt)
    except KeyboardInterrupt:
        if progress.in_step or run.dist.enabled:
            # Half an optimiser step cannot be resumed exactly, and with several
            # processes the others are not at this point: keep the last checkpoint.
            have = run.ckpt_path if run.ckpt_path.exists() else None
            raise TrainingInterrupted(
                "interrupted in the middle of a step; nothing new was saved"
                + (f", resume from {have}" if have else ""),
                checkpoint=str(have) if have else None, saved=False) from None
        if progress.t_epoch is not None:  # interrupted between two training steps
            state.partial["train_seconds"] = time.perf_counter() - progress.t_epoch
        return "interrupt"
    return None


def _build_kernel(run: Run, interrupt: stopping.InterruptFlag) -> None:
    """Build (or load) the C++ CPU kernel now if the model will use it.

    Built lazily inside the first step, a compile of about a minute would sit
    in the middle of a step: a terminal Ctrl-C (which stops the compiler too)
    would then interrupt that step. Here it is between steps: an interrupted
    build falls back to the PyTorch implementation (with a warning), the loop
    stops at its first step boundary and saves; a wait for another process's
    build ends as soon as a stop is requested.
    """
    if interrupt.requested or run.device.type != "cpu" \
            or not any(isinstance(m, QSVConv) for m in run.model.modules()):
        return  # (already stopping: the loop ends before its first step)
    _cpu_ext.cpu_kernel(stop=lambda: interrupt.requested)


def _train_epoch(run: Run, state: LoopState, progress: _Progress,
                 interrupt: stopping.InterruptFlag) -> Optional[str]:
    """Optimiser steps from ``state.batch`` to the end of the epoch, or to a stop."""
    cfg = run.cfg
    run.model.train()
    progress.t_epoch = time.perf_counter() - state.partial["train_seconds"]
    stop_reason = None
    with tqdm(total=run.steps_per_epoch, initial=state.batch, desc=f"epoch {state.epoch + 1}/"
              f"{cfg.epochs}", disable=not (cfg.progress and run.dist.is_main),
              dynamic_ncols=True, leave=False, file=sys.stderr) as bar:
        for images, labels in run.train_loader.epoch(state.epoch, start_batch=state.batch):
            if run.marks:
                _evaluate_at_mark(run, state)
            stop_reason = stopping.stop_requested(interrupt, run.budget, run.device,
                                                  run.dist.enabled)
            if stop_reason:
                break
            progress.in_step = True
            step = state.step(run.steps_per_epoch)
            with run.autocast():
                logits, aux_loss = run.train_model(images)
                loss = F.cross_entropy(logits, labels,
                                       label_smoothing=cfg.label_smoothing) + aux_loss
            run.optimizer.zero_grad(set_to_none=True)
            run.scaler.scale(loss).backward()
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.scheduler.step()
            if run.anneal:
                _set_budget_lr(run, step + 1)
            correct = (logits.argmax(dim=1) == labels).sum()
            progress.in_step = False
            # Reading the previous step's loss now (its own event, not the queue's
            # end) lets the GPU run ahead by one step.
            _absorb(run, state, progress)
            if progress.readback is None:
                progress.readback = Readback(run.device)
            slot = progress.readback.push(torch.stack([loss.detach().float(),
                                                       correct.float()]))
            progress.pending = (step, state.batch, slot)
            state.batch += 1
            bar.update()
            if state.batch % _POSTFIX_EVERY == 0 and state.partial["seen"]:
                _show_progress(bar, state, time.perf_counter() - progress.t_epoch,
                               run.dist.world_size)
        _absorb(run, state, progress)
        state.partial["train_seconds"] = time.perf_counter() - progress.t_epoch
        progress.t_epoch = None
    return stop_reason


def _absorb(run: Run, state: LoopState, progress: _Progress) -> None:
    """Check the pending step's loss and add it to the epoch's running sums
    (waiting for that step's copy only, :class:`~qsv_pyg.training.readback.Readback`)."""
    if progress.pending is None:
        return
    bad_step, bad_batch, slot = progress.pending
    assert progress.readback is not None
    loss_value, correct = progress.readback.read(slot)
    progress.pending = None
    if not math.isfinite(loss_value):
        where = (f"a checkpoint ({run.ckpt_path}) holds the last good state"
                 if run.ckpt_path.exists() else "no checkpoint had been written yet")
        raise NonFiniteLossError(
            f"non-finite training loss ({loss_value}) at epoch {state.epoch + 1}, step "
            f"{bad_step} (batch {bad_batch + 1}/{run.steps_per_epoch}); training stopped and "
            f"nothing was saved after the bad step, {where}. Try a lower --lr or --amp none.",
            epoch=state.epoch + 1, step=bad_step, value=loss_value)
    state.partial["loss_sum"] += loss_value * run.cfg.batch_size
    state.partial["correct"] += correct
    state.partial["seen"] += run.cfg.batch_size


def _end_epoch(run: Run, state: LoopState, progress: _Progress,
               interrupt: stopping.InterruptFlag) -> None:
    """Evaluate, log and checkpoint a finished epoch."""
    t_eval = time.perf_counter()
    step = state.step(run.steps_per_epoch)
    train_stats = reduce_partial(state.partial, run.device)
    test_stats = evaluate(run.eval_model, run.test_loader, run.autocast)
    seconds = state.partial["train_seconds"] + time.perf_counter() - t_eval
    record = {
        "epoch": state.epoch + 1, "step": step,
        "train_loss": train_stats["loss"], "train_acc": train_stats["acc"],
        "test_loss": test_stats["loss"], "test_acc": test_stats["acc"],
        "lr": _lr_at(run, step - 1), "betas": betas(run.model),
        "seconds": seconds,
        "images_per_s": train_stats["seen"] / max(state.partial["train_seconds"], 1e-9),
    }
    # Log first, then advance the position: an interrupt before this point
    # re-evaluates the epoch on resume (and rewrites its line), one after it
    # finds the finished epoch in the checkpoint.
    if run.dist.is_main:
        append_jsonl(run.out_dir / LOG_NAME, record)
    progress.last_train = {"loss": train_stats["loss"], "acc": train_stats["acc"]}
    state.finish_epoch(record, seconds)
    try:
        _save(run, state, interrupt)
    except RunFolderError:
        # The checkpoint could not be written (e.g. a full disk): cut the log back
        # to the last checkpoint, so it never runs ahead of what a resume finds.
        if run.dist.is_main:
            truncate_log(run.out_dir / LOG_NAME, keep_epochs=state.epoch - 1)
        raise
    run.say(f"epoch {record['epoch']}/{run.cfg.epochs} | train loss {record['train_loss']:.4f} "
            f"acc {record['train_acc']:.4f} | test loss {record['test_loss']:.4f} "
            f"acc {record['test_acc']:.4f} | lr {record['lr']:.2e} | "
            f"{seconds:.1f}s {record['images_per_s']:,.0f} img/s")


def _save(run: Run, state: LoopState, interrupt: stopping.InterruptFlag) -> None:
    """Checkpoint the current position; collective, rank 0 writes, signals wait."""
    rng_all = all_gather_object(capture_rng_state())
    partial_all = all_gather_object(dict(state.partial))
    if not run.dist.is_main:
        return
    with interrupt.saving():
        save_checkpoint(run.ckpt_path, {
            "config": run.cfg.to_dict(), "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict(), **state.state_dict(), "partial": partial_all,
            "rng": rng_all, "world_size": run.dist.world_size,
            "steps_per_epoch": run.steps_per_epoch, "optimizer_backend": run.backend,
            "data": run.data_facts, "budget_used_s": run.budget.run_seconds(fresh=False),
            "budget_eval_seconds": run.budget.eval_seconds()})


# ============================================================================ schedule


def _lr_at(run: Run, step: int) -> float:
    """The learning rate of optimiser step ``step`` (of the first param group)."""
    if run.anneal:
        return run.optimizer.param_groups[0]["lr"]
    return run.cfg.lr * warmup_cosine_factor(step, run.warmup_steps, run.total_steps,
                                              run.cfg.min_lr_ratio)


def _set_budget_lr(run: Run, next_step: int) -> None:
    """``--anneal-to-budget``: the cosine follows the epochs or the budget, whichever ends first.

    Models of different speed then get the same schedule shape, and a
    budget-stopped run still ends annealed. Time-dependent, so such runs are not
    bit-reproducible.
    """
    if next_step < run.warmup_steps:
        return  # the step-based warm-up stays as it is
    factor = warmup_cosine_factor(next_step, run.warmup_steps, run.total_steps,
                                  run.cfg.min_lr_ratio, min_progress=run.budget.used())
    for group in run.optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor  # keeps each group's own ratio


# ============================================================================ evaluation


def _evaluate_at_mark(run: Run, state: LoopState) -> None:
    """Evaluate if the budget clock passed the next mark (every rank agrees).

    The evaluation's time is charged off the budget (it moves the deadline), so
    it takes no training time from the run.
    """
    due = 1 if run.marks and run.budget.run_seconds() >= 60.0 * run.marks[0] else 0
    if run.dist.enabled:
        due = all_reduce_max_host([due])[0]  # agreed on the host: no device sync
    if not due:
        return
    t0 = run.budget.now()
    stats = evaluate(run.eval_model, run.test_loader, run.autocast)
    entry = {"minutes": run.marks.pop(0), "test_acc": stats["acc"], "test_loss": stats["loss"],
             "epoch": state.epoch, "batch": state.batch,
             "step": state.step(run.steps_per_epoch), "betas": betas(run.model)}
    state.budget_evals.append(entry)
    run.budget.charge += run.budget.now() - t0
    run.say(f"budget mark {entry['minutes']:g} min: test acc {stats['acc']:.4f} "
            f"(epoch {state.epoch + 1}, batch {state.batch}/{run.steps_per_epoch})")


def _show_progress(bar: tqdm, state: LoopState, seconds: float, world_size: int) -> None:
    p = state.partial
    bar.set_postfix(loss=f"{p['loss_sum'] / p['seen']:.4f}", acc=f"{p['correct'] / p['seen']:.3f}",
                    img_s=f"{p['seen'] * world_size / seconds:,.0f}")


# ============================================================================ finish


def _finish(run: Run, state: LoopState, last_train: Optional[Dict[str, float]],
            stop_reason: Optional[str]) -> Dict[str, Any]:
    """Evaluate if the model changed since the last evaluation; write ``metrics.json``."""
    cfg = run.cfg
    if stop_reason == "time_budget":
        run.say(f"time budget of {cfg.time_budget} min reached at epoch {state.epoch + 1}, "
                f"batch {state.batch}/{run.steps_per_epoch}; saved {run.ckpt_path}")
        if state.partial["seen"]:
            partial = reduce_partial(state.partial, run.device)
            last_train = {"loss": partial["loss"], "acc": partial["acc"]}
            state.total_seconds += state.partial["train_seconds"]
    if stop_reason or state.last_eval is None:
        # Stopped early: the model changed since the last evaluation.
        test_stats = evaluate(run.eval_model, run.test_loader, run.autocast)
        final_test = {"loss": test_stats["loss"], "acc": test_stats["acc"]}
        if state.best["test_acc"] is None or final_test["acc"] > state.best["test_acc"]:
            state.best = {"test_acc": final_test["acc"], "epoch": state.epoch + (state.batch > 0)}
    else:
        final_test = {"loss": state.last_eval["test_loss"], "acc": state.last_eval["test_acc"]}
    if last_train is None and state.last_eval is not None:
        last_train = {"loss": state.last_eval["train_loss"], "acc": state.last_eval["train_acc"]}
    steps = state.step(run.steps_per_epoch)
    images_seen = steps * cfg.batch_size * run.dist.world_size
    seconds = state.total_seconds
    metrics = {
        "model": cfg.model, "dataset": cfg.dataset, "preset": cfg.preset,
        "test_acc": final_test["acc"], "test_loss": final_test["loss"],
        "train_acc": last_train["acc"] if last_train else None,
        "train_loss": last_train["loss"] if last_train else None,
        "best_test_acc": state.best["test_acc"], "best_epoch": state.best["epoch"],
        "epochs": state.epoch, "epochs_planned": cfg.epochs, "steps": steps,
        "params": run.n_params, "seconds": seconds,
        "images_per_s": images_seen / seconds if seconds > 0 else None,
        "stopped_early": stop_reason is not None, "stop_reason": stop_reason,
        "optimizer_backend": run.backend, "device": str(run.device),
        "world_size": run.dist.world_size, "amp": run.amp,
        "compile": cfg.compile, "train_images": run.data_facts["train_images"],
        "test_images": run.data_facts["test_images"], "betas": betas(run.model),
        "torch": torch.__version__, "cpu": cpu_name(), "cpu_count": os.cpu_count(),
        "budget_evals": state.budget_evals,
        "budget_used_s": run.budget.run_seconds(),
        "budget_eval_seconds": run.budget.eval_seconds(),
        "wall_seconds_this_process": stopping.wall_clock() - run.t_start,
    }
    if run.dist.is_main:
        write_json(run.out_dir / METRICS_NAME, metrics)
        run.say(f"done: test acc {metrics['test_acc']:.4f} (best "
                f"{metrics['best_test_acc']:.4f}) after {state.epoch} epoch(s); metrics in "
                f"{run.out_dir / METRICS_NAME}")
    return metrics
