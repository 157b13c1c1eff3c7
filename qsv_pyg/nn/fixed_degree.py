r"""The fixed-degree fast path: every target has exactly ``k`` incoming edges.

The kNN graphs of :mod:`qsv_pyg.geometry` are stored target-sorted with exactly
``k`` edges per target, so the sources form a dense ``[N, k]`` table. Attention
then needs no scatter: gather ``[N, k, ...]``, softmax over ``k``, sum over ``k``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def fixed_degree_neighbors(edge_index: Tensor, num_dst: int) -> Optional[Tensor]:
    r"""Dense ``[num_dst, k]`` view of the sources when every target has exactly
    ``k`` incoming edges stored contiguously in target order, else ``None``.

    This is the layout :mod:`qsv_pyg.geometry` builds (target-sorted kNN graphs),
    and the one a batch of ``B`` graph copies keeps when indices are offset per
    copy. The check is a single vectorised comparison.
    """
    num_edges = edge_index.size(1)
    if num_dst <= 0 or num_edges == 0 or num_edges % num_dst != 0:
        return None
    k = num_edges // num_dst
    dst = edge_index[1].view(num_dst, k)
    expected = torch.arange(num_dst, device=dst.device).view(-1, 1)
    if not bool((dst == expected).all()):
        return None
    return edge_index[0].view(num_dst, k)


def gather_rows(src: Tensor, nbr: Tensor, dim: int) -> Tensor:
    """``src`` gathered at the ``[N, k]`` table ``nbr`` along ``dim``.

    ``index_select`` rather than advanced indexing: its backward is ``index_add_``,
    several times faster on CPU than the ``index_put_(accumulate=True)`` that
    ``src[nbr]`` differentiates to.
    """
    dim = dim % src.dim()
    out = src.index_select(dim, nbr.reshape(-1))
    return out.view(*src.shape[:dim], nbr.size(0), nbr.size(1), *src.shape[dim + 1:])


class _WeightedNeighborSum(torch.autograd.Function):
    """``z[..., i, h, :] = sum_k alpha[..., i, k, h] * v[..., nbr[i, k], h, :]``.

    A custom backward so the ``[..., N, k, H, C]`` gathered neighbours are never
    saved: they are re-gathered in backward (one cheap ``index_select``), which
    keeps the saved memory at the size of ``v`` and ``alpha`` — below GATConv's,
    which stores its per-edge messages.
    """

    @staticmethod
    def forward(ctx, alpha: Tensor, v: Tensor, nbr: Tensor) -> Tensor:
        v_nbr = gather_rows(v, nbr, -3)  # [..., N, k, H, C]
        ctx.save_for_backward(alpha, v, nbr)
        return (alpha.unsqueeze(-1) * v_nbr).sum(dim=-3)

    @staticmethod
    def backward(ctx, grad_z: Tensor):
        alpha, v, nbr = ctx.saved_tensors
        grad_alpha = grad_v = None
        grad_z = grad_z.unsqueeze(-3)  # [..., N, 1, H, C]
        if ctx.needs_input_grad[0]:
            v_nbr = gather_rows(v, nbr, -3)
            grad_alpha = (grad_z * v_nbr).sum(dim=-1)  # [..., N, k, H]
            # alpha shared by a batch (a per-node field): reduce the batch dims.
            while grad_alpha.dim() > alpha.dim():
                grad_alpha = grad_alpha.sum(dim=0)
        if ctx.needs_input_grad[1]:
            msg = alpha.unsqueeze(-1) * grad_z  # [..., N, k, H, C]
            msg = msg.expand(*v.shape[:-3], *msg.shape[-4:]) if msg.dim() < v.dim() + 1 \
                else msg
            msg = msg.reshape(*msg.shape[:-4], -1, *msg.shape[-2:])
            grad_v = torch.zeros_like(v).index_add_(v.dim() - 3, nbr.reshape(-1), msg)
        return grad_alpha, grad_v, None


def weighted_neighbor_sum(alpha: Tensor, v: Tensor, nbr: Tensor) -> Tensor:
    r"""Attention-weighted sum over a fixed-degree neighbour table.

    Args:
        alpha: weights ``[..., N_dst, k, H]`` (leading batch dims optional; a
            weight without them is shared by every batch item).
        v: source features ``[..., N_src, H, C]``.
        nbr: source indices ``[N_dst, k]``.

    Returns:
        ``[..., N_dst, H, C]``.
    """
    return _WeightedNeighborSum.apply(alpha, v, nbr)
