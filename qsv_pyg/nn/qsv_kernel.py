r"""QSV attention over a CSR graph as one registered operator.

For every target :math:`i` with incoming edges from sources :math:`j` (any
graph: variable degree, bipartite, isolated targets) and every head:

.. math::
    \mathbf{u}_j = Q_j \mathbf{v}_j, \quad
    \alpha_{ij} = \operatorname{softmax}_j\big(\beta\, \langle k_i, k_j \rangle
    + b_{ij}\big),
    \quad \mathbf{y}_i = \textstyle\sum_j \alpha_{ij} s_{ij} \mathbf{u}_j, \quad
    \mathbf{z}_i = Q_i^\top \mathbf{y}_i,

with :math:`Q = \mathrm{diag}(1, R(q))` acting on every block of four channels
(:func:`~qsv_pyg.quaternion.quaternion_to_block_matrix`; skipped when
``rotate=False``) and routing keys :math:`k` (the unit quaternions for learned
routing; ``D = 0`` gives uniform weights; optionally :math:`|\langle\cdot\rangle|`).
The per-edge scale :math:`s_{ij}` is optional (``scale`` ``[E, H]`` in the
graph's target-sorted edge order, or empty for :math:`s = 1`, which costs
nothing): attention dropout passes its mask divided by :math:`1 - p`. It is
a constant to autograd (no gradient), and the returned weights are the
unscaled :math:`\alpha`. The additive logit term :math:`b_{ij}` is optional
too (``bias`` ``[E, H]``, same order, empty for none at no cost): the logit is
:math:`\beta \langle k_i, k_j \rangle + b_{ij}` (edge features, a per-source
score, or an exact distance logit), and its gradient is
:math:`\partial L / \partial \mathrm{logit}_{ij}`.
The backward is written out by hand; nothing of size ``[E, H, C]`` is stored
on CPU. Under ``create_graph=True`` it runs as differentiable PyTorch ops
instead (the forward recomputed by :func:`_forward_torch`, then
:func:`_backward_torch`), so second derivatives are exact on every device.

``qsv_pyg::attend`` and ``qsv_pyg::attend_backward`` are registered with
:func:`torch.library.custom_op` (with fake kernels, autograd and CPU/CUDA
autocast to float32), so :func:`torch.compile` keeps them in one graph.
:func:`backend` is the one place that chooses their implementation: on CUDA the
fused Triton kernels of :mod:`qsv_pyg.nn.triton_kernel` when Triton imports
(``QSV_PYG_TRITON=0`` turns them off); on CPU the C++ kernel of
:mod:`qsv_pyg.nn._cpu_ext` when it can be built; elsewhere (and with
``QSV_PYG_CPU_KERNEL=0``) the PyTorch implementation below (gathers and
``index_add``), which stays the reference. All are checked against autograd of the
literal per-edge formula (``tests/test_qsv_kernel.py``,
``tests/test_triton_kernel.py``, ``opcheck`` included). :func:`qsv_attend` accumulates
in float32 whatever the features' dtype (quaternions are never rounded to bf16); on
the Triton path half-precision features are read and stored as they are (no float32
copy; z in their dtype, also under autocast), the C++ and PyTorch paths compute from
a float32 copy (see the comment in :func:`qsv_attend`).

:func:`routing_logits` is the routing logit in Python, shared by the PyTorch
implementation and :class:`~qsv_pyg.nn.QSVConv`'s message-passing path;
:func:`distance_logits` is distance routing's logit, passed as the additive term.
"""
from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..quaternion import block_matrix_to_quaternion_grad, quaternion_to_block_matrix
from . import triton_kernel
from ._cpu_ext import cpu_kernel
from .csr import GraphCSR

_NO_CONTEXT = contextlib.nullcontext()
Tensors5 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
Tensors7 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]

#: The implementations of the operator, in the order :func:`backend` tries them.
BACKENDS = ("triton", "cpp", "torch")


