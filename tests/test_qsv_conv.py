import math
import warnings

import pytest
import torch
from conftest import random_qsv_conv
from torch.nn.parameter import UninitializedParameter

from qsv_pyg.nn import QSVConv, graph_csr, qsv_conv_reference, unit_quaternion
from qsv_pyg.quaternion import (
    conjugate,
    hamilton_product,
    identity_quaternion,
    random_unit_quaternion,
    rotate,
)

ROUTINGS = ["learned", "abs", "uniform", "geometric"]
TRANSPORTS = ["sandwich", "identity"]
DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
       torch.float64: dict(rtol=1e-10, atol=1e-10)}


# ----------------------------------------------------------------- helpers
def gen(seed):
    return torch.Generator().manual_seed(seed)


def close(a, b, dtype=torch.float32, msg=None):
    torch.testing.assert_close(a, b, **TOL[dtype], msg=msg)


def make_conv(in_channels, out_channels=5, heads=1, dtype=torch.float32, seed=0,
              **kwargs):
    """A layer in eval mode with every parameter randomised (non-zero bias, feature
    quaternions far from the identity, β_h of different sizes per head)."""
    return random_qsv_conv(in_channels, out_channels, heads, seed, dtype, **kwargs)


def inputs(num_nodes, channels, heads, dtype=torch.float32, seed=0, batch=None):
    """Features, non-unit given quaternions ``[N, H, 4]`` and 3-d positions."""
    g = gen(seed)
    lead = (num_nodes, ) if batch is None else (batch, num_nodes)
    x = torch.randn(*lead, channels, generator=g, dtype=dtype)
    qlead = (num_nodes, heads) if batch is None else (batch, num_nodes, heads)
    quat = random_unit_quaternion(*qlead, generator=g, dtype=dtype)
    quat = quat * (0.5 + torch.rand(*qlead, 1, generator=g, dtype=dtype))
    pos = torch.randn(num_nodes, 3, generator=g, dtype=dtype)
    return x, quat, pos


def spy_fast(conv, monkeypatch):
    """Record the fast-path choices (:meth:`QSVConv.choose_path`) of this instance."""
    calls = []
    orig = QSVConv.choose_path

    def spy(layer, *args, **kwargs):
        path = orig(layer, *args, **kwargs)
        if layer is conv and path != "message_passing":
            calls.append(path)
        return path

    monkeypatch.setattr(QSVConv, "choose_path", spy)
    return calls


def segment_softmax(logits, dst, num_dst):
    out = torch.zeros_like(logits)
    for i in range(num_dst):
        m = dst == i
        if m.any():
            out[m] = torch.softmax(logits[m], dim=0)
    return out


def in_degree(edge_index, num_nodes, dtype=torch.float32):
    return torch.zeros(num_nodes, dtype=dtype).index_add_(
        0, edge_index[1], torch.ones(edge_index.size(1), dtype=dtype))


