"""qsv_pyg.geometry.oriented_frames and qsv_pyg.transforms: equivariant frames on
flat, symmetric, collinear and duplicate-point clouds, the transforms in
T.Compose, canonical kNN and tie-robust farthest point sampling."""
from __future__ import annotations

import math

import pytest
import torch
import torch_geometric.transforms as T
from torch_geometric.data import Batch, Data

import qsv_pyg.transforms as QT
from qsv_pyg.geometry import (FRAME_RULES, frame_quaternions, knn_within, local_frames,
                              oriented_frames)
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion
from qsv_pyg.transforms.functional import (EDGE_FEATURES, NODE_FEATURES,
                                           farthest_point_sampling, knn_graph,
                                           point_pair_features)

pytestmark = pytest.mark.usefixtures("one_thread")
F64 = torch.float64


def rotation(seed: int) -> torch.Tensor:
    q = random_unit_quaternion(generator=torch.Generator().manual_seed(seed)).double()
    return quaternion_to_matrix(q / q.norm())


def move(pos: torch.Tensor, seed: int) -> torch.Tensor:
    """A random rotation and translation of a cloud (float64)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return pos @ rotation(seed).T + 3 * torch.randn(3, generator=g, dtype=F64)


def blob(n: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=F64) * torch.tensor([1.0, 0.6, 0.3], dtype=F64)


def flat_plate(n: int = 4096, seed: int = 0) -> torch.Tensor:
    """Zero thickness, the plane through the centroid (issue 28, item 5)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, 3, generator=g, dtype=F64) * 2 - 1
    p[:, 2] = 0
    p[:, :2] -= p[:, :2].mean(0)
    return p


def polygon(n: int = 12) -> torch.Tensor:
    a = torch.arange(n, dtype=F64) * (2 * math.pi / n)
    return torch.stack([a.cos(), a.sin(), torch.zeros_like(a)], 1)


def cube_corners() -> torch.Tensor:
    return torch.tensor([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)],
                        dtype=F64)


def line(n: int = 40) -> torch.Tensor:
    t = torch.linspace(-1, 1, n, dtype=F64) ** 3  # uneven spacing: no ties in the kNN
    return t[:, None] * torch.tensor([1.0, 2.0, -0.5], dtype=F64)


