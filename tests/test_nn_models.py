"""qsv_pyg.nn.models.QSV: a BasicGNN of QSVConv layers, drop-in for PyG's GAT."""
from __future__ import annotations

import pytest
import torch
from torch_geometric.nn.models import GAT

from conftest import random_edge_index
from qsv_pyg.nn import QSVConv
from qsv_pyg.nn.models import MODEL_QUAT_SOURCES, QSV
from qsv_pyg.quaternion import hamilton_product, random_unit_quaternion


def _graph(n: int = 12, e: int = 40, c: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g), random_edge_index(n, e, seed=seed)


@pytest.mark.parametrize("jk", [None, "last", "cat", "max", "lstm"])
@pytest.mark.parametrize("norm", [None, "batch_norm", "layer_norm"])
def test_jk_and_norm_like_gat(jk, norm):
    x, ei = _graph()
    torch.manual_seed(0)
    model = QSV(8, 16, 3, out_channels=5, heads=2, jk=jk, norm=norm, dropout=0.2)
    ref = GAT(8, 16, 3, out_channels=5, heads=2, jk=jk, norm=norm, dropout=0.2)
    # Same module structure around the convolutions as PyG's GAT.
    assert [type(m) for m in model.norms] == [type(m) for m in ref.norms]
    assert hasattr(model, "lin") == hasattr(ref, "lin")
    assert hasattr(model, "jk") == hasattr(ref, "jk")
    out = model(x, ei)
    assert out.shape == ref(x, ei).shape == (12, 5)
    out.square().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_equals_a_hand_built_stack():
    """Two layers: conv, relu, conv (heads averaged in the last one)."""
    x, ei = _graph()
    torch.manual_seed(1)
    model = QSV(8, 8, 2, out_channels=3, heads=2, routing="learned").eval()
    c1 = QSVConv(8, 4, heads=2)
    c2 = QSVConv(8, 3, heads=2, concat=False)
    c1.load_state_dict(model.convs[0].state_dict())
    c2.load_state_dict(model.convs[1].state_dict())
    expect = c2(c1(x, ei).relu(), ei)
    torch.testing.assert_close(model(x, ei), expect)
    assert model.convs[1].concat is False and model.convs[0].concat is True


def test_attention_dropout_follows_dropout():
    model = QSV(8, 8, 2, dropout=0.3, heads=2)
    assert all(conv.dropout == 0.3 for conv in model.convs)
    model = QSV(8, 8, 2, dropout=0.3, attention_dropout=0.0, heads=2)
    assert model.dropout.p == 0.3 and all(conv.dropout == 0.0 for conv in model.convs)


def test_hidden_not_divisible_by_heads():
    with pytest.raises(ValueError, match="divisible by the number of heads"):
        QSV(8, 10, 2, heads=4)


@pytest.mark.parametrize("in_channels,hidden,heads", [(7, 10, 2), (3, 6, 3), (5, 5, 1)])
def test_widths_not_multiples_of_four_heads(in_channels, hidden, heads):
    x, ei = _graph(c=in_channels)
    model = QSV(in_channels, hidden, 3, out_channels=4, heads=heads, jk="cat")
    out = model(x, ei)
    assert out.shape == (12, 4)
    out.sum().backward()
    assert model.convs[0].lin_quat.weight.grad is not None


def test_lazy_in_channels():
    x, ei = _graph(c=6)
    model = QSV(-1, 8, 2, out_channels=3, heads=2)
    assert model(x, ei).shape == (12, 3)
    fresh = QSV(-1, 8, 2, out_channels=3, heads=2)
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh.eval()(x, ei), model.eval()(x, ei))


