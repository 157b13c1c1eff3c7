"""QSVConv consumes PyG's :class:`~torch_geometric.EdgeIndex` (issue 31, "PyG's
idioms"): the target-sorted CSR comes from the EdgeIndex's own cached CSC / CSR
(:func:`qsv_pyg.nn.csr.edge_index_csr`), never from the process-wide cache, and
outputs, gradients and attention weights equal the plain-tensor path's for the
same edges (edge features and weights in the EdgeIndex's edge order)."""
import pytest
import torch
from conftest import random_qsv_conv
from torch_geometric import EdgeIndex

import torch_geometric.utils
from qsv_pyg.nn import csr as csr_module
from qsv_pyg.nn.csr import build_csr, edge_index_csr
from qsv_pyg.nn.graph_cache import cache_info, cached_batch_edge_index, clear_cache
from qsv_pyg.quaternion import random_unit_quaternion

pytestmark = pytest.mark.usefixtures("one_thread")
# Edges with one target may be summed in another order (EdgeIndex's own sort is
# not stable): float64 and a tight tolerance.
TOL = dict(rtol=1e-10, atol=1e-10)
SORTS = [None, "row", "col"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make(in_channels=8, out_channels=3, heads=2, seed=0, **kwargs):
    return random_qsv_conv(in_channels, out_channels, heads, seed, torch.float64, **kwargs)


def edges(n_src, num_edges, seed, n_dst=None):
    """Distinct edges, no self-loops, shuffled; some repeated targets."""
    n_dst = n_src if n_dst is None else n_dst
    cand = torch.randperm(n_src * n_dst, generator=gen(seed))
    src, dst = cand // n_dst, cand % n_dst
    keep = (src != dst) if n_src == n_dst else (dst != n_dst - 1)  # last target: none
    return torch.stack([src[keep][:num_edges], dst[keep][:num_edges]])


def as_edge_index(ei, edge_attr, sort, sparse_size):
    """``(EdgeIndex, edge_attr)`` in ``sort`` order (None: as given)."""
    e = EdgeIndex(ei, sparse_size=sparse_size)
    if sort is None:
        return e, edge_attr
    e, perm = e.sort_by(sort, stable=True)
    return e, None if edge_attr is None else edge_attr[perm]


def call(conv, x, ei, ea, **kw):
    """``out, (edge_index, alpha)`` and the gradients of x, edge_attr and the
    parameters of ``(out * w).sum() + (alpha * v).sum()``."""
    x = tuple(t.detach().clone().requires_grad_() for t in x) if isinstance(x, tuple) \
        else x.detach().clone().requires_grad_()
    ea = None if ea is None else ea.detach().clone().requires_grad_()
    conv.zero_grad()
    out, (ei_out, alpha) = conv(x, ei, ea, return_attention_weights=True, **kw)
    w = torch.randn(out.shape, generator=gen(5), dtype=out.dtype)
    v = torch.randn(alpha.shape, generator=gen(6), dtype=alpha.dtype)
    ((out * w).sum() + (alpha * v).sum()).backward()
    xs = x if isinstance(x, tuple) else (x, )
    grads = [t.grad for t in xs] + ([] if ea is None else [ea.grad])
    grads += [p.grad for p in conv.parameters() if p.grad is not None]
    return out, ei_out, alpha, grads


def assert_same(res_e, res_p):
    out_e, ei_e, alpha_e, g_e = res_e
    out_p, ei_p, alpha_p, g_p = res_p
    torch.testing.assert_close(out_e, out_p, **TOL)
    assert torch.equal(ei_e.as_tensor() if isinstance(ei_e, EdgeIndex) else ei_e, ei_p)
    torch.testing.assert_close(alpha_e, alpha_p, **TOL)
    assert len(g_e) == len(g_p)
    for a, b in zip(g_e, g_p):
        torch.testing.assert_close(a, b, **TOL)


@pytest.fixture(autouse=True)
def empty_cache():
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize("add_self_loops", [False, True])
@pytest.mark.parametrize("sort", SORTS)
@pytest.mark.parametrize("routing", ["learned", "geometric"])
def test_same_as_plain_tensor(routing, sort, add_self_loops):
    N, E = 9, 30
    conv = make(routing=routing, edge_dim=3, edge_message=True, source_logit=True,
                add_self_loops=add_self_loops)
    g = gen(1)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    pos = torch.randn(N, 3, generator=g, dtype=torch.float64)
    quat = random_unit_quaternion(N, 2, generator=g, dtype=torch.float64)
    ei, ea = as_edge_index(edges(N, E, seed=2),
                           torch.randn(E, 3, generator=g, dtype=torch.float64), sort, (N, N))
    assert conv.choose_path(x, quat, ei) == "attend_shared"
    res_e = call(conv, x, ei, ea, quat=quat, pos=pos)
    assert cache_info()["entries"] == 0  # no process-wide entry for an EdgeIndex
    assert isinstance(res_e[1], EdgeIndex)  # returned as PyG's convs return it
    assert res_e[2].shape == (res_e[1].size(1), 2)
    res_p = call(conv, x, ei.as_tensor().clone(), ea, quat=quat, pos=pos)
    assert cache_info()["entries"] == 1  # the plain tensor's
    assert_same(res_e, res_p)


@pytest.mark.parametrize("sort", SORTS)
def test_bipartite(sort):
    n_src, n_dst, E = 8, 5, 20
    conv = make(edge_dim=2, project_input=True)
    g = gen(3)
    x = (torch.randn(n_src, 8, generator=g, dtype=torch.float64),
         torch.randn(n_dst, 8, generator=g, dtype=torch.float64))
    plain = edges(n_src, E, seed=4, n_dst=n_dst)
    attr = torch.randn(E, 2, generator=g, dtype=torch.float64)
    for size in ((n_src, n_dst), None):  # None: the EdgeIndex counts n_dst - 1 targets
        ei, ea = as_edge_index(plain, attr, sort, size)
        res_e = call(conv, x, ei, ea)
        if size is None:
            assert ei.get_num_cols() == n_dst - 1  # padded to the layer's targets
        assert cache_info()["entries"] == 0
        assert_same(res_e, call(conv, x, ei.as_tensor().clone(), ea))
        clear_cache()


def test_alpha_in_the_edge_index_order():
    """The weights come back in the EdgeIndex's own order, whatever its sort."""
    N, E = 9, 30
    conv = make()
    x = torch.randn(N, 8, generator=gen(7), dtype=torch.float64)
    plain = edges(N, E, seed=8)
    _, (_, alpha) = conv(x, plain, return_attention_weights=True)
    for sort in ("row", "col"):
        ei, perm = EdgeIndex(plain, sparse_size=(N, N)).sort_by(sort)
        _, (ei_out, alpha_s) = conv(x, ei, return_attention_weights=True)
        assert ei_out is ei
        torch.testing.assert_close(alpha_s, alpha[perm], **TOL)


@pytest.mark.parametrize("sort", ["row", "col"])
def test_uses_the_edge_index_cache(sort, monkeypatch):
    """A sorted EdgeIndex is sorted (for its transpose) once, on the first call:
    later calls read the CSC / CSR it cached."""
    N, E = 9, 30
    conv = make()
    x = torch.randn(N, 8, generator=gen(9), dtype=torch.float64)
    ei, _ = as_edge_index(edges(N, E, seed=10), None, sort, (N, N))
    sorts = []
    orig = torch_geometric.utils.index_sort

    def spy(*args, **kwargs):
        sorts.append(1)
        return orig(*args, **kwargs)

    monkeypatch.setattr(torch_geometric.utils, "index_sort", spy)
    first = conv(x, ei)
    assert len(sorts) == 1 and ei._T_perm is not None
    for _ in range(3):
        torch.testing.assert_close(conv(x, ei), first, **TOL)
    assert len(sorts) == 1
    assert cache_info()["entries"] == 0


@pytest.mark.parametrize("sort", SORTS)
def test_graph_csr_of_an_edge_index(sort):
    """The CSR of an EdgeIndex: the plain-tensor CSR's edges, each target's in
    the EdgeIndex's order, ``perm`` into the EdgeIndex's edges."""
    n_src, n_dst, E = 8, 6, 25
    ei, _ = as_edge_index(edges(n_src, E, seed=11, n_dst=n_dst), None, sort, (n_src, n_dst))
    g = edge_index_csr(ei, n_src, n_dst)
    ref = build_csr(ei.as_tensor(), n_src, n_dst)
    data = ei.as_tensor()
    assert torch.equal(g.rowptr, ref.rowptr) and torch.equal(g.rowptr_t, ref.rowptr_t)
    assert torch.equal(g.col, data[0][g.perm]) and torch.equal(g.row, data[1][g.perm])
    assert torch.equal(g.row, ref.row)
    assert torch.equal(torch.sort(g.perm)[0], torch.arange(E))
    # The transposed part: the sorted edges grouped by source.
    assert torch.equal(g.col[g.perm_t], torch.sort(g.col)[0])
    assert torch.equal(g.row_t, g.row[g.perm_t])
    assert cache_info()["entries"] == 0
    # Batch copies: the plain batch CSR's structure.
    gb = edge_index_csr(ei, n_src, n_dst, batch=3)
    rb = build_csr(ei.as_tensor(), n_src, n_dst)
    rb = csr_module.batch_csr(rb, 3, n_src, n_dst)
    assert torch.equal(gb.rowptr, rb.rowptr) and torch.equal(gb.row, rb.row)


@pytest.mark.parametrize("case", ["shared", "per_item", "message_passing"])
def test_batched_input(case):
    """``[B, N, C]`` input: the operator over batch copies of the EdgeIndex's CSR
    (shared or per item), or PyG's message passing over an EdgeIndex of copies;
    no process-wide cache entry either way."""
    B, N, E = 2, 7, 18
    conv = make(dense_path="never" if case == "message_passing" else "auto")
    g = gen(12)
    x = torch.randn(B, N, 8, generator=g, dtype=torch.float64)
    quat = random_unit_quaternion(*(() if case == "shared" else (B, )), N, 2, generator=g,
                                  dtype=torch.float64)
    for sort in SORTS:
        ei, _ = as_edge_index(edges(N, E, seed=13), None, sort, (N, N))
        res_e = call(conv, x, ei, None, quat=quat)
        assert cache_info()["entries"] == 0
        assert_same(res_e, call(conv, x, ei.as_tensor().clone(), None, quat=quat))
        clear_cache()


def test_batch_copies_stay_an_edge_index():
    ei, _ = as_edge_index(edges(5, 9, seed=14), None, "col", (5, 5))
    flat = cached_batch_edge_index(ei, 3, 5, 5)
    assert isinstance(flat, EdgeIndex) and flat.is_sorted_by_col
    assert flat.sparse_size() == (15, 15)
    assert torch.equal(flat.as_tensor(),
                       csr_module.batch_edge_index(ei.as_tensor(), 3, 5, 5))
    flat.validate()
    assert cache_info()["entries"] == 0


@pytest.mark.parametrize("sort", SORTS)
def test_message_passing_path(sort):
    N, E = 9, 30
    conv = make(edge_dim=3, dense_path="never")
    g = gen(15)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    ei, ea = as_edge_index(edges(N, E, seed=16),
                           torch.randn(E, 3, generator=g, dtype=torch.float64), sort, (N, N))
    assert_same(call(conv, x, ei, ea), call(conv, x, ei.as_tensor().clone(), ea))


def test_no_edges():
    conv = make()
    x = torch.randn(5, 8, generator=gen(17), dtype=torch.float64)
    ei = EdgeIndex(torch.empty(2, 0, dtype=torch.long), sparse_size=(5, 5))
    out, (_, alpha) = conv(x, ei, return_attention_weights=True)
    assert alpha.shape == (0, 2) and cache_info()["entries"] == 0
    torch.testing.assert_close(out, conv(x, torch.empty(2, 0, dtype=torch.long)), **TOL)


def test_out_of_range():
    conv = make()
    x = torch.randn(5, 8, generator=gen(18), dtype=torch.float64)
    with pytest.raises(ValueError, match="sparse size"):
        conv(x, EdgeIndex(torch.tensor([[0, 1], [1, 2]]), sparse_size=(6, 6)))
    # A sparse size that understates the indices: the host checks them.
    bad = EdgeIndex(torch.tensor([[0, 7], [1, 2]]), sparse_size=(5, 5))
    with pytest.raises(ValueError, match="source indices"):
        conv(x, bad)


@pytest.mark.parametrize("sort", SORTS)
def test_compile(sort):
    """Under torch.compile an EdgeIndex input traces in one graph (its CSR built
    in the graph, as a plain tensor's) and gives the eager result."""
    import torch._dynamo
    torch._dynamo.reset()
    N, E = 9, 30
    conv = make(edge_dim=3).float()
    g = gen(19)
    x = torch.randn(N, 8, generator=g)
    ei, ea = as_edge_index(edges(N, E, seed=20), torch.randn(E, 3, generator=g), sort, (N, N))
    expected = conv(x, ei, ea)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, ei, ea), expected, rtol=1e-5, atol=1e-5)