def neighbour_sets(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, k]`` sorted sources per target of a canonical (target-sorted) graph."""
    assert torch.equal(edge_index[1], torch.arange(n).repeat_interleave(edge_index.size(1) // n))
    return edge_index[0].view(n, -1).sort(dim=1).values


def frames_after_move(pos: torch.Tensor, k: int, seed: int = 1, rule: str = "robust"):
    """(frames, frames of the moved cloud, rotation); asserts the kNN sets agree."""
    ei, ei_moved = knn_within(pos, k), knn_within(move(pos, seed), k)
    assert torch.equal(neighbour_sets(ei, len(pos)), neighbour_sets(ei_moved, len(pos)))
    return (oriented_frames(pos, ei, rule=rule),
            oriented_frames(move(pos, seed), ei_moved, rule=rule), rotation(seed))


def assert_equivariant(a, b, g, atol=1e-9):
    assert torch.equal(a.ambiguous, b.ambiguous)
    ok = ~a.ambiguous
    torch.testing.assert_close(b.frame[ok], g @ a.frame[ok], atol=atol, rtol=0)
    torch.testing.assert_close(b.eigenvalues, a.eigenvalues, atol=1e-9, rtol=0)
    eye = torch.eye(3, dtype=F64).expand(len(a.frame), 3, 3)
    torch.testing.assert_close(a.frame.transpose(1, 2) @ a.frame, eye, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.linalg.det(a.frame), torch.ones(len(a.frame), dtype=F64),
                               atol=1e-12, rtol=0)


# ------------------------------------------------------------------ frames
def test_generic_cloud_frames_rotate_with_it_and_none_is_ambiguous():
    a, b, g = frames_after_move(blob(), 16)
    assert not a.ambiguous.any()
    assert_equivariant(a, b, g)


def test_flat_plate_through_its_centroid_gets_equivariant_frames():
    """Issue 28 item 5: the old tie-break (the normal's sign by <p_i, e3>, which is
    0 on a plate through the centroid) left the normal's sign to rounding; the
    plain PCA frames (local_frames, frame_quaternions) change on half the nodes."""
    a, b, g = frames_after_move(flat_plate(), 16)
    assert not a.ambiguous.any()
    assert_equivariant(a, b, g)
    # The normal is the plate's normal, the frame right-handed from e1, e2.
    torch.testing.assert_close(a.frame[:, :, 2].abs()[:, 2], torch.ones(4096, dtype=F64))
    old_a, old_b, _ = frames_after_move(flat_plate(), 16, rule="pca")
    changed = ((old_b.frame - g @ old_a.frame).abs().amax((1, 2)) > 1e-6).sum()
    assert changed > 1000  # what the old frames did (about half of the 4,096 nodes)


def test_planar_patch_with_isotropic_spread_takes_the_mean_offset_as_e1():
    """Degenerate in-plane eigenvalues (a symmetric square lattice neighbourhood off
    the centre): e1 comes from the projected candidates, not from eigh's arbitrary
    basis, and the frame still rotates with the cloud where it is not ambiguous."""
    xs = torch.arange(-3, 4, dtype=F64)
    grid = torch.stack(torch.meshgrid(xs, xs, indexing="ij"), -1).reshape(-1, 2)
    pos = torch.cat([grid, 0.1 * (grid[:, :1] ** 2 + 2 * grid[:, 1:] ** 2)], 1)  # a bowl
    a, b, g = frames_after_move(pos, 8)
    assert_equivariant(a, b, g)
    assert (~a.ambiguous).sum() > 20


@pytest.mark.parametrize("name,pos,k", [("polygon", polygon(), 2),
                                        ("cube corners", cube_corners(), 3),
                                        ("collinear", line(), 4)])
def test_symmetric_and_collinear_clouds_mark_every_node_ambiguous(name, pos, k):
    """A rotation of the cloud onto itself fixes each of these nodes: no frame is
    equivariant there, and the rule says so (the same way after a rotation)."""
    a, b, g = frames_after_move(pos, k)
    assert a.ambiguous.all(), name
    assert_equivariant(a, b, g)


def test_duplicate_points_keep_equivariant_frames_and_all_duplicates_are_ambiguous():
    pos = blob(100)
    dup = torch.cat([pos, pos[:50]])
    a, b, g = frames_after_move(dup, 16)
    assert not a.ambiguous.any()
    assert_equivariant(a, b, g)
    torch.testing.assert_close(a.frame[100:], a.frame[:50], atol=1e-12, rtol=0)
    same = torch.ones(6, 3, dtype=F64)
    out = oriented_frames(same, knn_within(same, 3))
    assert out.ambiguous.all()
    assert torch.isfinite(out.frame).all()
    torch.testing.assert_close(out.eigenvalues, torch.zeros(6, 3, dtype=F64))


def test_frames_are_per_cloud_with_batch():
    p1, p2 = blob(60, 1), flat_plate(80, 2)
    pos = torch.cat([p1, p2 + 5.0])
    batch = torch.cat([torch.zeros(60), torch.ones(80)]).long()
    ei = knn_graph(pos, 10, batch)
    both = oriented_frames(pos, ei, batch)
    one = oriented_frames(p2 + 5.0, knn_within(p2 + 5.0, 10))
    torch.testing.assert_close(both.frame[60:], one.frame, atol=1e-12, rtol=0)
    assert torch.equal(both.ambiguous[60:], one.ambiguous)


def test_frames_of_a_batch_mixing_every_case_equal_each_cloud_alone():
    """The moments that only some nodes need (the third moment where the first
    does not decide, the candidates of the plane / line / isotropic cases) are
    summed over those nodes' edges alone: in a batch whose clouds hit every case
    (a generic blob, a lattice bowl: plane on top, a line: line on top, a
    polygon, cube corners and duplicates: isotropic), every cloud's frames are
    bit for bit those of the cloud alone."""
    xs = torch.arange(-3, 4, dtype=F64)
    grid = torch.stack(torch.meshgrid(xs, xs, indexing="ij"), -1).reshape(-1, 2)
    bowl = torch.cat([grid, 0.1 * (grid[:, :1] ** 2 + 2 * grid[:, 1:] ** 2)], 1)
    clouds = [blob(60, 3), bowl, line(), polygon(), cube_corners(),
              torch.cat([blob(20, 4), torch.ones(6, 3, dtype=F64)])]
    k = 3
    pos = torch.cat([c + 10.0 * i for i, c in enumerate(clouds)])
    batch = torch.cat([torch.full((len(c),), i) for i, c in enumerate(clouds)])
    both = oriented_frames(pos, knn_graph(pos, k, batch), batch)
    start = 0
    for i, c in enumerate(clouds):
        one = oriented_frames(c + 10.0 * i, knn_within(c + 10.0 * i, k))
        part = slice(start, start + len(c))
        assert torch.equal(both.frame[part], one.frame), i
        assert torch.equal(both.ambiguous[part], one.ambiguous), i
        start += len(c)
    lam = both.eigenvalues
    gap12, gap23 = lam[:, 0] - lam[:, 1], lam[:, 1] - lam[:, 2]
    tiny = 1e-9 * lam[:, 0].clamp_min(1e-30)
    assert ((gap12 <= tiny) & (gap23 > tiny)).any()  # plane on top
    assert ((gap12 > tiny) & (gap23 <= tiny)).any()  # line on top
    assert ((gap12 <= tiny) & (gap23 <= tiny)).any()  # isotropic


def test_legacy_rules_are_local_frames():
    pos = blob(80)
    ei = knn_within(pos, 8)
    assert FRAME_RULES == ("robust", "pca+centroid", "pca")
    torch.testing.assert_close(oriented_frames(pos, ei, rule="pca").frame,
                               local_frames(pos, ei), atol=0, rtol=0)
    with pytest.raises(ValueError, match="rule='nope'"):
        oriented_frames(pos, ei, rule="nope")
    with pytest.raises(ValueError, match=r"\[num_nodes, 3\]"):
        oriented_frames(pos[:, :2], ei)
    with pytest.raises(ValueError, match="tol"):
        oriented_frames(pos, ei, tol=-1.0)
    with pytest.raises(ValueError, match="outside"):
        oriented_frames(pos, ei + 100)


@pytest.mark.parametrize("fn", [local_frames, frame_quaternions, oriented_frames])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_position_is_named(fn, bad):
    """Issue 28 item 15: eigh used to fail with "ill-conditioned or has too many
    repeated eigenvalues", naming no point."""
    pos = blob(30)
    ei = knn_within(pos, 5)
    pos[7, 1] = bad
    pos[12, 0] = bad
    with pytest.raises(ValueError, match=r"non-finite coordinate at point 7 .*2 of 30"):
        fn(pos, ei)


