"""``QSV``: a PyG ``BasicGNN`` of :class:`~qsv_pyg.nn.QSVConv` layers."""
from __future__ import annotations

import numbers
from typing import Final, List, Optional, Tuple, Union

import torch
import torch.fx
from torch import Tensor
from torch.nn import Parameter

from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.models.basic_gnn import BasicGNN
from torch_geometric.typing import Adj, OptTensor

from ..qsv_conv import QSVConv
from ..quat_sources import QUAT_SOURCES_OF, conv_quat_source, resolve_quat_source

#: Where the model's node quaternions come from (see :class:`QSV`).
MODEL_QUAT_SOURCES = QUAT_SOURCES_OF["QSV"]


def _check_positive_int(name: str, value: object) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class _LayerInputs:
    """The node-wise inputs of one :meth:`QSV.forward` call that PyG's
    :meth:`BasicGNN.forward` does not pass to its layers (it calls
    ``conv(x, edge_index, edge_attr=...)``): the quaternions and positions of
    all nodes, set by :meth:`QSV.forward` for the duration of the call.

    As a forward pre-hook of each :class:`QSVConv` it adds them as ``quat`` /
    ``pos``, sliced to the layer's node count (``x.size(0)``: after trimming
    by ``num_sampled_nodes_per_hop`` the nodes are a prefix); outside a
    :meth:`QSV.forward` call (both :obj:`None`, e.g. a layer called on its
    own or by ``inference_per_layer``) it adds nothing, and it never replaces
    a ``quat`` / ``pos`` the caller passed."""
    def __init__(self):
        self.quat: OptTensor = None
        self.pos: OptTensor = None

    def __call__(self, conv, args: tuple, kwargs: dict):
        if self.quat is None and self.pos is None:
            return None
        n = args[0].size(0) if args else kwargs["x"].size(0)
        if self.quat is not None and kwargs.get("quat") is None:
            kwargs["quat"] = self.quat[:n]
        if self.pos is not None and kwargs.get("pos") is None:
            kwargs["pos"] = self.pos[:n]
        return args, kwargs


