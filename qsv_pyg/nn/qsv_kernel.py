r"""The QSV aggregation as one autograd node, for fixed-degree graphs.

For a routing shared by every batch item (2-D input, or a per-node quaternion
field) the whole of QSV attention between "features in" and "per-head sums
out" is

.. math::
    \mathbf{u}_j = Q_j \mathbf{v}_j, \quad
    \alpha_{ik} = \operatorname{softmax}_k\big(\beta\, \langle q_i, q_{n(i,k)} \rangle\big),
    \quad \mathbf{y}_i = \textstyle\sum_k \alpha_{ik} \mathbf{u}_{n(i,k)}, \quad
    \mathbf{z}_i = Q_i^\top \mathbf{y}_i,

with :math:`Q = \mathrm{diag}(1, R(q))` acting on every block of four channels
(:func:`~qsv_pyg.quaternion.quaternion_to_block_matrix`). Written as ordinary
autograd operations this is some sixty small kernels forward and backward; at a
few thousand nodes their fixed cost, not arithmetic, sets the time. Here the
forward is eight kernels (two batched 4x4 matmuls, a gathered dot product, the
softmax, one sparse matrix product) and the backward is written out by hand
(two batched matmuls, one SDDMM, one SpMM, and, when the quaternions need a
gradient, two narrow SpMMs for the logits and two batched matmuls for the
rotations). Nothing of size ``[E, H, C]`` is stored.

On CPU, for the block-major layout, the same arithmetic runs in a C++ kernel
(:mod:`qsv_pyg.nn._cpu_ext`, two OpenMP passes, compiled on first use) when it
can be built; otherwise, and on other devices, in the PyTorch operations below.

The gradient is checked against autograd of the unfused operations
(``tests/test_qsv_kernel.py``, ``gradcheck`` in float64, both implementations).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..quaternion import block_matrix_to_quaternion_grad, quaternion_to_block_matrix
from ._cpu_ext import cpu_kernel
from .fixed_degree import _csr_pattern, neighbor_dot


def softmax_last(s: Tensor) -> Tensor:
    r"""Softmax over the last dimension.

    ``torch.softmax`` over a last dimension shorter than 16 takes a slow path on
    CPU (8 wide: 13.8 ms for 2M values vs 2.7 ms written out, 2 cores); the
    written-out form is used there.
    """
    if s.size(-1) >= 16 or s.device.type != "cpu":
        return torch.softmax(s, dim=-1)
    e = (s - s.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True))


def _csr(crow: Tensor, col: Tensor, values: Tensor, shape: Tuple[int, int]) -> Tensor:
    return torch.sparse_csr_tensor(crow, col, values, shape)


# Two layouts of the M four-vectors of a (node, head): "block-major" [M, 4]
# (the channel order of the input) and "component-major" [4, M]. Applying the
# 4x4 matrices is a batched matmul either way; which is faster depends on M
# (2 cores: M = 4, 16k matrices: 254 us block-major vs 370 us; M = 64: 3.8 ms
# vs 0.93 ms), so the caller picks (see COMPONENT_MAJOR_MIN_BLOCKS).
COMPONENT_MAJOR_MIN_BLOCKS = 16


def _apply(rot: Tensor, t: Tensor, transpose: bool, comp: bool) -> Tensor:
    """``rot @ t_m`` (or ``rot^T @ t_m``) for every vector ``t_m`` of ``t``."""
    if comp:  # t [NH, 4, M]
        return torch.bmm(rot.transpose(1, 2) if transpose else rot, t)
    return torch.bmm(t, rot if transpose else rot.transpose(1, 2))  # t [NH, M, 4]


def _outer(a: Tensor, b: Tensor, comp: bool) -> Tensor:
    """``sum_m a_m b_m^T`` per batch entry, ``[NH, 4, 4]``."""
    if comp:
        return torch.bmm(a, b.transpose(1, 2))
    return torch.bmm(a.transpose(1, 2), b)


class _QSVAggregate(torch.autograd.Function):

    @staticmethod
    def forward(ctx, v: Tensor, q_src: Tensor, q_dst: Optional[Tensor], beta: Tensor,
                nbr: Tensor, use_abs: bool, comp: bool):
        n, k = nbr.shape
        ns, H = v.shape[:2]
        width = v[0, 0].numel()
        same = q_dst is None
        qd = q_src if same else q_dst
        crow, col, crow_t, col_t, perm = _csr_pattern(nbr, H, ns)
        ctx.set_materialize_grads(False)
        ctx.use_abs, ctx.comp = use_abs, comp
        ctx.pattern = (crow, col, crow_t, col_t, perm)
        ext = _kernel_for(v, q_src, qd, beta, nbr, crow_t, comp)
        ctx.ext = ext
        if ext is not None:
            # The C++ kernel: the same arithmetic in two passes (rotation matrices
            # computed on the fly); dot is [n, H, k] here.
            z, alpha, u, y, dot = ext.forward(v, q_src, qd, beta.contiguous(),
                                              nbr.contiguous(), use_abs)
            ctx.save_for_backward(v, q_src, q_dst, beta, nbr, None, None, u, y, dot, alpha)
            return z, alpha.transpose(1, 2)
        rot_s = quaternion_to_block_matrix(q_src).view(ns * H, 4, 4)
        rot_d = rot_s if same else quaternion_to_block_matrix(qd).view(n * H, 4, 4)
        vf = v.view(ns * H, *v.shape[2:])
        u = _apply(rot_s, vf, False, comp)  # rotate every source once by q_j
        dot = neighbor_dot(qd, q_src, nbr)  # [n, k, H], Re(q_i* q_j)
        r = dot.abs() if use_abs else dot
        # (i, h, k) order = the CSR value order of rows (i, h).
        alpha = softmax_last((r * beta).transpose(1, 2).contiguous())
        y = _csr(crow, col, alpha.view(-1), (n * H, ns * H)) @ u.view(ns * H, width)
        y = y.view(n * H, *v.shape[2:])
        z = _apply(rot_d, y, True, comp)  # rotate back by q_i*
        ctx.save_for_backward(v, q_src, q_dst, beta, nbr, rot_s,
                              None if same else rot_d, u, y, dot, alpha)
        return z.view(n, H, *v.shape[2:]), alpha.transpose(1, 2)

    @staticmethod
    @once_differentiable  # the sparse products are not differentiated twice
    def backward(ctx, grad_z: Optional[Tensor], grad_alpha: Optional[Tensor]):
        v, q_src, q_dst, beta, nbr, rot_s, rot_d, u, y, dot, alpha = ctx.saved_tensors
        crow, col, crow_t, col_t, perm = ctx.pattern
        comp = ctx.comp
        need_v, need_qs, need_qd, need_beta = ctx.needs_input_grad[:4]
        same = q_dst is None
        qd = q_src if same else q_dst
        rot_d = rot_s if same else rot_d
        n, k = nbr.shape
        ns, H = v.shape[:2]
        width = v[0, 0].numel()
        shape, shape_t = (n * H, ns * H), (ns * H, n * H)
        need_q = need_qs or need_qd
        gv = gqs = gqd = gbeta = None
        if grad_z is None:  # only the attention weights were used
            grad_z = v.new_zeros(n, H, *v.shape[2:])

        if ctx.ext is not None:
            g_alpha = None if grad_alpha is None else grad_alpha.transpose(1, 2).contiguous()
            gv, gqs, gqd, gbeta = ctx.ext.backward(
                grad_z.contiguous(), g_alpha, v, q_src, qd, beta.contiguous(),
                nbr.contiguous(), alpha, dot, u, y, crow_t, col_t, perm, ctx.use_abs,
                bool(need_v), bool(need_q))
            if not need_q:
                gqs = gqd = None
            elif same:  # one node set: both roles' gradients go to the same quaternions
                gqs, gqd = gqs + gqd, None
            return (gv if need_v else None, gqs, gqd, gbeta if need_beta else None,
                    None, None, None)

        gz = grad_z.contiguous().view(n * H, *v.shape[2:])
        gy = _apply(rot_d, gz, False, comp)
        # d loss / d alpha = <gy_i, u_j> on the edges (SDDMM); alpha as the
        # pattern's values only fixes the sparsity (beta=0 ignores them).
        ga = torch.sparse.sampled_addmm(_csr(crow, col, alpha.view(-1), shape),
                                        gy.view(n * H, width), u.view(ns * H, width).t(),
                                        beta=0.0).values().view(n, H, k)
        if grad_alpha is not None:
            ga = ga + grad_alpha.transpose(1, 2)
        gs = alpha * (ga - (alpha * ga).sum(dim=-1, keepdim=True))  # softmax backward
        r = dot.abs() if ctx.use_abs else dot
        if need_beta:
            gbeta = (gs.transpose(1, 2) * r).sum(dim=(0, 1))
        gu = None
        if need_v or need_q:
            a_t = _csr(crow_t, col_t, alpha.view(-1).index_select(0, perm), shape_t)
            gu = (a_t @ gy.view(n * H, width)).view(ns * H, *v.shape[2:])
        if need_v:
            gv = _apply(rot_s, gu, True, comp).view(v.shape)
        if need_q:
            gd = gs * beta.view(1, H, 1)  # d loss / d <q_i, q_j>, (i, h, k) order
            if ctx.use_abs:
                gd = gd * dot.sign().transpose(1, 2)
            gd = gd.reshape(-1)
            # <q_i, q_j> sends gd * q_j to q_i (SpMM) and gd * q_i to q_j (A^T SpMM).
            gqd = _csr(crow, col, gd, shape) @ q_src.reshape(ns * H, 4)
            gqs = _csr(crow_t, col_t, gd.index_select(0, perm), shape_t) @ qd.reshape(n * H, 4)
            vf = v.view(ns * H, *v.shape[2:])
            g_rot_s = _outer(gu, vf, comp)  # u = Q_j v
            g_rot_d = _outer(y, gz, comp)   # z = Q_i^T y
            gqs, gqd = _quaternion_grads(q_src, qd, same, gqs, gqd, g_rot_s, g_rot_d)
        return gv, gqs, gqd, gbeta, None, None, None


def _quaternion_grads(q_src: Tensor, q_dst: Tensor, same: bool, g_dot_src: Tensor,
                      g_dot_dst: Tensor, g_rot_s: Tensor, g_rot_d: Tensor
                      ) -> Tuple[Tensor, Optional[Tensor]]:
    """Source and target quaternion gradients from the logit part (``g_dot_*``,
    ``N * H`` rows of 4) and the rotation part (``g_rot_*``, ``N * H`` 4x4)."""
    ns, H = q_src.shape[:2]
    n = q_dst.size(0)
    if same:
        gq = (g_dot_src + g_dot_dst).view(q_src.shape) + block_matrix_to_quaternion_grad(
            q_src, (g_rot_s + g_rot_d).view(ns, H, 4, 4))
        return gq, None
    gqs = g_dot_src.view(q_src.shape) + block_matrix_to_quaternion_grad(
        q_src, g_rot_s.view(ns, H, 4, 4))
    gqd = g_dot_dst.view(q_dst.shape) + block_matrix_to_quaternion_grad(
        q_dst, g_rot_d.view(n, H, 4, 4))
    return gqs, gqd


def _kernel_for(v: Tensor, q_src: Tensor, q_dst: Tensor, beta: Tensor, nbr: Tensor,
                crow_t: Tensor, comp: bool):
    """The C++ module when it applies (CPU, block-major, one dtype), else None."""
    if comp or v.device.type != "cpu" or nbr.dtype != torch.long \
            or crow_t.dtype != torch.int32:
        return None
    if not (v.dtype == q_src.dtype == q_dst.dtype == beta.dtype) \
            or v.dtype not in (torch.float32, torch.float64):
        return None
    return cpu_kernel()


def qsv_aggregate(v: Tensor, q_src: Tensor, q_dst: Optional[Tensor], beta: Tensor,
                  nbr: Tensor, use_abs: bool = False,
                  component_major: bool = False) -> Tuple[Tensor, Tensor]:
    r"""Fused QSV attention on a fixed-degree graph (routing shared by the batch).

    Args:
        v: source features in blocks of four, node-major: ``[N_src, H, M, 4]``
            (``M`` blocks per head, e.g. ``B * C / 4`` for a batch laid out
            ``[N, H, B, C]``), or ``[N_src, H, 4, M]`` with
            ``component_major=True``.
        q_src: unit source quaternions ``[N_src, H, 4]``.
        q_dst: unit target quaternions ``[N_dst, H, 4]``, or :obj:`None` when
            targets and sources are the same nodes (then ``N_dst = N_src``).
        beta: routing temperatures ``[H]``.
        nbr: source indices ``[N_dst, k]``.
        use_abs: route by :math:`|\mathrm{Re}\, r|` instead of
            :math:`\mathrm{Re}\, r`.
        component_major: the layout of ``v`` (and of the result); faster for
            many blocks per head (``M >= 16``), see ``COMPONENT_MAJOR_MIN_BLOCKS``.

    Returns:
        ``z`` in the layout of ``v`` with ``N_dst`` rows (transported, weighted,
        rotated back) and the attention weights ``[N_dst, k, H]``.
    """
    n, k = nbr.shape
    four = v.size(2) if component_major else v.size(-1)
    if v.dim() != 4 or four != 4 or q_src.shape != (v.size(0), v.size(1), 4):
        layout = "[N_src, H, 4, M]" if component_major else "[N_src, H, M, 4]"
        raise ValueError(f"qsv_aggregate: v {tuple(v.shape)} must be {layout} "
                         f"and q_src {tuple(q_src.shape)} [N_src, H, 4]")
    if q_dst is None and n != v.size(0):
        raise ValueError(f"qsv_aggregate: {n} targets but {v.size(0)} sources and no "
                         f"q_dst; pass the targets' quaternions")
    if q_dst is not None and q_dst.shape != (n, v.size(1), 4):
        raise ValueError(f"qsv_aggregate: q_dst {tuple(q_dst.shape)} must be "
                         f"[{n}, {v.size(1)}, 4]")
    if beta.shape != (v.size(1), ):
        raise ValueError(f"qsv_aggregate: beta {tuple(beta.shape)} must be [{v.size(1)}]")
    return _QSVAggregate.apply(v.contiguous(), q_src.contiguous(),
                               None if q_dst is None else q_dst.contiguous(),
                               beta, nbr, use_abs, component_major)
