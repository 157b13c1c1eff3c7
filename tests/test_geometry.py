import math

import pytest
import torch
from torch_geometric.data import HeteroData

from qsv_pyg.geometry import (
    Hierarchy,
    LatticeSpec,
    ShellSpec,
    build_lattice_hierarchy,
    build_shell_hierarchy,
    build_shells,
    dense_neighbors,
    disk_to_sphere,
    disk_to_square,
    fibonacci_sphere,
    knn_cross,
    knn_within,
    lattice_grid,
    sphere_to_disk,
    sphere_to_square,
    square_to_disk,
    square_to_sphere,
)

DEFAULT_SIZES = (256, 144, 64, 36, 16)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _uniform_sphere(n, dtype=torch.float64, seed=0):
    p = torch.randn(n, 3, generator=_gen(seed), dtype=torch.float64)
    return (p / p.norm(dim=-1, keepdim=True)).to(dtype)


def _brute_knn(src, dst, k, exclude_self=False):
    """Reference: per target, sources sorted by (distance, index) via cdist."""
    d = torch.cdist(dst.double(), src.double()).pow(2)
    if exclude_self:
        d.fill_diagonal_(float("inf"))
    idx = torch.arange(src.size(0)).expand_as(d)
    # lexicographic (distance, index): sort by index, then stably by distance.
    order = torch.sort(d, dim=-1, stable=True).indices
    return idx.gather(-1, order)[:, :k]


def _check_layout(ei, num_dst, k, num_src):
    assert ei.dtype == torch.long
    assert ei.shape == (2, num_dst * k)
    assert torch.equal(ei[1], torch.arange(num_dst).repeat_interleave(k))
    assert int(ei[0].min()) >= 0 and int(ei[0].max()) < num_src


# --------------------------------------------------------------------------- Fibonacci


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("radius", [1.0, 0.37])
def test_fibonacci_norms_count_dtype(dtype, radius):
    p = fibonacci_sphere(300, radius, dtype=dtype)
    assert p.shape == (300, 3) and p.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert torch.allclose(p.norm(dim=-1), torch.full((300,), radius, dtype=dtype), atol=tol)
    assert torch.isfinite(p).all()


def test_fibonacci_default_dtype_and_spacing():
    p = fibonacci_sphere(16)
    assert p.dtype == torch.get_default_dtype()
    # z_i = 1 - (2i + 1)/n exactly.
    z = 1 - (2 * torch.arange(16, dtype=torch.float64) + 1) / 16
    assert torch.allclose(p[:, 2].double(), z, atol=1e-7)


def test_fibonacci_roughly_uniform():
    n = 800
    p = fibonacci_sphere(n, dtype=torch.float64)
    # Equal-area z-bands hold the same number of points (Archimedes).
    bands = torch.histc(p[:, 2], bins=8, min=-1.0, max=1.0)
    assert (bands - n / 8).abs().max() <= 1
    # Nearest-neighbour distances are nearly constant.
    d = torch.cdist(p, p)
    d.fill_diagonal_(float("inf"))
    nn = d.min(dim=-1).values
    assert nn.std() / nn.mean() < 0.1
    # Uniform: the centroid is near the origin.
    assert p.mean(dim=0).norm() < 1e-2


@pytest.mark.parametrize("n", [0, -3])
def test_fibonacci_bad_n(n):
    with pytest.raises(ValueError, match="n must be"):
        fibonacci_sphere(n)


@pytest.mark.parametrize("radius", [0.0, -1.0, float("nan")])
def test_fibonacci_bad_radius(radius):
    with pytest.raises(ValueError, match="radius"):
        fibonacci_sphere(10, radius)


# --------------------------------------------------------------------------- ShellSpec


def test_shell_spec_default_and_build():
    spec = ShellSpec()
    assert spec.sizes == DEFAULT_SIZES
    assert spec.radii == (1.0, 0.8, 0.6, 0.4, 0.2)
    assert spec.sizes == LatticeSpec().sizes
    shells = build_shells(spec)
    assert [s.shape for s in shells] == [(n, 3) for n in DEFAULT_SIZES]
    for s, r in zip(shells, spec.radii):
        assert torch.allclose(s.norm(dim=-1), torch.full((s.size(0),), r), atol=1e-6)
    # Lists are accepted and stored as (hashable) tuples.
    assert hash(ShellSpec(sizes=[4, 2], radii=[1, 0.5])) is not None


