r"""PyG transforms that prepare point clouds for rotation-invariant models.

They are :class:`torch_geometric.transforms.BaseTransform` subclasses and
compose with PyG's own (:class:`~torch_geometric.transforms.Compose`,
``pre_transform``, :class:`~torch_geometric.transforms.SamplePoints`,
:class:`~torch_geometric.transforms.NormalizeScale`)::

    import torch_geometric.transforms as T
    import qsv_pyg.transforms as QT

    transform = T.Compose([QT.NormalizeRadius(), QT.KNNGraph(k=20),
                           QT.LocalFrames(), QT.InvariantFeatures()])

* :class:`RandomAxisScale`: an anisotropic scaling for training (a fresh factor
  per axis in every call; put it in ``transform``, not ``pre_transform``); the
  recommended recipe is now a fresh draw of the points without it;
* :class:`NormalizeRadius`: centre and scale to the unit ball, a rotation-invariant
  :class:`~torch_geometric.transforms.NormalizeScale` (which divides by the
  largest *coordinate*, so its scale changes when the cloud rotates);
* :class:`KNNGraph`: the canonical kNN graph (``data.edge_index``);
* :class:`LocalFrames`: every point's frame and quaternion
  (``data.frame [N, 3, 3]``, ``data.quat [N, 4]``, ``data.frame_ambiguous [N]``,
  ``data.frame_eigenvalues [N, 3]``), by the rule of
  :func:`~qsv_pyg.geometry.oriented_frames`;
* :class:`InvariantFeatures`: invariant node features (``data.x [N, 8]``) and
  point-pair edge features (``data.edge_attr [E, 8]``), see
  :func:`~qsv_pyg.transforms.functional.invariant_node_features` and
  :func:`~qsv_pyg.transforms.functional.point_pair_features`.

Put rotations and other geometric augmentations *before* them: the frames and
features are computed from the positions as they are when the transform runs.
:class:`~qsv_pyg.nn.models.QSVGeometric` reads the graph and frames from a batch
when :class:`KNNGraph` and :class:`LocalFrames` put them there, and computes
them itself otherwise.
"""
from __future__ import annotations


import torch
from torch_geometric.data import Data
from torch_geometric.transforms import BaseTransform

from qsv_pyg.geometry.frames import FRAME_RULES, matrix_to_quaternion, oriented_frames
from qsv_pyg.transforms import functional
from qsv_pyg.transforms.functional import (
    EDGE_FEATURES,
    NODE_FEATURES,
    invariant_node_features,
    knn_graph,
    point_pair_features,
)

#: :class:`RandomAxisScale`'s default interval: the DGCNN recipe's anisotropic
#: scaling, which the ModelNet10 table's augmented rows use (``SCALE_RANGE``).
AXIS_SCALES = (2.0 / 3.0, 3.0 / 2.0)

__all__ = ["RandomAxisScale", "AXIS_SCALES", "NormalizeRadius", "KNNGraph", "LocalFrames", "InvariantFeatures", "functional",
           "NODE_FEATURES", "EDGE_FEATURES"]


def _need(data: Data, names, transform: str, hint: str) -> None:
    missing = [name for name in names if getattr(data, name, None) is None]
    if missing:
        raise ValueError(f"{transform}: data has no {', '.join(missing)} ({hint})")


