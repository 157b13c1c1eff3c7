"""Shared small fixtures: graphs built with torch only (no torch-scatter/cluster)."""
from __future__ import annotations

from typing import Optional

from pathlib import Path

import pytest
import torch
from torch import Tensor


def random_edge_index(num_src: int, num_edges: int, seed: int = 0,
                      num_dst: Optional[int] = None,
                      self_loops: bool = False) -> Tensor:
    """``num_edges`` distinct random edges ``src -> dst`` in random order.

    No duplicates (so a dense ``[dst, src]`` picture of the attention weights is
    well defined); no self-loops unless asked for (homogeneous case only).
    """
    num_dst = num_src if num_dst is None else num_dst
    g = torch.Generator().manual_seed(seed)
    cand = torch.randperm(num_src * num_dst, generator=g)
    src, dst = cand // num_dst, cand % num_dst
    if not self_loops and num_src == num_dst:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    assert src.numel() >= num_edges
    return torch.stack([src[:num_edges], dst[:num_edges]])


def fixed_degree_edge_index(num_nodes: int, k: int, seed: int = 0,
                            include_self: bool = False) -> Tensor:
    """kNN-like graph: ``k`` distinct random sources per target, target-sorted.

    Exactly the layout :func:`qsv_pyg.geometry.dense_neighbors` recognises.
    """
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_nodes, num_nodes, generator=g)
    # The own node sorts first (include) or last (exclude).
    scores.fill_diagonal_(-1.0 if include_self else 2.0)
    src = scores.argsort(dim=1)[:, :k]  # [N, k], distinct per row
    dst = torch.arange(num_nodes).repeat_interleave(k)
    return torch.stack([src.reshape(-1), dst])


class Graph:
    def __init__(self, edge_index: Tensor, num_nodes: int):
        self.edge_index = edge_index
        self.num_nodes = num_nodes

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)


@pytest.fixture
def random_graph() -> Graph:
    """7 nodes, 16 distinct edges: irregular degrees (16 is no multiple of 7)."""
    return Graph(random_edge_index(7, 16, seed=1), 7)


@pytest.fixture
def knn_graph() -> Graph:
    """8 nodes, 3 distinct non-self sources per target, target-sorted."""
    return Graph(fixed_degree_edge_index(8, 3, seed=2), 8)


@pytest.fixture
def make_random_graph():
    return random_edge_index


@pytest.fixture
def make_knn_graph():
    return fixed_degree_edge_index


@pytest.fixture
def fake_process_clock(monkeypatch):
    """``install(step)`` makes the training budget's process clock advance by ``step``
    CPU-seconds per read; it returns the clock's state (``state["cpu"]``)."""
    from qsv_pyg.training import stopping

    def install(step: float) -> dict:
        state = {"cpu": 0.0}

        def clock() -> float:
            state["cpu"] += step
            return state["cpu"]

        monkeypatch.setattr(stopping, "process_clock", clock)
        return state

    return install


def _triton_interpreter_numpy_shim() -> Optional[str]:
    """Let Triton 3.6's interpreter run on NumPy >= 2.4 (the GPU image pairs
    Triton 3.6.0 with NumPy 2.5).

    The interpreter turns a loaded scalar (``tl.load(rowptr + i)``, held as a
    one-element 1-D array) into a loop bound with ``int(array)``, which NumPy
    2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"): every kernel's ``range(start, end, BE)`` failed, 26 of the 29
    interpreter tests. Triton 3.9 squeezes the array first; this does the same
    for older versions (on 3.9 it changes nothing). Returns what was done."""
    import importlib.util

    import numpy as np
    try:
        int(np.ones(1))
        return None  # older NumPy: nothing to fix
    except TypeError:
        pass
    try:
        if importlib.util.find_spec("triton") is None:
            return None
        from triton.runtime import interpreter
    except Exception:  # triton absent or broken: its tests skip or fail on their own
        return None
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "qsv_shim", False):
        return None

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.qsv_shim = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return "patched triton.runtime.interpreter._patch_lang_tensor (__index__ squeezes)"


#: Optional compiled extras, by the marker of the tests that need them. The
#: package runs without them (kNN falls back to an exact brute force, PyG to
#: torch's scatter); a GPU image without them skips these tests, with the reason.
OPTIONAL_EXTRAS = {"requires_torch_cluster": "torch_cluster",
                   "requires_torch_scatter": "torch_scatter"}


def _import_error(module: str) -> Optional[str]:
    """Why ``module`` does not import (None when it does)."""
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a broken build (OSError, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


def pytest_configure(config):
    _triton_interpreter_numpy_shim()
    for marker, module in OPTIONAL_EXTRAS.items():
        config.addinivalue_line("markers", f"{marker}: needs {module} (an optional extra; "
                                           f"skipped with the reason when it does not import)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly on a machine without a CUDA device;
    tests marked ``requires_torch_cluster`` / ``requires_torch_scatter`` where
    that extra does not import."""
    missing = {}
    for marker, module in OPTIONAL_EXTRAS.items():
        if any(item.get_closest_marker(marker) is not None for item in items):
            error = _import_error(module)
            if error is not None:
                missing[marker] = pytest.mark.skip(
                    reason=f"needs {module}, an optional extra that does not import here "
                           f"({error})")
    cuda_skip = None if torch.cuda.is_available() else pytest.mark.skip(
        reason="needs CUDA (marked cuda; run on a GPU with -m cuda)")
    for item in items:
        if cuda_skip is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(cuda_skip)
        for marker, skip in missing.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: on two shared cores intra-op threads
    only add contention. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["cpp", "torch"])
def impl(request, monkeypatch):
    """Run a test with the C++ CPU kernel and with the PyTorch path."""
    import qsv_pyg.nn._cpu_ext as cpu_ext

    if request.param == "torch":
        monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "0")
    elif cpu_ext.cpu_kernel() is None:
        pytest.skip(f"C++ kernel unavailable: {cpu_ext._STATE['error']}")
    return request.param


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module, loaded by path (tests put no
    other folder on ``sys.path``; a benchmark script puts its own folder there for
    its siblings). Registered under its plain name, so a script that imports
    another (``from bench_conv import ...``) gets this same module."""
    import importlib.util
    import sys
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def random_qsv_conv(in_channels, out_channels, heads, seed, dtype, **kwargs):
    """A QSVConv in eval mode with every parameter randomised from ``seed`` (non-zero
    bias, feature quaternions far from the identity, β_h of different sizes per
    head); lazy parameters stay uninitialised."""
    from torch.nn.parameter import UninitializedParameter

    from qsv_pyg.nn import QSVConv
    torch.manual_seed(seed)
    conv = QSVConv(in_channels, out_channels, heads=heads, **kwargs)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in conv.named_parameters():
            if isinstance(p, UninitializedParameter):
                continue
            if name == "log_beta":
                p.copy_(0.3 + 0.6 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return conv.to(dtype).eval()