@pytest.mark.parametrize(
    "sizes, radii, match",
    [
        ((4, 2), (1.0,), "same length"),
        ((), (), "at least one"),
        ((4, 0), (1.0, 0.5), r"sizes\[1\]"),
        ((4, 2), (1.0, -0.5), r"radii\[1\]"),
        ((4, 2), (1.0, 1.0), "strictly decreasing"),
        ((4, 2), (0.5, 1.0), "strictly decreasing"),
        ((2, 4), (1.0, 0.5), "non-increasing"),
    ],
)
def test_shell_spec_validation(sizes, radii, match):
    with pytest.raises(ValueError, match=match):
        ShellSpec(sizes=sizes, radii=radii)


@pytest.mark.parametrize("sides, match", [((), "at least one"), ((4, 0), r"sides\[1\]"), ((4, 6), "non-increasing")])
def test_lattice_spec_validation(sides, match):
    with pytest.raises(ValueError, match=match):
        LatticeSpec(sides=sides)


# --------------------------------------------------------------------------- kNN


@pytest.mark.parametrize("dim", [2, 3])
def test_knn_within_matches_brute_force(dim):
    pos = torch.rand(60, dim, generator=_gen(1))
    k = 7
    ei = knn_within(pos, k)
    _check_layout(ei, 60, k, 60)
    assert not (ei[0] == ei[1]).any()
    ref = _brute_knn(pos, pos, k, exclude_self=True)
    nbr = ei[0].view(60, k)
    assert torch.equal(nbr.sort(dim=-1).values, ref.sort(dim=-1).values)
    # Nearest first within each target.
    dist = (pos[nbr] - pos.unsqueeze(1)).norm(dim=-1)
    assert (dist.diff(dim=-1) >= 0).all()


def test_knn_within_loop_and_max_k():
    pos = torch.rand(20, 3, generator=_gen(2))
    ei = knn_within(pos, 3, loop=True)
    _check_layout(ei, 20, 3, 20)
    assert torch.equal(ei[0].view(20, 3)[:, 0], torch.arange(20))  # self first
    ei = knn_within(pos, 19)  # every other node
    nbr = ei[0].view(20, 19).sort(dim=-1).values
    full = torch.arange(20).expand(20, 20)
    assert torch.equal(nbr, full[~torch.eye(20, dtype=torch.bool)].view(20, 19))


def test_knn_ties_and_duplicates_exactly_k():
    # Integer grid: many exact ties, several tie groups straddle the k-th place.
    g = torch.stack(torch.meshgrid(torch.arange(7.0), torch.arange(7.0), indexing="ij"), -1)
    pos = g.reshape(-1, 2).double()
    for k in (1, 3, 4, 5, 6, 9, 13):
        ei = knn_within(pos, k)
        _check_layout(ei, 49, k, 49)
        assert not (ei[0] == ei[1]).any()
        # Exactly the (distance, index) order, not only the same sets.
        assert torch.equal(ei[0].view(49, k), _brute_knn(pos, pos, k, exclude_self=True))
        assert torch.equal(ei, knn_within(pos, k))  # deterministic

    # Heavily duplicated points: knn_graph(loop=False) would yield k + 1 here.
    pos = torch.cat([torch.zeros(10, 3), torch.ones(5, 3)])
    ei = knn_within(pos, 3)
    _check_layout(ei, 15, 3, 15)
    assert not (ei[0] == ei[1]).any()
    assert torch.equal(ei[0].view(15, 3), _brute_knn(pos, pos, 3, exclude_self=True))
    assert ei[0].view(15, 3)[0].tolist() == [1, 2, 3]  # ties -> smaller index


def test_knn_cross_matches_brute_force():
    src = torch.randn(50, 3, generator=_gen(3))
    dst = torch.randn(20, 3, generator=_gen(4))
    ei = knn_cross(src, dst, 6, by_direction=False)
    _check_layout(ei, 20, 6, 50)
    ref = _brute_knn(src, dst, 6)
    assert torch.equal(ei[0].view(20, 6).sort(-1).values, ref.sort(-1).values)
    # Every source at once.
    ei = knn_cross(src, dst, 50, by_direction=False)
    _check_layout(ei, 20, 50, 50)


