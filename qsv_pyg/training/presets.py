"""Named presets: the paper's full-scale schedules, the CPU-scale study, and auto-<model>.

A preset is a dict of :class:`~qsv_pyg.training.config.TrainConfig` field
values applied on top of the defaults (``--config NAME``); explicit flags win
over it. This module holds data; it reads the model list from the registry and
the models' keywords from :mod:`qsv_pyg.models.zoo`, and holds the schedule
defaults (:data:`DEFAULT_SCHEDULE`) that ``TrainConfig`` and every preset start from.

* ``paper-<model>`` / ``paper-<model>-cifar100``: the paper's schedule;
* ``paper-qsv-<ablation>``: QSV with one switch changed;
* ``cpu-<model>``: one run of the CPU-scale equal-budget study (docs/results.md);
* ``auto-<model>``: ``paper-<model>`` on a GPU, ``cpu-<model>`` on a CPU
  (:func:`resolve_auto_preset`), so a first command finishes on the machine
  at hand.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from qsv_pyg.models import available_models
from qsv_pyg.models.graph_net import DEFAULT_HEADS
from qsv_pyg.models.zoo import accepted_overrides, model_overrides_for

__all__ = ["AUTO_PRESETS", "CPU_SCALE_MODEL_ARGS", "CPU_SCALE_SCHEDULE", "DEFAULT_SCHEDULE",
           "PRESETS", "resolve_auto_preset"]

#: The schedule of a run that sets none (the :class:`TrainConfig` defaults): AdamW-style
#: steps, linear warm-up, cosine decay to ``min_lr_ratio``, label smoothing.
DEFAULT_SCHEDULE: Dict[str, Any] = dict(
    epochs=100, batch_size=128, lr=1e-3, weight_decay=0.05, warmup_epochs=5.0,
    min_lr_ratio=0.0, label_smoothing=0.1)

# One recipe for every architecture, so the comparison is at equal budget: the
# default schedule over 300 epochs ("hundreds of epochs", the paper's full schedule;
# its exact hyper-parameters are not in this repository, so these are our choice)
# with 10 warm-up epochs. GPU-hour estimates per preset are in docs/results.md.
_PAPER_SCHEDULE: Dict[str, Any] = dict(DEFAULT_SCHEDULE, epochs=300, warmup_epochs=10.0)

# The paper's ablations of QSV: one switch each, everything else as in paper-qsv.
_QSV_ABLATIONS: Dict[str, Dict[str, Any]] = {
    "routing-abs": dict(routing="abs"),
    "routing-uniform": dict(routing="uniform"),
    "routing-geometric": dict(routing="geometric"),
    "transport-identity": dict(transport="identity"),
    "quat-features": dict(quat_source="features"),
    "quat-both": dict(quat_source="composed"),
    "frozen-field": dict(frozen_field=True),
    # The paper's probe freezes β at its warm-start value 5 (−0.4 points).
    "frozen-beta": dict(frozen_beta=True, beta_init=5.0),
    # A warm start at β₀ = 5 that the prior (centre 0.79, on by default) pulls back.
    "beta-warm5": dict(beta_init=5.0),
    # Before the paper-faithful defaults: no β prior, Haar-random field.
    "no-beta-prior": dict(beta_prior_weight=0.0),
    "no-repulsion": dict(repulsion_weight=0.0),
    # The block study: the kernel's candidate substitutes removed.
    "no-root": dict(root_weight=False),
    "no-mlp": dict(mlp_ratio=0.0),
    "kernel-only": dict(root_weight=False, mlp_ratio=0.0),
}


def _build_presets() -> Dict[str, Dict[str, Any]]:
    presets: Dict[str, Dict[str, Any]] = {}
    for model in available_models():
        presets[f"paper-{model}"] = dict(_PAPER_SCHEDULE, model=model, dataset="cifar10")
        presets[f"paper-{model}-cifar100"] = dict(_PAPER_SCHEDULE, model=model,
                                                  dataset="cifar100")
        if "repulsion_k" in (accepted_overrides(model) or ()):  # a quaternion field
            # The paper's CIFAR-100 runs repel 16 neighbours (8 on CIFAR-10).
            presets[f"paper-{model}-cifar100"]["repulsion_k"] = 16
    for name, switch in _QSV_ABLATIONS.items():
        presets[f"paper-qsv-{name}"] = dict(_PAPER_SCHEDULE, model="qsv", dataset="cifar10",
                                            **switch)
    # The CPU-scale study of docs/results.md: shrunken, parameter-matched models
    # (overrides passed with --model-arg), 5 CPU-minutes each, one thread.
    for model in available_models():
        presets[f"cpu-{model}"] = dict(CPU_SCALE_SCHEDULE, model=model, dataset="cifar10",
                                       model_args=CPU_SCALE_MODEL_ARGS[model])
    return presets


#: The CPU-scale study's models, described once (as ``reproduce.py --model-overrides``
#: describes them): five levels of 100-64-36-16-9 nodes (10², 8², 6², 4², 3² so the
#: lattice mirrors them), QSV with the paper's heads at width 64 (one 4-channel
#: block per head at 16 heads).
_CPU_SCALE_MODELS: Dict[str, Any] = dict(shell_sizes=(100, 64, 36, 16, 9), patch_size=4,
                                         widths=(64, 64, 64, 64, 64), heads=DEFAULT_HEADS)
#: Model overrides of the CPU-scale study, per model: that description as each model
#: spells it (:func:`~qsv_pyg.models.zoo.model_overrides_for`): the lattice on the
#: square grids of the shells' node counts, the attention controls with their own
#: heads (``control_heads``), parameter-matched to that QSV model; nothing for ResNet-20.
CPU_SCALE_MODEL_ARGS: Dict[str, Dict[str, Any]] = {
    model: {key: tuple(value) if isinstance(value, list) else value
            for key, value in model_overrides_for(model, _CPU_SCALE_MODELS).items()}
    for model in available_models()}

#: Training flags of the CPU-scale equal-budget study (docs/results.md).
CPU_SCALE_SCHEDULE: Dict[str, Any] = dict(
    DEFAULT_SCHEDULE, epochs=30, lr=2e-3, warmup_epochs=0.5, time_budget=5.0,
    budget_clock="process", anneal_to_budget=True, threads=1)


#: Preset name -> field values (applied on top of the :class:`TrainConfig` defaults).
#: ``paper-<model>`` and ``paper-<model>-cifar100`` for every compared model, and
#: ``paper-qsv-<ablation>`` for the QSV ablations.
PRESETS: Dict[str, Dict[str, Any]] = _build_presets()


#: ``auto-<model>`` -> (preset on a GPU, preset on a CPU).
AUTO_PRESETS: Dict[str, Tuple[str, str]] = {
    f"auto-{model}": (f"paper-{model}", f"cpu-{model}") for model in available_models()}


def resolve_auto_preset(name: str, device: str = "auto") -> Tuple[str, str]:
    """The preset ``auto-<model>`` stands for on ``device``, and why, in one line.

    Args:
        name: a key of :data:`AUTO_PRESETS`.
        device: the ``--device`` of the run (``auto`` looks for CUDA).

    Returns:
        ``(preset name, explanation)``: the paper schedule when the run will use
        a GPU, the CPU-scale study run otherwise.
    """
    import torch  # only here: the presets are data

    gpu, cpu = AUTO_PRESETS[name]
    spec = str(device).lower()
    paper = PRESETS[gpu]
    if spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available()):
        where = (f"--device {device}" if spec != "auto" else
                 f"a CUDA device was found ({torch.cuda.get_device_name()})")
        return gpu, (f"{name}: {where}, so {gpu}: the paper's full schedule "
                     f"({paper['epochs']} epochs of batch {paper['batch_size']})")
    cheap = PRESETS[cpu]
    where = "--device cpu" if spec == "cpu" else "no CUDA device was found"
    return cpu, (f"{name}: {where}, so {cpu}: the CPU-scale study run "
                 f"({cheap['time_budget']:g} minutes of CPU time on {cheap['threads']} thread, "
                 f"a shrunken model); on a GPU {name} runs {gpu}, the paper's "
                 f"{paper['epochs']}-epoch schedule")