class QSV(BasicGNN):
    r"""A stack of :class:`~qsv_pyg.nn.QSVConv` layers with the signature and
    behaviour of PyG's :class:`~torch_geometric.nn.models.GAT`: ``jk``,
    ``norm``, ``act``, ``dropout`` (also applied to the attention coefficients,
    as in ``GAT``), a final linear map with ``jk``, and averaged heads in a last
    layer that maps to ``out_channels``.

    Widths need not be multiples of ``4 * heads``: each :class:`QSVConv`
    accepts any input width (also :obj:`-1`, lazy) and zero-pads it to whole
    blocks of four per head (the padding fills the last head's last blocks).
    ``hidden_channels`` must only be divisible by ``heads`` (each head outputs
    ``hidden_channels // heads`` channels, as in ``GAT``); a multiple of
    ``4 * heads`` avoids padding in the hidden layers.

    Args:
        in_channels (int): Size of each input sample, or :obj:`-1` to derive it
            from the first input.
        hidden_channels (int): Size of each hidden sample.
        num_layers (int): Number of message passing layers.
        out_channels (int, optional): If set, the last layer (or, with ``jk``,
            a final linear map) outputs this many channels.
            (default: :obj:`None`)
        quat_source (str, optional): Where the node quaternions come from
            (``QUAT_SOURCES_OF["QSV"]`` of :mod:`qsv_pyg.nn.quat_sources`).
            ``"features"``: every layer maps its input features to quaternions
            (inductive; any graph). ``"field"``: one learned quaternion per node
            and head, shared by the layers (transductive: needs ``num_nodes``
            and the same node set at every call, or ``node_id``).
            ``"given"``: the ``quat`` argument of :meth:`forward` (e.g. from
            geometry, :func:`qsv_pyg.geometry.frame_quaternions`), used by every
            layer. ``"composed"``: ``quat ⊗ q(x)``, the given quaternions
            composed with each layer's feature quaternions.
            (default: :obj:`"features"`)
        num_nodes (int, optional): Number of nodes of the field
            (``quat_source="field"`` only). (default: :obj:`None`)
        heads (int, optional): Number of quaternions (attention heads) per node.
            (default: :obj:`1`)
        concat (bool, optional): Concatenate the heads' outputs in the hidden
            layers (else average). (default: :obj:`True`)
        routing (str, optional): Routing of every layer, see
            :class:`~qsv_pyg.nn.QSVConv`; ``"geometric"`` needs ``pos`` in
            :meth:`forward`. (default: :obj:`"learned"`)
        transport (str, optional): ``"sandwich"`` or ``"identity"``.
            (default: :obj:`"sandwich"`)
        dropout (float, optional): Dropout probability of the node features
            (and of the attention coefficients, as in ``GAT``, unless
            ``attention_dropout`` is given). (default: :obj:`0.`)
        attention_dropout (float, optional): Dropout probability of the
            attention coefficients; :obj:`None` means ``dropout``. (It runs on
            :class:`~qsv_pyg.nn.QSVConv`'s fused kernels, as a per-edge mask.)
            (default: :obj:`None`)
        act, act_first, act_kwargs, norm, norm_kwargs, jk: As in
            :class:`~torch_geometric.nn.models.basic_gnn.BasicGNN`.
        **kwargs (optional): Additional arguments of
            :class:`~qsv_pyg.nn.QSVConv` (``add_self_loops``, ``root_weight``,
            ``project_input``, ``beta_init``, ``learn_beta``, ``fused_path``,
            ``edge_dim``, ``fill_value``, ``edge_message``, ``source_logit``, ...).
            With ``edge_dim`` every layer takes the edge features ``edge_attr``
            of :meth:`forward` (as PyG's ``GAT`` with ``edge_dim``).

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})`, edge indices
          :math:`(2, |\mathcal{E}|)`, quaternions *(given/composed)*
          :math:`(|\mathcal{V}|, 4)` or :math:`(|\mathcal{V}|, H, 4)`,
          edge features *(optional, with edge_dim)* :math:`(|\mathcal{E}|, D)`,
          positions *(geometric routing)* :math:`(|\mathcal{V}|, D)`
        - **output:** :math:`(|\mathcal{V}|, F_{out})`
    """
    supports_edge_weight: Final[bool] = False
    supports_edge_attr: Final[bool] = True
    supports_norm_batch: Final[bool]

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        num_layers: int,
        out_channels: Optional[int] = None,
        quat_source: str = "features",
        num_nodes: Optional[int] = None,
        attention_dropout: Optional[float] = None,
        **kwargs,
    ):
        quat_source = resolve_quat_source(quat_source, "QSV")
        if isinstance(in_channels, (tuple, list)):
            raise ValueError("QSV takes an int in_channels; for bipartite graphs use "
                             "QSVConv directly")
        if quat_source == "field":
            if num_nodes is None or num_nodes < 1:
                raise ValueError("quat_source='field' needs num_nodes, the number of "
                                 "nodes carrying a learned quaternion")
        elif num_nodes is not None:
            raise ValueError(f"num_nodes is only used by quat_source='field', not "
                             f"{quat_source!r}")
        # Checked here, not in QSVConv: the model divides hidden_channels by heads
        # (init_conv) and BasicGNN builds num_layers layers before any conv sees them.
        _check_positive_int("hidden_channels", hidden_channels)
        _check_positive_int("num_layers", num_layers)
        if out_channels is not None:
            _check_positive_int("out_channels", out_channels)
        _check_positive_int("heads", kwargs.get("heads", 1))
        self.quat_source = quat_source
        self.num_nodes = num_nodes
        self.attention_dropout = attention_dropout
        super().__init__(in_channels, hidden_channels, num_layers, out_channels,
                         **kwargs)
        heads = self.convs[0].heads
        if quat_source == "field":
            assert num_nodes is not None
            self.quat_field = Parameter(torch.empty(num_nodes, heads, 4))
        else:
            self.register_parameter("quat_field", None)
        self._reset_field()
        # The per-call node inputs of the layers (see forward): one object, read
        # by a forward pre-hook of every layer (copied with the model by deepcopy).
        self._layer_inputs = _LayerInputs()
        for conv in self.convs:
            conv.register_forward_pre_hook(self._layer_inputs, with_kwargs=True)

    def init_conv(self, in_channels: Union[int, Tuple[int, int]], out_channels: int,
                  **kwargs) -> MessagePassing:
        heads = kwargs.pop("heads", 1)
        concat = kwargs.pop("concat", True)
        dropout = self.attention_dropout
        kwargs["dropout"] = self.dropout.p if dropout is None else dropout
        # The layer that maps to out_channels averages its heads (as GAT does).
        if getattr(self, "_is_conv_to_out", False):
            concat = False
        if concat and out_channels % heads != 0:
            raise ValueError(f"hidden_channels (got {out_channels}) must be divisible "
                             f"by the number of heads (got {heads}) when heads are "
                             f"concatenated")
        if concat:
            out_channels = out_channels // heads
        return QSVConv(in_channels, out_channels, heads=heads, concat=concat,
                       quat_source=conv_quat_source(self.quat_source), **kwargs)

    def _reset_field(self) -> None:
        if self.quat_field is not None:
            # Near the identity rotation, as QSVConv's feature maps start.
            with torch.no_grad():
                self.quat_field.normal_(0.0, 0.5)
                self.quat_field[..., 0] += 1.0

    def reset_parameters(self):
        r"""Resets all learnable parameters of the module."""
        super().reset_parameters()
        self._reset_field()

    def _layer_quat(self, quat: OptTensor, node_id: OptTensor, num_nodes: int
                    ) -> OptTensor:
        """The quaternions every layer receives (``None``: from features)."""
        if self.quat_source == "features":
            if isinstance(quat, Tensor):
                raise ValueError("quat_source='features' computes the quaternions from "
                                 "the features; do not pass quat")
            return None
        if self.quat_source == "field":
            if isinstance(quat, Tensor):
                raise ValueError("quat_source='field' learns the quaternions; do not "
                                 "pass quat")
            assert self.quat_field is not None
            field = self.quat_field if not isinstance(node_id, Tensor) \
                else self.quat_field[node_id]
            if field.size(0) != num_nodes:
                raise ValueError(
                    f"the quaternion field has {field.size(0)} rows but the input has "
                    f"{num_nodes} nodes; pass node_id (the global index of each input "
                    f"node) for subgraphs")
            return field
        if quat is None:
            raise ValueError(f"quat_source={self.quat_source!r} needs quat, one "
                             f"quaternion per node ([N, 4] or [N, heads, 4])")
        return quat

    def forward(
        self,
        x: Tensor,
        edge_index: Adj,
        edge_weight: OptTensor = None,
        edge_attr: OptTensor = None,
        batch: OptTensor = None,
        batch_size: Optional[int] = None,
        num_sampled_nodes_per_hop: Optional[List[int]] = None,
        num_sampled_edges_per_hop: Optional[List[int]] = None,
        quat: OptTensor = None,
        pos: OptTensor = None,
        node_id: OptTensor = None,
    ) -> Tensor:
        r"""Forward pass; the arguments of :meth:`BasicGNN.forward` plus:

        Args:
            quat (torch.Tensor, optional): Node quaternions ``[N, 4]`` or
                ``[N, heads, 4]`` for ``quat_source="given"``/``"composed"``.
            pos (torch.Tensor, optional): Node positions for
                ``routing="geometric"``.
            node_id (torch.Tensor, optional): Global node indices into the
                learned field (``quat_source="field"``) when ``x`` holds a
                subgraph, e.g. a :class:`~torch_geometric.loader.NeighborLoader`
                batch's ``n_id``.

        ``edge_attr`` goes to every layer (which needs ``edge_dim``, as in
        PyG's ``GAT``); ``edge_weight`` is rejected (:class:`QSVConv` has no
        edge weights: pass them as a one-feature ``edge_attr`` with
        ``edge_dim=1``). With ``num_sampled_nodes_per_hop`` the node-wise
        ``quat``, ``pos`` and field rows, and the edge features, are trimmed
        with the features and edges.

        The layer loop is PyG's own :meth:`BasicGNN.forward` (trimming, norms,
        activations, dropout, ``jk``, the final linear map), not a copy of it.
        It calls each layer as ``conv(x, edge_index, edge_attr=edge_attr)``:
        the node-wise ``quat`` and ``pos`` reach the layers through a forward
        pre-hook of each :class:`QSVConv` (:class:`_LayerInputs`), which adds
        them, sliced to the layer's (trimmed) node count ``x.size(0)``, for the
        duration of this call only. The one thing this cannot do is
        :func:`torch.fx` tracing (PyG's ``to_hetero``): a traced layer call
        records only the arguments ``BasicGNN.forward`` passes, and the
        hook's additions are not part of the graph; tracing is refused when
        there are quaternions to pass (``quat_source`` other than
        ``"features"``; the features source, the common ``to_hetero`` case,
        traces as before).
        """
        # isinstance, not `is not None`: under torch.fx tracing (to_hetero) the
        # unused optional inputs are proxies.
        if isinstance(edge_weight, Tensor):
            raise ValueError("QSV does not use edge weights (pass them as edge_attr "
                             "with edge_dim=1)")
        if isinstance(edge_attr, Tensor) and self.convs[0].edge_dim is None:
            raise ValueError("QSV received edge_attr but was built without edge_dim; "
                             "pass edge_dim=<number of edge features>")
        if not isinstance(edge_attr, Tensor):
            edge_attr = None
        q_all = self._layer_quat(quat, node_id, x.size(0))
        pos = pos if isinstance(pos, Tensor) else None
        if q_all is not None and torch.fx._symbolic_trace.is_fx_tracing():
            raise NotImplementedError(
                f"QSV with quat_source={self.quat_source!r} cannot be traced by "
                f"torch.fx (to_hetero): the quaternions reach the layers through a "
                f"forward pre-hook, which a traced layer call does not record; use "
                f"quat_source='features'")
        inputs = self._layer_inputs
        inputs.quat, inputs.pos = q_all, pos
        try:
            return super().forward(x, edge_index, edge_attr=edge_attr, batch=batch,
                                   batch_size=batch_size,
                                   num_sampled_nodes_per_hop=num_sampled_nodes_per_hop,
                                   num_sampled_edges_per_hop=num_sampled_edges_per_hop)
        finally:
            inputs.quat = inputs.pos = None

    @torch.no_grad()
    def inference_per_layer(self, layer: int, x: Tensor, edge_index: Adj,
                            batch_size: int) -> Tensor:
        if self.quat_source != "features" or self.convs[0].routing == "geometric" \
                or self.convs[0].edge_dim is not None:
            raise NotImplementedError(
                "layer-wise inference passes only features and edges; it supports "
                "quat_source='features' with non-geometric routing and no edge_dim")
        return super().inference_per_layer(layer, x, edge_index, batch_size)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, "
                f"num_layers={self.num_layers}, quat_source={self.quat_source})")