class RandomAxisScale(BaseTransform):
    r"""Scales each axis of ``data.pos`` by its own factor, drawn uniformly
    from ``scales`` at every call (an anisotropic
    :class:`~torch_geometric.transforms.RandomScale`, which draws one factor
    for all axes, and that :class:`NormalizeRadius` would undo).

    An invariant model gains nothing from random rotations, but a shape
    stretched along its own axes is a new shape. It was the augmentation of
    the first recipe validation chose for :class:`~qsv_pyg.nn.models.QSVGeometric`
    on ModelNet10 (with a fresh draw of the points every epoch, e.g.
    :class:`~torch_geometric.transforms.SamplePoints` in ``transform``;
    docs/real_benchmarks.md, "Augmented rows"). The fresh draw alone, keeping
    the shapes' proportions, has since scored higher on validation on every
    seed ("The proportions lever"), so the recommended recipe leaves this
    transform out. The axes are the coordinates as given, so apply it before
    any rotation, then :class:`NormalizeRadius`, then :class:`KNNGraph` and
    :class:`LocalFrames`.

    Args:
        scales: ``(low, high)`` with ``0 < low <= high`` (default
            :data:`AXIS_SCALES`, ``(2/3, 3/2)``).
    """

    def __init__(self, scales=AXIS_SCALES) -> None:
        try:
            low, high = (float(v) for v in scales)
        except (TypeError, ValueError):
            raise ValueError(f"RandomAxisScale: scales must be a pair (low, high), "
                             f"got {scales!r}") from None
        if not (0 < low <= high < float("inf")):
            raise ValueError(f"RandomAxisScale: scales must satisfy 0 < low <= high, "
                             f"got {scales!r}")
        self.scales = (low, high)

    def forward(self, data: Data) -> Data:
        _need(data, ["pos"], "RandomAxisScale", "a point cloud needs data.pos")
        low, high = self.scales
        factor = low + (high - low) * torch.rand(data.pos.size(-1), device=data.pos.device)
        data.pos = data.pos * factor.to(data.pos.dtype)
        return data

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.scales})"


class NormalizeRadius(BaseTransform):
    r"""Centres ``data.pos`` (mean of the points) and scales it so that the
    farthest point is at distance 1 (times ``0.999999``, as PyG's
    :class:`~torch_geometric.transforms.NormalizeScale`).

    :class:`~torch_geometric.transforms.NormalizeScale` scales by the largest
    absolute *coordinate*, which changes when the cloud rotates (by up to a
    factor :math:`\sqrt{3}`): a rotated copy then has other distances, and no
    invariant model sees the same input. This transform uses the largest norm,
    which rotations keep. A cloud of one point (or of duplicates) is only
    centred.
    """

    def forward(self, data: Data) -> Data:
        _need(data, ["pos"], "NormalizeRadius", "a point cloud needs data.pos")
        pos = data.pos - data.pos.mean(dim=-2, keepdim=True)
        radius = pos.norm(dim=-1).max()
        if radius > 0:
            pos = pos * (0.999999 / radius)
        data.pos = pos
        return data

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class KNNGraph(BaseTransform):
    r"""Creates the k-nearest-neighbour graph of ``data.pos``, like
    :class:`torch_geometric.transforms.KNNGraph` but canonical: every point
    receives exactly :obj:`k` edges, nearest first, ties broken by the smaller
    index, distances in float64 (:func:`~qsv_pyg.transforms.functional.knn_graph`).
    Uses :mod:`torch_cluster` for the search when it is installed, exact brute
    force otherwise. Edges go ``source -> target`` (PyG's default flow);
    ``data.edge_attr`` is dropped (it belonged to another graph).

    Args:
        k (int, optional): Neighbours per point. (default: :obj:`20`)
        loop (bool, optional): A point may be its own neighbour.
            (default: :obj:`False`)
    """

    def __init__(self, k: int = 20, loop: bool = False) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"KNNGraph: k must be a positive int, got {k!r}")
        self.k = k
        self.loop = loop

    def forward(self, data: Data) -> Data:
        _need(data, ["pos"], "KNNGraph", "a point cloud needs data.pos")
        data.edge_attr = None
        data.edge_index = knn_graph(data.pos, self.k, getattr(data, "batch", None),
                                    loop=self.loop)
        return data

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(k={self.k})"


