"""Named presets: the paper's full-scale schedules, the CPU-scale study, and auto-<model>.

A preset is a dict of :class:`~qsv_pyg.training.config.TrainConfig` field
values applied on top of the defaults (``--config NAME``); explicit flags win
over it. This module holds only data and needs no other part of the package.

* ``paper-<model>`` / ``paper-<model>-cifar100``: the paper's schedule;
* ``paper-qsv-<ablation>``: QSV with one switch changed;
* ``cpu-<model>``: one run of the CPU-scale equal-budget study (docs/results.md);
* ``auto-<model>``: ``paper-<model>`` on a GPU, ``cpu-<model>`` on a CPU
  (:func:`resolve_auto_preset`), so a first command finishes on the machine
  at hand.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

__all__ = ["AUTO_PRESETS", "CPU_SCALE_MODEL_ARGS", "CPU_SCALE_SCHEDULE", "PRESETS",
           "resolve_auto_preset"]


# One recipe for every architecture, so the comparison is at equal budget:
# AdamW-style optimiser, 10 warm-up epochs, cosine to zero, label smoothing 0.1,
# 300 epochs ("hundreds of epochs", the paper's full schedule; its exact
# hyper-parameters are not in this repository, so these are our choice).
# GPU-hour estimates per preset are in docs/results.md.
_PAPER_SCHEDULE: Dict[str, Any] = dict(
    epochs=300, batch_size=128, lr=1e-3, weight_decay=0.05, warmup_epochs=10.0,
    min_lr_ratio=0.0, label_smoothing=0.1)

_MAIN_MODELS = ("qsv", "attention-gat", "attention-gatv2", "attention-transformer",
                "lattice", "resnet20")

# The paper's ablations of QSV: one switch each, everything else as in paper-qsv.
_QSV_ABLATIONS: Dict[str, Dict[str, Any]] = {
    "routing-abs": dict(routing="abs"),
    "routing-uniform": dict(routing="uniform"),
    "routing-geometric": dict(routing="geometric"),
    "transport-identity": dict(transport="identity"),
    "quat-features": dict(quat_source="features"),
    "quat-both": dict(quat_source="both"),
    "frozen-field": dict(frozen_field=True),
    # The paper's probe freezes β at its warm-start value 5 (−0.4 points).
    "frozen-beta": dict(frozen_beta=True, beta_init=5.0),
    # A warm start at β₀ = 5 that the prior (centre 0.79, on by default) pulls back.
    "beta-warm5": dict(beta_init=5.0),
    # Before the paper-faithful defaults: no β prior, Haar-random field.
    "no-beta-prior": dict(beta_prior=0.0),
    "no-repulsion": dict(repulsion_weight=0.0),
    # The block study: the kernel's candidate substitutes removed.
    "no-root": dict(root_weight=False),
    "no-mlp": dict(mlp_ratio=0.0),
    "kernel-only": dict(root_weight=False, mlp_ratio=0.0),
}
#: QSV models (the only ones with a quaternion field and its repulsion).
_FIELD_MODELS = ("qsv", "lattice")


def _build_presets() -> Dict[str, Dict[str, Any]]:
    presets: Dict[str, Dict[str, Any]] = {}
    for model in _MAIN_MODELS:
        presets[f"paper-{model}"] = dict(_PAPER_SCHEDULE, model=model, dataset="cifar10")
        presets[f"paper-{model}-cifar100"] = dict(_PAPER_SCHEDULE, model=model,
                                                  dataset="cifar100")
        if model in _FIELD_MODELS:
            # The paper's CIFAR-100 runs repel 16 neighbours (8 on CIFAR-10).
            presets[f"paper-{model}-cifar100"]["repulsion_k"] = 16
    for name, switch in _QSV_ABLATIONS.items():
        presets[f"paper-qsv-{name}"] = dict(_PAPER_SCHEDULE, model="qsv", dataset="cifar10",
                                            **switch)
    # The CPU-scale study of docs/results.md: shrunken, parameter-matched models
    # (overrides passed with --model-arg), 5 CPU-minutes each, one thread.
    for model in _MAIN_MODELS:
        presets[f"cpu-{model}"] = dict(CPU_SCALE_SCHEDULE, model=model, dataset="cifar10",
                                       model_args=CPU_SCALE_MODEL_ARGS[model])
    return presets


_CPU_SHELLS = dict(shell_sizes=(100, 64, 36, 16, 9), patch_size=4)
_CPU_WIDTHS = (64, 64, 64, 64, 64)
_CPU_QSV_HEADS = 16
#: Model overrides of the CPU-scale study: five levels of 100-64-36-16-9 nodes
#: (10², 8², 6², 4², 3² so the lattice mirrors them), QSV with the paper's 16
#: heads at width 64 (one 4-channel block per head); the attention controls keep
#: their own 4 heads and are parameter-matched to that QSV model.
CPU_SCALE_MODEL_ARGS: Dict[str, Dict[str, Any]] = {
    "qsv": dict(_CPU_SHELLS, widths=_CPU_WIDTHS, heads=_CPU_QSV_HEADS),
    "lattice": dict(lattice_sides=(10, 8, 6, 4, 3), patch_size=4, widths=_CPU_WIDTHS,
                    heads=_CPU_QSV_HEADS),
    **{control: dict(_CPU_SHELLS, qsv_widths=_CPU_WIDTHS, qsv_heads=_CPU_QSV_HEADS)
       for control in ("attention-gat", "attention-gatv2", "attention-transformer")},
    "resnet20": {},
}

#: Training flags of the CPU-scale equal-budget study (docs/results.md).
CPU_SCALE_SCHEDULE: Dict[str, Any] = dict(
    epochs=30, batch_size=128, lr=2e-3, weight_decay=0.05, warmup_epochs=0.5,
    min_lr_ratio=0.0, label_smoothing=0.1, time_budget=5.0, budget_clock="process",
    anneal_to_budget=True, threads=1)


#: Preset name -> field values (applied on top of the :class:`TrainConfig` defaults).
#: ``paper-<model>`` and ``paper-<model>-cifar100`` for every compared model, and
#: ``paper-qsv-<ablation>`` for the QSV ablations.
PRESETS: Dict[str, Dict[str, Any]] = _build_presets()


#: ``auto-<model>`` -> (preset on a GPU, preset on a CPU).
AUTO_PRESETS: Dict[str, Tuple[str, str]] = {
    f"auto-{model}": (f"paper-{model}", f"cpu-{model}") for model in _MAIN_MODELS}


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
