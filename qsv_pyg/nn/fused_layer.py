r"""QSVConv's common configuration as one registered operator, ``qsv_pyg::attend_layer``.

.. math::
    q = \operatorname{unit}(W_q x + b_q), \quad
    \mathbf{x}'_i = \big\Vert_{h} \mathbf{W}_h \mathbf{z}_i^{(h)}
        + \mathbf{W}_r \mathbf{x}_i + \mathbf{b},

with :math:`\mathbf{z}` the attention of :func:`~qsv_pyg.nn.qsv_kernel.qsv_attend`
with the unit quaternions as transport and keys of both ends (learned routing,
:math:`\beta = \exp(\log\beta)`): :class:`~qsv_pyg.nn.QSVConv`'s default layer
on a homogeneous graph (feature quaternions, ``routing="learned"``,
``transport="sandwich"``, root weight, bias, no edge terms; the heads
concatenated or averaged; features of any width, zero-padded to ``4 * heads``
for the heads as the layer pads them; attention dropout as a per-edge scale,
as ``qsv_pyg::attend`` takes it).

Why a second operator: on the Triton path the layer composed of
``qsv_pyg::attend`` and its own PyTorch ops launches 26 kernels per
forward+backward; this one launches 10 (:mod:`qsv_pyg.nn.triton_layer`; issue
32's aim) and keeps less for the backward (``z`` and the normalisation's
divisors: ``y`` is recomputed, ``h = x [W_q; W_r]^T`` not kept). Off the
Triton path it computes the composition itself (for ``opcheck`` and direct
callers), so :meth:`QSVConv.fused_layer_reason <qsv_pyg.nn.QSVConv>` sends a
layer's call here only on the Triton path (``QSV_PYG_FUSED_LAYER=0``: never).
The backward is written out (one autograd node for the whole layer); under
``create_graph=True`` it is autograd of the composition (:func:`reference`),
so second derivatives are exact.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quaternion import unit_quaternion
from . import triton_kernel, triton_layer
from .csr import GraphCSR

#: ``QSV_PYG_FUSED_LAYER``: ``1`` (default: use the operator where it applies) or
#: ``0`` (never: the layer composes ``qsv_pyg::attend`` with its own ops). Read
#: at every call.
FUSED_LAYER_ENV = "QSV_PYG_FUSED_LAYER"
#: The quaternion normalisation's threshold (:func:`~qsv_pyg.quaternion.unit_quaternion`).
EPS = 1e-8


def enabled() -> bool:
    return os.environ.get(FUSED_LAYER_ENV, "1") != "0"


def _project(z: Tensor, weight: Tensor, mean: bool) -> Tensor:
    """The per-head projection of ``z`` ``[N, H, C]``: ``[N, H F]``, or the mean
    over heads ``[N, F]``."""
    proj = torch.bmm(z.transpose(0, 1), weight)  # [H, N, F]
    return proj.mean(0) if mean else proj.transpose(0, 1).reshape(z.size(0), -1)


def _values(x: Tensor, weight: Tensor) -> Tensor:
    """``x`` zero-padded to the ``H C`` channels the heads read (QSVConv's
    ``pad_source``), or ``x`` itself."""
    width = weight.size(0) * weight.size(1)
    return x if x.size(-1) == width else F.pad(x, (0, width - x.size(-1)))


def reference(x: Tensor, w_cat: Tensor, b_quat: Tensor, bias: Tensor, weight: Tensor,
              log_beta: Tensor, scale: Tensor, rowptr: Tensor, col: Tensor, row: Tensor,
              rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor,
              mean: bool = False) -> Tuple[Tensor, Tensor]:
    """The operator as the composition the layer runs (differentiable PyTorch ops
    and ``qsv_pyg::attend``): ``(out, alpha)``."""
    from .qsv_kernel import attend
    N = x.size(0)
    H, C, _ = weight.shape
    q = unit_quaternion(F.linear(x, w_cat[:4 * H], b_quat).view(N, H, 4), EPS)
    v = _values(x, weight).reshape(N, H, C // 4, 4)
    z, alpha, _, _, _ = attend(v, q, q, q, q, log_beta.exp(), scale,
                               x.new_empty(0, H), rowptr, col, row, rowptr_t, perm_t, row_t,
                               False, True)
    return _project(z.view(N, H, C), weight, mean) + F.linear(x, w_cat[4 * H:]) + bias, alpha


Tensors7 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _divisors(hq: Tensor) -> Tensor:
    """The normalisation's divisor of every raw quaternion ``[N, H, 4]`` -> ``[N,
    H]``: its norm, -1 where the identity is taken (as ``layer_rotate_rows``
    stores it)."""
    n = torch.linalg.vector_norm(hq, dim=-1)
    return torch.where(n <= EPS, torch.full_like(n, -1.0), n)


@torch.library.custom_op("qsv_pyg::attend_layer", mutates_args=())
def attend_layer(x: Tensor, w_cat: Tensor, b_quat: Tensor, bias: Tensor, weight: Tensor,
                 log_beta: Tensor, scale: Tensor, rowptr: Tensor, col: Tensor, row: Tensor,
                 rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor, mean: bool) -> Tensors7:
    """``(out, alpha, nrm, qn, u, z, v)``: the output ``[N, H F]`` (with ``mean``,
    ``concat=False``: the mean over heads ``[N, F]``), the weights ``[E, H]`` in
    the graph's target-sorted order, and what the backward reads: the
    normalisation's divisors ``[N, H]`` (-1 where the identity was taken), the
    unit quaternions, the rotated sources, the aggregate ``z`` (the backward
    recomputes ``y = Q z``; ``h = x w_cat^T`` is not kept) and ``v``, the
    features zero-padded to ``H C`` channels when they need it (else empty).
    ``x``: ``[N, F_in]``, ``F_in <= H C``; ``w_cat``: the quaternion map's
    matrix over the root weight's, ``[4 H + R, F_in]`` (``R``: ``H F``, or ``F``
    with ``mean``); ``scale``: the per-edge scale ``[E, H]`` of the aggregation
    in the graph's target-sorted order (attention dropout's mask; a constant),
    or empty."""
    x = x.contiguous()
    v = _values(x, weight)
    padded = v if v is not x else x.new_empty(0)  # (an output must not alias an input)
    if triton_kernel.available(x):
        return (*triton_layer.forward(x, v, w_cat.contiguous(), b_quat.contiguous(),
                                      bias.contiguous(), weight.contiguous(),
                                      log_beta.contiguous(), scale.contiguous(), rowptr, col,
                                      mean, EPS), padded)
    # Elsewhere (no Triton) the composition itself.
    from .qsv_kernel import attend
    N, H = x.size(0), weight.size(0)
    C = weight.size(1)
    h = torch.mm(x, w_cat.t())  # (as on the Triton path: the quaternion bias added after)
    hq = h[:, :4 * H].add(b_quat).view(N, H, 4)
    qn = unit_quaternion(hq, EPS)
    z, alpha, u, _, _ = attend(v.reshape(N, H, C // 4, 4), qn, qn, qn, qn, log_beta.exp(),
                               scale, x.new_empty(0, H), rowptr, col, row, rowptr_t, perm_t,
                               row_t, False, True)
    out = _project(z.view(N, H, C), weight, mean) + h[:, 4 * H:] + bias
    return out, alpha, _divisors(hq), qn, u, z, padded


@attend_layer.register_fake
def _(x, w_cat, b_quat, bias, weight, log_beta, scale, rowptr, col, row, rowptr_t, perm_t,
      row_t, mean):
    N = x.size(0)
    H, C, Fo = weight.shape
    E = col.size(0)
    feats = x.new_empty(N, H, C // 4, 4)
    padded = x.new_empty(N, H * C) if x.size(1) != H * C else x.new_empty(0)
    return (x.new_empty(N, Fo if mean else H * Fo), x.new_empty(E, H), x.new_empty(N, H),
            x.new_empty(N, H, 4), feats, x.new_empty(feats.shape), padded)


def _setup_context(ctx, inputs, output):
    ctx.mean = inputs[-1]
    ctx.save_for_backward(*inputs[:-1], *output[1:])
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)


@torch.library.custom_op("qsv_pyg::attend_layer_backward", mutates_args=())
def attend_layer_backward(g: Tensor, galpha: Optional[Tensor], v: Tensor, weight: Tensor,
                          log_beta: Tensor, scale: Tensor, rowptr: Tensor, col: Tensor,
                          row: Tensor, rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor,
                          alpha: Tensor, nrm: Tensor, qn: Tensor, u: Tensor, z: Tensor,
                          need_v: bool, mean: bool) -> Tuple[Tensor, Tensor]:
    """``(gv, gh)``: the gradient of the attention's values ``v`` ``[N, H C]``
    (the features, padded; empty unless ``need_v``) and the buffer ``gh``
    ``[N, 4H + R + H]`` (``R``: the output width) whose row sum holds the
    quaternion bias's, the bias's and log beta's gradients and whose first
    ``4H + R`` columns are d h (:mod:`qsv_pyg.nn.triton_layer`)."""
    if triton_kernel.available(v):
        gv, gh = triton_layer.backward(g.contiguous(), galpha, v.contiguous(),
                                       weight.contiguous(), log_beta.contiguous(),
                                       scale.contiguous(), rowptr, col, rowptr_t, perm_t,
                                       row_t, alpha, nrm, qn, u, z, need_v, mean)
        return gv.view(v.shape) if need_v else gv, gh
    # Elsewhere: autograd of the composition for the same buffer (log beta's
    # whole gradient in the first row), the normalisation's backward from the
    # saved divisors as on the Triton path.
    from .qsv_kernel import attend
    N = v.size(0)
    H, C, Fo = weight.shape
    with torch.enable_grad():
        vv = v.detach().requires_grad_(True)
        q = qn.detach().requires_grad_(True)
        lb = log_beta.detach().requires_grad_(True)
        zz, a, _, _, _ = attend(vv.reshape(N, H, C // 4, 4), q, q, q, q, lb.exp(), scale,
                                v.new_empty(0, H), rowptr, col, row, rowptr_t, perm_t, row_t,
                                False, True)
        outs, grads = [_project(zz.view(N, H, C), weight.detach(), mean)], [g]
        if galpha is not None:
            outs.append(a)
            grads.append(galpha)
        gv, gq, glb = torch.autograd.grad(outs, [vv, q, lb], grads, allow_unused=True)
    n = nrm.unsqueeze(-1)
    graw = torch.where(n < 0, torch.zeros_like(gq),
                       (gq - qn * (qn * gq).sum(-1, keepdim=True)) / n)
    gbeta = torch.zeros(N, H, dtype=v.dtype, device=v.device)
    gbeta[:1] = glb
    gh = torch.cat([graw.reshape(N, 4 * H), g, gbeta], dim=1)
    return gv if need_v else v.new_empty(0), gh


@attend_layer_backward.register_fake
def _(g, galpha, v, weight, log_beta, scale, rowptr, col, row, rowptr_t, perm_t, row_t, alpha,
      nrm, qn, u, z, need_v, mean):
    H, _, Fo = weight.shape
    return (v.new_empty(v.shape) if need_v else v.new_empty(0),
            v.new_empty(v.size(0), 4 * H + (Fo if mean else H * Fo) + H))


def _backward(ctx, g_out, g_alpha, *_unused):
    (x, w_cat, b_quat, bias, weight, log_beta, scale, rowptr, col, row, rowptr_t, perm_t,
     row_t, alpha, nrm, qn, u, z, padded) = ctx.saved_tensors
    need, mean = ctx.needs_input_grad, ctx.mean
    graph = (rowptr, col, row, rowptr_t, perm_t, row_t)
    if g_out is None and g_alpha is None:
        return (None, ) * 14
    if g_out is None:
        g_out = x.new_zeros(x.size(0), w_cat.size(0) - 4 * weight.size(0))
    if torch.is_grad_enabled():
        # create_graph=True: autograd of the composition, on the saved inputs
        # themselves (exact second derivatives; the forward recomputed).
        inputs = (x, w_cat, b_quat, bias, weight, log_beta)
        out, alpha_r = reference(*inputs, scale.detach(), *graph, mean)
        wanted = [t for t, n in zip(inputs, need[:6]) if n]
        outs, grads = [out], [g_out]
        if g_alpha is not None:
            outs.append(alpha_r)
            grads.append(g_alpha)
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True,
                                       create_graph=True))
        return (*(next(got) if n else None for n in need[:6]), *(None, ) * 8)
    N, width = x.shape
    H, C, Fo = weight.shape
    g_out = g_out.contiguous()
    v = padded if padded.numel() else x.contiguous()  # the attention's values
    gv, gh = attend_layer_backward(g_out, None if g_alpha is None else g_alpha.contiguous(),
                                   v, weight, log_beta, scale, *graph, alpha, nrm, qn, u, z,
                                   need[0], mean)
    rows = w_cat.size(0)  # 4 H + the root width (H F, or F for the mean)
    gx = gw_cat = gb_quat = gbias = gweight = glog_beta = None
    if need[2] or need[3] or need[5]:
        sums = gh.sum(0)  # the quaternion bias, the output bias, log beta at once
        gb_quat, gbias, glog_beta = sums[:4 * H], sums[4 * H:rows], sums[rows:]
    if need[4] and mean:  # d W_h = z_h^T g / H, one matmul (beta = 0: the input unread)
        gweight = torch.addmm(z.new_empty(()), z.view(N, H * C).t(), g_out, beta=0,
                              alpha=1.0 / H).view(H, C, Fo)
    elif need[4]:  # d W_h = z_h^T g_h, both read strided
        gweight = torch.bmm(z.view(N, H, C).permute(1, 2, 0),
                            g_out.view(N, H, Fo).transpose(0, 1))
    if need[0]:  # d x = d v (less its padding) + gh [W_q; W_r]
        gx = torch.addmm(gv[:, :width] if padded.numel() else gv, gh[:, :rows], w_cat)
    if need[1]:
        gw_cat = torch.mm(gh[:, :rows].t(), x)
    return (gx, gw_cat, gb_quat if need[2] else None, gbias if need[3] else None, gweight,
            glog_beta if need[5] else None, *(None, ) * 8)  # scale: a constant


attend_layer.register_autograd(_backward, setup_context=_setup_context)
for _device in ("cpu", "cuda"):  # a float32 operator under autocast, as qsv_pyg::attend
    torch.library.register_autocast("qsv_pyg::attend_layer", _device, torch.float32)


def qsv_attend_layer(x: Tensor, w_quat: Tensor, b_quat: Tensor, w_root: Tensor,
                     bias: Tensor, weight: Tensor, log_beta: Tensor, graph: GraphCSR,
                     edge_scale: Optional[Tensor] = None,
                     concat: bool = True) -> Tuple[Tensor, Tensor]:
    r"""The layer's output ``[N, H F]`` (``[N, F]``, the mean over heads, when not
    ``concat``) and attention weights ``[E, H]`` (in the graph's target-sorted
    edge order) over ``graph`` (``N`` nodes, homogeneous).

    Args:
        x: node features ``[N, 4 H M]``.
        w_quat, b_quat: the quaternion map ``[4 H, 4 H M]``, ``[4 H]``.
        w_root, bias: the root weight ``[H F, 4 H M]`` and the bias ``[H F]``
            (``[F, 4 H M]`` and ``[F]`` when not ``concat``).
        weight: the per-head projection ``[H, 4 M, F]``.
        log_beta: the routing temperatures' logarithms ``[H]``.
        edge_scale: an optional per-edge scale ``[E, H]`` of the aggregation in
            the graph's target-sorted order (attention dropout's mask divided by
            ``1 - p``), a constant; the returned weights are unscaled.
    """
    H = weight.size(0)
    scale = x.new_empty(0, H) if edge_scale is None else edge_scale.to(x.dtype)
    out, alpha, *_ = attend_layer(x, torch.cat([w_quat, w_root]), b_quat, bias, weight,
                                  log_beta, scale, graph.rowptr, graph.col, graph.row,
                                  graph.rowptr_t, graph.perm_t, graph.row_t, not concat)
    return out, alpha


def unavailable(x: Tensor) -> Optional[str]:
    """Why the operator cannot take features like ``x`` (None: it can): it runs
    float32/float64 features on the Triton path; under autocast float32 ones, as
    a float32 operator (the layer's output is float32 under autocast either way;
    half-precision features compose, which keeps them in half precision)."""
    if not enabled():
        return f"{FUSED_LAYER_ENV}=0"
    if not triton_kernel.available(x):
        return "not on the Triton path"
    if torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float32:
        return f"autocast with {x.dtype} features (float32 only)"
    if x.dtype not in (torch.float32, torch.float64):
        return f"{x.dtype} features (float32 / float64 only)"
    return None


def too_wide(x: Tensor, heads: int, out_channels: int, concat: bool = True) -> Optional[str]:
    """Why the layer's projection does not fit the kernels (None: it does)."""
    if not triton_layer.fits(x, heads, out_channels, mean=not concat):
        return "the projection tile is too wide for one program"
    return None
