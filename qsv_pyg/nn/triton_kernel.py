r"""Fused Triton kernels of ``qsv_pyg::attend`` and ``qsv_pyg::attend_backward``.

The CUDA implementation of :mod:`qsv_pyg.nn.qsv_kernel`: the same arithmetic
as its PyTorch implementation (the reference) and as the C++ CPU kernel, in
four kernels (:mod:`qsv_pyg.nn._triton_kernels`):

forward
    ``rotate_rows`` writes ``u = Q_j v_j`` (returned: the backward reads it);
    ``forward_rows``, one program per target and tile of heads, walks the
    target's CSR row once with an online softmax (running max and sum) and
    accumulates ``y`` in float32 (each weight times the edge's optional
    ``scale``), then ``z = Q_i^T y``; a second walk over the row touches only
    ``[deg, H]`` logits, to write the normalised (unscaled) weights.
backward
    ``backward_rows`` (pass A, per target): ``gy = Q_i gz``, the softmax
    backward, d beta (per target, summed after), d kd, d qd, and the logit
    gradient per edge ``[E, H]``; ``backward_cols`` (pass B, per source over
    the transposed CSR ``rowptr_t / perm_t / row_t``): d v, d qs, d ks, with
    ``gy`` recomputed from ``gz``. No float atomics: deterministic.

Without a scale (an empty tensor) the kernels are compiled without it
(``HAS_SCALE``, a constexpr): no load, no multiply. Likewise the additive
logit term (``bias``, ``HAS_BIAS``; its gradient ``dL/dlogit`` is written
only when asked for, ``NEED_BIAS``).

Nothing of size ``[E, H, C]`` is stored; per edge only the ``[E, H]`` weights
and key products the operator returns anyway, and two ``[E, H]`` float32
buffers in the backward (the parked softmax gradient and the key-product
gradient: separate, so that no walk reads an entry another thread rewrites). float16, bfloat16 and float32 inputs accumulate in
float32 (float64 in float64); int32 and int64 indices.

Used for CUDA tensors when Triton imports (``QSV_PYG_TRITON=0`` turns it off).
``QSV_PYG_TRITON=interpret`` (read at every call) also sends CPU tensors here,
through Triton's interpreter (slow: for the tests).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

_LOCK = threading.Lock()
_KERNELS: dict = {}
_IMPORTABLE: dict = {}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Calls that ran on the Triton kernels (the tests check that they were used).
CALLS = {"forward": 0, "backward": 0}
BLOCK_E = 16  # edges per step of a row walk (at most)


def mode() -> str:
    """``QSV_PYG_TRITON``: ``1`` (default: CUDA tensors), ``0`` (never) or
    ``interpret`` (CUDA and CPU tensors, through the interpreter)."""
    return os.environ.get("QSV_PYG_TRITON", "1")


def importable() -> bool:
    """Whether :mod:`triton` imports (checked once)."""
    if "ok" not in _IMPORTABLE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _IMPORTABLE["ok"] = True
        except Exception:  # not installed, or no usable backend
            _IMPORTABLE["ok"] = False
    return _IMPORTABLE["ok"]


def available(t: Tensor) -> bool:
    """Whether the Triton kernels take the operator for inputs like ``t``:
    a CUDA tensor (or a CPU one under ``QSV_PYG_TRITON=interpret``) of a
    floating dtype, and Triton importable."""
    m = mode()
    if m == "0" or t.dtype not in DTYPES:
        return False
    if t.device.type == "cuda" or (t.device.type == "cpu" and m == "interpret"):
        return importable()
    return False


def _kernels(interpret: bool) -> ModuleType:
    """The kernel module, compiled or interpreted.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so the
    interpreted kernels are a second copy of the module executed with it set.
    """
    mod = _KERNELS.get(interpret)
    if mod is not None:
        return mod
    with _LOCK:
        if interpret not in _KERNELS:
            if not interpret:
                _KERNELS[False] = importlib.import_module("qsv_pyg.nn._triton_kernels")
            else:
                name = "qsv_pyg.nn._triton_kernels_interpreted"
                path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "_triton_kernels.py")
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                old = os.environ.get("TRITON_INTERPRET")
                os.environ["TRITON_INTERPRET"] = "1"
                try:
                    spec.loader.exec_module(mod)
                finally:
                    if old is None:
                        del os.environ["TRITON_INTERPRET"]
                    else:
                        os.environ["TRITON_INTERPRET"] = old
                sys.modules[name] = mod
                _KERNELS[True] = mod
    return _KERNELS[interpret]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


class _Setup:
    """Kernel module, accumulation type and tile sizes for one call."""

    def __init__(self, v: Tensor, ks: Tensor):
        import triton.language as tl
        self.k = _kernels(v.device.type != "cuda" or mode() == "interpret")
        self.acc = tl.float64 if v.dtype == torch.float64 else tl.float32
        self.acc_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
        self.H, self.M, self.D = v.size(1), v.size(2), ks.size(-1)
        self.BM, self.BD = _pow2(self.M), _pow2(max(self.D, 1))
        # Heads per program: up to 64 blocks of four channels per edge; edges per
        # step: a [BE, BH, BM] tile of at most 1024 blocks (wide rows, as a
        # batch riding along as channels, take fewer edges per step).
        self.BH = max(1, min(_pow2(self.H), 64 // self.BM))
        self.BE = max(1, min(BLOCK_E, 1024 // (self.BH * self.BM)))
        self.head_tiles = -(-self.H // self.BH)


def _nonempty(t: Tensor, like: Tensor) -> Tensor:
    """A stand-in pointer for an unused (empty) argument."""
    return t if t.numel() else like


def _check_graph(rowptr: Tensor, col: Tensor, num_src: int) -> None:
    """The kernels index unchecked (a graph built under torch.compile skips the
    Python range check): refuse a malformed CSR, asynchronously on CUDA."""
    E = col.numel()
    if rowptr.numel() == 0:
        raise RuntimeError("qsv_pyg triton: rowptr must have N_dst + 1 entries")
    ok = (rowptr[0] == 0) & (rowptr[-1] == E) & (rowptr.diff() >= 0).all()
    if E:
        ok = ok & (col.min() >= 0) & (col.max() < num_src)
    torch._assert_async(ok, "qsv_pyg triton: malformed CSR graph (rowptr must run "
                        "non-decreasing from 0 to E, col within [0, N_src))")


def _check_scale(scale: Tensor, E: int, H: int, name: str = "scale") -> bool:
    """Whether there is a ``scale`` (or ``bias``; empty: none); else it must
    be ``[E, H]``."""
    if scale.numel() == 0:
        return False
    if scale.shape != (E, H):
        raise RuntimeError(f"qsv_pyg triton: {name} {tuple(scale.shape)} must be empty or "
                           f"[E, H] = [{E}, {H}]")
    return True


def forward(v: Tensor, qs: Tensor, qd: Tensor, ks: Tensor, kd: Tensor, beta: Tensor,
            scale: Tensor, bias: Tensor, rowptr: Tensor, col: Tensor, use_abs: bool,
            rotate: bool):
    """``(z, alpha, u, y, dot)`` as ``qsv_pyg::attend``."""
    v, qs, qd, ks, kd, beta, scale, bias, rowptr, col = (
        t.contiguous() for t in (v, qs, qd, ks, kd, beta, scale, bias, rowptr, col))
    s = _Setup(v, ks)
    Ns, Nd, E = v.size(0), rowptr.numel() - 1, col.numel()
    _check_graph(rowptr, col, Ns)
    scaled = _check_scale(scale, E, s.H)
    biased = _check_scale(bias, E, s.H, "bias")
    u = torch.empty_like(v) if rotate else v.new_empty(0)
    y = v.new_empty(Nd, s.H, s.M, 4) if rotate else v.new_empty(0)
    z = v.new_empty(Nd, s.H, s.M, 4)
    alpha, dot = v.new_empty(E, s.H), v.new_empty(E, s.H)
    CALLS["forward"] += 1
    if rotate and Ns:
        rows, BR = Ns * s.H, max(1, 256 // s.BM)
        s.k.rotate_rows[(-(-rows // BR), )](v, qs, u, rows, s.M, TRANSPOSE=False, ACC=s.acc,
                                            BR=BR, BM=s.BM)
    if Nd:
        s.k.forward_rows[(Nd, s.head_tiles)](
            u if rotate else v, _nonempty(qd, v), _nonempty(ks, v), _nonempty(kd, v), beta,
            _nonempty(scale, v), _nonempty(bias, v), rowptr, col, _nonempty(y, z), z,
            _nonempty(alpha, z), _nonempty(dot, z), s.H, s.M, s.D, USE_ABS=use_abs,
            ROTATE=rotate, HAS_KEYS=s.D > 0, HAS_SCALE=scaled, HAS_BIAS=biased, ACC=s.acc,
            BE=s.BE, BH=s.BH, BM=s.BM, BD=s.BD)
    return z, alpha, u, y, dot


def backward(gz: Tensor, galpha: Optional[Tensor], v: Tensor, qs: Tensor, qd: Tensor,
             ks: Tensor, kd: Tensor, beta: Tensor, scale: Tensor, rowptr: Tensor,
             col: Tensor, rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor, alpha: Tensor,
             u: Tensor, y: Tensor, use_abs: bool, rotate: bool, need_v: bool, need_q: bool,
             need_k: bool, need_bias: bool = False):
    """``(gv, gqs, gqd, gks, gkd, gbeta, gbias)`` as ``qsv_pyg::attend_backward``
    (``need_q`` / ``need_k`` already cleared without rotation / keys)."""
    gz, v, qs, qd, ks, kd, beta, scale, alpha, u, y = (t.contiguous() for t in (
        gz, v, qs, qd, ks, kd, beta, scale, alpha, u, y))
    galpha = None if galpha is None else galpha.contiguous()
    s = _Setup(v, ks)
    Ns, Nd, E = v.size(0), rowptr.numel() - 1, col.numel()
    scaled = _check_scale(scale, E, s.H)
    opts = dict(dtype=v.dtype, device=v.device)

    def maybe(need: bool, *shape) -> Tensor:  # distinct empty tensors: no aliasing
        return torch.empty(shape if need else (0, ), **opts)

    gv = maybe(need_v, *v.shape)
    gqs, gqd = maybe(need_q, Ns, s.H, 4), maybe(need_q, Nd, s.H, 4)
    gks, gkd = maybe(need_k, Ns, s.H, s.D), maybe(need_k, Nd, s.H, s.D)
    ga_buf = torch.empty(E, s.H, dtype=s.acc_dtype, device=v.device)
    gd = torch.empty(E, s.H, dtype=s.acc_dtype, device=v.device)
    gbias = maybe(need_bias, E, s.H)
    gbeta_part = torch.zeros(Nd, s.H, dtype=s.acc_dtype, device=v.device)
    CALLS["backward"] += 1
    if Nd:
        s.k.backward_rows[(Nd, s.head_tiles)](
            gz, v if galpha is None else galpha, u if rotate else v, _nonempty(qd, v),
            _nonempty(ks, v), _nonempty(kd, v), beta, _nonempty(scale, v), rowptr, col,
            _nonempty(alpha, v), _nonempty(y, v), _nonempty(ga_buf, gbeta_part),
            _nonempty(gd, gbeta_part), _nonempty(gbias, v), gbeta_part, _nonempty(gqd, v),
            _nonempty(gkd, v), s.H, s.M, s.D, USE_ABS=use_abs, ROTATE=rotate,
            HAS_KEYS=s.D > 0, HAS_GALPHA=galpha is not None, HAS_SCALE=scaled,
            NEED_Q=need_q, NEED_K=need_k, NEED_BIAS=need_bias, ACC=s.acc, BE=s.BE, BH=s.BH,
            BM=s.BM, BD=s.BD)
    need_u = need_v or need_q
    if Ns and (need_u or need_k):
        s.k.backward_cols[(Ns, s.head_tiles)](
            gz if Nd else v, v, _nonempty(qs, v), _nonempty(qd, v), _nonempty(kd, v),
            _nonempty(alpha, v), _nonempty(scale, v), _nonempty(gd, gbeta_part),
            rowptr_t.contiguous(), perm_t.contiguous(), row_t.contiguous(), _nonempty(gv, v),
            _nonempty(gqs, v), _nonempty(gks, v), s.H, s.M, s.D, ROTATE=rotate,
            HAS_SCALE=scaled, NEED_U=need_u, NEED_V=need_v, NEED_Q=need_q, NEED_K=need_k,
            ACC=s.acc, BE=s.BE, BH=s.BH, BM=s.BM, BD=s.BD)
    gbeta = gbeta_part.sum(0).to(beta.dtype)
    if need_bias and not Nd:
        gbias.zero_()
    return gv, gqs, gqd, gks, gkd, gbeta, gbias
