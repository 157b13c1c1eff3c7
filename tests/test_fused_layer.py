"""``qsv_pyg::attend_layer``: QSVConv's default layer as one operator on the Triton
path (issue 32: at most 10 launches per forward+backward,
``tests/test_launch_count.py``), run here through Triton's interpreter and
checked against the composed path (``QSV_PYG_FUSED_LAYER=0``: the operator
``qsv_pyg::attend`` and the layer's own ops), which the other tests check
against the literal formula."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from qsv_pyg.nn import QSVConv  # noqa: E402
from qsv_pyg.nn import fused_layer, triton_kernel  # noqa: E402
from qsv_pyg.nn import triton_tuning as tt  # noqa: E402
from qsv_pyg.nn.csr import build_csr  # noqa: E402


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("QSV_PYG_TRITON", "interpret")
    monkeypatch.delenv(fused_layer.FUSED_LAYER_ENV, raising=False)
    return monkeypatch


def _graph(n: int, e: int, seed: int = 0) -> torch.Tensor:
    """A random graph with variable degrees, repeated edges and (for n >> e /
    n) isolated targets and sources."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (2, e), generator=gen)


def _layer(channels=16, out=3, heads=2, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = QSVConv(channels, out, heads=heads, check_finite=False, **kw).to(dtype)
    with torch.no_grad():  # away from the near-identity start: a real rotation
        layer.lin_quat.weight.normal_()
        layer.lin_quat.bias.normal_()
        layer.bias.normal_()
        layer.log_beta.normal_()
    return layer


def _step(layer, x, edge_index, alpha_weight=None):
    """Output, weights and every gradient of one forward+backward (the same
    random state each time: attention dropout draws the same mask)."""
    torch.manual_seed(7)
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, (_, alpha) = layer(x, edge_index, return_attention_weights=True)
    gen = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    if alpha_weight is not None:
        loss = loss + (alpha * alpha_weight).sum()
    loss.backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return out.detach(), alpha.detach(), grads


def _compare(layer, x, edge_index, monkeypatch, alpha_weight=None, tol=1e-10):
    calls = triton_kernel.CALLS["forward"]
    assert layer.fused_layer_reason(x, edge_index) is None
    fused = _step(layer, x, edge_index, alpha_weight)
    assert triton_kernel.CALLS["forward"] == calls  # not the composed path's operator
    monkeypatch.setenv(fused_layer.FUSED_LAYER_ENV, "0")
    assert layer.fused_layer_reason(x, edge_index) == f"{fused_layer.FUSED_LAYER_ENV}=0"
    composed = _step(layer, x, edge_index, alpha_weight)
    monkeypatch.delenv(fused_layer.FUSED_LAYER_ENV)
    assert triton_kernel.CALLS["forward"] == calls + 1
    for a, b in zip(fused[:2], composed[:2]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert fused[2].keys() == composed[2].keys()
    for name in fused[2]:
        assert fused[2][name] is not None, name
        torch.testing.assert_close(fused[2][name], composed[2][name], atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("heads,channels,out", [(2, 16, 3), (4, 16, 4), (1, 8, 5)])
def test_the_one_operator_is_the_composed_layer(interpret, heads, channels, out):
    layer = _layer(channels, out, heads)
    x = torch.randn(29, channels, dtype=torch.float64)
    _compare(layer, x, _graph(29, 90), interpret)


def test_padded_features(interpret):
    """Features of a width that is not a multiple of ``4 * heads`` (Cora's 1,433
    words): the heads read them zero-padded, the maps read them as they are."""
    layer = _layer(13, 3, 2)
    x = torch.randn(17, 13, dtype=torch.float64)
    _compare(layer, x, _graph(17, 50, seed=8), interpret)


@pytest.mark.parametrize("heads", [2, 4])
def test_the_mean_over_heads(interpret, heads):
    """``concat=False`` (the output layer of a GAT-like model): the mean over
    heads inside the row kernel."""
    layer = _layer(16, 5, heads, concat=False)
    x = torch.randn(19, 16, dtype=torch.float64)
    _compare(layer, x, _graph(19, 60, seed=6), interpret)


def test_weights_gradient_and_isolated_nodes(interpret):
    """A loss on the returned weights too (their gradient enters the softmax
    backward), on a graph where most nodes have no incoming edge."""
    layer = _layer()
    x = torch.randn(40, 16, dtype=torch.float64)
    edge_index = _graph(40, 12, seed=3)
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(12, 2, generator=gen, dtype=torch.float64)
    _compare(layer, x, edge_index, interpret, alpha_weight=weight)


def test_attention_dropout(interpret):
    """Attention dropout in training: the mask as the operator's per-edge scale
    (the returned weights are the ones used, as the composed path returns them)."""
    layer = _layer(dropout=0.4)
    layer.train()
    x = torch.randn(21, 16, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    _compare(layer, x, _graph(21, 70, seed=4), interpret,
             alpha_weight=torch.randn(70, 2, generator=gen, dtype=torch.float64))
    _, alpha, _ = _step(layer, x, _graph(21, 70, seed=4))
    assert (alpha == 0).any()  # some weights were dropped


def test_under_autocast(interpret):
    """bf16 autocast with float32 features: the one operator runs in float32
    (the composed path's matmuls run in bf16: equal to bf16's precision), and
    the output is float32 on both paths."""
    layer = _layer(dtype=torch.float32)
    x = torch.randn(15, 16)
    edge_index = _graph(15, 50, seed=10)
    results = []
    for env in ("1", "0"):
        interpret.setenv(fused_layer.FUSED_LAYER_ENV, env)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_step(layer, x, edge_index))
    (out, alpha, grads), (out_c, alpha_c, grads_c) = results
    assert out.dtype == out_c.dtype == torch.float32
    torch.testing.assert_close(out, out_c, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(alpha, alpha_c.to(alpha.dtype), atol=2e-2, rtol=2e-2)
    for name in grads:
        scale = grads_c[name].abs().max().item() + 1e-6
        assert (grads[name] - grads_c[name]).abs().max().item() <= 5e-2 * scale, name


def test_float32_and_tuned_configurations(interpret):
    """float32, and every launch configuration the autotune tries (several rows
    per program, shorter steps, more warps), as on a GPU."""
    interpret.setenv(tt.AUTOTUNE_ENV, "1")
    interpret.setattr(tt, "TUNED", {})
    interpret.setattr(tt, "TIMINGS", {})
    interpret.setattr(tt, "TUNE_REPEATS", 0)  # each candidate launched once, untimed
    layer = _layer(dtype=torch.float32)
    x = torch.randn(12, 16)
    _compare(layer, x, _graph(12, 40, seed=1), interpret, tol=2e-5)
    tried = {key[0]: len(t) for key, t in tt.TIMINGS.items()}
    assert {"layer_forward_rows", "layer_backward_rows", "layer_backward_cols"} <= set(tried)
    assert min(tried.values()) >= 3


def test_second_derivatives(interpret):
    """create_graph=True: the backward is autograd of the composition, so a
    gradient penalty matches the composed path's."""
    layer = _layer()
    x0 = torch.randn(17, 16, dtype=torch.float64)
    edge_index = _graph(17, 50, seed=2)

    def penalty():
        x = x0.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        out = layer(x, edge_index)
        (gx, ) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    fused = penalty()
    interpret.setenv(fused_layer.FUSED_LAYER_ENV, "0")
    composed = penalty()
    for a, b in zip(fused, composed):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_bit_identical_reruns(interpret):
    layer = _layer(dtype=torch.float32)
    x = torch.randn(25, 16)
    edge_index = _graph(25, 80)
    first, second = _step(layer, x, edge_index), _step(layer, x, edge_index)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])


@pytest.mark.parametrize("change,reason", [
    (dict(quat_source="given"), "quat_source='given'"),
    (dict(routing="uniform"), "routing or transport other than learned / sandwich"),
    (dict(edge_dim=3), "input projection or edge terms"),
    (dict(bias=False), "no root weight or no bias"),
    (dict(root_weight=False), "no root weight or no bias"),
    (dict(add_self_loops=True), "add_self_loops=True"),
    (dict(check_finite=True), "check_finite (checked on the composed path)"),
])
def test_what_the_one_operator_does_not_take(interpret, change, reason):
    kw = dict(channels=16, out=3, heads=2, dtype=torch.float32)
    layer = _layer(**kw) if "quat_source" not in change else QSVConv(
        16, 3, heads=2, check_finite=False, quat_source="given")
    if "quat_source" not in change:
        torch.manual_seed(0)
        layer = QSVConv(16, 3, heads=2, **{"check_finite": False, **change})
    x = torch.randn(10, 16)
    assert layer.fused_layer_reason(x, _graph(10, 30)) == reason


def test_where_the_one_operator_does_not_apply(interpret):
    layer = _layer(dtype=torch.float32)
    x, edge_index = torch.randn(10, 16), _graph(10, 30)
    assert layer.fused_layer_reason(x.double(), edge_index) == \
        "parameters of another dtype than the features"
    assert layer.fused_layer_reason((x, x), edge_index) == "bipartite input"
    assert layer.fused_layer_reason(x.view(2, 5, 16), edge_index) == "batched [B, N, C] input"
    assert layer.fused_layer_reason(torch.randn(10, 12), edge_index).startswith(
        "features of another width")
    assert layer.fused_layer_reason(torch.randn(0, 16), edge_index) == "no nodes"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.fused_layer_reason(x, edge_index) is None  # float32 features
        assert layer.fused_layer_reason(x.bfloat16(), edge_index).startswith("autocast")
    wide = QSVConv(16, 1024, heads=1, check_finite=False)  # a [1, 4, 1024] tile fits
    assert wide.fused_layer_reason(x, edge_index) is None
    wider = QSVConv(64, 2048, heads=1, check_finite=False)  # [1, 16, 2048] does not
    assert wider.fused_layer_reason(torch.randn(10, 64), edge_index) == \
        "the projection tile is too wide for one program"
    interpret.setenv("QSV_PYG_TRITON", "0")
    assert layer.fused_layer_reason(x, edge_index) == "not on the Triton path"


def test_the_operator_without_triton_is_the_composition(monkeypatch):
    """Off the Triton path (here the CPU) the registered operator computes the
    composition itself; ``opcheck`` checks its schema, fake tensor and autograd
    registration there."""
    monkeypatch.setenv("QSV_PYG_TRITON", "0")
    torch.manual_seed(0)
    n, heads, m, f = 11, 2, 2, 3
    x = torch.randn(n, 4 * heads * m, dtype=torch.float64, requires_grad=True)
    graph = build_csr(_graph(n, 30), n, n)
    params = [torch.randn(4 * heads + heads * f, 4 * heads * m, dtype=torch.float64),
              torch.randn(4 * heads, dtype=torch.float64),
              torch.randn(heads * f, dtype=torch.float64),
              torch.randn(heads, 4 * m, f, dtype=torch.float64),
              torch.randn(heads, dtype=torch.float64)]
    params = [p.requires_grad_(True) for p in params]
    scale = torch.rand(30, heads, dtype=torch.float64)  # attention dropout's scale
    args = (x, *params, scale, graph.rowptr, graph.col, graph.row, graph.rowptr_t,
            graph.perm_t, graph.row_t, False)
    torch.library.opcheck(fused_layer.attend_layer, args, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor"))
    out, alpha, *_ = fused_layer.attend_layer(*args)
    ref_out, ref_alpha = fused_layer.reference(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(alpha, ref_alpha)
    # the mean over heads: a root weight and bias of the output width
    mean_args = (x, torch.randn(4 * heads + f, 4 * heads * m, dtype=torch.float64,
                                requires_grad=True), params[1],
                 torch.randn(f, dtype=torch.float64, requires_grad=True), *params[3:],
                 scale, *args[7:13], True)
    torch.library.opcheck(fused_layer.attend_layer, mean_args, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor"))
    torch.testing.assert_close(fused_layer.attend_layer(*mean_args)[0],
                               fused_layer.reference(*mean_args)[0])


def test_opcheck_on_the_triton_path(interpret):
    torch.manual_seed(0)
    n, heads, m, f = 9, 2, 1, 2
    x = torch.randn(n, 4 * heads * m, requires_grad=True)
    graph = build_csr(_graph(n, 20), n, n)
    params = [torch.randn(4 * heads + heads * f, 4 * heads * m), torch.randn(4 * heads),
              torch.randn(heads * f), torch.randn(heads, 4 * m, f), torch.randn(heads)]
    params = [p.requires_grad_(True) for p in params]
    torch.library.opcheck(fused_layer.attend_layer,
                          (x, *params, torch.empty(0, heads), graph.rowptr, graph.col,
                           graph.row, graph.rowptr_t, graph.perm_t, graph.row_t, False),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def test_the_benchmarks_composed_layer_composes(interpret):
    """bench_conv's ``"qsv-composed"`` is ``"qsv"`` without the one operator (one
    GPU run then measures what it gains), with the same parameters and output."""
    from conftest import load_benchmark
    make_layer = load_benchmark("bench_conv").make_layer
    torch.manual_seed(0)
    fused = make_layer("qsv", 16, 2)
    composed = make_layer("qsv-composed", 16, 2)
    composed.layer.load_state_dict(fused.state_dict())
    x, edge_index = torch.randn(10, 16), _graph(10, 30)
    calls = triton_kernel.CALLS["forward"]
    out = fused(x, edge_index)
    assert triton_kernel.CALLS["forward"] == calls
    torch.testing.assert_close(composed(x, edge_index), out, atol=1e-5, rtol=1e-5)
    assert triton_kernel.CALLS["forward"] == calls + 1
    assert fused_layer.FUSED_LAYER_ENV not in __import__("os").environ


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,kw", [
    (torch.float64, {}), (torch.float32, {}),
    (torch.float32, dict(concat=False, dropout=0.3, width=61)),  # averaged, dropout, padded
])
def test_the_one_operator_on_a_gpu(monkeypatch, dtype, kw):
    """The compiled kernels on a GPU against the composed path (``pytest -m
    cuda``: run_gpu.sh's cuda-tests step), one launch configuration (no tuning:
    a cold cache compiles each kernel once per variant)."""
    monkeypatch.setenv(tt.AUTOTUNE_ENV, "0")
    monkeypatch.delenv(fused_layer.FUSED_LAYER_ENV, raising=False)
    kw = dict(kw)
    width = kw.pop("width", 64)
    layer = _layer(channels=width, out=16, heads=4, dtype=dtype, **kw).cuda()
    layer.train()
    x = torch.randn(300, width, dtype=dtype).cuda()
    gen = torch.Generator().manual_seed(4)
    edge_index = torch.randint(0, 300, (2, 3000), generator=gen).cuda()
    _compare(layer, x, edge_index, monkeypatch,
             tol=1e-9 if dtype == torch.float64 else 1e-4)


def test_torch_compile_keeps_the_one_operator(interpret):
    """Under torch.compile (aot_eager: the operators' fake kernels trace the
    forward and the backward) the layer gives the eager result and gradient."""
    layer = _layer(dtype=torch.float32)
    x = torch.randn(12, 16, requires_grad=True)
    edge_index = _graph(12, 40)
    eager = layer(x, edge_index)
    (g_eager, ) = torch.autograd.grad(eager.sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    out = compiled(x, edge_index)
    (g_out, ) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(g_out, g_eager)
    graphs = []

    def record(gm, inputs):  # the traced graphs hold the operator itself
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(layer, backend=record)(x, edge_index)
    assert any("attend_layer" in code for code in graphs), graphs


def test_a_gat_like_model_runs_on_the_one_operator(interpret):
    """``nn.models.QSV`` as a GAT on Cora is configured (padded input width,
    attention dropout in training, the heads averaged in the last layer): every
    conv takes the one operator, and the model's output and gradients are the
    composed path's."""
    from qsv_pyg.nn.models import QSV
    torch.manual_seed(0)
    model = QSV(13, 16, num_layers=2, out_channels=5, heads=2, dropout=0.3,
                check_finite=False).double()
    model.train()
    x = torch.randn(23, 13, dtype=torch.float64)
    edge_index = _graph(23, 70, seed=9)
    assert all(conv.fused_layer_reason(t, edge_index) is None for conv, t in
               ((model.convs[0], x), (model.convs[1], torch.randn(23, 16).double())))

    def step():
        torch.manual_seed(3)  # the same dropout masks
        model.zero_grad(set_to_none=True)
        out = model(x, edge_index)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    calls = triton_kernel.CALLS["forward"]
    fused = step()
    assert triton_kernel.CALLS["forward"] == calls
    interpret.setenv(fused_layer.FUSED_LAYER_ENV, "0")
    composed = step()
    torch.testing.assert_close(fused[0], composed[0], atol=1e-10, rtol=1e-10)
    for a, b in zip(fused[1], composed[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_edge_index_input_and_what_message_passing_keeps(interpret):
    """An ``EdgeIndex`` (its own cached CSR) takes the one operator with the
    plain tensor's result; a PyG hook, an explainer, a sparse adjacency and a
    lazy layer before its first call keep their paths, with the reason named."""
    from torch_geometric import EdgeIndex
    layer = _layer(dtype=torch.float32)
    x = torch.randn(14, 16)
    edge_index = _graph(14, 40, seed=12)
    sorted_index = EdgeIndex(edge_index[:, edge_index[1].argsort()], sparse_size=(14, 14),
                             sort_order="col")
    assert layer.fused_layer_reason(x, sorted_index) is None
    torch.testing.assert_close(layer(x, sorted_index), layer(x, edge_index.clone()),
                               atol=1e-6, rtol=1e-6)
    handle = layer.register_message_forward_hook(lambda *args: None)
    assert "hook" in layer.fused_layer_reason(x, edge_index)
    handle.remove()
    layer.explain = True
    assert "explainer" in layer.fused_layer_reason(x, edge_index)
    layer.explain = False
    adj = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(40), (14, 14))
    assert "sparse" in layer.fused_layer_reason(x, adj)
    lazy = QSVConv(-1, 3, heads=2, check_finite=False)
    assert lazy.fused_layer_reason(x, edge_index) == "a lazy layer before its first call"
    lazy(x, edge_index)  # the first call materialises it (composed)
    assert lazy.fused_layer_reason(x, edge_index) is None
