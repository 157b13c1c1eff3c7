"""Small helpers shared across the package, the CLIs and the benchmarks."""
from __future__ import annotations

import importlib
import platform
from types import ModuleType
from typing import Any, Optional

import torch


def import_geoopt() -> Optional[ModuleType]:
    """The geoopt module, or ``None`` when it cannot be imported.

    Callers import it when they need it (not when their module is imported), so a
    test can make the import fail and exercise the plain-parameter path.
    """
    try:
        return importlib.import_module("geoopt")
    except ImportError:
        return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows.

    Recorded with every training run and benchmark: a CPU-time budget buys
    different amounts of training on different processors.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def is_positive_int(value: Any) -> bool:
    """True for an ``int`` (not a ``bool``) greater than zero."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError: an unknown spelling, or CUDA asked for where there is none.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got {spec!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine "
                         "(use --device cpu or auto)")
    return device

