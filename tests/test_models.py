"""GraphNet (QSV, attention controls, lattice), its parts, and the model registry."""
from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from qsv_pyg.geometry import LatticeSpec, ShellSpec, build_lattice_hierarchy, build_shell_hierarchy
from qsv_pyg.models import (
    DEFAULT_WIDTHS,
    GraphConvAdapter,
    GraphNet,
    LambertPatchEmbedding,
    QuaternionField,
    available_models,
    build_model,
    make_conv,
    match_width,
    scale_widths,
)
from qsv_pyg.models import zoo
from qsv_pyg.nn import QSVConv
from qsv_pyg.geometry import dense_neighbors

# Exact counts of the default (10-class) models, for the record and to catch drift.
QSV_PARAMS = 600_490
RESNET20_PARAMS = 269_722

# Small configurations: 5 levels, k = 4 (3 within the 4-node innermost level).
SHELLS = dict(shell_sizes=(64, 36, 16, 9, 4), k_cross=4, k_inner=3, heads=2)
LATTICE = dict(lattice_sides=(8, 6, 4, 3, 2), k_cross=4, k_inner=3, heads=2)
WIDTHS = (16, 16, 24, 24, 32)
SMALL = {
    "qsv": dict(SHELLS, widths=WIDTHS),
    "lattice": dict(LATTICE, widths=WIDTHS),
    "attention-gat": dict(SHELLS, qsv_widths=WIDTHS, qsv_heads=2, match_tol=0.25),
    "attention-gatv2": dict(SHELLS, qsv_widths=WIDTHS, qsv_heads=2, match_tol=0.25),
    "attention-transformer": dict(SHELLS, qsv_widths=WIDTHS, qsv_heads=2, match_tol=0.25),
    "resnet20": dict(),
}
CONTROLS = ("attention-gat", "attention-gatv2", "attention-transformer")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, shared cores


@pytest.fixture
def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def small_qsv(**kw) -> GraphNet:
    torch.manual_seed(0)
    return build_model("qsv", **{**SMALL["qsv"], **kw})


def forward_backward(model: nn.Module, images: torch.Tensor, num_classes: int = 10,
                     unused: tuple = ()):
    """Check logits and that every parameter (but names containing ``unused``) gets a grad."""
    logits = model(images)
    assert logits.shape == (images.size(0), num_classes)
    assert torch.isfinite(logits).all()
    loss = logits.logsumexp(-1).mean() + model.auxiliary_loss()
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad and not any(u in name for u in unused):
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name
    return logits


# --------------------------------------------------------------- parameter counts
def test_default_parameter_counts():
    qsv = build_model("qsv")
    n = qsv.num_parameters()
    print(f"\nqsv: {n:,}  widths {qsv.widths}")
    assert n == QSV_PARAMS
    assert abs(n - 570_000) <= 0.10 * 570_000
    assert qsv.widths == DEFAULT_WIDTHS and qsv.sizes == (256, 144, 64, 36, 16)
    assert "0.600M" in qsv.summary() and "qsv on shells" in qsv.summary()
    assert qsv.heads == 16  # the paper's 16 heads per shell

    for name in CONTROLS:
        ctl = build_model(name)
        m = ctl.num_parameters()
        print(f"{name}: {m:,} ({(m - n) / n:+.2%})  widths {ctl.widths}")
        assert abs(m - n) <= 0.05 * n, name
        assert ctl.heads == zoo.CONTROL_HEADS  # the controls keep their own heads
        assert all(w % ctl.heads == 0 for w in ctl.widths)

    lattice = build_model("lattice")
    print(f"lattice: {lattice.num_parameters():,}")
    assert lattice.num_parameters() == n
    assert abs(build_model("resnet20").num_parameters() - 270_000) <= 0.02 * 270_000


