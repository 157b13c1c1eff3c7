r"""Local reference frames of point clouds, and the unit quaternions of frames.

A node's frame :math:`R_i = [\mathbf{e}_1, \mathbf{e}_2, \mathbf{e}_3]` (columns,
:math:`\det R_i = +1`) comes from the principal axes of its neighbours'
offsets. Rotating the whole cloud by :math:`G` turns every frame into
:math:`G R_i` (up to degenerate neighbourhoods, see :func:`local_frames`), so
the relative rotation :math:`R_i^\top R_j` of two nodes does not change. That is
what :class:`~qsv_pyg.nn.QSVConv` computes from node quaternions: with
:math:`q_i` the quaternion of :math:`R_i`, :math:`r_{ij} = q_i^* \otimes q_j`
rotates a vector written in :math:`j`'s frame into :math:`i`'s frame, and the
layer becomes invariant to rotations of the input when its input features are
written in the local frames (:math:`R_i^\top \mathbf{v}_i`) and its routing does
not depend on the quaternions' signs (``routing="abs"``; a rotation matrix fixes
its quaternion only up to sign).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["matrix_to_quaternion", "local_frames", "frame_quaternions"]


def matrix_to_quaternion(matrix: Tensor) -> Tensor:
    r"""Unit quaternion ``(w, x, y, z)`` of a rotation matrix, with :math:`w \ge 0`.

    The inverse of :func:`qsv_pyg.quaternion.quaternion_to_matrix` up to the
    sign of the quaternion (both :math:`q` and :math:`-q` give the same
    rotation; the one with a non-negative real part is returned). Computed from
    the best-conditioned of the four standard formulas, so it is accurate for
    every rotation angle.

    Args:
        matrix: rotation matrices of shape ``(..., 3, 3)``.

    Returns:
        Tensor of shape ``(..., 4)``.
    """
    if matrix.shape[-2:] != (3, 3):
        raise ValueError(f"rotation matrices must have shape (..., 3, 3), got "
                         f"{tuple(matrix.shape)}")
    m = matrix
    m00, m01, m02 = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    m10, m11, m12 = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    m20, m21, m22 = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    # 2|w|, 2|x|, 2|y|, 2|z| for a rotation matrix.
    q_abs = torch.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22,
                         1 - m00 + m11 - m22, 1 - m00 - m11 + m22], -1).clamp_min(0).sqrt()
    # Row k is 4 q_k q (one formula per largest component).
    cand = torch.stack([
        torch.stack([q_abs[..., 0] ** 2, m21 - m12, m02 - m20, m10 - m01], -1),
        torch.stack([m21 - m12, q_abs[..., 1] ** 2, m10 + m01, m02 + m20], -1),
        torch.stack([m02 - m20, m10 + m01, q_abs[..., 2] ** 2, m12 + m21], -1),
        torch.stack([m10 - m01, m20 + m02, m21 + m12, q_abs[..., 3] ** 2], -1),
    ], -2)
    cand = cand / (2 * q_abs.clamp_min(0.1)).unsqueeze(-1)
    best = q_abs.argmax(dim=-1)
    q = cand.gather(-2, best[..., None, None].expand(*best.shape, 1, 4)).squeeze(-2)
    q = q * torch.where(q[..., :1] < 0, -1.0, 1.0).to(q.dtype)
    return q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)


def local_frames(pos: Tensor, edge_index: Tensor, num_nodes: Optional[int] = None
                 ) -> Tensor:
    r"""Sign-disambiguated principal-axis frames of every node's neighbourhood.

    For target :math:`i` with incoming edges :math:`j \to i` and offsets
    :math:`\mathbf{d}_j = \mathbf{p}_j - \mathbf{p}_i`, the covariance of the
    offsets gives the axes :math:`\mathbf{e}_1` (largest variance) and
    :math:`\mathbf{e}_3` (smallest, the surface normal of a sampled surface).
    Each is oriented so that :math:`\sum_j \langle \mathbf{d}_j, \mathbf{e}\rangle
    \ge 0` (towards where the neighbours lie), and
    :math:`\mathbf{e}_2 = \mathbf{e}_3 \times \mathbf{e}_1` makes the frame
    right-handed. The frames rotate with the cloud except where two variances
    are (nearly) equal or a sum is (nearly) zero; noise in the points decides
    the frame there. Computed in float64 and not meant to be differentiated.

    Args:
        pos: node positions ``[N, 3]``.
        edge_index: ``[2, E]`` edges ``source -> target`` (e.g. a kNN graph from
            :func:`torch_cluster.knn_graph`); a target without edges gets the
            identity frame.
        num_nodes: ``N`` (default: ``pos.size(0)``).

    Returns:
        Rotation matrices ``[N, 3, 3]`` whose columns are
        :math:`\mathbf{e}_1, \mathbf{e}_2, \mathbf{e}_3` in ``pos``'s dtype.
    """
    if pos.dim() != 2 or pos.size(1) != 3:
        raise ValueError(f"pos must have shape [num_nodes, 3], got {tuple(pos.shape)}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, num_edges], got "
                         f"{tuple(edge_index.shape)}")
    n = pos.size(0) if num_nodes is None else num_nodes
    p = pos.detach().double()
    src, dst = edge_index[0], edge_index[1]
    d = p[src] - p[dst]  # [E, 3]
    count = torch.zeros(n, dtype=p.dtype, device=p.device).index_add_(
        0, dst, torch.ones_like(d[:, 0]))
    deg = count.clamp_min(1)
    mean = torch.zeros(n, 3, dtype=p.dtype, device=p.device).index_add_(0, dst, d)
    outer = torch.zeros(n, 3, 3, dtype=p.dtype, device=p.device).index_add_(
        0, dst, d.unsqueeze(-1) * d.unsqueeze(-2))
    mean = mean / deg[:, None]
    cov = outer / deg[:, None, None] - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    e1, e3 = vecs[..., 2], vecs[..., 0]
    # sum_j <d_j, e> = deg * <mean, e>: the sign of <mean, e> orients e.
    e1 = e1 * torch.where((mean * e1).sum(-1, keepdim=True) < 0, -1.0, 1.0)
    e3 = e3 * torch.where((mean * e3).sum(-1, keepdim=True) < 0, -1.0, 1.0)
    e2 = torch.linalg.cross(e3, e1)
    frames = torch.stack([e1, e2, e3], dim=-1)
    eye = torch.eye(3, dtype=p.dtype, device=p.device).expand_as(frames)
    return torch.where((count > 0)[:, None, None], frames, eye).to(pos.dtype)


def frame_quaternions(pos: Tensor, edge_index: Tensor,
                      num_nodes: Optional[int] = None) -> Tensor:
    r"""Unit quaternions ``[N, 4]`` of :func:`local_frames`, ready for the
    ``quat`` argument of :class:`~qsv_pyg.nn.QSVConv` and
    :class:`~qsv_pyg.nn.models.QSV` (use ``routing="abs"``: the sign of each
    quaternion is a convention, see :func:`matrix_to_quaternion`)."""
    return matrix_to_quaternion(local_frames(pos, edge_index, num_nodes))
