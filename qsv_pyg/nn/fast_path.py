"""The fast path of :class:`~qsv_pyg.nn.QSVConv`: its inputs laid out for the
registered operator :func:`~qsv_pyg.nn.qsv_kernel.qsv_attend`.

Routing becomes keys (``logit = beta * <k_i, k_j>``), the graph its cached CSR
(:func:`~qsv_pyg.nn.csr.graph_csr`), and a batch either extra channels of one
shared routing or ``B`` disjoint copies of the graph
(:func:`~qsv_pyg.nn.dispatch.choose_path`).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor
from torch_geometric.typing import OptTensor

from .csr import graph_csr
from .qsv_kernel import qsv_attend


def routing_keys(conv, q_src: Tensor, q_dst: OptTensor, pos: Tuple[OptTensor, OptTensor],
                 num_src: int, num_dst: int, ref: Tensor) -> Tuple[Tensor, Tensor]:
    """Routing keys ``[*, N, H, D]``: ``logit = beta * <k_i, k_j>`` up to a
    per-target constant (which the softmax ignores)."""
    if conv.routing in ("learned", "abs"):
        assert q_dst is not None
        return q_src, q_dst  # Re(q_i* q_j) = <q_i, q_j>
    H = conv.heads
    if conv.routing == "uniform":  # no keys: equal logits, alpha = 1 / deg
        return ref.new_empty(num_src, H, 0), ref.new_empty(num_dst, H, 0)
    # -|p_i - p_j|^2 = 2 <p_i, p_j> - |p_j|^2 - |p_i|^2; the last term is the
    # same for all of a target's edges.
    p_s, p_d = pos
    assert p_s is not None and p_d is not None
    k_s = torch.cat([p_s, p_s.pow(2).sum(-1, keepdim=True)], dim=-1)
    k_d = torch.cat([2 * p_d, -torch.ones_like(p_d[:, :1])], dim=-1)
    return k_s.unsqueeze(-2).expand(-1, H, -1), k_d.unsqueeze(-2).expand(-1, H, -1)


def attend(conv, path: str, x: Tensor, q_src: Tensor, q_dst: OptTensor,
           pos: Tuple[OptTensor, OptTensor], edge_index: Tensor, num_dst: int,
           want_alpha: bool = True) -> Tuple[Tensor, Tensor, int]:
    """Aggregate by the registered operator; returns ``(z_h [H, M, C], alpha,
    b)``, rows node-major ``(n, b)`` when ``b > 0`` (``QSVConv._project``).
    ``alpha`` is in the order of ``edge_index`` when ``want_alpha``, else in
    the graph's target-sorted order (not reordered: nobody reads it)."""
    H = conv.heads
    C = x.size(-1) // H
    if type(edge_index) is not Tensor:  # EdgeIndex (its storage is its `_data`)
        edge_index = edge_index.as_tensor() if hasattr(edge_index, "as_tensor") \
            else edge_index.as_subclass(Tensor)
    n_src = x.size(-2)
    k_src, k_dst = routing_keys(conv, q_src, q_dst, pos, n_src, num_dst, x)
    rotate = conv.transport == "sandwich"
    use_abs = conv.routing == "abs"
    B = x.size(0) if x.dim() == 3 else 1
    if path == "attend_per_item":
        graph = graph_csr(edge_index, n_src, num_dst, batch=B)

        def flat(t: Tensor) -> Tensor:  # [B, N, H, *] or shared [N, H, *] -> [B * N, H, *]
            t = t if t.dim() == 4 else t.unsqueeze(0).expand(B, *t.shape)
            return t.reshape(t.size(0) * t.size(1), *t.shape[-2:])

        v = x.reshape(B * n_src, H, C // 4, 4)
        assert q_dst is not None or not rotate
        z, alpha = qsv_attend(v, flat(q_src) if rotate else None,
                              flat(q_dst) if rotate else None, flat(k_src), flat(k_dst),
                              conv.beta, graph, use_abs)
        if want_alpha:
            alpha = torch.empty_like(alpha).index_copy_(0, graph.perm, alpha)
        return z.view(B * num_dst, H, C).transpose(0, 1), alpha.view(B, -1, H), 0
    graph = graph_csr(edge_index, n_src, num_dst)
    # [N, H, B * C / 4, 4]: the batch rides along as more blocks of each row.
    v = x.view(B, n_src, H, C // 4, 4).permute(1, 2, 0, 3, 4).reshape(n_src, H, B * C // 4, 4)
    z, alpha = qsv_attend(v, q_src if rotate else None, q_dst if rotate else None,
                          k_src, k_dst, conv.beta, graph, use_abs)
    if want_alpha:
        alpha = torch.empty_like(alpha).index_copy_(0, graph.perm, alpha)
    z_h = z.view(num_dst, H, B * C).transpose(0, 1).reshape(H, num_dst * B, C)
    if x.dim() == 3:
        return z_h, alpha.expand(B, -1, -1), B
    return z_h, alpha, 0