class LocalFrames(BaseTransform):
    r"""Computes every point's local frame and its quaternion with
    :func:`~qsv_pyg.geometry.oriented_frames` (float64) on ``data.edge_index``
    (run :class:`KNNGraph` first).

    Sets ``data.frame [N, 3, 3]`` (columns :math:`\mathbf{e}_1, \mathbf{e}_2,
    \mathbf{e}_3`, rotating with the cloud), ``data.quat [N, 4]`` (its unit
    quaternion, :math:`w \ge 0`, for :class:`~qsv_pyg.nn.QSVConv`'s ``quat``),
    ``data.frame_ambiguous [N]`` (bool: no equivariant frame exists there, see
    the rule) and ``data.frame_eigenvalues [N, 3]`` (the local covariance's,
    descending), in ``data.pos``'s dtype.

    Args:
        rule (str, optional): One of :data:`~qsv_pyg.geometry.FRAME_RULES`.
            (default: :obj:`"robust"`)
        tol (float, optional): Relative tolerance of the rule's decisions.
            (default: :obj:`1e-6`)
    """

    def __init__(self, rule: str = "robust", tol: float = 1e-6) -> None:
        if rule not in FRAME_RULES:
            raise ValueError(f"LocalFrames: rule={rule!r} is not one of {FRAME_RULES}")
        self.rule = rule
        self.tol = tol

    def forward(self, data: Data) -> Data:
        _need(data, ["pos", "edge_index"], "LocalFrames",
              "run qsv_pyg.transforms.KNNGraph first")
        out = oriented_frames(data.pos, data.edge_index, getattr(data, "batch", None),
                              rule=self.rule, tol=self.tol, num_nodes=data.pos.size(0))
        dtype = data.pos.dtype
        data.frame = out.frame.to(dtype)
        data.quat = matrix_to_quaternion(out.frame).to(dtype)
        data.frame_ambiguous = out.ambiguous
        data.frame_eigenvalues = out.eigenvalues.to(dtype)
        return data

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(rule={self.rule!r})"


class InvariantFeatures(BaseTransform):
    r"""Writes rotation- and translation-invariant node and edge features from
    ``data.pos``, ``data.edge_index`` and the frames of :class:`LocalFrames`:

    * ``data.x [N, 8]``: :func:`~qsv_pyg.transforms.functional.invariant_node_features`
      (distance to the centroid, the centroid ray in the point's frame, the
      neighbourhood's spread and eigenvalue ratios, the ambiguity mark);
    * ``data.edge_attr [E, 8]``: :func:`~qsv_pyg.transforms.functional.point_pair_features`
      (:math:`\lVert\mathbf{d}\rVert`, the unit offset in both endpoints'
      frames: the angles to each normal and the in-plane angles, and the
      cosine between the normals).

    Args:
        node (bool, optional): Write the node features. (default: :obj:`True`)
        edge (bool, optional): Write the edge features. (default: :obj:`True`)
        cat (bool, optional): Concatenate to existing ``x`` / ``edge_attr``
            instead of replacing them, as PyG's
            :class:`~torch_geometric.transforms.Distance` does.
            (default: :obj:`False`)
    """

    def __init__(self, node: bool = True, edge: bool = True, cat: bool = False) -> None:
        self.node = node
        self.edge = edge
        self.cat = cat

    def forward(self, data: Data) -> Data:
        _need(data, ["pos", "edge_index", "frame", "frame_ambiguous", "frame_eigenvalues"],
              "InvariantFeatures", "run qsv_pyg.transforms.KNNGraph and LocalFrames first")
        dtype = data.pos.dtype
        if self.node:
            x = invariant_node_features(data.pos, data.frame, data.frame_ambiguous,
                                        data.frame_eigenvalues,
                                        getattr(data, "batch", None)).to(dtype)
            old = getattr(data, "x", None)
            if self.cat and old is not None:
                x = torch.cat([old.view(x.size(0), -1).to(dtype), x], dim=-1)
            data.x = x
        if self.edge:
            e = point_pair_features(data.pos, data.edge_index, data.frame,
                                    data.frame_ambiguous).to(dtype)
            old = getattr(data, "edge_attr", None)
            if self.cat and old is not None:
                e = torch.cat([old.view(e.size(0), -1).to(dtype), e], dim=-1)
            data.edge_attr = e
        return data

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(node={self.node}, edge={self.edge})"
