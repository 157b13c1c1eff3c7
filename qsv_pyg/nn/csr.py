r"""The target-sorted CSR form of a graph, built once per graph and cached.

:func:`~qsv_pyg.nn.qsv_kernel.qsv_attend` walks the incoming edges of every
target (softmax and weighted sum) and, in its backward, the outgoing edges of
every source. Both orders come from one sort each, done once per graph (as
PyG's :class:`~torch_geometric.EdgeIndex` caches its sort) and reused while the
``edge_index`` tensor is unchanged. Under :func:`torch.compile` the same
arrays are built inside the graph on every call (sorts of static shape, no
host syncs): the cache cannot key on storage there.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor
from torch_geometric import is_compiling


class GraphCSR(NamedTuple):
    """Index arrays of one graph (all int64, on the graph's device).

    ``rowptr [N_dst + 1]`` / ``col [E]`` / ``row [E]``: the edges sorted by
    target (stable), their sources and targets; ``perm [E]``: the original
    position of every sorted edge; ``rowptr_t [N_src + 1]`` / ``perm_t [E]`` /
    ``row_t [E]``: the sorted edges regrouped by source (stable), as their
    sorted-edge index and their target.
    """
    rowptr: Tensor
    col: Tensor
    row: Tensor
    perm: Tensor
    rowptr_t: Tensor
    perm_t: Tensor
    row_t: Tensor

    @property
    def num_edges(self) -> int:
        return self.col.numel()


def _rowptr(index: Tensor, num_rows: int) -> Tensor:
    # index_add_ rather than bincount: a static output shape (compile-friendly).
    counts = torch.zeros(num_rows, dtype=torch.long, device=index.device)
    counts.index_add_(0, index, torch.ones_like(index))
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def build_csr(edge_index: Tensor, num_src: int, num_dst: int) -> GraphCSR:
    """The :class:`GraphCSR` of a ``[2, E]`` edge index (no cache)."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    perm = torch.argsort(dst, stable=True)
    col, row = src[perm], dst[perm]
    perm_t = torch.argsort(col, stable=True)
    return GraphCSR(_rowptr(dst, num_dst), col, row, perm, _rowptr(col, num_src), perm_t,
                    row[perm_t])


def check_range(edge_index: Tensor, num_src: int, num_dst: int) -> None:
    """Indices outside ``[0, num_src) x [0, num_dst)`` raise a clear ValueError."""
    if edge_index.numel() == 0:
        return
    lo, hi = edge_index.amin(dim=1).tolist(), edge_index.amax(dim=1).tolist()
    for name, low, high, n in (("source", lo[0], hi[0], num_src),
                               ("target", lo[1], hi[1], num_dst)):
        if low < 0 or high >= n:
            raise ValueError(f"edge_index has {name} indices in [{low}, {high}] but there "
                             f"are {n} {name} nodes")


def batch_csr(g: GraphCSR, batch: int, num_src: int, num_dst: int) -> GraphCSR:
    """``batch`` disjoint copies of ``g`` (copy ``b``'s nodes offset by ``b * N``)."""
    E = g.num_edges
    b = torch.arange(batch, device=g.col.device).view(-1, 1)

    def ptr(p: Tensor) -> Tensor:
        return torch.cat([(p[:-1].view(1, -1) + b * E).reshape(-1),
                          p.new_full((1, ), batch * E)])

    def shift(t: Tensor, by: int) -> Tensor:
        return (t.view(1, -1) + b * by).reshape(-1)

    return GraphCSR(ptr(g.rowptr), shift(g.col, num_src), shift(g.row, num_dst),
                    shift(g.perm, E), ptr(g.rowptr_t), shift(g.perm_t, E),
                    shift(g.row_t, num_dst))


_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_MAX_ENTRIES = 32


def graph_csr(edge_index: Tensor, num_src: int, num_dst: int, batch: int = 0) -> GraphCSR:
    """The cached :class:`GraphCSR` of ``edge_index`` (of ``batch`` copies when
    ``batch > 0``).

    Keyed on the tensor's storage address, offset, strides and version counter,
    so an in-place change is noticed; the entry holds the tensor, so its
    address cannot be reused by another graph while the entry lives. Index
    ranges are checked once per graph, when the entry is built.
    """
    if is_compiling():
        g = build_csr(edge_index, num_src, num_dst)
        return batch_csr(g, batch, num_src, num_dst) if batch else g
    key = (edge_index.device, edge_index.untyped_storage().data_ptr(),
           edge_index.storage_offset(), edge_index._version, tuple(edge_index.shape),
           tuple(edge_index.stride()), num_src, num_dst, batch)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit[0]
    if batch:
        g = batch_csr(graph_csr(edge_index, num_src, num_dst), batch, num_src, num_dst)
    else:
        check_range(edge_index, num_src, num_dst)
        g = build_csr(edge_index, num_src, num_dst)
    _CACHE[key] = (g, edge_index)
    while len(_CACHE) > _MAX_ENTRIES:
        _CACHE.popitem(last=False)
    return g
