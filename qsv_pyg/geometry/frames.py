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

:func:`local_frames` signs the axes by the mean offset only, so its frames do not
rotate with the cloud on planar, flat or symmetric neighbourhoods;
:func:`oriented_frames` resolves those by a documented equivariant rule and
marks the nodes where no equivariant frame exists. Both raise a ``ValueError``
naming the first non-finite position.
"""
from __future__ import annotations

import math

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["matrix_to_quaternion", "local_frames", "frame_quaternions",
           "check_finite_positions", "oriented_frames", "OrientedFrames", "FRAME_RULES"]


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

    Raises:
        ValueError: malformed shapes, or a non-finite position (the message
            names the first such point).

    See :func:`oriented_frames` for frames that rotate with the cloud on
    planar and symmetric neighbourhoods too.
    """
    if pos.dim() != 2 or pos.size(1) != 3:
        raise ValueError(f"pos must have shape [num_nodes, 3], got {tuple(pos.shape)}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, num_edges], got "
                         f"{tuple(edge_index.shape)}")
    check_finite_positions(pos, "local_frames")
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


# --------------------------------------------------------------- robust frames
#: The frame rules of :func:`oriented_frames`: ``"robust"`` (the rule documented
#: there), ``"pca+centroid"`` (:func:`local_frames` plus the old example's
#: planar-patch tie-break) and ``"pca"`` (:func:`local_frames` as it is).
FRAME_RULES = ("robust", "pca+centroid", "pca")


class OrientedFrames(NamedTuple):
    """What :func:`oriented_frames` returns."""

    #: Rotation matrices ``[N, 3, 3]``, columns :math:`\mathbf{e}_1, \mathbf{e}_2,
    #: \mathbf{e}_3` (largest-variance axis first, the normal last).
    frame: Tensor
    #: ``[N]`` bool: ``True`` where no rotation-equivariant frame could be chosen
    #: (the frame there is deterministic but arbitrary, see :func:`oriented_frames`).
    ambiguous: Tensor
    #: ``[N, 3]`` eigenvalues of the neighbour offsets' covariance, descending.
    eigenvalues: Tensor


def check_finite_positions(pos: Tensor, fn: str) -> None:
    """Raise a ``ValueError`` naming the first point of ``pos [N, D]`` with a NaN
    or infinite coordinate (one reduction when every coordinate is finite)."""
    if not isinstance(pos, Tensor) or not pos.is_floating_point():
        return
    finite = torch.isfinite(pos)
    if bool(finite.all()):
        return
    rows = (~finite).reshape(-1, pos.size(-1) if pos.dim() > 1 else 1).any(dim=-1)
    bad = rows.nonzero()
    i = int(bad[0, 0])
    value = pos.reshape(rows.numel(), -1)[i].tolist()
    raise ValueError(f"{fn}: pos has a non-finite coordinate at point {i} "
                     f"(pos[{i}] = {value}); {bad.size(0)} of {rows.numel()} points are "
                     f"not finite. Remove or repair them before building frames.")


def _unit(v: Tensor, ok: Tensor) -> Tensor:
    """``v / |v|`` where ``ok``, else zero (no 0/0)."""
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    return torch.where(ok[..., None], v / norm.clamp_min(torch.finfo(v.dtype).tiny),
                       torch.zeros_like(v))