def test_knn_cross_by_direction_ignores_radius():
    src = _uniform_sphere(80, torch.float32, seed=5)
    dst = _uniform_sphere(30, torch.float32, seed=6)
    radii_src = 0.5 + torch.rand(80, 1, generator=_gen(7))
    ei_unit = knn_cross(src, dst, 5)
    ei_scaled = knn_cross(src * radii_src, dst * 0.2, 5)
    assert torch.equal(ei_unit, ei_scaled)
    # Without direction the radii matter (and nearest-by-position is used).
    ei_pos = knn_cross(src * radii_src, dst * 0.2, 5, by_direction=False)
    assert not torch.equal(ei_unit, ei_pos)
    ref = _brute_knn(src, dst, 5)
    assert torch.equal(ei_unit[0].view(30, 5).sort(-1).values, ref.sort(-1).values)


def test_knn_errors():
    pos = torch.rand(10, 3)
    for k in (0, -1, 10, 11):
        with pytest.raises(ValueError, match="k"):
            knn_within(pos, k)
    with pytest.raises(ValueError, match="k=11"):
        knn_within(pos, 11, loop=True)
    knn_within(pos, 10, loop=True)
    with pytest.raises(ValueError, match="N_src=10"):
        knn_cross(pos, torch.rand(4, 3), 11)
    with pytest.raises(ValueError, match="positive"):
        knn_cross(pos, torch.rand(4, 3), 0)
    with pytest.raises(ValueError, match="same dimension"):
        knn_cross(pos, torch.rand(4, 2), 2)
    with pytest.raises(ValueError, match="2-D"):
        knn_within(torch.rand(10), 2)
    with pytest.raises(ValueError, match="floating"):
        knn_within(torch.ones(10, 2, dtype=torch.long), 2)


def test_dense_neighbors():
    pos = torch.rand(25, 2, generator=_gen(8))
    ei = knn_within(pos, 4)
    nbr = dense_neighbors(ei, 25)
    assert nbr.shape == (25, 4)
    assert torch.equal(nbr.reshape(-1), ei[0])
    rebuilt = torch.stack([nbr.reshape(-1), torch.arange(25).repeat_interleave(4)])
    assert torch.equal(rebuilt, ei)
    # Irregular: one edge missing, unsorted targets, wrong node count, empty.
    assert dense_neighbors(ei[:, 1:], 25) is None
    assert dense_neighbors(ei.flip(1), 25) is None
    assert dense_neighbors(ei, 20) is None
    assert dense_neighbors(ei, 50) is None
    assert dense_neighbors(torch.empty(2, 0, dtype=torch.long), 5) is None


# --------------------------------------------------------------------------- Lambert


def test_lambert_round_trips_float64():
    p = torch.cat([_uniform_sphere(5000), torch.tensor([[0, 0, 1.0], [0, 0, -1.0 + 1e-9]]).double()])
    p = p / p.norm(dim=-1, keepdim=True)
    assert (square_to_sphere(sphere_to_square(p)) - p).abs().max() < 1e-10
    assert (disk_to_sphere(sphere_to_disk(p)) - p).abs().max() < 1e-10
    s = torch.rand(5000, 2, generator=_gen(9), dtype=torch.float64) * 2 - 1
    assert (sphere_to_square(square_to_sphere(s)) - s).abs().max() < 1e-10
    assert (disk_to_square(square_to_disk(s)) - s).abs().max() < 1e-10
    d = square_to_disk(s)
    assert d.norm(dim=-1).max() <= 2.0 + 1e-12
    assert (sphere_to_disk(disk_to_sphere(d)) - d).abs().max() < 1e-10


