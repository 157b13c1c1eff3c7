r"""Edge features and the other per-edge logit terms of :class:`~qsv_pyg.nn.QSVConv`.

As in :class:`~torch_geometric.nn.conv.GATConv`, ``edge_dim`` gives the layer
a bias-free per-head score of the edge features, :math:`(\mathbf{W}_e
e_{ij})_h` (``lin_edge``), added to the logit; the added self-loops'
features are ``fill_value``. ``edge_message`` also embeds the edge features
into the message, :math:`\mathbf{W}_m e_{ij}` (``lin_edge_msg``): joining
:math:`\mathbf{x}_j` before the transport (``"source"``, or :obj:`True`) or
added after it, in the target's frame (``"target"``: TransformerConv's edge
term), and ``source_logit`` adds GAT's
source half, :math:`a_h^\top \mathbf{x}_j` (``lin_source``).
:class:`EdgeFeaturesMixin` holds these maps' set-up, the check of
``edge_attr``, and their terms on both of the layer's paths: the operator's
additive logit and edge-message sum on the fast path, the score and embedding
that ``edge_update`` and ``message`` add on PyG's message passing.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from torch_geometric import is_compiling
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.typing import Adj, OptTensor, SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor

from ..quaternion import matrix_rotate_blocks, quaternion_to_matrix
from .checks import check_finite, check_float
from .qsv_kernel import distance_logits

#: ``edge_message`` values (besides :obj:`False`): the frame the embedding
#: :math:`\mathbf{W}_m e_{ij}` is written in. ``"source"`` (also :obj:`True`):
#: it joins :math:`\mathbf{x}_j` before the transport and is rotated with it
#: (per edge and channel: about as costly as materialising the messages).
#: ``"target"``: it is added to the transported message, in the target's frame,
#: so only :math:`\sum_j \alpha_{ij} e_{ij}` (``edge_dim`` numbers per target
#: and head) is aggregated.
EDGE_MESSAGES = ("source", "target")


def _weighted_row_sums(graph, weights: Tensor, e: Tensor, num_dst: int) -> Tensor:
    r""":math:`s_{i,h} = \sum_j w_{ij,h} e_{ij}` ``[num_dst, H, D]`` of the
    target-sorted edges' weights ``[E, H]`` and features ``[E, D]``.

    On CPU (eager) the rows are padded to the largest degree and summed by one
    batched matrix product, ``[N, H, k] @ [N, k, D]``, when the padding at most
    doubles the edges (kNN graphs): about a sixth of the time of the
    ``[E, H, D]`` products that :meth:`~torch.Tensor.index_add` sums, forward
    and backward. Elsewhere (CUDA: the largest degree would be a host sync;
    under :func:`torch.compile`; skewed degrees) it is that ``index_add``."""
    H, D = weights.size(1), e.size(1)
    E = e.size(0)
    if not weights.is_cuda and not is_compiling() and num_dst > 0 and E > 0:
        degree = graph.rowptr[1:] - graph.rowptr[:-1]
        k = int(degree.max())
        if num_dst * k <= 2 * E:
            slot = torch.arange(E, device=e.device) - graph.rowptr[graph.row]
            wp = weights.new_zeros(num_dst, k, H).index_put((graph.row, slot), weights)
            ep = e.new_zeros(num_dst, k, D).index_put((graph.row, slot), e)
            return torch.bmm(wp.transpose(1, 2), ep)
    return e.new_zeros(num_dst, H, D).index_add(0, graph.row,
                                                weights.view(-1, H, 1) * e.view(-1, 1, D))


class EdgeFeaturesMixin:
    """The edge features (``edge_dim``, ``fill_value``, ``edge_message``), the
    per-source score (``source_logit``) and the checked node positions of
    distance routing (:meth:`_positions`; their exact logit is the same additive
    term) of :class:`~qsv_pyg.nn.QSVConv`.

    The layer calls :meth:`_set_edge_options` with its arguments and
    :meth:`_make_edge_maps` once the source width is known; the maps are its
    ``lin_edge``, ``lin_edge_msg`` and ``lin_source`` submodules (None when
    off). The methods read the layer's ``heads``, ``routing``, ``beta``,
    ``_padded`` and ``_checks_finite``.
    """

    def _set_edge_options(self, edge_dim: Optional[int],
                          fill_value: Union[float, Tensor, str], edge_message: bool,
                          source_logit: bool) -> None:
        """Check and keep the edge options (no parameters yet)."""
        if edge_dim is not None and (isinstance(edge_dim, bool) or not isinstance(
                edge_dim, int) or (edge_dim < 1 and edge_dim != -1)):
            raise ValueError(f"edge_dim must be a positive integer, -1 (lazy) or None, "
                             f"got {edge_dim!r}")
        if edge_message is True:
            edge_message = "source"
        if edge_message is not False and edge_message is not None and \
                edge_message not in EDGE_MESSAGES:
            raise ValueError(f"edge_message must be False, True or one of {EDGE_MESSAGES}, "
                             f"got {edge_message!r}")
        edge_message = edge_message or False
        if edge_message and edge_dim is None:
            raise ValueError(f"edge_message={edge_message!r} embeds the edge features into "
                             f"the messages: it needs edge_dim")
        self.edge_dim = edge_dim
        self.fill_value = fill_value
        self.edge_message = edge_message
        self.source_logit = source_logit

    def _make_edge_maps(self, in_src: int) -> None:
        """The edge features' maps in the logit (GATConv's :math:`a_{edge}^\top
        W_e e_{ij}`, one score per head) and in the message (:math:`W_m e_{ij}`
        joins :math:`x_j` in the source's frame), and the per-source score
        :math:`a_h^\top x_j` (GAT's source half), of ``in_src`` source
        channels (after ``project_input``; -1 when lazy)."""
        heads, edge_dim = self.heads, self.edge_dim
        self.lin_edge = self.lin_edge_msg = self.lin_source = None
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, heads, bias=False, weight_initializer="glorot")
        if self.edge_message:
            if in_src < 1:
                raise ValueError("edge_message=True needs the source width: pass "
                                 "in_channels (not -1) or project_input=True")
            self.lin_edge_msg = Linear(edge_dim, self._padded(in_src), bias=False,
                                       weight_initializer="glorot")
        if self.source_logit:
            self.lin_source = Linear(in_src, heads, bias=False, weight_initializer="glorot")

    def _check_edge_attr(self, edge_attr: OptTensor, edge_index: Adj) -> OptTensor:
        """``edge_attr`` as ``[E, edge_dim]`` (a ``[E]`` vector is one feature),
        checked against the layer and the edges."""
        # isinstance, not `is not None`: under torch.fx tracing (to_hetero) an
        # unused optional input is a proxy.
        if not isinstance(edge_attr, Tensor):
            return None
        if self.lin_edge is None:
            raise ValueError("QSVConv received edge_attr but was built without edge_dim; "
                             "pass edge_dim=<number of edge features> (quaternions go "
                             "in quat=...)")
        check_float(edge_attr, "edge_attr")
        if edge_attr.dim() == 1:
            edge_attr = edge_attr.view(-1, 1)
        if edge_attr.dim() != 2:
            raise ValueError(f"QSVConv: edge_attr must have shape [num_edges, edge_dim] "
                             f"or [num_edges], got {tuple(edge_attr.shape)} (quaternions "
                             f"go in quat=...)")
        if self.edge_dim != -1 and edge_attr.size(1) != self.edge_dim:
            raise ValueError(f"QSVConv: edge_attr has {edge_attr.size(1)} features per "
                             f"edge but edge_dim={self.edge_dim}")
        if isinstance(edge_index, SparseTensor):
            num_edges = edge_index.nnz()
        elif is_torch_sparse_tensor(edge_index):
            num_edges = edge_index._nnz()
        else:
            num_edges = edge_index.size(1)
        if edge_attr.size(0) != num_edges:
            raise ValueError(f"QSVConv: edge_attr has {edge_attr.size(0)} rows but there "
                             f"are {num_edges} edges")
        if self._checks_finite(edge_attr):
            check_finite(edge_attr, "edge features (edge_attr)")
        return edge_attr


    # -------------------------------------------------------------- fast path
    def _edge_logit(self, graph, base_perm: Tensor, copies: int,
                    pos: Tuple[OptTensor, OptTensor], edge_attr: OptTensor,
                    src_score: OptTensor) -> OptTensor:
        """The operator's additive logit term ``[E, H]`` in ``graph``'s
        target-sorted order (``copies`` copies of the base graph, whose sorted
        edges are ``base_perm``), or None: the edge features' score
        ``lin_edge(e_ij)``, the source score ``a_h^T x_j`` gathered per edge, and
        distance routing's :math:`-\beta |p_i - p_j|^2` (exact wherever the
        positions sit)."""
        terms = []
        if edge_attr is not None:
            assert self.lin_edge is not None
            t = self.lin_edge(edge_attr)[base_perm]  # [E, H]: map first, then gather
            terms.append(t.repeat(copies, 1) if copies > 1 else t)
        if src_score is not None:
            terms.append(src_score.reshape(-1, self.heads)[graph.col])
        if self.routing == "geometric":  # positions are shared by the copies
            assert pos[0] is not None and pos[1] is not None
            E = base_perm.numel()  # copy 0's sorted edges come first, not offset
            t = distance_logits(pos[1][graph.row[:E]], pos[0][graph.col[:E]], self.beta)
            terms.append(t.repeat(copies, 1) if copies > 1 else t)
        if not terms:
            return None
        out = terms[0]
        for t in terms[1:]:
            out = out + t
        return out

    def _edge_message_sum(self, graph, base_perm: Tensor, copies: int, edge_attr: Tensor,
                          weights: Tensor, q_src: OptTensor, q_dst: OptTensor,
                          num_dst: int, C: int) -> Tensor:
        r"""The edge features' part of the aggregate ``[N_dst', H, C / 4, 4]``:
        :math:`Q_i^\top \sum_j \alpha_{ij} Q_j \mathbf{W}_m e_{ij}` with
        ``edge_message="source"`` (the embedding joins :math:`x_j` in the
        source's frame, so the transport rotates it as the message), or
        :math:`\mathbf{W}_m \sum_j \alpha_{ij} e_{ij}` with ``"target"`` (per
        head; only the ``edge_dim`` features are aggregated): PyTorch ops around
        the operator, in float32 (as the operator), differentiable through the
        weights."""
        assert self.lin_edge_msg is not None
        H = self.heads
        if self.edge_message == "target":
            dt = weights.dtype
            with torch.autocast(weights.device.type, enabled=False):
                e = edge_attr.to(dt)[base_perm]
                if copies > 1:
                    e = e.repeat(copies, 1)
                s = _weighted_row_sums(graph, weights, e, num_dst)
                w = self.lin_edge_msg.weight.to(dt).view(H, C, e.size(1))
                y = torch.einsum("nhd,hcd->nhc", s, w)
            return y.view(num_dst, H, C // 4, 4)
        emb = self.lin_edge_msg(edge_attr[base_perm])
        if copies > 1:
            emb = emb.repeat(copies, 1)
        dt = weights.dtype
        with torch.autocast(weights.device.type, enabled=False):
            w = emb.to(dt).view(-1, H, C // 4, 4)
            if q_src is not None:
                w = matrix_rotate_blocks(quaternion_to_matrix(q_src.to(dt)[graph.col]), w)
            y = w.new_zeros(num_dst, H, C // 4, 4).index_add(
                0, graph.row, weights.view(-1, H, 1, 1) * w)
            if q_dst is not None:
                y = matrix_rotate_blocks(quaternion_to_matrix(q_dst.to(dt)).transpose(-1, -2),
                                         y)
        return y


    # ------------------------------------------------------- message passing
    def _add_edge_scores(self, logits: Tensor, edge_attr: OptTensor,
                         s_j: OptTensor) -> Tensor:
        """``edge_update``'s logits plus the edge features' score and the
        source score."""
        # A SparseTensor's values arrive as edge_attr too; without edge_dim they
        # are not edge features (as in GATConv).
        if edge_attr is not None and self.lin_edge is not None:
            logits = logits + self.lin_edge(edge_attr.view(-1, 1) if edge_attr.dim() == 1
                                            else edge_attr)
        if s_j is not None:
            logits = logits + s_j
        return logits

    def _with_edge_embedding(self, x_j: Tensor, edge_attr: OptTensor,
                             rot_j: OptTensor) -> Tensor:
        """``message``'s source features plus the edge embedding
        :math:`W_m e_{ij}` (with ``edge_message``), rotated by ``rot_j``: the
        source's rotation (``"source"``: it joins :math:`x_j` in the source's
        frame, rotated by :math:`q_j` as :math:`x_j` was) or the target's
        (``"target"``: the aggregate's final :math:`Q_i^\top` undoes it)."""
        if self.lin_edge_msg is not None and edge_attr is not None:
            emb = self.lin_edge_msg(edge_attr.view(-1, 1) if edge_attr.dim() == 1
                                    else edge_attr)
            emb = emb.view(*x_j.shape[:-1], -1, 4)
            if rot_j is not None:
                emb = matrix_rotate_blocks(rot_j, emb)
            x_j = x_j + emb.reshape(x_j.shape)
        return x_j

    def _positions(self, pos, num_src: int, num_dst: int) -> Tuple[OptTensor, OptTensor]:
        """The checked ``(source, target)`` positions for geometric routing."""
        if self.routing != "geometric":
            return None, None
        if pos is None:
            raise ValueError("routing='geometric' needs node positions: pass pos")
        pair = (pos, pos) if isinstance(pos, Tensor) else (pos[0], pos[1])
        if pair[0] is None or pair[1] is None:
            raise ValueError("routing='geometric' needs positions of source and "
                             "target nodes")
        for t, rows, side in ((pair[0], num_src, "source"), (pair[1], num_dst, "target")):
            name = f"pos ({side})"
            check_float(t, name)
            if t.dim() != 2:
                raise ValueError(f"QSVConv: {name} must have shape [num_nodes, dim], "
                                 f"got {tuple(t.shape)}")
            if t.size(0) != rows:
                raise ValueError(f"QSVConv: {name} has {t.size(0)} rows but there are "
                                 f"{rows} {side} nodes")
            if self._checks_finite(t):
                check_finite(t, f"{side} positions (pos)")
        return pair