# -------------------------------------------------------------- transforms
def compose(k: int = 12):
    return T.Compose([QT.NormalizeRadius(), QT.KNNGraph(k=k), QT.LocalFrames(),
                      QT.InvariantFeatures()])


def test_normalize_radius_is_rotation_invariant_where_normalize_scale_is_not():
    pos = blob(100, 7)
    radius = lambda t, p: t(Data(pos=p)).pos.norm(dim=1)  # noqa: E731
    ours = QT.NormalizeRadius()
    torch.testing.assert_close(radius(ours, move(pos, 2)), radius(ours, pos.clone()),
                               atol=1e-12, rtol=0)
    assert radius(ours, pos.clone()).max() == pytest.approx(0.999999)
    pyg = T.NormalizeScale()
    assert (radius(pyg, move(pos, 2)) - radius(pyg, pos.clone())).abs().max() > 1e-3
    one = ours(Data(pos=torch.ones(3, 3, dtype=F64)))
    assert (one.pos == 0).all() and repr(ours) == "NormalizeRadius()"


def test_transforms_inside_compose_give_invariant_features():
    transform = T.Compose([T.Center(), compose()])  # with PyG's transforms
    assert "KNNGraph(k=12)" in repr(transform) and "LocalFrames(rule='robust')" in repr(
        transform) and "InvariantFeatures(node=True, edge=True)" in repr(transform)
    pos = blob(150, 3)
    a = transform(Data(pos=pos.clone()))
    b = transform(Data(pos=move(pos, 4)))
    assert a.x.shape == (150, len(NODE_FEATURES))
    assert a.edge_attr.shape == (1800, len(EDGE_FEATURES))
    assert a.frame.shape == (150, 3, 3) and a.quat.shape == (150, 4)
    assert a.frame_ambiguous.dtype == torch.bool and a.frame_eigenvalues.shape == (150, 3)
    assert torch.equal(a.edge_index, b.edge_index)
    torch.testing.assert_close(b.x, a.x, atol=1e-9, rtol=0)
    torch.testing.assert_close(b.edge_attr, a.edge_attr, atol=1e-9, rtol=0)
    torch.testing.assert_close(quaternion_to_matrix(a.quat), a.frame, atol=1e-12, rtol=0)
    # ... and as a pre_transform of a list of Data batched by PyG.
    batch = Batch.from_data_list([compose()(Data(pos=blob(40, s))) for s in range(3)])
    assert batch.frame.shape == (120, 3, 3) and batch.edge_index.max() == 119


