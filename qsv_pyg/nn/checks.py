"""The argument checks of :class:`~qsv_pyg.nn.QSVConv` and its helpers.

Every check raises :class:`ValueError` naming the argument and what was wrong,
so that a bad call never surfaces as an opaque torch error deep inside the
aggregation.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def check_option(name: str, value: str, choices: Tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError naming them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of "
                         f"{', '.join(repr(c) for c in choices)}")
    return value


def check_float(t: Optional[Tensor], name: str) -> None:
    """Raise unless ``t`` is None or a floating-point tensor."""
    if t is not None and not t.is_floating_point():
        raise ValueError(f"QSVConv: {name} must be a floating-point tensor, got {t.dtype}")


def check_finite(t: Optional[Tensor], name: str) -> None:
    """Raise on NaN or infinite entries (one reduction and a host sync).

    A finite sum proves every entry finite: a NaN or an infinity anywhere makes
    the sum NaN or infinite. Only a non-finite sum, which large finite entries can
    also overflow to, takes the exact elementwise test (one kernel instead of
    four on the common path)."""
    if t is None:
        return
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(total)):
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"QSVConv received non-finite {name}")
