"""Fibonacci spheres and concentric shells of them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from qsv_pyg.geometry.hierarchy import Hierarchy, _check_level_k, _check_level_sizes
from qsv_pyg.geometry.knn import knn_cross, knn_within
from qsv_pyg.geometry.lambert import sphere_to_square
from qsv_pyg.utils import is_positive_int

# pi * (3 - sqrt(5)): successive points turn by this azimuth, which never lines up
# with earlier ones and so spreads the points evenly in longitude.
GOLDEN_ANGLE = math.pi * (3.0 - math.sqrt(5.0))


def fibonacci_sphere(
    n: int,
    radius: float = 1.0,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> Tensor:
    r"""Golden-angle (Fibonacci) lattice of :obj:`n` points on a sphere.

    Point :math:`i` has height :math:`z_i = 1 - (2i + 1)/n` (so every point
    owns a band of equal area :math:`4\pi/n`) and azimuth
    :math:`\phi_i = i \cdot \pi(3 - \sqrt{5})`. Points run from near the
    north pole (:math:`z \to +1`) to near the south pole.

    Args:
        n (int): Number of points, :math:`n > 0`.
        radius (float, optional): Sphere radius, :math:`> 0`. (default: :obj:`1.0`)
        dtype (torch.dtype, optional): Output dtype. (default:
            :obj:`torch.get_default_dtype()`, i.e. :obj:`torch.float32`)
        device (torch.device, optional): Output device. (default: CPU)

    Returns:
        Tensor: Positions of shape :obj:`[n, 3]`, each of norm :obj:`radius`.

    Raises:
        ValueError: If :obj:`n <= 0` or :obj:`radius <= 0`.
    """
    if not is_positive_int(n):
        raise ValueError(f"fibonacci_sphere: n must be a positive int, got {n!r}")
    if not (radius > 0 and math.isfinite(radius)):
        raise ValueError(f"fibonacci_sphere: radius must be positive and finite, got {radius!r}")
    dtype = dtype or torch.get_default_dtype()

    # Computed in float64 so the azimuth i * golden_angle stays accurate for large n.
    i = torch.arange(n, dtype=torch.float64)
    z = 1.0 - (2.0 * i + 1.0) / n
    rho = torch.sqrt((1.0 - z * z).clamp_min(0.0))
    phi = torch.remainder(i * GOLDEN_ANGLE, 2.0 * math.pi)
    pos = torch.stack([rho * torch.cos(phi), rho * torch.sin(phi), z], dim=-1)
    return (radius * pos).to(dtype=dtype, device=device)


@dataclass(frozen=True)
class ShellSpec:
    r"""Sizes and radii of concentric Fibonacci shells, outer shell first.

    The default sizes :math:`(16^2, 12^2, 8^2, 6^2, 4^2)` match
    :class:`~qsv_pyg.geometry.LatticeSpec` level by level, so the flat-lattice
    control has exactly the same node count per level.

    Args:
        sizes (tuple[int, ...]): Points per shell, positive and non-increasing.
            (default: :obj:`(256, 144, 64, 36, 16)`)
        radii (tuple[float, ...]): Shell radii, positive and strictly
            decreasing from outer (level 0) to inner. (default:
            :obj:`(1.0, 0.8, 0.6, 0.4, 0.2)`)

    Raises:
        ValueError: If the two tuples differ in length, are empty, or violate
            the constraints above.
    """

    sizes: Tuple[int, ...] = (256, 144, 64, 36, 16)
    radii: Tuple[float, ...] = (1.0, 0.8, 0.6, 0.4, 0.2)

    def __post_init__(self) -> None:
        # Accept any sequence but store tuples so the spec stays hashable.
        sizes = tuple(self.sizes)
        radii = tuple(float(r) for r in self.radii)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "radii", radii)

        _check_level_sizes("ShellSpec", "sizes", sizes, unit="shell")
        if len(sizes) != len(radii):
            raise ValueError(
                f"ShellSpec: sizes and radii must have the same length, "
                f"got {len(sizes)} sizes and {len(radii)} radii"
            )
        for s, r in enumerate(radii):
            if not (r > 0 and math.isfinite(r)):
                raise ValueError(f"ShellSpec: radii[{s}] must be positive and finite, got {r!r}")
        for s in range(1, len(radii)):
            if radii[s] >= radii[s - 1]:
                raise ValueError(
                    f"ShellSpec: radii must be strictly decreasing from outer to inner, "
                    f"got radii[{s - 1}]={radii[s - 1]} <= radii[{s}]={radii[s]}"
                )

    @property
    def num_levels(self) -> int:
        """Number of shells."""
        return len(self.sizes)


def build_shells(
    spec: ShellSpec = ShellSpec(),
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> List[Tensor]:
    r"""Positions of every shell of :obj:`spec`.

    Args:
        spec (ShellSpec, optional): Shell sizes and radii. (default:
            :obj:`ShellSpec()`)
        dtype (torch.dtype, optional): Output dtype. (default:
            :obj:`torch.get_default_dtype()`)
        device (torch.device, optional): Output device. (default: CPU)

    Returns:
        list[Tensor]: :obj:`spec.num_levels` tensors, the :math:`s`-th of shape
        :obj:`[spec.sizes[s], 3]` with norm :obj:`spec.radii[s]`; index 0 is
        the outer shell.
    """
    return [
        fibonacci_sphere(n, r, dtype=dtype, device=device)
        for n, r in zip(spec.sizes, spec.radii)
    ]


def build_shell_hierarchy(
    spec: ShellSpec = ShellSpec(),
    k_cross: int = 8,
    k_inner: int = 8,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> Hierarchy:
    r"""Concentric Fibonacci shells wired into a :class:`Hierarchy`.

    * :obj:`cross_edges[s]`: every node of shell :math:`s + 1` receives its
      :obj:`k_cross` nearest nodes of shell :math:`s`, measured between unit
      directions (the shells have different radii), see
      :func:`~qsv_pyg.geometry.knn_cross`.
    * :obj:`inner_edges`: :obj:`k_inner`-NN graph of the innermost shell.
    * :obj:`image_coords`: :func:`~qsv_pyg.geometry.sphere_to_square` of the
      outer shell's directions, so the outer nodes sample the image with equal
      area each; the north pole looks at the image centre.

    The graph is computed once on CPU in float64 and then cast, so it does not
    depend on :obj:`dtype` or :obj:`device`.

    Args:
        spec (ShellSpec, optional): Shell sizes and radii. (default:
            :obj:`ShellSpec()`)
        k_cross (int, optional): Level-:math:`s` neighbours per
            level-:math:`(s+1)` node. (default: :obj:`8`)
        k_inner (int, optional): Neighbours per innermost node. (default: :obj:`8`)
        dtype (torch.dtype, optional): dtype of :obj:`pos` and
            :obj:`image_coords`. (default: :obj:`torch.get_default_dtype()`)
        device (torch.device, optional): Device of every tensor. (default: CPU)

    Returns:
        Hierarchy: With :obj:`kind="shells"` and 3-D positions.

    Raises:
        ValueError: If :obj:`k_cross` exceeds the size of some shell
            :math:`s < L - 1`, or :obj:`k_inner` is not below the innermost size.
    """
    _check_level_k(spec.sizes, k_cross, k_inner)
    dtype = dtype or torch.get_default_dtype()
    shells = build_shells(spec, dtype=torch.float64)
    cross = [
        knn_cross(shells[s], shells[s + 1], k_cross, by_direction=True).to(device)
        for s in range(len(shells) - 1)
    ]
    inner = knn_within(shells[-1], k_inner).to(device)
    # Rounding can put a boundary point a hair outside the square.
    image_coords = sphere_to_square(shells[0]).clamp(-1.0, 1.0)
    return Hierarchy(
        kind="shells",
        pos=[p.to(dtype=dtype, device=device) for p in shells],
        cross_edges=cross,
        inner_edges=inner,
        image_coords=image_coords.to(dtype=dtype, device=device),
        k_cross=k_cross,
        k_inner=k_inner,
    )
