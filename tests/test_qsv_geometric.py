"""qsv_pyg.nn.models.QSVGeometric: invariant to rotations and translations of each
cloud (float64 logits to 1e-9), also on flat, collinear, duplicate-point and
symmetric clouds, float32 predictions on real ModelNet10 shapes, the transforms'
batches, the ablation switches and bad input."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch_geometric.transforms as T
from torch_geometric.data import Batch, Data

import qsv_pyg.transforms as QT
from qsv_pyg.nn.models import QSVGeometric
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion

pytestmark = pytest.mark.usefixtures("one_thread")
F64 = torch.float64
SMALL = dict(hidden_channels=16, heads=2, k=8)


def rotation(seed: int) -> torch.Tensor:
    q = random_unit_quaternion(generator=torch.Generator().manual_seed(seed)).double()
    return quaternion_to_matrix(q / q.norm())


def move_each(clouds, seed: int):
    """Every cloud rotated and translated by its own random motion."""
    g = torch.Generator().manual_seed(seed)
    return [c @ rotation(seed * 100 + i).T + 5 * torch.randn(3, generator=g, dtype=c.dtype)
            for i, c in enumerate(clouds)]


def stack(clouds):
    pos = torch.cat(clouds)
    batch = torch.cat([torch.full((len(c),), i) for i, c in enumerate(clouds)])
    return pos, batch


def blob(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 0.6, 0.3], dtype=F64) * (0.5 + torch.rand(3, generator=g,
                                                                           dtype=F64))
    return torch.randn(n, 3, generator=g, dtype=F64) * scale


def flat_plate(n: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, 3, generator=g, dtype=F64) * 2 - 1
    p[:, 2] = 0
    p[:, :2] -= p[:, :2].mean(0)
    return p


def polygon(n: int) -> torch.Tensor:
    a = torch.arange(n, dtype=F64) * (2 * math.pi / n)
    return torch.stack([a.cos(), a.sin(), torch.zeros_like(a)], 1)


def cube_corners() -> torch.Tensor:
    return torch.tensor([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)],
                        dtype=F64)


def model(**kw) -> QSVGeometric:
    torch.manual_seed(0)
    m = QSVGeometric(5, **{**SMALL, **kw}).double().eval()
    # Non-trivial batch-norm statistics, as after training.
    for norm in [*m.norms, *[mod for mod in m.head.modules()
                             if isinstance(mod, torch.nn.BatchNorm1d)]]:
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
    return m


def max_change(m: QSVGeometric, clouds, seed: int = 1) -> float:
    with torch.no_grad():
        a = m(*stack(clouds))
        b = m(*stack(move_each(clouds, seed)))
    assert a.shape == (len(clouds), 5)
    return float((a - b).abs().max())


@pytest.mark.parametrize("kw", [
    {},
    {"hierarchy": ((1.0, 6), (0.5, 8), (0.25, 12))},
    {"transport": "identity", "routing": "uniform", "pair_features": False},
    {"routing": "geometric", "edge_message": True, "source_logit": True},
    {"edge_message": "target", "hierarchy": ((1.0, 6), (0.5, 8))},
    {"edge_message": False},
], ids=["default", "hierarchy", "identity-uniform-nopairs", "geometric-edge-message",
        "edge-message-target-hierarchy", "no-edge-message"])
def test_float64_logits_are_invariant_to_rotations_and_translations(kw):
    clouds = [blob(96, s) for s in range(3)] + [blob(64, 9)]
    m = model(**kw)
    assert max_change(m, clouds) < 1e-9
    # ... while the same network on rotated inputs is not a constant function.
    with torch.no_grad():
        assert float(m(*stack(clouds)).std(0).max()) > 1e-4


def test_flat_plate_through_its_centroid_is_invariant():
    """Issue 28 item 5: with the example's tie-break (frame_rule="pca+centroid")
    or plain PCA frames, a flat plate's logits moved under rotation."""
    plates = [flat_plate(256, s) for s in range(2)]
    assert max_change(model(), plates) < 1e-9
    assert max_change(model(frame_rule="pca"), plates) > 1e-4


@pytest.mark.parametrize("name", ["polygon", "cube corners", "collinear", "duplicates",
                                  "all one point"])
