r"""The fused path of :class:`~qsv_pyg.nn.QSVConv` and the choice of path.

Every call that the registered operator can take runs as one
:func:`~qsv_pyg.nn.qsv_kernel.qsv_attend` over the graph's cached
target-sorted CSR (:mod:`qsv_pyg.nn.csr`, cached by :mod:`qsv_pyg.nn.graph_cache`): the rotations, the softmax, the
weighted sum and attention dropout (a per-edge mask the operator multiplies
into the weights). :class:`FusedPathMixin` holds the choice between it and
PyG's message passing (:mod:`qsv_pyg.nn.message_path`), ``choose_path`` /
``path_reason`` with their vocabulary (:data:`PATHS`, the ``fused_path``
option), and the call laid out for the operator: the routing keys, the
per-item batch copies, the dropout mask, the edge terms of
:class:`~qsv_pyg.nn.edge_features.EdgeFeaturesMixin` in sorted edge order.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from torch_geometric.typing import Adj, OptTensor
from torch_geometric.utils import is_torch_sparse_tensor

from . import fused_layer
from .checks import check_option
from .graph_cache import graph_csr
from .qsv_kernel import qsv_attend

#: The values of ``fused_path``.
FUSED_PATHS = ("auto", "never")
#: The values of ``dense_path``, ``fused_path``'s deprecated name: ``"always"``
#: is a deprecated synonym of ``"auto"`` (:func:`_from_dense_path`).
DENSE_PATHS = ("auto", "always", "never")


def _fused_path(value: str) -> str:
    """``value`` if ``fused_path`` takes it, else a ValueError."""
    if value == "always":
        raise ValueError("fused_path='always' is not supported: 'auto' takes the fused "
                         "path whenever the call allows ('always' was a deprecated "
                         "synonym of 'auto' under the old name dense_path)")
    return check_option("fused_path", value, FUSED_PATHS)


def _from_dense_path(value: str, stacklevel: int = 3) -> str:
    """The ``fused_path`` of an old ``dense_path`` value, with a
    DeprecationWarning (``"always"`` is read as ``"auto"``)."""
    check_option("dense_path", value, DENSE_PATHS)
    note = "; its value 'always' is 'auto'" if value == "always" else ""
    warnings.warn(f"QSVConv: dense_path is deprecated, use fused_path{note}",
                  DeprecationWarning, stacklevel=stacklevel)
    return "auto" if value == "always" else value


#: The aggregations of :meth:`QSVConv.choose_path`.
PATHS = ("attend_shared", "attend_per_item", "message_passing")
#: QSVConv's ``routing`` values; each gets its logit in :meth:`FusedPathMixin._routing_keys`
#: (keys, or the additive term of :meth:`~qsv_pyg.nn.edge_features.EdgeFeaturesMixin._edge_logit`).
ROUTINGS = ("learned", "abs", "uniform", "geometric")
# PyG's per-step hooks, which only message passing runs. PyG registers them
# through public methods (``register_message_forward_hook`` ...) but has no
# public way to ask for them: these are the dictionaries those methods fill
# (tests/test_dispatch.py registers one of each kind).
_PYG_HOOKS = tuple(f"_{step}_forward{kind}_hooks" for step in (
    "propagate", "message", "aggregate", "message_and_aggregate", "edge_update")
    for kind in ("_pre", ""))


def flat_batch(t: OptTensor, batch: int) -> OptTensor:
    """Per-item ``[B, N, H, *]`` (4-D) or shared ``[N, *]`` -> ``[B * N, *]``:
    node rows of ``batch`` disjoint copies of a graph."""
    if t is None:
        return None
    t = t if t.dim() == 4 else t.unsqueeze(0).expand(batch, *t.shape)
    return t.reshape(batch * t.size(1), *t.shape[2:])


class FusedPathMixin:
    """The choice of path and the fused path of :class:`~qsv_pyg.nn.QSVConv`.

    ``forward`` asks :meth:`choose_path` and, unless it says
    ``"message_passing"``, calls :meth:`_attend`. The methods read the
    layer's options (``fused_path``, whose deprecated name is the
    ``dense_path`` property here, ``heads``, ``routing``, ``transport``,
    ``dropout``, ``source_logit``, ``edge_message``), ``beta``, PyG's
    ``explain`` and hook dictionaries, and the edge terms of
    :class:`~qsv_pyg.nn.edge_features.EdgeFeaturesMixin` (``_edge_logit``,
    ``_edge_message_sum``).
    """

    @property
    def dense_path(self) -> str:
        """Deprecated name of ``fused_path`` (with a DeprecationWarning)."""
        warnings.warn("QSVConv: dense_path is deprecated, use fused_path",
                      DeprecationWarning, stacklevel=2)
        return self.fused_path

    @dense_path.setter
    def dense_path(self, value: str) -> None:
        self.fused_path = _from_dense_path(value, stacklevel=4)  # via Module.__setattr__

    def choose_path(self, x_src: Tensor, q_src: OptTensor, edge_index: Adj) -> str:
        """How one call aggregates, one of :data:`PATHS` (:meth:`path_reason`
        says why).

        Args:
            x_src: source features ``[N, C]`` or ``[B, N, C]``.
            q_src: the unit source quaternions (``[N, H, 4]`` shared by a batch,
                ``[B, N, H, 4]`` per item) or :obj:`None`.
            edge_index: the adjacency as passed to the layer.
        """
        return self.path_reason(x_src, q_src, edge_index)[0]

    def path_reason(self, x_src: Tensor, q_src: OptTensor, edge_index: Adj
                    ) -> Tuple[str, str]:
        """:meth:`choose_path`'s path and its reason, in words.

        ``"message_passing"`` (PyG's ``propagate``, the literal softmax) for what
        the operator does not do: ``fused_path="never"``, sparse adjacencies,
        explainers (PyG's public ``explain``) and PyG's message-passing hooks.
        Else the operator: ``"attend_per_item"`` over ``B`` disjoint copies of
        the graph when a ``[B, N, C]`` input's weights differ per item (feature
        quaternions, or attention dropout: every item draws its own mask),
        ``"attend_shared"`` over the graph with one set of weights for the call
        (2-D input, or a shared field: the batch rides along as channels).
        The operator's implementation is
        :func:`qsv_pyg.nn.qsv_kernel.backend`'s choice.
        """
        if self.fused_path == "never":
            return "message_passing", "fused_path='never'"
        if not isinstance(edge_index, Tensor) or is_torch_sparse_tensor(edge_index):
            return "message_passing", "a sparse adjacency (SparseTensor or torch.sparse)"
        if self.explain:
            return "message_passing", "an explainer (explain=True) reads the messages"
        for hooks in _PYG_HOOKS:
            if getattr(self, hooks):
                return "message_passing", f"a hook of PyG's message passing ({hooks})"
        if x_src.dim() == 3 and q_src is not None and q_src.dim() == 4:
            return "attend_per_item", "[B, N, C] input with per-item quaternions"
        if x_src.dim() == 3 and self._drops_attention():
            return "attend_per_item", "[B, N, C] input with attention dropout per item"
        if x_src.dim() == 3 and self.source_logit:
            return "attend_per_item", "[B, N, C] input with a per-source logit per item"
        return "attend_shared", "one routing for the call (2-D input or a shared field)"

    def _drops_attention(self) -> bool:
        return self.training and self.dropout > 0

    def fused_layer_reason(self, x, edge_index: Adj, edge_attr: OptTensor = None, quat=None,
                           pos=None, size=None) -> Optional[str]:
        """Why a call does not run as the one operator of the whole layer,
        ``qsv_pyg::attend_layer`` (:mod:`qsv_pyg.nn.fused_layer`: 10 launches per
        forward+backward on the Triton path instead of 26), or :obj:`None` when it
        does. It takes the default layer on the Triton path: feature quaternions,
        learned routing, the sandwich transport, root weight and bias, the heads
        concatenated or averaged, 2-D float32/float64 input (float32 under
        autocast) of any width over a homogeneous graph that :meth:`choose_path`
        gives the operator, attention dropout included; no edge terms, no
        finiteness check. Everything else composes ``qsv_pyg::attend`` with the
        layer's own ops (the same result)."""
        from torch.nn.parameter import UninitializedParameter
        if not isinstance(x, Tensor):
            return "bipartite input"
        why = fused_layer.unavailable(x)  # first: off the Triton path this is all
        if why is not None:
            return why
        checks = (
            (x.dim() != 2, "batched [B, N, C] input"),
            (quat is not None or pos is not None or size is not None,
             "quat, pos or size given"),
            (self.quat_source not in ("auto", "features") or self.lin_quat is None,
             f"quat_source={self.quat_source!r}"),
            (self.routing != "learned" or self.transport != "sandwich",
             "routing or transport other than learned / sandwich"),
            (self.project_input or self.edge_dim is not None or self.source_logit
             or bool(self.edge_message) or edge_attr is not None,
             "input projection or edge terms"),
            (self.lin_skip is None or self.bias is None, "no root weight or no bias"),
            (self.add_self_loops, "add_self_loops=True"),
        )
        for failed, why in checks:
            if failed:
                return why
        if any(isinstance(p, UninitializedParameter)
               for p in (self.weight, self.lin_quat.weight, self.lin_skip.weight)):
            return "a lazy layer before its first call"
        if x.size(0) == 0:
            return "no nodes"
        if self._padded(x.size(1)) != self.weight.size(0) * self.weight.size(1) or \
                x.size(1) != self.lin_quat.weight.size(1):
            return "features of another width than the layer's (the composed path says why)"
        if self._checks_finite(x):
            return "check_finite (checked on the composed path)"
        if any(p.dtype != x.dtype for p in (self.weight, self.lin_quat.weight,
                                              self.lin_skip.weight, self.bias)):
            return "parameters of another dtype than the features"
        path, why = self.path_reason(x, None, edge_index)
        if path != "attend_shared":
            return why
        return fused_layer.too_wide(x, self.heads, self.out_channels, self.concat)

    def _attend_layer(self, x: Tensor, edge_index: Tensor, want_alpha: bool):
        """The whole layer as ``qsv_pyg::attend_layer`` (see
        :meth:`fused_layer_reason`); with ``want_alpha`` also ``(edge_index,
        alpha)``, the weights in the order of ``edge_index``."""
        n = x.size(0)
        graph = graph_csr(edge_index, n, n)
        mask = self._dropout_mask(graph.col.numel(), x)
        # A float32 operator (under autocast too: its inputs are float32 already)
        with torch.autocast(x.device.type, enabled=False):
            out, alpha = fused_layer.qsv_attend_layer(
                x, self.lin_quat.weight, self.lin_quat.bias, self.lin_skip.weight, self.bias,
                self.weight, self.log_beta, graph, edge_scale=mask, concat=self.concat)
        if want_alpha:  # in edge order, the weights used, as GATConv returns them
            used = alpha if mask is None else alpha * mask
            return out, (edge_index, torch.empty_like(used).index_copy_(0, graph.perm, used))
        return out


    def _routing_keys(self, q_src: Tensor, q_dst: OptTensor, num_src: int, num_dst: int,
                      ref: Tensor) -> Tuple[Tensor, Tensor]:
        """Routing keys ``[*, N, H, D]`` of the operator (``logit = beta *
        <k_i, k_j>``, :func:`~qsv_pyg.nn.qsv_kernel.routing_logits`): the
        quaternions for learned routing, none (``D = 0``) for uniform and
        geometric routing (whose logit is the additive term,
        :meth:`_edge_logit`)."""
        if self.routing in ("learned", "abs"):
            assert q_dst is not None
            return q_src, q_dst  # Re(q_i* q_j) = <q_i, q_j>
        return ref.new_empty(num_src, self.heads, 0), ref.new_empty(num_dst, self.heads, 0)

    def _attend(self, path: str, x: Tensor, q_src: Tensor, q_dst: OptTensor,
                pos: Tuple[OptTensor, OptTensor], edge_index: Tensor, num_dst: int,
                want_alpha: bool = True, edge_attr: OptTensor = None,
                src_score: OptTensor = None) -> Tuple[Tensor, Tensor, int]:
        """Aggregate by the registered operator; returns ``(z_h [H, M, C], alpha,
        b)``, rows node-major ``(n, b)`` when ``b > 0`` (:meth:`_project`).
        ``alpha`` is in the order of ``edge_index`` when ``want_alpha``, else in
        the graph's target-sorted order (not reordered: nobody reads it)."""
        H = self.heads
        C = x.size(-1) // H
        n_src = x.size(-2)
        rotate = self.transport == "sandwich"
        use_abs = self.routing == "abs"
        B = x.size(0) if x.dim() == 3 else 1
        per_item = path == "attend_per_item"
        # An EdgeIndex's CSR comes from its own cached CSC / CSR, a plain
        # tensor's from the process-wide cache (qsv_pyg.nn.graph_cache.graph_csr).
        graph = graph_csr(edge_index, n_src, num_dst, batch=B if per_item else 0)
        copies = B if per_item else 1
        # The base graph's sorted edges: the first copy's (batch_csr keeps copy 0's
        # perm as it is), in the order of edge_attr.
        base_perm = graph.perm[:edge_index.size(1)] if per_item else graph.perm
        if per_item:
            q_s = flat_batch(q_src, B) if rotate else None
            q_d = flat_batch(q_dst, B) if rotate else None
        else:
            q_s = q_src if rotate else None
            q_d = q_dst if rotate else None
        k_src, k_dst = self._routing_keys(q_src, q_dst, n_src, num_dst, x)
        if per_item:
            k_src, k_dst = flat_batch(k_src, B), flat_batch(k_dst, B)
        logit = self._edge_logit(graph, base_perm, copies, pos, edge_attr, src_score)
        mask = self._dropout_mask(graph.col.numel(), x)
        if per_item:
            v = x.reshape(B * n_src, H, C // 4, 4)
        else:  # [N, H, B * C / 4, 4]: the batch rides along as more blocks of each row.
            v = x.view(B, n_src, H, C // 4, 4).permute(1, 2, 0, 3, 4).reshape(
                n_src, H, B * C // 4, 4)
        z, alpha = qsv_attend(v, q_s, q_d, k_src, k_dst, self.beta, graph, use_abs,
                              edge_scale=mask, edge_logit=logit)
        used = alpha if mask is None else alpha * mask.to(alpha.dtype)  # the weights used
        if self.edge_message and edge_attr is not None:
            extra = self._edge_message_sum(graph, base_perm, copies, edge_attr, used, q_s,
                                           q_d, copies * num_dst, C)
            if per_item:
                z = z + extra.to(z.dtype)
            else:
                z = (z.view(num_dst, H, B, C // 4, 4) + extra.to(z.dtype).unsqueeze(2)
                     ).view(z.shape)
        if want_alpha:  # in edge order, the weights used, as GATConv returns them
            alpha = torch.empty_like(used).index_copy_(0, graph.perm, used)
        if per_item:
            return z.view(B * num_dst, H, C).transpose(0, 1), alpha.view(B, -1, H), 0
        z_h = z.view(num_dst, H, B * C).transpose(0, 1).reshape(H, num_dst * B, C)
        if x.dim() == 3:
            return z_h, alpha.expand(B, -1, -1), B
        return z_h, alpha, 0

    def _dropout_mask(self, num_edges: int, ref: Tensor) -> OptTensor:
        """Attention dropout's ``[E, H]`` edge scale (0 or ``1 / (1 - p)``, as
        :func:`torch.nn.functional.dropout` draws it), or None when not dropping."""
        if not self._drops_attention():
            return None
        keep = 1.0 - self.dropout
        dt = torch.promote_types(ref.dtype, torch.float32)
        mask = torch.empty(num_edges, self.heads, dtype=dt, device=ref.device)
        return mask.bernoulli_(keep).div_(keep)
