"""The multi-level graph shared by the shell and lattice models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from qsv_pyg.utils import is_positive_int

__all__ = ["Hierarchy"]

KINDS = ("shells", "lattice")


def _level(s: int) -> str:
    return f"level{s}"


@dataclass
class Hierarchy:
    r"""Node positions and kNN edges of a coarse-to-fine stack of levels.

    Level 0 is the outer (input) level that samples the image; level
    :math:`L-1` is the innermost. Both :func:`~qsv_pyg.geometry.build_shell_hierarchy`
    and :func:`~qsv_pyg.geometry.build_lattice_hierarchy` return this object,
    so models are agnostic to the geometry. All edge tensors follow the layout
    of :func:`~qsv_pyg.geometry.knn_cross`: row 0 source, row 1 target,
    target-sorted, exactly :obj:`k` per target, so
    :func:`~qsv_pyg.geometry.dense_neighbors` applies to each of them.

    Args:
        kind (str): :obj:`"shells"` or :obj:`"lattice"`.
        pos (list[Tensor]): Per level, positions :obj:`[N_s, D]` (:obj:`D = 3`
            for shells, :obj:`2` for lattices).
        cross_edges (list[Tensor]): :math:`L - 1` tensors;
            :obj:`cross_edges[s]` is :obj:`[2, N_{s+1} * k_cross]` with sources
            in level :math:`s` and targets in level :math:`s + 1`.
        inner_edges (Tensor): :obj:`[2, N_{L-1} * k_inner]` kNN edges within the
            innermost level, without self loops.
        image_coords (Tensor): :obj:`[N_0, 2]` sampling locations :math:`(x, y)`
            of the level-0 nodes in :math:`[-1, 1]^2`, in the convention of
            :func:`torch.nn.functional.grid_sample` with
            :obj:`align_corners=False` (:math:`x` along the width, :math:`y`
            along the height, :math:`(-1, -1)` the top-left image corner).
        k_cross (int): Sources per target of every cross-level edge set.
        k_inner (int): Sources per target of :obj:`inner_edges`.
    """

    kind: str
    pos: List[Tensor]
    cross_edges: List[Tensor]
    inner_edges: Tensor
    image_coords: Tensor
    k_cross: int
    k_inner: int

    def __post_init__(self) -> None:
        # Shape checks only: cheap, and they catch a hand-assembled hierarchy
        # whose levels do not line up before a model indexes out of range.
        if self.kind not in KINDS:
            raise ValueError(f"Hierarchy: kind must be one of {KINDS}, got {self.kind!r}")
        self.pos = list(self.pos)
        self.cross_edges = list(self.cross_edges)
        if len(self.pos) == 0:
            raise ValueError("Hierarchy: at least one level is required")
        if len(self.cross_edges) != len(self.pos) - 1:
            raise ValueError(
                f"Hierarchy: {len(self.pos)} levels need {len(self.pos) - 1} cross edge "
                f"sets, got {len(self.cross_edges)}"
            )
        sizes = self.sizes
        for s, ei in enumerate(self.cross_edges):
            expected = (2, sizes[s + 1] * self.k_cross)
            if tuple(ei.shape) != expected:
                raise ValueError(
                    f"Hierarchy: cross_edges[{s}] (level{s} -> level{s + 1}) must have "
                    f"shape {expected}, got {tuple(self.cross_edges[s].shape)}"
                )
        expected = (2, sizes[-1] * self.k_inner)
        if tuple(self.inner_edges.shape) != expected:
            raise ValueError(
                f"Hierarchy: inner_edges must have shape {expected}, "
                f"got {tuple(self.inner_edges.shape)}"
            )
        if tuple(self.image_coords.shape) != (sizes[0], 2):
            raise ValueError(
                f"Hierarchy: image_coords must have shape {(sizes[0], 2)}, "
                f"got {tuple(self.image_coords.shape)}"
            )

    @property
    def num_levels(self) -> int:
        """Number of levels :math:`L`."""
        return len(self.pos)

    @property
    def sizes(self) -> Tuple[int, ...]:
        """Node count :math:`N_s` of every level, outer first."""
        return tuple(int(p.size(0)) for p in self.pos)

    def to(self, device: torch.device | str) -> "Hierarchy":
        """Copy with every tensor moved to :obj:`device` (dtypes unchanged)."""
        return Hierarchy(
            kind=self.kind,
            pos=[p.to(device) for p in self.pos],
            cross_edges=[e.to(device) for e in self.cross_edges],
            inner_edges=self.inner_edges.to(device),
            image_coords=self.image_coords.to(device),
            k_cross=self.k_cross,
            k_inner=self.k_inner,
        )

    def to_hetero_data(self) -> HeteroData:
        r"""Export as a :class:`~torch_geometric.data.HeteroData`.

        Node types are :obj:`"level0"`, ..., :obj:`"level{L-1}"` with
        attribute :obj:`pos` (and :obj:`image_coords` on :obj:`"level0"`);
        edge types are :obj:`("level{s}", "to", "level{s+1}")` and
        :obj:`("level{L-1}", "near", "level{L-1}")`; :obj:`kind`,
        :obj:`k_cross` and :obj:`k_inner` are graph-level attributes.
        :meth:`from_hetero_data` inverts this.

        Returns:
            HeteroData: The hierarchy, sharing tensors with :obj:`self`.
        """
        data = HeteroData()
        data.kind = self.kind
        data.k_cross = self.k_cross
        data.k_inner = self.k_inner
        for s, p in enumerate(self.pos):
            data[_level(s)].pos = p
            data[_level(s)].num_nodes = int(p.size(0))
        data[_level(0)].image_coords = self.image_coords
        for s, ei in enumerate(self.cross_edges):
            data[_level(s), "to", _level(s + 1)].edge_index = ei
        last = _level(self.num_levels - 1)
        data[last, "near", last].edge_index = self.inner_edges
        return data

    @classmethod
    def from_hetero_data(cls, data: HeteroData) -> "Hierarchy":
        """Rebuild a :class:`Hierarchy` from :meth:`to_hetero_data` output."""
        num_levels = len(data.node_types)
        last = _level(num_levels - 1)
        return cls(
            kind=data.kind,
            pos=[data[_level(s)].pos for s in range(num_levels)],
            cross_edges=[
                data[_level(s), "to", _level(s + 1)].edge_index for s in range(num_levels - 1)
            ],
            inner_edges=data[last, "near", last].edge_index,
            image_coords=data[_level(0)].image_coords,
            k_cross=int(data.k_cross),
            k_inner=int(data.k_inner),
        )


def _check_level_sizes(owner: str, name: str, values: Tuple[int, ...], unit: str = "level") -> None:
    """Raise a ValueError unless :obj:`values` (one entry per level, outer first) is
    non-empty and holds positive ints that never grow inwards."""
    if len(values) == 0:
        raise ValueError(f"{owner}: at least one {unit} is required")
    for s, n in enumerate(values):
        if not is_positive_int(n):
            raise ValueError(f"{owner}: {name}[{s}] must be a positive int, got {n!r}")
    for s in range(1, len(values)):
        if values[s] > values[s - 1]:
            raise ValueError(
                f"{owner}: {name} must be non-increasing from outer to inner, "
                f"got {name}[{s - 1}]={values[s - 1]} < {name}[{s}]={values[s]}"
            )


def _check_level_k(sizes: Sequence[int], k_cross: int, k_inner: int) -> None:
    """Raise a ValueError naming the first level too small for the requested k."""
    for name, k in (("k_cross", k_cross), ("k_inner", k_inner)):
        if not is_positive_int(k):
            raise ValueError(f"{name} must be a positive int, got {k!r}")
    for s in range(len(sizes) - 1):
        if k_cross > sizes[s]:
            raise ValueError(
                f"k_cross={k_cross} is too large for level {s} ({sizes[s]} nodes): every "
                f"level{s + 1} node needs k_cross distinct level{s} neighbours"
            )
    s = len(sizes) - 1
    if k_inner > sizes[s] - 1:
        raise ValueError(
            f"k_inner={k_inner} is too large for level {s} ({sizes[s]} nodes): the inner "
            f"kNN graph excludes self loops, so k_inner <= {sizes[s] - 1}"
        )