def test_random_axis_scale_draws_a_factor_per_axis_every_call_and_composes():
    """The recipe's augmentation as a PyG transform: each axis scaled by its own
    factor in ``scales``, a fresh draw per call; then the invariant pipeline."""
    torch.manual_seed(0)
    pos = blob(120).float()
    aug = QT.RandomAxisScale()
    assert aug.scales == QT.AXIS_SCALES == (2 / 3, 3 / 2)
    draws = torch.stack([aug(Data(pos=pos.clone())).pos[0] / pos[0] for _ in range(50)])
    lo, hi = QT.AXIS_SCALES
    assert draws.ge(lo - 1e-6).all() and draws.le(hi + 1e-6).all()
    assert draws.std(0).gt(0.1).all()  # fresh factors every call, on every axis
    assert (draws[:, 0] - draws[:, 1]).abs().max() > 0.1  # not one factor for all axes
    out = aug(Data(pos=pos.clone())).pos
    torch.testing.assert_close(out / pos, (out / pos)[:1].expand_as(pos), rtol=1e-5, atol=0)
    pipeline = T.Compose([QT.RandomAxisScale((0.5, 2.0)), QT.NormalizeRadius(),
                          QT.KNNGraph(k=8), QT.LocalFrames()])
    data = pipeline(Data(pos=pos.clone()))
    assert data.pos.norm(dim=-1).max() < 1 and data.frame.shape == (120, 3, 3)
    for bad in [(0.0, 1.0), (2.0, 1.0), (1.0,), "ab", (1.0, float("inf"))]:
        with pytest.raises(ValueError, match="RandomAxisScale: scales"):
            QT.RandomAxisScale(bad)
    with pytest.raises(ValueError, match="RandomAxisScale: data has no pos"):
        aug(Data(x=torch.ones(3, 1)))


def test_transform_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="LocalFrames: data has no edge_index"):
        QT.LocalFrames()(Data(pos=blob(10)))
    with pytest.raises(ValueError, match="InvariantFeatures: data has no frame"):
        QT.InvariantFeatures()(QT.KNNGraph(3)(Data(pos=blob(10))))
    with pytest.raises(ValueError, match="KNNGraph: data has no pos"):
        QT.KNNGraph(3)(Data(x=torch.ones(4, 1)))
    with pytest.raises(ValueError, match="k must be a positive int"):
        QT.KNNGraph(0)
    with pytest.raises(ValueError, match="rule="):
        QT.LocalFrames(rule="svd")
    bad = blob(10)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="point 3"):
        QT.KNNGraph(3)(Data(pos=bad))


def test_invariant_features_cat_appends():
    data = QT.LocalFrames()(QT.KNNGraph(4)(Data(pos=blob(20), x=torch.ones(20, 2, dtype=F64))))
    data.edge_attr = torch.zeros(80, 1, dtype=F64)
    out = QT.InvariantFeatures(cat=True)(data)
    assert out.x.shape == (20, 10) and out.edge_attr.shape == (80, 9)
    assert (out.x[:, :2] == 1).all()


def test_point_pair_features_are_the_ppf_angles():
    pos = blob(50, 5)
    data = QT.LocalFrames()(QT.KNNGraph(6)(Data(pos=pos)))
    e = point_pair_features(pos, data.edge_index, data.frame, data.frame_ambiguous)
    src, dst = data.edge_index
    d = pos[src] - pos[dst]
    torch.testing.assert_close(e[:, 0], d.norm(dim=1))
    n_i, n_j = data.frame[dst, :, 2], data.frame[src, :, 2]
    cos_i = (n_i * d).sum(1) / d.norm(dim=1)
    torch.testing.assert_close(e[:, 3], cos_i)  # cos angle(n_i, d)
    torch.testing.assert_close(e[:, 6], (n_j * d).sum(1) / d.norm(dim=1))
    torch.testing.assert_close(e[:, 7], (n_i * n_j).sum(1))
    # In-plane angle of d to e1 at i: (cos, sin) times sin angle(n_i, d).
    phi = torch.atan2(e[:, 2], e[:, 1])
    e1, e2 = data.frame[dst, :, 0], data.frame[dst, :, 1]
    torch.testing.assert_close(phi, torch.atan2((d * e2).sum(1), (d * e1).sum(1)))
    torch.testing.assert_close(e[:, 1:3].norm(dim=1), (1 - cos_i ** 2).clamp_min(0).sqrt())