def test_lambert_round_trips_float32():
    p = _uniform_sphere(5000, torch.float32)
    # The map is singular at the south pole (its image is the whole square
    # boundary), so float32 rounding of the square coordinate is amplified
    # there; away from a small polar cap the round trip is accurate.
    p = p[p[:, 2] > -0.99]
    assert (square_to_sphere(sphere_to_square(p)) - p).abs().max() < 1e-5
    assert (disk_to_sphere(sphere_to_disk(p)) - p).abs().max() < 1e-5
    s = torch.rand(5000, 2, generator=_gen(10)) * 2 - 1
    assert (sphere_to_square(square_to_sphere(s)) - s).abs().max() < 1e-5
    assert (disk_to_square(square_to_disk(s)) - s).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lambert_poles_no_nan(dtype):
    p = torch.tensor(
        [[0, 0, 1], [0, 0, -1], [1e-20, 0, -1], [0, 1e-9, -1], [1e-9, 0, 1], [0, 0, 3.0]],
        dtype=dtype,
        requires_grad=True,
    )
    s = sphere_to_square(p)
    assert torch.isfinite(s).all()
    assert torch.allclose(s[0], torch.zeros(2, dtype=dtype))  # north pole -> centre
    assert torch.allclose(s[5], torch.zeros(2, dtype=dtype))  # any radius accepted
    assert s[1].abs().max() == 1  # south pole -> boundary
    s.sum().backward()
    assert torch.isfinite(p.grad).all()

    q = torch.tensor([[0, 0], [1, 1], [-1, 0], [1e-30, 1e-31], [0, 0.5]], dtype=dtype, requires_grad=True)
    out = square_to_sphere(q)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], torch.tensor([0, 0, 1], dtype=dtype))
    assert torch.allclose(out[1], torch.tensor([0, 0, -1], dtype=dtype))
    assert torch.allclose(out.norm(dim=-1), torch.ones(5, dtype=dtype))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    d = torch.zeros(1, 2, dtype=dtype, requires_grad=True)
    disk_to_square(d).sum().backward()
    assert torch.isfinite(d.grad).all()


def test_lambert_histogram_uniform():
    n, bins = 32000, 8
    s = sphere_to_square(_uniform_sphere(n, seed=11))
    assert s.abs().max() <= 1 + 1e-12
    cell = ((s + 1) / 2 * bins).long().clamp(0, bins - 1)
    counts = torch.bincount(cell[:, 1] * bins + cell[:, 0], minlength=bins * bins).double()
    expected = n / bins**2
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = bins * bins - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof)  # ~6 sigma of a chi-square(63)


def _tangent_basis(p0):
    a = torch.tensor([1.0, 0, 0], dtype=p0.dtype) if p0[0].abs() < 0.9 else torch.tensor([0, 1.0, 0], dtype=p0.dtype)
    e1 = torch.linalg.cross(p0, a)
    e1 = e1 / e1.norm()
    return e1, torch.linalg.cross(p0, e1)


def test_lambert_jacobian_constant_area():
    from torch.autograd.functional import jacobian

    for p0 in _uniform_sphere(6, seed=12):
        e1, e2 = _tangent_basis(p0)

        def chart(ab):
            q = p0 + ab[0] * e1 + ab[1] * e2
            return q / q.norm()

        zero = torch.zeros(2, dtype=torch.float64)
        det_square = torch.linalg.det(jacobian(lambda ab: sphere_to_square(chart(ab)), zero))
        det_disk = torch.linalg.det(jacobian(lambda ab: sphere_to_disk(chart(ab)), zero))
        assert abs(abs(det_square.item()) - 4 / (4 * math.pi)) < 1e-8
        assert abs(abs(det_disk.item()) - 1.0) < 1e-8

    for s0 in torch.rand(6, 2, generator=_gen(13), dtype=torch.float64) * 1.8 - 0.9:
        J = jacobian(square_to_sphere, s0)  # [3, 2]
        assert abs(torch.linalg.cross(J[:, 0], J[:, 1]).norm().item() - math.pi) < 1e-8
        assert abs(abs(torch.linalg.det(jacobian(square_to_disk, s0)).item()) - math.pi) < 1e-8


def test_lambert_shape_errors():
    with pytest.raises(ValueError, match=r"\[\.\.\., 3\]"):
        sphere_to_square(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2\]"):
        square_to_sphere(torch.zeros(4, 3))
    # Leading dimensions broadcast.
    assert sphere_to_square(_uniform_sphere(12).view(3, 4, 3)).shape == (3, 4, 2)


# --------------------------------------------------------------------------- Hierarchy


@pytest.fixture(scope="module", params=["shells", "lattice"])
def hierarchy(request):
    build = build_shell_hierarchy if request.param == "shells" else build_lattice_hierarchy
    return build()