def test_control_width_solving_is_memoised():
    zoo._solve_widths.cache_clear()
    first = build_model("attention-gat", **SMALL["attention-gat"])
    misses = zoo._solve_widths.cache_info().misses
    second = build_model("attention-gat", **SMALL["attention-gat"])
    assert zoo._solve_widths.cache_info().misses == misses
    assert zoo._solve_widths.cache_info().hits >= 1
    assert first.widths == second.widths
    assert first is not second and first.embed.proj.weight is not second.embed.proj.weight


def test_controls_match_the_qsv_reference_built_with_the_same_overrides():
    ref = build_model("qsv", **SMALL["qsv"]).num_parameters()
    for name in CONTROLS:
        n = build_model(name, **SMALL[name]).num_parameters()
        assert abs(n - ref) <= 0.25 * ref, name
    # Explicit widths skip the matching.
    gat = build_model("attention-gat", **SHELLS, widths=(8, 8, 8, 8, 8))
    assert gat.widths == (8, 8, 8, 8, 8)


# ------------------------------------------------------------------ forward passes
@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_registered_model_forward_backward(name, images):
    assert name in available_models()
    torch.manual_seed(0)
    forward_backward(build_model(name, **SMALL[name]), images)


def test_registry_covers_all_models():
    assert set(available_models()) >= set(SMALL)


def test_num_classes(images):
    model = build_model("qsv", num_classes=7, **SMALL["qsv"])
    forward_backward(model, images, num_classes=7)
    gat = build_model("attention-gat", num_classes=7, **SMALL["attention-gat"])
    assert gat(images).shape == (2, 7)


@pytest.mark.parametrize("routing", ["learned", "abs", "uniform", "geometric"])
@pytest.mark.parametrize("transport", ["sandwich", "identity"])
def test_routing_transport_ablations(routing, transport, images):
    model = small_qsv(routing=routing, transport=transport)
    unused = ()
    if routing in ("uniform", "geometric"):
        unused += ("log_beta",) if routing == "uniform" else ()
        # No routing by alignment and no rotation: the field plays no part.
        unused += ("fields.",) if transport == "identity" else ()
    forward_backward(model, images, unused=unused)
    for conv in model.qsv_convs().values():
        assert conv.routing == routing and conv.transport == transport


@pytest.mark.parametrize("source,conv_source,has_field", [
    ("field", "given", True), ("features", "features", False), ("composed", "composed", True),
    ("both", "composed", True)])
def test_quat_sources(source, conv_source, has_field, images):
    if source == "both":  # the old spelling of "composed"
        with pytest.warns(DeprecationWarning, match="'composed'"):
            model = small_qsv(quat_source=source)
        assert model.qsv_options["quat_source"] == "composed"
    else:
        model = small_qsv(quat_source=source)
    forward_backward(model, images)
    assert all(c.quat_source == conv_source for c in model.qsv_convs().values())
    assert (model.fields is not None) == has_field
    assert bool(model.sphere_parameters()) == has_field


@pytest.mark.parametrize("geometry", ["qsv", "lattice"])
def test_geometric_routing_positions(geometry, images):
    model = build_model(geometry, **SMALL[geometry], routing="geometric")
    forward_backward(model, images)
    pos = [getattr(model, f"pos_{s}") for s in range(5)]
    if geometry == "qsv":  # unit directions on every shell
        assert all(torch.allclose(p.norm(dim=-1), torch.ones(p.size(0))) for p in pos)
    else:  # raw lattice coordinates
        assert all(p.shape[1] == 2 for p in pos)
        assert torch.equal(pos[0], build_lattice_hierarchy(
            LatticeSpec(LATTICE["lattice_sides"]), 4, 3).pos[0])


