r"""Point-cloud controls of the ModelNet tables: DGCNN, PointNet++ and a Vector
Neurons network (VN-DGCNN style), built from PyG's layers.

* :class:`DGCNN` and :class:`PointNet2`: PyG's ``examples/dgcnn_classification.py``
  and ``examples/pointnet2_classification.py`` at a width ``w`` (there 64), the
  definitions the ModelNet10 table has always used. Neither is rotation
  invariant: they see the coordinates.
* :class:`VNDGCNN`: the Vector Neurons control of Deng et al., "Vector Neurons:
  A General Framework for SO(3)-Equivariant Networks", ICCV 2021
  (arXiv:2104.12229): every feature is a list of 3-D vectors
  :math:`\mathbf{V} \in \mathbb{R}^{C \times 3}` that rotates with the cloud
  (:math:`\mathbf{V} \mapsto \mathbf{V} R^\top`); :class:`VNLinear`,
  :class:`VNLeakyReLU`, :class:`VNBatchNorm` and the edge convolution
  :class:`VNEdgeConv` on kNN graphs of the features keep that equivariance,
  and the invariant layer :class:`VNInvariant` (the product with a learned
  equivariant frame) ends it before an MLP classifier.

Every model is called as ``model(pos, batch)`` and returns
``[num_clouds, num_classes]`` logits.

The kNN graphs come from :func:`torch_cluster.knn_graph` (PyG 2.8's own
``knn`` needs pyg-lib, which PyPI lacks); without :mod:`torch_cluster` a dense
exact search per cloud is used (same graph wherever distances are not tied).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MLP, EdgeConv, PointNetConv, global_max_pool, global_mean_pool
from torch_geometric.utils import scatter

from .matching import count_parameters, match_width, scale_widths

__all__ = ["DGCNN", "PointNet2", "DynamicEdgeConv", "SetAbstraction", "VNLinear",
           "VNLeakyReLU", "VNBatchNorm", "VNEdgeConv", "VNInvariant", "VNDGCNN",
           "feature_knn_graph", "matched_vn_dgcnn", "matched_width_model", "VN_BASE_WIDTHS"]

try:  # optional: a compiled extension
    import torch_cluster
except ImportError:  # pragma: no cover - depends on the environment
    torch_cluster = None


def feature_knn_graph(x: Tensor, k: int, batch: Optional[Tensor] = None,
                      loop: bool = False) -> Tensor:
    r"""The kNN graph of the rows of ``x [N, D]`` within each cloud of ``batch``:
    ``edge_index [2, E]`` (row 0 the neighbour, row 1 the target).

    :func:`torch_cluster.knn_graph` when installed, otherwise an exact dense
    search per cloud (:func:`torch.cdist`)."""
    if batch is None:
        batch = torch.zeros(x.size(0), dtype=torch.long, device=x.device)
    if torch_cluster is not None:
        return torch_cluster.knn_graph(x, k, batch, loop=loop)
    parts = []
    for b in torch.unique(batch):
        idx = (batch == b).nonzero().view(-1)
        d = torch.cdist(x[idx].detach(), x[idx].detach())
        if not loop:
            d.fill_diagonal_(float("inf"))
        kk = min(k, idx.numel() - (0 if loop else 1))
        nbr = d.topk(kk, dim=1, largest=False).indices
        dst = torch.arange(idx.numel(), device=x.device).repeat_interleave(kk)
        parts.append(torch.stack([idx[nbr.reshape(-1)], idx[dst]]))
    return torch.cat(parts, dim=1)


# ============================================================== DGCNN, PointNet++
class DynamicEdgeConv(torch.nn.Module):
    """PyG's :class:`~torch_geometric.nn.conv.DynamicEdgeConv` (an ``EdgeConv`` on
    the kNN graph of its input, each point among its own ``k`` neighbours) with the
    graph from :func:`feature_knn_graph` (``torch_cluster``): PyG 2.8 takes its
    ``knn`` from pyg-lib, which PyPI does not carry."""

    def __init__(self, nn: torch.nn.Module, k: int, aggr: str = "max") -> None:
        super().__init__()
        self.conv, self.k = EdgeConv(nn, aggr=aggr), k

    def forward(self, x: Tensor, batch: Tensor) -> Tensor:
        return self.conv(x, feature_knn_graph(x, self.k, batch, loop=True))


class DGCNN(torch.nn.Module):
    """PyG's ``examples/dgcnn_classification.py`` at width ``w`` (there 64):
    EdgeConv MLP ``[6, w, w]`` and ``[2w, 2w]`` on dynamic kNN graphs, a linear map
    to ``4w``, global max pooling, MLP ``[4w, 2w, classes]`` with dropout 0.5.

    Args:
        num_classes (int): Output size.
        w (int): Width.
        k (int, optional): Neighbours of the dynamic graphs. (default: :obj:`16`)

    Shapes:
        - **input:** ``pos`` :math:`(N, 3)`, ``batch`` :math:`(N)`
        - **output:** :math:`(\\text{num\\_clouds}, \\text{num\\_classes})`
    """

    def __init__(self, num_classes: int, w: int, k: int = 16) -> None:
        super().__init__()
        self.num_classes, self.w, self.k = num_classes, w, k
        self.conv1 = DynamicEdgeConv(MLP([6, w, w]), k, "max")
        self.conv2 = DynamicEdgeConv(MLP([2 * w, 2 * w]), k, "max")
        self.lin1 = torch.nn.Linear(3 * w, 4 * w)
        self.mlp = MLP([4 * w, 2 * w, num_classes], dropout=0.5, norm=None)

    def forward(self, pos: Tensor, batch: Optional[Tensor] = None) -> Tensor:
        batch = _batch_of(pos, batch)
        x1 = self.conv1(pos, batch)
        x2 = self.conv2(x1, batch)
        out = global_max_pool(self.lin1(torch.cat([x1, x2], 1)), batch)
        return self.mlp(out)


class SetAbstraction(torch.nn.Module):
    """One PointNet++ set abstraction: farthest point sampling (``ratio``), a
    radius-``r`` ball (at most 64 neighbours) and a :class:`PointNetConv`."""

    def __init__(self, ratio: float, r: float, nn: torch.nn.Module) -> None:
        super().__init__()
        self.ratio, self.r = ratio, r
        self.conv = PointNetConv(nn, add_self_loops=False)

    def forward(self, x: Optional[Tensor], pos: Tensor, batch: Tensor
                ) -> Tuple[Tensor, Tensor, Tensor]:
        if torch_cluster is None:
            raise RuntimeError("PointNet2 needs torch_cluster (fps, radius)")
        # fps and radius of torch_cluster (PyG 2.8's own need pyg-lib). A random
        # first point while training (as in PyG's example), a fixed one in tests.
        idx = torch_cluster.fps(pos, batch, ratio=self.ratio, random_start=self.training)
        row, col = torch_cluster.radius(pos, pos[idx], self.r, batch, batch[idx],
                                        max_num_neighbors=64)
        edge_index = torch.stack([col, row], dim=0)
        x_dst = None if x is None else x[idx]
        x = self.conv((x, x_dst), (pos, pos[idx]), edge_index)
        return x, pos[idx], batch[idx]


class PointNet2(torch.nn.Module):
    """PyG's ``examples/pointnet2_classification.py`` at width ``w`` (there 64):
    set abstraction (ratio 0.5, r 0.2, MLP ``[3, w, 2w]``), (0.25, 0.4,
    ``[2w+3, 2w, 4w]``), a global MLP ``[4w+3, 4w, 8w]`` with max pooling and an
    MLP ``[8w, 4w, classes]`` with dropout 0.5.

    Args:
        num_classes (int): Output size.
        w (int): Width.

    Shapes:
        - **input:** ``pos`` :math:`(N, 3)`, ``batch`` :math:`(N)`
        - **output:** :math:`(\\text{num\\_clouds}, \\text{num\\_classes})`
    """

    def __init__(self, num_classes: int, w: int) -> None:
        super().__init__()
        self.num_classes, self.w = num_classes, w
        self.sa1 = SetAbstraction(0.5, 0.2, MLP([3, w, 2 * w]))
        self.sa2 = SetAbstraction(0.25, 0.4, MLP([2 * w + 3, 2 * w, 4 * w]))
        self.sa3 = MLP([4 * w + 3, 4 * w, 8 * w])
        self.mlp = MLP([8 * w, 4 * w, num_classes], dropout=0.5, norm=None)

    def forward(self, pos: Tensor, batch: Optional[Tensor] = None) -> Tensor:
        batch = _batch_of(pos, batch)
        x, p, b = self.sa1(None, pos, batch)
        x, p, b = self.sa2(x, p, b)
        x = global_max_pool(self.sa3(torch.cat([x, p], 1)), b)
        return self.mlp(x)


def _batch_of(pos: Tensor, batch: Optional[Tensor]) -> Tensor:
    if pos.dim() != 2 or pos.size(1) != 3:
        raise ValueError(f"pos must be [num_points, 3], got {tuple(pos.shape)}")
    if batch is None:
        return torch.zeros(pos.size(0), dtype=torch.long, device=pos.device)
    return batch


# ============================================================== Vector Neurons
EPS = 1e-6


class VNLinear(torch.nn.Module):
    r"""Vector-neuron linear map :math:`\mathbf{V}' = W \mathbf{V}`, with
    :math:`W \in \mathbb{R}^{C' \times C}` acting on the channels of
    :math:`\mathbf{V} \in \mathbb{R}^{C \times 3}` (no bias: a bias would not
    rotate). Equivariant: :math:`W (\mathbf{V} R^\top) = (W \mathbf{V}) R^\top`.

    Shapes:
        - **input:** :math:`(*, C, 3)`
        - **output:** :math:`(*, C', 3)`
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.lin = torch.nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x.transpose(-1, -2)).transpose(-1, -2)


