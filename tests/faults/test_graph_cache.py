"""Issue 23 (reliability round 2), items 2, 5 and 14, and issue 20 (a host sync
per new graph; the cache's memory): the CSR cache of :mod:`qsv_pyg.nn.graph_cache`

- item 2: never serves a stale graph, whatever route changed the values of
  ``edge_index`` (``.data``, ``.numpy()``, a refilled ``torch.from_numpy``
  buffer), and checks a changed graph's index ranges again;
- item 5: works under :func:`torch.inference_mode` (inference tensors have no
  version counter), for :class:`QSVConv` and the :class:`QSV` model, and a graph
  first seen there can later be trained on;
- item 14: is bounded by the bytes of its index arrays, not only by a count;
- issue 20: costs one host read per new graph (the range check) and no sync
  per hit (a CPU hit's verifying compare reads host memory only; a device hit
  is not compared unless ``verify=True``), and nothing under
  :func:`torch.compile`.
"""
import numpy as np
import pytest
import torch

import qsv_pyg.nn.graph_cache as csr
from qsv_pyg.nn import QSVConv, graph_csr
from qsv_pyg.nn.csr import build_csr
from qsv_pyg.nn.graph_cache import cache_info, clear_cache, configure_cache
from qsv_pyg.nn.models import QSV

N = 40


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    old = configure_cache()
    yield
    configure_cache(**old)
    clear_cache()


