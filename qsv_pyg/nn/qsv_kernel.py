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

The gradient is checked against autograd of the unfused operations
(``tests/test_qsv_kernel.py``, ``gradcheck`` in float64).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..quaternion import block_matrix_to_quaternion_grad, quaternion_to_block_matrix
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


class _QSVAggregate(torch.autograd.Function):

    @staticmethod
    def forward(ctx, v: Tensor, q_src: Tensor, q_dst: Optional[Tensor], beta: Tensor,
                nbr: Tensor, use_abs: bool):
        n, k = nbr.shape
        ns, H, m, _ = v.shape
        same = q_dst is None
        qd = q_src if same else q_dst
        crow, col, crow_t, col_t, perm = _csr_pattern(nbr, H, ns)
        rot_s = quaternion_to_block_matrix(q_src).view(ns * H, 4, 4)
        rot_d = rot_s if same else quaternion_to_block_matrix(qd).view(n * H, 4, 4)
        # Rotate every source once by q_j: rows of v times Q_j^T.
        u = torch.bmm(v.view(ns * H, m, 4), rot_s.transpose(1, 2))
        dot = neighbor_dot(qd, q_src, nbr)  # [n, k, H], Re(q_i* q_j)
        r = dot.abs() if use_abs else dot
        # (i, h, k) order = the CSR value order of rows (i, h).
        alpha = softmax_last((r * beta).transpose(1, 2).contiguous())
        y = _csr(crow, col, alpha.view(-1), (n * H, ns * H)) @ u.view(ns * H, m * 4)
        y = y.view(n * H, m, 4)
        z = torch.bmm(y, rot_d)  # rotate back by q_i*: rows times Q_i
        ctx.save_for_backward(v, q_src, q_dst, beta, nbr, rot_s,
                              None if same else rot_d, u, y, dot, alpha)
        ctx.use_abs = use_abs
        ctx.pattern = (crow, col, crow_t, col_t, perm)
        return z.view(n, H, m, 4), alpha.transpose(1, 2)

    @staticmethod
    @once_differentiable  # the sparse products are not differentiated twice
    def backward(ctx, grad_z: Tensor, grad_alpha: Optional[Tensor]):
        v, q_src, q_dst, beta, nbr, rot_s, rot_d, u, y, dot, alpha = ctx.saved_tensors
        crow, col, crow_t, col_t, perm = ctx.pattern
        need_v, need_qs, need_qd, need_beta = ctx.needs_input_grad[:4]
        same = q_dst is None
        qd = q_src if same else q_dst
        rot_d = rot_s if same else rot_d
        n, k = nbr.shape
        ns, H, m, _ = v.shape
        shape, shape_t = (n * H, ns * H), (ns * H, n * H)
        need_q = need_qs or need_qd
        gv = gqs = gqd = gbeta = None

        gz = grad_z.contiguous().view(n * H, m, 4)
        gy = torch.bmm(gz, rot_d.transpose(1, 2))
        # d loss / d alpha = <gy_i, u_j> on the edges (SDDMM); alpha as the
        # pattern's values only fixes the sparsity (beta=0 ignores them).
        ga = torch.sparse.sampled_addmm(_csr(crow, col, alpha.view(-1), shape),
                                        gy.view(n * H, m * 4), u.view(ns * H, m * 4).t(),
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
            gu = (a_t @ gy.view(n * H, m * 4)).view(ns * H, m, 4)
        if need_v:
            gv = torch.bmm(gu, rot_s).view(v.shape)
        if need_q:
            gd = gs * beta.view(1, H, 1)  # d loss / d <q_i, q_j>, (i, h, k) order
            if ctx.use_abs:
                gd = gd * dot.sign().transpose(1, 2)
            gd = gd.reshape(-1)
            # <q_i, q_j> sends gd * q_j to q_i (SpMM) and gd * q_i to q_j (A^T SpMM).
            gqd = _csr(crow, col, gd, shape) @ q_src.reshape(ns * H, 4)
            gqs = _csr(crow_t, col_t, gd.index_select(0, perm), shape_t) @ qd.reshape(n * H, 4)
            g_rot_s = torch.bmm(gu.transpose(1, 2), v.view(ns * H, m, 4))  # u = v Q_j^T
            g_rot_d = torch.bmm(y.transpose(1, 2), gz)                    # z = y Q_i
            if same:
                gqs = (gqs + gqd).view(q_src.shape) + block_matrix_to_quaternion_grad(
                    q_src, (g_rot_s + g_rot_d).view(ns, H, 4, 4))
                gqd = None
            else:
                gqs = gqs.view(q_src.shape) + block_matrix_to_quaternion_grad(
                    q_src, g_rot_s.view(ns, H, 4, 4))
                gqd = gqd.view(qd.shape) + block_matrix_to_quaternion_grad(
                    qd, g_rot_d.view(n, H, 4, 4))
        return gv, gqs, gqd, gbeta, None, None


def qsv_aggregate(v: Tensor, q_src: Tensor, q_dst: Optional[Tensor], beta: Tensor,
                  nbr: Tensor, use_abs: bool = False) -> Tuple[Tensor, Tensor]:
    r"""Fused QSV attention on a fixed-degree graph (routing shared by the batch).

    Args:
        v: source features in blocks of four, node-major ``[N_src, H, M, 4]``
            (``M`` blocks per head, e.g. ``B * C / 4`` for a batch laid out
            ``[N, H, B, C]``).
        q_src: unit source quaternions ``[N_src, H, 4]``.
        q_dst: unit target quaternions ``[N_dst, H, 4]``, or :obj:`None` when
            targets and sources are the same nodes (then ``N_dst = N_src``).
        beta: routing temperatures ``[H]``.
        nbr: source indices ``[N_dst, k]``.
        use_abs: route by :math:`|\mathrm{Re}\, r|` instead of
            :math:`\mathrm{Re}\, r`.

    Returns:
        ``z`` of shape ``[N_dst, H, M, 4]`` (transported, weighted, rotated
        back) and the attention weights ``[N_dst, k, H]``.
    """
    n, k = nbr.shape
    if v.dim() != 4 or v.size(-1) != 4 or q_src.shape != (v.size(0), v.size(1), 4):
        raise ValueError(f"qsv_aggregate: v {tuple(v.shape)} must be [N_src, H, M, 4] "
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
                               beta, nbr, use_abs)