# ---------------------------------------------------- reference agreement
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("graph_kind", ["random", "knn"])
@pytest.mark.parametrize("self_loops", [False, True], ids=["noloops", "loops"])
@pytest.mark.parametrize("heads,concat", [(1, True), (1, False), (3, True), (3, False)])
@pytest.mark.parametrize("quat_mode", ["features", "given"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_matches_reference(routing, transport, quat_mode, heads, concat, self_loops,
                           graph_kind, dtype, random_graph, knn_graph, monkeypatch):
    graph = random_graph if graph_kind == "random" else knn_graph
    C = 8 * heads
    conv = make_conv(C, 5, heads, dtype, routing=routing, transport=transport,
                     concat=concat, add_self_loops=self_loops)
    calls = spy_fast(conv, monkeypatch)
    x, quat, pos = inputs(graph.num_nodes, C, heads, dtype, seed=heads)
    q = quat if quat_mode == "given" else None
    out, (ei, alpha) = conv(x, graph.edge_index, quat=q, pos=pos,
                            return_attention_weights=True)
    ref, ref_alpha = qsv_conv_reference(conv, x, graph.edge_index, quat=q, pos=pos)
    assert out.shape == (graph.num_nodes, 5 * heads if concat else 5)
    assert out.dtype == dtype
    assert alpha.shape == (ei.size(1), heads)
    close(out, ref, dtype)
    close(alpha, ref_alpha, dtype)
    # Every graph takes the fast path (the registered operator).
    assert calls == ["attend_shared"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_composed_quat_source(routing, transport, random_graph, knn_graph):
    for graph in (random_graph, knn_graph):
        conv = make_conv(24, 5, 3, torch.float64, routing=routing, transport=transport,
                         quat_source="composed")
        x, quat, pos = inputs(graph.num_nodes, 24, 3, torch.float64, seed=5)
        out = conv(x, graph.edge_index, quat=quat, pos=pos)
        ref, _ = qsv_conv_reference(conv, x, graph.edge_index, quat=quat, pos=pos)
        close(out, ref, torch.float64)
        # Independent of the layer's own quaternion code: quat ⊗ unit(q(x)).
        f = unit_quaternion(conv.lin_quat(x).view(-1, 3, 4))
        composed = hamilton_product(quat, f)
        conv.quat_source = "given"
        close(out, conv(x, graph.edge_index, quat=composed, pos=pos), torch.float64)


def test_features_and_auto_quat_sources(random_graph):
    ei = random_graph.edge_index
    conv = make_conv(16, 4, 2, torch.float64)
    x, quat, _ = inputs(random_graph.num_nodes, 16, 2, torch.float64)
    feat = conv.lin_quat(x).view(-1, 2, 4)
    out_auto_feat = conv(x, ei)
    out_auto_given = conv(x, ei, quat=quat)
    conv.quat_source = "given"
    close(out_auto_feat, conv(x, ei, quat=feat), torch.float64)
    close(out_auto_given, conv(x, ei, quat=quat), torch.float64)
    # Given quaternions are normalised inside: scale does not matter.
    close(out_auto_given, conv(x, ei, quat=quat * 3.7), torch.float64)
    # A [N, 4] field is shared by all heads.
    close(conv(x, ei, quat=quat[:, 0]), conv(x, ei, quat=quat[:, :1].expand(-1, 2, 4)),
          torch.float64)
    conv.quat_source = "features"
    close(out_auto_feat, conv(x, ei), torch.float64)
    with pytest.raises(ValueError, match="do not pass quat"):
        conv(x, ei, quat=quat)
    conv.quat_source = "given"
    with pytest.raises(ValueError, match="needs the quat argument"):
        conv(x, ei)


def test_given_source_has_no_feature_map():
    conv = QSVConv(8, 4, quat_source="given")
    assert conv.lin_quat is None and conv.lin_quat_src is None


def test_literal_single_edge():
    """Hand-computed: one edge 0 -> 1, one head, one block of four channels."""
    torch.manual_seed(0)
    conv = make_conv(4, 3, 1, torch.float64, routing="learned", transport="sandwich")
    x = torch.randn(2, 4, dtype=torch.float64)
    q = random_unit_quaternion(2, 1, dtype=torch.float64, generator=gen(1))
    ei = torch.tensor([[0], [1]])
    out = conv(x, ei, quat=q)
    r = hamilton_product(conjugate(q[1, 0]), q[0, 0])
    z1 = rotate(r, x[0])  # α = 1 for the only edge
    W = conv.weight[0]  # [4, 3]
    root = conv.lin_skip(x) + conv.bias
    close(out[1], z1 @ W + root[1], torch.float64)
    close(out[0], root[0], torch.float64)  # no incoming edge


# ------------------------------------------ fast path vs message passing
def _run_with_grads(conv, x, ei, quat, pos, weight):
    conv.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    q = None if quat is None else quat.detach().clone().requires_grad_()
    out, (_, alpha) = conv(x, ei, quat=q, pos=pos, return_attention_weights=True)
    (out * weight).sum().backward()
    grads = {n: (None if p.grad is None else p.grad.clone())
             for n, p in conv.named_parameters()}
    return out.detach(), alpha.detach(), x.grad, None if q is None else q.grad, grads


@pytest.mark.parametrize("graph_kind", ["random", "knn"])
@pytest.mark.parametrize("mode", ["2d", "batched_shared", "batched_per_item",
                                  "features", "batched_features"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fast_path_matches_message_passing(routing, transport, mode, graph_kind, knn_graph,
                                           random_graph, monkeypatch):
    graph = random_graph if graph_kind == "random" else knn_graph
    N, H, C = graph.num_nodes, 2, 16
    conv = make_conv(C, 3, H, routing=routing, transport=transport)
    batch = None if mode in ("2d", "features") else 3
    x, quat, pos = inputs(N, C, H, seed=7, batch=batch)
    if mode == "batched_shared":
        quat = quat[0]
    elif mode in ("features", "batched_features"):
        quat = None
    weight = torch.randn(*x.shape[:-1], 3 * H, generator=gen(8))
    calls = spy_fast(conv, monkeypatch)
    conv.fused_path = "auto"
    fast = _run_with_grads(conv, x, graph.edge_index, quat, pos, weight)
    per_item = mode in ("batched_per_item", "batched_features")
    assert calls == ["attend_per_item" if per_item else "attend_shared"]
    conv.fused_path = "never"
    scatter = _run_with_grads(conv, x, graph.edge_index, quat, pos, weight)
    assert len(calls) == 1
    with pytest.warns(DeprecationWarning, match="dense_path is deprecated"):
        conv.dense_path = "always"  # the old name; its "always" is "auto"
    assert conv.fused_path == "auto"
    always = _run_with_grads(conv, x, graph.edge_index, quat, pos, weight)
    assert len(calls) == 2

    for run in (always, scatter):
        close(fast[0], run[0], msg=lambda m: f"output: {m}")
        assert fast[1].shape == run[1].shape
        close(fast[1], run[1], msg=lambda m: f"alpha: {m}")
        close(fast[2], run[2], msg=lambda m: f"grad x: {m}")
        if quat is not None:
            close(fast[3], run[3], msg=lambda m: f"grad quat: {m}")
        assert fast[4].keys() == run[4].keys()
        for name, g in fast[4].items():
            if g is None or run[4][name] is None:
                assert g is None or not g.any(), name
                assert run[4][name] is None or not run[4][name].any(), name
            else:
                close(g, run[4][name], msg=lambda m, n=name: f"grad {n}: {m}")
    assert fast[2].abs().sum() > 0
    if routing in ("learned", "abs", "geometric"):
        assert fast[4]["log_beta"] is not None and fast[4]["log_beta"].abs().sum() > 0


def test_graph_csr_is_built_once_per_graph(random_graph, monkeypatch):
    import qsv_pyg.nn.graph_cache as csr
    builds = []
    orig = csr.build_csr
    monkeypatch.setattr(csr, "build_csr", lambda *a: builds.append(1) or orig(*a))
    conv = make_conv(8, 4, 2)
    ei = random_graph.edge_index.clone()  # a fresh tensor: not cached yet
    x = torch.randn(random_graph.num_nodes, 8)
    for _ in range(3):
        conv(x, ei)
    assert builds == [1]
    assert graph_csr(ei, random_graph.num_nodes, random_graph.num_nodes).num_edges == ei.size(1)


# ------------------------------------------------------------ batched mode
@pytest.mark.parametrize("self_loops", [False, True], ids=["noloops", "loops"])
@pytest.mark.parametrize("quat_kind", ["shared", "per_item", "features"])
@pytest.mark.parametrize("graph_kind", ["random", "knn"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_batched_equals_stacked(routing, graph_kind, quat_kind, self_loops, random_graph,
                                knn_graph):
    graph = random_graph if graph_kind == "random" else knn_graph
    B, N, H, C = 3, graph.num_nodes, 2, 16
    conv = make_conv(C, 3, H, routing=routing, add_self_loops=self_loops)
    x, quat, pos = inputs(N, C, H, seed=9, batch=B)
    per_item = {"shared": lambda b: quat[0], "per_item": lambda b: quat[b],
                "features": lambda b: None}[quat_kind]
    q_batched = {"shared": quat[0], "per_item": quat, "features": None}[quat_kind]
    out, (ei, alpha) = conv(x, graph.edge_index, quat=q_batched, pos=pos,
                            return_attention_weights=True)
    items = [conv(x[b], graph.edge_index, quat=per_item(b), pos=pos,
                  return_attention_weights=True) for b in range(B)]
    assert out.shape == (B, N, 3 * H)
    close(out, torch.stack([o for o, _ in items]))
    assert torch.equal(ei, items[0][1][0])
    assert alpha.shape == (B, ei.size(1), H)
    close(alpha, torch.stack([a for _, (_, a) in items]))


@pytest.mark.parametrize("fused_path", ["auto", "never"])
def test_batched_dropout_independent_per_item(fused_path, knn_graph):
    conv = make_conv(16, 3, 2, dropout=0.5, fused_path=fused_path).train()
    x, quat, _ = inputs(knn_graph.num_nodes, 16, 2, seed=30, batch=4)
    torch.manual_seed(0)
    _, (_, alpha) = conv(x, knn_graph.edge_index, quat=quat[0],
                         return_attention_weights=True)
    assert alpha.shape == (4, knn_graph.num_edges, 2)
    assert (alpha == 0).any()
    assert not torch.equal(alpha[0] == 0, alpha[1] == 0)
    conv.eval()
    _, (_, alpha) = conv(x, knn_graph.edge_index, quat=quat[0],
                         return_attention_weights=True)
    assert not (alpha == 0).any()


def test_batched_bipartite(make_random_graph):
    ei = make_random_graph(6, 10, seed=3, num_dst=4)
    conv = make_conv((16, 8), 3, 2)
    xs, qs, _ = inputs(6, 16, 2, seed=1, batch=2)
    xd, qd, _ = inputs(4, 8, 2, seed=2, batch=2)
    out = conv((xs, xd), ei, quat=(qs, qd))
    for b in range(2):
        close(out[b], conv((xs[b], xd[b]), ei, quat=(qs[b], qd[b])))


def test_batched_rejects_sparse_adjacency(random_graph):
    from torch_geometric.utils import to_torch_csc_tensor
    N = random_graph.num_nodes
    adj = to_torch_csc_tensor(random_graph.edge_index, size=(N, N)).t()
    with pytest.raises(ValueError, match="plain"):
        QSVConv(8, 4)(torch.randn(2, N, 8), adj)


# ------------------------------------------------------- attention weights
@pytest.mark.parametrize("routing", ROUTINGS)
def test_alpha_normalised_per_target(routing, random_graph, knn_graph):
    for graph in (random_graph, knn_graph):
        N, ei = graph.num_nodes, graph.edge_index
        conv = make_conv(12, 2, 3, routing=routing)
        x, quat, pos = inputs(N, 12, 3, seed=4)
        out, (ei_out, alpha) = conv(x, ei, quat=quat, pos=pos, return_attention_weights=True)
        assert torch.equal(ei_out, ei)
        assert alpha.shape == (ei.size(1), 3)
        assert (alpha >= 0).all() and (alpha <= 1).all()
        sums = torch.zeros(N, 3).index_add_(0, ei[1], alpha)
        deg = in_degree(ei, N)
        close(sums[deg > 0], torch.ones(int((deg > 0).sum()), 3))
        assert (sums[deg == 0] == 0).all()
        if routing == "uniform":
            assert torch.equal(alpha, (1.0 / deg[ei[1]]).unsqueeze(-1).expand(-1, 3))
        else:
            # Not uniform: routing depends on the quaternions / positions.
            assert not torch.allclose(alpha, (1.0 / deg[ei[1]]).unsqueeze(-1).expand(-1, 3))


def test_return_attention_weights_truthiness(random_graph):
    conv = QSVConv(8, 4)
    x = torch.randn(random_graph.num_nodes, 8)
    ei = random_graph.edge_index
    for flag in (True, 1):
        res = conv(x, ei, return_attention_weights=flag)
        assert isinstance(res, tuple) and len(res) == 2
        out, (ei_out, alpha) = res
        assert alpha.shape == (ei.size(1), 1)
    for flag in (None, False, 0):
        assert isinstance(conv(x, ei, return_attention_weights=flag), torch.Tensor)


# ------------------------------------------------------------- invariances
@pytest.mark.parametrize("quat_source", ["given", "composed"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_global_left_rotation_invariance(routing, transport, quat_source, random_graph,
                                         knn_graph):
    for graph in (random_graph, knn_graph):
        conv = make_conv(16, 3, 2, torch.float64, routing=routing, transport=transport,
                         quat_source=quat_source, add_self_loops=True)
        x, quat, pos = inputs(graph.num_nodes, 16, 2, torch.float64, seed=11)
        g = random_unit_quaternion(2, generator=gen(12), dtype=torch.float64)  # per head
        out, (_, alpha) = conv(x, graph.edge_index, quat=quat, pos=pos,
                               return_attention_weights=True)
        out_g, (_, alpha_g) = conv(x, graph.edge_index, quat=hamilton_product(g, quat),
                                   pos=pos, return_attention_weights=True)
        close(out, out_g, torch.float64)
        close(alpha, alpha_g, torch.float64)
        # A right rotation does change things (r_ij -> g* r_ij g) for the sandwich.
        if transport == "sandwich":
            out_r = conv(x, graph.edge_index, quat=hamilton_product(quat, g), pos=pos)
            assert not torch.allclose(out, out_r)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_sign_flip_of_all_quaternions(routing, transport, random_graph):
    conv = make_conv(16, 3, 2, torch.float64, routing=routing, transport=transport)
    x, quat, pos = inputs(random_graph.num_nodes, 16, 2, torch.float64, seed=13)
    ei = random_graph.edge_index
    close(conv(x, ei, quat=quat, pos=pos), conv(x, ei, quat=-quat, pos=pos), torch.float64)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_sign_flip_of_one_quaternion(routing, transport, random_graph):
    """Negating q_j flips r_ij (and r_ji): the learned logit changes sign on those
    edges; |Re r|, uniform and geometric routing and the (quadratic) sandwich do not
    see the sign."""
    dt = torch.float64
    conv = make_conv(16, 3, 2, dt, routing=routing, transport=transport,
                     add_self_loops=True)
    N, ei = random_graph.num_nodes, random_graph.edge_index
    x, quat, pos = inputs(N, 16, 2, dt, seed=14)
    j = int(ei[0, 0])  # a node with an outgoing edge
    flip = torch.ones(N, 1, 1, dtype=dt)
    flip[j] = -1
    out, (ei_l, alpha) = conv(x, ei, quat=quat, pos=pos, return_attention_weights=True)
    out_f, (_, alpha_f) = conv(x, ei, quat=quat * flip, pos=pos,
                               return_attention_weights=True)
    touched = (ei_l[0] == j) ^ (ei_l[1] == j)  # self-loop r_jj stays the identity
    assert touched.any()
    if routing == "learned":
        qn = unit_quaternion(quat)
        re_r = (qn[ei_l[1]] * qn[ei_l[0]]).sum(-1)
        sign = torch.where(touched, -1.0, 1.0).to(dt).unsqueeze(-1)
        expected = segment_softmax(conv.beta * sign * re_r, ei_l[1], N)
        close(alpha, segment_softmax(conv.beta * re_r, ei_l[1], N), dt)
        close(alpha_f, expected, dt)
        assert not torch.allclose(alpha, alpha_f)
        assert not torch.allclose(out, out_f)
    else:
        close(alpha, alpha_f, dt)
        close(out, out_f, dt)


@pytest.mark.parametrize("quat_mode", ["given", "features"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_permutation_equivariance(routing, transport, quat_mode, random_graph, knn_graph):
    for graph in (random_graph, knn_graph):
        N, ei = graph.num_nodes, graph.edge_index
        conv = make_conv(16, 3, 2, torch.float64, routing=routing, transport=transport)
        x, quat, pos = inputs(N, 16, 2, torch.float64, seed=15)
        perm = torch.randperm(N, generator=gen(16))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(N)
        q = quat if quat_mode == "given" else None
        qp = quat[perm] if quat_mode == "given" else None
        out, (_, alpha) = conv(x, ei, quat=q, pos=pos, return_attention_weights=True)
        out_p, (_, alpha_p) = conv(x[perm], inv[ei], quat=qp, pos=pos[perm],
                                   return_attention_weights=True)
        close(out_p, out[perm], torch.float64)
        close(alpha_p, alpha, torch.float64)  # same edge order


# --------------------------------------------------------------- bipartite
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_bipartite(routing, transport, make_random_graph):
    dt = torch.float64
    Ns, Nd, H = 6, 4, 2
    ei = make_random_graph(Ns, 11, seed=17, num_dst=Nd)
    conv = make_conv((16, 12), 3, H, dt, routing=routing, transport=transport)
    xs, qs, ps = inputs(Ns, 16, H, dt, seed=18)
    xd, qd, pd = inputs(Nd, 12, H, dt, seed=19)
    pos = (ps, pd)
    out = conv((xs, xd), ei, quat=(qs, qd), pos=pos)
    assert out.shape == (Nd, 3 * H)
    ref, _ = qsv_conv_reference(conv, (xs, xd), ei, quat=(qs, qd), pos=pos)
    close(out, ref, dt)
    # Quaternions from the features (separate maps for the two sides).
    out_f = conv((xs, xd), ei, pos=pos)
    ref_f, _ = qsv_conv_reference(conv, (xs, xd), ei, pos=pos)
    close(out_f, ref_f, dt)
    if routing in ("learned", "abs") or transport == "sandwich":
        assert not torch.allclose(out, out_f)
    # No target features: the root term is dropped, the rest is unchanged.
    out_none = conv((xs, None), ei, quat=(qs, qd), pos=pos)
    assert out_none.shape == (Nd, 3 * H)
    close(out_none, out - conv.lin_skip(xd), dt)
    ref_none, _ = qsv_conv_reference(conv, (xs, None), ei, quat=(qs, qd), pos=pos)
    close(out_none, ref_none, dt)
    out_size = conv((xs, None), ei, quat=(qs, qd), pos=pos, size=(Ns, Nd))
    close(out_size, out_none, dt)


def test_bipartite_errors(make_random_graph):
    ei = make_random_graph(6, 8, seed=20, num_dst=4)
    conv = QSVConv((8, 12), 3)
    xs, qs, _ = inputs(6, 8, 1)
    xd, qd, _ = inputs(4, 12, 1)
    with pytest.raises(ValueError, match="pair"):
        conv((xs, xd), ei, quat=qs)
    with pytest.raises(ValueError, match="target nodes' quaternions are needed"):
        conv((xs, None), ei, quat=(qs, None))
    with pytest.raises(ValueError, match="target nodes' quaternions are needed"):
        conv((xs, None), ei, size=(6, 4))
    with pytest.raises(ValueError, match="quat\\[0\\]"):
        conv((xs, xd), ei, quat=(None, qd))
    with pytest.raises(ValueError, match="6 rows but there are 4 target nodes"):
        conv((xs, xd), ei, quat=(qs, qs))
    # Uniform routing without transport needs no target quaternions at all.
    conv_u = QSVConv((8, 12), 3, routing="uniform", transport="identity")
    out = conv_u((xs, None), ei, size=(6, 4))
    assert out.shape == (4, 3) and torch.isfinite(out).all()


def test_lazy_in_channels(random_graph, make_random_graph):
    N, ei = random_graph.num_nodes, random_graph.edge_index
    conv = QSVConv(-1, 4, heads=2)
    assert isinstance(conv.weight, UninitializedParameter)
    x = torch.randn(N, 16)
    out = conv(x, ei)
    assert out.shape == (N, 8)
    assert conv.weight.shape == (2, 8, 4)
    # Lazily built feature map starts near the identity like reset_parameters.
    assert torch.equal(conv.lin_quat.bias.view(2, 4),
                       identity_quaternion(2, dtype=torch.float32))
    ref, _ = qsv_conv_reference(conv.eval(), x, ei)
    close(out, ref)
    with pytest.raises(ValueError, match="layer was built for 16"):
        conv(torch.randn(N, 8), ei)
    # Lazy bipartite.
    ei_b = make_random_graph(6, 9, seed=21, num_dst=4)
    conv_b = QSVConv((-1, -1), 3, heads=2)
    xs, xd = torch.randn(6, 16), torch.randn(4, 12)
    out_b = conv_b((xs, xd), ei_b)
    assert out_b.shape == (4, 6)
    ref_b, _ = qsv_conv_reference(conv_b.eval(), (xs, xd), ei_b)
    close(out_b, ref_b)
    # Lazy with given quaternions.
    conv_q = QSVConv(-1, 4, heads=2, quat_source="given")
    _, quat, _ = inputs(N, 16, 2)
    assert conv_q(x, ei, quat=quat).shape == (N, 8)


@pytest.mark.parametrize("in_channels,heads", [(34, 2), (5, 1), (29, 4), (1, 3)])
def test_any_input_width_is_zero_padded(in_channels, heads, random_graph):
    N, ei = random_graph.num_nodes, random_graph.edge_index
    conv = make_conv(in_channels, 3, heads)
    pad = -(-in_channels // (4 * heads)) * 4 * heads
    assert conv.weight.shape == (heads, pad // heads, 3)
    x, _, _ = inputs(N, in_channels, heads, seed=5)
    x.requires_grad_()
    out = conv(x, ei)
    ref, _ = qsv_conv_reference(conv, x, ei)
    close(out, ref)
    # The padding is zeros: the same as feeding the padded features to a layer
    # whose quaternion and skip maps see only the real channels.
    wide = torch.nn.functional.pad(x, (0, pad - in_channels))
    assert torch.equal(conv.pad_source(x), wide)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="layer was built for"):
        conv(torch.randn(N, pad + 1), ei)


@pytest.mark.parametrize("in_channels", [-1, (-1, -1)])
def test_lazy_layer_loads_a_state_dict_before_its_first_call(in_channels, random_graph):
    N, ei = random_graph.num_nodes, random_graph.edge_index
    x = torch.randn(N, 34)
    src = QSVConv(in_channels, 4, heads=2)
    expected = src(x, ei) if isinstance(in_channels, int) else src((x, x), ei)
    fresh = QSVConv(in_channels, 4, heads=2)
    fresh.load_state_dict(src.state_dict())
    assert fresh.weight.shape == src.weight.shape == (2, 20, 4)
    got = fresh(x, ei) if isinstance(in_channels, int) else fresh((x, x), ei)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # An uninitialised state dict makes a materialised layer lazy again (as in PyG).
    again = QSVConv(34, 4, heads=2)
    again.load_state_dict(QSVConv(-1, 4, heads=2).state_dict(), strict=False)
    assert isinstance(again.weight, UninitializedParameter)


# ----------------------------------------------- degenerate graphs / inputs
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_isolated_targets_get_no_message(routing, transport):
    N = 5
    ei = torch.tensor([[1, 2, 3, 0], [0, 0, 2, 2]])  # nodes 1, 3, 4 receive nothing
    conv = make_conv(8, 3, 2, routing=routing, transport=transport)
    x, quat, pos = inputs(N, 8, 2, seed=22)
    x.requires_grad_()
    out = conv(x, ei, quat=quat, pos=pos)
    assert torch.isfinite(out).all()
    root = conv.lin_skip(x) + conv.bias
    close(out[[1, 3, 4]], root[[1, 3, 4]])
    assert not torch.allclose(out[[0, 2]], root[[0, 2]])
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_empty_graph(routing):
    N = 5
    conv = make_conv(8, 3, 2, routing=routing)
    x, quat, pos = inputs(N, 8, 2, seed=23)
    ei = torch.empty(2, 0, dtype=torch.long)
    for q in (None, quat):
        out, (ei_out, alpha) = conv(x, ei, quat=q, pos=pos, return_attention_weights=True)
        assert alpha.shape == (0, 2) and ei_out.shape == (2, 0)
        close(out, conv.lin_skip(x) + conv.bias)
    # Batched, and with self-loops only.
    xb, _, _ = inputs(N, 8, 2, seed=24, batch=2)
    close(conv(xb, ei, pos=pos), conv.lin_skip(xb) + conv.bias)
    conv.add_self_loops = True
    out = conv(x, ei, quat=quat, pos=pos)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_zero_nodes(routing):
    conv = make_conv(8, 3, 2, routing=routing)
    x = torch.empty(0, 8)
    ei = torch.empty(2, 0, dtype=torch.long)
    out = conv(x, ei, quat=torch.empty(0, 2, 4), pos=torch.empty(0, 3))
    assert out.shape == (0, 6)
    out = conv(x, ei, pos=torch.empty(0, 3))
    assert out.shape == (0, 6)


def test_zero_norm_quaternions_become_identity(random_graph, knn_graph):
    for graph in (random_graph, knn_graph):
        for source in ("given", "composed"):
            conv = make_conv(16, 3, 2, quat_source=source)
            x, quat, _ = inputs(graph.num_nodes, 16, 2, seed=25)
            q0 = quat.clone()
            q0[2] = 0.0
            q0[4, 1] = 0.0
            qi = q0.clone()
            qi[2] = identity_quaternion(2)
            qi[4, 1] = identity_quaternion()
            q0.requires_grad_()
            out = conv(x, graph.edge_index, quat=q0)
            assert torch.isfinite(out).all()
            close(out, conv(x, graph.edge_index, quat=qi))
            out.sum().backward()
            assert torch.isfinite(q0.grad).all()


# --------------------------------------------------- edge_index formats
@pytest.mark.parametrize("graph_kind", ["random", "knn"])
def test_edge_index_class(graph_kind, random_graph, knn_graph):
    from torch_geometric import EdgeIndex
    graph = random_graph if graph_kind == "random" else knn_graph
    N = graph.num_nodes
    conv = make_conv(16, 3, 2, add_self_loops=False)
    x, quat, _ = inputs(N, 16, 2, seed=26)
    out, (_, alpha) = conv(x, graph.edge_index, quat=quat, return_attention_weights=True)
    ei = EdgeIndex(graph.edge_index, sparse_size=(N, N))
    out2, (ei2, alpha2) = conv(x, ei, quat=quat, return_attention_weights=True)
    close(out2, out)
    close(alpha2, alpha)
    ei_sorted, perm = ei.sort_by("col")
    out3, (_, alpha3) = conv(x, ei_sorted, quat=quat, return_attention_weights=True)
    close(out3, out)
    close(alpha3, alpha[perm])
    out4 = conv(x, ei, return_attention_weights=False)
    close(out4, conv(x, graph.edge_index))


@pytest.mark.parametrize("layout", ["csr", "coo"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_torch_sparse_adjacency(routing, layout, random_graph):
    from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor
    N, ei = random_graph.num_nodes, random_graph.edge_index
    conv = make_conv(16, 3, 2, routing=routing)
    x, quat, pos = inputs(N, 16, 2, seed=27)
    if layout == "csr":
        adj = to_torch_csc_tensor(ei, size=(N, N)).t()
    else:
        # PyG's generated propagate reads .indices(): the COO must be coalesced.
        adj = to_torch_coo_tensor(ei, size=(N, N)).t().coalesce()
    out, (_, alpha) = conv(x, ei, quat=quat, pos=pos, return_attention_weights=True)
    out_s = conv(x, adj, quat=quat, pos=pos)
    close(out_s, out)
    res = conv(x, adj, quat=quat, pos=pos, return_attention_weights=True)
    close(res[0], out)
    adj_alpha, alpha_s = res[1]
    assert adj_alpha.is_sparse or adj_alpha.layout in (torch.sparse_csr, torch.sparse_coo)
    assert adj_alpha.size() == (N, N, 2)
    assert alpha_s.shape == (ei.size(1), 2)
    dense = torch.zeros(N, N, 2)
    dense[ei[1], ei[0]] = alpha  # [target, source, head]
    close(adj_alpha.to_dense(), dense)
    # Features as quaternion source works too.
    close(conv(x, adj, pos=pos), conv(x, ei, pos=pos))


def test_torch_sparse_with_self_loops_raises(random_graph):
    from torch_geometric.utils import to_torch_csc_tensor
    N = random_graph.num_nodes
    adj = to_torch_csc_tensor(random_graph.edge_index, size=(N, N)).t()
    with pytest.raises(ValueError, match="add_self_loops"):
        QSVConv(8, 4, add_self_loops=True)(torch.randn(N, 8), adj)


# ---------------------------------------------------------- module basics
def test_reset_parameters():
    conv = QSVConv(16, 8, heads=2, beta_init=2.5)
    assert torch.allclose(conv.beta, torch.full((2, ), 2.5))
    with torch.no_grad():
        conv.log_beta.add_(1.0)
        conv.bias.add_(1.0)
        conv.lin_quat.bias.add_(1.0)
    w0 = conv.weight.detach().clone()
    s0 = conv.lin_skip.weight.detach().clone()
    conv.reset_parameters()
    assert torch.allclose(conv.beta, torch.full((2, ), 2.5))
    assert not torch.equal(conv.weight, w0)
    assert not torch.equal(conv.lin_skip.weight, s0)
    assert torch.equal(conv.bias, torch.zeros(16))
    assert torch.equal(conv.lin_quat.bias.view(2, 4), identity_quaternion(2))


def test_repr():
    assert repr(QSVConv(16, 8, heads=2)) == \
        "QSVConv(16, 8, heads=2, routing=learned, transport=sandwich)"
    assert repr(QSVConv((8, 4), 3, routing="abs", transport="identity")) == \
        "QSVConv((8, 4), 3, heads=1, routing=abs, transport=identity)"


def test_learn_beta():
    conv = QSVConv(8, 4, heads=2, beta_init=0.5)
    assert "log_beta" in dict(conv.named_parameters())
    assert (conv.beta > 0).all()
    fixed = QSVConv(8, 4, heads=2, beta_init=0.5, learn_beta=False)
    assert "log_beta" not in dict(fixed.named_parameters())
    assert "log_beta" in dict(fixed.named_buffers())
    assert "log_beta" in fixed.state_dict()
    assert all(p is not fixed.log_beta for p in fixed.parameters())
    assert torch.allclose(fixed.beta, torch.full((2, ), 0.5))
    assert (fixed.beta > 0).all()
    # β stays positive whatever the (log-)parameter becomes.
    with torch.no_grad():
        conv.log_beta.fill_(-50.0)
    assert (conv.beta > 0).all()


def test_learned_beta_gets_gradient(random_graph):
    conv = QSVConv(8, 4)
    conv(torch.randn(random_graph.num_nodes, 8), random_graph.edge_index).sum().backward()
    assert conv.log_beta.grad is not None


# ------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("fused_path", ["never", "auto"])
@pytest.mark.parametrize("case", ["learned_given", "geometric_features", "batched",
                                  "batched_shared"])
def test_compile_no_graph_breaks(case, fused_path, knn_graph):
    import torch._dynamo
    torch._dynamo.reset()
    routing = "geometric" if case == "geometric_features" else "learned"
    conv = make_conv(16, 3, 2, routing=routing, fused_path=fused_path)
    N = knn_graph.num_nodes
    x, quat, pos = inputs(N, 16, 2, seed=28,
                          batch=2 if case.startswith("batched") else None)
    q = None if case == "geometric_features" else quat  # [B, N, H, 4] when batched
    q = q[0] if case == "batched_shared" else q  # a field shared by the batch
    expected = conv(x, knn_graph.edge_index, quat=q, pos=pos)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    out = compiled(x, knn_graph.edge_index, quat=q, pos=pos)
    close(out, expected)


@pytest.mark.slow
def test_compile_inductor(knn_graph):
    import torch._dynamo
    torch._dynamo.reset()
    conv = make_conv(16, 3, 2, fused_path="auto")
    x, quat, _ = inputs(knn_graph.num_nodes, 16, 2, seed=29)
    expected = conv(x, knn_graph.edge_index, quat=quat)
    compiled = torch.compile(conv, fullgraph=True)
    close(compiled(x, knn_graph.edge_index, quat=quat), expected)


# --------------------------------------------------------------- explainer
class _TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = QSVConv(8, 4, heads=2, add_self_loops=True)
        self.conv2 = QSVConv(8, 3, heads=1, routing="abs")

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv2(x, edge_index)


@pytest.mark.parametrize("index", [None, 2])
def test_attention_explainer(index, knn_graph, monkeypatch):
    from torch_geometric.explain import AttentionExplainer, Explainer
    torch.manual_seed(0)
    model = _TwoLayer().eval()
    explainer = Explainer(
        model=model,
        algorithm=AttentionExplainer(),
        explanation_type="model",
        edge_mask_type="object",
        model_config=dict(mode="multiclass_classification", task_level="node",
                          return_type="raw"),
    )
    x = torch.randn(knn_graph.num_nodes, 8)
    # The explainer's hooks must force message passing so that the attention
    # weights can be read.
    explanation = explainer(x, knn_graph.edge_index, index=index)
    E = knn_graph.num_edges
    assert explanation.edge_mask.shape == (E, )
    assert (explanation.edge_mask > 0).any()
    assert explanation.edge_mask.min() >= 0 and explanation.edge_mask.max() <= 1
    # Hooks are removed afterwards: the fast path is back.
    calls = spy_fast(model.conv2, monkeypatch)
    model(x, knn_graph.edge_index)
    assert len(calls) == 1


# ---------------------------------------------------------------- to_hetero
def test_to_hetero():
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    class GNN(torch.nn.Module):
        def __init__(self, add_self_loops=False):
            super().__init__()
            self.conv1 = QSVConv((-1, -1), 4, heads=2, add_self_loops=add_self_loops)
            self.conv2 = QSVConv(8, 3, heads=1, routing="abs")

        def forward(self, x, edge_index):
            x = self.conv1(x, edge_index).relu()
            return self.conv2(x, edge_index)

    data = HeteroData()
    data["paper"].x = torch.randn(5, 8)
    data["author"].x = torch.randn(4, 16)
    data["paper", "cites", "paper"].edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    data["author", "writes", "paper"].edge_index = torch.tensor([[0, 1, 2, 3, 3],
                                                                 [0, 0, 1, 2, 4]])
    data["paper", "rev_writes", "author"].edge_index = torch.tensor([[0, 0, 1, 2, 4],
                                                                     [0, 1, 2, 3, 3]])
    model = GNN()
    assert hasattr(model.conv1, "add_self_loops")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hetero = to_hetero(model, data.metadata(), aggr="sum")
        out = hetero(data.x_dict, data.edge_index_dict)
    assert out["paper"].shape == (5, 3) and out["author"].shape == (4, 3)
    assert all(torch.isfinite(v).all() for v in out.values())
    with pytest.raises(ValueError, match="add_self_loops"):
        to_hetero(GNN(add_self_loops=True), data.metadata(), aggr="sum")


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(in_channels=0, out_channels=4), "in_channels must be a positive integer"),
    (dict(in_channels=-2, out_channels=4), "in_channels must be a positive integer"),
    (dict(in_channels=(8, 0), out_channels=4), "target in_channels"),
    (dict(in_channels=8, out_channels=4, routing="dot"),
     "routing='dot'.*'learned', 'abs', 'uniform', 'geometric'"),
    (dict(in_channels=8, out_channels=4, transport="rotate"),
     "transport='rotate'.*'sandwich', 'identity'"),
    (dict(in_channels=8, out_channels=4, quat_source="pos"),
     "quat_source='pos'.*'auto', 'features', 'given', 'composed'"),
    (dict(in_channels=8, out_channels=4, fused_path="sometimes"),
     "fused_path='sometimes'.*'auto', 'never'"),
    (dict(in_channels=8, out_channels=4, fused_path="always"),
     "fused_path='always' is not supported: 'auto' takes the fused path"),
    (dict(in_channels=8, out_channels=4, dense_path="sometimes"),
     "dense_path='sometimes'.*'auto', 'always', 'never'"),
    (dict(in_channels=8, out_channels=4, fused_path="never", dense_path="never"),
     "pass fused_path only"),
    (dict(in_channels=8, out_channels=4, beta_init=0.0), "beta_init"),
    (dict(in_channels=8, out_channels=4, beta_init=-1.0), "beta_init"),
    (dict(in_channels=8, out_channels=4, beta_init=math.inf), "beta_init"),
    (dict(in_channels=8, out_channels=4, heads=0), "heads"),
    (dict(in_channels=8, out_channels=0), "out_channels"),
    (dict(in_channels=8, out_channels=4, dropout=1.0), "dropout"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QSVConv(**kwargs)


def test_forward_errors(random_graph):
    N, ei = random_graph.num_nodes, random_graph.edge_index
    x, quat, pos = inputs(N, 8, 2)
    conv = QSVConv(8, 4, heads=2)
    with pytest.raises(ValueError, match="geometric.*pos"):
        QSVConv(8, 4, routing="geometric")(torch.randn(N, 8), ei)
    with pytest.raises(ValueError, match="positions of source and target"):
        geo = QSVConv((8, 8), 4, heads=2, routing="geometric")
        geo((x, x[:3]), ei[:, ei[1] < 3], quat=(quat, quat[:3]), pos=(pos, None))
    bad = x.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite node features"):
        conv(bad, ei)
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite node features"):
        conv(bad, ei, quat=quat)
    with pytest.raises(ValueError, match="non-finite node features"):
        QSVConv((8, 8), 4, heads=2)((x, bad[:4]), ei[:, ei[1] < 4])
    bq = quat.clone()
    bq[0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite source quaternions"):
        conv(x, ei, quat=bq)
    bq[0, 1, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        conv(x, ei, quat=bq)
    for shape in [(N, 2, 3), (N, 3, 4), (N, 2, 4, 1), (N, ), (N, 8)]:
        with pytest.raises(ValueError, match="quaternions must have shape"):
            conv(x, ei, quat=torch.randn(*shape))
    with pytest.raises(ValueError, match="rows"):
        conv(x, ei, quat=torch.randn(N + 1, 2, 4))
    with pytest.raises(ValueError, match="channels"):
        conv(torch.randn(N, 16), ei)
    with pytest.raises(ValueError, match="node features of shape"):
        conv(torch.randn(N), ei)
    # check_finite=False skips the check (and its host sync).
    out = QSVConv(8, 4, heads=2, check_finite=False)(bad, ei)
    assert not torch.isfinite(out).all()
    # The check's fast path is a sum: +inf and -inf together (a NaN sum) are caught,
    # and finite entries whose sum overflows are not mistaken for non-finite ones.
    bad[1, 2], bad[2, 3] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match="non-finite node features"):
        conv(bad, ei)
    from qsv_pyg.nn.checks import check_finite as _check_finite
    big = torch.full((64, 8), 3e38)
    assert not torch.isfinite(big.sum())
    _check_finite(big, "node features")  # finite entries: no error
    _check_finite(big.half().clamp(max=6e4), "node features")
    with pytest.raises(ValueError, match="non-finite x"):
        _check_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64), "x")


def test_cpu_autocast_keeps_the_fast_path(knn_graph, monkeypatch):
    conv = make_conv(16, 3, 2)
    x, quat, _ = inputs(knn_graph.num_nodes, 16, 2, seed=31, batch=2)
    calls = spy_fast(conv, monkeypatch)
    ref = conv(x, knn_graph.edge_index, quat=quat[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x, knn_graph.edge_index, quat=quat[0])
    assert calls == ["attend_shared"] * 2 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.1)


@pytest.fixture(params=["cpp", "torch"])
def kernel(request, monkeypatch):
    """Run a test with the C++ CPU kernel and with the PyTorch implementation."""
    import qsv_pyg.nn._cpu_ext as cpu_ext
    if request.param == "torch":
        monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "0")
    elif cpu_ext.cpu_kernel() is None:
        pytest.skip("C++ kernel unavailable")
    return request.param


@pytest.mark.parametrize("quat_mode", ["features", "given"])
@pytest.mark.parametrize("graph_kind", ["random", "bipartite", "isolated", "batched",
                                        "batched_field"])
def test_gradients_match_reference(graph_kind, quat_mode, kernel, make_random_graph):
    """Output and every gradient of the fast path equal the literal per-edge
    reference (float32, 1e-5), for each implementation of the operator."""
    H, C = 2, 8
    n_src, n_dst = (9, 5) if graph_kind == "bipartite" else (9, 9)
    ei = make_random_graph(n_src, 25, seed=41, num_dst=n_dst) \
        if graph_kind == "bipartite" else make_random_graph(n_src, 25, seed=41)
    if graph_kind == "isolated":
        ei = ei[:, ei[1] % 3 != 0]  # targets 0, 3, 6 receive nothing
    bip = graph_kind == "bipartite"
    conv = make_conv((C, 6) if bip else C, 3, H, quat_source=quat_mode)
    B = 3 if graph_kind.startswith("batched") else None
    shared = graph_kind == "batched_field"  # one field for the whole batch
    x, quat, _ = inputs(n_src, C, H, seed=42, batch=B)
    x.requires_grad_()
    x_dst = torch.randn(n_dst, 6, generator=gen(43), requires_grad=True) if bip else None
    q = None
    if quat_mode == "given":
        q = (quat[0] if shared else quat).detach().requires_grad_()
        q_dst = torch.randn(n_dst, H, 4, generator=gen(44), requires_grad=True) if bip \
            else None
    leaves = [t for t in (x, x_dst, q, q_dst if bip and q is not None else None)
              if t is not None] + list(conv.parameters())

    def call(layer_fn):
        if B is None:
            xx = (x, x_dst) if bip else x
            qq = (q, q_dst) if bip and q is not None else q
            return layer_fn(xx, qq)
        return torch.stack([layer_fn(x[b], q if q is None or shared else q[b])
                            for b in range(B)])

    # Batched input goes through the batched path in one call; the reference is per item.
    out = conv(x, ei, quat=q) if B else call(lambda xx, qq: conv(xx, ei, quat=qq))
    ref = call(lambda xx, qq: qsv_conv_reference(conv, xx, ei, quat=qq)[0])
    w = torch.randn(ref.shape, generator=gen(45))
    g = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves, allow_unused=True)
    close(out, ref)
    for a, b in zip(g, g_ref):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            close(a, b)


@pytest.mark.parametrize("batched", [False, True])
def test_compiled_graph_calls_the_registered_operator(batched, random_graph):
    import torch._dynamo
    torch._dynamo.reset()
    conv = make_conv(16, 3, 2)
    x, quat, _ = inputs(random_graph.num_nodes, 16, 2, seed=32, batch=2 if batched else None)
    q = quat[0] if batched else quat
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    compiled = torch.compile(conv, fullgraph=True, backend=backend)
    close(compiled(x, random_graph.edge_index, quat=q), conv(x, random_graph.edge_index, quat=q))
    assert torch.ops.qsv_pyg.attend.default in targets or torch.ops.qsv_pyg.attend in targets


# ------------------------------------------- attention dropout on the fast path
def test_dropout_fast_path_uses_the_returned_weights(random_graph, monkeypatch):
    """Training with attention dropout stays on the operator, and its output is the
    weighted sum of the (dropped, rescaled) weights it returns."""
    conv = make_conv(8, 8, 1, transport="identity", dropout=0.4).train()
    fast = spy_fast(conv, monkeypatch)
    x, quat, _ = inputs(random_graph.num_nodes, 8, 1, seed=41)
    ei = random_graph.edge_index
    torch.manual_seed(3)
    out, (ei_out, alpha) = conv(x, ei, quat=quat, return_attention_weights=True)
    assert fast == ["attend_shared"]
    dropped = alpha == 0
    assert 0.2 < dropped.float().mean() < 0.6
    kept = alpha[~dropped]
    assert torch.isclose(kept.max(), kept.max())  # finite
    z = torch.zeros(random_graph.num_nodes, 8).index_add_(0, ei_out[1], alpha * x[ei_out[0]])
    want = z @ conv.weight[0] + conv.lin_skip(x) + conv.bias
    close(out, want)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dropout_fast_path_is_unbiased(transport, knn_graph):
    """The mean output over many dropout masks is the output without dropout."""
    conv = make_conv(8, 4, 2, transport=transport, dropout=0.5, dtype=torch.float64)
    x, _, _ = inputs(knn_graph.num_nodes, 8, 2, dtype=torch.float64, seed=42)
    with torch.no_grad():
        want = conv.eval()(x, knn_graph.edge_index)
        conv.train()
        torch.manual_seed(0)
        mean = sum(conv(x, knn_graph.edge_index) for _ in range(3000)) / 3000
    assert (mean - want).abs().max() < 0.1 * want.abs().max()


def test_dropout_fast_path_gradients(random_graph):
    """gradcheck of a training forward with a fixed mask (the seed is reset per call)."""
    conv = make_conv(8, 3, 2, dropout=0.3, dtype=torch.float64).train()
    x, _, _ = inputs(random_graph.num_nodes, 8, 2, dtype=torch.float64, seed=43)
    x.requires_grad_(True)

    def f(x):
        torch.manual_seed(7)
        return conv(x, random_graph.edge_index)

    assert torch.autograd.gradcheck(f, (x, ), eps=1e-6, atol=1e-5)
    torch.manual_seed(7)
    conv(x, random_graph.edge_index).sum().backward()
    assert conv.weight.grad is not None and conv.log_beta.grad is not None


# ------------------------------------------------------------- project_input
def test_project_input_parameters_and_shapes(random_graph):
    """P: in -> heads * C (C = out rounded up to 4), the quaternion map reads P x,
    the per-head weight is C x out, the root weight reads the raw features."""
    conv = QSVConv(1433, 7, heads=8, project_input=True)
    c = 8
    want = (1433 * 8 * c             # P
            + 8 * c * 8 * 4 + 8 * 4  # quaternion map on P x (+ bias)
            + 8 * c * 7              # W_h
            + 1433 * 8 * 7           # root weight
            + 8 * 7 + 8)             # bias, log_beta
    assert sum(p.numel() for p in conv.parameters()) == want
    assert conv.lin_proj.in_channels == 1433 and conv.lin_quat.in_channels == 8 * c
    assert conv.weight.shape == (8, c, 7)
    assert "project_input=True" in repr(conv)
    x = torch.randn(random_graph.num_nodes, 1433)
    out = conv(x, random_graph.edge_index)
    assert out.shape == (random_graph.num_nodes, 56)
    out.sum().backward()
    assert conv.lin_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("routing", ROUTINGS)
def test_project_input_fast_path_matches_message_passing(routing, knn_graph):
    conv = make_conv(10, 6, 2, routing=routing, project_input=True, dtype=torch.float64)
    x, _, pos = inputs(knn_graph.num_nodes, 10, 2, dtype=torch.float64, seed=44)
    fast = conv(x, knn_graph.edge_index, pos=pos)
    conv.fused_path = "never"
    close(fast, conv(x, knn_graph.edge_index, pos=pos), torch.float64)
    # It is the plain layer applied to P x (with the root weight on the raw x).
    plain = make_conv(16, 6, 2, routing=routing, dtype=torch.float64, root_weight=False)
    with torch.no_grad():
        plain.lin_quat.load_state_dict(conv.lin_quat.state_dict())
        plain.weight.copy_(conv.weight)
        plain.log_beta.copy_(conv.log_beta)
        plain.bias.copy_(conv.bias)
    px = conv.lin_proj(x)
    close(fast, plain(px, knn_graph.edge_index, pos=pos) + conv.lin_skip(x), torch.float64)


def test_project_input_bipartite_and_lazy(make_random_graph):
    ei = make_random_graph(6, 10, seed=5, num_dst=4)
    conv = QSVConv((16, 8), 5, heads=2, project_input=True)
    assert conv.lin_proj is None and conv.lin_proj_src.in_channels == 16
    out = conv((torch.randn(6, 16), torch.randn(4, 8)), ei)
    assert out.shape == (4, 10)
    lazy = QSVConv(-1, 5, heads=2, project_input=True)
    assert lazy(torch.randn(6, 12), make_random_graph(6, 10, seed=6)).shape == (6, 10)
    state = lazy.state_dict()
    again = QSVConv(-1, 5, heads=2, project_input=True)
    again.load_state_dict(state)
    assert again.lin_proj.weight.shape == (16, 12)  # heads * C = 2 * 8


def test_qsv_model_takes_project_input(random_graph):
    from qsv_pyg.nn.models import QSV
    model = QSV(1433, 64, 2, 7, heads=8, project_input=True, add_self_loops=True,
                root_weight=False)
    assert all(conv.project_input for conv in model.convs)
    out = model(torch.randn(random_graph.num_nodes, 1433), random_graph.edge_index)
    assert out.shape == (random_graph.num_nodes, 7)