def test_quat_source_validation():
    with pytest.raises(ValueError, match="quat_source='nope' is not supported"):
        QSV(8, 8, 2, quat_source="nope")
    with pytest.raises(ValueError, match="needs num_nodes"):
        QSV(8, 8, 2, quat_source="field")
    with pytest.raises(ValueError, match="num_nodes is only used"):
        QSV(8, 8, 2, num_nodes=5)
    x, ei = _graph()
    with pytest.raises(ValueError, match="needs quat"):
        QSV(8, 8, 2, quat_source="given")(x, ei)
    with pytest.raises(ValueError, match="do not pass quat"):
        QSV(8, 8, 2)(x, ei, quat=torch.randn(12, 4))
    with pytest.raises(ValueError, match="edge weights"):
        QSV(8, 8, 2)(x, ei, edge_weight=torch.rand(ei.size(1)))
    assert set(MODEL_QUAT_SOURCES) == {"features", "field", "given", "composed"}


def test_given_quaternions_only_relative_rotations_matter():
    """Left-multiplying every node quaternion by one rotation changes no r_ij."""
    x, ei = _graph()
    q = random_unit_quaternion(12, 2, generator=torch.Generator().manual_seed(3))
    g = random_unit_quaternion(generator=torch.Generator().manual_seed(4))
    for source in ("given", "composed"):
        torch.manual_seed(0)
        model = QSV(8, 8, 2, out_channels=3, heads=2, quat_source=source).eval()
        out = model(x, ei, quat=q)
        torch.testing.assert_close(model(x, ei, quat=hamilton_product(g, q)), out,
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(x, ei, quat=q.roll(1, 0)), out, atol=1e-3)
    # One quaternion per node shared by the heads: [N, 4].
    model = QSV(8, 8, 2, heads=2, quat_source="given")
    assert model(x, ei, quat=q[:, 0]).shape == (12, 8)


def test_abs_routing_ignores_quaternion_signs():
    x, ei = _graph()
    q = random_unit_quaternion(12, 1, generator=torch.Generator().manual_seed(5))
    flip = torch.where(torch.arange(12) % 3 == 0, -1.0, 1.0).view(12, 1, 1)
    torch.manual_seed(0)
    model = QSV(8, 8, 2, quat_source="given", routing="abs").eval()
    torch.testing.assert_close(model(x, ei, quat=q * flip), model(x, ei, quat=q))
    model = QSV(8, 8, 2, quat_source="given", routing="learned").eval()
    assert not torch.allclose(model(x, ei, quat=q * flip), model(x, ei, quat=q))


def test_learned_field():
    x, ei = _graph()
    model = QSV(8, 8, 2, out_channels=3, heads=2, quat_source="field", num_nodes=12)
    assert model.quat_field.shape == (12, 2, 4)
    model(x, ei).sum().backward()
    assert model.quat_field.grad is not None and model.quat_field.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="pass node_id"):
        model(x[:5], ei[:, (ei < 5).all(0)])
    # A subgraph reads its rows of the field through node_id.
    node_id = torch.tensor([3, 7, 1, 0])
    sub_ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    model.eval()
    out = model(x[node_id], sub_ei, node_id=node_id)
    conv_out = model.convs[1](model.convs[0](x[node_id], sub_ei,
                                             quat=model.quat_field[node_id]).relu(),
                              sub_ei, quat=model.quat_field[node_id])
    torch.testing.assert_close(out, conv_out)
    before = model.quat_field.detach().clone()
    model.reset_parameters()
    assert not torch.equal(before, model.quat_field)
    with pytest.raises(NotImplementedError, match="quat_source='features'"):
        model.inference_per_layer(0, x, ei, 12)


def test_geometric_routing_takes_pos():
    x, ei = _graph()
    pos = torch.randn(12, 3)
    model = QSV(8, 8, 2, routing="geometric", heads=2).eval()
    out = model(x, ei, pos=pos)
    assert not torch.allclose(out, model(x, ei, pos=pos * 3), atol=1e-4)
    with pytest.raises(ValueError, match="needs node positions"):
        model(x, ei)


