"""The one dispatch point of QSVConv (QSVConv.choose_path, also importable as
qsv_pyg.nn.dispatch.choose_path), tested directly."""
import pytest
import torch
from torch_geometric.nn.conv import MessagePassing

from qsv_pyg.nn import PATHS, QSVConv, choose_path


def call(conv, x, quat=None, edge_index=None):
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]]) if edge_index is None else edge_index
    return choose_path(conv, x, quat, edge_index)


def test_paths_are_named_once():
    assert PATHS == ("attend_shared", "attend_per_item", "message_passing")


@pytest.mark.parametrize("routing", ["learned", "abs", "uniform", "geometric"])
@pytest.mark.parametrize("transport", ["sandwich", "identity"])
def test_every_routing_and_transport_takes_the_operator(routing, transport):
    conv = QSVConv(8, 4, heads=2, routing=routing, transport=transport)
    assert call(conv, torch.randn(3, 8), torch.randn(3, 2, 4)) == "attend_shared"


def test_batch_with_a_shared_field_routes_once():
    conv = QSVConv(8, 4, heads=2)
    assert call(conv, torch.randn(5, 3, 8), torch.randn(3, 2, 4)) == "attend_shared"


def test_batch_with_per_item_quaternions_uses_graph_copies():
    conv = QSVConv(8, 4, heads=2)
    assert call(conv, torch.randn(5, 3, 8), torch.randn(5, 3, 2, 4)) == "attend_per_item"


def test_attention_dropout_takes_the_fast_path():
    """Dropout while training runs on the operator (a per-edge mask); a [B, N, C]
    batch then takes the per-item copies, so every item draws its own mask."""
    conv = QSVConv(8, 4, heads=2, dropout=0.3)
    x, q = torch.randn(3, 8), torch.randn(3, 2, 4)
    assert call(conv.train(), x, q) == "attend_shared"
    assert call(conv.eval(), x, q) == "attend_shared"
    assert call(conv.train(), torch.randn(5, 3, 8), q) == "attend_per_item"
    assert call(conv.eval(), torch.randn(5, 3, 8), q) == "attend_shared"


def test_never_forces_message_passing_and_always_is_auto():
    x, q = torch.randn(3, 8), torch.randn(3, 2, 4)
    assert call(QSVConv(8, 4, heads=2, fused_path="never"), x, q) == "message_passing"
    assert call(QSVConv(8, 4, heads=2), x, q) == "attend_shared"
    # dense_path, the old name, still works with a DeprecationWarning; its
    # "always" is "auto" (fused_path itself refuses "always").
    with pytest.warns(DeprecationWarning, match="dense_path is deprecated"):
        old = QSVConv(8, 4, heads=2, dense_path="never")
    assert old.fused_path == "never" and call(old, x, q) == "message_passing"
    with pytest.warns(DeprecationWarning, match="'always' is 'auto'"):
        old = QSVConv(8, 4, heads=2, dense_path="always")
    assert old.fused_path == "auto" and call(old, x, q) == "attend_shared"
    with pytest.warns(DeprecationWarning):
        assert old.dense_path == "auto"
    with pytest.warns(DeprecationWarning):
        old.dense_path = "never"
    assert old.fused_path == "never"
    with pytest.raises(ValueError, match="fused_path='always' is not supported"):
        QSVConv(8, 4, fused_path="always")


def test_sparse_adjacency_uses_message_passing():
    from torch_geometric.utils import to_torch_coo_tensor
    conv = QSVConv(8, 4, heads=2)
    adj = to_torch_coo_tensor(torch.tensor([[0, 1], [1, 2]]), size=(3, 3))
    assert call(conv, torch.randn(3, 8), None, adj) == "message_passing"


def test_message_hooks_use_message_passing():
    conv = QSVConv(8, 4, heads=2)
    handle = conv.register_message_forward_hook(lambda *a: None)
    assert call(conv, torch.randn(3, 8)) == "message_passing"
    handle.remove()
    assert call(conv, torch.randn(3, 8)) == "attend_shared"


# PyG's own hook kinds (not torch.nn.Module's), found by their public register methods.
PYG_HOOKS = sorted(n for n in dir(MessagePassing)
                   if n.startswith("register_") and n.endswith("hook")
                   and not hasattr(torch.nn.Module, n))


def test_all_ten_pyg_hook_kinds_are_known():
    assert len(PYG_HOOKS) == 10, PYG_HOOKS


@pytest.mark.parametrize("register", PYG_HOOKS)
def test_every_pyg_hook_uses_message_passing(register):
    """Only message passing runs PyG's hooks: any hook there keeps the call on it."""
    conv = QSVConv(8, 4, heads=2)
    handle = getattr(conv, register)(lambda *a: None)
    path, reason = conv.path_reason(torch.randn(3, 8), None, torch.tensor([[0, 1], [1, 2]]))
    assert path == "message_passing" and "hook" in reason
    handle.remove()
    assert call(conv, torch.randn(3, 8)) == "attend_shared"


def test_the_reasons_are_named():
    x, ei = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2]])
    assert QSVConv(8, 4, fused_path="never").path_reason(x, None, ei) == \
        ("message_passing", "fused_path='never'")
    assert "dropout" in QSVConv(8, 4, dropout=0.5).train().path_reason(
        torch.randn(2, 3, 8), None, ei)[1]
    conv = QSVConv(8, 4)
    conv.explain = True
    assert "explain" in conv.path_reason(x, None, ei)[1]
    assert conv.path_reason(torch.randn(2, 3, 8), torch.randn(2, 3, 1, 4), ei)[0] == \
        "message_passing"
    conv.explain = False
    assert conv.path_reason(torch.randn(2, 3, 8), torch.randn(2, 3, 1, 4), ei)[0] == \
        "attend_per_item"