def test_degenerate_clouds_keep_the_output_invariant(name):
    """No equivariant frame exists at these nodes (a rotation of the cloud onto itself
    fixes them): the model does not read their frames."""
    t = torch.linspace(-1, 1, 30, dtype=F64) ** 3
    clouds = {
        "polygon": [polygon(12), 2 * polygon(9)],
        "cube corners": [cube_corners(), 0.5 * cube_corners()],
        "collinear": [t[:, None] * torch.tensor([1.0, 2.0, -0.5], dtype=F64)],
        "duplicates": [torch.cat([blob(40, 1), blob(40, 1)[:20]]), blob(30, 2).repeat(2, 1)],
        "all one point": [torch.ones(12, 3, dtype=F64)],
    }[name]
    k = {"polygon": 2, "cube corners": 3}.get(name, 6)
    m = model(k=k)
    assert max_change(m, clouds) < 1e-9
    assert torch.isfinite(m(*stack(clouds))).all()


def test_model_reads_the_transforms_batch():
    """model(data) with graph and frames from the transforms equals model(pos, batch)."""
    m = model()
    transform = T.Compose([QT.NormalizeRadius(), QT.KNNGraph(k=8), QT.LocalFrames()])
    data = [transform(Data(pos=blob(50, s))) for s in range(3)]
    batch = Batch.from_data_list(data)
    with torch.no_grad():
        from_data = m(batch)
        from_pos = m(batch.pos, batch.batch)
        from_kw = m(batch.pos, batch.batch, edge_index=batch.edge_index, frame=batch.frame,
                    frame_ambiguous=batch.frame_ambiguous,
                    frame_eigenvalues=batch.frame_eigenvalues)
    torch.testing.assert_close(from_data, from_pos, atol=1e-12, rtol=0)
    torch.testing.assert_close(from_kw, from_pos, atol=1e-12, rtol=0)
    one = m(data[0].pos)  # batch=None: one cloud
    torch.testing.assert_close(one, from_pos[:1], atol=1e-12, rtol=0)


def test_gradients_reach_every_layer_and_a_step_lowers_the_loss():
    torch.manual_seed(0)
    m = QSVGeometric(2, **SMALL, hierarchy=((1.0, 6), (0.5, 8))).double()
    clouds = [blob(40, s) for s in range(4)] + [flat_plate(40, s) for s in range(4)]
    pos, batch = stack(clouds)
    y = torch.tensor([0] * 4 + [1] * 4)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(pos, batch), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(float(c.lin_edge.weight.grad.abs().sum()) > 0 for c in m.convs)
    assert losses[-1] < 0.5 * losses[0]


def test_the_usage_pipeline_runs_on_meshes():
    """docs/usage.md's ten lines, on two small meshes instead of ModelNet's files."""
    from torch_geometric.loader import DataLoader
    tetra = Data(pos=torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]),
                 face=torch.tensor([[0, 0, 0, 1], [1, 1, 2, 2], [2, 3, 3, 3]]))
    meshes = [Data(pos=tetra.pos * (1 + i), face=tetra.face, y=torch.tensor([i % 2]))
              for i in range(4)]
    torch.manual_seed(0)
    pre = T.Compose([T.SamplePoints(64), QT.NormalizeRadius(), QT.KNNGraph(k=8),
                     QT.LocalFrames()])
    loader = DataLoader([pre(m) for m in meshes], batch_size=2, shuffle=True)
    model = QSVGeometric(2, **{**SMALL, "k": 8})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for data in loader:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data), data.y)
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)


def _modelnet_npz() -> Path:
    """``$QSV_DATA_DIR`` or ``shared/data`` beside the checkout (or beside the
    folder of worktrees holding it), as qsv_pyg.experiments.units looks for it."""
    here = Path(__file__).resolve().parents
    roots = ([Path(os.environ["QSV_DATA_DIR"])] if "QSV_DATA_DIR" in os.environ else
             [here[2] / "shared" / "data", here[3] / "shared" / "data"])
    for root in roots:
        path = root / "ModelNet10" / "modelnet10_pcd1024.npz"
        if path.is_file():
            return path
    pytest.skip(f"no ModelNet10/modelnet10_pcd1024.npz under {', '.join(map(str, roots))}")


