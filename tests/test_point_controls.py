"""qsv_pyg.models.point_controls: the VN control is rotation and translation
invariant (float64), DGCNN / PointNet++ / VN give one row of logits per cloud,
and the parameter matching reaches its target."""
from __future__ import annotations

import pytest
import torch

from qsv_pyg.models.matching import count_parameters
from qsv_pyg.models import point_controls as pc
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion


def _clouds(num=3, n=48, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randn(num * n, 3, generator=g, dtype=dtype)
    pos = pos * torch.tensor([1.0, 0.6, 0.3], dtype=dtype)  # anisotropic: not symmetric
    return pos, torch.arange(num).repeat_interleave(n)


def test_vn_dgcnn_logits_invariant_to_rotations_and_translations_float64():
    torch.manual_seed(0)
    model = pc.VNDGCNN(10, widths=(4, 4, 8, 16), k=8).double().eval()
    pos, batch = _clouds()
    ref = model(pos, batch)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for r in quaternion_to_matrix(random_unit_quaternion(4, generator=g, dtype=torch.float64)):
        moved = pos.clone()
        for b in range(3):  # every cloud rotated and translated on its own
            t = torch.randn(3, generator=g, dtype=torch.float64) * 5
            moved[batch == b] = pos[batch == b] @ r.T + t
        worst = max(worst, float((model(moved, batch) - ref).abs().max()))
    assert worst < 1e-9, worst
    assert ref.abs().max() > 1e-3  # not a constant output


def test_vn_layers_are_equivariant():
    torch.manual_seed(0)
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    r = quaternion_to_matrix(random_unit_quaternion(1, dtype=torch.float64))[0]
    for layer in (pc.VNLinear(6, 4), pc.VNLeakyReLU(6)):
        layer = layer.double()
        assert torch.allclose(layer(x @ r.T), layer(x) @ r.T, atol=1e-12)
    inv = pc.VNInvariant(6).double().eval()
    assert torch.allclose(inv(x @ r.T), inv(x), atol=1e-12)


def test_a_non_invariant_model_is_not_invariant():
    """The test above can fail: DGCNN's logits do change under rotation."""
    torch.manual_seed(0)
    model = pc.DGCNN(10, 8, k=8).double().eval()
    pos, batch = _clouds()
    r = quaternion_to_matrix(random_unit_quaternion(1, dtype=torch.float64))[0]
    assert (model(pos @ r.T, batch) - model(pos, batch)).abs().max() > 1e-6


@pytest.mark.parametrize("build", [lambda: pc.DGCNN(7, 8, k=8),
                                   lambda: pc.VNDGCNN(7, (3, 3, 6), k=8),
                                   lambda: pc.PointNet2(7, 8)])
def test_controls_give_one_row_of_logits_per_cloud(build):
    model = build()
    if isinstance(model, pc.PointNet2):
        pytest.importorskip("torch_cluster")
    pos, batch = _clouds(num=3, n=64, dtype=torch.float32)
    out = model(pos, batch)
    assert out.shape == (3, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_matched_vn_and_widths_reach_the_target():
    target = 40_000
    vn = pc.matched_vn_dgcnn(10, target)
    assert abs(count_parameters(vn) - target) <= 0.05 * target
    dg = pc.matched_width_model(lambda w: pc.DGCNN(10, w), 64, target)
    assert abs(count_parameters(dg) - target) <= 0.05 * target


def test_feature_knn_fallback_matches_dense_search(monkeypatch):
    monkeypatch.setattr(pc, "torch_cluster", None)
    pos, batch = _clouds(num=2, n=20)
    src, dst = pc.feature_knn_graph(pos, 4, batch)
    assert src.numel() == 40 * 4
    assert bool((batch[src] == batch[dst]).all()) and bool((src != dst).all())
    d = torch.cdist(pos[:20], pos[:20]).fill_diagonal_(float("inf"))
    want = d.topk(4, largest=False).indices[0].sort().values
    assert torch.equal(src[dst == 0].sort().values, want)
