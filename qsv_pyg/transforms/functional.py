r"""The functions behind :mod:`qsv_pyg.transforms` and
:class:`~qsv_pyg.nn.models.QSVGeometric`: canonical kNN graphs of batched
clouds, tie-robust farthest point sampling, and the rotation-invariant node and
edge (point-pair) features of clouds with local frames.

Everything here is a function of the positions (and the frames of
:func:`~qsv_pyg.geometry.oriented_frames`), computed in float64 unless said
otherwise, and not meant to be differentiated.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from qsv_pyg.geometry.frames import check_finite_positions
from qsv_pyg.geometry.knn import knn_batched, knn_cross, knn_within

__all__ = ["NODE_FEATURES", "EDGE_FEATURES", "knn_graph", "knn_bipartite",
           "farthest_point_sampling", "invariant_node_features", "point_pair_features"]

#: Names of the columns of :func:`invariant_node_features`.
NODE_FEATURES = ("dist_centroid", "centroid_e1", "centroid_e2", "centroid_e3",
                 "local_scale", "eig_ratio_21", "eig_ratio_31", "ambiguous")
#: Names of the columns of :func:`point_pair_features`.
EDGE_FEATURES = ("dist", "d_in_dst_e1", "d_in_dst_e2", "d_in_dst_e3",
                 "d_in_src_e1", "d_in_src_e2", "d_in_src_e3", "normals_cos")


def _batch(batch: Optional[Tensor], n: int, device, fn: str) -> Tensor:
    if batch is None:
        return torch.zeros(n, dtype=torch.long, device=device)
    if not isinstance(batch, Tensor) or batch.dim() != 1 or batch.numel() != n:
        shape = tuple(batch.shape) if isinstance(batch, Tensor) else type(batch).__name__
        raise ValueError(f"{fn}: batch must have shape [{n}], got {shape}")
    if batch.is_floating_point():
        raise ValueError(f"{fn}: batch must be an integer tensor, got {batch.dtype}")
    return batch.long()


def _clouds(batch: Tensor):
    """``(cloud id, node indices)`` of every non-empty cloud, in id order."""
    if batch.numel() == 0:
        return []
    if bool((batch[1:] >= batch[:-1]).all()):  # PyG's sorted batch: slices
        ids, counts = torch.unique_consecutive(batch, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        return [(int(b), torch.arange(int(s), int(s) + int(c), device=batch.device))
                for b, s, c in zip(ids, starts, counts)]
    return [(int(b), (batch == b).nonzero().view(-1)) for b in torch.unique(batch)]


def knn_graph(pos: Tensor, k: int, batch: Optional[Tensor] = None, loop: bool = False
              ) -> Tensor:
    r"""kNN graph of every cloud of a batch, in the canonical layout of
    :func:`~qsv_pyg.geometry.knn_within` (per target exactly :obj:`k` sources,
    nearest first, ties to the smaller index; distances in float64).

    Unlike :func:`torch_cluster.knn_graph` it never returns :obj:`k + 1`
    neighbours for duplicated points, and the neighbour set does not depend on
    rounding wherever distances are not tied. Without :mod:`torch_cluster`,
    :func:`~qsv_pyg.geometry.knn_within` falls back to exact brute force.

    Args:
        pos: positions ``[N, 3]`` (any ``D``).
        k: neighbours per node; every cloud needs more than :obj:`k` points
            (at least :obj:`k` with :obj:`loop`).
        batch: ``[N]`` cloud index (PyG's ``batch``); default one cloud.
        loop: whether a node is its own candidate.

    Returns:
        ``edge_index [2, N * k]``, row 0 the source, row 1 the target, sorted by
        target when ``batch`` is sorted.
    """
    if not isinstance(pos, Tensor) or pos.dim() != 2:
        raise ValueError("knn_graph: pos must be a 2-D tensor [N, D]")
    check_finite_positions(pos, "knn_graph")
    batch = _batch(batch, pos.size(0), pos.device, "knn_graph")
    p = pos.detach().double()
    if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
        # one search over all clouds (a bad k or a small cloud: the per-cloud
        # path, which names the cloud)
        edge_index = knn_batched(p, k, batch, loop=loop)
        if edge_index is not None:
            return edge_index
    parts = []
    for b, idx in _clouds(batch):
        try:
            ei = knn_within(p[idx], k, loop=loop)
        except ValueError as error:
            raise ValueError(f"knn_graph: cloud {b} ({idx.numel()} points): {error}") from None
        parts.append(idx[ei])
    if not parts:
        return torch.empty(2, 0, dtype=torch.long, device=pos.device)
    return torch.cat(parts, dim=1)


def knn_bipartite(pos_src: Tensor, pos_dst: Tensor, k: int, batch_src: Tensor,
                  batch_dst: Tensor) -> Tensor:
    r"""The :obj:`k` nearest sources (same cloud) of every destination,
    canonical layout as :func:`knn_graph` (float64 distances).

    Returns:
        ``edge_index [2, N_dst * k]``: row 0 indexes ``pos_src``, row 1
        ``pos_dst``.
    """
    ps, pd = pos_src.detach().double(), pos_dst.detach().double()
    src_clouds = dict(_clouds(batch_src))
    parts = []
    for b, idx_dst in _clouds(batch_dst):
        idx_src = src_clouds.get(b)
        if idx_src is None:
            raise ValueError(f"knn_bipartite: cloud {b} has destinations but no sources")
        try:
            ei = knn_cross(ps[idx_src], pd[idx_dst], k, by_direction=False)
        except ValueError as error:
            raise ValueError(f"knn_bipartite: cloud {b}: {error}") from None
        parts.append(torch.stack([idx_src[ei[0]], idx_dst[ei[1]]]))
    if not parts:
        return torch.empty(2, 0, dtype=torch.long, device=pos_src.device)
    return torch.cat(parts, dim=1)


def farthest_point_sampling(pos: Tensor, ratio: float, batch: Optional[Tensor] = None,
                            tol: float = 1e-9) -> Tensor:
    r"""Farthest point sampling that does not depend on rounding at ties.

    Per cloud of :math:`n` points it keeps :math:`\lceil \text{ratio} \cdot n
    \rceil`: first the point farthest from the cloud's centroid, then
    repeatedly the point farthest from those kept, as
    :func:`torch_cluster.fps`, but in float64, and where several points are
    within ``tol`` (relative) of the largest distance the one with the
    smallest index is taken. So a rotated or translated cloud keeps the same
    points unless distances differ by about ``tol`` (exact symmetric ties are
    decided by index, not by the rounding of the rotated coordinates).

    Args:
        pos: positions ``[N, D]``.
        ratio: fraction of each cloud to keep, in ``(0, 1]``.
        batch: ``[N]`` cloud index; default one cloud.
        tol: relative tie tolerance.

    Returns:
        ``[M]`` indices into ``pos``, per cloud in sampling order, clouds in id
        order.
    """
    if not (0 < ratio <= 1):
        raise ValueError(f"farthest_point_sampling: ratio must be in (0, 1], got {ratio}")
    check_finite_positions(pos, "farthest_point_sampling")
    batch = _batch(batch, pos.size(0), pos.device, "farthest_point_sampling")
    clouds = _clouds(batch)
    if not clouds:
        return torch.empty(0, dtype=torch.long, device=pos.device)
    if ratio == 1:
        return torch.cat([idx for _, idx in clouds])
    p = pos.detach().double()
    sizes = [idx.numel() for _, idx in clouds]
    n_max, num = max(sizes), len(clouds)
    dense = p.new_zeros(num, n_max, p.size(1))
    valid = torch.zeros(num, n_max, dtype=torch.bool, device=p.device)
    index = torch.full((num, n_max), -1, dtype=torch.long, device=p.device)
    for c, (_, idx) in enumerate(clouds):
        dense[c, :idx.numel()] = p[idx]
        valid[c, :idx.numel()] = True
        index[c, :idx.numel()] = idx
    keep = torch.tensor([math.ceil(ratio * s) for s in sizes], device=p.device)
    m_max = int(keep.max())
    rows = torch.arange(num, device=p.device)

    def pick(score: Tensor) -> Tensor:
        score = score.masked_fill(~valid, -1.0)
        best = score.max(dim=1, keepdim=True).values
        near = score >= best - tol * best.abs()
        return near.to(torch.int8).argmax(dim=1)  # the first (smallest index) near-best

    centroid = (dense * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)
    current = pick((dense - centroid[:, None]).pow(2).sum(-1))
    chosen = [current]
    min_dist = torch.full((num, n_max), float("inf"), dtype=p.dtype, device=p.device)
    for _ in range(1, m_max):
        last = dense[rows, current]
        min_dist = torch.minimum(min_dist, (dense - last[:, None]).pow(2).sum(-1))
        current = pick(min_dist)
        chosen.append(current)
    order = torch.stack(chosen, dim=1)  # [num, m_max]
    return torch.cat([index[c, order[c, :int(keep[c])]] for c in range(num)])


def _centroids(p: Tensor, batch: Tensor) -> Tensor:
    num = int(batch.max()) + 1 if batch.numel() else 0
    size = torch.zeros(num, dtype=p.dtype, device=p.device).index_add_(
        0, batch, torch.ones_like(p[:, 0]))
    total = torch.zeros(num, p.size(1), dtype=p.dtype, device=p.device).index_add_(0, batch, p)
    return (total / size.clamp_min(1)[:, None])[batch]


def invariant_node_features(pos: Tensor, frame: Tensor, ambiguous: Tensor,
                            eigenvalues: Tensor, batch: Optional[Tensor] = None) -> Tensor:
    r"""Rotation- and translation-invariant node features ``[N, 8]``
    (columns :data:`NODE_FEATURES`).

    With :math:`\mathbf{r}_i = \mathbf{p}_i - \mathbf{c}` (:math:`\mathbf{c}` the
    centroid of :math:`i`'s cloud), the frame :math:`R_i` and the local
    covariance's eigenvalues :math:`\lambda_1 \ge \lambda_2 \ge \lambda_3`:

    .. math::
        \big[\, \lVert \mathbf{r}_i \rVert,\; R_i^\top \mathbf{r}_i,\;
        \sqrt{\lambda_1 + \lambda_2 + \lambda_3},\; \lambda_2 / \lambda_1,\;
        \lambda_3 / \lambda_1,\; a_i \,\big]

    (the centroid's distance, its ray in the node's frame, the neighbourhood's
    spread and shape: linear, planar or isotropic; ratios are 0 where
    :math:`\lambda_1 = 0`). On an ambiguous node (:math:`a_i = 1`) the frame
    is not equivariant, so :math:`R_i^\top \mathbf{r}_i` is set to zero there:
    the row depends on no ambiguous axis.

    Args:
        pos: ``[N, 3]``; frame: ``[N, 3, 3]``; ambiguous: ``[N]`` bool;
        eigenvalues: ``[N, 3]`` descending (all from
        :func:`~qsv_pyg.geometry.oriented_frames`); batch: ``[N]`` or None.

    Returns:
        ``[N, 8]`` in float64.
    """
    n = pos.size(0)
    batch = _batch(batch, n, pos.device, "invariant_node_features")
    p = pos.detach().double()
    r = p - _centroids(p, batch)
    local = (frame.double().transpose(1, 2) @ r.unsqueeze(-1)).squeeze(-1)
    amb = ambiguous.bool()
    local = local.masked_fill(amb[:, None], 0.0)
    lam = eigenvalues.double().clamp_min(0)
    top = lam[:, :1]
    ratios = torch.where(top > 0, lam[:, 1:] / top.clamp_min(torch.finfo(lam.dtype).tiny),
                         torch.zeros_like(lam[:, 1:]))
    return torch.cat([r.norm(dim=-1, keepdim=True), local,
                      lam.sum(-1, keepdim=True).sqrt(), ratios, amb[:, None].double()], 1)


def point_pair_features(pos: Tensor, edge_index: Tensor, frame: Tensor, ambiguous: Tensor,
                        pos_dst: Optional[Tensor] = None, frame_dst: Optional[Tensor] = None,
                        ambiguous_dst: Optional[Tensor] = None) -> Tensor:
    r"""Rotation- and translation-invariant point-pair features ``[E, 8]`` of
    the edges :math:`j \to i` (columns :data:`EDGE_FEATURES`).

    With :math:`\mathbf{d} = \mathbf{p}_j - \mathbf{p}_i`, :math:`\hat{\mathbf{d}}
    = \mathbf{d} / \lVert\mathbf{d}\rVert` (0 for coincident points) and the
    frames' normals :math:`\mathbf{n} = \mathbf{e}_3`:

    .. math::
        \big[\, \lVert \mathbf{d} \rVert,\; R_i^\top \hat{\mathbf{d}},\;
        R_j^\top \hat{\mathbf{d}},\; \langle \mathbf{n}_i, \mathbf{n}_j \rangle \,\big].

    These are the point-pair features of PPF/RIConv++/PaRI-Conv written in the
    frames: the third entry of :math:`R_i^\top \hat{\mathbf{d}}` is
    :math:`\cos\angle(\mathbf{n}_i, \mathbf{d})`, its first two are
    :math:`\sin\angle(\mathbf{n}_i, \mathbf{d})` times the cosine and sine of
    the in-plane angle of :math:`\mathbf{d}` to the frame's x-axis (the
    product keeps them continuous where :math:`\mathbf{d}` is along the
    normal), the same at :math:`j`, and the angle between the normals. The
    block of an ambiguous endpoint (and the normals' cosine, if either is
    ambiguous) is zero.

    Args:
        pos: source positions ``[N_src, 3]`` (and targets unless ``pos_dst``).
        edge_index: ``[2, E]``, row 0 the sources, row 1 the targets.
        frame, ambiguous: the sources' frames ``[N_src, 3, 3]`` and marks ``[N_src]``.
        pos_dst, frame_dst, ambiguous_dst: the targets' for a bipartite graph.

    Returns:
        ``[E, 8]`` in float64.
    """
    pos_dst = pos if pos_dst is None else pos_dst
    frame_dst = frame if frame_dst is None else frame_dst
    ambiguous_dst = ambiguous if ambiguous_dst is None else ambiguous_dst
    src, dst = edge_index[0], edge_index[1]
    # Coordinate-major ([3, E], [9, E]): every product below is one contiguous
    # vector op (per-edge 3x3 matmuls or sums over a size-3 dimension are
    # several times slower on CPU).
    def columns(t: Tensor, index: Tensor) -> Tensor:  # [N, ...] -> [numel / N, E]
        return t.detach().double().reshape(t.size(0), -1).t().contiguous().index_select(1, index)

    d = columns(pos, src) - columns(pos_dst, dst)  # [3, E]
    dist = (d[0] * d[0] + d[1] * d[1] + d[2] * d[2]).sqrt()
    unit = torch.where(dist > 0, d / dist.clamp_min(torch.finfo(d.dtype).tiny),
                       torch.zeros_like(d))
    f_src, f_dst = columns(frame, src), columns(frame_dst, dst)  # [9, E]: row b*3+a
    a_src, a_dst = ambiguous.bool()[src], ambiguous_dst.bool()[dst]

    def in_frame(f: Tensor, amb: Tensor) -> List[Tensor]:  # R^T u, zero if ambiguous
        return [(f[a] * unit[0] + f[3 + a] * unit[1] + f[6 + a] * unit[2]).masked_fill_(amb, 0.0)
                for a in range(3)]

    normals = (f_src[2] * f_dst[2] + f_src[5] * f_dst[5] + f_src[8] * f_dst[8]).masked_fill_(
        a_src | a_dst, 0.0)
    return torch.stack([dist, *in_frame(f_dst, a_dst), *in_frame(f_src, a_src), normals], dim=1)