def test_frozen_field(images):
    model = small_qsv(frozen_field=True, beta_prior_weight=0.0)  # no β prior term
    init = [f.quaternions.clone() for f in model.fields]
    forward_backward(model, images)
    params = {id(p) for p in model.parameters()}
    for f, q in zip(model.fields, init):
        assert f.backend == "frozen"
        assert id(f.quaternions) not in params
        assert any(b is f.quaternions for b in model.buffers())
        assert torch.equal(f.quaternions, q)
    assert model.sphere_parameters() == []
    assert model.auxiliary_loss().item() == 0.0
    assert any(k.startswith("fields.0") for k in model.state_dict())


def test_fixed_beta_and_beta_prior(images):
    model = small_qsv(learn_beta=False, beta_init=2.0)
    forward_backward(model, images)
    params = {id(p) for p in model.parameters()}
    for conv in model.qsv_convs().values():
        assert id(conv.log_beta) not in params
        assert torch.allclose(conv.beta, torch.full((2,), 2.0))

    model = small_qsv(beta_prior_weight=0.5, beta_prior_centre=1.0, beta_init=2.0,
                      repulsion_weight=0.0)
    n_heads = 2 * len(model.qsv_convs())
    expected = 0.5 * n_heads * (torch.log(torch.tensor(2.0)) ** 2)
    assert torch.allclose(model.auxiliary_loss(), expected)
    model.auxiliary_loss().backward()
    assert all(c.log_beta.grad is not None and (c.log_beta.grad > 0).all()
               for c in model.qsv_convs().values())
    assert small_qsv(beta_prior_weight=0.5, beta_prior_centre=1.0,
                     repulsion_weight=0.0).auxiliary_loss() == 0


def test_beta_prior_centre_does_not_follow_beta_init(images):
    # The paper's warm start at β₀ = 5 decays back to the prior's fixed point,
    # so the default centre (0.79) must not move with beta_init.
    import math
    for beta_init in (1.0, 5.0):
        model = small_qsv(beta_init=beta_init)
        assert model.log_beta_prior_centre == pytest.approx(math.log(0.79))
        assert model.qsv_options["beta_prior_weight"] > 0  # on by default
    model = small_qsv(beta_init=5.0, repulsion_weight=0.0)
    model.auxiliary_loss().backward()
    assert all((c.log_beta.grad > 0).all() for c in model.qsv_convs().values())


def test_betas_returns_every_qsv_layer():
    model = small_qsv(within_rounds=3)
    betas = model.betas()
    assert list(betas) == ["cross0", "cross1", "cross2", "cross3",
                           "within0", "within1", "within2"]
    assert all(b.shape == (2,) and not b.requires_grad for b in betas.values())
    gat = build_model("attention-gat", **SMALL["attention-gat"])
    assert gat.betas() == {} and gat.sphere_parameters() == []
    assert gat.auxiliary_loss().item() == 0.0


def test_shells_and_lattice_have_the_same_node_counts():
    assert build_shell_hierarchy(ShellSpec(), 8, 8).sizes == \
        build_lattice_hierarchy(LatticeSpec(), 8, 8).sizes
    small_shells, small_lattice = small_qsv(), build_model("lattice", **SMALL["lattice"])
    assert small_shells.sizes == small_lattice.sizes == (64, 36, 16, 9, 4)
    assert small_shells.geometry == "shells" and small_lattice.geometry == "lattice"
    assert small_shells.num_parameters() == small_lattice.num_parameters()


# ------------------------------------------------------------------------- graphs
def _record_conv_inputs(model, monkeypatch):
    """Record the edge_index every inner conv is called with, in call order."""
    seen = []
    for module in model.modules():
        if isinstance(module, GraphConvAdapter):
            conv = module.conv
            original = conv.forward

            def spy(x, edge_index, *args, _original=original, **kwargs):
                seen.append(edge_index)
                return _original(x, edge_index, *args, **kwargs)

            monkeypatch.setattr(conv, "forward", spy)
    return seen