def test_float32_predictions_agree_on_real_modelnet10_shapes():
    with np.load(_modelnet_npz(), allow_pickle=False) as f:
        pos = torch.from_numpy(f["pos_test"][::113][:8, :512].astype(np.float32))
    clouds = [QT.NormalizeRadius()(Data(pos=p)).pos for p in pos]
    torch.manual_seed(0)
    m = QSVGeometric(10, hidden_channels=32, heads=2, k=16).eval()
    with torch.no_grad():
        a = m(*stack(clouds))
        moved = [(c.double() @ rotation(50 + i).T).float() for i, c in enumerate(clouds)]
        b = m(*stack(moved))
    assert torch.equal(a.argmax(1), b.argmax(1))
    assert float((a - b).abs().max()) < 1e-3 * float(a.abs().max())
    # float64 model and positions: the logits agree to 1e-9 on the same shapes.
    m64 = m.double()
    with torch.no_grad():
        a64 = m64(*stack([c.double() for c in clouds]))
        b64 = m64(*stack(move_each([c.double() for c in clouds], 3)))
    assert float((a64 - b64).abs().max()) < 1e-9


def test_bad_arguments_and_inputs_are_named():
    with pytest.raises(ValueError, match="routing='learned'.*invariant"):
        QSVGeometric(3, routing="learned")
    with pytest.raises(ValueError, match="multiple of 4 \\* heads = 16"):
        QSVGeometric(3, hidden_channels=24, heads=4)
    with pytest.raises(ValueError, match="hierarchy\\[1\\] fraction"):
        QSVGeometric(3, hierarchy=((0.5, 8), (1.0, 8)))
    with pytest.raises(ValueError, match="num_layers=2 but the hierarchy has 3"):
        QSVGeometric(3, num_layers=2, hierarchy=True)
    with pytest.raises(ValueError, match="frame_rule"):
        QSVGeometric(3, frame_rule="svd")
    with pytest.raises(ValueError, match="edge_message=True needs pair_features"):
        QSVGeometric(3, pair_features=False, edge_message=True)
    # edge_message=None (the default): "target" with the pair features, off without
    assert QSVGeometric(3).edge_message == "target"
    assert QSVGeometric(3).convs[0].edge_message == "target"
    assert QSVGeometric(3, pair_features=False).edge_message is False
    assert QSVGeometric(3, edge_message=False).convs[0].edge_message is False
    assert "edge_message='target'" in repr(QSVGeometric(3))
    m = model()
    with pytest.raises(ValueError, match=r"\[num_points, 3\]"):
        m(torch.zeros(10, 2, dtype=F64))
    bad = blob(20, 0)
    bad[4, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite coordinate at point 4"):
        m(bad)
    with pytest.raises(ValueError, match=r"cloud 1 \(5 points\)"):
        m(*stack([blob(20, 0), blob(5, 1)]))
    assert "QSVGeometric(5, hidden_channels=16" in repr(m)
    assert repr(QSVGeometric(3, hierarchy=True)).count("(0.5, 16)") == 1


def test_the_usage_voting_lines_average_fresh_draws():
    """docs/usage.md's voting lines: a dataset whose transform draws fresh points on
    every access, the mean softmax over the passes."""
    from torch_geometric.data import Dataset
    from torch_geometric.loader import DataLoader
    tetra = Data(pos=torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]),
                 face=torch.tensor([[0, 0, 0, 1], [1, 1, 2, 2], [2, 3, 3, 3]]))

    class Meshes(Dataset):
        def __init__(self, transform):
            super().__init__(None, transform)

        def len(self):
            return 4

        def get(self, i):
            return Data(pos=tetra.pos * (1 + i), face=tetra.face, y=torch.tensor([i % 2]))

    test_set = Meshes(T.Compose([T.SamplePoints(64), QT.NormalizeRadius()]))
    torch.manual_seed(0)
    model = QSVGeometric(2, **SMALL)

    @torch.no_grad()
    def vote(model, dataset, votes=10):  # mean softmax over fresh draws of the points
        model.eval()
        return sum(torch.cat([model(d).softmax(-1) for d in DataLoader(dataset, batch_size=64)])
                   for _ in range(votes)) / votes

    torch.manual_seed(1)
    probs = vote(model, test_set, votes=3)
    assert probs.shape == (4, 2) and torch.allclose(probs.sum(-1), torch.ones(4))
    torch.manual_seed(1)  # the same three draws, one pass at a time
    passes = [torch.cat([model(d).softmax(-1) for d in DataLoader(test_set, batch_size=64)])
              for _ in range(3)]
    assert torch.allclose(probs, sum(passes) / 3)
    assert not torch.allclose(passes[0], passes[1])  # each pass drew other points
