"""Name → constructor registry used by the training CLI and the benchmarks."""
from __future__ import annotations

from typing import Callable, Dict

import torch

_REGISTRY: Dict[str, Callable[..., torch.nn.Module]] = {}


def register_model(name: str) -> Callable:
    """Decorator: ``@register_model("qsv")`` makes ``build_model("qsv")`` call it."""

    def wrap(fn: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"model name {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return wrap


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def build_model(name: str, num_classes: int = 10, **overrides) -> torch.nn.Module:
    """Build a registered model.

    Args:
        name: one of :func:`available_models` (``qsv``, ``attention-gat``,
            ``attention-gatv2``, ``attention-transformer``, ``lattice``, ``resnet20``).
        num_classes: size of the classifier output.
        **overrides: keyword arguments forwarded to the model's constructor
            (ablation switches, widths, shell sizes, ...).
    """
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(available_models())}")
    return _REGISTRY[name](num_classes=num_classes, **overrides)
