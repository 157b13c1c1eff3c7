"""QSVConv: quaternion graph attention as a PyG ``MessagePassing`` layer."""
from __future__ import annotations

import math
import typing
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter
from torch.nn.parameter import UninitializedParameter

from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import glorot, zeros
from torch_geometric.typing import Adj, OptTensor, Size, SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor, softmax
from torch_geometric.utils.sparse import set_sparse_value

from ..quaternion import matrix_rotate_blocks, quaternion_to_matrix
from .dispatch import choose_path
from .fast_path import attend
from .graph_args import batched_propagate, num_targets, with_self_loops
from .inputs import check_call, positions
from .quat_sources import QUAT_SOURCES, NodeQuaternions

if typing.TYPE_CHECKING:
    from typing import overload
else:
    from torch.jit import _overload_method as overload

ROUTINGS = ("learned", "abs", "uniform", "geometric")
TRANSPORTS = ("sandwich", "identity")
DENSE_PATHS = ("auto", "always", "never")


def _check_option(name: str, value: str, choices: Tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of "
                         f"{', '.join(repr(c) for c in choices)}")
    return value


class QSVConv(NodeQuaternions, MessagePassing):
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

    Every graph takes one fast path (:mod:`qsv_pyg.nn.dispatch`): its
    target-sorted CSR is built once and cached (:mod:`qsv_pyg.nn.csr`), and the
    rotations, softmax and weighted sum run as one registered operator with a
    hand-written backward (:func:`~qsv_pyg.nn.qsv_kernel.qsv_attend`; a C++
    kernel on CPU), which :func:`torch.compile` and autocast keep. Attention
    dropout while training, explainers and sparse adjacencies use PyG's message
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
            :math:`\mathbf{W}_r \mathbf{x}_i`. (default: :obj:`True`)
        bias (bool, optional): Learn an additive bias. (default: :obj:`True`)
        quat_source (str, optional): Where the node quaternions come from.
            ``"auto"``: the ``quat`` argument when given, else a learned linear
            map of the features to ``heads × 4`` (normalised). ``"features"``:
            always the linear map. ``"given"``: always ``quat`` (no map is
            created). ``"composed"``: ``quat ⊗ q(x)``, a given field composed with
            the feature quaternion. (default: :obj:`"auto"`)
        dense_path (str, optional): ``"auto"`` takes the fast path whenever the
            call allows; ``"never"`` always uses message passing (for
            comparisons). ``"always"`` is accepted as a synonym of ``"auto"``
            (it once required a fixed-degree graph; every graph has the fast
            path now). (default: :obj:`"auto"`)
        check_finite (bool, optional): Raise :class:`ValueError` on non-finite
            features, quaternions, positions or temperatures :math:`\beta_h`.
            This costs one reduction and a host sync per input and is skipped
            under :func:`torch.compile`. Without the check a non-finite input
            propagates: the affected outputs (and gradients) are NaN, never
            silently replaced (a NaN quaternion is not read as the identity).
            (default: :obj:`True`)
        **kwargs (optional): Additional arguments of
            :class:`torch_geometric.nn.conv.MessagePassing`.

    Shapes:
        - **input:**
          node features :math:`(|\mathcal{V}|, F_{in})` or
          :math:`((|\mathcal{V}_s|, F_{s}), (|\mathcal{V}_t|, F_{t}))`
          (the target features may be :obj:`None` when quaternions are given
          and ``root_weight`` is not needed),
          edge indices :math:`(2, |\mathcal{E}|)` (or a sparse adjacency),
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
        bias: bool = True,
        quat_source: str = "auto",
        dense_path: str = "auto",
        check_finite: bool = True,
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
        self.routing = _check_option("routing", routing, ROUTINGS)
        self.transport = _check_option("transport", transport, TRANSPORTS)
        self.beta_init = float(beta_init)
        self.learn_beta = learn_beta
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.root_weight = root_weight
        self.quat_source = _check_option("quat_source", quat_source, QUAT_SOURCES)
        self.dense_path = _check_option("dense_path", dense_path, DENSE_PATHS)
        self.check_finite = check_finite

        if isinstance(in_channels, int):
            in_src = in_dst = in_channels
        else:
            in_src, in_dst = in_channels
        for name, c in (("in_channels", in_src), ("target in_channels", in_dst)):
            if not isinstance(c, int) or isinstance(c, bool) or (c < 1 and c != -1):
                raise ValueError(f"{name} must be a positive integer or -1 (lazy), got {c!r}")

        self._make_quat_maps(in_channels)

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

    # ---------------------------------------------------------------- forward
    @overload
    def forward(self, x, edge_index, quat=None, pos=None, size=None,
                return_attention_weights: typing.Literal[False] | None = None) -> Tensor:
        pass

    @overload
    def forward(self, x, edge_index, quat=None, pos=None, size=None,
                return_attention_weights: typing.Literal[True] = True
                ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        pass

    def forward(  # noqa: F811
        self,
        x: Union[Tensor, Tuple[Tensor, OptTensor]],
        edge_index: Adj,
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
                :class:`~torch_geometric.EdgeIndex`, or a sparse adjacency
                (``torch.sparse`` or ``SparseTensor``) in PyG's transposed
                convention.
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
        check_call(self, x_src, x_dst, edge_index)
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
        pos_pair = positions(self, pos, x_src.size(-2), num_dst)
        if self.add_self_loops:
            edge_index = with_self_loops(edge_index, x_src, x_dst, size)

        path = choose_path(self, x_pad, q_src, edge_index)
        if path == "message_passing":
            z, alpha = self._message_passing(x_pad, q_src, q_dst, pos_pair, edge_index,
                                             num_dst)
            z_h, b = z.movedim(-2, 0).reshape(H, -1, C), 0
        else:
            z_h, alpha, b = attend(self, path, x_pad, q_src, q_dst, pos_pair, edge_index,
                                   num_dst, bool(return_attention_weights))
        out = self._project(z_h, b, (*x_src.shape[:-2], num_dst))
        if self.lin_skip is not None and x_dst is not None:
            out = out + self.lin_skip(x_dst)
        if self.bias is not None:
            out = out + self.bias

        if return_attention_weights:
            if isinstance(edge_index, Tensor):
                if is_torch_sparse_tensor(edge_index):
                    adj = set_sparse_value(edge_index, alpha)
                    return out, (adj, alpha)
                return out, (edge_index, alpha)
            elif isinstance(edge_index, SparseTensor):
                return out, edge_index.set_value(alpha, layout="coo")
        return out

    def _project(self, z_h: Tensor, b: int, lead_out: Tuple[int, ...]) -> Tensor:
        """Per-head output projection of ``z_h [H, M, C]``; rows node-major
        ``(n, b)`` when ``b > 0``, else in the order of ``lead_out``."""
        # One batched matmul over heads, [H, M, C] @ [H, C, F]: a block-diagonal
        # [H*C, H*F] matmul would do H times the work.
        proj = torch.bmm(z_h, self.weight)  # [H, M, F]
        if self.concat:
            proj = proj.transpose(0, 1)  # [M, H, F]
        else:
            proj = proj.mean(dim=0, keepdim=True).transpose(0, 1)  # [M, 1, F]
        width = proj.size(1) * proj.size(2)
        if b:  # node-major rows (n, b) -> (b, n)
            proj = proj.reshape(-1, b, width).transpose(0, 1)
        return proj.reshape(*lead_out, width)

    # ------------------------------------------------------- message passing
    def _message_passing(self, x: Tensor, q_src: Tensor, q_dst: OptTensor,
                         pos: Tuple[OptTensor, OptTensor], edge_index: Adj, num_dst: int
                         ) -> Tuple[Tensor, Tensor]:
        """PyG's ``propagate``; returns ``z [*, N_dst, H, C]`` and alpha."""
        H = self.heads
        C = x.size(-1) // H
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
        if x.dim() == 2:
            size = (x.size(0), num_dst)
            alpha = self.edge_updater(edge_index, q=(q_src, q_dst), pos=pos, size=size)
            z = self.propagate(edge_index, x=(v, None), alpha=alpha, size=size)
        else:
            z, alpha = batched_propagate(self, v, q_src, q_dst, pos, edge_index, num_dst)
        if rot_dst is not None:
            z = matrix_rotate_blocks(rot_dst.transpose(-1, -2),
                                     z.view(*z.shape[:-1], C // 4, 4))
            z = z.reshape(*z.shape[:-2], C)
        return z, alpha

    def _num_dst(self, x_src: Tensor, x_dst: OptTensor, quat, edge_index: Adj,
                 size: Size) -> int:
        return num_targets(x_src, x_dst, quat, edge_index, size)

    # ------------------------------------------------------------ scatter path
    def edge_update(self, q_i: OptTensor, q_j: OptTensor, pos_i: OptTensor,
                    pos_j: OptTensor, index: Tensor, ptr: OptTensor,
                    dim_size: Optional[int]) -> Tensor:
        if self.routing == "uniform":  # equal logits: the softmax gives 1 / deg
            ref = q_j if q_j is not None else pos_j
            assert ref is not None
            logits = ref.new_zeros(index.numel(), self.heads)
        elif self.routing == "geometric":
            assert pos_i is not None and pos_j is not None
            logits = -(pos_i - pos_j).pow(2).sum(dim=-1, keepdim=True) * self.beta
        else:
            assert q_i is not None and q_j is not None
            re_r = (q_i * q_j).sum(dim=-1)  # Re(q_i* q_j) = <q_i, q_j>
            logits = (re_r.abs() if self.routing == "abs" else re_r) * self.beta
        if index.numel() == 0:
            return logits
        alpha = softmax(logits, index, ptr, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
        return alpha.unsqueeze(-1) * x_j

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"{self.out_channels}, heads={self.heads}, routing={self.routing}, "
                f"transport={self.transport})")
