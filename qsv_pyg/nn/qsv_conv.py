"""QSVConv: quaternion graph attention as a PyG ``MessagePassing`` layer.

The layer, read top to bottom: options, set-up and state dicts, the checks of
a call, ``forward`` and the output projection. The rest is in files of their
own, joined as mixins: where the node quaternions come from (``quat_source``,
:class:`~qsv_pyg.nn.quat_sources.QuatSourceMixin`), the edge features with
the other per-edge logit terms
(:class:`~qsv_pyg.nn.edge_features.EdgeFeaturesMixin`), the choice of path
and the fast path (the registered operator of :mod:`qsv_pyg.nn.qsv_kernel`
over the graph's cached CSR, :mod:`qsv_pyg.nn.csr`;
:class:`~qsv_pyg.nn.fused_path.FusedPathMixin`) and PyG message passing
(:class:`~qsv_pyg.nn.message_path.MessagePathMixin`); the argument checks
are :mod:`qsv_pyg.nn.checks`. Both paths take the routing logit from
:func:`~qsv_pyg.nn.qsv_kernel.routing_logits`; :mod:`qsv_pyg.nn.reference`
keeps the literal per-edge formula.
"""
from __future__ import annotations

import math
import typing
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter
from torch.nn.parameter import UninitializedParameter

from torch_geometric import is_compiling
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import glorot, zeros
from torch_geometric.typing import Adj, OptTensor, Size, SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor
from torch_geometric.utils.sparse import set_sparse_value

from .checks import check_finite, check_float, check_option
from .csr import check_edge_index, with_self_loops_and_attr
from .edge_features import EdgeFeaturesMixin
from .fused_path import (  # noqa: F401 (DENSE_PATHS, FUSED_PATHS, PATHS: imported from here)
    DENSE_PATHS,
    FUSED_PATHS,
    PATHS,
    ROUTINGS,
    FusedPathMixin,
    _from_dense_path,
    _fused_path,
)
from .message_path import MessagePathMixin
from .quat_sources import QuatSourceMixin, resolve_quat_source

if typing.TYPE_CHECKING:
    from typing import overload
else:
    from torch.jit import _overload_method as overload

TRANSPORTS = ("sandwich", "identity")