def test_trimmed_layers_slice_node_inputs():
    """With num_sampled_nodes_per_hop the given quaternions are trimmed too."""
    x, ei = _graph(n=9, e=0)
    # Hop structure: seed nodes 0-2, hop 1 = 3-5, hop 2 = 6-8.
    ei = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    q = random_unit_quaternion(9, 1, generator=torch.Generator().manual_seed(0))
    model = QSV(8, 8, 2, quat_source="given").eval()
    full = model(x, ei, quat=q)
    trimmed = model(x, ei, quat=q, num_sampled_nodes_per_hop=[3, 3, 3],
                    num_sampled_edges_per_hop=[3, 3])
    assert trimmed.size(0) == 6  # the last layer sees the seeds and hop 1
    torch.testing.assert_close(trimmed[:3], full[:3])


def test_to_hetero():
    """PyG's to_hetero traces forward with torch.fx: unused inputs are proxies."""
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    data = HeteroData()
    data["a"].x = torch.randn(6, 8)
    data["b"].x = torch.randn(5, 8)
    ei = torch.stack([torch.arange(12) % 6, torch.arange(12) % 5])
    data["a", "to", "b"].edge_index = ei
    data["b", "rev", "a"].edge_index = ei.flip(0)
    model = to_hetero(QSV(-1, 8, 2, 4, jk="cat"), data.metadata())
    out = model(data.x_dict, data.edge_index_dict)
    assert out["a"].shape == (6, 4) and out["b"].shape == (5, 4)
    out["a"].sum().backward()


# ------------------------------------------- BasicGNN.forward, not a fork
def test_forward_is_basic_gnn_forward(monkeypatch):
    """QSV.forward runs PyG's own BasicGNN.forward (issue 31): the layer loop is
    upstream's; quat / pos reach the layers by a forward pre-hook of each conv,
    during the call only."""
    from torch_geometric.nn.models.basic_gnn import BasicGNN
    calls = []
    orig = BasicGNN.forward

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(BasicGNN, "forward", spy)
    x, ei = _graph()
    q = random_unit_quaternion(12, 2, generator=torch.Generator().manual_seed(6))
    pos = torch.randn(12, 3)
    torch.manual_seed(0)
    model = QSV(8, 8, 2, out_channels=3, heads=2, quat_source="given",
                routing="geometric").eval()
    out = model(x, ei, quat=q, pos=pos)
    assert len(calls) == 1
    expect = model.convs[1](model.convs[0](x, ei, quat=q, pos=pos).relu(), ei, quat=q,
                            pos=pos)
    torch.testing.assert_close(out, expect)
    # Nothing is left behind: a layer called on its own gets no quaternions.
    assert model._layer_inputs.quat is None and model._layer_inputs.pos is None
    with pytest.raises(ValueError, match="needs"):
        model.convs[0](x, ei)
    # ... also after a failing call.
    with pytest.raises(ValueError):
        model(x, ei[:, :3].clone().fill_(99), quat=q, pos=pos)
    assert model._layer_inputs.quat is None and model._layer_inputs.pos is None


def test_deepcopy_and_pickle_keep_the_layer_inputs_hook():
    import copy
    import io
    x, ei = _graph()
    q = random_unit_quaternion(12, 2, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    model = QSV(8, 8, 2, out_channels=3, heads=2, quat_source="given").eval()
    out = model(x, ei, quat=q)
    twin = copy.deepcopy(model)
    assert twin._layer_inputs is not model._layer_inputs
    assert twin.convs[0]._forward_pre_hooks[next(iter(twin.convs[0]._forward_pre_hooks))] \
        is twin._layer_inputs
    torch.testing.assert_close(twin(x, ei, quat=q), out)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x, ei, quat=q), out)


def test_fx_tracing_with_quaternions_is_refused():
    """Under torch.fx tracing the hook's inputs would not be recorded."""
    model = QSV(8, 8, 2, quat_source="given")
    with pytest.raises(NotImplementedError, match="torch.fx"):
        torch.fx.symbolic_trace(model, concrete_args={"edge_weight": None})