def test_ambiguous_nodes_get_no_frame_dependent_features():
    data = compose(2)(Data(pos=polygon(10)))
    assert data.frame_ambiguous.all()
    assert (data.x[:, 1:4] == 0).all() and (data.x[:, 7] == 1).all()
    assert (data.edge_attr[:, 1:] == 0).all() and (data.edge_attr[:, 0] > 0).all()


# -------------------------------------------------------- kNN and sampling
def test_knn_graph_has_exactly_k_per_target_with_duplicates_and_batches():
    """torch_cluster.knn_graph can return k + 1 sources for a repeated point
    (issue 28 item 11); the canonical graph never does."""
    pos = torch.cat([blob(30), blob(30)[:5], blob(20, 9)])  # cloud 0 repeats 5 points
    batch = torch.cat([torch.zeros(35), torch.ones(20)]).long()
    ei = knn_graph(pos, 7, batch)
    assert ei.shape == (2, 55 * 7)
    assert torch.equal(ei[1], torch.arange(55).repeat_interleave(7))
    assert (batch[ei[0]] == batch[ei[1]]).all() and (ei[0] != ei[1]).all()
    with pytest.raises(ValueError, match=r"cloud 1 \(20 points\).*k=20"):
        knn_graph(pos, 20, batch)


def _knn_cloud_by_cloud(pos, k, batch, loop=False):
    from qsv_pyg.geometry.knn import knn_within
    parts = []
    for b in batch.unique():
        idx = (batch == b).nonzero().view(-1)
        parts.append(idx[knn_within(pos[idx].double(), k, loop=loop)])
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("loop", [False, True])
def test_knn_graph_searches_all_clouds_at_once_with_the_same_graph(loop, monkeypatch):
    """knn_graph's one search over all clouds (geometry.knn.knn_batched) gives
    the graph of the search cloud by cloud, on integer lattices (exact ties
    everywhere, duplicates) of uneven cloud sizes, and a sorted batch takes it."""
    import qsv_pyg.geometry.knn as K
    pytest.importorskip("torch_cluster")
    calls = []
    batched = K.knn_batched
    monkeypatch.setattr(QT.functional, "knn_batched",
                        lambda *a, **kw: calls.append(batched(*a, **kw)) or calls[-1])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        sizes = torch.randint(4, 30, (4,), generator=g)
        pos = torch.randint(0, 3, (int(sizes.sum()), 3), generator=g).double()
        batch = torch.arange(4).repeat_interleave(sizes)
        for k in (1, 3):
            assert torch.equal(knn_graph(pos, k, batch, loop=loop),
                               _knn_cloud_by_cloud(pos, k, batch, loop))
    assert any(c is not None for c in calls)  # the batched path ran (not only fallbacks)
    # a real-looking cloud: always batched
    pos, batch = torch.cat([blob(40), blob(50, 3)]), torch.repeat_interleave(
        torch.arange(2), torch.tensor([40, 50]))
    calls.clear()
    assert torch.equal(knn_graph(pos, 8, batch, loop=loop),
                       _knn_cloud_by_cloud(pos, 8, batch, loop))
    assert calls[-1] is not None


def test_knn_graph_unsorted_batch_and_small_clouds_go_cloud_by_cloud():
    import qsv_pyg.geometry.knn as K
    pytest.importorskip("torch_cluster")
    pos = torch.cat([blob(20), blob(20, 4)])
    batch = torch.arange(2).repeat(20)  # interleaved clouds
    assert K.knn_batched(pos, 5, batch) is None
    assert torch.equal(knn_graph(pos, 5, batch), _knn_cloud_by_cloud(pos, 5, batch))
    small = torch.repeat_interleave(torch.arange(2), torch.tensor([6, 34]))
    assert K.knn_batched(pos, 5, small) is None  # k + 2 candidates reach cloud 0's 6 points
    assert torch.equal(knn_graph(pos, 5, small), _knn_cloud_by_cloud(pos, 5, small))


