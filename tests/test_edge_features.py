"""Edge features in QSVConv (issue 29): ``edge_dim`` / ``fill_value`` / ``edge_attr``
as in GATConv, the edge score in the logit, the optional edge embedding in the
message, the per-source logit term; on the fast path (the operator's additive
logit term) and on message passing, against the literal per-edge formula of
:mod:`qsv_pyg.nn.reference`. Also issue 28 items 1 (distance routing exact
wherever the cloud sits) and 4 (quaternions in float32 under autocast)."""
import copy
import warnings

import pytest
import torch
from conftest import random_qsv_conv

import qsv_pyg.nn.fused_path as fused_path_module
import torch_geometric.typing
from qsv_pyg.nn import QSVConv, qsv_conv_reference
from qsv_pyg.nn.models import QSV
from qsv_pyg.quaternion import random_unit_quaternion

pytestmark = pytest.mark.usefixtures("one_thread")
TOL64 = dict(rtol=1e-9, atol=1e-9)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make(in_channels, out_channels=3, heads=2, seed=0, dtype=torch.float64, **kwargs):
    """A layer in eval mode with every parameter randomised (β_h differing per head)."""
    return random_qsv_conv(in_channels, out_channels, heads, seed, dtype, **kwargs)


def edges(n_src, num_edges, seed, n_dst=None):
    """Distinct edges, no self-loops, shuffled; target 0 of a bipartite graph gets none."""
    n_dst = n_src if n_dst is None else n_dst
    g = gen(seed)
    cand = torch.randperm(n_src * n_dst, generator=g)
    src, dst = cand // n_dst, cand % n_dst
    keep = (src != dst) if n_src == n_dst else (dst != 0)
    return torch.stack([src[keep][:num_edges], dst[keep][:num_edges]])


def fail_if_called(*args, **kwargs):
    raise AssertionError("the edge path fell back to PyG's message passing")


def run(conv, x, ei, ea, monkeypatch=None, **kw):
    """``(out, alpha)`` of ``conv``; with ``monkeypatch`` the fast path is required."""
    if monkeypatch is not None:
        monkeypatch.setattr(conv, "propagate", fail_if_called)
    out, (_, alpha) = conv(x, ei, ea, return_attention_weights=True, **kw)
    if monkeypatch is not None:
        monkeypatch.undo()
    return out, alpha


CONFIGS = {
    "edge_dim=4": dict(edge_dim=4),
    "edge_dim=1, loops 0.5": dict(edge_dim=1, add_self_loops=True, fill_value=0.5),
    "loops mean": dict(edge_dim=4, add_self_loops=True, fill_value="mean"),
    "loops add, message": dict(edge_dim=4, add_self_loops=True, fill_value="add",
                               edge_message=True),
    "loops tensor, message, source": dict(edge_dim=4, add_self_loops=True,
                                          fill_value=torch.tensor([1.0, -2.0, 0.5, 0.0]),
                                          edge_message=True, source_logit=True),
    "source only": dict(source_logit=True),
    "message, projected": dict(edge_dim=4, edge_message=True, project_input=True),
    "loops mean, message target": dict(edge_dim=4, add_self_loops=True,
                                       edge_message="target"),
    "message target, source, projected": dict(edge_dim=3, edge_message="target",
                                              source_logit=True, project_input=True),
}


