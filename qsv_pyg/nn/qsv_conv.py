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

from torch_geometric import is_compiling
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import glorot, zeros
from torch_geometric.typing import Adj, OptTensor, Size, SparseTensor
from torch_geometric.utils import (
    add_self_loops,
    is_torch_sparse_tensor,
    remove_self_loops,
    softmax,
)
from torch_geometric.utils.sparse import set_sparse_value

from ..quaternion import hamilton_product, matrix_rotate_blocks, quaternion_to_matrix
from .qsv_kernel import COMPONENT_MAJOR_MIN_BLOCKS, qsv_aggregate
from .fixed_degree import (
    fixed_degree_neighbors,
    gather_rows,
    neighbor_dot,
    weighted_neighbor_sum,
)

if typing.TYPE_CHECKING:
    from typing import overload
else:
    from torch.jit import _overload_method as overload

ROUTINGS = ("learned", "abs", "uniform", "geometric")
TRANSPORTS = ("sandwich", "identity")
QUAT_SOURCES = ("auto", "features", "given", "composed")
DENSE_PATHS = ("auto", "always", "never")


class _UnitQuaternion(torch.autograd.Function):
    """``q / |q|`` with norms ``<= eps`` mapped to the identity, as one autograd
    node: the ops autograd would record for it (norm, clamp, divide, where)
    cost a third more on CPU at a few thousand nodes, measured."""

    @staticmethod
    def forward(ctx, q: Tensor, eps: float) -> Tensor:
        norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        ok = norm > eps
        identity = q.new_zeros(4)
        identity[0] = 1.0
        unit = torch.where(ok, q / norm.clamp_min(eps), identity)
        ctx.save_for_backward(unit, norm, ok)
        ctx.eps = eps
        return unit

    @staticmethod
    def backward(ctx, grad: Tensor):
        unit, norm, ok = ctx.saved_tensors
        # d(q/|q|) = (g - u <u, g>) / |q|; the identity branch is constant.
        g = (grad - unit * (unit * grad).sum(dim=-1, keepdim=True)) / norm.clamp_min(ctx.eps)
        return g.masked_fill(~ok, 0.0), None


def unit_quaternion(q: Tensor, eps: float = 1e-8) -> Tensor:
    r"""Normalise ``q`` (``[..., 4]``); norms below ``eps`` become the identity.

    A zero quaternion has no direction, and dividing by its norm would give NaN.
    Mapping it to the identity rotation ``(1, 0, 0, 0)`` keeps the layer finite
    and gives such a node "no rotation" (its transport is the identity and its
    learned logit against a neighbour is that neighbour's real part). The
    gradient there is zero.
    """
    if q.size(-1) != 4:
        raise ValueError(f"quaternions must have a last dimension of size 4, got "
                         f"shape {tuple(q.shape)}")
    return _UnitQuaternion.apply(q, eps)


def _check_option(name: str, value: str, choices: Tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of "
                         f"{', '.join(repr(c) for c in choices)}")
    return value


