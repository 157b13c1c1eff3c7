r"""The graph structure: edge index checks and self-loops, the target-sorted
CSR of a graph and batch copies of a graph (cached by :mod:`qsv_pyg.nn.graph_cache`).

:func:`~qsv_pyg.nn.qsv_kernel.qsv_attend` walks the incoming edges of every
target (softmax and weighted sum) and, in its backward, the outgoing edges of
every source. Both orders come from one sort each, done once per graph (as
PyG's :class:`~torch_geometric.EdgeIndex` caches its sort) and reused while the
``edge_index`` tensor holds the same values
(:func:`~qsv_pyg.nn.graph_cache.graph_csr`). A batch of ``B`` items over one
graph is ``B`` disjoint copies of it, node indices of copy ``b`` offset by
``b * N`` (:func:`batch_edge_index`, :func:`batch_csr`; both from
:func:`_copies`); :func:`~qsv_pyg.nn.graph_cache.cached_batch_edge_index`
caches the copies in the same cache, for message passing
(:class:`~qsv_pyg.nn.QSVConv`'s other path, PyG's convs in
:class:`~qsv_pyg.models.blocks.GraphConvAdapter`). Under :func:`torch.compile`
the same arrays are built inside the graph on every call (sorts of static
shape, no host syncs): the cache cannot key on storage there.
A static graph avoids that: its owner builds the CSR once, keeps it in module
buffers and attaches it to the edge index (:func:`attach_static_csr`, as
:class:`~qsv_pyg.models.GraphNet` does for its graphs); a compiled call then
reads those buffers (:func:`static_csr`) instead of sorting again, and only
the batch copies (:func:`batch_csr`: an ``arange`` and adds, no sort) are
computed in the graph.

A :class:`~torch_geometric.EdgeIndex` is not put in this cache: it caches its
own compressed forms, and :func:`~qsv_pyg.nn.graph_cache.graph_csr` builds its
CSR from them (:func:`edge_index_csr`: its ``get_csc()`` is the target-sorted order, its
``get_csr()`` or its own row order the source-grouped one), so the sort lives
and dies with the EdgeIndex, as in PyG's own layers. Its batch copies are an
EdgeIndex again (:func:`batch_edge_index_of`), also uncached.

The cache itself (its keys, verification, limits and guarantees) is
:mod:`qsv_pyg.nn.graph_cache`.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric import EdgeIndex, is_compiling
from torch_geometric.typing import Adj, SparseTensor
from torch_geometric.utils import add_self_loops, is_torch_sparse_tensor, remove_self_loops


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


def check_edge_index(edge_index: Tensor) -> None:
    """A plain edge index must be an integer ``[2, E]`` tensor (a ValueError
    naming what is wrong)."""
    if edge_index.is_floating_point() or edge_index.is_complex() \
            or edge_index.dtype == torch.bool:
        raise ValueError(f"edge_index must be an integer tensor (torch.long), got "
                         f"{edge_index.dtype}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, num_edges], got "
                         f"{tuple(edge_index.shape)}")


def with_self_loops(edge_index: Adj, x_src: Tensor, x_dst: Optional[Tensor],
                    size: Optional[Tuple[int, int]]) -> Adj:
    """``edge_index`` with one self-loop per node present on both sides (as in
    GATConv); existing self-loops are replaced."""
    return with_self_loops_and_attr(edge_index, x_src, x_dst, size)[0]


def with_self_loops_and_attr(edge_index: Adj, x_src: Tensor, x_dst: Optional[Tensor],
                             size: Optional[Tuple[int, int]],
                             edge_attr: Optional[Tensor] = None,
                             fill_value: Union[float, Tensor, str] = "mean"
                             ) -> Tuple[Adj, Optional[Tensor]]:
    """:func:`with_self_loops` and the edge features: the new loops get
    ``fill_value`` features as in GATConv (a float, a tensor, or a reduction
    of each target's incoming features, ``"mean"``, ``"add"``, ...; PyG's
    :func:`~torch_geometric.utils.add_self_loops`)."""
    if isinstance(edge_index, SparseTensor):
        from torch_geometric.typing import torch_sparse
        return torch_sparse.set_diag(edge_index), edge_attr
    if is_torch_sparse_tensor(edge_index):
        raise ValueError("add_self_loops=True is not supported for torch.sparse "
                         "adjacencies; add the diagonal before calling QSVConv")
    num_nodes = x_src.size(-2)
    if x_dst is not None:
        num_nodes = min(num_nodes, x_dst.size(-2))
    if size is not None:
        num_nodes = min(size)
    edge_index, edge_attr = remove_self_loops(edge_index, edge_attr)
    edge_index, edge_attr = add_self_loops(edge_index, edge_attr, fill_value=fill_value,
                                           num_nodes=num_nodes)
    return edge_index, edge_attr

def _index_ranges(edge_index: Tensor) -> Optional[List[int]]:
    """``[src_min, dst_min, src_max, dst_max]`` of a ``[2, E]`` edge index, by
    one reduction and one host sync (:obj:`None` when there are no edges)."""
    if edge_index.numel() == 0:
        return None
    lo, hi = torch.aminmax(edge_index, dim=1)
    return torch.cat([lo, hi]).tolist()


def _check_ranges(ranges: Optional[List[int]], num_src: int, num_dst: int) -> None:
    if ranges is None:
        return
    for name, low, high, n in (("source", ranges[0], ranges[2], num_src),
                               ("target", ranges[1], ranges[3], num_dst)):
        if low < 0 or high >= n:
            raise ValueError(f"edge_index has {name} indices in [{low}, {high}] but there "
                             f"are {n} {name} nodes")


def check_range(edge_index: Tensor, num_src: int, num_dst: int) -> None:
    """Indices outside ``[0, num_src) x [0, num_dst)`` raise a clear ValueError
    (one reduction, one host sync)."""
    _check_ranges(_index_ranges(edge_index), num_src, num_dst)


def _copies(t: Tensor, batch: int, step: int) -> Tensor:
    """``batch`` copies of the 1-D ``t`` end to end, copy ``b`` plus ``b * step``:
    the one batch-offset builder. From ``arange`` and Python scalars only (a
    tensor built from host data would be a host-to-device copy, a sync on CUDA)."""
    b = torch.arange(batch, device=t.device).view(-1, 1)
    return (t.view(1, -1) + b * step).reshape(-1)


def batch_edge_index(edge_index: Tensor, batch: int, num_src: int, num_dst: int) -> Tensor:
    """``batch`` copies of ``edge_index``, copy ``b`` offset by ``(b * num_src,
    b * num_dst)``, concatenated in batch order: ``[2, batch * E]`` (no cache;
    :func:`cached_batch_edge_index` caches it)."""
    edge_index = plain_edge_index(edge_index)  # EdgeIndex: its own ops break compile
    return torch.stack([_copies(edge_index[0], batch, num_src),
                        _copies(edge_index[1], batch, num_dst)])


def batch_csr(g: GraphCSR, batch: int, num_src: int, num_dst: int) -> GraphCSR:
    """``batch`` disjoint copies of ``g`` (copy ``b``'s nodes offset by ``b * N``):
    the CSR of :func:`batch_edge_index`, without sorting again."""
    E = g.num_edges

    def ptr(p: Tensor) -> Tensor:
        return torch.cat([_copies(p[:-1], batch, E), p.new_full((1, ), batch * E)])

    return GraphCSR(ptr(g.rowptr), _copies(g.col, batch, num_src),
                    _copies(g.row, batch, num_dst), _copies(g.perm, batch, E),
                    ptr(g.rowptr_t), _copies(g.perm_t, batch, E),
                    _copies(g.row_t, batch, num_dst))


#: The attribute of an edge index tensor that holds its :class:`StaticCSR`.
STATIC_ATTR = "_qsv_static_csr"


class StaticCSR(NamedTuple):
    """A CSR kept by the owner of a static graph (see :func:`attach_static_csr`)."""
    num_src: int
    num_dst: int
    csr: GraphCSR


def attach_static_csr(edge_index: Tensor, num_src: int, num_dst: int,
                      csr: GraphCSR) -> None:
    """Attach ``csr`` (the :class:`GraphCSR` of ``edge_index``, e.g. held in
    module buffers) to the tensor ``edge_index`` for compiled calls.

    Under :func:`torch.compile`, :func:`graph_csr` then reads these arrays
    rather than building them in the graph on every call. The owner keeps them
    current: nothing checks, inside a compiled graph, that ``edge_index`` still
    holds the values ``csr`` was built from (rebuild and attach again after
    writing new edges into it, as :class:`~qsv_pyg.models.GraphNet` does after
    ``load_state_dict`` and ``.to()``). Eager calls keep using the cache, which
    verifies its hits."""
    if type(edge_index) is not Tensor:
        raise TypeError(f"attach_static_csr needs a plain tensor, got {type(edge_index)}")
    if csr.num_edges != edge_index.size(1) or csr.rowptr.numel() != num_dst + 1 \
            or csr.rowptr_t.numel() != num_src + 1:
        raise ValueError(f"the CSR ({csr.num_edges} edges, {csr.rowptr.numel() - 1} targets, "
                         f"{csr.rowptr_t.numel() - 1} sources) does not fit the edge index "
                         f"({edge_index.size(1)} edges, {num_dst} targets, {num_src} sources)")
    setattr(edge_index, STATIC_ATTR, StaticCSR(num_src, num_dst, csr))


def static_csr(edge_index: Tensor, num_src: int, num_dst: int) -> Optional[GraphCSR]:
    """The CSR attached to ``edge_index`` for these node counts, or None."""
    held = getattr(edge_index, STATIC_ATTR, None)
    if held is None or held.num_src != num_src or held.num_dst != num_dst:
        return None
    return held.csr


def plain_edge_index(edge_index: Tensor) -> Tensor:
    """A plain tensor of ``edge_index``'s values: an
    :class:`~torch_geometric.EdgeIndex` keeps them in its ``as_tensor()``."""
    if isinstance(edge_index, EdgeIndex):  # first: traced by torch.compile too
        return edge_index.as_tensor()
    if type(edge_index) is Tensor:
        return edge_index
    return edge_index.as_subclass(Tensor)


# ---------------------------------------------------------------- EdgeIndex
def _ptr(ptr: Tensor, num: int) -> Tensor:
    """``ptr`` as int64 with ``num + 1`` entries: an :class:`EdgeIndex` whose
    sparse size is smaller than the layer's node count (nodes past its largest
    index have no edges) gets its last offset repeated."""
    ptr = ptr.long()
    extra = num + 1 - ptr.numel()
    if extra > 0:
        ptr = torch.cat([ptr, ptr[-1:].expand(extra)])
    return ptr


def _check_edge_index_size(edge_index: EdgeIndex, num_src: int, num_dst: int) -> None:
    """An :class:`EdgeIndex`'s sparse size must fit the layer's nodes.

    Its sparse size is trusted as PyG trusts it (a size not given is computed
    once from the indices and kept by the EdgeIndex, one host sync); on the
    host the indices are also checked on every call (no sync there, one pass
    over the edges, as a verified hit of the plain-tensor cache costs). On a
    device they are not: call :meth:`EdgeIndex.validate` to check them."""
    rows, cols = edge_index.get_num_rows(), edge_index.get_num_cols()
    if rows > num_src or cols > num_dst:
        raise ValueError(f"the EdgeIndex's sparse size ({rows}, {cols}) exceeds the "
                         f"layer's ({num_src} source, {num_dst} target) nodes")
    if edge_index.device.type == "cpu":
        check_range(edge_index.as_tensor(), num_src, num_dst)


def edge_index_csr(edge_index: EdgeIndex, num_src: int, num_dst: int,
                   batch: int = 0) -> GraphCSR:
    """The :class:`GraphCSR` of a :class:`~torch_geometric.EdgeIndex`, from
    the compressed forms the EdgeIndex itself computes and caches (its
    ``get_csc()`` / ``get_csr()``), never from the process-wide cache.

    - **Sorted by target** (``sort_order="col"``, PyG's CSC): the edges are
      already in the operator's order (``perm`` is the identity); the
      transposed part (edges grouped by source) is the EdgeIndex's cached
      ``get_csr()``.
    - **Sorted by source** (``sort_order="row"``, e.g. after
      :func:`~torch_geometric.utils.coalesce`): the target-sorted order is its
      cached ``get_csc()``, and its own order is the source-grouped one (its
      ``indptr`` and the inverse permutation, one scatter a call).
    - **Unsorted**: sorted by target on every call (``sort_by("col",
      stable=True)``, as PyG's ops re-sort an unsorted EdgeIndex); sort it
      once beforehand (``edge_index.sort_by("col")[0]``, with the edge
      features permuted alike) to have the sort cached.

    Each edge keeps its features and attention weight whatever the order
    (``perm`` maps the sorted edges to the EdgeIndex's). Edges with the same
    target follow the EdgeIndex's own sort, which PyG does not make stable,
    where the plain-tensor path sorts stably: the sums over a target's edges
    may then add in another order (equal up to floating-point rounding).
    Under :func:`torch.compile` the CSR of its values is built in the graph
    (:func:`build_csr`), as for a plain tensor.
    """
    data = plain_edge_index(edge_index)
    if is_compiling():
        g = build_csr(data, num_src, num_dst)
        return batch_csr(g, batch, num_src, num_dst) if batch else g
    _check_edge_index_size(edge_index, num_src, num_dst)
    E = data.size(1)
    if edge_index.is_sorted_by_row:
        (colptr, col), perm = edge_index.get_csc()  # cached by the EdgeIndex
        assert perm is not None
        perm = perm.long()
        row = data[1][perm]
        rowptr_t = edge_index.get_indptr()  # its own order groups by source
        perm_t = torch.empty_like(perm).scatter_(
            0, perm, torch.arange(E, device=perm.device))
        row_t = data[1]
    else:
        if edge_index.is_sorted_by_col:
            by_dst, perm = edge_index, None
        else:
            by_dst, perm = edge_index.sort_by("col", stable=True)
        colptr = by_dst.get_indptr()
        sorted_data = plain_edge_index(by_dst)
        col, row = sorted_data[0], sorted_data[1]
        (rowptr_t, row_t), perm_t = by_dst.get_csr()  # cached by by_dst
        assert perm_t is not None
        perm = torch.arange(E, device=data.device) if perm is None else perm.long()
    g = GraphCSR(_ptr(colptr, num_dst), col.long(), row.long(), perm,
                 _ptr(rowptr_t, num_src), perm_t.long(), row_t.long())
    return batch_csr(g, batch, num_src, num_dst) if batch else g


def batch_edge_index_of(edge_index: EdgeIndex, batch: int, num_src: int,
                        num_dst: int) -> Tensor:
    """:func:`batch_edge_index` of an :class:`~torch_geometric.EdgeIndex`, as
    an :class:`~torch_geometric.EdgeIndex` of ``(batch * num_src, batch *
    num_dst)`` nodes with its sort order (the copies, in batch order, keep it)
    for PyG's message passing; not cached (a plain tensor under
    :func:`torch.compile`)."""
    flat = batch_edge_index(edge_index, batch, num_src, num_dst)
    if is_compiling():
        return flat
    return EdgeIndex(flat, sparse_size=(batch * num_src, batch * num_dst),
                     sort_order=edge_index.sort_order,
                     is_undirected=edge_index.is_undirected and num_src == num_dst)
