r"""Literal per-edge QSV kernel, kept as the ground truth for :class:`QSVConv`.

It forms :math:`r_{ij} = q_i^* \otimes q_j` for every edge, takes the logit from
:math:`\mathrm{Re}\, r_{ij}`, normalises with an explicit loop over targets and
transports every message with two Hamilton products — no factorisation, no PyG
softmax, no scatter kernels. Slow by design; use it on small graphs only.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..quaternion import conjugate, hamilton_product
from .csr import with_self_loops_and_attr
from .qsv_conv import QSVConv


def qsv_conv_reference(
    conv: QSVConv,
    x: Union[Tensor, Tuple[Tensor, Optional[Tensor]]],
    edge_index: Tensor,
    quat=None,
    pos=None,
    edge_attr: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Evaluate ``conv`` edge by edge (eval-mode semantics: no dropout).

    The logit of edge :math:`j \to i` and head :math:`h` is the routing logit
    (:math:`\beta_h \mathrm{Re}\, r_{ij}`, its absolute value, zero, or
    :math:`-\beta_h |p_i - p_j|^2`) plus, with ``edge_dim``, the edge score
    :math:`(\mathbf{W}_e e_{ij})_h` and, with ``source_logit``, the source score
    :math:`a_h^\top x_j`; with ``edge_message="source"`` the transported message is
    :math:`r_{ij} \otimes (x_j + \mathbf{W}_m e_{ij}) \otimes r_{ij}^*`, with
    ``"target"`` it is :math:`r_{ij} \otimes x_j \otimes r_{ij}^* + \mathbf{W}_m e_{ij}`.

    Args:
        conv: the layer whose parameters are used.
        x, quat, pos, edge_attr: as in :meth:`QSVConv.forward`.
        edge_index: ``[2, E]`` plain edge indices (self-loops are added here when
            ``conv.add_self_loops`` is set, with ``conv.fill_value`` features).

    Returns:
        ``(out, alpha)``: the layer output and the ``[E, heads]`` attention weights
        in the order of the (possibly self-looped) edge list.
    """
    if isinstance(x, Tensor):
        x_src, x_dst = x, x
    else:
        x_src, x_dst = x
    H = conv.heads
    num_dst = x_dst.size(0) if x_dst is not None else quat[1].size(0)
    x_root = x_dst
    if conv.project_input:
        x_src, x_dst = conv._project_input(x_src, x_dst)
    q_src, q_dst = conv._node_quaternions(x_src, x_dst, quat, num_dst)
    x_feat = x_src
    x_src = conv.pad_source(x_src)
    C = x_src.size(-1) // H
    if edge_attr is not None and edge_attr.dim() == 1:
        edge_attr = edge_attr.view(-1, 1)
    if conv.add_self_loops:
        edge_index, edge_attr = with_self_loops_and_attr(edge_index, x_src, x_dst, None,
                                                         edge_attr, conv.fill_value)
    src, dst = edge_index
    E = src.numel()

    logits = torch.zeros(E, H, dtype=x_src.dtype, device=x_src.device)
    r = None
    if q_dst is not None:
        r = hamilton_product(conjugate(q_dst[dst]), q_src[src])  # [E, H, 4]
    if conv.routing == "learned":
        logits = conv.beta * r[..., 0]
    elif conv.routing == "abs":
        logits = conv.beta * r[..., 0].abs()
    elif conv.routing == "geometric":
        p_src, p_dst = (pos, pos) if isinstance(pos, Tensor) else pos
        d2 = ((p_dst[dst] - p_src[src]) ** 2).sum(-1, keepdim=True)
        logits = -conv.beta * d2
    if edge_attr is not None:  # a_edge^T W_e e_ij, one score per head
        logits = logits + edge_attr @ conv.lin_edge.weight.t()
    if conv.lin_source is not None:  # a_h^T x_j
        logits = logits + (x_feat @ conv.lin_source.weight.t())[src]

    alpha = torch.zeros_like(logits)
    for i in range(num_dst):
        mask = dst == i
        if mask.any():
            alpha[mask] = torch.softmax(logits[mask], dim=0)

    xj = x_src[src].view(E, H, C // 4, 4)
    emb = None
    if conv.edge_message and edge_attr is not None:
        emb = (edge_attr @ conv.lin_edge_msg.weight.t()).view(E, H, C // 4, 4)
    if emb is not None and conv.edge_message == "source":  # joins x_j before the transport
        xj = xj + emb
    if conv.transport == "sandwich":
        rr = r.unsqueeze(2)  # one rotation per edge and head, shared by its blocks
        xj = hamilton_product(hamilton_product(rr, xj), conjugate(rr))
    if emb is not None and conv.edge_message == "target":  # in the target's frame
        xj = xj + emb
    msg = alpha.view(E, H, 1, 1) * xj
    z = torch.zeros(num_dst, H, C // 4, 4, dtype=x_src.dtype, device=x_src.device)
    z = z.index_add(0, dst, msg).view(num_dst, H, C)

    out = torch.einsum("nhc,hcf->nhf", z, conv.weight)
    out = out.reshape(num_dst, -1) if conv.concat else out.mean(dim=1)
    if conv.lin_skip is not None and x_root is not None:
        out = out + conv.lin_skip(x_root)
    if conv.bias is not None:
        out = out + conv.bias
    return out, alpha
