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

Launch configurations and their tuning: :mod:`qsv_pyg.nn.triton_tuning`.

Used for CUDA tensors when Triton imports (``QSV_PYG_TRITON=0`` turns it off).
``QSV_PYG_TRITON=interpret`` (read at every call) also sends CPU tensors here,
through Triton's interpreter (slow: for the tests).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import threading
import warnings
import weakref
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from .triton_tuning import (  # noqa: F401 (Config, AUTOTUNE_ENV, tuned, ...: read from here too)
    AUTOTUNE_ENV,
    MAX_WARPS,
    SHARED_ROWS_DEGREE,
    TARGETS_CHOICES,
    Config,
    _pow2,
    candidates,
    degree_bucket,
    launch_tuned,
    num_warps_for,
    tuned,
    tuning_enabled,
    tuning_key,
)

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


def _installed() -> bool:
    """Whether a :mod:`triton` package is there to import (without importing it;
    ``sys.modules["triton"] = None`` hides it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def importable() -> bool:
    """Whether :mod:`triton` imports (checked once).

    Not installed: :obj:`False`, silently (the operator uses its other
    implementations). Installed but failing to import (a broken install, a
    version mismatch, no usable backend): :obj:`False` and one
    :class:`RuntimeWarning` naming the error, so a CUDA run does not fall back
    to the slower PyTorch implementation unnoticed."""
    if "ok" not in _IMPORTABLE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _IMPORTABLE["ok"] = True
        except Exception as exc:  # not installed, or no usable backend
            _IMPORTABLE["ok"] = False
            if _installed():
                warnings.warn(f"qsv_pyg: Triton is installed but does not import "
                              f"({type(exc).__name__}: {exc}); the QSV operator uses its "
                              f"PyTorch implementation on CUDA instead of the fused "
                              f"kernels", RuntimeWarning, stacklevel=2)
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


#: The kernel modules (in this order: the layer's reads the operator's helpers).
KERNEL_MODULES = ("_triton_kernels", "_triton_layer_kernels")


class _Kernels:
    """The kernels of :data:`KERNEL_MODULES` in one mode, by name."""

    def __init__(self, *modules: ModuleType):
        self.modules = modules

    def __getattr__(self, name: str):
        for module in self.__dict__.get("modules", ()):
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(name)


def _interpreted(stem: str, base: Optional[ModuleType]) -> ModuleType:
    """A second copy of ``qsv_pyg.nn.<stem>`` executed with ``TRITON_INTERPRET=1``
    (given the interpreted operator module as ``_BASE``)."""
    name = f"qsv_pyg.nn.{stem}_interpreted"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{stem}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if base is not None:
        mod._BASE = base
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
    return mod


def _kernels(interpret: bool) -> _Kernels:
    """The kernels, compiled or interpreted.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so the
    interpreted kernels are a second copy of the modules executed with it set.
    """
    mod = _KERNELS.get(interpret)
    if mod is not None:
        return mod
    with _LOCK:
        if interpret not in _KERNELS:
            modules: list = []
            for stem in KERNEL_MODULES:
                if not interpret:
                    modules.append(importlib.import_module(f"qsv_pyg.nn.{stem}"))
                else:
                    modules.append(_interpreted(stem, modules[0] if modules else None))
            _KERNELS[interpret] = _Kernels(*modules)
    return _KERNELS[interpret]


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
        self.warps = num_warps_for(self.BE * self.BH * self.BM)


def _on_device(launch):
    """Run ``launch(t, ...)`` with ``t``'s CUDA device current: Triton launches
    on the current device, so a tensor on ``cuda:1`` without
    :func:`torch.cuda.set_device` would otherwise be read from ``cuda:0``."""
    @functools.wraps(launch)
    def guarded(t: Tensor, *args, **kwargs):
        if t.device.type != "cuda":
            return launch(t, *args, **kwargs)
        with torch.cuda.device(t.device):
            return launch(t, *args, **kwargs)
    return guarded


def _nonempty(t: Tensor, like: Tensor) -> Tensor:
    """A stand-in pointer for an unused (empty) argument."""
    return t if t.numel() else like


#: Graphs whose CSR passed :func:`_check_graph`: ``id(col) -> (weakref(rowptr),
#: weakref(col), rowptr version, col version, num_src)``; an entry goes with its
#: tensors (a weakref callback), so a freed address is never mistaken for a
#: checked graph.
_CHECKED: dict = {}


def _checked_key(rowptr: Tensor, col: Tensor, num_src: int) -> Optional[tuple]:
    """What identifies a checked graph, or None when it cannot be tracked
    (inference tensors have no version counter)."""
    if rowptr.is_inference() or col.is_inference():
        return None
    return (rowptr._version, col._version, num_src)


def _check_graph(rowptr: Tensor, col: Tensor, num_src: int) -> None:
    """The kernels index unchecked (a graph built under torch.compile skips the
    Python range check): refuse a malformed CSR, asynchronously on CUDA.

    Once per graph: the ``rowptr`` / ``col`` tensors of a checked call are
    remembered by identity and version counter, so the next forward over the
    same graph (the CSR cache and static CSR buffers hand out the same tensors)
    launches nothing here; an in-place write to either tensor checks it again.
    The check itself is about 14 small kernels (and no host sync)."""
    E = col.numel()
    if rowptr.numel() == 0:
        raise RuntimeError("qsv_pyg triton: rowptr must have N_dst + 1 entries")
    key = _checked_key(rowptr, col, num_src)
    seen = _CHECKED.get(id(col))
    if key is not None and seen is not None and seen[0]() is rowptr and seen[1]() is col \
            and seen[2:] == key:
        return
    ok = (rowptr[0] == 0) & (rowptr[-1] == E) & (rowptr.diff() >= 0).all()
    if E:
        ok = ok & (col.min() >= 0) & (col.max() < num_src)
    torch._assert_async(ok, "qsv_pyg triton: malformed CSR graph (rowptr must run "
                        "non-decreasing from 0 to E, col within [0, N_src))")
    if key is not None:
        ident = id(col)

        def forget(_ref, ident=ident):
            _CHECKED.pop(ident, None)

        _CHECKED[ident] = (weakref.ref(rowptr, forget), weakref.ref(col, forget)) + key


def _check_scale(scale: Tensor, E: int, H: int, name: str = "scale") -> bool:
    """Whether there is a ``scale`` (or ``bias``; empty: none); else it must
    be ``[E, H]``."""
    if scale.numel() == 0:
        return False
    if scale.shape != (E, H):
        raise RuntimeError(f"qsv_pyg triton: {name} {tuple(scale.shape)} must be empty or "
                           f"[E, H] = [{E}, {H}]")
    return True


@_on_device
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
    # The weights and key products in float32 (float64) whatever the features'
    # storage: the backward's softmax gradient reads them.
    alpha = torch.empty(E, s.H, dtype=s.acc_dtype, device=v.device)
    dot = torch.empty(E, s.H, dtype=s.acc_dtype, device=v.device)
    CALLS["forward"] += 1
    if rotate and Ns:
        rows, BR = Ns * s.H, max(1, 256 // s.BM)
        s.k.rotate_rows[(-(-rows // BR), )](v, qs, u, rows, s.M, TRANSPOSE=False, ACC=s.acc,
                                            BR=BR, BM=s.BM,
                                            num_warps=num_warps_for(BR * s.BM))
    if Nd:
        flags = dict(USE_ABS=use_abs, ROTATE=rotate, HAS_KEYS=s.D > 0, HAS_SCALE=scaled,
                     HAS_BIAS=biased)

        def launch(c: Config):
            s.k.forward_rows[(-(-Nd // c.TARGETS), s.head_tiles)](
                u if rotate else v, _nonempty(qd, v), _nonempty(ks, v), _nonempty(kd, v),
                beta, _nonempty(scale, v), _nonempty(bias, v), rowptr, col, _nonempty(y, z),
                z, _nonempty(alpha, z), _nonempty(dot, z), s.H, s.M, s.D, Nd, **flags,
                ACC=s.acc, BE=c.BE, BH=s.BH, BM=s.BM, BD=s.BD, TARGETS=c.TARGETS,
                num_warps=c.warps)
        degree = degree_bucket(E, Nd)
        launch_tuned(tuning_key("forward_rows", v.device, v.dtype, s, degree, flags),
                     candidates(s, degree), launch, v.device)
    return z, alpha, u, y, dot


def _rows_strides(gz: Tensor):
    """``(gz, node stride, head stride)``: the kernels read ``gz`` ``[N, H, M, 4]``
    with any node and head strides as long as each row's blocks of four are
    contiguous (the layer's gradient arrives transposed, heads outermost: read
    as it is, no copy); otherwise a contiguous copy."""
    if gz.dim() != 4 or (gz.size(2) > 1 and gz.stride(2) != 4) or gz.stride(3) != 1:
        gz = gz.contiguous()
    return gz, gz.stride(0), gz.stride(1)


#: ``shared`` bits of :func:`backward` (one tensor passed as several inputs).
SHARED_Q, SHARED_K, KEYS_ARE_Q = 1, 2, 4


@_on_device
def backward(gz: Tensor, galpha: Optional[Tensor], v: Tensor, qs: Tensor, qd: Tensor,
             ks: Tensor, kd: Tensor, beta: Tensor, scale: Tensor, rowptr: Tensor,
             col: Tensor, rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor, alpha: Tensor,
             u: Tensor, y: Tensor, use_abs: bool, rotate: bool, need_v: bool, need_q: bool,
             need_k: bool, need_bias: bool = False, shared: int = 0):
    """``(gv, gqs, gqd, gks, gkd, gbeta, gbias)`` as ``qsv_pyg::attend_backward``
    (``need_q`` / ``need_k`` already cleared without rotation / keys).

    ``shared`` (bits :data:`SHARED_Q`: ``qs`` is ``qd``; :data:`SHARED_K`:
    ``ks`` is ``kd``; :data:`KEYS_ARE_Q`: with both, the keys are the
    quaternions) sums the gradients of one tensor in the kernel: ``gqs`` then
    holds d qs + d qd (+ d ks + d kd), ``gks`` d ks + d kd; the other slots keep
    their own parts. Each input's gradient is in that input's dtype (half
    features: a half ``gv``; the quaternions', keys' and β's stay float32)."""
    v, qs, qd, ks, kd, beta, scale, alpha, u, y = (t.contiguous() for t in (
        v, qs, qd, ks, kd, beta, scale, alpha, u, y))
    gz, gz_sn, gz_sh = _rows_strides(gz)
    galpha = None if galpha is None else galpha.contiguous()
    s = _Setup(v, ks)
    Ns, Nd, E = v.size(0), rowptr.numel() - 1, col.numel()
    scaled = _check_scale(scale, E, s.H)

    def maybe(need: bool, like: Tensor, *shape) -> Tensor:  # distinct: no aliasing
        return torch.empty(shape if need else (0, ), dtype=like.dtype, device=v.device)

    gv = maybe(need_v, v, *v.shape)
    gqs, gqd = maybe(need_q, qs, Ns, s.H, 4), maybe(need_q, qd, Nd, s.H, 4)
    gks, gkd = maybe(need_k, ks, Ns, s.H, s.D), maybe(need_k, kd, Nd, s.H, s.D)
    ga_buf = torch.empty(E, s.H, dtype=s.acc_dtype, device=v.device)
    gd = torch.empty(E, s.H, dtype=s.acc_dtype, device=v.device)
    gbias = maybe(need_bias, alpha, E, s.H)  # float32 (float64), as alpha
    # every (target, head) entry is written by pass A: no zero fill
    gbeta_part = torch.empty(Nd, s.H, dtype=s.acc_dtype, device=v.device)
    sum_q = bool(shared & SHARED_Q) and need_q and Ns == Nd
    sum_k = bool(shared & SHARED_K) and need_k and Ns == Nd
    keys_q = bool(shared & KEYS_ARE_Q) and sum_q and sum_k and s.D == 4
    CALLS["backward"] += 1
    if Nd:
        flags_a = dict(USE_ABS=use_abs, ROTATE=rotate, HAS_KEYS=s.D > 0,
                       HAS_GALPHA=galpha is not None, HAS_SCALE=scaled, NEED_Q=need_q,
                       NEED_K=need_k, NEED_BIAS=need_bias)

        def launch_a(c: Config):
            s.k.backward_rows[(-(-Nd // c.TARGETS), s.head_tiles)](
                gz, v if galpha is None else galpha, u if rotate else v, _nonempty(qd, v),
                _nonempty(ks, v), _nonempty(kd, v), beta, _nonempty(scale, v), rowptr, col,
                _nonempty(alpha, v), _nonempty(y, v), _nonempty(ga_buf, gbeta_part),
                _nonempty(gd, gbeta_part), _nonempty(gbias, v), gbeta_part,
                _nonempty(gqd, v), _nonempty(gkd, v), s.H, s.M, s.D, gz_sn, gz_sh, Nd,
                **flags_a, ACC=s.acc, BE=c.BE, BH=s.BH, BM=s.BM, BD=s.BD, TARGETS=c.TARGETS,
                num_warps=c.warps)
        degree = degree_bucket(E, Nd)
        launch_tuned(tuning_key("backward_rows", v.device, v.dtype, s, degree, flags_a),
                     candidates(s, degree), launch_a, v.device)
    need_u = need_v or need_q
    if Ns and (need_u or need_k):
        flags_b = dict(ROTATE=rotate, HAS_SCALE=scaled, NEED_U=need_u, NEED_V=need_v,
                       NEED_Q=need_q, NEED_K=need_k, SUM_QD=sum_q, SUM_KD=sum_k,
                       KEYS_INTO_Q=keys_q)
        rowptr_t, perm_t, row_t = (t.contiguous() for t in (rowptr_t, perm_t, row_t))

        def launch_b(c: Config):
            s.k.backward_cols[(-(-Ns // c.TARGETS), s.head_tiles)](
                gz if Nd else v, v, _nonempty(qs, v), _nonempty(qd, v), _nonempty(kd, v),
                _nonempty(alpha, v), _nonempty(scale, v), _nonempty(gd, gbeta_part),
                rowptr_t, perm_t, row_t, _nonempty(gv, v), _nonempty(gqs, v),
                _nonempty(gks, v), _nonempty(gqd, v), _nonempty(gkd, v), s.H, s.M, s.D,
                gz_sn if Nd else 0, gz_sh if Nd else 0, Ns, **flags_b, ACC=s.acc, BE=c.BE,
                BH=s.BH, BM=s.BM, BD=s.BD, TARGETS=c.TARGETS, num_warps=c.warps)
        degree = degree_bucket(E, Ns)
        launch_tuned(tuning_key("backward_cols", v.device, v.dtype, s, degree, flags_b),
                     candidates(s, degree), launch_b, v.device)
    gbeta = gbeta_part.sum(0).to(beta.dtype)
    if need_bias and not Nd:
        gbias.zero_()
    return gv, gqs, gqd, gks, gkd, gbeta, gbias


# ------------------------------------------------------- unit quaternions
UNIT_ROWS = 256  # quaternions per program


def unit_available(q: Tensor) -> bool:
    """Whether :func:`unit_quaternion` takes ``q``: float32 / float64 on the
    Triton path (:func:`available`), not while torch.compile traces (inductor
    fuses the PyTorch ops itself)."""
    return q.dtype in (torch.float32, torch.float64) and available(q) and \
        not torch.compiler.is_compiling()


@_on_device
def unit_quaternion(q: Tensor, eps: float) -> Tensor:
    """``q / |q|`` with norms ``<= eps`` the identity, in one launch (the
    PyTorch ops are nine, and eight for the gradient)."""
    import triton.language as tl
    qc = q.contiguous()
    out = torch.empty_like(qc)
    rows = qc.numel() // 4
    if rows:
        k = _kernels(q.device.type != "cuda" or mode() == "interpret")
        k.unit_rows[(-(-rows // UNIT_ROWS), )](
            qc, out, rows, EPS=float(eps),
            ACC=tl.float64 if q.dtype == torch.float64 else tl.float32, BR=UNIT_ROWS,
            num_warps=num_warps_for(UNIT_ROWS))
    return out


@_on_device
def unit_quaternion_backward(q: Tensor, grad: Tensor, eps: float) -> Tensor:
    """The gradient of :func:`unit_quaternion` for the incoming ``grad``."""
    import triton.language as tl
    qc, gc = q.contiguous(), grad.contiguous().to(q.dtype)
    out = torch.empty_like(qc)
    rows = qc.numel() // 4
    if rows:
        k = _kernels(q.device.type != "cuda" or mode() == "interpret")
        k.unit_rows_backward[(-(-rows // UNIT_ROWS), )](
            qc, gc, out, rows, EPS=float(eps),
            ACC=tl.float64 if q.dtype == torch.float64 else tl.float32, BR=UNIT_ROWS,
            num_warps=num_warps_for(UNIT_ROWS))
    return out
