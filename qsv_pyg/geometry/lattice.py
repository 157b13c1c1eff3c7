"""Flat square-lattice hierarchy: the Euclidean control for the shell model."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from qsv_pyg.geometry.hierarchy import Hierarchy, _check_level_k, _check_level_sizes
from qsv_pyg.geometry.knn import knn_cross, knn_within
from qsv_pyg.utils import is_positive_int

__all__ = ["LatticeSpec", "lattice_grid", "build_lattice_hierarchy"]


@dataclass(frozen=True)
class LatticeSpec:
    r"""Side lengths of square grids, outer (finest) level first.

    The default :math:`(16, 12, 8, 6, 4)` gives the node counts
    :math:`(256, 144, 64, 36, 16)` of the default
    :class:`~qsv_pyg.geometry.ShellSpec`.

    Args:
        sides (tuple[int, ...]): Grid side per level, positive and
            non-increasing. (default: :obj:`(16, 12, 8, 6, 4)`)

    Raises:
        ValueError: If :obj:`sides` is empty or violates the constraints.
    """

    sides: Tuple[int, ...] = (16, 12, 8, 6, 4)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sides", tuple(self.sides))
        _check_level_sizes("LatticeSpec", "sides", self.sides)

    @property
    def num_levels(self) -> int:
        """Number of levels."""
        return len(self.sides)

    @property
    def sizes(self) -> Tuple[int, ...]:
        """Node count per level, :math:`n_s^2`."""
        return tuple(n * n for n in self.sides)


def _grid_numerators(side: int) -> Tensor:
    """Integers 2c + 1 - side, i.e. cell centres in units of 1/side, row-major."""
    centres = 2 * torch.arange(side, dtype=torch.long) + 1 - side
    rows, cols = torch.meshgrid(centres, centres, indexing="ij")
    return torch.stack([cols.reshape(-1), rows.reshape(-1)], dim=-1)


def lattice_grid(
    side: int,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> Tensor:
    r"""Cell centres of a :obj:`side` x :obj:`side` grid on :math:`[-1, 1]^2`.

    Node :math:`r \cdot \text{side} + c` (row-major) sits at
    :math:`(x, y) = ((2c + 1)/\text{side} - 1,\ (2r + 1)/\text{side} - 1)`,
    the centre of patch :math:`(r, c)` in
    :func:`torch.nn.functional.grid_sample` coordinates with
    :obj:`align_corners=False`.

    Args:
        side (int): Cells per side, :math:`> 0`.
        dtype (torch.dtype, optional): Output dtype. (default:
            :obj:`torch.get_default_dtype()`)
        device (torch.device, optional): Output device. (default: CPU)

    Returns:
        Tensor: Positions of shape :obj:`[side * side, 2]`.
    """
    if not is_positive_int(side):
        raise ValueError(f"lattice_grid: side must be a positive int, got {side!r}")
    dtype = dtype or torch.get_default_dtype()
    return (_grid_numerators(side).to(torch.float64) / side).to(dtype=dtype, device=device)


def build_lattice_hierarchy(
    spec: LatticeSpec = LatticeSpec(),
    k_cross: int = 8,
    k_inner: int = 8,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> Hierarchy:
    r"""Stack of flat grids wired into a :class:`Hierarchy`.

    Level :math:`s` is :func:`lattice_grid` of :obj:`spec.sides[s]`; level 0 is
    the image patch grid and :obj:`image_coords` equals its positions. Cross and
    inner edges are Euclidean kNN in the plane
    (:func:`~qsv_pyg.geometry.knn_cross` with :obj:`by_direction=False`,
    :func:`~qsv_pyg.geometry.knn_within`).

    A regular grid has many exactly equidistant neighbours. To make the result
    exact and reproducible, the kNN runs on integer coordinates (centres scaled
    by the least common multiple of the two sides involved, exactly
    representable in float64), so ties are genuine ties and are broken towards
    the smaller, i.e. row-major-earlier, source index.

    Args:
        spec (LatticeSpec, optional): Grid sides. (default: :obj:`LatticeSpec()`)
        k_cross (int, optional): Level-:math:`s` neighbours per
            level-:math:`(s+1)` node. (default: :obj:`8`)
        k_inner (int, optional): Neighbours per innermost node. (default: :obj:`8`)
        dtype (torch.dtype, optional): dtype of :obj:`pos` and
            :obj:`image_coords`. (default: :obj:`torch.get_default_dtype()`)
        device (torch.device, optional): Device of every tensor. (default: CPU)

    Returns:
        Hierarchy: With :obj:`kind="lattice"` and 2-D positions.

    Raises:
        ValueError: If :obj:`k_cross` exceeds the size of some level
            :math:`s < L - 1`, or :obj:`k_inner` is not below the innermost size.
    """
    _check_level_k(spec.sizes, k_cross, k_inner)
    dtype = dtype or torch.get_default_dtype()
    sides = spec.sides

    def integer_pos(side: int, scale: int) -> Tensor:
        # (2c + 1 - side) * scale / side is an integer when side divides scale.
        return (_grid_numerators(side) * (scale // side)).to(torch.float64)

    cross: List[Tensor] = []
    for s in range(len(sides) - 1):
        scale = math.lcm(sides[s], sides[s + 1])
        src, dst = integer_pos(sides[s], scale), integer_pos(sides[s + 1], scale)
        cross.append(knn_cross(src, dst, k_cross, by_direction=False).to(device))
    inner = knn_within(integer_pos(sides[-1], sides[-1]), k_inner).to(device)

    pos = [lattice_grid(n, dtype=dtype, device=device) for n in sides]
    return Hierarchy(
        kind="lattice",
        pos=pos,
        cross_edges=cross,
        inner_edges=inner,
        image_coords=pos[0].clone(),
        k_cross=k_cross,
        k_inner=k_inner,
    )