class VNLeakyReLU(torch.nn.Module):
    r"""Vector-neuron leaky ReLU: a learned direction
    :math:`\mathbf{k} = U \mathbf{V}` per channel; a vector :math:`\mathbf{v}`
    pointing into the half-space of :math:`\mathbf{k}` is kept, otherwise its
    component along :math:`\mathbf{k}` is removed, and the result is mixed with
    :math:`\mathbf{v}` by the slope :math:`\alpha`:

    .. math::
        \mathbf{v}' = \alpha \mathbf{v} + (1 - \alpha)\left(\mathbf{v} -
        [\langle\mathbf{v},\mathbf{k}\rangle < 0]\,
        \frac{\langle\mathbf{v},\mathbf{k}\rangle}{\lVert\mathbf{k}\rVert^2 +
        \epsilon}\mathbf{k}\right)

    Shapes:
        - **input:** :math:`(*, C, 3)`
        - **output:** :math:`(*, C, 3)`
    """

    def __init__(self, channels: int, negative_slope: float = 0.2) -> None:
        super().__init__()
        self.channels, self.negative_slope = channels, negative_slope
        self.direction = VNLinear(channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        d = self.direction(x)
        dot = (x * d).sum(-1, keepdim=True)
        norm2 = (d * d).sum(-1, keepdim=True)
        cut = x - torch.where(dot < 0, dot / (norm2 + EPS), torch.zeros_like(dot)) * d
        return self.negative_slope * x + (1 - self.negative_slope) * cut


class VNBatchNorm(torch.nn.Module):
    r"""Vector-neuron batch norm: :class:`torch.nn.BatchNorm1d` on the norms
    :math:`\lVert\mathbf{v}_c\rVert` (invariant), the directions kept.

    Shapes:
        - **input:** :math:`(N, C, 3)`
        - **output:** :math:`(N, C, 3)`
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        self.bn = torch.nn.BatchNorm1d(channels)

    def forward(self, x: Tensor) -> Tensor:
        norm = x.norm(dim=-1) + EPS
        return x / norm[..., None] * self.bn(norm)[..., None]


class VNBlock(torch.nn.Sequential):
    """:class:`VNLinear`, :class:`VNBatchNorm`, :class:`VNLeakyReLU`."""

    def __init__(self, in_channels: int, out_channels: int, negative_slope: float = 0.2
                 ) -> None:
        super().__init__(VNLinear(in_channels, out_channels), VNBatchNorm(out_channels),
                         VNLeakyReLU(out_channels, negative_slope))


class VNEdgeConv(torch.nn.Module):
    r"""Vector-neuron edge convolution (VN-DGCNN): on the kNN graph of the
    features (distances of the flattened vectors: invariant), every edge
    :math:`j \to i` carries :math:`[\mathbf{V}_j - \mathbf{V}_i, \mathbf{V}_i]`
    (and, with ``cross``, :math:`\mathbf{V}_j \times \mathbf{V}_i`, equivariant
    under rotations), mapped by a :class:`VNBlock` and mean-aggregated
    (:func:`torch_geometric.utils.scatter`).

    Args:
        in_channels (int): Vector channels :math:`C`.
        out_channels (int): Vector channels :math:`C'`.
        k (int): Neighbours.
        cross (bool, optional): Add the cross product (the first layer of
            VN-DGCNN, on the positions). (default: :obj:`False`)

    Shapes:
        - **input:** :math:`(N, C, 3)`, ``batch`` :math:`(N)`
        - **output:** :math:`(N, C', 3)`
    """

    def __init__(self, in_channels: int, out_channels: int, k: int,
                 cross: bool = False) -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.k, self.cross = (
            in_channels, out_channels, k, cross)
        self.block = VNBlock((3 if cross else 2) * in_channels, out_channels)

    def forward(self, x: Tensor, batch: Tensor) -> Tensor:
        src, dst = feature_knn_graph(x.reshape(x.size(0), -1), self.k, batch, loop=False)
        xi, xj = x[dst], x[src]
        parts = [xj - xi, xi]
        if self.cross:
            parts.append(torch.linalg.cross(xj, xi, dim=-1))
        msg = self.block(torch.cat(parts, dim=1))
        return scatter(msg, dst, dim=0, dim_size=x.size(0), reduce="mean")


class VNInvariant(torch.nn.Module):
    r"""The VN invariant layer: a learned equivariant frame
    :math:`Z = \mathrm{VN}(\mathbf{V}) \in \mathbb{R}^{3 \times 3}` per point
    (rows rotating with the cloud) and the invariant product
    :math:`\mathbf{V} Z^\top` (:math:`\mathbf{V} R^\top R Z^\top = \mathbf{V}
    Z^\top`).

    Shapes:
        - **input:** :math:`(N, C, 3)`
        - **output:** :math:`(N, 3C)` (invariant)
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        half = max(channels // 2, 1)
        self.frame = torch.nn.Sequential(VNBlock(channels, half), VNLinear(half, 3))

    def forward(self, x: Tensor) -> Tensor:
        z = self.frame(x)  # [N, 3, 3]
        return torch.einsum("nci,nki->nck", x, z).reshape(x.size(0), -1)


#: Vector channels of :class:`VNDGCNN` at ``scale = 1``: the four edge
#: convolutions and the embedding. VN-DGCNN divides DGCNN's widths by 3
#: (64, 64, 128, 256, 1024 -> 21, 21, 42, 85, 341); these are the narrow
#: starting point that :func:`matched_vn_dgcnn` scales.
VN_BASE_WIDTHS: Tuple[int, ...] = (21, 21, 42, 85, 341)


class VNDGCNN(torch.nn.Module):
    r"""Vector Neurons DGCNN (Deng et al. 2021), rotation invariant.

    The cloud is centred (its mean subtracted, per cloud: the model is then
    translation invariant too), each point enters as one vector channel
    :math:`\mathbf{p}_i`. Edge convolutions (:class:`VNEdgeConv`: the first on
    the positions' kNN graph with the cross product, the others on the
    features' kNN graphs) are concatenated, mapped by a :class:`VNBlock` to the
    embedding width, joined with their per-cloud mean (VN mean pooling), made
    invariant by :class:`VNInvariant`, max- and mean-pooled per cloud and
    classified by an MLP (dropout 0.5) whose hidden sizes keep Deng et al.'s
    proportions (4,092 -> 512 -> 256 at full width: a quarter and an eighth of
    the invariant feature size).

    :math:`f(\mathbf{P} R^\top + \mathbf{t}) = f(\mathbf{P})` for every
    rotation :math:`R` and translation :math:`\mathbf{t}` (up to rounding and
    kNN ties).

    Args:
        num_classes (int): Output size.
        widths (sequence of int, optional): Vector channels of the edge
            convolutions and the embedding (at least two entries: the last is the
            embedding). (default: :data:`VN_BASE_WIDTHS`)
        k (int, optional): Neighbours. (default: :obj:`20`)
        dropout (float, optional): Dropout of the MLP. (default: :obj:`0.5`)

    Shapes:
        - **input:** ``pos`` :math:`(N, 3)`, ``batch`` :math:`(N)`
        - **output:** :math:`(\text{num\_clouds}, \text{num\_classes})`
    """

    def __init__(self, num_classes: int, widths: Sequence[int] = VN_BASE_WIDTHS,
                 k: int = 20, dropout: float = 0.5) -> None:
        super().__init__()
        widths = tuple(int(w) for w in widths)
        if len(widths) < 2 or min(widths) < 1:
            raise ValueError(f"VNDGCNN: widths needs >= 2 positive entries, got {widths}")
        self.num_classes, self.widths, self.k, self.dropout = num_classes, widths, k, dropout
        convs, c = [], 1
        for i, w in enumerate(widths[:-1]):
            convs.append(VNEdgeConv(c, w, k, cross=(i == 0)))
            c = w
        self.convs = torch.nn.ModuleList(convs)
        emb = widths[-1]
        self.embed = VNBlock(sum(widths[:-1]), emb)
        self.invariant = VNInvariant(2 * emb)
        inv = 2 * emb * 3
        # Deng et al.'s head at full width: 4,092 -> 512 -> 256 -> classes, i.e.
        # hidden sizes of about inv / 4 and inv / 8 (inv = 2,046 there).
        self.mlp = MLP([2 * inv, max(inv // 4, num_classes), max(inv // 8, num_classes),
                        num_classes], dropout=dropout, norm="batch_norm", act="leaky_relu",
                       act_kwargs={"negative_slope": 0.2})

    def forward(self, pos: Tensor, batch: Optional[Tensor] = None) -> Tensor:
        batch = _batch_of(pos, batch)
        num_clouds = int(batch.max()) + 1
        p = pos - scatter(pos, batch, 0, dim_size=num_clouds, reduce="mean")[batch]
        x = p.unsqueeze(1)  # [N, 1, 3]
        outs = []
        for conv in self.convs:
            x = conv(x, batch)
            outs.append(x)
        x = self.embed(torch.cat(outs, dim=1))
        mean = scatter(x, batch, 0, dim_size=num_clouds, reduce="mean")[batch]
        inv = self.invariant(torch.cat([x, mean], dim=1))
        pooled = torch.cat([global_max_pool(inv, batch, num_clouds),
                            global_mean_pool(inv, batch, num_clouds)], dim=-1)
        return self.mlp(pooled)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.num_classes}, widths={self.widths}, k={self.k})"


def matched_vn_dgcnn(num_classes: int, target_params: int, k: int = 20,
                     tol: float = 0.05) -> VNDGCNN:
    """A :class:`VNDGCNN` whose parameter count matches ``target_params`` within
    ``tol``: :data:`VN_BASE_WIDTHS` scaled by
    :func:`~qsv_pyg.models.matching.match_width` (dithered rounding,
    :func:`~qsv_pyg.models.matching.scale_widths`)."""
    model, _ = match_width(
        lambda s: VNDGCNN(num_classes, scale_widths(VN_BASE_WIDTHS, s, 1), k), target_params,
        tol=tol)
    return model


def matched_width_model(build: Callable[[int], torch.nn.Module], base_width: int,
                        target_params: int, tol: float = 0.05) -> torch.nn.Module:
    """``build(w)`` (one integer width, as :class:`DGCNN` and :class:`PointNet2`)
    with ``w = round(base_width * scale)`` and the scale found by
    :func:`~qsv_pyg.models.matching.match_width`."""
    model, _ = match_width(lambda s: build(max(1, round(base_width * s))), target_params,
                           tol=tol)
    return model


def num_params(model: torch.nn.Module) -> int:
    return count_parameters(model)
