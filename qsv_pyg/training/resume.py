"""Resuming a run: which configuration, and whether the checkpoint fits what is built.

A resumed run continues exactly, so everything it resumes on must be what the
checkpoint was written for. Before any state is loaded this module checks

* the configuration: equal to the checkpoint's except for the
  :func:`~qsv_pyg.training.config.resume_overridable` fields and the fields an
  older checkpoint lacks (:func:`unrecorded_fields`: they resume at the value
  given, or today's default, with a warning naming them);
* the data: the dataset, the number of training and test images (and the
  labels' checksum, in checkpoints that carry it) and so ``steps_per_epoch``;
* the position: an epoch and batch that exist in this run, and a scheduler
  that stands at that step;
* the states: the model's, the optimiser's, the scheduler's and the RNG's must
  belong to the model and optimiser being built.

Every mismatch raises :class:`~qsv_pyg.training.config.ConfigError` naming
what differs, which the command line turns into exit code 2.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import torch
from torch import nn

from .checkpoint import CheckpointError, load_checkpoint, restore_rng_state
from .config import _BEFORE_FIELD_EXISTED, ConfigError, TrainConfig, flag_of, resume_overridable
from .config import upgrade_keys
from .state import LoopState, empty_partial

__all__ = ["budget_so_far", "check_data", "config_for_resume", "data_facts",
           "load_for_resume", "read_training_checkpoint", "restore", "restore_model",
           "unrecorded_fields"]

_LOG = logging.getLogger(__name__)
_REQUIRED = ("config", "model", "optimizer", "epoch", "batch", "rng")


def read_training_checkpoint(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """Load a checkpoint written by the trainer (on the CPU).

    Raises:
        ConfigError: unreadable, or not a training checkpoint.
    """
    try:
        state = load_checkpoint(path, map_location="cpu")
    except (FileNotFoundError, CheckpointError) as err:
        raise ConfigError(str(err)) from None
    missing = set(_REQUIRED) - set(state)
    if missing:
        raise ConfigError(f"{path} is not a training checkpoint (missing {sorted(missing)})")
    return state


def unrecorded_fields(saved: Dict[str, Any]) -> Tuple[str, ...]:
    """Fields that a checkpoint's stored configuration ``saved`` lacks and whose value
    in that run is unknown.

    A checkpoint written before a field existed lacks it. Where the behaviour
    before the field is known (``config._BEFORE_FIELD_EXISTED``), the run resumes
    with that value as if it had been stored; the others resume at the value given
    now, or today's default, which the checkpoint never fixed. The
    :func:`~qsv_pyg.training.config.resume_overridable` fields are not listed:
    they may differ anyway. Old field names count as the fields they became.
    """
    saved = upgrade_keys(saved)
    allowed = resume_overridable()
    return tuple(name for name in TrainConfig.describe()
                 if name not in saved and name not in _BEFORE_FIELD_EXISTED
                 and name not in allowed)


def config_for_resume(checkpoint: "str | os.PathLike[str]", overrides: Dict[str, Any]
                      ) -> TrainConfig:
    """The configuration stored in ``checkpoint`` with the allowed ``overrides``.

    Args:
        checkpoint: checkpoint file.
        overrides: config fields given explicitly for the resumed run. Fields in
            :func:`~qsv_pyg.training.config.resume_overridable` replace the stored
            values; any other field must equal the stored value, except a field
            the checkpoint lacks (:func:`unrecorded_fields`): it takes the value
            given. ``out_dir`` defaults to the checkpoint's folder.

    A checkpoint that lacks fields is resumed with a warning (logger
    ``qsv_pyg.training.resume``) naming each and the value it resumes at.

    Raises:
        ConfigError: unreadable checkpoint, or an override that would change what
            the run computes.
    """
    allowed = resume_overridable()
    state = read_training_checkpoint(checkpoint)
    saved = state["config"]
    if not isinstance(saved, dict):
        raise ConfigError(f"{checkpoint}: its configuration is not a dict; the checkpoint is "
                          "damaged")
    saved = upgrade_keys(saved)  # the names of today's fields
    cfg = TrainConfig.from_dict(saved)  # fields it lacks: their old behaviour, or today's
    unrecorded = unrecorded_fields(saved)
    changed = sorted(k for k, v in overrides.items()
                     if k not in allowed and k not in unrecorded and getattr(cfg, k) != v)
    if changed:
        details = ", ".join(f"{flag_of(k)} {getattr(cfg, k)!r} -> {overrides[k]!r}"
                            + (" (the checkpoint predates the option: that was its "
                               "behaviour)" if k not in saved else "")
                            for k in changed)
        flags = ", ".join(flag_of(k) for k in sorted(allowed))
        raise ConfigError(f"cannot change {details} when resuming {checkpoint}; only {flags} "
                          "may differ (start a new run instead)")
    cfg = cfg.replace(**{k: v for k, v in overrides.items() if k in allowed or k in unrecorded})
    if not overrides.get("out_dir"):
        cfg.out_dir = str(Path(checkpoint).parent)
    _tell_missing(checkpoint, saved, cfg, overrides)
    return cfg


def _tell_missing(checkpoint: "str | os.PathLike[str]", saved: Dict[str, Any],
                  cfg: TrainConfig, overrides: Dict[str, Any]) -> None:
    """Warn about the fields ``saved`` lacks and the values the run resumes at."""
    allowed = resume_overridable()
    flags = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata["group"] is not None]
    missing = [k for k in flags if k not in saved and k not in allowed]
    if not missing:
        return

    def why(name: str) -> str:
        if name in _BEFORE_FIELD_EXISTED:
            return "its behaviour before the option existed"
        return "as given" if name in overrides else "today's default"

    values = ", ".join(f"{flag_of(k)} {getattr(cfg, k)!r} ({why(k)})" for k in missing)
    message = (f"{checkpoint} was written before {len(missing)} option(s) existed; "
               f"resuming with {values}")
    guess = [flag_of(k) for k in missing if k not in _BEFORE_FIELD_EXISTED and k not in overrides]
    if guess:
        message += f"; give {', '.join(guess)} if the run trained with another value"
    _LOG.warning(message)


def load_for_resume(path: "str | os.PathLike[str]", cfg: TrainConfig,
                    world_size: int) -> Dict[str, Any]:
    """Read ``path`` for resuming ``cfg`` with ``world_size`` processes.

    Raises:
        ConfigError: unreadable checkpoint, another configuration, or a
            mid-epoch checkpoint of another number of processes.
    """
    state = read_training_checkpoint(path)
    allowed = resume_overridable()
    if not isinstance(state["config"], dict):
        raise ConfigError(f"{path}: its configuration is not a dict; the checkpoint is damaged")
    unrecorded = set(unrecorded_fields(state["config"]))  # the checkpoint never fixed them
    saved = TrainConfig.from_dict(state["config"]).to_dict()
    mine = cfg.to_dict()
    differ = sorted(k for k, v in saved.items()
                    if k not in allowed and k not in unrecorded and mine[k] != v)
    if differ:
        raise ConfigError(f"the configuration differs from the checkpoint's in {differ}; "
                          "build it with config_for_resume()")
    saved_world = state.get("world_size", 1)
    if not (isinstance(state["rng"], list) and len(state["rng"]) == saved_world
            and len(state.get("partial") or []) == saved_world):
        raise ConfigError(f"{path}: its RNG and running sums do not match its "
                          f"{saved_world} process(es); the checkpoint is damaged")
    if saved_world != world_size:
        if state["batch"] != 0:
            raise ConfigError(
                f"{path} was saved mid-epoch by {saved_world} process(es); resume it "
                f"with the same number of processes (now {world_size})")
        warnings.warn(f"resuming a {saved_world}-process run with {world_size} "
                      "process(es): the batches differ from an uninterrupted run")
        # Every rank starts from rank 0's RNG and an empty epoch.
        state["rng"] = [state["rng"][0]] * world_size
        state["partial"] = [empty_partial() for _ in range(world_size)]
    return state


def budget_so_far(state: Dict[str, Any]) -> Tuple[float, float]:
    """``(budget-clock seconds used, seconds of mark evaluations)`` by the run so far
    (zeros for checkpoints written before the count was kept)."""
    return (float(state.get("budget_used_s", 0.0)),
            float(state.get("budget_eval_seconds", 0.0)))


# ---------------------------------------------------------------------------- the data


def data_facts(dataset: str, train_labels: Any, test_labels: Any,
               steps_per_epoch: int) -> Dict[str, Any]:
    """What a checkpoint records about its data, to check a resume against.

    The labels' checksum tells a copy of the same data (allowed: ``--data-dir``
    may move) from other data of the same size.
    """
    digest = hashlib.sha256()
    for labels in (train_labels, test_labels):
        digest.update(np.ascontiguousarray(torch.as_tensor(labels).cpu().numpy(),
                                           dtype=np.int64).tobytes())
    return {"dataset": dataset, "train_images": len(train_labels),
            "test_images": len(test_labels), "labels_sha256": digest.hexdigest(),
            "steps_per_epoch": steps_per_epoch}


def check_data(state: Dict[str, Any], facts: Dict[str, Any], epochs: int,
               world_size: int) -> None:
    """The checkpoint fits the data it resumes on, and its position exists.

    Args:
        state: the checkpoint.
        facts: :func:`data_facts` of the data loaded now.
        epochs: planned epochs.
        world_size: processes now (with another number, at an epoch boundary,
            the steps per epoch may differ).

    Raises:
        ConfigError: naming what differs.
    """
    saved = state.get("data") or {}
    if saved and (saved["train_images"], saved["test_images"]) != (
            facts["train_images"], facts["test_images"]):
        raise ConfigError(
            f"the checkpoint was trained on {saved['train_images']} training and "
            f"{saved['test_images']} test images, the data now has {facts['train_images']} and "
            f"{facts['test_images']}; resume on the same data (--data-dir, --subset)")
    if saved and saved.get("labels_sha256") not in (None, facts["labels_sha256"]):
        raise ConfigError("the data now has other labels than the checkpoint's training data "
                          "(same sizes, different content); resume on the same data")
    steps = facts["steps_per_epoch"]
    saved_steps = state.get("steps_per_epoch", steps)
    if saved_steps != steps and state.get("world_size", 1) == world_size:
        raise ConfigError(f"the checkpoint has {saved_steps} steps per epoch, the data and batch "
                          f"size now give {steps}; resume on the same data")
    epoch, batch = state["epoch"], state["batch"]
    if not (_is_int(epoch) and _is_int(batch) and 0 <= epoch <= epochs and 0 <= batch < steps
            and not (epoch == epochs and batch)):
        raise ConfigError(f"the checkpoint's position (epoch {epoch!r}, batch {batch!r}) does "
                          f"not exist in a run of {epochs} epochs of {steps} steps; the "
                          "checkpoint is damaged")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------- the states


def restore_model(model: nn.Module, state: Dict[str, Any], name: str) -> None:
    """Load the checkpoint's model weights into ``model`` (built as model ``name``).

    Raises:
        ConfigError: the weights belong to another architecture.
    """
    weights = state["model"]
    mine = model.state_dict()
    if not isinstance(weights, dict):
        raise ConfigError("the checkpoint's model state is not a state dict")
    missing = sorted(set(mine) - set(weights))
    unexpected = sorted(set(weights) - set(mine))
    shapes = sorted(k for k in set(mine) & set(weights) if not isinstance(
        weights[k], torch.Tensor) or weights[k].shape != mine[k].shape)
    if missing or unexpected or shapes:
        parts = [f"{len(v)} {what} (e.g. {v[0]!r})" for what, v in (
            ("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)) if v]
        raise ConfigError(f"the checkpoint's model state does not fit model {name!r}: "
                          f"{', '.join(parts)} weights; it belongs to another architecture")
    model.load_state_dict(weights)


def restore(state: Dict[str, Any], rank: int, optimizer: torch.optim.Optimizer, scheduler,
            scaler: torch.amp.GradScaler, steps_per_epoch: int, world_size: int) -> LoopState:
    """Load the optimiser, scheduler, scaler and this rank's RNG; return the loop state.

    A run resumed with another number of processes (only at an epoch boundary)
    has another number of steps per epoch: its scheduler continues from the
    step of the same epoch.

    Raises:
        ConfigError: a state that belongs to another optimiser, scheduler or RNG.
    """
    step = state["epoch"] * steps_per_epoch + state["batch"]
    sched = state.get("scheduler")
    if not (isinstance(sched, dict) and "last_epoch" in sched
            and isinstance(sched.get("base_lrs"), list)
            and len(sched["base_lrs"]) == len(optimizer.param_groups)):
        raise ConfigError("the checkpoint's scheduler state belongs to another scheduler or "
                          "optimiser")
    if state.get("world_size", 1) != world_size:
        sched = dict(sched, last_epoch=step, _step_count=step + 1)
    elif sched["last_epoch"] != step:
        raise ConfigError(f"the checkpoint's scheduler stands at step {sched['last_epoch']!r}, "
                          f"its position at step {step}; the checkpoint is damaged")
    for what, load, value in (("optimizer", optimizer.load_state_dict, state["optimizer"]),
                              ("scheduler", scheduler.load_state_dict, sched),
                              ("gradient scaler", scaler.load_state_dict, state.get("scaler")),
                              ("RNG", restore_rng_state, state["rng"][rank])):
        try:
            load(value)
        except (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError) as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise ConfigError(f"the checkpoint's {what} state does not fit this run "
                              f"({reason})") from None
    return LoopState.from_checkpoint(state, rank)
