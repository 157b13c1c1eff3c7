"""Issue 14, items 8 and 12: QSVConv never masks a bad input and names every
wrong argument (no opaque torch error from inside the aggregation)."""
import pytest
import torch

from qsv_pyg.nn import QSVConv


def knn_like(n: int = 6, k: int = 3) -> torch.Tensor:
    """Target-sorted, fixed-degree edges (the layout of the image models)."""
    src = (torch.arange(n).view(-1, 1) + torch.arange(1, k + 1).view(1, -1)) % n
    return torch.stack([src.reshape(-1), torch.arange(n).repeat_interleave(k)])


def given_field_conv(**kwargs) -> QSVConv:
    torch.manual_seed(0)
    return QSVConv(8, 4, heads=2, quat_source="given", **kwargs).eval()


# ------------------------------------------------ item 8: silent masking
@pytest.mark.parametrize("batched", [False, True])
def test_nan_quaternion_propagates_without_check_finite(batched):
    conv = given_field_conv(check_finite=False)
    ei = knn_like()
    x = torch.randn(2, 6, 8) if batched else torch.randn(6, 8)
    quat = torch.randn(6, 2, 4, requires_grad=True)
    bad = quat.detach().clone()
    bad[2, 0] = float("nan")
    bad.requires_grad_()
    out = conv(x, ei, quat=bad)
    # Node 2 is its own target and a source of nodes 0 and 1 (head 0).
    rows = out[..., 2, :] if batched else out[2]
    assert torch.isnan(rows).any(), "a NaN quaternion was masked"
    out.nan_to_num().sum().backward()
    assert torch.isnan(bad.grad[2, 0]).any(), "the NaN quaternion got a zero gradient"


def test_zero_quaternion_still_means_identity():
    conv = given_field_conv(check_finite=False)
    quat = torch.randn(6, 2, 4)
    quat[1] = 0.0
    out = conv(torch.randn(6, 8), knn_like(), quat=quat)
    assert torch.isfinite(out).all()


def test_overflowing_beta_is_refused_with_check_finite():
    conv = given_field_conv()
    with torch.no_grad():
        conv.log_beta.fill_(1000.0)  # exp overflows to inf
    with pytest.raises(ValueError, match="non-finite routing temperatures beta"):
        conv(torch.randn(6, 8), knn_like(), quat=torch.randn(6, 2, 4))


def test_non_finite_positions_are_refused_with_check_finite():
    conv = QSVConv(8, 4, heads=2, routing="geometric").eval()
    pos = torch.randn(6, 3)
    pos[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite source positions"):
        conv(torch.randn(6, 8), knn_like(), pos=pos)


@pytest.mark.parametrize("batched", [False, True])
def test_three_row_edge_index_is_refused(batched):
    ei = knn_like()
    ei3 = torch.cat([ei, ei[:1]], dim=0)  # [3, E], target-sorted rows 0..1
    conv = given_field_conv()
    x = torch.randn(2, 6, 8) if batched else torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, num_edges\]"):
        conv(x, ei3, quat=torch.randn(6, 2, 4))


# --------------------------------------- item 12: opaque errors -> messages
def test_float_edge_index_is_named():
    conv = given_field_conv()
    with pytest.raises(ValueError, match="edge_index must be an integer tensor"):
        conv(torch.randn(6, 8), knn_like().float(), quat=torch.randn(6, 2, 4))


@pytest.mark.parametrize("rows", [5, 7])
def test_pos_with_wrong_row_count_is_named(rows):
    conv = QSVConv(8, 4, heads=2, routing="geometric").eval()
    with pytest.raises(ValueError, match=rf"pos \(source\) has {rows} rows but there "
                                         rf"are 6 source nodes"):
        conv(torch.randn(6, 8), knn_like(), pos=torch.randn(rows, 3))


def test_integer_features_are_named():
    conv = QSVConv(8, 4, heads=2).eval()
    with pytest.raises(ValueError, match="x \\(source features\\) must be a floating-point"):
        conv(torch.randint(0, 5, (6, 8)), knn_like())


def test_integer_quaternions_are_named():
    conv = given_field_conv()
    with pytest.raises(ValueError, match="source quaternions \\(quat\\) must be a "
                                         "floating-point"):
        conv(torch.randn(6, 8), knn_like(), quat=torch.randint(0, 3, (6, 2, 4)))


def test_integer_positions_are_named():
    conv = QSVConv(8, 4, heads=2, routing="geometric").eval()
    with pytest.raises(ValueError, match="pos \\(source\\) must be a floating-point"):
        conv(torch.randn(6, 8), knn_like(), pos=torch.randint(0, 3, (6, 3)))