def test_hierarchy_shapes(hierarchy):
    h = hierarchy
    dim = 3 if h.kind == "shells" else 2
    assert h.sizes == DEFAULT_SIZES and h.num_levels == 5
    assert h.k_cross == 8 and h.k_inner == 8
    for s, p in enumerate(h.pos):
        assert p.shape == (DEFAULT_SIZES[s], dim) and p.dtype == torch.float32
    assert len(h.cross_edges) == 4
    for s, ei in enumerate(h.cross_edges):
        _check_layout(ei, DEFAULT_SIZES[s + 1], 8, DEFAULT_SIZES[s])
        assert dense_neighbors(ei, DEFAULT_SIZES[s + 1]) is not None
        # Sources of one target are distinct.
        nbr = ei[0].view(-1, 8)
        assert (nbr.sort(-1).values.diff(dim=-1) > 0).all()
    _check_layout(h.inner_edges, 16, 8, 16)
    assert not (h.inner_edges[0] == h.inner_edges[1]).any()
    assert h.image_coords.shape == (256, 2) and h.image_coords.dtype == torch.float32
    assert h.image_coords.abs().max() <= 1


def test_shell_hierarchy_geometry():
    h = build_shell_hierarchy(dtype=torch.float64)
    assert h.kind == "shells" and h.pos[0].dtype == torch.float64
    for s in range(4):
        ref = _brute_knn(h.pos[s] / h.pos[s].norm(dim=-1, keepdim=True),
                         h.pos[s + 1] / h.pos[s + 1].norm(dim=-1, keepdim=True), 8)
        assert torch.equal(h.cross_edges[s][0].view(-1, 8).sort(-1).values, ref.sort(-1).values)
    assert torch.allclose(h.image_coords, sphere_to_square(h.pos[0]))
    # Equal-area: the 256 outer nodes fill the 4 quadrants of the image equally.
    quadrant = (h.image_coords[:, 0] > 0).long() * 2 + (h.image_coords[:, 1] > 0).long()
    assert (torch.bincount(quadrant, minlength=4) - 64).abs().max() <= 6


def test_lattice_hierarchy_geometry():
    h = build_lattice_hierarchy()
    assert h.kind == "lattice"
    # Row-major cell centres, x = column, y = row (grid_sample convention).
    assert torch.allclose(h.pos[0][0], torch.tensor([-15 / 16, -15 / 16]))
    assert torch.allclose(h.pos[0][1], torch.tensor([-13 / 16, -15 / 16]))
    assert torch.allclose(h.pos[0][16], torch.tensor([-15 / 16, -13 / 16]))
    assert torch.equal(h.image_coords, h.pos[0])
    assert torch.equal(lattice_grid(16), h.pos[0])
    # Ties broken towards the smaller index, exactly: corner 0 of the 4x4 grid.
    assert h.inner_edges[0, :8].tolist() == [1, 4, 5, 2, 8, 6, 9, 10]
    # Exactly the (distance, index) order, computed on exact integer coordinates.
    sides = LatticeSpec().sides
    for s in range(4):
        scale = math.lcm(sides[s], sides[s + 1])
        src = torch.round(h.pos[s].double() * scale)
        dst = torch.round(h.pos[s + 1].double() * scale)
        assert torch.equal(h.cross_edges[s][0].view(-1, 8), _brute_knn(src, dst, 8))
    assert torch.equal(h.inner_edges[0].view(16, 8), _brute_knn(h.pos[4] * 4, h.pos[4] * 4, 8, True))


def test_hierarchy_deterministic_and_dtype():
    for build in (build_shell_hierarchy, build_lattice_hierarchy):
        a, b = build(), build(dtype=torch.float64)
        assert b.pos[0].dtype == torch.float64 and b.image_coords.dtype == torch.float64
        for ea, eb in zip(a.cross_edges + [a.inner_edges], b.cross_edges + [b.inner_edges]):
            assert torch.equal(ea, eb)


def test_hierarchy_k_errors():
    with pytest.raises(ValueError, match="level 0"):
        build_shell_hierarchy(k_cross=300)
    with pytest.raises(ValueError, match="level 1"):
        build_shell_hierarchy(ShellSpec(sizes=(64, 4, 4), radii=(1.0, 0.5, 0.25)), k_cross=8, k_inner=3)
    with pytest.raises(ValueError, match="level 4"):
        build_lattice_hierarchy(k_inner=16)
    with pytest.raises(ValueError, match="level 2"):
        build_lattice_hierarchy(LatticeSpec(sides=(8, 4, 2)), k_inner=4)
    with pytest.raises(ValueError, match="k_cross"):
        build_lattice_hierarchy(k_cross=0)


