"""Input checks and quaternion normalisation for :class:`~qsv_pyg.nn.QSVConv`.

Every check raises :class:`ValueError` naming the argument and what was wrong,
so that a bad call never surfaces as an opaque torch error from deep inside
the aggregation.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch_geometric import is_compiling
from torch_geometric.typing import OptTensor
from torch_geometric.utils import is_torch_sparse_tensor


class _UnitQuaternion(torch.autograd.Function):
    """``q / |q|`` with norms ``<= eps`` mapped to the identity, as one autograd
    node (the ops autograd would record for it cost more at a few thousand
    nodes; see benchmarks/README.md).

    The backward is itself differentiable (second derivatives are exact): it
    uses the saved output ``unit`` (which autograd tracks back to ``q``) and,
    when a graph of the backward is being built (``create_graph=True``), a
    norm recomputed from ``q`` rather than the constant saved one. A plain
    first-order backward uses the saved norm, as before."""

    @staticmethod
    def forward(ctx, q: Tensor, eps: float) -> Tensor:
        norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        # `~(norm <= eps)` rather than `norm > eps`: a NaN norm must take the
        # division branch so that the NaN propagates instead of being masked.
        ok = ~(norm <= eps)
        identity = q.new_zeros(4)
        identity[0] = 1.0
        unit = torch.where(ok, q / norm.clamp_min(eps), identity)
        ctx.save_for_backward(q, unit, norm, ok)
        ctx.eps = eps
        return unit

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, unit, norm, ok = ctx.saved_tensors
        if torch.is_grad_enabled():
            # Double backward: |q| must be a function of q, not a constant
            # (treating it as one made second derivatives wrong).
            norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        # d(q/|q|) = (g - u <u, g>) / |q|; the identity branch is constant.
        g = (grad - unit * (unit * grad).sum(dim=-1, keepdim=True)) / norm.clamp_min(ctx.eps)
        return g.masked_fill(~ok, 0.0), None


def unit_quaternion(q: Tensor, eps: float = 1e-8) -> Tensor:
    r"""Normalise ``q`` (``[..., 4]``); norms below ``eps`` become the identity.

    A zero quaternion has no direction, and dividing by its norm would give NaN.
    Mapping it to the identity rotation ``(1, 0, 0, 0)`` keeps the layer finite
    and gives such a node "no rotation" (its transport is the identity and its
    learned logit against a neighbour is that neighbour's real part). The
    gradient there is zero. A quaternion with a NaN or infinite component is
    not small: it stays NaN (it is never masked as the identity), so a bad
    input shows in the output.
    """
    if q.size(-1) != 4:
        raise ValueError(f"quaternions must have a last dimension of size 4, got "
                         f"shape {tuple(q.shape)}")
    return _UnitQuaternion.apply(q, eps)


def check_edge_index(edge_index: Tensor) -> None:
    """A plain edge index must be an integer ``[2, E]`` tensor."""
    if edge_index.is_floating_point() or edge_index.is_complex() \
            or edge_index.dtype == torch.bool:
        raise ValueError(f"edge_index must be an integer tensor (torch.long), got "
                         f"{edge_index.dtype}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, num_edges], got "
                         f"{tuple(edge_index.shape)}")


def check_float(t: Optional[Tensor], name: str) -> None:
    """``t`` (when given) must be a floating-point tensor."""
    if t is not None and not t.is_floating_point():
        raise ValueError(f"QSVConv: {name} must be a floating-point tensor, got {t.dtype}")


def check_finite(t: Optional[Tensor], name: str) -> None:
    """Raise on NaN or infinite entries (one reduction and a host sync)."""
    if t is not None and not bool(torch.isfinite(t).all()):
        raise ValueError(f"QSVConv received non-finite {name}")


def check_rows(t: Tensor, rows: int, name: str, what: str) -> None:
    """``t`` must have one row per node of its side (``t.size(-2) == rows``)."""
    if t.dim() != 2:
        raise ValueError(f"QSVConv: {name} must have shape [num_nodes, dim], got "
                         f"{tuple(t.shape)}")
    if t.size(0) != rows:
        raise ValueError(f"QSVConv: {name} has {t.size(0)} rows but there are {rows} "
                         f"{what} nodes")


def check_call(conv, x_src: Tensor, x_dst: OptTensor, edge_index) -> None:
    """Shapes, dtypes and (with ``conv.check_finite``) finiteness of a call."""
    if x_src.dim() not in (2, 3):
        raise ValueError(f"QSVConv expects node features of shape [num_nodes, "
                         f"channels] or [batch, num_nodes, channels] (a static "
                         f"graph shared by the batch); got {tuple(x_src.shape)}")
    check_float(x_src, "x (source features)")
    check_float(x_dst, "x[1] (target features)")
    if isinstance(edge_index, Tensor) and not is_torch_sparse_tensor(edge_index):
        check_edge_index(edge_index)
    if x_dst is not None and x_dst.dim() != x_src.dim():
        raise ValueError(f"source and target features must have the same number "
                         f"of dimensions; got {tuple(x_src.shape)} and "
                         f"{tuple(x_dst.shape)}")
    if conv.check_finite and not is_compiling():
        check_finite(x_src, "node features")
        check_finite(x_dst if x_dst is not x_src else None, "node features")
        # An overflowing temperature would turn every weight into NaN.
        check_finite(conv.log_beta.exp(), "routing temperatures beta (exp(log_beta))")

def positions(conv, pos, num_src: int, num_dst: int) -> Tuple[OptTensor, OptTensor]:
    """The checked ``(source, target)`` positions for geometric routing."""
    if conv.routing != "geometric":
        return None, None
    if pos is None:
        raise ValueError("routing='geometric' needs node positions: pass pos")
    pair = (pos, pos) if isinstance(pos, Tensor) else (pos[0], pos[1])
    if pair[0] is None or pair[1] is None:
        raise ValueError("routing='geometric' needs positions of source and "
                         "target nodes")
    for t, rows, side in ((pair[0], num_src, "source"), (pair[1], num_dst, "target")):
        check_float(t, f"pos ({side})")
        check_rows(t, rows, f"pos ({side})", side)
        if conv.check_finite and not is_compiling():
            check_finite(t, f"{side} positions (pos)")
    return pair
