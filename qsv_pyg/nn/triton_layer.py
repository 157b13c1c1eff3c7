r"""Triton launches of ``qsv_pyg::attend_layer`` (:mod:`qsv_pyg.nn.fused_layer`).

QSVConv's common configuration (feature quaternions, learned routing, the
sandwich transport, root weight and bias; heads concatenated or averaged;
attention dropout as a per-edge scale) as four Triton kernels
(:mod:`qsv_pyg.nn._triton_layer_kernels`) and six PyTorch ops per
forward+backward, against 26 launches when the layer composes the operator with
its own PyTorch ops (issue 32: at most 10):

forward (4)
    ``cat`` of the quaternion map's and root weight's matrices and one ``mm``:
    ``h = x [W_q; W_r]^T``; ``layer_rotate_rows``: ``qn = unit(h_q + b_q)`` and
    ``u = Q(qn) v``; ``layer_forward_rows``: the attention of
    :mod:`qsv_pyg.nn.triton_kernel` with ``beta = exp(log_beta)``, then
    ``out = concat_h W_h^T z^h + h_root + b`` (or the mean over heads).
backward (6)
    ``layer_backward_rows``: ``gz = W_h g`` (stored for pass B), the softmax
    backward, and the rows of one buffer ``gh`` ``[N, 4H + R + H]`` (``R``: the
    output width, ``HF``, or ``F`` for the mean over heads): the output
    gradient itself (the root term's and bias's) and d log beta per target;
    ``layer_backward_cols``: d v and the raw quaternions' gradient (through the
    normalisation) into ``gh``'s first ``4H`` columns; then ``gh.sum(0)`` (the
    quaternion bias, the bias and log beta at once), ``bmm`` (d W_h; ``addmm``
    for the mean over heads), ``addmm`` (d x = d v + gh W) and ``mm`` (d [W_q;
    W_r]).

The forward keeps ``z``, the unit quaternions, their divisors and ``u`` for
the backward (``y = Q z`` is recomputed there; ``h`` is not kept).

No atomics: deterministic. float32 and float64.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_kernel import (
    Config,
    _check_graph,
    _check_scale,
    _on_device,
    _pow2,
    _Setup,
    candidates,
    degree_bucket,
    launch_tuned,
    num_warps_for,
    tuning_key,
)

#: Rows (node, head) per program of ``layer_rotate_rows`` (times the blocks).
ROTATE_BLOCKS = 256
#: The largest projection tile ``[BH, BM, BF]`` (values) a row kernel holds:
#: wider layers take the composed path (:func:`fits`).
MAX_PROJECT_TILE = 8192


def _setup(x: Tensor, heads: int) -> _Setup:
    n, width = x.shape
    return _Setup(x.view(n, heads, width // (4 * heads), 4), x.new_empty(0, heads, 4))


def fits(x: Tensor, heads: int, out_channels: int, mean: bool = False) -> bool:
    """Whether the projection tile of the layer's kernels stays within
    :data:`MAX_PROJECT_TILE` values (and, for the mean over heads, one program
    holds every head), for features like ``x`` (padded to ``4 * heads``)."""
    step = 4 * heads
    s = _setup(x.new_empty(0, -(-x.size(-1) // step) * step), heads)
    return s.BH * s.BM * _pow2(out_channels) <= MAX_PROJECT_TILE and \
        (not mean or s.head_tiles == 1)


@_on_device
def forward(x: Tensor, v: Tensor, w_cat: Tensor, b_quat: Tensor, bias: Tensor, weight: Tensor,
            log_beta: Tensor, scale: Tensor, rowptr: Tensor, col: Tensor, mean: bool,
            eps: float):
    """``(out, alpha, nrm, qn, u, z)``: the layer's output ``[N, H F]`` (``[N, F]``,
    the mean over heads, with ``mean``), the weights ``[E, H]`` (target-sorted
    order) and what the backward reads: the normalisation's divisors ``[N, H]``
    (-1 where the identity was taken), the unit quaternions, the rotated
    sources and the aggregate ``z`` (``y = Q z`` is recomputed, ``h = x
    w_cat^T`` not kept). ``scale``: the per-edge scale ``[E, H]`` of the
    aggregation (attention dropout's mask), or empty for none. ``v``: ``x``
    zero-padded to ``H C`` channels (``x`` itself when no padding is needed),
    the attention's values."""
    N = x.size(0)
    H, C, Fo = weight.shape
    s = _setup(v, H)
    E = col.numel()
    _check_graph(rowptr, col, N)
    scaled = _check_scale(scale, E, H)
    h = torch.mm(x, w_cat.t())  # [N, 4H + R]: raw quaternions, root term
    qn = x.new_empty(N, H, 4)
    nrm = x.new_empty(N, H)
    v = v.view(N, H, s.M, 4)
    u, z = torch.empty_like(v), torch.empty_like(v)
    alpha = x.new_empty(E, H)
    dot = x.new_empty(E, H)
    out = x.new_empty(N, Fo if mean else H * Fo)
    if N:
        rows, BR = N * H, max(1, ROTATE_BLOCKS // s.BM)
        s.k.layer_rotate_rows[(-(-rows // BR), )](
            v, h, b_quat, qn, nrm, u, rows, H, s.M, h.stride(0), EPS=float(eps), ACC=s.acc,
            BR=BR, BM=s.BM, num_warps=num_warps_for(BR * s.BM))
        BF = _pow2(Fo)

        def launch(c: Config):
            s.k.layer_forward_rows[(-(-N // c.TARGETS), s.head_tiles)](
                u, qn, log_beta, scale if scaled else log_beta, rowptr, col, z, z, alpha, dot,
                weight, h, h.stride(0), 4 * H, bias, out, H, s.M, Fo, N, HAS_SCALE=scaled,
                MEAN=mean, ACC=s.acc, BE=c.BE, BH=s.BH, BM=s.BM, BD=4, BF=BF, TARGETS=c.TARGETS,
                num_warps=c.warps)
        degree = degree_bucket(E, N)
        launch_tuned(tuning_key("layer_forward_rows", x.device, x.dtype, s, degree,
                                {"F": Fo, "HAS_SCALE": scaled, "MEAN": mean}),
                     candidates(s, degree), launch, x.device)
    return out, alpha, nrm, qn, u, z


@_on_device
def backward(g: Tensor, galpha, v: Tensor, weight: Tensor, log_beta: Tensor, scale: Tensor,
             rowptr: Tensor, col: Tensor, rowptr_t: Tensor, perm_t: Tensor, row_t: Tensor,
             alpha: Tensor, nrm: Tensor, qn: Tensor, u: Tensor, z: Tensor, need_v: bool,
             mean: bool):
    """``(gv, gh)``: d v ``[N, H M 4]`` (the values ``v``: the features, padded to
    ``H C`` channels; empty unless ``need_v``) and the buffer ``gh`` ``[N, 4H +
    R + H]`` (d h_q through the normalisation, the output gradient, d log beta
    per target), whose row sum and matmuls the caller takes."""
    N = v.size(0)
    H, C, Fo = weight.shape
    s = _setup(v, H)
    E = col.numel()
    scaled = _check_scale(scale, E, H)
    g = g.contiguous()
    galpha = None if galpha is None else galpha.contiguous()
    root = Fo if mean else H * Fo
    gh = v.new_empty(N, 4 * H + root + H)
    gz = torch.empty_like(u)
    gv = torch.empty_like(u) if need_v else v.new_empty(0)
    ga_buf, gd = v.new_empty(E, H), v.new_empty(E, H)
    gqd, gkd, gks = (v.new_empty(N, H, 4) for _ in range(3))
    if N:
        BF = _pow2(Fo)
        degree = degree_bucket(E, N)

        def launch_a(c: Config):
            s.k.layer_backward_rows[(-(-N // c.TARGETS), s.head_tiles)](
                g, g if galpha is None else galpha, weight, u, qn, log_beta,
                scale if scaled else log_beta, rowptr, col, alpha, z, ga_buf, gd, gz, gh,
                gh.stride(0), 4 * H, 4 * H + root, gqd, gkd, H, s.M, Fo, N,
                HAS_GALPHA=galpha is not None, HAS_SCALE=scaled, MEAN=mean, ACC=s.acc,
                BE=c.BE, BH=s.BH, BM=s.BM, BD=4, BF=BF, TARGETS=c.TARGETS, num_warps=c.warps)
        launch_tuned(tuning_key("layer_backward_rows", v.device, v.dtype, s, degree,
                                {"F": Fo, "HAS_GALPHA": galpha is not None,
                                 "HAS_SCALE": scaled, "MEAN": mean}),
                     candidates(s, degree), launch_a, v.device)

        def launch_b(c: Config):
            s.k.layer_backward_cols[(-(-N // c.TARGETS), s.head_tiles)](
                gz, v, qn, alpha, scale if scaled else alpha, gd, rowptr_t, perm_t, row_t,
                gv if need_v else gz, gh, gh.stride(0), gks, gqd, gkd, nrm, H, s.M, N,
                NEED_V=need_v, HAS_SCALE=scaled, ACC=s.acc, BE=c.BE, BH=s.BH, BM=s.BM, BD=4,
                TARGETS=c.TARGETS, num_warps=c.warps)
        launch_tuned(tuning_key("layer_backward_cols", v.device, v.dtype, s, degree,
                                {"NEED_V": need_v, "HAS_SCALE": scaled}), candidates(s, degree),
                     launch_b, v.device)
    return gv, gh
