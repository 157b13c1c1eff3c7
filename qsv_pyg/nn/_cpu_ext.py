"""The optional C++ kernel of QSV attention on CPU, compiled on first use.

``qsv_pyg/csrc/qsv_kernel_cpu.cpp`` computes what the PyTorch implementation of
:mod:`qsv_pyg.nn.qsv_kernel` computes, in two OpenMP passes over the CSR graph
instead of some forty separate kernels (timings: benchmarks/README.md). It is
built with :func:`torch.utils.cpp_extension.load` the first time it is needed
(about 20 s; cached under ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``). Without a C++ compiler and ninja, or with
``QSV_PYG_CPU_KERNEL=0``, the PyTorch implementation is used; results agree to
rounding.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from types import ModuleType
from typing import Optional

_LOCK = threading.Lock()
_STATE: dict = {"tried": False, "module": None, "error": None}
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                      "qsv_kernel_cpu.cpp")
log = logging.getLogger("qsv_pyg")


def enabled() -> bool:
    """False when ``QSV_PYG_CPU_KERNEL=0`` (checked at every call)."""
    return os.environ.get("QSV_PYG_CPU_KERNEL", "1") != "0"


def cpu_kernel() -> Optional[ModuleType]:
    """The compiled module, or None (disabled, or the build failed: warned once)."""
    if not enabled():
        return None
    if _STATE["tried"]:
        return _STATE["module"]
    with _LOCK:
        if not _STATE["tried"]:
            try:
                from torch.utils.cpp_extension import load
                log.info("qsv_pyg: compiling the C++ CPU kernel (once, about 20 s)")
                _STATE["module"] = load(name="qsv_pyg_csr_kernel", sources=[SOURCE],
                                        extra_cflags=["-O3", "-fopenmp"],
                                        extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as exc:  # no compiler or ninja, read-only cache, ...
                _STATE["error"] = exc
                warnings.warn(f"qsv_pyg: the C++ CPU kernel could not be built ({exc!s:.300}); "
                              f"using the PyTorch implementation (slower on small graphs). "
                              f"Set QSV_PYG_CPU_KERNEL=0 to skip the attempt.")
            _STATE["tried"] = True
    return _STATE["module"]
