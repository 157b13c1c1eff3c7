r"""Deterministic k-nearest-neighbour graphs on top of :mod:`torch_cluster`.

All builders return a :obj:`[2, num_targets * k]` :obj:`edge_index` in PyG's
``source_to_target`` convention (row 0 = source :math:`j`, row 1 = target
:math:`i`) with a fixed layout:

* exactly :obj:`k` edges per target, no more, no fewer;
* sorted by target, and within a target by **(distance, source index)**, i.e.
  nearest first, ties broken towards the smaller source index.

The neighbour *set* is also canonical: it is the first :obj:`k` sources in that
(distance, index) order. :func:`torch_cluster.knn` alone does not give this,
because among equidistant candidates it keeps an arbitrary subset (and
:func:`torch_cluster.knn_graph` with ``loop=False`` can return :obj:`k + 1`
neighbours for duplicated points). Here :func:`torch_cluster.knn` only proposes
candidates; distances are recomputed, re-sorted by (distance, index), and the
candidate count is doubled until no tie straddles the :obj:`k`-th place.
Distances are compared exactly as computed in the input dtype, so ties are only
recognised when the arithmetic is exact (e.g. integer coordinates, see
:func:`~qsv_pyg.geometry.build_lattice_hierarchy`).

Without :mod:`torch_cluster` (an optional extra: the GPU image has none) the
candidates come from an exact brute force on any device
(:func:`_candidates_brute_force`: chunks of targets, squared distances in the
same arithmetic as the re-sort, :func:`torch.topk`), with memory bounded by
:data:`BRUTE_FORCE_ELEMENTS`. Both paths give the same graphs: the candidates
only have to contain the :obj:`k` nearest, and the re-sort by (distance,
index) and the doubling until no tie straddles the :obj:`k`-th place decide
the rest, including among exactly equidistant sources (lattices).

Because of the fixed layout, :func:`dense_neighbors` can view such an
:obj:`edge_index` as a :obj:`[num_targets, k]` neighbour table for free.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

try:
    import torch_cluster
except ImportError:  # e.g. a GPU image without it: exact brute force instead
    torch_cluster = None

__all__ = ["knn_within", "knn_cross", "knn_batched", "dense_neighbors"]

# torch_cluster's CUDA kernel keeps its candidate list in registers and refuses k > 100.
_CUDA_MAX_K = 100
#: Elements of the ``[targets, sources, D]`` difference tensor one chunk of the
#: brute-force search holds (2**24: 64 MiB in float32; the distances and top-k
#: of a chunk are smaller). On a GPU a 16k x 16k search in 3-D is about 50 chunks.
BRUTE_FORCE_ELEMENTS = 1 << 24


def _check_pos(pos: Tensor, name: str, fn: str) -> None:
    if not isinstance(pos, Tensor) or pos.dim() != 2:
        shape = tuple(pos.shape) if isinstance(pos, Tensor) else type(pos).__name__
        raise ValueError(f"{fn}: {name} must be a 2-D tensor [N, D], got {shape}")
    if not pos.is_floating_point():
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {pos.dtype}")


def _check_k(k: int, num_candidates: int, fn: str, what: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"{fn}: k must be an int, got {k!r}")
    if k <= 0:
        raise ValueError(f"{fn}: k must be positive, got k={k}")
    if k > num_candidates:
        raise ValueError(
            f"{fn}: k={k} is larger than the {num_candidates} available neighbours ({what})"
        )


def _candidates(src: Tensor, dst: Tensor, k_query: int,
                batch: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """``[N_dst, k_query]`` indices into :obj:`src` that contain the
    :obj:`k_query` nearest sources of every destination (in some order); with
    ``batch`` (sorted cloud ids of the sources and of the destinations, every
    cloud with more than ``k_query`` sources), the nearest of its own cloud."""
    n_src, n_dst = src.size(0), dst.size(0)
    if batch is None and k_query >= n_src:
        # Every source is a candidate; cheaper and simpler than a search.
        return torch.arange(n_src, device=src.device).expand(n_dst, n_src)
    if batch is None and (torch_cluster is None or (src.is_cuda and k_query > _CUDA_MAX_K)):
        return _candidates_brute_force(src, dst, k_query)
    row, col = torch_cluster.knn(src, dst, k_query, *(batch or ()))  # row: dst, col: src
    if row.numel() != n_dst * k_query:
        raise RuntimeError(
            f"torch_cluster.knn returned {row.numel()} pairs, expected {n_dst} x {k_query}"
        )
    # Group by destination; the within-row order is irrelevant (re-sorted later).
    # On CPU torch_cluster returns the pairs grouped already: one comparison pass
    # (a twentieth of the sort's time) confirms it. On CUDA the check would be a
    # host sync, so the sort always runs there.
    if src.is_cuda or not bool((row[1:] >= row[:-1]).all()):
        col = col[torch.sort(row, stable=True).indices]
    return col.view(n_dst, k_query)


def _candidates_brute_force(src: Tensor, dst: Tensor, k_query: int) -> Tensor:
    r""":func:`_candidates` without torch_cluster: the exact top-:obj:`k_query`
    of the squared distances, in chunks of destinations so that a chunk's
    ``[chunk, N_src, D]`` differences hold at most :data:`BRUTE_FORCE_ELEMENTS`.

    The distances are :math:`\sum_d (p_{j,d} - p_{i,d})^2` in the input dtype,
    the arithmetic of :func:`_select`'s re-sort (not :func:`torch.cdist`, whose
    matrix-product form rounds differently): every source left out is then
    exactly at least as far as the farthest candidate, which the tie check
    relies on. Ties among candidates are broken by the re-sort, not here."""
    n_src, dim = src.size(0), max(1, src.size(1))
    chunk = max(1, BRUTE_FORCE_ELEMENTS // max(1, n_src * dim))
    out = []
    for i in range(0, dst.size(0), chunk):
        d2 = (src.unsqueeze(0) - dst[i:i + chunk].unsqueeze(1)).pow(2).sum(dim=-1)
        out.append(d2.topk(k_query, dim=1, largest=False, sorted=False).indices)
    return torch.cat(out, dim=0)


def _select(src: Tensor, dst: Tensor, k: int, self_index: bool,
            batch: Optional[Tuple[Tensor, Tensor, int]] = None) -> Optional[Tensor]:
    r"""Canonical k nearest sources of every destination.

    Args:
        src (Tensor): Sources :obj:`[N_src, D]`.
        dst (Tensor): Destinations :obj:`[N_dst, D]`.
        k (int): Neighbours per destination, already validated.
        self_index (bool): If :obj:`True`, :obj:`src` and :obj:`dst` are the
            same point set and source :math:`i` is excluded for destination
            :math:`i`.
        batch (tuple, optional): ``(batch_src, batch_dst, fewest)``: sorted
            cloud ids and the fewest sources of a cloud; every destination
            then takes the nearest sources of its own cloud, found in one
            search over all clouds (:func:`torch_cluster.knn`).

    Returns:
        Tensor: :obj:`[N_dst, k]` source indices, each row ordered by
        (distance, index); with ``batch``, :obj:`None` when a tie would make
        the search reach a whole cloud (the caller then goes cloud by cloud).
    """
    n_src, n_dst = src.size(0), dst.size(0)
    if n_dst == 0:
        return torch.empty(0, k, dtype=torch.long, device=src.device)
    src, dst = src.contiguous(), dst.contiguous()
    target = torch.arange(n_dst, device=src.device).unsqueeze(-1)

    # One extra candidate to detect a tie at the k-th place, one more for self.
    k_query = min(n_src, k + 1 + int(self_index))
    while True:
        if batch is not None and k_query >= batch[2]:
            return None
        cand = _candidates(src, dst, k_query, None if batch is None else batch[:2])
        # Sort by index first, then stably by distance: (distance, index) order.
        cand = torch.sort(cand, dim=-1).values
        dist = (src[cand] - dst.unsqueeze(1)).pow(2).sum(dim=-1)
        if self_index:
            dist = dist.masked_fill(cand == target, float("inf"))
        dist, order = torch.sort(dist, dim=-1, stable=True)
        cand = cand.gather(-1, order)

        if cand.size(1) >= n_src:  # every source was a candidate
            break
        # The candidates are the k_query nearest, so every source left out is at
        # least as far as the farthest candidate. If some (non-self) candidate is
        # strictly farther than the k-th, nothing left out can tie with the k-th.
        finite = torch.isfinite(dist)
        kth = dist[:, k - 1 : k]
        resolved = ((dist > kth) & finite).any(dim=-1)
        if bool(resolved.all()):
            break
        k_query = min(n_src, 2 * k_query)

    return cand[:, :k]


def knn_batched(pos: Tensor, k: int, batch: Tensor, loop: bool = False) -> Optional[Tensor]:
    r""":func:`knn_within` of every cloud of a batch at once: one candidate
    search over all clouds (:func:`torch_cluster.knn` with the batch vector)
    instead of one per cloud, the same graph (the per-cloud (distance, index)
    order is the global one: the clouds are contiguous). ``pos`` and ``k`` are
    validated by the caller; :obj:`None` when this path does not apply
    (no :mod:`torch_cluster`, an unsorted ``batch``, a cloud too small for the
    search, or ties reaching a whole cloud): go cloud by cloud then.

    Returns:
        LongTensor or None: ``edge_index [2, N * k]``, global node indices.
    """
    n = pos.size(0)
    if torch_cluster is None or n == 0 or (pos.is_cuda and k + 2 > _CUDA_MAX_K):
        return None
    batch = batch.to(pos.device)
    if not bool((batch[1:] >= batch[:-1]).all()):
        return None
    fewest = int(torch.unique_consecutive(batch, return_counts=True)[1].min())
    nbr = _select(pos, pos, k, self_index=not loop, batch=(batch, batch, fewest))
    return None if nbr is None else _to_edge_index(nbr)


def _to_edge_index(nbr: Tensor) -> Tensor:
    n_dst, k = nbr.shape
    target = torch.arange(n_dst, device=nbr.device).repeat_interleave(k)
    return torch.stack([nbr.reshape(-1), target], dim=0)


def knn_within(pos: Tensor, k: int, loop: bool = False) -> Tensor:
    r"""k-nearest-neighbour graph of one point set.

    Every node :math:`i` receives edges from its :obj:`k` nearest nodes
    :math:`j` (Euclidean distance), nearest first, ties broken by smaller
    :math:`j`.

    Args:
        pos (Tensor): Node positions :obj:`[N, D]` (any device).
        k (int): Neighbours per node; :math:`1 \le k \le N - 1`
            (:math:`\le N` if :obj:`loop`).
        loop (bool, optional): If :obj:`True`, a node is its own candidate
            (at distance 0, so it comes first unless a duplicate point has a
            smaller index). (default: :obj:`False`)

    Returns:
        LongTensor: :obj:`edge_index` of shape :obj:`[2, N * k]`, row 0 the
        source, row 1 the target, target-sorted, exactly :obj:`k` per target.

    Raises:
        ValueError: If :obj:`pos` is not :obj:`[N, D]` floating point or
            :obj:`k` is out of range.
    """
    _check_pos(pos, "pos", "knn_within")
    n = pos.size(0)
    _check_k(k, n if loop else n - 1, "knn_within",
             f"N={n} nodes" + ("" if loop else ", self excluded"))
    return _to_edge_index(_select(pos, pos, k, self_index=not loop))


def knn_cross(
    pos_src: Tensor,
    pos_dst: Tensor,
    k: int,
    by_direction: bool = True,
) -> Tensor:
    r"""Bipartite k-nearest-neighbour graph from :obj:`pos_src` to
    :obj:`pos_dst`.

    Every destination node takes its :obj:`k` nearest source nodes. With
    :obj:`by_direction`, distances are between unit directions
    :math:`p / \lVert p \rVert` (monotone in the angle), which is the right
    notion between concentric shells of different radii.

    Args:
        pos_src (Tensor): Source positions :obj:`[N_src, D]`.
        pos_dst (Tensor): Destination positions :obj:`[N_dst, D]`, same
            :obj:`D`, dtype and device.
        k (int): Neighbours per destination, :math:`1 \le k \le N_{src}`.
        by_direction (bool, optional): Compare directions instead of
            positions. Positions must then be non-zero. (default: :obj:`True`)

    Returns:
        LongTensor: :obj:`edge_index` of shape :obj:`[2, N_dst * k]`; row 0
        indexes :obj:`pos_src`, row 1 indexes :obj:`pos_dst`; target-sorted,
        exactly :obj:`k` per target, each target's sources in (distance, index)
        order.

    Raises:
        ValueError: On malformed positions or :obj:`k` out of range.
    """
    _check_pos(pos_src, "pos_src", "knn_cross")
    _check_pos(pos_dst, "pos_dst", "knn_cross")
    if pos_src.size(1) != pos_dst.size(1):
        raise ValueError(
            f"knn_cross: pos_src and pos_dst must have the same dimension, "
            f"got {pos_src.size(1)} and {pos_dst.size(1)}"
        )
    _check_k(k, pos_src.size(0), "knn_cross", f"N_src={pos_src.size(0)} source nodes")
    if by_direction:
        pos_src = _unit(pos_src)
        pos_dst = _unit(pos_dst)
    return _to_edge_index(_select(pos_src, pos_dst.to(pos_src.dtype), k, self_index=False))


def _unit(pos: Tensor) -> Tensor:
    return pos / pos.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(pos.dtype).tiny)


def dense_neighbors(edge_index: Tensor, num_dst: int) -> Optional[Tensor]:
    r"""View a regular, target-sorted :obj:`edge_index` as a neighbour table.

    Args:
        edge_index (LongTensor): :obj:`[2, E]`, row 1 the targets.
        num_dst (int): Number of target nodes.

    Returns:
        LongTensor or None: :obj:`[num_dst, k]` source indices (a view of row 0
        when it is contiguous, :math:`k = E / \text{num\_dst}`) if the targets read
        :math:`0, \dots, 0, 1, \dots, 1, \dots` with exactly :math:`k \ge 1`
        copies of each, as produced by :func:`knn_within` and
        :func:`knn_cross`; otherwise :obj:`None`.
    """
    if edge_index.dim() != 2 or edge_index.size(0) != 2 or num_dst <= 0:
        return None
    num_edges = edge_index.size(1)
    if num_edges == 0 or num_edges % num_dst != 0:
        return None
    k = num_edges // num_dst
    expected = torch.arange(num_dst, device=edge_index.device).repeat_interleave(k)
    if not torch.equal(edge_index[1], expected.to(edge_index.dtype)):
        return None
    return edge_index[0].reshape(num_dst, k)