def test_hierarchy_single_level_and_custom_k():
    h = build_shell_hierarchy(ShellSpec(sizes=(32,), radii=(1.0,)), k_inner=5)
    assert h.sizes == (32,) and h.cross_edges == []
    _check_layout(h.inner_edges, 32, 5, 32)
    h = build_lattice_hierarchy(LatticeSpec(sides=(6, 3)), k_cross=4, k_inner=2)
    _check_layout(h.cross_edges[0], 9, 4, 36)
    _check_layout(h.inner_edges, 9, 2, 9)


def test_hierarchy_validation():
    h = build_lattice_hierarchy(LatticeSpec(sides=(4, 2)), k_cross=4, k_inner=2)
    with pytest.raises(ValueError, match="kind"):
        Hierarchy("torus", h.pos, h.cross_edges, h.inner_edges, h.image_coords, 4, 2)
    with pytest.raises(ValueError, match="cross_edges"):
        Hierarchy("lattice", h.pos, [h.cross_edges[0][:, :-1]], h.inner_edges, h.image_coords, 4, 2)
    with pytest.raises(ValueError, match="cross edge sets"):
        Hierarchy("lattice", h.pos, [], h.inner_edges, h.image_coords, 4, 2)
    with pytest.raises(ValueError, match="inner_edges"):
        Hierarchy("lattice", h.pos, h.cross_edges, h.inner_edges, h.image_coords, 4, 3)
    with pytest.raises(ValueError, match="image_coords"):
        Hierarchy("lattice", h.pos, h.cross_edges, h.inner_edges, h.image_coords[1:], 4, 2)


def test_hierarchy_hetero_data_round_trip(hierarchy):
    h = hierarchy
    data = h.to_hetero_data()
    assert isinstance(data, HeteroData)
    assert data.node_types == [f"level{s}" for s in range(5)]
    for s, n in enumerate(DEFAULT_SIZES):
        assert data[f"level{s}"].num_nodes == n
        assert torch.equal(data[f"level{s}"].pos, h.pos[s])
    for s in range(4):
        assert data[f"level{s}", "to", f"level{s + 1}"].num_edges == DEFAULT_SIZES[s + 1] * 8
    assert data["level4", "near", "level4"].num_edges == 16 * 8
    assert len(data.edge_types) == 5
    data.validate()

    back = Hierarchy.from_hetero_data(data)
    assert back.kind == h.kind and back.sizes == h.sizes
    assert (back.k_cross, back.k_inner) == (h.k_cross, h.k_inner)
    for a, b in zip(back.cross_edges + [back.inner_edges, back.image_coords],
                    h.cross_edges + [h.inner_edges, h.image_coords]):
        assert torch.equal(a, b)


def test_hierarchy_to_device(hierarchy):
    h = hierarchy.to("cpu")
    assert isinstance(h, Hierarchy) and h.sizes == hierarchy.sizes
    assert all(p.device.type == "cpu" for p in h.pos)
    assert torch.equal(h.inner_edges, hierarchy.inner_edges)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda():
    h = build_shell_hierarchy(device="cuda")
    assert all(p.is_cuda for p in h.pos) and h.inner_edges.is_cuda and h.image_coords.is_cuda
    cpu = build_shell_hierarchy()
    assert torch.equal(h.to("cpu").cross_edges[0], cpu.cross_edges[0])
    pos = torch.rand(200, 3, generator=_gen(14), dtype=torch.float64)
    assert torch.equal(knn_within(pos.cuda(), 6).cpu(), knn_within(pos, 6))
    assert torch.equal(knn_cross(pos.cuda(), pos[:50].cuda(), 120).cpu(), knn_cross(pos, pos[:50], 120))
    p = _uniform_sphere(100).cuda()
    assert (square_to_sphere(sphere_to_square(p)) - p).abs().max() < 1e-10


@pytest.mark.requires_torch_cluster  # without it both sides are the fallback
def test_knn_without_torch_cluster_matches(monkeypatch):
    """The brute-force fallback (no torch_cluster installed) gives the same graphs."""
    import qsv_pyg.geometry.knn as knn_mod
    pos = fibonacci_sphere(300, dtype=torch.float64)
    src = fibonacci_sphere(120, dtype=torch.float64)
    within, cross = knn_within(pos, 8), knn_cross(src, pos, 6)
    monkeypatch.setattr(knn_mod, "torch_cluster", None)
    assert torch.equal(knn_mod.knn_within(pos, 8), within)
    assert torch.equal(knn_mod.knn_cross(src, pos, 6), cross)