def oriented_frames(pos: Tensor, edge_index: Tensor, batch: Optional[Tensor] = None, *,
                    rule: str = "robust", tol: float = 1e-6,
                    num_nodes: Optional[int] = None,
                    dtype: torch.dtype = torch.float64) -> OrientedFrames:
    r"""Rotation-equivariant local PCA frames, with the ambiguous nodes marked.

    For target :math:`i` with incoming edges :math:`j \to i` (e.g. its kNN),
    offsets :math:`\mathbf{d}_j = \mathbf{p}_j - \mathbf{p}_i`, their mean
    :math:`\mathbf{m}_i`, covariance :math:`C_i` with eigenvalues
    :math:`\lambda_1 \ge \lambda_2 \ge \lambda_3` and eigenvectors
    :math:`\mathbf{u}_1, \mathbf{u}_2, \mathbf{u}_3`, the neighbourhood scale
    :math:`s_i^2 = \operatorname{mean}_j \lVert \mathbf{d}_j \rVert^2`, and
    :math:`\mathbf{g}_i = \mathbf{c} - \mathbf{p}_i` the direction to the
    centroid :math:`\mathbf{c}` of :math:`i`'s cloud (``batch``), the rule
    ``"robust"`` builds :math:`R_i = [\mathbf{e}_1, \mathbf{e}_2, \mathbf{e}_3]`
    (:math:`\mathbf{e}_1` the largest-variance axis, :math:`\mathbf{e}_3` the
    smallest: a sampled surface's normal) from quantities that all rotate with
    the cloud, so that rotating the cloud by :math:`G` (and translating it)
    turns :math:`R_i` into :math:`G R_i`:

    1. **Axes.** Two eigenvalues closer than the tolerance span a plane (a
       planar or flat patch, a symmetric neighbourhood, collinear points, a
       duplicate point): there, instead of arbitrary eigenvectors, the axis is
       the first of these vectors, projected on that plane, that is not
       (nearly) zero: the mean offset :math:`\mathbf{m}_i`, the cubic moment
       :math:`\operatorname{mean}_j \lVert P\mathbf{d}_j\rVert^2 P\mathbf{d}_j`
       (:math:`P` the projector on the plane), the centroid direction
       :math:`\mathbf{g}_i`. It comes oriented; the axis orthogonal to it in the
       plane is a line. Three (nearly) equal eigenvalues: the first such vector
       is :math:`\mathbf{e}_1`, the next one's component orthogonal to it
       :math:`\mathbf{e}_2`.
    2. **Signs.** Each remaining line :math:`\mathbf{u}` is oriented by the
       sign of the first of :math:`\langle \mathbf{m}_i, \mathbf{u}\rangle`
       (where the neighbours lie), the third moment
       :math:`\operatorname{mean}_j \langle \mathbf{d}_j, \mathbf{u}\rangle^3`
       (skewness: a planar patch's normal has none, a curved one's has) and
       :math:`\langle \mathbf{g}_i, \mathbf{u}\rangle` (towards the centroid)
       that is not (nearly) zero; a line none of them orients stays unoriented.
    3. **Handedness.** The frame is completed from the first oriented pair, in
       the order :math:`(\mathbf{e}_1, \mathbf{e}_3)`,
       :math:`(\mathbf{e}_1, \mathbf{e}_2)`, :math:`(\mathbf{e}_2, \mathbf{e}_3)`,
       by the cross product (:math:`\mathbf{e}_2 = \mathbf{e}_3 \times \mathbf{e}_1`,
       :math:`\mathbf{e}_3 = \mathbf{e}_1 \times \mathbf{e}_2`,
       :math:`\mathbf{e}_1 = \mathbf{e}_2 \times \mathbf{e}_3`), so
       :math:`\det R_i = +1`. A flat plate through its centroid (no sign for
       the normal from any moment) thus gets :math:`\mathbf{e}_3 = \mathbf{e}_1
       \times \mathbf{e}_2` from its two oriented in-plane axes.
    4. **Ambiguous nodes.** Where fewer than two axes are oriented, no
       equivariant frame exists from this information (e.g. every vertex of a
       regular polygon or of a cube, points on a line, a cloud of duplicates:
       a rotation of the cloud onto itself fixes the node, and no frame is
       fixed by a rotation). These nodes are marked in ``ambiguous`` and get a
       deterministic but *not* equivariant frame (the eigenvectors, signed by
       the rules above where they apply, made right-handed). A model must not
       read their frame: :class:`~qsv_pyg.nn.models.QSVGeometric` gives them
       frame-free features and no frame-transported messages.

    "(Nearly) zero" means below ``tol`` times the quantity's scale
    (:math:`s_i`, :math:`s_i^3`, :math:`\lVert \mathbf{g}_i \rVert`; eigenvalue
    gaps below :math:`s_i^2`) plus a floor from the input's precision,
    :math:`8\,\varepsilon\,\max_{k}\lVert\mathbf{p}_k\rVert` per cloud
    (:math:`\varepsilon` of ``pos.dtype``; 100 times that floor for eigenvalue
    gaps, so that eigenvectors are only used where rounding cannot turn them).
    The decisions rotate with the cloud except for quantities within rounding
    of a threshold. Everything is computed in ``dtype`` (float64 by default)
    and not meant to be differentiated. The graph must be built from the same
    (rotated) points: a kNN graph whose k-th neighbour is tied is only as
    invariant as the tie-break (:func:`~qsv_pyg.geometry.knn_within` breaks
    ties by index after exact distance comparisons).

    Args:
        pos: node positions ``[N, 3]``.
        edge_index: ``[2, E]`` edges ``source -> target``; a target without
            edges has zero offsets (its frame is decided by the centroid
            direction alone, i.e. it is ambiguous).
        batch: ``[N]`` cloud index of every node (PyG's ``batch`` vector; the
            centroid is per cloud). Default: one cloud.
        rule: one of :data:`FRAME_RULES`. ``"pca"`` is :func:`local_frames`;
            ``"pca+centroid"`` additionally orients :math:`\mathbf{e}_3` by
            :math:`\langle \mathbf{p}_i - \mathbf{c}, \mathbf{e}_3 \rangle \ge 0`
            where :math:`|\langle \mathbf{m}_i, \mathbf{e}_3\rangle| \le
            10^{-9} \lVert \mathbf{m}_i\rVert` (the tie-break the ModelNet
            example used, which fails on flat shapes). Both mark no node as
            ambiguous (they do not know); they exist for ablations.
        tol: relative tolerance of the decisions (``"robust"`` only).
        num_nodes: ``N`` (default: ``pos.size(0)``).
        dtype: the floating-point type of the computation and the outputs.

    Returns:
        :class:`OrientedFrames` ``(frame [N, 3, 3], ambiguous [N], eigenvalues
        [N, 3])`` in ``dtype``.

    Raises:
        ValueError: malformed shapes, an unknown rule, a negative tolerance, or
            a non-finite position (the message names the first such point).
    """
    if rule not in FRAME_RULES:
        raise ValueError(f"oriented_frames: rule={rule!r} is not one of {FRAME_RULES}")
    if not isinstance(pos, Tensor) or pos.dim() != 2 or pos.size(1) != 3:
        shape = tuple(pos.shape) if isinstance(pos, Tensor) else type(pos).__name__
        raise ValueError(f"oriented_frames: pos must have shape [num_nodes, 3], got {shape}")
    if not pos.is_floating_point():
        raise ValueError(f"oriented_frames: pos must be floating point, got {pos.dtype}")
    if (not isinstance(edge_index, Tensor) or edge_index.dim() != 2
            or edge_index.size(0) != 2):
        raise ValueError("oriented_frames: edge_index must have shape [2, num_edges]")
    if not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"oriented_frames: tol must be a finite number >= 0, got {tol}")
    check_finite_positions(pos, "oriented_frames")
    n = pos.size(0) if num_nodes is None else int(num_nodes)
    if n != pos.size(0):
        raise ValueError(f"oriented_frames: num_nodes={n} but pos has {pos.size(0)} rows")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
        raise ValueError(f"oriented_frames: edge_index refers to nodes outside "
                         f"[0, {n})")
    dev = pos.device
    if batch is None:
        batch = torch.zeros(n, dtype=torch.long, device=dev)
    elif batch.dim() != 1 or batch.numel() != n:
        raise ValueError(f"oriented_frames: batch must have shape [{n}], got "
                         f"{tuple(batch.shape)}")
    batch = batch.long()
    p = pos.detach().to(dtype)
    num_clouds = int(batch.max()) + 1 if n else 0
    ones_n = torch.ones(n, dtype=dtype, device=dev)
    size = torch.zeros(num_clouds, dtype=dtype, device=dev).index_add_(0, batch, ones_n)
    centroid = torch.zeros(num_clouds, 3, dtype=dtype, device=dev).index_add_(0, batch, p)
    centroid = centroid / size.clamp_min(1)[:, None]

    src, dst = edge_index[0].long(), edge_index[1].long()
    d = p[src] - p[dst]  # [E, 3]
    count = torch.zeros(n, dtype=dtype, device=dev).index_add_(0, dst, torch.ones_like(d[:, 0]))
    deg = count.clamp_min(1)

    def edge_mean(values: Tensor, targets: Tensor = dst,
                  nodes: Optional[Tensor] = None) -> Tensor:
        """Per-target mean of edge ``values``; with ``nodes``, only over those
        targets (``targets`` then local indices into ``nodes``)."""
        degree = deg if nodes is None else deg[nodes]
        out = torch.zeros(degree.numel(), *values.shape[1:], dtype=dtype, device=dev)
        return out.index_add_(0, targets, values) / degree.view(
            -1, *([1] * (values.dim() - 1)))

    mean = edge_mean(d)
    second = edge_mean(d.unsqueeze(-1) * d.unsqueeze(-2))
    cov = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    lam, vecs = torch.linalg.eigh(cov)  # ascending
    lam, vecs = lam.flip(-1), vecs.flip(-1)  # descending: u1 largest, u3 smallest
    eigenvalues = lam.clamp_min(0)
    u1, u2, u3 = vecs[..., 0], vecs[..., 1], vecs[..., 2]

    if rule != "robust":
        e1 = u1 * torch.where((mean * u1).sum(-1, keepdim=True) < 0, -1.0, 1.0).to(dtype)
        e3 = u3 * torch.where((mean * u3).sum(-1, keepdim=True) < 0, -1.0, 1.0).to(dtype)
        if rule == "pca+centroid":
            rel = p - centroid[batch]
            flat = (mean * e3).sum(-1).abs() <= 1e-9 * mean.norm(dim=-1)
            outward = torch.where((rel * e3).sum(-1) < 0, -1.0, 1.0).to(dtype)
            e3 = torch.where(flat[:, None], e3 * outward[:, None], e3)
        frame = torch.stack([e1, torch.linalg.cross(e3, e1), e3], dim=-1)
        eye = torch.eye(3, dtype=dtype, device=dev).expand_as(frame)
        frame = torch.where((count > 0)[:, None, None], frame, eye)
        return OrientedFrames(frame, torch.zeros(n, dtype=torch.bool, device=dev),
                              eigenvalues)

    # Scales and thresholds (see the docstring).
    eps = torch.finfo(pos.dtype).eps
    radius = torch.zeros(num_clouds, dtype=dtype, device=dev).scatter_reduce_(
        0, batch, p.norm(dim=-1), "amax", include_self=True)
    floor = (8 * eps * radius)[batch]  # [N]
    s2 = second.diagonal(dim1=-2, dim2=-1).sum(-1)
    s = s2.sqrt()
    g = centroid[batch] - p
    thr_first = tol * s + floor
    thr_cubic = s2 * (tol * s + 3 * floor)
    thr_centroid = tol * g.norm(dim=-1) + floor
    thr_gap = s * (tol * s + 100 * floor)

    # The edge moments below are needed only at some nodes (the third moment
    # where the first does not decide, the candidates of a case only at its
    # nodes): they are summed over those nodes' edges alone (per node the same
    # sums, in the same order, as over all edges), the rest stays zero.
    def edges_of(sel: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The nodes of ``sel [N]``, their edges' offsets and local targets."""
        nodes = sel.nonzero().squeeze(1)
        local = torch.full((n,), -1, dtype=torch.long, device=dev)
        local[nodes] = torch.arange(nodes.numel(), device=dev)
        edges = sel[dst].nonzero().squeeze(1)
        return nodes, d[edges], local[dst[edges]]

    def cubic(u: Tensor, sel: Tensor) -> Tensor:  # mean_j <d_j, u>^3 at sel, else 0
        nodes, d_s, local = edges_of(sel)
        out = torch.zeros(n, dtype=dtype, device=dev)
        out[nodes] = edge_mean((d_s * u[nodes][local]).sum(-1) ** 3, local, nodes)
        return out

    def orient(u: Tensor, used: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """``u`` signed by the first decisive moment, and whether one was (at the
        nodes ``used``; elsewhere the result is not read)."""
        first, cen = (mean * u).sum(-1), (g * u).sum(-1)
        ok1 = first.abs() > thr_first
        third = cubic(u, ~ok1 if used is None else used & ~ok1)
        ok3 = third.abs() > thr_cubic
        okg = cen.abs() > thr_centroid
        value = torch.where(ok1, first, torch.where(ok3, third, torch.where(okg, cen, 1.0)))
        sign = torch.where(value < 0, -1.0, 1.0).to(dtype)
        return u * sign[:, None], ok1 | ok3 | okg

    def pick(proj: Tensor, sel: Tensor) -> Tuple[Tensor, Tensor]:
        """The first decisive candidate vector projected by ``proj [N, 3, 3]``
        (at the nodes ``sel``; zero and not found elsewhere)."""
        nodes, d_s, local = edges_of(sel)
        pd = (proj[nodes][local] @ d_s.unsqueeze(-1)).squeeze(-1)  # [E_sel, 3]
        cand_cubic = torch.zeros_like(mean)
        cand_cubic[nodes] = edge_mean(pd.pow(2).sum(-1, keepdim=True) * pd, local, nodes)
        vec = torch.zeros_like(mean)
        found = torch.zeros(n, dtype=torch.bool, device=dev)
        for c, thr in (((proj @ mean.unsqueeze(-1)).squeeze(-1), thr_first),
                       (cand_cubic, thr_cubic),
                       ((proj @ g.unsqueeze(-1)).squeeze(-1), thr_centroid)):
            take = sel & ~found & (c.norm(dim=-1) > thr)
            vec = torch.where(take[:, None], c, vec)
            found = found | take
        return _unit(vec, found), found

    gap12, gap23 = lam[:, 0] - lam[:, 1], lam[:, 1] - lam[:, 2]
    deg12, deg23 = gap12 <= thr_gap, gap23 <= thr_gap
    outer = lambda a, b: a.unsqueeze(-1) * b.unsqueeze(-2)  # noqa: E731
    cross = torch.linalg.cross

    case_p = deg12 & ~deg23
    case_l = ~deg12 & deg23
    case_i = deg12 & deg23

    # Case "distinct": three lines (x1, x2 also make the ambiguous nodes' fallback).
    x1, ok1 = orient(u1)
    x2, ok2 = orient(u2)
    x3, ok3 = orient(u3, ~case_l & ~case_i)
    # Case "plane on top" (lambda1 ~ lambda2): e1 picked in span(u1, u2).
    v, okv = pick(outer(u1, u1) + outer(u2, u2), case_p)
    w2, okw2 = orient(_unit(cross(u3, v), okv), case_p)
    # Case "line on top" (lambda2 ~ lambda3): e2 picked in span(u2, u3).
    vl, okvl = pick(outer(u2, u2) + outer(u3, u3), case_l)
    w3, okw3 = orient(_unit(cross(u1, vl), okvl), case_l)
    # Case "isotropic": e1 and e2 picked from the candidates.
    eye = torch.eye(3, dtype=dtype, device=dev).expand(n, 3, 3)
    vi1, oki1 = pick(eye, case_i)
    vi2, oki2 = pick(eye - outer(vi1, vi1), case_i)

    def choose(a, b, c, d_):  # per node: distinct / plane / line / isotropic
        out = torch.where(case_p.view(-1, *([1] * (a.dim() - 1))), b, a)
        out = torch.where(case_l.view(-1, *([1] * (a.dim() - 1))), c, out)
        return torch.where(case_i.view(-1, *([1] * (a.dim() - 1))), d_, out)

    a1 = choose(x1, v, x1, vi1)
    k1 = choose(ok1, okv, ok1, oki1)
    a2 = choose(x2, w2, vl, vi2)
    k2 = choose(ok2, okv & okw2, okvl, oki1 & oki2)
    a3 = choose(x3, x3, w3, _unit(cross(vi1, vi2), oki1 & oki2))
    k3 = choose(ok3, ok3, okvl & okw3, oki1 & oki2)

    def gram(a: Tensor, b: Tensor) -> Tensor:  # b made orthogonal to unit a, unit
        b = b - (a * b).sum(-1, keepdim=True) * a
        return b / b.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)

    use13 = k1 & k3
    use12 = ~use13 & k1 & k2
    use23 = ~use13 & ~use12 & k2 & k3
    e3_13 = gram(a1, a3)
    frame13 = torch.stack([a1, cross(e3_13, a1), e3_13], -1)
    e2_12 = gram(a1, a2)
    frame12 = torch.stack([a1, e2_12, cross(a1, e2_12)], -1)
    e3_23 = gram(a2, a3)
    frame23 = torch.stack([cross(a2, e3_23), a2, e3_23], -1)
    # The deterministic fallback of ambiguous nodes: signed eigenvectors, right-handed.
    fb3 = cross(x1, x2)
    fallback = torch.stack([x1, x2, fb3], -1)
    frame = torch.where(use13[:, None, None], frame13, fallback)
    frame = torch.where(use12[:, None, None], frame12, frame)
    frame = torch.where(use23[:, None, None], frame23, frame)
    ambiguous = ~(use13 | use12 | use23)
    return OrientedFrames(frame, ambiguous, eigenvalues)