@pytest.mark.parametrize("transport", ["sandwich", "identity"])
@pytest.mark.parametrize("routing", ["learned", "abs", "uniform", "geometric"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_both_paths_match_the_literal_formula(config, routing, transport, monkeypatch):
    """Output and weights of the fast path (which must not fall back to message
    passing) and of message passing against the literal per-edge formula; the
    gradients of the features, the edge features and every parameter agree
    between the paths (float64)."""
    kwargs = CONFIGS[config]
    n, F = 7, 10  # 10 channels: padded to 16 for two heads
    conv = make(F, heads=2, routing=routing, transport=transport, **kwargs)
    x = torch.randn(n, F, generator=gen(1), dtype=torch.float64, requires_grad=True)
    ei = edges(n, 18, seed=2)
    ea = None
    if "edge_dim" in kwargs:
        shape = (18, ) if kwargs["edge_dim"] == 1 else (18, kwargs["edge_dim"])
        ea = torch.randn(*shape, generator=gen(3), dtype=torch.float64, requires_grad=True)
    pos = torch.randn(n, 3, generator=gen(4), dtype=torch.float64) if routing == "geometric" \
        else None
    out, alpha = run(conv, x, ei, ea, monkeypatch, pos=pos)
    ref, ref_alpha = qsv_conv_reference(conv, x, ei, pos=pos, edge_attr=ea)
    torch.testing.assert_close(out, ref, **TOL64)
    torch.testing.assert_close(alpha, ref_alpha, **TOL64)
    conv.fused_path = "never"
    out_mp, alpha_mp = run(conv, x, ei, ea, pos=pos)
    torch.testing.assert_close(out_mp, ref, **TOL64)
    torch.testing.assert_close(alpha_mp, ref_alpha, **TOL64)
    cot = torch.randn(out.shape, generator=gen(5), dtype=torch.float64)
    wrt = [x] + ([ea] if ea is not None else []) + [p for p in conv.parameters()]
    g_fast = torch.autograd.grad((out * cot).sum(), wrt, allow_unused=True)
    g_mp = torch.autograd.grad((out_mp * cot).sum(), wrt, allow_unused=True)
    for a, b in zip(g_fast, g_mp):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            torch.testing.assert_close(a, b, **TOL64)
    if ea is not None:  # the edge features reach the output
        assert g_fast[1].abs().sum() > 0


@pytest.mark.parametrize("config", ["edge_dim=4", "loops tensor, message, source",
                                    "loops mean, message target"])
def test_float32_fast_path_on_every_cpu_backend(config, impl, monkeypatch):
    """The C++ kernel and the PyTorch implementation of the operator, float32."""
    kwargs = CONFIGS[config]
    conv = make(8, heads=2, dtype=torch.float32, **kwargs)
    x = torch.randn(9, 8, generator=gen(6))
    ei = edges(9, 25, seed=7)
    ea = torch.randn(25, 4, generator=gen(8))
    out, alpha = run(conv, x, ei, ea, monkeypatch)
    ref, ref_alpha = qsv_conv_reference(conv, x, ei, edge_attr=ea)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alpha, ref_alpha, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [True, "target"])
def test_bipartite_inputs_with_edge_features(mode, monkeypatch):
    """Source and target sets of different sizes and widths (GATConv's
    ``(x_src, x_dst)``), isolated targets, with every edge option."""
    conv = make((10, 6), heads=2, edge_dim=3, edge_message=mode, source_logit=True,
                add_self_loops=False)
    xs = torch.randn(9, 10, generator=gen(9), dtype=torch.float64)
    xd = torch.randn(5, 6, generator=gen(10), dtype=torch.float64)
    ei = edges(9, 20, seed=11, n_dst=5)
    ea = torch.randn(20, 3, generator=gen(12), dtype=torch.float64)
    out, alpha = run(conv, (xs, xd), ei, ea, monkeypatch)
    ref, ref_alpha = qsv_conv_reference(conv, (xs, xd), ei, edge_attr=ea)
    torch.testing.assert_close(out, ref, **TOL64)
    torch.testing.assert_close(alpha, ref_alpha, **TOL64)
    conv.fused_path = "never"
    torch.testing.assert_close(run(conv, (xs, xd), ei, ea)[0], ref, **TOL64)
    # given quaternions and no target features (x_dst None, quat pair)
    conv = make((10, 6), heads=2, edge_dim=3, edge_message=mode, quat_source="given",
                root_weight=False)
    qs = random_unit_quaternion(9, 2, generator=gen(13), dtype=torch.float64)
    qd = random_unit_quaternion(5, 2, generator=gen(14), dtype=torch.float64)
    out, alpha = run(conv, (xs, None), ei, ea, monkeypatch, quat=(qs, qd))
    ref, ref_alpha = qsv_conv_reference(conv, (xs, None), ei, quat=(qs, qd), edge_attr=ea)
    torch.testing.assert_close(out, ref, **TOL64)
    torch.testing.assert_close(alpha, ref_alpha, **TOL64)


@pytest.mark.parametrize("mode", [True, "target"])
@pytest.mark.parametrize("quat_kind", ["shared field", "per item"])
def test_batched_static_graph_with_edge_features(quat_kind, mode, monkeypatch):
    """``[B, N, C]`` over one graph with one ``[E, D]`` of edge features: the
    shared path (one field, the batch as channels) and the per-item path
    (feature quaternions; the per-source term) equal the items one by one."""
    B, n = 3, 6
    per_item = quat_kind == "per item"
    conv = make(8, heads=2, edge_dim=2, edge_message=mode, source_logit=per_item,
                quat_source="features" if per_item else "given", add_self_loops=True)
    x = torch.randn(B, n, 8, generator=gen(15), dtype=torch.float64)
    ei = edges(n, 14, seed=16)
    ea = torch.randn(14, 2, generator=gen(17), dtype=torch.float64)
    q = None if per_item else random_unit_quaternion(n, 2, generator=gen(18),
                                                     dtype=torch.float64)
    paths = []
    orig = QSVConv.choose_path
    monkeypatch.setattr(QSVConv, "choose_path",
                        lambda self, *a: paths.append(orig(self, *a)) or paths[-1])
    out = conv(x, ei, ea, quat=q)
    assert paths == ["attend_per_item" if per_item else "attend_shared"]
    for b in range(B):
        torch.testing.assert_close(out[b], conv(x[b], ei, ea, quat=q), **TOL64)
    conv.fused_path = "never"
    torch.testing.assert_close(conv(x, ei, ea, quat=q), out, **TOL64)


# ------------------------------------------------- PyG's GATConv tests, ported
def test_qsv_conv_with_edge_attr():
    """PyG's ``test_gat_conv_with_edge_attr`` (test/nn/conv/test_gat_conv.py),
    ported: edge_dim 1 and 4, fill_value 0.5 and 'mean' (GATConv adds
    self-loops by default; QSVConv's default is the paper's no self-loops, so
    they are asked for), and a SparseTensor with edge values, which GATConv
    refuses together with self-loops."""
    x = torch.randn(4, 8)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 0, 1, 1]])
    edge_weight = torch.randn(edge_index.size(1))
    edge_attr = torch.randn(edge_index.size(1), 4)
    sparse = torch_geometric.typing.WITH_TORCH_SPARSE
    if sparse:
        from torch_geometric.typing import SparseTensor

    conv = QSVConv(8, 32, heads=2, edge_dim=1, fill_value=0.5, add_self_loops=True)
    out = conv(x, edge_index, edge_weight)
    assert out.size() == (4, 64)
    if sparse:
        adj1 = SparseTensor.from_edge_index(edge_index, edge_weight, (4, 4))
        with pytest.raises(NotImplementedError):
            assert torch.allclose(conv(x, adj1.t()), out)

    conv = QSVConv(8, 32, heads=2, edge_dim=1, fill_value="mean", add_self_loops=True)
    out = conv(x, edge_index, edge_weight)
    assert out.size() == (4, 64)
    if sparse:
        with pytest.raises(NotImplementedError):
            assert torch.allclose(conv(x, adj1.t()), out)

    conv = QSVConv(8, 32, heads=2, edge_dim=4, fill_value=0.5, add_self_loops=True)
    out = conv(x, edge_index, edge_attr)
    assert out.size() == (4, 64)
    if sparse:
        adj2 = SparseTensor.from_edge_index(edge_index, edge_attr, (4, 4))
        with pytest.raises(NotImplementedError):
            assert torch.allclose(conv(x, adj2.t()), out)

    conv = QSVConv(8, 32, heads=2, edge_dim=4, fill_value="mean", add_self_loops=True)
    out = conv(x, edge_index, edge_attr)
    assert out.size() == (4, 64)
    if sparse:
        with pytest.raises(NotImplementedError):
            assert torch.allclose(conv(x, adj2.t()), out)


