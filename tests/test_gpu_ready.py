"""What a GPU run needs, checked on the CPU (issue 32): the graph check of the
Triton launcher once per graph, ``check_finite="auto"``, the device guard of the
launches, the warning when Triton is installed but broken."""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from qsv_pyg.nn import QSVConv
from qsv_pyg.nn import triton_kernel as tk
from qsv_pyg.nn.csr import build_csr


def _graph(n: int = 6, k: int = 2):
    src = torch.arange(n).repeat_interleave(k)
    dst = (src + torch.arange(1, k + 1).repeat(n)) % n
    return build_csr(torch.stack([src, dst]), n, n)


# --------------------------------------------------------------- graph check
@pytest.fixture
def asserts(monkeypatch):
    """Counts the launcher's graph checks (each ends in one ``_assert_async``)."""
    calls = []
    original = torch._assert_async

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_assert_async", counted)
    monkeypatch.setattr(tk, "_CHECKED", {})
    return calls


def test_graph_check_runs_once_per_graph(asserts):
    g = _graph()
    for _ in range(3):
        tk._check_graph(g.rowptr, g.col, 6)
    assert len(asserts) == 1  # the same tensors, unchanged: checked once
    tk._check_graph(g.rowptr, g.col, 7)  # another source count: checked again
    assert len(asserts) == 2


def test_graph_check_sees_in_place_writes_and_new_tensors(asserts):
    g = _graph()
    tk._check_graph(g.rowptr, g.col, 6)
    col = g.col
    col[0] = 6  # out of range, written in place: the version counter moved
    with pytest.raises(RuntimeError, match="malformed CSR"):
        tk._check_graph(g.rowptr, col, 6)
    bad = g.col.clone()  # a new tensor is a new graph
    with pytest.raises(RuntimeError, match="malformed CSR"):
        tk._check_graph(g.rowptr, bad, 6)


def test_checked_graphs_are_forgotten_with_their_tensors(asserts):
    g = _graph()
    tk._check_graph(g.rowptr, g.col, 6)
    assert len(tk._CHECKED) == 1
    del g
    assert len(tk._CHECKED) == 0  # no address of a freed tensor is trusted later


def test_inference_tensors_are_checked_every_time(asserts):
    with torch.inference_mode():
        g = _graph()
        tk._check_graph(g.rowptr, g.col, 6)
        tk._check_graph(g.rowptr, g.col, 6)
    assert len(asserts) == 2


def test_interpreted_forward_checks_a_graph_once(asserts, monkeypatch):
    """Two forwards over one graph on the Triton path (interpreter): one check."""
    pytest.importorskip("triton")
    monkeypatch.setenv("QSV_PYG_TRITON", "interpret")
    g = _graph(4, 1)
    v = torch.randn(4, 1, 1, 4)
    q = torch.nn.functional.normalize(torch.randn(4, 1, 4), dim=-1)
    for _ in range(2):
        tk.forward(v, q, q, q, q, torch.ones(1), v.new_empty(0), v.new_empty(0), g.rowptr,
                   g.col, False, True)
    assert len(asserts) == 1


# --------------------------------------------------------------- check_finite
def test_check_finite_defaults_to_auto_and_checks_on_the_cpu():
    conv = QSVConv(8, 4, heads=2)
    assert conv.check_finite == "auto"
    x = torch.randn(5, 8)
    x[1, 2] = float("nan")
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    with pytest.raises(ValueError, match="non-finite node features"):
        conv(x, ei)


def test_check_finite_auto_skips_devices():
    """``"auto"``: no per-forward check (a host sync each) off the CPU."""
    on_device = torch.empty(2, device="meta")
    on_host = torch.empty(2)
    auto, always, never = (QSVConv(8, 4, heads=2, check_finite=c)
                           for c in ("auto", True, False))
    assert auto._checks_finite(on_host) and not auto._checks_finite(on_device)
    assert always._checks_finite(on_device) and always._checks_finite(on_host)
    assert not never._checks_finite(on_host)


@pytest.mark.parametrize("bad", ["yes", None, 1])
def test_check_finite_refuses_other_values(bad):
    with pytest.raises(ValueError, match="check_finite must be True, False or 'auto'"):
        QSVConv(8, 4, heads=2, check_finite=bad)


# --------------------------------------------------------------- device guard
class _OnCuda1:
    device = torch.device("cuda", 1)


def test_launches_run_on_the_tensors_device(monkeypatch):
    entered = []

    class FakeDeviceContext:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(("enter", self.device))

        def __exit__(self, *exc):
            entered.append(("exit", self.device))

    monkeypatch.setattr(torch.cuda, "device", FakeDeviceContext)

    @tk._on_device
    def launch(t, x):
        entered.append(("launch", x))
        return x + 1

    assert launch(_OnCuda1(), 1) == 2
    cuda1 = torch.device("cuda", 1)
    assert entered == [("enter", cuda1), ("launch", 1), ("exit", cuda1)]
    entered.clear()
    assert launch(torch.zeros(1), 2) == 3 and entered == [("launch", 2)]  # CPU: no guard
    assert tk.forward.__wrapped__ is not None and tk.backward.__wrapped__ is not None