@pytest.mark.parametrize("name", CONTROLS)
def test_controls_see_exactly_the_qsv_edges(name, images, monkeypatch):
    qsv = small_qsv()
    ctl = build_model(name, **SMALL[name])
    for key, edges in qsv.graph_buffers().items():
        assert torch.equal(edges, ctl.graph_buffers()[key]), key

    qsv_seen = _record_conv_inputs(qsv, monkeypatch)
    ctl_seen = _record_conv_inputs(ctl, monkeypatch)
    qsv(images)
    ctl(images)
    assert len(qsv_seen) == len(ctl_seen) == 6
    n_src = list(qsv.sizes[:-1]) + [qsv.sizes[-1]] * 2
    n_dst = list(qsv.sizes[1:]) + [qsv.sizes[-1]] * 2
    for edges, flat, ns, nd in zip(qsv_seen, ctl_seen, n_src, n_dst):
        # QSV gets the [2, E] graph itself (batched static-graph mode) ...
        assert edges.shape[0] == 2 and int(edges[1].max()) < nd
        # ... the control the two batch copies, shifted by (N_src, N_dst).
        shifted = edges + torch.tensor([[ns], [nd]])
        assert torch.equal(flat, torch.cat([edges, shifted], dim=1))


def test_flattened_edge_index_is_cached_per_batch_size():
    adapter = GraphConvAdapter(make_conv("gat", 8, 8, 8, 2))
    edges = torch.tensor([[0, 1, 2, 2], [0, 0, 1, 1]])
    flat2 = adapter.flat_edge_index(edges, 2, 3, 2)
    assert torch.equal(flat2, torch.tensor([[0, 1, 2, 2, 3, 4, 5, 5],
                                            [0, 0, 1, 1, 2, 2, 3, 3]]))
    assert adapter.flat_edge_index(edges, 2, 3, 2) is flat2  # not rebuilt
    flat3 = adapter.flat_edge_index(edges, 3, 3, 2)
    assert flat3.shape == (2, 12) and adapter.flat_edge_index(edges, 2, 3, 2) is flat2
    # A different graph tensor with the same values is a different cache entry.
    assert adapter.flat_edge_index(edges.clone(), 2, 3, 2) is not flat2
    # Values written behind the version counter are noticed (the graph cache
    # compares a CPU hit with its copy), and casting the module keeps it right.
    edges.data[0, 0] = 1
    adapter.to(torch.float64)
    assert torch.equal(adapter.flat_edge_index(edges, 2, 3, 2),
                       torch.tensor([[1, 1, 2, 2, 4, 4, 5, 5], [0, 0, 1, 1, 2, 2, 3, 3]]))


def test_graphs_are_buffers(images):
    model = small_qsv(routing="geometric")
    state = model.state_dict()
    buffers = dict(model.named_buffers())
    for key in ["cross_edges_0", "cross_edges_3", "inner_edges", "pos_0",
                "repulsion_nbrs_0", "embed.grid"]:
        assert key in state and key in buffers, key
    assert not any(n.endswith("edges") for n, _ in model.named_parameters())

    # .to() casts positions but keeps the graphs integral; a reload reproduces outputs.
    double = copy.deepcopy(model).to(torch.float64)
    assert double.inner_edges.dtype == torch.long and double.pos_0.dtype == torch.float64
    assert double(images.double()).dtype == torch.float64
    clone = small_qsv(routing="geometric")
    clone.load_state_dict(state)
    torch.testing.assert_close(clone(images), model(images))


