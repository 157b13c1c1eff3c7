r"""PyG message passing in :class:`~qsv_pyg.nn.QSVConv`.

The path for what the fused operator does not do (``fused_path="never"``,
sparse adjacencies, explainers, PyG's message-passing hooks:
:meth:`~qsv_pyg.nn.fused_path.FusedPathMixin.path_reason`): the literal
softmax of PyG's ``edge_updater`` and ``propagate``, with the transport
factorised as on the fused path (every source rotated once by :math:`q_j`,
every target's sum rotated back once by :math:`q_i^*`). PyG finds the hooks
``edge_update`` and ``message`` on the layer through its class (the
inherited methods, and the ``self.propagate`` / ``self.edge_updater`` calls
here, which its code generation reads through the class's bases).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_geometric.typing import Adj, OptTensor
from torch_geometric.utils import is_torch_sparse_tensor, softmax

from ..quaternion import matrix_rotate_blocks, quaternion_to_matrix
from .graph_cache import cached_batch_edge_index
from .fused_path import flat_batch
from .qsv_kernel import distance_logits, routing_logits


class MessagePathMixin:
    """PyG message passing for :class:`~qsv_pyg.nn.QSVConv`
    (:meth:`_message_passing` and PyG's hooks ``edge_update`` and
    ``message``).

    The methods read the layer's ``heads``, ``routing``, ``transport``,
    ``dropout``, ``edge_message`` and ``beta``, PyG's ``propagate`` and
    ``edge_updater``, and the message-passing terms of
    :class:`~qsv_pyg.nn.edge_features.EdgeFeaturesMixin`
    (``_add_edge_scores``, ``_with_edge_embedding``).
    """

    def _message_passing(self, x: Tensor, q_src: Tensor, q_dst: OptTensor,
                         pos: Tuple[OptTensor, OptTensor], edge_index: Adj, num_dst: int,
                         edge_attr: OptTensor = None, src_score: OptTensor = None
                         ) -> Tuple[Tensor, Tensor]:
        """PyG's ``propagate``; returns ``z [*, N_dst, H, C]`` and alpha. A
        ``[B, N, C]`` batch runs over ``B`` disjoint copies of the graph."""
        H = self.heads
        C = x.size(-1) // H
        # PyG's ops take one dtype: a half-precision layer (no autocast) passes
        # messages in its own dtype, as it always did (the unit quaternions are
        # float32; the fast path keeps them so).
        if q_src.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            same = q_dst is q_src
            q_src = q_src.to(x.dtype)
            q_dst = q_src if same else (None if q_dst is None else q_dst.to(x.dtype))
        rot_src = rot_dst = None
        if self.transport == "sandwich":
            assert q_dst is not None
            rot_src = quaternion_to_matrix(q_src)
            rot_dst = rot_src if q_dst is q_src else quaternion_to_matrix(q_dst)
        # Rotate each source once by q_j (the first half of the factorised
        # sandwich); messages are then plain weighted sums.
        lead = x.shape[:-1]  # (N,) or (B, N)
        v = x.view(*lead, H, C // 4, 4)
        if rot_src is not None:
            v = matrix_rotate_blocks(rot_src, v)
        v = v.reshape(*lead, H, C)
        # The message's edge embedding is rotated in message(): by q_j when it is
        # written in the source's frame, by q_i in the target's (the final
        # rotation by q_i^* below then leaves it as it is).
        side = 0 if self.edge_message == "source" else 1
        rot_msg = (rot_src, rot_dst)[side] if self.edge_message else None

        def rot_pair(r: OptTensor) -> Tuple[OptTensor, OptTensor]:
            return (r, None) if side == 0 else (None, r)
        if x.dim() == 2:
            size = (x.size(0), num_dst)
            alpha = self.edge_updater(edge_index, q=(q_src, q_dst), pos=pos,
                                      edge_attr=edge_attr, s=(src_score, None), size=size)
            z = self.propagate(edge_index, x=(v, None), alpha=alpha, edge_attr=edge_attr,
                               rot=rot_pair(rot_msg), size=size)
        else:
            if not isinstance(edge_index, Tensor) or is_torch_sparse_tensor(edge_index):
                raise ValueError("batched [B, N, C] inputs need a plain [2, E] edge_index")
            B, n_src = v.size(0), v.size(1)
            flat_index = cached_batch_edge_index(edge_index, B, n_src, num_dst)
            size = (B * n_src, B * num_dst)
            flat_attr = None if edge_attr is None else edge_attr.repeat(B, 1)
            flat_score = None if src_score is None else src_score.reshape(B * n_src, H)
            if rot_msg is not None:
                n = (n_src, num_dst)[side]
                rot_msg = rot_msg.reshape(B * n, H, 3, 3) if rot_msg.dim() == 5 else \
                    rot_msg.unsqueeze(0).expand(B, *rot_msg.shape).reshape(B * n, H, 3, 3)
            alpha = self.edge_updater(
                flat_index, q=(flat_batch(q_src, B), flat_batch(q_dst, B)),
                pos=(flat_batch(pos[0], B), flat_batch(pos[1], B)), edge_attr=flat_attr,
                s=(flat_score, None), size=size)
            z = self.propagate(flat_index, x=(v.reshape(B * n_src, H, C), None),
                               alpha=alpha, edge_attr=flat_attr,
                               rot=rot_pair(rot_msg), size=size)
            z, alpha = z.view(B, num_dst, H, C), alpha.view(B, -1, H)
        if rot_dst is not None:
            z = matrix_rotate_blocks(rot_dst.transpose(-1, -2),
                                     z.view(*z.shape[:-1], C // 4, 4))
            z = z.reshape(*z.shape[:-2], C)
        return z, alpha

    def edge_update(self, q_i: OptTensor, q_j: OptTensor, pos_i: OptTensor,
                    pos_j: OptTensor, edge_attr: OptTensor, s_j: OptTensor, index: Tensor,
                    ptr: OptTensor, dim_size: Optional[int]) -> Tensor:
        if self.routing == "uniform":  # equal logits: the softmax gives 1 / deg
            ref = q_j if q_j is not None else pos_j
            if ref is None:
                ref = s_j if s_j is not None else edge_attr
            assert ref is not None
            logits = ref.new_zeros(index.numel(), self.heads)
        elif self.routing == "geometric":
            assert pos_i is not None and pos_j is not None
            logits = distance_logits(pos_i, pos_j, self.beta)
        else:
            assert q_i is not None and q_j is not None
            logits, _ = routing_logits(q_i, q_j, self.beta, self.routing == "abs")
        logits = self._add_edge_scores(logits, edge_attr, s_j)
        if index.numel() == 0:
            return logits
        alpha = softmax(logits, index, ptr, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor, edge_attr: OptTensor,
                rot_j: OptTensor, rot_i: OptTensor) -> Tensor:
        rot = rot_j if rot_i is None else rot_i  # at most one is given
        return alpha.unsqueeze(-1) * self._with_edge_embedding(x_j, edge_attr, rot)
