r"""Quaternion algebra on ``(..., 4)`` tensors, real part first: ``(w, x, y, z)``.

Plain functions in the style of e3nn's ``o3/_rotation.py``: every function
broadcasts over leading dimensions, preserves dtype and device, and is
differentiable (checked with :func:`torch.autograd.gradcheck` in float64).

A unit quaternion :math:`q` acts on a 3-vector :math:`v` by the sandwich product
:math:`q \otimes (0, v) \otimes q^*`; on a general quaternion
:math:`x = (x_0, \mathbf{x})` the sandwich keeps the real part :math:`x_0` and
rotates the vector part :math:`\mathbf{x}` by :func:`quaternion_to_matrix`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "hamilton_product",
    "conjugate",
    "normalize",
    "unit_quaternion",
    "quaternion_to_matrix",
    "quaternion_to_block_matrix",
    "rotate",
    "rotate_blocks",
    "matrix_rotate_blocks",
    "random_unit_quaternion",
    "identity_quaternion",
]


def _check_last_dim(q: Tensor, name: str) -> None:
    if q.shape[-1] != 4:
        raise ValueError(
            f"{name} must have a last dimension of size 4 (w, x, y, z), "
            f"got shape {tuple(q.shape)}")


def hamilton_product(a: Tensor, b: Tensor) -> Tensor:
    r"""Hamilton product :math:`a \otimes b`.

    Args:
        a: quaternions of shape ``(..., 4)``.
        b: quaternions of shape ``(..., 4)`` (broadcast against ``a``).

    Returns:
        Tensor of shape ``broadcast(a, b).shape``.
    """
    _check_last_dim(a, "a")
    _check_last_dim(b, "b")
    aw, ax, ay, az = a.unbind(-1)
    bw, bx, by, bz = b.unbind(-1)
    return torch.stack([
        aw * bw - ax * bx - ay * by - az * bz,
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
    ], dim=-1)


def conjugate(q: Tensor) -> Tensor:
    r"""Conjugate :math:`q^* = (w, -x, -y, -z)`; the inverse of a unit quaternion.

    Args:
        q: quaternions of shape ``(..., 4)``.
    """
    _check_last_dim(q, "q")
    # Multiplying by a constant sign vector keeps this a single fused op.
    sign = q.new_tensor([1.0, -1.0, -1.0, -1.0])
    return q * sign


def normalize(q: Tensor, eps: float = 1e-12) -> Tensor:
    r"""Scale to unit norm, :math:`q / \max(\lVert q \rVert, \epsilon)`.

    A quaternion of norm below ``eps`` is returned (nearly) unchanged rather than
    blown up to NaN; use :func:`unit_quaternion` (below; what
    :class:`~qsv_pyg.nn.QSVConv` normalises with) for the convention that maps it
    to the identity rotation instead.

    Args:
        q: quaternions of shape ``(..., 4)``.
        eps: lower bound on the norm in the denominator.
    """
    _check_last_dim(q, "q")
    return q / q.norm(dim=-1, keepdim=True).clamp_min(eps)



def _fused_unit(q: Tensor):
    """The module whose ``unit_forward``/``unit_backward`` normalise ``q`` in one
    kernel each way (the Triton path's, or the C++ CPU kernel's, chosen as the
    attention operator chooses them), or None for the PyTorch ops (other
    dtypes, and while torch.compile traces: inductor fuses the ops itself)."""
    from .nn import _cpu_ext, triton_kernel
    if triton_kernel.unit_available(q):
        return _TritonUnit
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and not torch.compiler.is_compiling()):
        ext = _cpu_ext.cpu_kernel()
        if ext is not None and hasattr(ext, "unit_forward"):
            return ext
    return None


class _TritonUnit:
    """The Triton path's kernels under the C++ module's names."""

    @staticmethod
    def unit_forward(q: Tensor, eps: float) -> Tensor:
        from .nn import triton_kernel
        return triton_kernel.unit_quaternion(q, eps)

    @staticmethod
    def unit_backward(q: Tensor, grad: Tensor, eps: float) -> Tensor:
        from .nn import triton_kernel
        return triton_kernel.unit_quaternion_backward(q, grad, eps)


class _UnitQuaternion(torch.autograd.Function):
    """``q / |q|`` with norms ``<= eps`` mapped to the identity, as one autograd
    node (the ops autograd would record for it cost more at a few thousand
    nodes; see benchmarks/README.md).

    The backward is itself differentiable (second derivatives are exact): it
    uses the saved output ``unit`` (which autograd tracks back to ``q``) and,
    when a graph of the backward is being built (``create_graph=True``), a
    norm recomputed from ``q`` rather than the constant saved one. A plain
    first-order backward uses the saved norm.

    On the Triton path (CUDA, float32 / float64; see
    :func:`qsv_pyg.nn.triton_kernel.unit_quaternion`) and with the C++ CPU
    kernel (:mod:`qsv_pyg.nn._cpu_ext`, float32 / float64 CPU tensors) the
    forward and the first-order backward are one kernel each instead of nine
    and eight PyTorch ops; a double backward uses the PyTorch formula below."""

    @staticmethod
    def forward(ctx, q: Tensor, eps: float) -> Tensor:
        ctx.eps = eps
        ctx.fused = _fused_unit(q)
        if ctx.fused is not None:
            unit = ctx.fused.unit_forward(q.contiguous(), eps)
            ctx.save_for_backward(q, unit)
            return unit
        norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        # `~(norm <= eps)` rather than `norm > eps`: a NaN norm must take the
        # division branch so that the NaN propagates instead of being masked.
        ok = ~(norm <= eps)
        # Built on the device without a host-to-device copy (``identity[0] = 1.0``
        # on a CUDA tensor is a synchronising copy of the Python scalar).
        identity = torch.cat([q.new_ones(1), q.new_zeros(3)])
        unit = torch.where(ok, q / norm.clamp_min(eps), identity)
        ctx.save_for_backward(q, unit, norm, ok)
        return unit

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.fused is not None:
            q, unit = ctx.saved_tensors
            if not torch.is_grad_enabled():
                return ctx.fused.unit_backward(q.contiguous(),
                                               grad.contiguous().to(q.dtype), ctx.eps), None
            norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
            ok = ~(norm <= ctx.eps)
        else:
            q, unit, norm, ok = ctx.saved_tensors
        if torch.is_grad_enabled():
            # Double backward: |q| must be a function of q, not a constant
            # (treating it as one made second derivatives wrong).
            norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        # d(q/|q|) = (g - u <u, g>) / |q|; the identity branch is constant.
        g = (grad - unit * (unit * grad).sum(dim=-1, keepdim=True)) / norm.clamp_min(ctx.eps)
        return g.masked_fill(~ok, 0.0), None


def unit_quaternion(q: Tensor, eps: float = 1e-8) -> Tensor:
    r"""Normalise ``q`` (``[..., 4]``); norms below ``eps`` become the identity.

    The one normalisation of :class:`~qsv_pyg.nn.QSVConv`'s node quaternions
    (given, from features or composed). A zero quaternion has no direction, and
    dividing by its norm would give NaN. Mapping it to the identity rotation
    ``(1, 0, 0, 0)`` keeps the layer finite and gives such a node "no rotation"
    (its transport is the identity and its learned logit against a neighbour is
    that neighbour's real part). The gradient there is zero. A quaternion with
    a NaN or infinite component is not small: it stays NaN (it is never masked
    as the identity), so a bad input shows in the output. First and second
    derivatives are exact (one autograd node).
    """
    if q.size(-1) != 4:
        raise ValueError(f"quaternions must have a last dimension of size 4, got "
                         f"shape {tuple(q.shape)}")
    return _UnitQuaternion.apply(q, eps)

def identity_quaternion(*shape: int, dtype: Optional[torch.dtype] = None,
                        device: Optional[torch.device] = None) -> Tensor:
    """The identity rotation ``(1, 0, 0, 0)`` broadcast to ``(*shape, 4)``."""
    q = torch.zeros(*shape, 4, dtype=dtype, device=device)
    q[..., 0] = 1.0
    return q


def quaternion_to_matrix(q: Tensor) -> Tensor:
    r"""Rotation matrix of a unit quaternion.

    Args:
        q: unit quaternions of shape ``(..., 4)``; not renormalised here, so the
            result is orthogonal only up to how far ``q`` is from unit norm.

    Returns:
        Tensor of shape ``(..., 3, 3)`` with ``R @ v`` equal to the vector part of
        ``q ⊗ (0, v) ⊗ q*``.
    """
    _check_last_dim(q, "q")
    w, x, y, z = q.unbind(-1)
    xx, yy, zz = x * x, y * y, z * z
    xy, xz, yz = x * y, x * z, y * z
    wx, wy, wz = w * x, w * y, w * z
    one = torch.ones_like(w)
    rows = [
        one - 2 * (yy + zz), 2 * (xy - wz), 2 * (xz + wy),
        2 * (xy + wz), one - 2 * (xx + zz), 2 * (yz - wx),
        2 * (xz - wy), 2 * (yz + wx), one - 2 * (xx + yy),
    ]
    return torch.stack(rows, dim=-1).unflatten(-1, (3, 3))


def _outer_to_block_map() -> Tensor:
    """``[16, 16]`` map from the outer product ``q q^T`` (flattened) to
    ``diag(1, R(q))`` (flattened), exact for unit ``q``."""
    m = torch.zeros(4, 4, 4, 4, dtype=torch.float64)  # [i, j, row, col]
    w, x, y, z = range(4)
    terms = {
        (0, 0): [(1, w, w), (1, x, x), (1, y, y), (1, z, z)],  # |q|^2 = 1
        (1, 1): [(1, w, w), (1, x, x), (-1, y, y), (-1, z, z)],
        (2, 2): [(1, w, w), (-1, x, x), (1, y, y), (-1, z, z)],
        (3, 3): [(1, w, w), (-1, x, x), (-1, y, y), (1, z, z)],
        (1, 2): [(1, x, y), (1, y, x), (-1, w, z), (-1, z, w)],
        (1, 3): [(1, x, z), (1, z, x), (1, w, y), (1, y, w)],
        (2, 1): [(1, x, y), (1, y, x), (1, w, z), (1, z, w)],
        (2, 3): [(1, y, z), (1, z, y), (-1, w, x), (-1, x, w)],
        (3, 1): [(1, x, z), (1, z, x), (-1, w, y), (-1, y, w)],
        (3, 2): [(1, y, z), (1, z, y), (1, w, x), (1, x, w)],
    }
    for (row, col), coeffs in terms.items():
        for c, i, j in coeffs:
            m[i, j, row, col] += c
    return m.view(16, 16)


_OUTER_TO_BLOCK = _outer_to_block_map()
_OUTER_TO_BLOCK_CACHE: dict = {}


def _outer_map(ref: Tensor) -> Tensor:
    key = (ref.device, ref.dtype)
    m = _OUTER_TO_BLOCK_CACHE.get(key)
    if m is None:
        m = _OUTER_TO_BLOCK_CACHE[key] = _OUTER_TO_BLOCK.to(device=ref.device, dtype=ref.dtype)
    return m


def quaternion_to_block_matrix(q: Tensor) -> Tensor:
    r"""The sandwich product of a unit quaternion as a ``4 x 4`` matrix.

    ``Q = diag(1, R(q))``: ``Q @ x`` equals :math:`q \otimes x \otimes q^*` for
    any quaternion ``x`` (real part kept, vector part rotated by
    :func:`quaternion_to_matrix`). Every entry is a quadratic form in ``q``, so
    ``Q`` is computed as one matrix product of the outer product ``q q^T`` with
    a constant ``16 x 16`` map — two kernels instead of dozens of small ones.
    Exact for unit ``q`` (the ``(0, 0)`` entry is :math:`\lVert q \rVert^2`).

    Args:
        q: unit quaternions of shape ``(..., 4)``.

    Returns:
        Tensor of shape ``(..., 4, 4)``.
    """
    _check_last_dim(q, "q")
    outer = (q.unsqueeze(-1) * q.unsqueeze(-2)).reshape(*q.shape[:-1], 16)
    return (outer @ _outer_map(q)).view(*q.shape[:-1], 4, 4)


def block_matrix_to_quaternion_grad(q: Tensor, grad: Tensor) -> Tensor:
    r"""Vector-Jacobian product of :func:`quaternion_to_block_matrix`.

    The gradient with respect to ``q`` (``(..., 4)``) of a loss whose gradient
    with respect to ``Q = quaternion_to_block_matrix(q)`` is ``grad``
    (``(..., 4, 4)``); used by hand-written backward passes.
    """
    g = (grad.reshape(*q.shape[:-1], 16) @ _outer_map(q).t()).view(*q.shape[:-1], 4, 4)
    return ((g + g.transpose(-1, -2)) @ q.unsqueeze(-1)).squeeze(-1)


def rotate(q: Tensor, x: Tensor) -> Tensor:
    r"""Sandwich product :math:`q \otimes x \otimes q^*`.

    For unit ``q`` the real part of ``x`` is kept and the vector part rotated.
    Computed literally with two Hamilton products, so it is also the reference
    for the faster matrix form in :func:`rotate_blocks`.

    Args:
        q: quaternions of shape ``(..., 4)``.
        x: quaternions of shape ``(..., 4)`` (broadcast against ``q``).
    """
    return hamilton_product(hamilton_product(q, x), conjugate(q))


def rotate_blocks(q: Tensor, x: Tensor) -> Tensor:
    r"""Apply the sandwich of unit ``q`` to every 4-channel block of ``x``.

    Equivalent to :func:`rotate` on each block (for unit ``q``), but builds one
    3×3 matrix per quaternion and applies it to all of its blocks, which is what
    makes per-node transport cheap.

    Args:
        q: unit quaternions of shape ``(..., 4)``.
        x: features of shape ``(..., B, 4)``; ``q`` is broadcast over the block
            dimension ``B`` (and ``x`` may have extra leading dimensions).

    Returns:
        Tensor of shape ``(..., B, 4)``.
    """
    _check_last_dim(q, "q")
    _check_last_dim(x, "x")
    return matrix_rotate_blocks(quaternion_to_matrix(q), x)


def matrix_rotate_blocks(rot: Tensor, x: Tensor) -> Tensor:
    r"""Rotate the vector part of every 4-channel block of ``x`` by ``rot``.

    The matrix form of :func:`rotate_blocks`, for callers that reuse one matrix
    (e.g. rotating by ``q`` and later back by ``q*``, whose matrix is
    ``rot.transpose(-1, -2)``).

    Args:
        rot: rotation matrices of shape ``(..., 3, 3)``.
        x: features of shape ``(..., B, 4)``.
    """
    _check_last_dim(x, "x")
    rot_t = rot.transpose(-1, -2)
    v = x[..., 1:]
    # [..., B, 3] @ [..., 3, 3] as one batched matmul. Leading dims of x that
    # rot lacks (a batch of images sharing a per-node field) are folded into
    # the rows rather than broadcast (faster on CPU; see benchmarks/README.md).
    extra = v.dim() - rot.dim()
    if extra > 0 and tuple(v.shape[extra:-2]) == tuple(rot.shape[:-2]):
        lead = list(range(extra))
        moved = v.movedim(lead, [d - 2 - extra for d in lead])  # (q..., lead..., B, 3)
        vec = (moved.reshape(*rot.shape[:-2], -1, 3) @ rot_t).view(moved.shape)
        vec = vec.movedim([d - 2 - extra for d in lead], lead)
    elif extra >= 0:
        vec = torch.matmul(v, rot_t)
    else:
        vec = torch.matmul(v.unsqueeze(-2), rot_t.unsqueeze(-3)).squeeze(-2)
    return torch.cat([x[..., :1], vec], dim=-1)


def random_unit_quaternion(*shape: int, generator: Optional[torch.Generator] = None,
                           dtype: Optional[torch.dtype] = None,
                           device: Optional[torch.device] = None) -> Tensor:
    r"""Uniformly random rotations (Haar measure on :math:`S^3`).

    Normalised standard Gaussians are uniform on the 3-sphere.

    Args:
        *shape: leading shape; the result has shape ``(*shape, 4)``.
        generator: optional :class:`torch.Generator` for reproducibility.
        dtype, device: of the result (defaults: ``torch.get_default_dtype()``, CPU).
    """
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if generator is not None and device is not None \
            and torch.device(device).type != generator.device.type:
        q = torch.randn(*shape, 4, generator=generator, dtype=dtype,
                        device=generator.device).to(device)
    else:
        q = torch.randn(*shape, 4, generator=generator, dtype=dtype, device=device)
    return normalize(q)
