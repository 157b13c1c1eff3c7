"""qsv_pyg.geometry.frames: local PCA frames and their quaternions."""
from __future__ import annotations

import pytest
import torch

from qsv_pyg.geometry import frame_quaternions, local_frames, matrix_to_quaternion
from qsv_pyg.nn import QSVConv
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion


def _knn(pos: torch.Tensor, k: int) -> torch.Tensor:
    """Brute-force kNN graph (source -> target), nearest first, no self-loops."""
    dist = torch.cdist(pos, pos)
    dist.fill_diagonal_(float("inf"))
    src = dist.topk(k, largest=False).indices
    return torch.stack([src.reshape(-1), torch.arange(pos.size(0)).repeat_interleave(k)])


def _rotation(seed: int) -> torch.Tensor:
    q = random_unit_quaternion(generator=torch.Generator().manual_seed(seed)).double()
    return quaternion_to_matrix(q / q.norm())


def _cloud(n: int = 80, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64) * torch.tensor(
        [1.0, 0.6, 0.3], dtype=torch.float64)


def test_matrix_to_quaternion_inverts_quaternion_to_matrix():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2000, 4, generator=g, dtype=torch.float64)
    # Include the identity and half turns (w = 0), where formulas lose precision.
    q[:4] = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0.6, 0, 0.8]],
                         dtype=torch.float64)
    q[4:8, 0] = 1e-9
    q = q / q.norm(dim=-1, keepdim=True)
    back = matrix_to_quaternion(quaternion_to_matrix(q))
    assert (back[:, 0] >= 0).all()
    torch.testing.assert_close(quaternion_to_matrix(back), quaternion_to_matrix(q),
                               atol=1e-12, rtol=0)
    canon = torch.where(q[:, :1] < 0, -q, q)
    ok = q[:, 0].abs() > 1e-6  # the sign is a convention only at w = 0
    torch.testing.assert_close(back[ok], canon[ok], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"\(\.\.\., 3, 3\)"):
        matrix_to_quaternion(torch.eye(4))


def test_frames_are_rotations_and_isolated_nodes_get_identity():
    pos = _cloud()
    ei = _knn(pos, 8)
    ei = ei[:, ei[1] != 0]  # node 0 has no incoming edges
    frames = local_frames(pos, ei)
    eye = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(frames.transpose(1, 2) @ frames, eye.expand(80, 3, 3))
    torch.testing.assert_close(torch.linalg.det(frames), torch.ones(80, dtype=torch.float64))
    torch.testing.assert_close(frames[0], eye)
    with pytest.raises(ValueError, match=r"\[num_nodes, 3\]"):
        local_frames(pos[:, :2], ei)


def test_frames_rotate_with_the_cloud():
    pos = _cloud()
    ei = _knn(pos, 8)
    g = _rotation(1)
    frames = local_frames(pos, ei)
    torch.testing.assert_close(local_frames(pos @ g.T, ei), g @ frames,
                               atol=1e-9, rtol=0)


def test_qsv_with_frame_quaternions_is_rotation_invariant():
    """Local-frame features + frame quaternions + |Re r| routing: a rotated cloud
    gives the same output, while global coordinates with feature quaternions do not."""
    pos = _cloud(60, seed=2)
    g = _rotation(3)
    torch.manual_seed(0)
    conv = QSVConv(4, 6, heads=1, routing="abs", quat_source="given").double()
    plain = QSVConv(4, 6, heads=1).double()

    def run(p):
        ei = _knn(p, 8)
        frames = local_frames(p, ei)
        local = (frames.transpose(1, 2) @ p.unsqueeze(-1)).squeeze(-1)
        x_local = torch.cat([p.norm(dim=1, keepdim=True), local], 1)
        x_xyz = torch.cat([p.norm(dim=1, keepdim=True), p], 1)
        return conv(x_local, ei, quat=frame_quaternions(p, ei)), plain(x_xyz, ei)

    inv, var = run(pos)
    inv_rot, var_rot = run(pos @ g.T)
    torch.testing.assert_close(inv_rot, inv, atol=1e-9, rtol=0)
    assert (var_rot - var).abs().max() > 1e-2
