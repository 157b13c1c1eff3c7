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
    """``z[i, h, ...] = sum_k alpha[i, k, h, ...] * v[nbr[i, k], h, ...]``.

    Node-major layout: the gather is an ``index_select`` along dim 0 that copies
    whole contiguous rows (along an inner dim it measured 5x slower on CPU), its
    transpose an ``index_add_`` along dim 0, and with a batch laid out as
    ``[N, H, B, C]`` a weight shared by the batch multiplies long contiguous
    runs. The backward re-gathers the ``[N, k, ...]`` neighbours instead of
    saving them, so the memory kept for backward is that of ``v`` and ``alpha``
    — below GATConv's, which stores per-edge messages.
    """

    @staticmethod
    def forward(ctx, alpha: Tensor, v: Tensor, nbr: Tensor) -> Tensor:
        n_dst, k = nbr.shape
        a = alpha.view(*alpha.shape, *([1] * (v.dim() + 1 - alpha.dim())))
        v_nbr = v.index_select(0, nbr.reshape(-1)).view(n_dst, k, *v.shape[1:])
        ctx.save_for_backward(alpha, v, nbr)
        return (a * v_nbr).sum(dim=1)

    @staticmethod
    def backward(ctx, grad_z: Tensor):
        alpha, v, nbr = ctx.saved_tensors
        n_dst, k = nbr.shape
        g = grad_z.unsqueeze(1)  # [N_dst, 1, H, ...]
        grad_alpha = grad_v = None
        if ctx.needs_input_grad[0]:
            v_nbr = v.index_select(0, nbr.reshape(-1)).view(n_dst, k, *v.shape[1:])
            grad_alpha = (g * v_nbr).sum(dim=tuple(range(alpha.dim(), v.dim() + 1)))
        if ctx.needs_input_grad[1]:
            a = alpha.view(*alpha.shape, *([1] * (v.dim() + 1 - alpha.dim())))
            msg = (a * g).reshape(n_dst * k, *v.shape[1:])
            grad_v = torch.zeros_like(v).index_add_(0, nbr.reshape(-1), msg)
        return grad_alpha, grad_v, None


def weighted_neighbor_sum(alpha: Tensor, v: Tensor, nbr: Tensor) -> Tensor:
    r"""Attention-weighted sum over a fixed-degree neighbour table.

    Args:
        alpha: weights ``[N_dst, k, H, *A]`` where ``A`` is a prefix of ``v``'s
            trailing dims ``R`` (e.g. empty for weights shared by a batch, or
            ``(B,)`` for per-item weights with ``v`` laid out ``[N, H, B, C]``).
        v: source features ``[N_src, H, *R]``.
        nbr: source indices ``[N_dst, k]``.

    Returns:
        ``[N_dst, H, *R]``.
    """
    if alpha.shape[:2] != nbr.shape or alpha.size(2) != v.size(1) \
            or tuple(alpha.shape[3:]) != tuple(v.shape[2:2 + alpha.dim() - 3]):
        raise ValueError(f"weighted_neighbor_sum: alpha {tuple(alpha.shape)} does not fit "
                         f"nbr {tuple(nbr.shape)} and v {tuple(v.shape)}")
    return _WeightedNeighborSum.apply(alpha, v, nbr)