def test_int32_edge_index():
    N, E = 9, 30
    conv = make()
    x = torch.randn(N, 8, generator=gen(21), dtype=torch.float64)
    plain = edges(N, E, seed=22)
    for sort in SORTS:
        ei, _ = as_edge_index(plain.int(), None, sort, (N, N))
        assert ei.dtype == torch.int32
        assert_same(call(conv, x, ei, None), call(conv, x, ei.as_tensor().long(), None))
        clear_cache()


def test_qsv_model_over_an_edge_index():
    """PyG's BasicGNN loop (QSV) hands the EdgeIndex to every layer unchanged."""
    from qsv_pyg.nn.models import QSV
    N, E = 9, 30
    torch.manual_seed(0)
    model = QSV(8, 8, 2, out_channels=3, heads=2, edge_dim=2).double().eval()
    g = gen(23)
    x = torch.randn(N, 8, generator=g, dtype=torch.float64)
    ei, ea = as_edge_index(edges(N, E, seed=24),
                           torch.randn(E, 2, generator=g, dtype=torch.float64), "row", (N, N))
    out = model(x, ei, edge_attr=ea)
    assert cache_info()["entries"] == 0
    torch.testing.assert_close(out, model(x, ei.as_tensor(), edge_attr=ea), **TOL)