@pytest.mark.skipif(not torch_geometric.typing.WITH_TORCH_SPARSE,
                    reason="needs torch-sparse (SparseTensor)")
@pytest.mark.parametrize("edge_dim", [1, 4])
def test_sparse_tensor_values_are_the_edge_features(edge_dim):
    """Without self-loops a SparseTensor's values are the edge features, as in
    GATConv: the same output as edge_index with edge_attr."""
    from torch_geometric.typing import SparseTensor
    x = torch.randn(4, 8)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 0, 1, 1]])
    ea = torch.randn(4) if edge_dim == 1 else torch.randn(4, edge_dim)
    conv = QSVConv(8, 16, heads=2, edge_dim=edge_dim, edge_message=True).eval()
    out = conv(x, edge_index, ea)
    adj = SparseTensor.from_edge_index(edge_index, ea, (4, 4))
    torch.testing.assert_close(conv(x, adj.t()), out, rtol=1e-5, atol=1e-5)


def test_torch_sparse_adjacency_values_are_the_edge_features():
    """A torch.sparse adjacency (PyG's transposed convention) whose values are
    ``[E, edge_dim]`` features gives the edge_index + edge_attr result, and
    returns the weights as a sparse tensor; 1-D values are edge weights, not
    features, as in GATConv (PyG's message passing reads them so)."""
    from torch_geometric.utils import to_torch_coo_tensor
    x = torch.randn(4, 8, generator=gen(19))
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 0, 1, 1]])
    ea = torch.randn(4, 4, generator=gen(20))
    conv = make(8, 16, heads=2, dtype=torch.float32, edge_dim=4, edge_message=True)
    out, alpha = run(conv, x, edge_index, ea)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj = to_torch_coo_tensor(edge_index.flip(0), ea, size=(4, 4))
        out_s, (adj_alpha, alpha_s) = conv(x, adj, return_attention_weights=True)
    torch.testing.assert_close(out_s, out, rtol=1e-5, atol=1e-5)
    assert adj_alpha.shape == (4, 4, 2)
    dense = adj_alpha.to_dense()
    torch.testing.assert_close(dense[edge_index[1], edge_index[0]], alpha, rtol=1e-5,
                               atol=1e-5)
    conv1 = make(8, 16, heads=2, dtype=torch.float32, edge_dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj1 = to_torch_coo_tensor(edge_index.flip(0), ea[:, 0], size=(4, 4))
        torch.testing.assert_close(conv1(x, adj1), conv1(x, edge_index), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("mode", [True, "target"])
def test_to_hetero_with_edge_features(mode):
    """PyG's to_hetero (torch.fx tracing) with an edge_attr per relation: every
    relation's features reach its output."""
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    class GNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = QSVConv((-1, -1), 4, heads=2, edge_dim=3, source_logit=True)
            self.conv2 = QSVConv(8, 3, heads=1, edge_dim=3, edge_message=mode)

        def forward(self, x, edge_index, edge_attr):
            x = self.conv1(x, edge_index, edge_attr).relu()
            return self.conv2(x, edge_index, edge_attr)

    data = HeteroData()
    data["paper"].x = torch.randn(5, 8)
    data["author"].x = torch.randn(4, 16)
    for rel, ei in ((("paper", "cites", "paper"), [[0, 1, 2, 3], [1, 2, 3, 4]]),
                    (("author", "writes", "paper"), [[0, 1, 2, 3, 3], [0, 0, 1, 2, 4]]),
                    (("paper", "rev_writes", "author"), [[0, 0, 1, 2, 4], [0, 1, 2, 3, 3]])):
        data[rel].edge_index = torch.tensor(ei)
        data[rel].edge_attr = torch.randn(len(ei[0]), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hetero = to_hetero(GNN(), data.metadata(), aggr="sum").eval()
        out = hetero(data.x_dict, data.edge_index_dict, data.edge_attr_dict)
        assert out["paper"].shape == (5, 3) and out["author"].shape == (4, 3)
        assert all(torch.isfinite(v).all() for v in out.values())
        changed = dict(data.edge_attr_dict)
        key = ("author", "writes", "paper")
        changed[key] = changed[key] + 1.0
        out2 = hetero(data.x_dict, data.edge_index_dict, changed)
    assert not torch.allclose(out2["paper"], out["paper"])
    out["paper"].sum().backward()


# ------------------------------------------------------------- the QSV model
def test_qsv_model_passes_edge_attr_like_gat(monkeypatch):
    """``QSV(..., edge_dim=...)`` hands edge_attr to every layer (PyG's GAT:
    supports_edge_attr); without edge_dim a given edge_attr is an error."""
    assert QSV.supports_edge_attr
    torch.manual_seed(0)
    model = QSV(8, 8, 2, out_channels=3, heads=2, edge_dim=3, add_self_loops=True,
                edge_message=True).eval()
    x = torch.randn(6, 8, generator=gen(21))
    ei = edges(6, 14, seed=22)
    ea = torch.randn(14, 3, generator=gen(23))
    seen = []
    for conv in model.convs:
        orig = conv.forward
        monkeypatch.setattr(conv, "forward",
                            lambda *a, _f=orig, **k: seen.append(k.get("edge_attr")) or
                            _f(*a, **k))
    out = model(x, ei, edge_attr=ea)
    assert len(seen) == 2 and all(s is ea for s in seen)
    h = model.act(model.convs[0](x, ei, ea))
    torch.testing.assert_close(out, model.convs[1](h, ei, ea))
    assert not torch.allclose(out, model(x, ei, edge_attr=ea + 1))
    with pytest.raises(ValueError, match="without edge_dim"):
        QSV(8, 8, 2)(x, ei, edge_attr=ea)
    with pytest.raises(ValueError, match="edge weights"):
        model(x, ei, edge_weight=torch.ones(14))
    # layer-wise inference hands the layers no edge features: refused, not silent
    with pytest.raises(NotImplementedError, match="no edge_dim"):
        model.inference_per_layer(0, x, ei, 6)


def test_qsv_model_to_hetero_with_edge_features():
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    data = HeteroData()
    data["a"].x = torch.randn(6, 8)
    data["b"].x = torch.randn(5, 8)
    ei = torch.stack([torch.arange(12) % 6, torch.arange(12) % 5])
    data["a", "to", "b"].edge_index = ei
    data["a", "to", "b"].edge_attr = torch.randn(12, 2)
    data["b", "rev", "a"].edge_index = ei.flip(0)
    data["b", "rev", "a"].edge_attr = torch.randn(12, 2)
    model = to_hetero(QSV(-1, 8, 2, 4, edge_dim=2), data.metadata())
    out = model(data.x_dict, data.edge_index_dict, edge_attr=data.edge_attr_dict)
    assert out["a"].shape == (6, 4) and out["b"].shape == (5, 4)
    out["a"].sum().backward()


# ------------------------------------------------------- the per-source term
def test_source_logit_is_off_by_default_and_scores_sources():
    """Off by default (no parameters, the paper's layer and its state dict); on,
    a source with a high score a_h^T x_j takes the weight of every target it
    reaches, on both paths."""
    plain = QSVConv(8, 4, heads=2)
    assert not plain.source_logit and plain.lin_source is None and plain.lin_edge is None
    assert not any(k.startswith(("lin_source", "lin_edge")) for k in plain.state_dict())
    conv = make(8, heads=2, source_logit=True)
    x = torch.randn(6, 8, generator=gen(24), dtype=torch.float64)
    x[2] = 0
    x[2, 0] = 1.0
    ei = torch.tensor([[1, 2, 3, 2, 4, 5], [0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        conv.lin_source.weight.zero_()
        conv.lin_source.weight[:, 0] = 50.0  # node 2's score: 50 per head
    for path in ("auto", "never"):
        conv.fused_path = path
        _, (_, alpha) = conv(x, ei, return_attention_weights=True)
        assert (alpha[ei[0] == 2] > 0.99).all()


def test_source_logit_gradient_on_the_fast_path(monkeypatch):
    conv = make(8, heads=2, source_logit=True, add_self_loops=True)
    x = torch.randn(7, 8, generator=gen(25), dtype=torch.float64)
    ei = edges(7, 16, seed=26)
    out = run(conv, x, ei, None, monkeypatch)[0]
    (g_fast, ) = torch.autograd.grad(out.pow(2).sum(), conv.lin_source.weight)
    conv.fused_path = "never"
    (g_mp, ) = torch.autograd.grad(conv(x, ei).pow(2).sum(), conv.lin_source.weight)
    assert g_fast.abs().sum() > 0
    torch.testing.assert_close(g_fast, g_mp, **TOL64)


# ------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("mode", [True, "target"])
def test_compiled_edge_path_calls_the_operator_once_in_one_graph(mode):
    import torch._dynamo
    torch._dynamo.reset()
    conv = make(8, heads=2, dtype=torch.float32, edge_dim=3, edge_message=mode,
                source_logit=True, routing="geometric", add_self_loops=True)
    x = torch.randn(7, 8, generator=gen(27))
    pos = torch.randn(7, 3, generator=gen(28))
    ei = edges(7, 16, seed=29)
    ea = torch.randn(16, 3, generator=gen(30))
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    compiled = torch.compile(conv, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x, ei, ea, pos=pos), conv(x, ei, ea, pos=pos),
                               rtol=1e-5, atol=1e-5)
    attend = torch.ops.qsv_pyg.attend
    assert sum(t in (attend, attend.default) for t in targets) == 1


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("build,call,match", [
    (dict(), dict(edge_attr=torch.randn(12, 2)), "built without edge_dim"),
    (dict(edge_dim=2), dict(edge_attr=torch.randn(12, 3)), "3 features per edge"),
    (dict(edge_dim=2), dict(edge_attr=torch.randn(11, 2)), "11 rows but there are 12"),
    (dict(edge_dim=2), dict(edge_attr=torch.ones(12, 2, dtype=torch.long)),
     "edge_attr must be a floating-point"),
    (dict(edge_dim=2), dict(edge_attr=torch.randn(12, 2, 4)), "quaternions go in quat"),
    (dict(edge_dim=2), dict(edge_attr=torch.full((12, 2), float("nan"))),
     "non-finite edge features"),
])
def test_bad_edge_features_name_the_problem(build, call, match):
    conv = QSVConv(8, 4, heads=2, **build)
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match=match):
        conv(x, edges(6, 12, seed=31), **call)


@pytest.mark.parametrize("kwargs,match", [
    (dict(edge_dim=0), "edge_dim must be a positive integer"),
    (dict(edge_dim=True), "edge_dim must be a positive integer"),
    (dict(edge_message=True), "needs edge_dim"),
    (dict(in_channels=-1, edge_dim=2, edge_message=True), "needs the source width"),
    (dict(edge_message="target"), "needs edge_dim"),
    (dict(edge_dim=2, edge_message="sideways"), "edge_message must be False, True or one"),
])
def test_bad_edge_options_name_the_problem(kwargs, match):
    kwargs = {"in_channels": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        QSVConv(out_channels=4, **kwargs)


# ------------------------- issue 28 item 1: distance routing away from the origin
@pytest.mark.parametrize("beta", [1.0, 10.0])
@pytest.mark.parametrize("shift", [0.0, 100.0, 1000.0])
def test_geometric_routing_is_exact_wherever_the_cloud_sits(shift, beta):
    """The fast path's weights of routing="geometric" in float32 agree with
    message passing and with float64 from the same positions to float32
    rounding, at the origin and shifted by 100 and 1000 (they were off by
    1.2e-3 and 0.098: the keys expanded -beta |p_i - p_j|^2 into dot products)."""
    torch.manual_seed(0)
    conv = QSVConv(8, 4, heads=2, routing="geometric", beta_init=beta).eval()
    x = torch.randn(40, 8, generator=gen(32))
    pos = 0.3 * torch.randn(40, 3, generator=gen(33)) + shift
    ei = edges(40, 300, seed=34)
    _, (_, fast) = conv(x, ei, pos=pos, return_attention_weights=True)
    conv64 = copy.deepcopy(conv).double()
    _, (_, exact) = conv64(x.double(), ei, pos=pos.double(), return_attention_weights=True)
    conv.fused_path = "never"
    _, (_, mp) = conv(x, ei, pos=pos, return_attention_weights=True)
    assert (fast.double() - exact).abs().max() < 1e-5
    assert (fast - mp).abs().max() < 1e-5


# ----------------------- issue 28 item 4: quaternions in float32 under autocast
@pytest.mark.parametrize("quat_source", ["features", "given", "composed"])
def test_quaternions_reach_the_operator_in_float32_under_autocast(quat_source, monkeypatch):
    """Under CPU autocast (bf16) the feature quaternions (and given ones passed in
    bf16) are computed and normalised in float32: unit to float32 rounding."""
    seen = []
    orig = fused_path_module.qsv_attend

    def spy(v, q_src, q_dst, *args, **kwargs):
        seen.append((q_src, q_dst))
        return orig(v, q_src, q_dst, *args, **kwargs)

    monkeypatch.setattr(fused_path_module, "qsv_attend", spy)
    torch.manual_seed(0)
    conv = QSVConv(16, 8, heads=2, quat_source=quat_source)
    x = torch.randn(10, 16, generator=gen(35))
    quat = None if quat_source == "features" else \
        random_unit_quaternion(10, 2, generator=gen(36)).bfloat16()
    ei = edges(10, 30, seed=37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x, ei, quat=quat)
    (q_src, q_dst), = seen
    for q in (q_src, q_dst):
        assert q.dtype == torch.float32
        assert (q.norm(dim=-1) - 1).abs().max() < 1e-6


def test_attention_dropout_weights_the_edge_message(monkeypatch):
    """Training with attention dropout stays on the operator, and the edge
    embedding is weighted by the dropped, rescaled weights it returns, as the
    features are: the output is the literal sum with those weights."""
    from qsv_pyg.quaternion import conjugate, hamilton_product
    conv = make(8, heads=2, edge_dim=3, edge_message=True, dropout=0.5).train()
    x = torch.randn(7, 8, generator=gen(40), dtype=torch.float64)
    ei = edges(7, 20, seed=41)
    ea = torch.randn(20, 3, generator=gen(42), dtype=torch.float64)
    torch.manual_seed(43)
    out, alpha = run(conv, x, ei, ea, monkeypatch)
    assert (alpha == 0).any()  # some weights were dropped
    src, dst = ei
    H, C = 2, 4
    q_src, q_dst = conv._node_quaternions(x, x, None, 7)
    xj = (x[src] + ea @ conv.lin_edge_msg.weight.t()).view(20, H, C // 4, 4)
    r = hamilton_product(conjugate(q_dst[dst]), q_src[src]).unsqueeze(2)
    xj = hamilton_product(hamilton_product(r, xj), conjugate(r))
    z = x.new_zeros(7, H, C // 4, 4).index_add(0, dst, alpha.view(20, H, 1, 1) * xj)
    ref = torch.einsum("nhc,hcf->nhf", z.view(7, H, C), conv.weight).reshape(7, -1)
    ref = ref + conv.lin_skip(x) + conv.bias
    torch.testing.assert_close(out, ref, **TOL64)


def test_lazy_edge_dim():
    """``edge_dim=-1`` derives the width from the first edge_attr, as PyG's lazy
    layers do; a state dict of the built layer loads into a fresh lazy one."""
    conv = QSVConv(8, 4, heads=2, edge_dim=-1, edge_message=True)
    x, ei = torch.randn(6, 8), edges(6, 12, seed=44)
    ea = torch.randn(12, 5)
    out = conv(x, ei, ea)
    assert conv.lin_edge.weight.shape == (2, 5) and conv.lin_edge_msg.weight.shape == (8, 5)
    fresh = QSVConv(8, 4, heads=2, edge_dim=-1, edge_message=True)
    fresh.load_state_dict(conv.state_dict())
    torch.testing.assert_close(fresh(x, ei, ea), out)


def test_geometric_routing_gradients_of_positions_and_beta(monkeypatch):
    """The distance logit is the operator's additive term: the positions and β
    get their gradients through it, as on message passing."""
    conv = make(8, heads=2, routing="geometric", edge_dim=2)
    x = torch.randn(7, 8, generator=gen(45), dtype=torch.float64)
    pos = (torch.randn(7, 3, generator=gen(46), dtype=torch.float64) + 50).requires_grad_()
    ei = edges(7, 18, seed=47)
    ea = torch.randn(18, 2, generator=gen(48), dtype=torch.float64)
    grads = []
    for path in ("auto", "never"):
        conv.fused_path = path
        out = conv(x, ei, ea, pos=pos) if path == "never" else \
            run(conv, x, ei, ea, monkeypatch, pos=pos)[0]
        grads.append(torch.autograd.grad(out.pow(2).sum(), (pos, conv.log_beta)))
    for a, b in zip(*grads):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, **TOL64)


@pytest.mark.parametrize("edge", [False, True], ids=["plain", "edge features"])
def test_a_bfloat16_layer_runs_on_both_paths(edge):
    """A layer converted to bfloat16 (no autocast) keeps working on message
    passing, whose PyG ops take one dtype, now that the unit quaternions are
    float32; the two paths agree to bf16 rounding."""
    torch.manual_seed(0)
    kw = dict(edge_dim=2, edge_message=True, source_logit=True) if edge else {}
    conv = QSVConv(8, 4, heads=2, **kw).bfloat16().eval()
    x = torch.randn(6, 8, generator=gen(49)).bfloat16()
    ei = edges(6, 14, seed=50)
    ea = torch.randn(14, 2, generator=gen(51)).bfloat16() if edge else None
    fast = conv(x, ei, ea)
    conv.fused_path = "never"
    mp = conv(x, ei, ea)
    assert fast.dtype == mp.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), mp.float(), rtol=5e-2, atol=5e-2)


def test_qsv_model_trims_the_edge_features_with_the_layers():
    """With num_sampled_nodes_per_hop (NeighborLoader batches) the edge features
    are trimmed with the edges, as in BasicGNN: the seeds' output is unchanged."""
    torch.manual_seed(0)
    x = torch.randn(9, 8, generator=gen(52))
    ei = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])  # hops: 0-2, 3-5, 6-8
    ea = torch.randn(6, 2, generator=gen(53))
    model = QSV(8, 8, 2, edge_dim=2, edge_message=True).eval()
    full = model(x, ei, edge_attr=ea)
    trimmed = model(x, ei, edge_attr=ea, num_sampled_nodes_per_hop=[3, 3, 3],
                    num_sampled_edges_per_hop=[3, 3])
    assert trimmed.size(0) == 6
    torch.testing.assert_close(trimmed[:3], full[:3])


# ------------------------- edge_message="target": the aggregated edge features
@pytest.mark.parametrize("graph_kind", ["knn-like", "skewed", "isolated targets"])
def test_weighted_row_sums_padded_and_index_add_agree(graph_kind, monkeypatch):
    """``sum_j w_ij,h e_ij`` per target: the padded batched product (kNN-like
    degrees) and the ``index_add`` fallback (skewed degrees, forced on CUDA and
    under compile) give the same sums and gradients (float64)."""
    from qsv_pyg.nn import edge_features as ef
    from qsv_pyg.nn.graph_cache import graph_csr
    n = 12
    if graph_kind == "knn-like":  # 4 sources per target, one edge dropped
        dst = torch.arange(n).repeat_interleave(4)[1:]
        src = (dst + torch.arange(dst.numel()) % 5 + 1) % n
    elif graph_kind == "skewed":  # one hub target: padding would be far over 2x
        src = torch.arange(n).repeat(3)
        dst = torch.cat([torch.zeros(2 * n, dtype=torch.long), torch.arange(n)])
    else:  # targets 0, 5 and 11 receive nothing
        dst = torch.tensor([1, 1, 2, 3, 3, 4, 6, 7, 8, 9, 10, 10])
        src = torch.tensor([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0])
    ei = torch.stack([src, dst])
    graph = graph_csr(ei, n, n)
    E = ei.size(1)
    w = torch.rand(E, 3, generator=gen(40), dtype=torch.float64, requires_grad=True)
    e = torch.randn(E, 5, generator=gen(41), dtype=torch.float64, requires_grad=True)
    ref = torch.zeros(n, 3, 5, dtype=torch.float64).index_add(
        0, graph.row, w.view(-1, 3, 1) * e.view(-1, 1, 5))
    out = ef._weighted_row_sums(graph, w, e, n)
    padded = []
    monkeypatch.setattr(torch, "bmm", lambda *a: padded.append(1) or torch.matmul(*a))
    out = ef._weighted_row_sums(graph, w, e, n)
    monkeypatch.undo()
    assert bool(padded) == (graph_kind != "skewed")
    torch.testing.assert_close(out, ref, **TOL64)
    cot = torch.randn(ref.shape, generator=gen(42), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * cot).sum(), [w, e]),
                    torch.autograd.grad((ref * cot).sum(), [w, e])):
        torch.testing.assert_close(a, b, **TOL64)
    if graph_kind == "isolated targets":
        assert not out[[0, 5, 11]].any()