class QSVConv(MessagePassing):
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

    When every target has exactly :math:`k` incoming edges stored contiguously
    in target order (the kNN graphs of :mod:`qsv_pyg.geometry`), a fixed-degree
    path applies the softmax over :math:`k` with no scatter (deterministic);
    see ``dense_path``. With learned (or ``"abs"``) routing, the sandwich
    transport, a routing shared by the batch and no attention dropout, that
    path is one autograd node with a hand-written backward
    (:func:`~qsv_pyg.nn.qsv_kernel.qsv_aggregate`: batched 4x4 rotations and
    sparse products, nothing of size ``[E, H, C]`` stored).

    Args:
        in_channels (int or tuple): Size of each input sample, or :obj:`-1` to
            derive it lazily from the first input. A tuple gives the source and
            target sizes of a bipartite graph. The source size must be a multiple
            of ``4 * heads``: each head reads its slice in blocks of four.
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
        dense_path (str, optional): ``"auto"`` uses the fixed-degree path when
            the graph allows (checked per call in eager mode; under
            :func:`torch.compile` the scatter path is taken), ``"always"``
            requires it (checked in eager mode, trusted when compiled),
            ``"never"`` always uses message passing. (default: :obj:`"auto"`)
        check_finite (bool, optional): Raise :class:`ValueError` on non-finite
            features or quaternions. This costs one reduction and a host sync
            per input and is skipped under :func:`torch.compile`.
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
        self._check_channels(in_src)

        # Feature → quaternion maps (one per side for bipartite graphs, as in
        # GATConv's lin_src/lin_dst).
        self.lin_quat = self.lin_quat_src = self.lin_quat_dst = None
        if self.quat_source != "given":
            if isinstance(in_channels, int):
                self.lin_quat = Linear(in_channels, heads * 4, bias=True,
                                       weight_initializer="glorot")
            else:
                self.lin_quat_src = Linear(in_src, heads * 4, bias=True,
                                           weight_initializer="glorot")
                self.lin_quat_dst = Linear(in_dst, heads * 4, bias=True,
                                           weight_initializer="glorot")

        log_beta = torch.full((heads, ), math.log(beta_init))
        if learn_beta:
            self.log_beta = Parameter(log_beta)
        else:
            self.register_buffer("log_beta", log_beta)

        # Per-head output projection W_h: C -> out_channels, C = in_src / heads.
        if in_src > 0:
            self.weight = Parameter(torch.empty(heads, in_src // heads, out_channels))
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
    def _check_channels(self, in_src: int) -> None:
        if in_src == -1:
            return
        if in_src <= 0 or in_src % (4 * self.heads) != 0:
            raise ValueError(
                f"QSVConv reads each head's input channels in blocks of four, so "
                f"the source channel count must be a multiple of 4 * heads = "
                f"{4 * self.heads}; got {in_src}")

    def reset_parameters(self):
        super().reset_parameters()
        for lin in (self.lin_quat, self.lin_quat_src, self.lin_quat_dst):
            if lin is not None:
                lin.reset_parameters()
                if not isinstance(lin.weight, UninitializedParameter):
                    # Start near the identity rotation so the initial transport is
                    # mild and the normalisation well conditioned.
                    with torch.no_grad():
                        lin.weight.mul_(0.5)
                        lin.bias.zero_()
                        lin.bias.view(self.heads, 4)[:, 0] = 1.0
        with torch.no_grad():
            self.log_beta.fill_(math.log(self.beta_init))
        if not isinstance(self.weight, UninitializedParameter):
            glorot(self.weight)
        if self.lin_skip is not None:
            self.lin_skip.reset_parameters()
        zeros(self.bias)

    def _materialize(self, in_src: int) -> None:
        self._check_channels(in_src)
        if isinstance(self.weight, UninitializedParameter):
            self.weight.materialize((self.heads, in_src // self.heads, self.out_channels))
            glorot(self.weight)

    @property
    def beta(self) -> Tensor:
        r"""The per-head routing temperatures :math:`\beta_h` (shape ``[heads]``)."""
        return self.log_beta.exp()

    # ------------------------------------------------------------ quaternions
    def _feature_quat(self, x: Tensor, side: str) -> Tensor:
        lin = self.lin_quat
        if lin is None:
            lin = self.lin_quat_src if side == "src" else self.lin_quat_dst
        assert lin is not None
        if isinstance(lin.weight, UninitializedParameter):
            lin(x)  # PyG's lazy Linear materialises itself on its first call
            with torch.no_grad():  # same near-identity start as reset_parameters
                lin.weight.mul_(0.5)
                lin.bias.zero_()
                lin.bias.view(self.heads, 4)[:, 0] = 1.0
        return lin(x).view(*x.shape[:-1], self.heads, 4)

    def _given_quat(self, quat: Tensor, num_nodes: int, side: str) -> Tensor:
        if quat.dim() == 2 and quat.size(-1) == 4:
            quat = quat.unsqueeze(1).expand(-1, self.heads, 4)
        if quat.dim() not in (3, 4) or quat.size(-2) != self.heads or quat.size(-1) != 4:
            raise ValueError(
                f"{side} quaternions must have shape [num_nodes, heads={self.heads}, 4] "
                f"(or [num_nodes, 4] to share one across heads, or [batch, num_nodes, "
                f"heads, 4] for batched inputs); got {tuple(quat.shape)}")
        if quat.size(-3) != num_nodes:
            raise ValueError(f"{side} quaternions have {quat.size(-3)} rows but there "
                             f"are {num_nodes} {side} nodes")
        return quat

    def _node_quaternions(
        self,
        x_src: Tensor,
        x_dst: Optional[Tensor],
        quat: Union[Tensor, Tuple[OptTensor, OptTensor], None],
        num_dst: int,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Unit quaternions ``[N_src, H, 4]`` and ``[N_dst, H, 4]`` (or None)."""
        src_q: OptTensor = None
        dst_q: OptTensor = None
        bipartite = x_dst is not x_src
        if quat is not None:
            if isinstance(quat, Tensor):
                src_q = dst_q = self._given_quat(quat, x_src.size(-2), "source")
                if bipartite:
                    raise ValueError("for bipartite inputs pass quat as a pair "
                                     "(quat_src, quat_dst)")
            else:
                q_s, q_d = quat
                if q_s is None:
                    raise ValueError("the source quaternions quat[0] are missing")
                src_q = self._given_quat(q_s, x_src.size(-2), "source")
                if q_d is not None:
                    dst_q = self._given_quat(q_d, num_dst, "target")
        source = self.quat_source
        if source == "auto":
            source = "features" if quat is None else "given"
        if source in ("given", "composed") and src_q is None:
            raise ValueError(f"quat_source={self.quat_source!r} needs the quat argument")
        if source == "features" and quat is not None:
            raise ValueError("quat_source='features' computes quaternions from the "
                             "features; do not pass quat (or use 'auto'/'composed')")

        if source in ("features", "composed"):
            f_src = self._feature_quat(x_src, "src")
            f_dst = f_src if not bipartite else (
                None if x_dst is None else self._feature_quat(x_dst, "dst"))
            if source == "features":
                src_q, dst_q = f_src, f_dst
            else:
                assert src_q is not None
                # Normalise the given field first, so that a zero quaternion
                # counts as the identity here too (identity ⊗ q(x) = q(x)).
                new_src = hamilton_product(unit_quaternion(src_q), unit_quaternion(f_src))
                if bipartite:
                    dst_q = None if (dst_q is None or f_dst is None) else \
                        hamilton_product(unit_quaternion(dst_q), unit_quaternion(f_dst))
                else:
                    dst_q = new_src
                src_q = new_src

        assert src_q is not None
        if self.check_finite and not is_compiling():
            for name, t in (("source quaternions", src_q), ("target quaternions", dst_q)):
                if t is not None and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"QSVConv received non-finite {name}")
        unit_src = unit_quaternion(src_q)
        if dst_q is None:
            return unit_src, None
        if dst_q is src_q:
            return unit_src, unit_src
        return unit_src, unit_quaternion(dst_q)

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
        if x_src.dim() not in (2, 3):
            raise ValueError(f"QSVConv expects node features of shape [num_nodes, "
                             f"channels] or [batch, num_nodes, channels] (a static "
                             f"graph shared by the batch); got {tuple(x_src.shape)}")
        if x_dst is not None and x_dst.dim() != x_src.dim():
            raise ValueError(f"source and target features must have the same number "
                             f"of dimensions; got {tuple(x_src.shape)} and "
                             f"{tuple(x_dst.shape)}")
        if isinstance(self.weight, UninitializedParameter):
            self._materialize(x_src.size(-1))
        H, C = self.heads, self.weight.size(1)
        if x_src.size(-1) != H * C:
            raise ValueError(f"source features have {x_src.size(-1)} channels; the "
                             f"layer was built for {H * C}")
        if self.check_finite and not is_compiling():
            if not bool(torch.isfinite(x_src).all()) or (
                    x_dst is not None and x_dst is not x_src
                    and not bool(torch.isfinite(x_dst).all())):
                raise ValueError("QSVConv received non-finite node features")

        num_dst = self._num_dst(x_src, x_dst, quat, edge_index, size)
        q_src, q_dst = self._node_quaternions(x_src, x_dst, quat, num_dst)
        if q_dst is None and (self.routing in ("learned", "abs")
                              or self.transport == "sandwich"):
            raise ValueError("the target nodes' quaternions are needed: pass target "
                             "features x=(x_src, x_dst) or quat=(quat_src, quat_dst)")

        pos_pair: Tuple[OptTensor, OptTensor] = (None, None)
        if self.routing == "geometric":
            if pos is None:
                raise ValueError("routing='geometric' needs node positions: pass pos")
            pos_pair = (pos, pos) if isinstance(pos, Tensor) else (pos[0], pos[1])
            if pos_pair[0] is None or pos_pair[1] is None:
                raise ValueError("routing='geometric' needs positions of source and "
                                 "target nodes")

        if self.add_self_loops:
            edge_index = self._with_self_loops(edge_index, x_src, x_dst, size)

        dense_src = self._dense_neighbors(edge_index, num_dst)
        if dense_src is not None:
            z_nm, alpha = self._dense_aggregate(x_src, q_src, q_dst, pos_pair, dense_src)
            n, b = z_nm.size(0), z_nm.size(2)  # node-major [N_dst, H, B, C (or C/4, 4)]
            z_h = z_nm.transpose(0, 1).reshape(H, n * b, C)
            lead_out = (*x_src.shape[:-2], n)
        else:
            # One rotation matrix per node and head; a graph on one node set
            # reuses it for the rotation back (by q_i*, the transposed matrix).
            rot_src, rot_dst = self._rotations(q_src, q_dst)
            # Rotate each source once by q_j (the first half of the factorised
            # sandwich); messages are then plain weighted sums.
            lead = x_src.shape[:-1]  # (N,) or (B, N)
            v = x_src.view(*lead, H, C // 4, 4)
            if rot_src is not None:
                v = matrix_rotate_blocks(rot_src, v)
            v = v.reshape(*lead, H, C)
            if x_src.dim() == 2:
                alpha = self.edge_updater(edge_index, q=(q_src, q_dst), pos=pos_pair,
                                          size=size)
                z = self.propagate(edge_index, x=(v, None), alpha=alpha,
                                   size=(x_src.size(0), num_dst))
            else:
                z, alpha = self._batched_scatter(v, q_src, q_dst, pos_pair, edge_index,
                                                 num_dst)
            if rot_dst is not None:
                z = matrix_rotate_blocks(rot_dst.transpose(-1, -2),
                                         z.view(*z.shape[:-1], C // 4, 4))
                z = z.reshape(*z.shape[:-2], C)
            z_h = z.movedim(-2, 0).reshape(H, -1, C)
            n, b, lead_out = -1, 0, tuple(z.shape[:-2])

        # Per-head output projection W_h as one batched matmul over heads,
        # [H, M, C] @ [H, C, F]: a block-diagonal [H*C, H*F] matmul does H times
        # the work and measured 2.4x slower on CPU, transposed copies included.
        proj = torch.bmm(z_h, self.weight)  # [H, M, F]
        F_out = self.out_channels
        if self.concat:
            proj = proj.transpose(0, 1)  # [M, H, F]
        else:
            proj = proj.mean(dim=0, keepdim=True).transpose(0, 1)  # [M, 1, F]
        width = H * F_out if self.concat else F_out
        if b:  # node-major rows (n, b) -> (b, n)
            proj = proj.reshape(n, b, width).transpose(0, 1)
        out = proj.reshape(*lead_out, width)

        if self.lin_skip is not None and x_dst is not None:
            out = out + self.lin_skip(x_dst)
        if self.bias is not None:
            out = out + self.bias

        if return_attention_weights:
            if x_src.dim() == 3 and alpha.dim() == 2:
                # The fixed-degree path computes a routing shared by the batch
                # once; report it per item, [B, E, H], like the scatter path.
                alpha = alpha.expand(x_src.size(0), -1, -1)
            if isinstance(edge_index, Tensor):
                if is_torch_sparse_tensor(edge_index):
                    adj = set_sparse_value(edge_index, alpha)
                    return out, (adj, alpha)
                return out, (edge_index, alpha)
            elif isinstance(edge_index, SparseTensor):
                return out, edge_index.set_value(alpha, layout="coo")
        return out

    def _batched_scatter(self, v: Tensor, q_src: Tensor, q_dst: OptTensor,
                         pos: Tuple[OptTensor, OptTensor], edge_index: Adj,
                         num_dst: int) -> Tuple[Tensor, Tensor]:
        """Scatter path for a ``[B, N, ...]`` batch: B offset copies of the graph."""
        if not isinstance(edge_index, Tensor) or is_torch_sparse_tensor(edge_index):
            raise ValueError("batched [B, N, C] inputs need a plain [2, E] edge_index")
        B, num_src = v.size(0), v.size(1)
        if type(edge_index) is not Tensor:  # EdgeIndex; as_subclass breaks compile
            edge_index = edge_index.as_subclass(Tensor)
        offsets = torch.arange(B, device=edge_index.device).view(B, 1, 1)
        offsets = offsets * torch.tensor([num_src, num_dst],
                                         device=edge_index.device).view(1, 2, 1)
        flat_index = (edge_index.unsqueeze(0) + offsets).transpose(0, 1).reshape(2, -1)

        def flat(t: OptTensor, n: int) -> OptTensor:
            if t is None:
                return None
            if t.dim() == 3:  # [n, H, 4] shared by the batch
                t = t.unsqueeze(0).expand(B, *t.shape)
            return t.reshape(B * n, *t.shape[2:])

        q = (flat(q_src, num_src), flat(q_dst, num_dst))
        p = (None if pos[0] is None else pos[0].unsqueeze(0).expand(B, *pos[0].shape)
             .reshape(B * num_src, -1),
             None if pos[1] is None else pos[1].unsqueeze(0).expand(B, *pos[1].shape)
             .reshape(B * num_dst, -1))
        alpha = self.edge_updater(flat_index, q=q, pos=p, size=(B * num_src, B * num_dst))
        z = self.propagate(flat_index, x=(v.reshape(B * num_src, *v.shape[2:]), None),
                           alpha=alpha, size=(B * num_src, B * num_dst))
        return z.view(B, num_dst, *z.shape[1:]), alpha.view(B, -1, self.heads)

    def _num_dst(self, x_src: Tensor, x_dst: OptTensor, quat, edge_index: Adj,
                 size: Size) -> int:
        if size is not None:
            return int(size[1])
        if isinstance(edge_index, SparseTensor):
            return int(edge_index.size(0))
        if isinstance(edge_index, Tensor) and is_torch_sparse_tensor(edge_index):
            return int(edge_index.size(0))
        if x_dst is not None:
            return x_dst.size(-2)
        if isinstance(quat, (tuple, list)) and quat[1] is not None:
            return quat[1].size(-3) if quat[1].dim() >= 3 else quat[1].size(0)
        return x_src.size(-2)

    def _with_self_loops(self, edge_index: Adj, x_src: Tensor, x_dst: OptTensor,
                         size: Size) -> Adj:
        if isinstance(edge_index, SparseTensor):
            from torch_geometric.typing import torch_sparse
            return torch_sparse.set_diag(edge_index)
        if is_torch_sparse_tensor(edge_index):
            raise ValueError("add_self_loops=True is not supported for torch.sparse "
                             "adjacencies; add the diagonal before calling QSVConv")
        # Only nodes that exist on both sides get a loop (as in GATConv).
        num_nodes = x_src.size(-2)
        if x_dst is not None:
            num_nodes = min(num_nodes, x_dst.size(-2))
        if size is not None:
            num_nodes = min(size)
        edge_index, _ = remove_self_loops(edge_index)
        edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
        return edge_index

    # ------------------------------------------------------------ scatter path
    def _logits(self, q_i: OptTensor, q_j: OptTensor, pos_i: OptTensor,
                pos_j: OptTensor, shape: Tuple[int, ...]) -> Tensor:
        """Routing logits of shape ``shape + (heads,)`` from gathered pairs."""
        if self.routing == "uniform":
            # Equal logits: the softmax gives exactly 1 / deg.
            ref = q_j if q_j is not None else pos_j
            assert ref is not None
            return ref.new_zeros(shape + (self.heads, ))
        beta = self.beta
        if self.routing == "geometric":
            assert pos_i is not None and pos_j is not None
            dist2 = (pos_i - pos_j).pow(2).sum(dim=-1, keepdim=True)
            return -dist2 * beta
        assert q_i is not None and q_j is not None
        re_r = (q_i * q_j).sum(dim=-1)  # Re(q_i* q_j) = <q_i, q_j>
        if self.routing == "abs":
            re_r = re_r.abs()
        return re_r * beta

    def edge_update(self, q_i: OptTensor, q_j: OptTensor, pos_i: OptTensor,
                    pos_j: OptTensor, index: Tensor, ptr: OptTensor,
                    dim_size: Optional[int]) -> Tensor:
        logits = self._logits(q_i, q_j, pos_i, pos_j, (index.numel(), ))
        if index.numel() == 0:
            return logits
        alpha = softmax(logits, index, ptr, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
        return alpha.unsqueeze(-1) * x_j

    # -------------------------------------------------------- fixed-degree path
    def _dense_neighbors(self, edge_index: Adj, num_dst: int) -> OptTensor:
        if self.dense_path == "never" or not isinstance(edge_index, Tensor) \
                or is_torch_sparse_tensor(edge_index):
            return None
        # Explainers hook into `message`; keep them on the message-passing path.
        if self.explain or len(self._message_forward_hooks) > 0 \
                or len(self._edge_update_forward_hooks) > 0:
            return None
        edge_index = edge_index.as_subclass(Tensor) if type(edge_index) is not Tensor \
            else edge_index
        if is_compiling():
            if self.dense_path == "always" and num_dst > 0 \
                    and edge_index.size(1) % num_dst == 0 and edge_index.size(1) > 0:
                return edge_index[0].view(num_dst, -1)
            return None
        nbr = fixed_degree_neighbors(edge_index, num_dst)
        if nbr is None and self.dense_path == "always":
            raise ValueError(
                "dense_path='always' needs a target-sorted graph with the same number "
                "of incoming edges for every target")
        return nbr

    def _use_fused(self, x_src: Tensor, q_src: Tensor, q_dst: OptTensor) -> bool:
        """Whether :func:`~qsv_pyg.nn.qsv_kernel.qsv_aggregate` computes this call:
        learned routing with the sandwich transport, a routing shared by the
        batch (quaternions ``[N, H, 4]``), no attention dropout, eager mode
        without autocast."""
        return (self.routing in ("learned", "abs") and self.transport == "sandwich"
                and q_dst is not None and q_src.dim() == 3 and q_dst.dim() == 3
                and not (self.training and self.dropout > 0)
                and x_src.dtype in (torch.float32, torch.float64)
                and q_src.dtype == q_dst.dtype == x_src.dtype and not is_compiling()
                # its sparse products take one dtype; under autocast the
                # matmuls would change it midway
                and not torch.is_autocast_enabled(x_src.device.type))

    def _fused_aggregate(self, x_src: Tensor, q_src: Tensor, q_dst: Tensor,
                         nbr: Tensor) -> Tuple[Tensor, Tensor]:
        """The fixed-degree aggregation as one autograd node; same returns as
        :meth:`_dense_aggregate` (``z`` node-major ``[N_dst, H, B, C]``, here
        possibly a strided view)."""
        H = self.heads
        C = x_src.size(-1) // H
        b = x_src.numel() // max(x_src.size(-1) * x_src.size(-2), 1) if x_src.dim() == 3 else 1
        n_src, n_dst = x_src.size(-2), nbr.size(0)
        blocks = b * C // 4
        comp = blocks >= COMPONENT_MAJOR_MIN_BLOCKS
        x5 = x_src.reshape(b, n_src, H, C // 4, 4)
        # [N, H, B, C/4, 4] (block-major) or [N, H, 4, B, C/4] (component-major)
        v = x5.permute(1, 2, 4, 0, 3) if comp else x5.permute(1, 2, 0, 3, 4)
        shape = (n_src, H, 4, blocks) if comp else (n_src, H, blocks, 4)
        z, alpha = qsv_aggregate(v.reshape(shape), q_src,
                                 None if q_dst is q_src else q_dst, self.beta, nbr,
                                 use_abs=self.routing == "abs", component_major=comp)
        if comp:  # back to [N, H, B, C/4, 4] as a view; the caller's reshape copies once
            z = z.view(n_dst, H, 4, b, C // 4).permute(0, 1, 3, 4, 2)
        else:
            z = z.view(n_dst, H, b, C // 4, 4)
        return z, alpha.reshape(-1, H)

    @staticmethod
    def _rotate_node_major(rot: Tensor, v: Tensor) -> Tensor:
        """Rotate ``v`` laid out ``[N, H, B, C]`` by ``rot`` (``[N, H, 3, 3]``
        shared by the batch, or ``[B, N, H, 3, 3]``); returns a contiguous tensor."""
        n, h, b, c = v.shape
        if rot.dim() == 4:  # every (batch item, block) of a node-head is one row
            return matrix_rotate_blocks(rot, v.reshape(n, h, b * c // 4, 4)).view(n, h, b, c)
        rot = rot.permute(1, 2, 0, 3, 4)  # [N, H, B, 3, 3]
        return matrix_rotate_blocks(rot, v.reshape(n, h, b, c // 4, 4)).view(n, h, b, c)

    def _rotations(self, q_src: Tensor, q_dst: OptTensor) -> Tuple[OptTensor, OptTensor]:
        if self.transport != "sandwich":
            return None, None
        assert q_dst is not None
        rot_src = quaternion_to_matrix(q_src)
        return rot_src, rot_src if q_dst is q_src else quaternion_to_matrix(q_dst)

    def _dense_aggregate(self, x_src: Tensor, q_src: Tensor, q_dst: OptTensor,
                         pos: Tuple[OptTensor, OptTensor], nbr: Tensor
                         ) -> Tuple[Tensor, Tensor]:
        """Transport, softmax over the k neighbours and weighted sum, no scatter.

        Works node-major, ``[N, H, B, C]``: a batch sharing a field rotates as one
        matmul per node and head, the neighbour gather copies contiguous rows,
        and a routing shared by the batch weights long contiguous runs.
        Returns ``z`` node-major, ``[N_dst, H, B, C]`` (``B = 1`` without a
        batch), and alpha as ``[*, E, H]``.
        """
        if self._use_fused(x_src, q_src, q_dst):
            assert q_dst is not None
            return self._fused_aggregate(x_src, q_src, q_dst, nbr)
        rot_src, rot_dst = self._rotations(q_src, q_dst)
        n, k = nbr.shape
        H = self.heads
        batch = x_src.shape[:-2]
        b = x_src.numel() // max(x_src.size(-1) * x_src.size(-2), 1) if batch else 1
        C = x_src.size(-1) // H
        v = x_src.reshape(b, x_src.size(-2), H, C).permute(1, 2, 0, 3)  # [N, H, B, C]
        v = self._rotate_node_major(rot_src, v) if rot_src is not None else v.contiguous()

        if self.routing in ("learned", "abs"):
            assert q_dst is not None
            # [..., n, 1, H, 4] . [..., n, k, H, 4]; with a field shared by the
            # batch this is computed once, not once per batch item.
            re_r = neighbor_dot(q_dst, q_src, nbr)  # Re(q_i* q_j) = <q_i, q_j>
            if self.routing == "abs":
                re_r = re_r.abs()
            logits = re_r * self.beta
        elif self.routing == "geometric":
            p_src, p_dst = pos
            assert p_src is not None and p_dst is not None
            logits = self._logits(None, None, p_dst.unsqueeze(-2),
                                  gather_rows(p_src, nbr, -2), (n, k))
        else:
            logits = self._logits(None, q_src, None, None, (n, k))
        alpha = torch.softmax(logits, dim=-2)  # [..., n, k, H]
        if self.training and self.dropout > 0 and alpha.dim() == 3 and batch:
            # Routing shared by the batch: still drop independently per item,
            # as the scatter path does.
            alpha = alpha.expand(*batch, *alpha.shape)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)

        a_nm = alpha if alpha.dim() == 3 else alpha.reshape(b, n, k, H).permute(1, 2, 3, 0)
        z = weighted_neighbor_sum(a_nm, v, nbr)  # [n, H, B, C]
        if rot_dst is not None:
            z = self._rotate_node_major(rot_dst.transpose(-1, -2), z)
        return z, alpha.reshape(*alpha.shape[:-3], n * k, H)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"{self.out_channels}, heads={self.heads}, routing={self.routing}, "
                f"transport={self.transport})")