# --------------------------------------------------------------- importable()
@pytest.fixture
def fresh_importable(monkeypatch):
    monkeypatch.setattr(tk, "_IMPORTABLE", {})  # (triton's own modules stay imported:
    return monkeypatch                           # importing its C library twice aborts)


def test_broken_triton_warns_once(fresh_importable):
    pytest.importorskip("triton")
    fresh_importable.setitem(sys.modules, "triton.language", None)  # import fails
    with pytest.warns(RuntimeWarning, match="Triton is installed but does not import"):
        assert tk.importable() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tk.importable() is False  # remembered: no second warning


def test_absent_triton_is_silent(fresh_importable):
    fresh_importable.setitem(sys.modules, "triton", None)  # as if not installed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tk.importable() is False


def test_triton_interpreter_shim_is_a_no_op_or_squeezes():
    """conftest's shim for Triton 3.6 on NumPy >= 2.4: after it, a one-element
    array converts to a loop bound the way the interpreter does it."""
    triton = pytest.importorskip("triton")
    from triton.runtime import interpreter

    scope = types.SimpleNamespace(attrs={})
    scope.set_attr = lambda obj, name, value: scope.attrs.__setitem__(name, value)
    interpreter._patch_lang_tensor(triton.language.tensor, scope)
    import numpy as np
    fake = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([7])))
    assert scope.attrs["__index__"](fake) == 7


# --------------------------------------------------------------- static CSRs
def _small_graph_net(**kw):
    from qsv_pyg.models import build_model

    torch.manual_seed(0)
    return build_model("qsv", **{**dict(shell_sizes=[16, 9, 4], k_cross=4, k_inner=3,
                                        heads=2, widths=[16, 16, 16]), **kw})


def _sorts_in_compiled_forward(model, images) -> int:
    """Sorts (the CSR builds) in the graphs dynamo captures of ``model(images)``."""
    torch._dynamo.reset()
    found = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            name = getattr(node.target, "__name__", str(node.target))
            if node.op in ("call_function", "call_method") and name in ("argsort", "sort"):
                found.append(name)
        return gm.forward

    with torch.no_grad():
        got = torch.compile(model, backend=backend)(images)
        want = model(images)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)  # the static CSRs are the graphs' own
    return len(found)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_graph_net_reads_its_static_csrs():
    """GraphNet's graphs are static: their CSRs are buffers, and a compiled
    forward reads them instead of sorting every graph on every call."""
    from qsv_pyg.nn import csr

    model = _small_graph_net().eval()
    images = torch.randn(2, 3, 32, 32)
    for name in model.graph_buffers():
        held = csr.static_csr(getattr(model, name), *model._graph_sizes()[name])
        assert held is not None and held.col is getattr(model, f"{name}_csr_col")
        eager = csr.build_csr(getattr(model, name), *model._graph_sizes()[name])
        assert all(torch.equal(a, b) for a, b in zip(held, eager)), name
    assert not any(k.endswith(("_csr_col", "_csr_rowptr")) for k in model.state_dict())
    assert _sorts_in_compiled_forward(model, images) == 0
    for name in model.graph_buffers():  # without them: two sorts per graph
        delattr(getattr(model, name), csr.STATIC_ATTR)
    assert _sorts_in_compiled_forward(model, images) >= 2 * len(model.graph_buffers())


def _pickled(model):
    import io
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a whole GraphNet still pickles (no lambda hooks)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_static_csrs_follow_to_and_load_state_dict():
    import copy

    from qsv_pyg.nn import csr

    model = _small_graph_net()
    for twin in (copy.deepcopy(model), _pickled(model)):
        held = csr.static_csr(twin.inner_edges, twin.sizes[-1], twin.sizes[-1])
        assert held is not None and held.col is twin.inner_edges_csr_col
    double = copy.deepcopy(model).to(torch.float64)  # new buffer tensors
    held = csr.static_csr(double.inner_edges, double.sizes[-1], double.sizes[-1])
    assert held is not None and held.col is double.inner_edges_csr_col
    state = model.state_dict()
    flipped = state["inner_edges"].flip(1)  # other edges, same node sets
    state["inner_edges"] = flipped.clone()
    model.load_state_dict(state)
    held = csr.static_csr(model.inner_edges, model.sizes[-1], model.sizes[-1])
    want = csr.build_csr(flipped, model.sizes[-1], model.sizes[-1])
    assert all(torch.equal(a, b) for a, b in zip(held, want))


def test_attach_static_csr_refuses_a_csr_of_another_graph():
    from qsv_pyg.nn import csr

    g = _graph(6, 2)
    with pytest.raises(ValueError, match="does not fit the edge index"):
        csr.attach_static_csr(torch.zeros(2, 5, dtype=torch.long), 6, 6, g)