def _implementation(v: Tensor) -> Tuple[str, Optional[ModuleType]]:
    """:func:`backend` and its module (None for ``"torch"``)."""
    if triton_kernel.available(v):
        return "triton", triton_kernel
    if v.device.type == "cpu" and v.dtype in (torch.float32, torch.float64):
        ext = cpu_kernel()
        if ext is not None:
            return "cpp", ext
    return "torch", None


def backend(v: Tensor) -> str:
    """The implementation that runs the operator for features like ``v``, one of
    :data:`BACKENDS`: ``"triton"`` for CUDA tensors when Triton imports (CPU
    ones too under ``QSV_PYG_TRITON=interpret``; ``QSV_PYG_TRITON=0``: never),
    ``"cpp"`` for float32/float64 CPU tensors when the C++ kernel is built
    (``QSV_PYG_CPU_KERNEL=0``: never), else ``"torch"``. Read at every call."""
    return _implementation(v)[0]


def routing_logits(k_dst: Tensor, k_src: Tensor, beta: Tensor,
                   use_abs: bool) -> Tuple[Tensor, Tensor]:
    r"""The routing logits :math:`\beta_h \langle k_i, k_j \rangle` of a set of
    edges (:math:`\beta_h |\langle k_i, k_j \rangle|` with ``use_abs``), and
    the dot products :math:`\langle k_i, k_j \rangle`.

    With the unit quaternions as keys this is QSV's learned routing,
    :math:`\langle q_i, q_j \rangle = \mathrm{Re}(q_i^* \otimes q_j)`.

    Args:
        k_dst, k_src: every edge's target and source keys ``[E, H, D]``
            (``D = 0``: zero logits, uniform weights).
        beta: the temperatures ``[H]``.
    """
    dot = (k_dst * k_src).sum(-1)
    return (dot.abs() if use_abs else dot) * beta, dot


def distance_logits(p_dst: Tensor, p_src: Tensor, beta: Tensor) -> Tensor:
    r"""Distance routing's logits :math:`-\beta_h |p_i - p_j|^2` ``[E, H]`` of
    every edge's target and source positions ``[E, D]``: the difference is taken
    first, so the logit is exact to rounding wherever the cloud sits (expanding
    it into dot products, :math:`2\langle p_i, p_j\rangle - |p_j|^2`, cancels
    catastrophically away from the origin: in float32 the weights were off by
    0.1 for a cloud shifted by 1000). :class:`~qsv_pyg.nn.QSVConv` passes it as
    the operator's additive logit term, on both paths."""
    d2 = (p_dst - p_src).pow(2).sum(-1, keepdim=True)
    return -d2 * beta


def _rotate(t: Tensor, q: Tensor, transpose: bool) -> Tensor:
    """``Q(q) t_m`` (or ``Q^T t_m``) for the blocks of ``t`` ``[N, H, M, 4]``."""
    n, h, m, _ = t.shape
    rot = quaternion_to_block_matrix(q).view(n * h, 4, 4)
    out = torch.bmm(t.reshape(n * h, m, 4), rot if transpose else rot.transpose(1, 2))
    return out.view(t.shape)


