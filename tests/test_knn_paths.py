"""Both kNN paths (torch_cluster's candidates, and the exact brute force used
without it, on any device) give the same canonical graphs: the k nearest in
(distance, source index) order, ties included."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qsv_pyg.geometry.knn as knn
from qsv_pyg.geometry import fibonacci_sphere, knn_cross, knn_within

ROOT = Path(__file__).resolve().parents[1]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _reference(src, dst, k, exclude_self=False):
    """Every source sorted by (squared distance, index): the definition."""
    d = (src.unsqueeze(0) - dst.unsqueeze(1)).pow(2).sum(-1)
    if exclude_self:
        d.fill_diagonal_(float("inf"))
    return torch.sort(d, dim=1, stable=True).indices[:, :k]


def _point_sets():
    lattice = torch.stack(torch.meshgrid(torch.arange(9.0), torch.arange(7.0),
                                         indexing="ij"), -1).reshape(-1, 2)
    return {
        "random": torch.rand(300, 3, generator=_gen(1), dtype=torch.float64),
        "sphere": fibonacci_sphere(256, dtype=torch.float64),
        "lattice-ties": lattice,  # integer coordinates: exact equidistant sources
        "duplicates": torch.rand(40, 2, generator=_gen(2)).repeat(3, 1),
        # Far from the origin in float32: a matrix-product distance (cdist's
        # |x|^2 + |y|^2 - 2xy) loses every digit of the small differences.
        "offset-f32": 1000.0 + torch.rand(200, 3, generator=_gen(3)),
    }


@pytest.fixture
def brute_force(monkeypatch):
    """The path without torch_cluster, in several chunks."""
    monkeypatch.setattr(knn, "torch_cluster", None)
    monkeypatch.setattr(knn, "BRUTE_FORCE_ELEMENTS", 2000)


@pytest.mark.parametrize("kind", list(_point_sets()))
def test_brute_force_gives_the_canonical_graph(kind, brute_force):
    pos = _point_sets()[kind]
    for k in (1, 6, 13):
        ei = knn_within(pos, k)
        assert torch.equal(ei[0].view(-1, k), _reference(pos, pos, k, exclude_self=True)), k
    src, dst = pos[::2], pos[1::3]
    ei = knn_cross(src, dst, 5, by_direction=False)
    assert torch.equal(ei[0].view(-1, 5), _reference(src, dst, 5))


def test_brute_force_memory_is_bounded(brute_force, monkeypatch):
    """No chunk holds more than BRUTE_FORCE_ELEMENTS differences."""
    sizes = []
    original = torch.Tensor.topk

    def spy(t, *args, **kwargs):
        sizes.append(t.numel() * 3)  # [chunk, N_src] distances of 3-D points
        return original(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    pos = torch.rand(300, 3, generator=_gen(4))
    knn_within(pos, 4)
    assert len(sizes) >= math.ceil(300 / (2000 // (300 * 3)))
    assert max(sizes) <= 2000


@pytest.mark.requires_torch_cluster
@pytest.mark.parametrize("kind", list(_point_sets()))
def test_torch_cluster_and_brute_force_agree(kind, monkeypatch):
    pos = _point_sets()[kind]
    if kind == "offset-f32":
        pos = pos.double()  # torch_cluster's own float32 arithmetic may differ there
    src, dst = pos[::2], pos[1::3]
    with_cluster = [knn_within(pos, k) for k in (1, 6, 13)] + [knn_cross(src, dst, 5)]
    monkeypatch.setattr(knn, "torch_cluster", None)
    without = [knn_within(pos, k) for k in (1, 6, 13)] + [knn_cross(src, dst, 5)]
    for a, b in zip(with_cluster, without):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_package_works_with_the_extras_hidden(tmp_path):
    """torch_scatter and torch_cluster unimportable (as on the GPU image): the
    kNN falls back, a GraphNet builds and trains a step."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['torch_cluster'] = None\nsys.modules['torch_scatter'] = None\n")
    code = (
        "import torch, qsv_pyg.geometry.knn as k\n"
        "assert k.torch_cluster is None\n"
        "from qsv_pyg.models import build_model\n"
        "m = build_model('qsv', shell_sizes=[16, 9, 4], k_cross=4, k_inner=3, heads=2,"
        " widths=[16, 16, 16])\n"
        "m(torch.randn(2, 3, 32, 32)).sum().backward()\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok"), out.stdout