def test_fast_path_is_used_and_matches_message_passing(images, monkeypatch):
    model = small_qsv()
    for key, edges in model.graph_buffers().items():
        s = int(key.rsplit("_", 1)[1]) + 1 if key.startswith("cross") else -1
        assert dense_neighbors(edges, model.sizes[s]) is not None, key

    calls = []
    original = QSVConv.choose_path

    def spy(conv, *args, **kwargs):
        path = original(conv, *args, **kwargs)
        if path != "message_passing":
            calls.append(conv)
        return path

    monkeypatch.setattr(QSVConv, "choose_path", spy)
    out = model(images)
    assert len(calls) == len(model.qsv_convs()) == 6

    scatter = copy.deepcopy(model)
    for conv in scatter.qsv_convs().values():
        conv.fused_path = "never"
    calls.clear()
    ref = scatter(images)
    assert calls == []
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    out.square().sum().backward()
    ref.square().sum().backward()
    grads = dict(scatter.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- quaternion field
def test_repulsion_is_sign_invariant_and_prefers_spread_fields():
    field = QuaternionField(50, heads=3, seed=0)
    nbrs = torch.randint(0, 50, (50, 6), generator=torch.Generator().manual_seed(1))
    loss = field.repulsion(nbrs)
    loss.backward()
    assert field.quaternions.grad is not None
    with torch.no_grad():
        signs = torch.where(torch.rand(50, 3, 1) < 0.5, -1.0, 1.0)
        field.quaternions.mul_(signs)
    torch.testing.assert_close(field.repulsion(nbrs), loss)

    clustered = QuaternionField(50, heads=3, init="identity", init_scale=0.05, seed=0)
    assert clustered.repulsion(nbrs) > 0.9 > 0.5 > loss  # uniform: about 1/4


def test_field_initialisation_and_unit_norm():
    a, b = QuaternionField(20, 2, seed=3), QuaternionField(20, 2, seed=3)
    assert torch.equal(a.quaternions, b.quaternions)
    assert a().shape == (20, 2, 4)
    torch.testing.assert_close(a().norm(dim=-1), torch.ones(20, 2))
    near = QuaternionField(20, 2, init="identity", init_scale=0.01, seed=0)
    assert (near()[..., 0] > 0.99).all()
    with pytest.raises(ValueError):
        QuaternionField(20, 2, init="gaussian")
    with pytest.raises(ValueError):
        QuaternionField(0, 2)


def test_sphere_parameters_are_unit_norm_manifold_parameters():
    geoopt = pytest.importorskip("geoopt")
    model = small_qsv()
    sphere = model.sphere_parameters()
    assert len(sphere) == 5
    params = {id(p) for p in model.parameters()}
    for p, n in zip(sphere, model.sizes):
        assert isinstance(p, geoopt.ManifoldParameter)
        assert isinstance(p.manifold, geoopt.Sphere)
        assert p.shape == (n, 2, 4) and id(p) in params
        torch.testing.assert_close(p.norm(dim=-1), torch.ones(n, 2))
    assert all(f.backend == "geoopt" for f in model.fields)


@pytest.mark.parametrize("geoopt_available", [True, False])
def test_field_backends_build_run_and_train(geoopt_available, images, monkeypatch):
    from qsv_pyg.training.optim import build_optimizer

    if geoopt_available:
        pytest.importorskip("geoopt")
    else:  # make `import geoopt` fail
        monkeypatch.setitem(sys.modules, "geoopt", None)
    model = small_qsv()
    expected = "geoopt" if geoopt_available else "plain"
    assert all(f.backend == expected for f in model.fields)
    assert all(type(p) is nn.Parameter for p in model.sphere_parameters()) \
        != geoopt_available
    opt = build_optimizer(model, lr=0.05, weight_decay=0.0,
                          backend="riemannian" if geoopt_available else "projected")
    before = [p.detach().clone() for p in model.sphere_parameters()]
    forward_backward(model, images)
    opt.step()
    for p, q in zip(model.sphere_parameters(), before):
        assert not torch.equal(p, q)
        torch.testing.assert_close(p.norm(dim=-1), torch.ones(p.shape[:-1]))


# ------------------------------------------------------------------------- parts
def test_patch_embedding_samples_pixel_patches():
    # Centres on pixel centres and odd p: every sample lands exactly on a pixel.
    image = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    rows, cols = torch.tensor([2, 5]), torch.tensor([3, 4])
    coords = torch.stack([(2 * cols + 1) / 8 - 1, (2 * rows + 1) / 8 - 1], dim=-1)
    emb = LambertPatchEmbedding(coords, patch_size=3, image_size=8, in_ch=3, dim=27)
    emb.proj = nn.Identity()
    with torch.no_grad():
        emb.node_embed.zero_()
    out = emb(image)
    assert out.shape == (2, 2, 27)
    for n, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        crop = image[:, :, r - 1:r + 2, c - 1:c + 2].reshape(2, -1)
        torch.testing.assert_close(out[:, n], crop)
    with pytest.raises(ValueError):
        emb(torch.zeros(1, 3, 16, 16))


def test_make_conv_kinds():
    x_src, x_dst = torch.randn(5, 16), torch.randn(3, 16)
    edges = torch.tensor([[0, 1, 2, 3, 4, 0], [0, 0, 1, 1, 2, 2]])
    for kind in ("qsv", "gat", "gatv2", "transformer"):
        conv = make_conv(kind, 16, 16, 16, 2)
        assert conv((x_src, x_dst), edges).shape == (3, 16), kind
    assert make_conv("qsv", 16, None, 16, 2, routing="abs").routing == "abs"
    with pytest.raises(TypeError):
        make_conv("gat", 16, 16, 16, 2, routing="abs")
    with pytest.raises(ValueError):
        make_conv("mlp", 16, 16, 16, 2)
    with pytest.raises(ValueError):
        make_conv("gat", 16, 16, 15, 2)


def test_match_width_bisection():
    def build(scale):
        return nn.Linear(max(1, round(100 * scale)), 10)  # 10 * width + 10 params

    model, scale = match_width(build, 1_010, tol=0.01)
    assert sum(p.numel() for p in model.parameters()) == 1_010
    assert model.in_features == 100 and scale == pytest.approx(1.0, abs=0.01)
    model, scale = match_width(build, 5_000, tol=0.01)
    assert abs(sum(p.numel() for p in model.parameters()) - 5_000) <= 50
    with pytest.raises(ValueError, match="within"):
        match_width(lambda s: nn.Linear(10 * max(1, round(s)), 100), 1_500, tol=0.01)
    assert scale_widths((64, 96, 128), 1.0, 16) == (64, 96, 128)
    assert scale_widths((16, 16), 0.01, 8) == (8, 8)


# --------------------------------------------------------------------- bad input
def test_bad_overrides():
    with pytest.raises(TypeError, match="routnig"):
        build_model("qsv", routnig="abs")
    with pytest.raises(TypeError, match="routing"):
        build_model("attention-gat", routing="abs")  # QSV-only
    with pytest.raises(TypeError, match="shell_sizes"):
        build_model("lattice", shell_sizes=(16, 9))
    with pytest.raises(TypeError, match="lattice_sides"):
        build_model("qsv", lattice_sides=(4, 2))
    with pytest.raises(ValueError, match="multiples"):
        build_model("qsv", **SHELLS, widths=(16, 16, 24, 24, 30))
    with pytest.raises(ValueError, match="levels"):
        build_model("qsv", **SHELLS, widths=(16, 16))
    with pytest.raises(ValueError, match="quat_source"):
        build_model("qsv", **SMALL["qsv"], quat_source="bogus")
    with pytest.raises(ValueError, match="routing"):
        build_model("qsv", **SMALL["qsv"], routing="bogus")
    with pytest.raises(ValueError, match="either"):
        build_model("attention-gat", **SHELLS, widths=WIDTHS, qsv_widths=WIDTHS)
    with pytest.raises(ValueError, match="only apply to conv='qsv'"):
        GraphNet(conv="gat", routing="abs")
    with pytest.raises(ValueError):
        build_model("qsv", shell_sizes=(16, 9), k_cross=4, k_inner=8)
    with pytest.raises(ValueError, match="repulsion_weight"):
        build_model("qsv", **SMALL["qsv"], repulsion_weight=-1.0)