class QSVConv(QuatSourceMixin, EdgeFeaturesMixin, FusedPathMixin, MessagePathMixin,
              MessagePassing):
    r"""Quaternion graph attention from Quat-Sphere-Vision (QSV).

    Every node carries one unit quaternion per head, :math:`q_i^{(h)}`, in place
    of attention's query/key/value projections. For an edge :math:`j \to i` the
    relative rotation :math:`r_{ij} = q_i^* \otimes q_j` both routes and
    transports the message:

    .. math::
        \alpha_{ij}^{(h)} &= \operatorname{softmax}_{j \in \mathcal{N}(i)}
            \left( \beta_h \, \mathrm{Re}\, r_{ij}^{(h)} \right), \qquad
        \mathbf{z}_i^{(h)} = \sum_{j \in \mathcal{N}(i)} \alpha_{ij}^{(h)} \,
            r_{ij}^{(h)} \otimes \mathbf{x}_j^{(h)} \otimes r_{ij}^{(h)*},

        \mathbf{x}'_i &= \big\Vert_{h=1}^{H} \mathbf{W}_h \mathbf{z}_i^{(h)}
            \; \left(\text{or } \tfrac{1}{H}\textstyle\sum_h\right)
            + \mathbf{W}_r \mathbf{x}_i + \mathbf{b},

    where :math:`\mathbf{x}_j^{(h)}` is head :math:`h`'s slice of the source
    features read as blocks of four channels (one real, three vector), each block
    transported by the sandwich product, and :math:`\beta_h > 0` is a learned
    temperature. Since :math:`\mathrm{Re}(q_i^* q_j) = \langle q_i, q_j \rangle`
    the logit is a 4-d dot product, and since
    :math:`r x r^* = q_i^* (q_j x q_j^*) q_i` the transport factorises: every
    source is rotated once by :math:`q_j`, the weighted sum is taken, and every
    target's sum is rotated back once by :math:`q_i^*`. The per-edge work is then
    the same as :class:`~torch_geometric.nn.conv.GATConv`'s (one dot product per
    head, a softmax, a weighted sum); :mod:`qsv_pyg.nn.reference` keeps the
    literal per-edge formula for testing.

    Every graph takes one fast path (:meth:`choose_path` says which path a
    call takes, and why): its target-sorted CSR is built once and cached
    (:mod:`qsv_pyg.nn.csr`), and the rotations, softmax and weighted sum run
    as one registered operator with a hand-written backward
    (:func:`~qsv_pyg.nn.qsv_kernel.qsv_attend`; C++ on CPU, Triton on CUDA),
    which :func:`torch.compile` and autocast keep; attention dropout runs
    there too, as a per-edge mask the operator multiplies into the weights.
    On the Triton path the default layer (feature quaternions, learned
    routing, root weight and bias, 2-D float32/float64 input) runs as one
    operator, projection, root term and bias included
    (:mod:`qsv_pyg.nn.fused_layer`: 10 kernel launches per forward+backward);
    :meth:`fused_layer_reason` says why a call composes instead.
    Explainers, message-passing hooks and sparse adjacencies use PyG's message
    passing instead.

    Args:
        in_channels (int or tuple): Size of each input sample, or :obj:`-1` to
            derive it lazily from the first input. A tuple gives the source and
            target sizes of a bipartite graph. Any size is accepted: each head
            reads its slice of the source features in blocks of four, so a
            source size that is not a multiple of ``4 * heads`` is zero-padded
            to the next multiple (no extra parameters; the padded channels of a
            block are filled by the rotation and weighted by :math:`\mathbf{W}_h`
            like any other). A lazy layer can load a state dict before its
            first call, like PyG's lazy layers.
        out_channels (int): Size of each output sample per head.
        heads (int, optional): Number of quaternions per node. (default: :obj:`1`)
        concat (bool, optional): Concatenate the heads' outputs (else average).
            (default: :obj:`True`)
        routing (str, optional): ``"learned"`` (:math:`\beta\,\mathrm{Re}\,r`),
            ``"abs"`` (:math:`\beta\,|\mathrm{Re}\,r|`, sign-invariant),
            ``"uniform"`` (:math:`\alpha = 1/\deg`), or ``"geometric"`` (logit
            :math:`-\beta \lVert p_i - p_j \rVert^2` of the node positions
            ``pos`` as given; pass unit directions for concentric shells of
            different radii, raw coordinates for a flat lattice).
            (default: :obj:`"learned"`)
        transport (str, optional): ``"sandwich"`` (rotate messages by
            :math:`r_{ij}`) or ``"identity"``. (default: :obj:`"sandwich"`)
        beta_init (float, optional): Initial temperature :math:`\beta_h > 0`.
            (default: :obj:`1.0`)
        learn_beta (bool, optional): Learn :math:`\beta_h` (parametrised by its
            logarithm, so it stays positive); if :obj:`False` it is a buffer.
            (default: :obj:`True`)
        dropout (float, optional): Dropout on the attention coefficients.
            (default: :obj:`0.0`)
        add_self_loops (bool, optional): Add self-loops (:math:`r_{ii}` is the
            identity). (default: :obj:`False`)
        root_weight (bool, optional): Add the transformed target features
            :math:`\mathbf{W}_r \mathbf{x}_i` (of the raw features, also with
            ``project_input``). (default: :obj:`True`)
        project_input (bool, optional): First project the source (and target)
            features by a learned linear map :math:`\mathbf{P}` to
            ``heads × C`` channels, :math:`C` = ``out_channels`` rounded up to
            a multiple of four, as :class:`~torch_geometric.nn.conv.GATConv`
            projects before it attends; the feature quaternions are then read
            from :math:`\mathbf{P}\mathbf{x}` too, and each head transports
            its :math:`C` projected channels. For wide inputs (bag-of-words,
            one-hot) this is far cheaper, and each head sees every input
            feature instead of a slice. :obj:`False` is the paper's layer: no
            value projection, each head reads its slice of the raw features.
            (default: :obj:`False`)
        bias (bool, optional): Learn an additive bias. (default: :obj:`True`)
        quat_source (str, optional): Where the node quaternions come from
            (``QUAT_SOURCES_OF["QSVConv"]`` of :mod:`qsv_pyg.nn.quat_sources`).
            ``"auto"``: the ``quat`` argument when given, else a learned linear
            map of the features to ``heads × 4`` (normalised). ``"features"``:
            always the linear map. ``"given"``: always ``quat`` (no map is
            created). ``"composed"`` (old spelling ``"both"``): ``quat ⊗ q(x)``,
            a given field composed with the feature quaternion.
            (default: :obj:`"auto"`)
        fused_path (str, optional): ``"auto"`` takes the fused path (the
            registered operator, :meth:`choose_path`) whenever the call allows;
            ``"never"`` always uses message passing (for comparisons).
            (default: :obj:`"auto"`)
        check_finite (bool or str, optional): Raise :class:`ValueError` on
            non-finite features, quaternions, positions or temperatures
            :math:`\beta_h`. This costs one reduction per input and, on a
            device, a host sync per input (three or more per layer and call);
            it is skipped under :func:`torch.compile`. ``"auto"`` checks inputs
            on the CPU (where the read waits for nothing) and skips the check
            on other devices, so a CUDA forward does not sync; :obj:`True`
            checks on every device, :obj:`False` on none. Without the check a
            non-finite input propagates: the affected outputs (and gradients)
            are NaN, never silently replaced (a NaN quaternion is not read as
            the identity), and the training loop's loss check reports it.
            (default: :obj:`"auto"`)
        edge_dim (int, optional): Edge feature dimensionality (:obj:`-1`: lazy),
            as in :class:`~torch_geometric.nn.conv.GATConv`: the edge features
            ``edge_attr`` add a per-head linear score to the logit,
            :math:`\beta_h \mathrm{Re}\, r_{ij} + (\mathbf{W}_e e_{ij})_h`
            (``lin_edge``, bias-free). (default: :obj:`None`)
        fill_value (float or torch.Tensor or str, optional): The edge features
            of the added self-loops (``add_self_loops=True`` and ``edge_dim``):
            a value, a ``[edge_dim]`` tensor, or a reduction of each target's
            incoming edge features (``"add"``, ``"mean"``, ``"min"``,
            ``"max"``, ``"mul"``), as in GATConv. (default: :obj:`"mean"`)
        edge_message (bool or str, optional): Also add an embedding
            :math:`\mathbf{W}_m e_{ij}` (``lin_edge_msg``, to the padded source
            width) to the message. :obj:`True` or ``"source"``: to
            :math:`\mathbf{x}_j` before the transport, so it is rotated with
            it: the message is :math:`r_{ij} (\mathbf{x}_j + \mathbf{W}_m
            e_{ij}) r_{ij}^*` (the embedding has the source features' channel
            layout: blocks of four per head, component 0 kept, components 1-3
            rotated, read in the source's frame; it costs about as much as
            materialising the messages). ``"target"``: after the transport, in
            the target's frame, as TransformerConv adds its edge embedding:
            :math:`r_{ij} \mathbf{x}_j r_{ij}^* + \mathbf{W}_m e_{ij}` (only
            :math:`\sum_j \alpha_{ij} e_{ij}` is aggregated: cheap). Needs
            ``edge_dim`` and a known source width. (default: :obj:`False`)
        source_logit (bool, optional): Add a per-head linear score of the source
            features :math:`a_h^\top \mathbf{x}_j` (``lin_source``; of the
            projected features with ``project_input``) to the logit, GAT's
            source half: a neighbour scored on its own. Off: the paper's layer.
            (default: :obj:`False`)
        dense_path (str, optional): Deprecated name of ``fused_path`` (for
            old code; also as an attribute), taken with a
            :class:`DeprecationWarning`; its value ``"always"`` (which once
            required a fixed-degree graph) is read as ``"auto"``.
            ``fused_path`` itself refuses ``"always"``. (default: :obj:`None`)
        **kwargs (optional): Additional arguments of
            :class:`torch_geometric.nn.conv.MessagePassing`.

    Shapes:
        - **input:**
          node features :math:`(|\mathcal{V}|, F_{in})` or
          :math:`((|\mathcal{V}_s|, F_{s}), (|\mathcal{V}_t|, F_{t}))`
          (the target features may be :obj:`None` when quaternions are given
          and ``root_weight`` is not needed),
          edge indices :math:`(2, |\mathcal{E}|)` (or a sparse adjacency),
          edge features *(optional)* :math:`(|\mathcal{E}|, D)`,
          quaternions *(optional)* :math:`(|\mathcal{V}|, H, 4)` or a pair,
          positions *(optional)* :math:`(|\mathcal{V}|, D)` or a pair
        - **output:** node features :math:`(|\mathcal{V}_t|, H * F_{out})` or
          :math:`(|\mathcal{V}_t|, F_{out})` if :obj:`concat=False`;
          with ``return_attention_weights``, also
          :math:`((2, |\mathcal{E}|), (|\mathcal{E}|, H))`
    """

    def __init__(
        self,
        in_channels: Union[int, Tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        routing: str = "learned",
        transport: str = "sandwich",
        beta_init: float = 1.0,
        learn_beta: bool = True,
        dropout: float = 0.0,
        add_self_loops: bool = False,
        root_weight: bool = True,
        project_input: bool = False,
        bias: bool = True,
        quat_source: str = "auto",
        fused_path: str = "auto",
        check_finite: Union[bool, str] = "auto",
        edge_dim: Optional[int] = None,
        fill_value: Union[float, Tensor, str] = "mean",
        edge_message: Union[bool, str] = False,
        source_logit: bool = False,
        dense_path: Optional[str] = None,
        **kwargs,
    ):
        kwargs.setdefault("aggr", "add")
        super().__init__(node_dim=0, **kwargs)

        if heads < 1:
            raise ValueError(f"heads must be a positive integer, got {heads}")
        if out_channels < 1:
            raise ValueError(f"out_channels must be positive, got {out_channels}")
        if not (beta_init > 0 and math.isfinite(beta_init)):
            raise ValueError(f"beta_init must be a positive finite number, got {beta_init}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.routing = check_option("routing", routing, ROUTINGS)
        self.transport = check_option("transport", transport, TRANSPORTS)
        self.beta_init = float(beta_init)
        self.learn_beta = learn_beta
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.root_weight = root_weight
        self.project_input = project_input
        self.quat_source = resolve_quat_source(quat_source, "QSVConv")
        if dense_path is not None:
            if fused_path != "auto":
                raise ValueError("pass fused_path only (dense_path is its deprecated name)")
            fused_path = _from_dense_path(dense_path)
        self.fused_path = _fused_path(fused_path)
        if not (check_finite is True or check_finite is False or check_finite == "auto"):
            raise ValueError(f"check_finite must be True, False or 'auto', got "
                             f"{check_finite!r}")
        self.check_finite = check_finite
        self._set_edge_options(edge_dim, fill_value, edge_message, source_logit)

        if isinstance(in_channels, int):
            in_src = in_dst = in_channels
        else:
            in_src, in_dst = in_channels
        for name, c in (("in_channels", in_src), ("target in_channels", in_dst)):
            if not isinstance(c, int) or isinstance(c, bool) or (c < 1 and c != -1):
                raise ValueError(f"{name} must be a positive integer or -1 (lazy), got {c!r}")

        # The value projection P (project_input): GATConv's lin / lin_src, lin_dst.
        self.lin_proj = self.lin_proj_src = self.lin_proj_dst = None
        if project_input:
            width = heads * (-(-out_channels // 4) * 4)
            if isinstance(in_channels, int):
                self.lin_proj = Linear(in_channels, width, bias=False,
                                       weight_initializer="glorot")
            else:
                self.lin_proj_src = Linear(in_src, width, bias=False,
                                           weight_initializer="glorot")
                self.lin_proj_dst = Linear(in_dst, width, bias=False,
                                           weight_initializer="glorot")
            quat_in: Union[int, Tuple[int, int]] = \
                width if isinstance(in_channels, int) else (width, width)
            in_src = width
        else:
            quat_in = in_channels
        self._make_quat_maps(quat_in)  # QuatSourceMixin
        self._make_edge_maps(in_src)  # EdgeFeaturesMixin

        log_beta = torch.full((heads, ), math.log(beta_init))
        if learn_beta:
            self.log_beta = Parameter(log_beta)
        else:
            self.register_buffer("log_beta", log_beta)

        # Per-head output projection W_h: C -> out_channels, C = padded in_src / heads.
        if in_src > 0:
            self.weight = Parameter(torch.empty(heads, self._padded(in_src) // heads,
                                                out_channels))
        else:
            self.weight = UninitializedParameter()

        total_out = heads * out_channels if concat else out_channels
        if root_weight:
            self.lin_skip = Linear(in_dst, total_out, bias=False,
                                   weight_initializer="glorot")
        else:
            self.lin_skip = None
        if bias:
            self.bias = Parameter(torch.empty(total_out))
        else:
            self.register_parameter("bias", None)

        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    def _padded(self, in_src: int) -> int:
        """``in_src`` rounded up to a multiple of ``4 * heads``."""
        step = 4 * self.heads
        return -(-in_src // step) * step

    def reset_parameters(self):
        super().reset_parameters()
        for lin in (self.lin_proj, self.lin_proj_src, self.lin_proj_dst, self.lin_edge,
                    self.lin_edge_msg, self.lin_source):
            if lin is not None:
                lin.reset_parameters()
        for lin in (self.lin_quat, self.lin_quat_src, self.lin_quat_dst):
            if lin is not None:
                lin.reset_parameters()
                if not isinstance(lin.weight, UninitializedParameter):
                    self._near_identity(lin)
        with torch.no_grad():
            self.log_beta.fill_(math.log(self.beta_init))
        if not isinstance(self.weight, UninitializedParameter):
            glorot(self.weight)
        if self.lin_skip is not None:
            self.lin_skip.reset_parameters()
        zeros(self.bias)

    def _materialize(self, in_src: int) -> None:
        if isinstance(self.weight, UninitializedParameter):
            self.weight.materialize((self.heads, self._padded(in_src) // self.heads,
                                     self.out_channels))
            glorot(self.weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # An uninitialised (lazy) weight cannot be detached: save it as is.
        for name, t in list(self._parameters.items()) + list(self._buffers.items()):
            if t is not None and name not in self._non_persistent_buffers_set:
                lazy = isinstance(t, UninitializedParameter)
                destination[prefix + name] = t if keep_vars or lazy else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A lazy layer takes its shape from the state dict (as PyG's Linear does).
        weight = state_dict.get(prefix + "weight", None)
        if weight is not None and isinstance(weight, UninitializedParameter):
            self.weight = UninitializedParameter()
        elif weight is not None and isinstance(self.weight, UninitializedParameter):
            self.weight.materialize(tuple(weight.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def pad_source(self, x_src: Tensor) -> Tensor:
        """``x_src`` zero-padded to the layer's ``heads * C`` channels."""
        width = self.weight.size(0) * self.weight.size(1)
        f = x_src.size(-1)
        if f == width:
            return x_src
        if self._padded(f) != width:
            raise ValueError(f"source features have {f} channels; the layer was built "
                             f"for {width} (padded to a multiple of 4 * heads = "
                             f"{4 * self.heads})")
        return F.pad(x_src, (0, width - f))

    @property
    def beta(self) -> Tensor:
        r"""The per-head routing temperatures :math:`\beta_h` (shape ``[heads]``)."""
        return self.log_beta.exp()

    # -------------------------------------------------------- call checks
    def _checks_finite(self, t: Tensor) -> bool:
        """Whether this call checks finiteness (``check_finite``; never under
        :func:`torch.compile`): ``"auto"`` only for inputs on the CPU."""
        if is_compiling() or self.check_finite is False:
            return False
        return self.check_finite is True or t.device.type == "cpu"

    def _check_call(self, x_src: Tensor, x_dst: OptTensor, edge_index: Adj) -> None:
        """Shapes, dtypes and (with ``check_finite``) finiteness of a call."""
        if x_src.dim() not in (2, 3):
            raise ValueError(f"QSVConv expects node features of shape [num_nodes, "
                             f"channels] or [batch, num_nodes, channels] (a static "
                             f"graph shared by the batch); got {tuple(x_src.shape)}")
        check_float(x_src, "x (source features)")
        check_float(x_dst, "x[1] (target features)")
        if isinstance(edge_index, Tensor) and not is_torch_sparse_tensor(edge_index):
            check_edge_index(edge_index)
        if x_dst is not None and x_dst.dim() != x_src.dim():
            raise ValueError(f"source and target features must have the same number "
                             f"of dimensions; got {tuple(x_src.shape)} and "
                             f"{tuple(x_dst.shape)}")
        if self._checks_finite(x_src):
            check_finite(x_src, "node features")
            check_finite(x_dst if x_dst is not x_src else None, "node features")
            # An overflowing temperature would turn every weight into NaN.
            check_finite(self.log_beta.exp(), "routing temperatures beta (exp(log_beta))")

    # ---------------------------------------------------------------- forward
    @overload
    def forward(self, x, edge_index, edge_attr=None, quat=None, pos=None, size=None,
                return_attention_weights: typing.Literal[False] | None = None) -> Tensor:
        pass

    @overload
    def forward(self, x, edge_index, edge_attr=None, quat=None, pos=None, size=None,
                return_attention_weights: typing.Literal[True] = True
                ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        pass

    def forward(  # noqa: F811
        self,
        x: Union[Tensor, Tuple[Tensor, OptTensor]],
        edge_index: Adj,
        edge_attr: OptTensor = None,
        quat: Union[Tensor, Tuple[OptTensor, OptTensor], None] = None,
        pos: Union[Tensor, Tuple[OptTensor, OptTensor], None] = None,
        size: Size = None,
        return_attention_weights: Optional[bool] = None,
    ):
        r"""Runs the forward pass of the module.

        Args:
            x (torch.Tensor or (torch.Tensor, torch.Tensor or None)): The input
                node features, or a (source, target) pair for bipartite graphs.
            edge_index (torch.Tensor or SparseTensor): The edge indices, an
                :class:`~torch_geometric.EdgeIndex` (whose own cached CSC / CSR
                the operator then reads, sort it by ``"col"`` or ``"row"`` to
                have it cached: :func:`qsv_pyg.nn.csr.edge_index_csr`), or a
                sparse adjacency (``torch.sparse`` or ``SparseTensor``) in
                PyG's transposed convention.
            edge_attr (torch.Tensor, optional): Edge features ``[E, edge_dim]``
                (or ``[E]`` for ``edge_dim=1``), in the order of ``edge_index``
                (the layer needs ``edge_dim``). A ``SparseTensor``'s values
                serve as edge features when this is not given, as in GATConv.
                (default: :obj:`None`)
            quat (torch.Tensor or pair, optional): Per-node quaternions
                ``[N, heads, 4]`` (normalised inside); see ``quat_source``.
            pos (torch.Tensor or pair, optional): Node positions, required by
                ``routing="geometric"``.
            size ((int, int), optional): The shape of the adjacency matrix.
            return_attention_weights (bool, optional): If truthy, also return
                ``(edge_index, alpha)`` with ``alpha`` of shape ``[E, heads]``
                (a sparse tensor with the weights as values for sparse input).
        """
        if isinstance(x, Tensor):
            x_src: Tensor = x
            x_dst: OptTensor = x
        else:
            x_src, x_dst = x
        self._check_call(x_src, x_dst, edge_index)
        edge_attr = self._check_edge_attr(edge_attr, edge_index)
        if self.fused_layer_reason(x, edge_index, edge_attr, quat, pos, size) is None:
            return self._attend_layer(x_src, edge_index, bool(return_attention_weights))
        x_root = x_dst  # the root weight reads the raw target features
        if self.project_input:
            x_src, x_dst = self._project_input(x_src, x_dst)
        if isinstance(self.weight, UninitializedParameter):
            self._materialize(x_src.size(-1))
        H, C = self.heads, self.weight.size(1)
        x_pad = self.pad_source(x_src)
        num_dst = self._num_dst(x_src, x_dst, quat, edge_index, size)
        q_src, q_dst = self._node_quaternions(x_src, x_dst, quat, num_dst)
        if q_dst is None and (self.routing in ("learned", "abs")
                              or self.transport == "sandwich"):
            raise ValueError("the target nodes' quaternions are needed: pass target "
                             "features x=(x_src, x_dst) or quat=(quat_src, quat_dst)")
        pos_pair = self._positions(pos, x_src.size(-2), num_dst)
        if self.add_self_loops:
            if isinstance(edge_index, SparseTensor) and self.edge_dim is not None:
                raise NotImplementedError(
                    "QSVConv: edge features and add_self_loops=True together are not "
                    "supported for a SparseTensor adjacency (as in GATConv); pass an "
                    "edge_index and edge_attr")
            edge_index, edge_attr = with_self_loops_and_attr(
                edge_index, x_src, x_dst, size, edge_attr, self.fill_value)
        # The per-source score a_h^T x_j, per node ([*, N_src, H]).
        src_score = self.lin_source(x_src) if self.lin_source is not None else None

        path = self.choose_path(x_pad, q_src, edge_index)
        if path == "message_passing":
            z, alpha = self._message_passing(x_pad, q_src, q_dst, pos_pair, edge_index,
                                             num_dst, edge_attr, src_score)
            z_h, b = z.movedim(-2, 0).reshape(H, -1, C), 0
        else:
            z_h, alpha, b = self._attend(path, x_pad, q_src, q_dst, pos_pair, edge_index,
                                         num_dst, bool(return_attention_weights),
                                         edge_attr, src_score)
        out = self._project(z_h, b, (*x_src.shape[:-2], num_dst))
        if self.lin_skip is not None and x_root is not None:
            out = out + self.lin_skip(x_root)
        if self.bias is not None:
            out = out + self.bias

        if return_attention_weights:
            if isinstance(edge_index, Tensor):
                if is_torch_sparse_tensor(edge_index):
                    if edge_index.dense_dim() > 0:  # edge features as its values
                        if edge_index.layout != torch.sparse_coo:
                            raise ValueError("return_attention_weights with edge features "
                                             "as a sparse adjacency's values needs a COO "
                                             "adjacency")
                        adj = torch.sparse_coo_tensor(
                            edge_index._indices(), alpha, (*edge_index.shape[:2], H),
                            is_coalesced=edge_index.is_coalesced())
                    else:
                        adj = set_sparse_value(edge_index, alpha)
                    return out, (adj, alpha)
                return out, (edge_index, alpha)
            elif isinstance(edge_index, SparseTensor):
                return out, edge_index.set_value(alpha, layout="coo")
        return out

    def _project_input(self, x_src: Tensor, x_dst: OptTensor) -> Tuple[Tensor, OptTensor]:
        """``(P x_src, P x_dst)`` of ``project_input`` (one map unless bipartite)."""
        if self.lin_proj is not None:
            p_src = self.lin_proj(x_src)
            if x_dst is x_src:
                return p_src, p_src
            return p_src, None if x_dst is None else self.lin_proj(x_dst)
        assert self.lin_proj_src is not None and self.lin_proj_dst is not None
        return (self.lin_proj_src(x_src),
                None if x_dst is None else self.lin_proj_dst(x_dst))

    def _num_dst(self, x_src: Tensor, x_dst: OptTensor, quat, edge_index: Adj,
                 size: Size) -> int:
        """The number of target nodes implied by a call's arguments."""
        if size is not None:
            return int(size[1])
        if isinstance(edge_index, SparseTensor) or (
                isinstance(edge_index, Tensor) and is_torch_sparse_tensor(edge_index)):
            return int(edge_index.size(0))
        if x_dst is not None:
            return x_dst.size(-2)
        if isinstance(quat, (tuple, list)) and quat[1] is not None:
            return quat[1].size(-3) if quat[1].dim() >= 3 else quat[1].size(0)
        return x_src.size(-2)

    def _project(self, z_h: Tensor, b: int, lead_out: Tuple[int, ...]) -> Tensor:
        """Per-head output projection of ``z_h [H, M, C]``; rows node-major
        ``(n, b)`` when ``b > 0``, else in the order of ``lead_out``."""
        # One batched matmul over heads, [H, M, C] @ [H, C, F]: a block-diagonal
        # [H*C, H*F] matmul would do H times the work. z_h is usually a transposed
        # view of the node-major [M, H, C] aggregate: copied once here, the matmul
        # and the weight gradient (which autograd computes from the saved z_h) run
        # on contiguous rows (on Cora's 1,440 channels, one CPU thread: the weight
        # gradient 65 ms strided against 14 ms + a 7 ms copy).
        proj = torch.bmm(z_h.contiguous(), self.weight)  # [H, M, F]
        if self.concat:
            proj = proj.transpose(0, 1)  # [M, H, F]
        else:
            proj = proj.mean(dim=0, keepdim=True).transpose(0, 1)  # [M, 1, F]
        width = proj.size(1) * proj.size(2)
        if b:  # node-major rows (n, b) -> (b, n)
            proj = proj.reshape(-1, b, width).transpose(0, 1)
        return proj.reshape(*lead_out, width)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"{self.out_channels}, heads={self.heads}, routing={self.routing}, "
                f"transport={self.transport}"
                + (", project_input=True" if self.project_input else "")
                + (f", edge_dim={self.edge_dim}" if self.edge_dim is not None else "")
                + (f", edge_message={self.edge_message!r}" if self.edge_message else "")
                + (", source_logit=True" if self.source_logit else "") + ")")