def graph(seed: int, n: int = N, num_edges: int = 160) -> torch.Tensor:
    """``num_edges`` distinct random edges (no self-loops), in random order."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.randperm(n * n, generator=g)
    src, dst = cand // n, cand % n
    keep = src != dst
    return torch.stack([src[keep][:num_edges], dst[keep][:num_edges]])


def conv_pair(**kwargs):
    """The fast path and message passing (``fused_path="never"``), same weights."""
    torch.manual_seed(0)
    fast = QSVConv(8, 4, heads=2, **kwargs).eval()
    slow = QSVConv(8, 4, heads=2, fused_path="never", **kwargs).eval()
    slow.load_state_dict(fast.state_dict())
    return fast, slow


def entry_bytes(entry) -> int:
    """The bytes an entry holds, counted independently of its own tally."""
    return entry.ref.nbytes + sum(t.nbytes for g in entry.csrs.values() for t in g)


# ------------------------------------------ item 2: writes the version misses
ROUTES = ["data", "numpy", "from_numpy"]


class Graphs:
    """One ``edge_index`` whose values are replaced by ``route``; ``.ei`` is
    the tensor to pass (a new one over the same buffer for ``from_numpy``)."""

    def __init__(self, route: str, first: torch.Tensor):
        self.route = route
        self.buf = first.numpy().copy()
        self.ei = torch.from_numpy(self.buf) if route == "from_numpy" else first.clone()

    def write(self, new: torch.Tensor) -> None:
        if self.route == "data":
            self.ei.data[:] = new
        elif self.route == "numpy":
            self.ei.numpy()[:] = new.numpy()
        else:  # the buffer refilled, a new tensor over it (same address, version 0)
            self.buf[:] = new.numpy()
            self.ei = torch.from_numpy(self.buf)


@pytest.mark.parametrize("route", ROUTES)
def test_values_written_behind_the_version_counter_rebuild(route):
    fast, slow = conv_pair()
    x = torch.randn(N, 8)
    graphs = Graphs(route, graph(0))
    version = graphs.ei._version
    for step in range(4):
        if step:
            graphs.write(graph(step))
        want = slow(x, graphs.ei)
        torch.testing.assert_close(fast(x, graphs.ei), want, atol=1e-5, rtol=1e-4)
    if route != "from_numpy":
        assert graphs.ei._version == version, "the route was meant to miss the counter"
    # One tensor (address) whose values changed: its entry was replaced.
    assert cache_info()["entries"] == 1


@pytest.mark.parametrize("route", ROUTES)
def test_reordered_edges_rebuild_the_permutation(route):
    fast, slow = conv_pair()
    x = torch.randn(N, 8)
    first = graph(1)
    graphs = Graphs(route, first)
    fast(x, graphs.ei)
    graphs.write(first[:, torch.randperm(first.size(1))])  # same edges, new order
    _, (_, alpha) = fast(x, graphs.ei, return_attention_weights=True)
    _, (_, want) = slow(x, graphs.ei, return_attention_weights=True)
    torch.testing.assert_close(alpha, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("route", ROUTES)
def test_out_of_range_index_written_later_is_caught(route):
    fast, _ = conv_pair()
    x = torch.randn(N, 8)
    bad = graph(2)
    graphs = Graphs(route, bad)
    fast(x, graphs.ei)
    bad = bad.clone()
    bad[0, 3] = N
    graphs.write(bad)
    with pytest.raises(ValueError, match=rf"source indices in \[0, {N}\] but there are {N}"):
        fast(x, graphs.ei)


def test_unchanged_graph_is_built_once_and_verified_hits_return_the_entry(monkeypatch):
    builds = []
    orig = csr.build_csr
    monkeypatch.setattr(csr, "build_csr", lambda *a: builds.append(1) or orig(*a))
    ei = graph(3)
    g = graph_csr(ei, N, N)
    assert all(graph_csr(ei, N, N) is g for _ in range(5))
    assert builds == [1]
    ei.numpy()[0, 0] = (ei[0, 0] + 1) % N
    assert graph_csr(ei, N, N) is not g and builds == [1, 1]


def test_trusting_mode_sees_ordinary_in_place_writes():
    configure_cache(verify=False)
    fast, slow = conv_pair()
    x = torch.randn(N, 8)
    ei = graph(4)
    fast(x, ei)
    ei.copy_(graph(5))  # bumps the version counter
    torch.testing.assert_close(fast(x, ei), slow(x, ei), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------ item 5: inference mode
@pytest.mark.parametrize("layout", ["shared", "per_item"])
def test_qsvconv_with_a_graph_built_in_inference_mode(layout):
    fast, slow = conv_pair()
    x = torch.randn(N, 8) if layout == "shared" else torch.randn(3, N, 8)
    ei = graph(6)
    with torch.no_grad():
        want = slow(x, ei)
    with torch.inference_mode():
        ei_inf = ei.clone()
        assert ei_inf.is_inference()
        got = fast(x, ei_inf)
        again = fast(x, ei_inf)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-4)


def test_qsv_model_with_a_graph_built_in_inference_mode():
    torch.manual_seed(0)
    model = QSV(8, 16, 2, out_channels=3, heads=2).eval()
    x, ei = torch.randn(N, 8), graph(7)
    with torch.no_grad():
        want = model(x, ei)
    with torch.inference_mode():
        got = model(x.clone(), ei.clone())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("verify", [True, False])
def test_inference_tensor_changed_in_place_is_rebuilt(verify):
    configure_cache(verify=verify)  # inference tensors are verified either way
    fast, slow = conv_pair()
    x, other = torch.randn(N, 8), graph(9)
    with torch.inference_mode():
        ei = graph(8).clone()
        fast(x, ei)
        ei.copy_(other)  # no version counter to bump
        got = fast(x, ei)
    with torch.no_grad():
        want = slow(x, other)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_graph_first_seen_in_inference_mode_can_be_trained_on():
    fast, _ = conv_pair()
    x, ei = torch.randn(N, 8), graph(10)
    with torch.inference_mode():
        fast(x, ei)
    fast.train()
    x = x.requires_grad_()
    fast(x, ei).square().sum().backward()  # the cached arrays are saved for backward
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ---------------------------------------------------- item 14: bounded by bytes
def test_entry_bytes_are_the_index_arrays():
    ei = graph(11, n=N, num_edges=300)
    graph_csr(ei, N, N)
    E = ei.size(1)
    # The copy [2, E], col/row/perm/perm_t/row_t [E] and two rowptrs [N + 1].
    assert cache_info()["nbytes"] == 8 * (2 * E + 5 * E + 2 * (N + 1))
    graph_csr(ei, N, N, batch=4)  # the batched CSR is counted too
    entry, = csr._CACHE.values()
    assert cache_info()["nbytes"] == entry_bytes(entry) == entry.nbytes
    # ... plus B = 4 copies of the five [E] arrays and two rowptrs [4 N + 1].
    assert entry.nbytes == 8 * (2 * E + 5 * E + 2 * (N + 1)) + 8 * (5 * 4 * E + 2 * (4 * N + 1))


def test_200_new_graphs_stay_under_the_byte_limit():
    limit = 4 * 2 ** 20
    configure_cache(max_bytes=limit)
    n, E = 2000, 20_000  # about 1.1 MiB an entry: three or four fit
    g = torch.Generator().manual_seed(12)
    peak = 0
    for step in range(200):
        ei = torch.randint(0, n, (2, E), generator=g)
        got = graph_csr(ei, n, n)
        info = cache_info()
        peak = max(peak, info["nbytes"])
        assert info["nbytes"] <= limit, f"step {step}: {info}"
        assert info["nbytes"] == sum(entry_bytes(e) for e in csr._CACHE.values())
        assert info["entries"] >= 1  # still caching
    assert peak > limit // 2
    assert torch.equal(got.col, build_csr(ei, n, n).col)


def test_the_default_limit_is_documented_and_configurable():
    info = cache_info()
    assert info["max_bytes"] == csr.MAX_BYTES == 256 * 2 ** 20
    assert info["max_entries"] == csr.MAX_ENTRIES
    old = configure_cache(max_bytes=1000, max_entries=3)
    assert old["max_bytes"] == csr.MAX_BYTES and cache_info()["max_entries"] == 3
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes must be a non-negative integer"):
            configure_cache(max_bytes=bad)


def test_least_recently_used_graph_goes_first():
    a, b, c = graph(13), graph(14), graph(15)
    graph_csr(a, N, N)
    one = cache_info()["nbytes"]
    configure_cache(max_bytes=2 * one)
    graph_csr(b, N, N)
    graph_csr(a, N, N)  # a is now the most recent
    graph_csr(c, N, N)
    keys = list(csr._CACHE)
    assert len(keys) == 2 and keys == [csr._key(a), csr._key(c)]


def test_a_graph_larger_than_the_limit_is_not_cached():
    configure_cache(max_bytes=1000)
    fast, slow = conv_pair()
    x, ei = torch.randn(N, 8), graph(16)
    with pytest.warns(RuntimeWarning, match="not cached"):
        got = fast(x, ei)
    assert cache_info()["entries"] == 0 and cache_info()["nbytes"] == 0
    torch.testing.assert_close(got, slow(x, ei), atol=1e-5, rtol=1e-4)


def test_a_zero_limit_turns_caching_off_quietly(recwarn):
    configure_cache(max_bytes=0)
    ei = graph(17)
    g = graph_csr(ei, N, N)
    assert cache_info()["entries"] == 0 and torch.equal(g.col, build_csr(ei, N, N).col)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


# -------------------------------------------------- issue 20: host syncs
@pytest.fixture
def host_reads(monkeypatch):
    """Every Python-level read of a tensor's value to the host (and every
    ``torch.equal``, a sync on CUDA), by name."""
    calls = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def wrap(self, *args, _orig=orig, _name=name, **kwargs):
            calls.append(_name)
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, wrap)
    orig_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append("equal") or orig_equal(a, b))
    return calls


@pytest.mark.parametrize("verify", ["auto", True, False])
def test_a_new_graph_costs_one_host_read_and_a_hit_none(host_reads, verify):
    configure_cache(verify=verify)
    ei = graph(18)
    graph_csr(ei, N, N)
    assert host_reads == ["tolist"]  # one aminmax, one .tolist()
    host_reads.clear()
    graph_csr(ei, N, N)
    graph_csr(ei, N, N, batch=2)  # a new batch size of a known graph: no new check
    graph_csr(ei, N, N, batch=2)
    # A CPU hit's compare reads host memory (on a device "auto" does not compare).
    assert host_reads == (["equal"] * 3 if verify else [])


@pytest.mark.parametrize("verify, cpu, device, inference", [
    ("auto", True, False, True), (True, True, True, True), (False, False, False, True)])
def test_which_hits_are_verified(verify, cpu, device, inference):
    configure_cache(verify=verify)
    host = torch.zeros(2, 3, dtype=torch.long)
    on_device = torch.zeros(2, 3, dtype=torch.long, device="meta")  # stands for CUDA
    assert csr._verifies(host) is cpu and csr._verifies(on_device) is device
    with torch.inference_mode():
        assert csr._verifies(torch.zeros(2, 3, dtype=torch.long)) is inference
        assert csr._verifies(torch.zeros(2, 3, dtype=torch.long, device="meta")) is inference
    with pytest.raises(ValueError, match="verify must be 'auto', True or False"):
        configure_cache(verify="yes")


def test_compiling_reads_nothing_and_caches_nothing(host_reads, monkeypatch):
    monkeypatch.setattr(csr, "is_compiling", lambda: True)
    ei = graph(19)
    g = graph_csr(ei, N, N, batch=2)
    assert host_reads == [] and cache_info()["entries"] == 0
    assert g.num_edges == 2 * ei.size(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_syncs_once_per_new_graph_and_never_on_a_hit():
    ei = graph(20).cuda()  # the default verify="auto": device hits are not compared
    torch.cuda.synchronize()
    with pytest.warns(UserWarning, match="synchroniz") as record:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            graph_csr(ei, N, N)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in record if "synchroniz" in str(w.message)]) == 1
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph_csr(ei, N, N)
        graph_csr(ei, N, N, batch=3)  # a new batch size: built, not checked again
        graph_csr(ei, N, N, batch=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