def _outer_grad(q: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """dL/dq when dL/dQ(q) = sum_m a_m b_m^T (``a``, ``b`` ``[N, H, M, 4]``)."""
    n, h, m, _ = a.shape
    g = torch.bmm(a.reshape(n * h, m, 4).transpose(1, 2), b.reshape(n * h, m, 4))
    return block_matrix_to_quaternion_grad(q, g.view(n, h, 4, 4))


def _forward_torch(v, qs, qd, ks, kd, beta, scale, bias, rowptr, col, row, use_abs,
                   rotate):
    num_dst, E, H = rowptr.numel() - 1, col.numel(), v.size(1)
    src = _rotate(v, qs, False) if rotate else v
    logits, dot = routing_logits(kd[row], ks[col], beta, use_abs)
    if bias.numel():
        logits = logits + bias
    idx = row.view(-1, 1).expand(-1, H)
    mx = logits.new_full((num_dst, H), float("-inf")).scatter_reduce(
        0, idx, logits, "amax", include_self=True)
    ex = (logits - mx[row]).exp()
    alpha = ex / ex.new_zeros(num_dst, H).index_add(0, row, ex)[row]
    w = alpha * scale if scale.numel() else alpha  # alpha itself is returned unscaled
    y = v.new_zeros(num_dst, *v.shape[1:]).index_add(
        0, row, w.view(E, H, 1, 1) * src[col])
    if not rotate:
        return y, alpha, v.new_empty(0), v.new_empty(0), dot
    return _rotate(y, qd, True), alpha, src, y, dot


def _backward_torch(gz, galpha, v, qs, qd, ks, kd, beta, scale, col, row, alpha, dot, u,
                    y, use_abs, rotate, need_v, need_q, need_k, need_bias):
    E, H = alpha.shape
    scaled = scale.numel() > 0
    gy = _rotate(gz, qd, False) if rotate else gz
    src = u if rotate else v
    ga = (gy[row] * src[col]).sum(dim=(-1, -2))
    if scaled:  # y = sum_j alpha s u_j: d/d alpha = s <gy, u_j>
        ga = ga * scale
    if galpha is not None:
        ga = ga + galpha
    sa = ga.new_zeros(gy.size(0), H).index_add(0, row, alpha * ga)
    gs = alpha * (ga - sa[row])  # dL/dlogit, the additive term's gradient
    gbias = gs if need_bias else v.new_empty(0)
    gbeta = (gs * (dot.abs() if use_abs else dot)).sum(0)
    gd = gs * beta * (dot.sign() if use_abs else 1.0)
    gks, gkd, gv, gqs, gqd = (v.new_empty(0) for _ in range(5))  # distinct: no aliasing
    if need_k:
        gkd = torch.zeros_like(kd).index_add(0, row, gd.unsqueeze(-1) * ks[col])
        gks = torch.zeros_like(ks).index_add(0, col, gd.unsqueeze(-1) * kd[row])
    if need_v or need_q:
        w = alpha * scale if scaled else alpha
        gu = torch.zeros_like(v).index_add(0, col, w.view(E, H, 1, 1) * gy[row])
        if need_v:
            gv = _rotate(gu, qs, True) if rotate else gu
        if need_q:  # u = Q_j v and z = Q_i^T y
            gqs = _outer_grad(qs, gu, v)
            gqd = _outer_grad(qd, y, gz)
    return gv, gqs, gqd, gks, gkd, gbeta, gbias


@torch.library.custom_op("qsv_pyg::attend", mutates_args=())
def attend(v: Tensor, qs: Tensor, qd: Tensor, ks: Tensor, kd: Tensor, beta: Tensor,
           scale: Tensor, bias: Tensor, rowptr: Tensor, col: Tensor, row: Tensor,
           rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor, use_abs: bool,
           rotate: bool) -> Tensors5:
    """Forward: ``(z, alpha, u, y, dot)``; ``u``, ``y`` (empty unless
    ``rotate``) and ``dot`` are kept for the backward. ``scale``: the per-edge
    scale ``[E, H]`` of the aggregation, or empty for none; ``alpha`` is the
    unscaled softmax either way. ``bias``: the additive logit term ``[E, H]``,
    or empty for none (``dot`` is the key product alone either way)."""
    _check_edge_input(scale, "scale", col.size(0), v.size(1))
    _check_edge_input(bias, "bias", col.size(0), v.size(1))
    name, impl = _implementation(v)
    if name == "triton":  # half features read as they are (float32 accumulation)
        return impl.forward(v, qs, qd, ks, kd, beta, scale, bias, rowptr, col, use_abs,
                            rotate)
    # The C++ kernel and the PyTorch implementation compute in float32 (float64):
    # half features are widened here and the results stored as the Triton
    # kernels store them (z, u, y in the features' dtype; alpha, dot widened).
    acc = torch.promote_types(v.dtype, torch.float32)
    vw = v.to(acc)
    if impl is None:
        z, alpha, u, y, dot = _forward_torch(vw, qs, qd, ks, kd, beta, scale, bias, rowptr,
                                             col, row, use_abs, rotate)
    else:
        z, alpha, u, y, dot = impl.forward(vw, qs, qd, ks, kd, beta, scale, bias, rowptr,
                                           col, use_abs, rotate)
    return (z.to(v.dtype), alpha.to(acc), u.to(v.dtype), y.to(v.dtype), dot.to(acc))


def _check_edge_input(t: Tensor, name: str, E, H) -> None:
    """The operator's ``scale`` / ``bias`` is empty (none) or ``[E, H]``
    (torch._check: also a runtime assert under torch.compile with dynamic shapes)."""
    if t.numel() == 0:
        return

    def message() -> str:
        return f"qsv_pyg::attend: {name} {tuple(t.shape)} must be empty or [E, H] = " \
               f"[{E}, {H}]"

    torch._check(t.dim() == 2, message)
    torch._check(t.size(0) == E, message)
    torch._check(t.size(1) == H, message)


@attend.register_fake
def _(v, qs, qd, ks, kd, beta, scale, bias, rowptr, col, row, rowptr_t, perm_t, row_t,
      use_abs, rotate):
    num_dst, E = rowptr.size(0) - 1, col.size(0)
    _check_edge_input(scale, "scale", E, v.size(1))
    _check_edge_input(bias, "bias", E, v.size(1))
    z = v.new_empty(num_dst, *v.shape[1:])
    kept = (v.new_empty(v.shape), v.new_empty(z.shape)) if rotate else \
        (v.new_empty(0), v.new_empty(0))
    acc = torch.promote_types(v.dtype, torch.float32)
    return (z, v.new_empty(E, v.size(1), dtype=acc), kept[0], kept[1],
            v.new_empty(E, v.size(1), dtype=acc))


@torch.library.custom_op("qsv_pyg::attend_backward", mutates_args=())
def attend_backward(gz: Tensor, galpha: Optional[Tensor], v: Tensor, qs: Tensor,
                    qd: Tensor, ks: Tensor, kd: Tensor, beta: Tensor, scale: Tensor,
                    rowptr: Tensor, col: Tensor, row: Tensor, rowptr_t: Tensor,
                    perm_t: Tensor, row_t: Tensor, alpha: Tensor, dot: Tensor, u: Tensor,
                    y: Tensor, use_abs: bool, rotate: bool, need_v: bool, need_q: bool,
                    need_k: bool, need_bias: bool, shared: int = 0) -> Tensors7:
    """Gradients ``(v, qs, qd, ks, kd, beta, bias)``; empty where not needed.
    The additive term itself is not an input: its gradient is ``dL/dlogit``,
    which needs only the saved weights.

    ``shared`` says which inputs are one tensor (bits of
    :data:`~qsv_pyg.nn.triton_kernel.SHARED_Q`: ``qs`` is ``qd``, ``SHARED_K``:
    ``ks`` is ``kd``, ``KEYS_ARE_Q``: with both, the keys are the quaternions):
    that tensor's whole gradient is then returned in its first slot (``gqs``;
    ``gks`` for shared keys), summed in the kernel rather than by autograd; the
    other slots hold their own parts (ignored). ``gz`` may be strided over
    nodes and heads (read as it is on the Triton path)."""
    need_q, need_k = need_q and rotate, need_k and ks.size(-1) > 0
    name, impl = _implementation(v)
    if name == "triton":
        return triton_kernel.backward(gz, galpha, v, qs, qd, ks, kd, beta, scale, rowptr,
                                      col, rowptr_t, perm_t, row_t, alpha, u, y, use_abs,
                                      rotate, need_v, need_q, need_k, need_bias, shared)
    # float32 (float64) here: half features (and their saved u, y) are widened
    acc = torch.promote_types(v.dtype, torch.float32)
    gz, vw, u, y = gz.contiguous().to(acc), v.to(acc), u.to(acc), y.to(acc)
    if impl is not None:  # the C++ kernel also takes the saved dot products
        gv, gqs, gqd, gks, gkd, gbeta, gbias = impl.backward(
            gz, galpha, vw, qs, qd, ks, kd, beta, scale, rowptr, col, rowptr_t, perm_t, row_t,
            alpha, dot, u, y, use_abs, rotate, need_v, need_q, need_k, need_bias)
    else:
        gv, gqs, gqd, gks, gkd, gbeta, gbias = _backward_torch(
            gz, galpha, vw, qs, qd, ks, kd, beta, scale, col, row, alpha, dot, u, y,
            use_abs, rotate, need_v, need_q, need_k, need_bias)
    if shared & triton_kernel.SHARED_K and need_k and gks.shape == gkd.shape:
        gks = gks + gkd
    if shared & triton_kernel.SHARED_Q and need_q and gqs.shape == gqd.shape:
        gqs = gqs + gqd
        if shared & triton_kernel.KEYS_ARE_Q and shared & triton_kernel.SHARED_K and \
                need_k and gks.shape == gqs.shape:
            gqs = gqs + gks
    return gv.to(v.dtype), gqs, gqd, gks, gkd, gbeta, gbias


@attend_backward.register_fake
def _(gz, galpha, v, qs, qd, ks, kd, beta, scale, rowptr, col, row, rowptr_t, perm_t,
      row_t, alpha, dot, u, y, use_abs, rotate, need_v, need_q, need_k, need_bias,
      shared=0):
    need_q, need_k = need_q and rotate, need_k and ks.size(-1) > 0

    def like(t: Tensor, need: bool) -> Tensor:
        return t.new_empty(t.shape) if need else t.new_empty(0)

    return (like(v, need_v), like(qs, need_q), like(qd, need_q), like(ks, need_k),
            like(kd, need_k), beta.new_empty(beta.shape), like(alpha, need_bias))


def _setup_context(ctx, inputs, output):
    (v, qs, qd, ks, kd, beta, scale, bias, rowptr, col, row, rowptr_t, perm_t, row_t,
     use_abs, rotate) = inputs
    z, alpha, u, y, dot = output
    ctx.mark_non_differentiable(u, y, dot)
    # No zero-filled gradients for u, y and dot (never differentiated) or for an
    # unused z or alpha: each would be a full [N, H, M, 4] fill per step (on Cora's
    # literal drop-in two 15 MB fills, about a fifth of a training step).
    ctx.set_materialize_grads(False)
    ctx.flags = (use_abs, rotate)
    ctx.shared = _shared(qs, qd, ks, kd, rotate)
    ctx.save_for_backward(v, qs, qd, ks, kd, beta, scale, bias, rowptr, col, row, rowptr_t,
                          perm_t, row_t, alpha, dot, u, y)


def _shared(qs: Tensor, qd: Tensor, ks: Tensor, kd: Tensor, rotate: bool) -> int:
    """Which inputs are one tensor (the same object: the layer passes its unit
    quaternions as both sides' transport and keys on a homogeneous graph), as
    ``attend_backward``'s ``shared`` bits. By identity only: two tensors that
    merely share storage may be different leaves, with gradients of their own."""
    shared = 0
    if rotate and qs is qd:
        shared |= triton_kernel.SHARED_Q
    if ks.size(-1) > 0 and ks is kd:
        shared |= triton_kernel.SHARED_K
    if shared == triton_kernel.SHARED_Q | triton_kernel.SHARED_K and ks is qs:
        shared |= triton_kernel.KEYS_ARE_Q
    return shared


def _backward(ctx, gz, galpha, _gu, _gy, _gdot):
    (v, qs, qd, ks, kd, beta, scale, bias, rowptr, col, row, rowptr_t, perm_t, row_t, alpha,
     dot, u, y) = ctx.saved_tensors
    use_abs, rotate = ctx.flags
    nv, nqs, nqd, nks, nkd, nbeta = ctx.needs_input_grad[:6]
    nbias = ctx.needs_input_grad[7] and bias.numel() > 0
    if gz is None:
        gz = v.new_zeros(rowptr.numel() - 1, *v.shape[1:])
    if torch.is_grad_enabled():
        # create_graph=True (a gradient penalty, a Hessian-vector product):
        # the gradients must themselves be differentiable. The saved u, y and
        # dot are constants to autograd (non-differentiable outputs), so the
        # forward is recomputed with PyTorch ops and the backward formula,
        # written with PyTorch ops too, is applied to it: exact second
        # derivatives (autograd of both), at the PyTorch path's speed. The scale
        # is a constant (it gets no gradient, so none of second order either).
        scale = scale.detach()
        _, alpha, u, y, dot = _forward_torch(v, qs, qd, ks, kd, beta, scale, bias, rowptr,
                                             col, row, use_abs, rotate)
        gv, gqs, gqd, gks, gkd, gbeta, gbias = _backward_torch(
            gz, galpha, v, qs, qd, ks, kd, beta, scale, col, row, alpha, dot, u, y, use_abs,
            rotate, nv, (nqs or nqd) and rotate, (nks or nkd) and ks.size(-1) > 0, nbias)
    else:
        # gz as it comes (the layer's is transposed: the Triton kernels read it
        # strided; the other implementations copy it)
        shared = ctx.shared
        gv, gqs, gqd, gks, gkd, gbeta, gbias = attend_backward(
            gz, None if galpha is None else galpha.contiguous(), v, qs, qd,
            ks, kd, beta, scale, rowptr, col, row, rowptr_t, perm_t, row_t, alpha, dot, u,
            y, use_abs, rotate, nv, nqs or nqd, nks or nkd, nbias, shared)
        # one tensor's whole gradient sits in its first slot
        if shared & triton_kernel.SHARED_Q:
            nqd = False
        if shared & triton_kernel.SHARED_K:
            nkd = False
        if shared & triton_kernel.KEYS_ARE_Q:
            nks = False
    return (gv if nv else None, gqs if nqs and gqs.numel() else None,
            gqd if nqd and gqd.numel() else None, gks if nks and gks.numel() else None,
            gkd if nkd and gkd.numel() else None, gbeta if nbeta else None,
            None,  # scale: a constant (a dropout mask)
            gbias if nbias else None,
            None, None, None, None, None, None, None, None)


attend.register_autograd(_backward, setup_context=_setup_context)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("qsv_pyg::attend", _device, torch.float32)


def qsv_attend(v: Tensor, q_src: Optional[Tensor], q_dst: Optional[Tensor], k_src: Tensor,
               k_dst: Tensor, beta: Tensor, graph: GraphCSR, use_abs: bool = False,
               edge_scale: Optional[Tensor] = None,
               edge_logit: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    r"""QSV attention of ``graph`` (see the module docstring).

    Args:
        v: source features in blocks of four, ``[N_src, H, M, 4]``.
        q_src, q_dst: unit quaternions ``[N_src, H, 4]`` / ``[N_dst, H, 4]`` of
            the transport, or both :obj:`None` for no transport.
        k_src, k_dst: routing keys ``[N_src, H, D]`` / ``[N_dst, H, D]``
            (``D = 0``: uniform routing).
        beta: routing temperatures ``[H]``.
        graph: the :class:`~qsv_pyg.nn.csr.GraphCSR` (``N_dst`` targets).
        use_abs: route by :math:`|\langle k_i, k_j \rangle|`.
        edge_scale: an optional per-edge scale :math:`s_{ij}` ``[E, H]`` of the
            aggregation, in the graph's target-sorted edge order (the order of
            the returned weights): :math:`y_i = \sum_j \alpha_{ij} s_{ij} u_j`.
            Attention dropout passes its mask divided by :math:`1 - p`. A
            constant to autograd: no gradient flows to it.
        edge_logit: an optional additive logit term :math:`b_{ij}` ``[E, H]``,
            in the same order: the logit is :math:`\beta \langle k_i, k_j
            \rangle + b_{ij}` (or with :math:`|\cdot|`). Differentiable: its
            gradient is :math:`\partial L / \partial \mathrm{logit}_{ij}`.
            :obj:`None` costs nothing.

    Returns:
        ``z`` ``[N_dst, H, M, 4]`` and the attention weights ``[E, H]`` in the
        graph's target-sorted edge order: the unscaled softmax :math:`\alpha`
        also with ``edge_scale`` (multiply it in for the weights actually used).
    """
    ns, heads = v.shape[:2]
    nd = graph.rowptr.numel() - 1
    rotate = q_src is not None
    if v.dim() != 4 or v.size(-1) != 4:
        raise ValueError(f"qsv_attend: v {tuple(v.shape)} must be [N_src, H, M, 4]")
    if rotate and (q_dst is None or q_src.shape != (ns, heads, 4)
                   or q_dst.shape != (nd, heads, 4)):
        raise ValueError(f"qsv_attend: quaternions must be [{ns}, {heads}, 4] and "
                         f"[{nd}, {heads}, 4]")
    d = k_src.size(-1)
    if k_src.shape != (ns, heads, d) or k_dst.shape != (nd, heads, d):
        raise ValueError(f"qsv_attend: keys {tuple(k_src.shape)}, {tuple(k_dst.shape)} "
                         f"must be [{ns}, {heads}, D] and [{nd}, {heads}, D]")
    if beta.shape != (heads, ):
        raise ValueError(f"qsv_attend: beta {tuple(beta.shape)} must be [{heads}]")
    num_edges = graph.col.numel()
    if edge_scale is not None and edge_scale.shape != (num_edges, heads):
        raise ValueError(f"qsv_attend: edge_scale {tuple(edge_scale.shape)} must be "
                         f"[E, H] = [{num_edges}, {heads}] (one per edge and head, in the "
                         f"graph's target-sorted edge order)")
    if edge_logit is not None and edge_logit.shape != (num_edges, heads):
        raise ValueError(f"qsv_attend: edge_logit {tuple(edge_logit.shape)} must be "
                         f"[E, H] = [{num_edges}, {heads}] (one per edge and head, in the "
                         f"graph's target-sorted edge order)")
    # Precision. The quaternions, keys, β and the edge terms reach the operator in
    # float32 (float64 for float64 features), never rounded to the features' dtype
    # (a bf16 quaternion is off the unit sphere by up to ~6e-3). Everything
    # accumulates in float32 (float64). The features themselves:
    # * Triton path: half-precision features (bf16 / fp16, e.g. from a projection
    #   under autocast) are read as they are, no float32 copy; u, y and z are
    #   stored in that dtype, the weights in float32. z is returned in the
    #   features' dtype also under autocast (what autocast's lower-precision ops
    #   return; the next matmul would cast it there anyway).
    # * C++ and PyTorch paths: computed in float32 from a widened copy; under
    #   autocast z is returned in float32 (the operator is a float32 op there),
    #   outside it in the features' dtype.
    # The weights are returned in float32 under autocast, else in the features'
    # dtype. The operator's own autocast registration (float32 for direct callers)
    # is bypassed here: the dtypes are set explicitly.
    dt = torch.promote_types(v.dtype, torch.float32)
    autocast = torch.is_autocast_enabled(v.device.type)
    half_storage = v.dtype in (torch.float16, torch.bfloat16) and backend(v) == "triton"
    vdt = v.dtype if half_storage else dt
    z_dt = v.dtype if half_storage or not autocast else dt
    alpha_dt = dt if autocast else v.dtype
    empty = v.new_empty(0, heads, 4, dtype=dt)
    scale = v.new_empty(0, heads, dtype=dt) if edge_scale is None else \
        edge_scale.to(dt).contiguous()
    bias = v.new_empty(0, heads, dtype=dt) if edge_logit is None else \
        edge_logit.to(dt).contiguous()
    with torch.autocast(v.device.type, enabled=False) if autocast else _NO_CONTEXT:
        z, alpha, _, _, _ = attend(
            v.to(vdt).contiguous(), empty if q_src is None else q_src.to(dt).contiguous(),
            empty if q_dst is None else q_dst.to(dt).contiguous(), k_src.to(dt).contiguous(),
            k_dst.to(dt).contiguous(), beta.to(dt), scale, bias, graph.rowptr, graph.col,
            graph.row, graph.rowptr_t, graph.perm_t, graph.row_t, use_abs, rotate)
    return z.to(z_dt), alpha.to(alpha_dt)
