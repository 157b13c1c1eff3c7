r"""Equal-area maps between the unit sphere, the disk of radius 2 and the square.

The chain used to let sphere nodes sample an image is

.. code-block:: none

    unit sphere  --Lambert azimuthal-->  disk |d| <= 2  --concentric-->  square [-1, 1]^2

* The Lambert azimuthal equal-area projection is centred at the **north pole**
  :math:`(0, 0, 1)`: the north pole goes to the disk centre and the south pole
  (its antipode) to the rim :math:`|d| = 2`. With radius 2 the disk has area
  :math:`4\pi`, equal to the sphere's, so this step preserves area exactly.
* The concentric map of Shirley & Chiu (1997) takes the square onto the disk
  with a constant area factor (:math:`\pi` here, from area 4 to :math:`4\pi`).

Hence :func:`sphere_to_square` multiplies area by the constant
:math:`4 / (4\pi) = 1/\pi`: uniformly distributed directions land uniformly in
the square. The north pole maps to the square centre, the south pole to its
boundary.

All functions broadcast over leading dimensions, work on any device and dtype,
and return finite values everywhere (including both poles and the disk centre);
branches are written with the "double ``where``" pattern so that gradients
through them are finite as well, except on the disk rim, where the inverse
Lambert map is genuinely singular (a whole circle collapses to one point).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "sphere_to_disk",
    "disk_to_sphere",
    "square_to_disk",
    "disk_to_square",
    "sphere_to_square",
    "square_to_sphere",
]

# Radius of the Lambert disk: the projection of the unit sphere centred at a pole
# reaches its antipode at chordal distance 2.
DISK_RADIUS = 2.0


def _sqrt_tiny(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).tiny)


def _check_last_dim(x: Tensor, size: int, name: str, fn: str) -> None:
    if x.dim() == 0 or x.size(-1) != size:
        raise ValueError(f"{fn}: {name} must have shape [..., {size}], got {tuple(x.shape)}")


def sphere_to_disk(p: Tensor) -> Tensor:
    r"""Lambert azimuthal equal-area projection centred at the north pole.

    .. math::
        (x, y, z) \mapsto \sqrt{\tfrac{2}{1 + z}}\,(x, y),

    so :math:`|d| = \sqrt{2(1 - z)}`. The south pole :math:`(0, 0, -1)` is a
    whole circle in the limit; it is mapped to the rim point :math:`(2, 0)`.

    Args:
        p (Tensor): Non-zero directions of shape :obj:`[..., 3]`; they are
            normalised here, so any radius is accepted.

    Returns:
        Tensor: Disk points of shape :obj:`[..., 2]` with :math:`|d| \le 2`.
    """
    _check_last_dim(p, 3, "p", "sphere_to_disk")
    p = p / p.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    x, y, z = p.unbind(-1)
    north = z > 0

    # Northern hemisphere: scale factor sqrt(2 / (1 + z)) is well conditioned
    # (1 + z >= 1) and keeps full precision near the pole, where 1 - z cancels.
    z_n = torch.where(north, z, torch.ones_like(z))
    scale = torch.sqrt(2.0 / (1.0 + z_n))
    d_north = torch.stack([x * scale, y * scale], dim=-1)

    # Southern hemisphere: radius sqrt(2 (1 - z)) times the azimuth direction;
    # dividing by 1 + z would blow up at the antipode.
    z_s = torch.where(north, torch.zeros_like(z), z)
    radius = torch.sqrt(2.0 * (1.0 - z_s))
    rho2 = x * x + y * y
    # Below this the azimuth is numerically meaningless (and 1/rho^2 in the
    # backward pass would overflow): treat the point as the antipode itself.
    has_dir = (~north) & (rho2 > _sqrt_tiny(p.dtype))
    rho = torch.sqrt(torch.where(has_dir, rho2, torch.ones_like(rho2)))
    ux = torch.where(has_dir, x / rho, torch.ones_like(x))
    uy = torch.where(has_dir, y / rho, torch.zeros_like(y))
    d_south = torch.stack([radius * ux, radius * uy], dim=-1)

    return torch.where(north.unsqueeze(-1), d_north, d_south)


def disk_to_sphere(d: Tensor) -> Tensor:
    r"""Inverse of :func:`sphere_to_disk`.

    .. math::
        (X, Y) \mapsto \Bigl(X\sqrt{1 - r^2/4},\; Y\sqrt{1 - r^2/4},\;
        1 - r^2/2\Bigr), \qquad r^2 = X^2 + Y^2.

    Args:
        d (Tensor): Disk points of shape :obj:`[..., 2]`, :math:`|d| \le 2`.
            Points outside the disk are mapped to the south pole.

    Returns:
        Tensor: Unit vectors of shape :obj:`[..., 3]`.
    """
    _check_last_dim(d, 2, "d", "disk_to_sphere")
    X, Y = d.unbind(-1)
    return _disk_to_sphere(d, 1.0 - 0.25 * (X * X + Y * Y))


def _disk_to_sphere(d: Tensor, q: Tensor) -> Tensor:
    # q = 1 - |d|^2 / 4 = (1 + z) / 2, passed in so that callers who know |d|
    # exactly (square_to_sphere) avoid the cancellation of 1 - |d|^2/4 at the rim.
    q = q.clamp(min=0.0)
    inside = q > 0
    # sqrt has an infinite slope at 0 (the rim); keep it out of the graph there.
    s = torch.where(inside, torch.sqrt(torch.where(inside, q, torch.ones_like(q))), torch.zeros_like(q))
    X, Y = d.unbind(-1)
    return torch.stack([X * s, Y * s, 2.0 * q - 1.0], dim=-1)


def square_to_disk(s: Tensor) -> Tensor:
    r"""Shirley–Chiu concentric map from the square :math:`[-1, 1]^2` onto the
    disk of radius 2.

    Concentric squares go to concentric circles; the Jacobian determinant is
    the constant :math:`\pi` (square area 4, disk area :math:`4\pi`). The
    square centre goes to the disk centre and the square boundary to the rim.

    Args:
        s (Tensor): Square points of shape :obj:`[..., 2]`.

    Returns:
        Tensor: Disk points of shape :obj:`[..., 2]`.
    """
    _check_last_dim(s, 2, "s", "square_to_disk")
    a, b = s.unbind(-1)
    horiz = a.abs() >= b.abs()
    quarter_pi = 0.25 * math.pi

    # Left/right wedges |a| >= |b|: radius |a|, angle (pi/4) * b/a. At the origin
    # (a = b ~ 0) the safe denominator 1 gives angle ~0 and radius ~0.
    a_safe = torch.where(horiz & (a.abs() > _sqrt_tiny(s.dtype)), a, torch.ones_like(a))
    phi = quarter_pi * (b / a_safe)
    d_h = torch.stack([a * torch.cos(phi), a * torch.sin(phi)], dim=-1)

    # Top/bottom wedges |b| > |a|: radius |b|, angle pi/2 - (pi/4) * a/b.
    b_safe = torch.where(~horiz & (b.abs() > _sqrt_tiny(s.dtype)), b, torch.ones_like(b))
    psi = quarter_pi * (a / b_safe)
    d_v = torch.stack([b * torch.sin(psi), b * torch.cos(psi)], dim=-1)

    return DISK_RADIUS * torch.where(horiz.unsqueeze(-1), d_h, d_v)


def disk_to_square(d: Tensor) -> Tensor:
    r"""Inverse of :func:`square_to_disk`: disk of radius 2 onto
    :math:`[-1, 1]^2`.

    Args:
        d (Tensor): Disk points of shape :obj:`[..., 2]`, :math:`|d| \le 2`.

    Returns:
        Tensor: Square points of shape :obj:`[..., 2]`.
    """
    _check_last_dim(d, 2, "d", "disk_to_square")
    u, v = (d / DISK_RADIUS).unbind(-1)
    horiz = u.abs() >= v.abs()
    four_over_pi = 4.0 / math.pi

    # With t = tan(angle) in [-1, 1], the radius is u * sqrt(1 + t^2): this avoids
    # hypot(), whose gradient is 0/0 at the origin, and atan2's branch cut.
    u_safe = torch.where(horiz & (u.abs() > _sqrt_tiny(d.dtype)), u, torch.ones_like(u))
    t = v / u_safe
    a_h = u * torch.sqrt(1.0 + t * t)
    s_h = torch.stack([a_h, a_h * four_over_pi * torch.atan(t)], dim=-1)

    v_safe = torch.where(~horiz & (v.abs() > _sqrt_tiny(d.dtype)), v, torch.ones_like(v))
    t = u / v_safe
    b_v = v * torch.sqrt(1.0 + t * t)
    s_v = torch.stack([b_v * four_over_pi * torch.atan(t), b_v], dim=-1)

    return torch.where(horiz.unsqueeze(-1), s_h, s_v)


def sphere_to_square(p: Tensor) -> Tensor:
    r"""Equal-area map from directions to :math:`[-1, 1]^2`
    (:func:`sphere_to_disk` then :func:`disk_to_square`).

    Area is scaled by the constant :math:`1/\pi`. The north pole maps to
    :math:`(0, 0)`, the south pole to the boundary point :math:`(1, 0)`.

    Args:
        p (Tensor): Non-zero directions of shape :obj:`[..., 3]`.

    Returns:
        Tensor: Square points of shape :obj:`[..., 2]`.
    """
    return disk_to_square(sphere_to_disk(p))


def square_to_sphere(s: Tensor) -> Tensor:
    r"""Inverse of :func:`sphere_to_square` (:func:`square_to_disk` then
    :func:`disk_to_sphere`).

    Args:
        s (Tensor): Square points of shape :obj:`[..., 2]` in :math:`[-1, 1]^2`.

    Returns:
        Tensor: Unit vectors of shape :obj:`[..., 3]`.
    """
    _check_last_dim(s, 2, "s", "square_to_sphere")
    # The concentric map sends the square of half-width m = max(|a|, |b|) to the
    # circle of radius 2m, so 1 - |d|^2/4 = (1 - m)(1 + m) without cancellation.
    m = s.abs().amax(dim=-1).clamp(max=1.0)
    return _disk_to_sphere(square_to_disk(s), (1.0 - m) * (1.0 + m))