def test_knn_candidates_grouped_by_destination_whatever_order_the_search_returns(monkeypatch):
    """geometry.knn skips its grouping sort where torch_cluster's pairs come grouped
    by destination (they do on CPU) and sorts where they do not: a search that
    returns its pairs shuffled gives the same graphs, batched and per cloud."""
    import qsv_pyg.geometry.knn as K
    torch_cluster = pytest.importorskip("torch_cluster")
    pos = torch.cat([blob(40), blob(50, 3)])
    batch = torch.repeat_interleave(torch.arange(2), torch.tensor([40, 50]))
    expected = {loop: knn_graph(pos, 8, batch, loop=loop) for loop in (False, True)}
    single = K.knn_within(pos, 8)
    row, _ = torch_cluster.knn(pos, pos, 10, batch, batch)
    assert bool((row[1:] >= row[:-1]).all())  # grouped: the sort is skipped

    class Shuffled:
        @staticmethod
        def knn(*args):
            row, col = torch_cluster.knn(*args)
            perm = torch.randperm(row.numel(), generator=torch.Generator().manual_seed(1))
            return row[perm], col[perm]

    monkeypatch.setattr(K, "torch_cluster", Shuffled)
    for loop in (False, True):
        assert torch.equal(knn_graph(pos, 8, batch, loop=loop), expected[loop])
    assert torch.equal(K.knn_within(pos, 8), single)


def test_point_pair_features_bipartite_with_ambiguous_endpoints():
    """The columns as written in the docstring (R^T d/|d| at each end, the
    normals' cosine), zero blocks at ambiguous ends, on a bipartite graph with
    a coincident pair."""
    g = torch.Generator().manual_seed(3)
    pos_s, pos_d = torch.randn(12, 3, generator=g, dtype=F64), torch.randn(5, 3, generator=g,
                                                                         dtype=F64)
    pos_d[0] = pos_s[2]  # d = 0 on the edge 2 -> 0
    fs = quaternion_to_matrix(random_unit_quaternion(12, generator=g, dtype=F64))
    fd = quaternion_to_matrix(random_unit_quaternion(5, generator=g, dtype=F64))
    amb_s, amb_d = torch.zeros(12, dtype=torch.bool), torch.zeros(5, dtype=torch.bool)
    amb_s[[1, 7]], amb_d[3] = True, True
    ei = torch.stack([torch.randint(0, 12, (40,), generator=g),
                      torch.randint(0, 5, (40,), generator=g)])
    ei[:, 0] = torch.tensor([2, 0])
    e = point_pair_features(pos_s, ei, fs, amb_s, pos_d, fd, amb_d)
    d = pos_s[ei[0]] - pos_d[ei[1]]
    dist = d.norm(dim=1, keepdim=True)
    u = torch.where(dist > 0, d / dist.clamp_min(1e-300), torch.zeros_like(d))
    want_d = torch.einsum("eba,eb->ea", fd[ei[1]], u) * ~amb_d[ei[1], None]
    want_s = torch.einsum("eba,eb->ea", fs[ei[0]], u) * ~amb_s[ei[0], None]
    cos = (fs[ei[0], :, 2] * fd[ei[1], :, 2]).sum(1, keepdim=True) * \
        ~(amb_s[ei[0]] | amb_d[ei[1]])[:, None]
    torch.testing.assert_close(e, torch.cat([dist, want_d, want_s, cos], 1), rtol=0, atol=1e-15)
    assert e.shape == (40, 8) and (e[0, 1:7] == 0).all() and e[0, 0] == 0


def test_farthest_point_sampling_breaks_exact_ties_by_index():
    """On a symmetric cloud every choice is a tie; after a rotation the rounding
    differs, the choice does not."""
    pos = torch.cat([cube_corners(), polygon(8) * 2])
    idx = farthest_point_sampling(pos, 0.5)
    assert idx.numel() == 8 and idx.unique().numel() == 8
    for seed in range(5):
        assert torch.equal(farthest_point_sampling(move(pos, seed), 0.5), idx)
    batch = torch.cat([torch.zeros(16), torch.ones(7)]).long()
    two = farthest_point_sampling(torch.cat([pos, blob(7)]), 0.5, batch)
    assert two.numel() == 8 + 4 and torch.equal(two[:8], idx)
    assert (two[8:] >= 16).all()
    assert torch.equal(farthest_point_sampling(pos, 1.0), torch.arange(16))
    with pytest.raises(ValueError, match="ratio"):
        farthest_point_sampling(pos, 0.0)
