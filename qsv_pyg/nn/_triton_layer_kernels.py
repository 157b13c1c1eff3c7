r"""Triton kernels of ``qsv_pyg::attend_layer`` (launched by :mod:`qsv_pyg.nn.triton_layer`).

QSVConv's default layer in four kernels (and six PyTorch ops per
forward+backward, :mod:`qsv_pyg.nn.fused_layer`): the row walks of
:mod:`qsv_pyg.nn._triton_kernels` (``_forward_row``, ``_backward_row``,
``_backward_col``, called with the layer's flags) with the quaternion map's
bias, the normalisation, ``exp`` of log β, the per-head projection ``W_h``, the
root term and the bias inside; the quaternion map and the root weight are one
matmul whose output ``h = x [W_q; W_r]^T`` the kernels read (the raw
quaternions at columns ``[0, 4H)``, the root term at ``root_off``).

The helpers come from the operator's kernel module of the same mode:
:func:`triton.jit` fixes compiled or interpreted when it decorates, so the
launcher's interpreted copy of this file is given the interpreted copy of that
module as ``_BASE`` (:func:`qsv_pyg.nn.triton_kernel._kernels`).
"""
import importlib

import triton
import triton.language as tl

_base = globals().get("_BASE") or importlib.import_module("qsv_pyg.nn._triton_kernels")
_ADD = _base._ADD
_load4, _store4, _rotate = _base._load4, _base._store4, _base._rotate
_forward_row, _backward_row, _backward_col = (_base._forward_row, _base._backward_row,
                                              _base._backward_col)


@triton.jit
def _unit(h_raw, bq, off, boff, mask, EPS: tl.constexpr, ACC: tl.constexpr):
    """``unit(h[off:off+4] + bq[boff:boff+4])`` as :func:`unit_rows` (the
    identity where the norm is ``<= EPS``), and the norm's divisor."""
    w, x, y, z = _load4(h_raw, off, mask, ACC)
    bw, bx, by, bz = _load4(bq, boff, mask, ACC)
    w, x, y, z = w + bw, x + bx, y + by, z + bz
    norm = tl.sqrt(w * w + x * x + y * y + z * z)
    small = norm <= EPS
    n = tl.where(small, EPS, norm)  # clamp_min: a NaN norm stays NaN
    return (tl.where(small, 1.0, w / n), tl.where(small, 0.0, x / n),
            tl.where(small, 0.0, y / n), tl.where(small, 0.0, z / n), n, small)


@triton.jit
def layer_rotate_rows(v, h_raw, bq, qn, nrm, u, R, H, M, h_sn, EPS: tl.constexpr,
                      ACC: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr):
    """For ``BR`` of the ``R = N H`` rows (node, head): the unit quaternion
    ``qn = unit(h_n + bq)`` (stored: the row kernels read it), its divisor
    ``nrm`` (-1 where the identity was taken: the backward's normalisation
    reads it, so ``h`` need not be kept) and the rotated source ``u = Q(qn) v``."""
    offs_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs_m = tl.arange(0, BM)
    rm = offs_r < R
    head = offs_r % H
    qw, qx, qy, qz, n, small = _unit(h_raw, bq, (offs_r // H) * h_sn + head * 4, head * 4,
                                     rm, EPS, ACC)
    _store4(qn, offs_r * 4, rm, qw, qx, qy, qz)
    tl.store(nrm + offs_r, tl.where(small, -1.0, n).to(nrm.dtype.element_ty), mask=rm)
    mask = rm[:, None] & (offs_m < M)[None, :]
    off = offs_r[:, None] * (M * 4) + offs_m[None, :] * 4
    a0, a1, a2, a3 = _load4(v, off, mask, ACC)
    o0, o1, o2, o3 = _rotate(qw[:, None], qx[:, None], qy[:, None], qz[:, None], a0, a1, a2,
                             a3, False)
    _store4(u, off, mask, o0, o1, o2, o3)


@triton.jit
def _project_row(i, valid, z0, z1, z2, z3, w, h_raw, h_sn, root_off, bias, out, H, M, F,
                 MEAN: tl.constexpr, ACC: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
                 BF: tl.constexpr):
    """``out_i = concat_h W_h^T z_i^h + h_i[root] + bias`` for the program's heads
    (``W`` ``[H, 4 M, F]``, channel ``4 m + c`` of head ``h`` at ``(h 4 M + 4 m +
    c) F``); with ``MEAN`` (``concat=False``; every head in the program) the
    mean over heads, ``out_i`` ``[F]``."""
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = offs_h < tl.where(valid, H, 0)
    offs_m = tl.arange(0, BM)
    offs_f = tl.arange(0, BF)
    fm = offs_f < F
    wb = offs_h[:, None, None] * (M * 4 * F) + offs_m[None, :, None] * (4 * F) + \
        offs_f[None, None, :]
    wm = hm[:, None, None] & (offs_m < M)[None, :, None] & fm[None, None, :]
    o = tl.reduce(z0[:, :, None] * tl.load(w + wb, mask=wm, other=0).to(ACC), 1, _ADD)
    o += tl.reduce(z1[:, :, None] * tl.load(w + wb + F, mask=wm, other=0).to(ACC), 1, _ADD)
    o += tl.reduce(z2[:, :, None] * tl.load(w + wb + 2 * F, mask=wm, other=0).to(ACC), 1,
                   _ADD)
    o += tl.reduce(z3[:, :, None] * tl.load(w + wb + 3 * F, mask=wm, other=0).to(ACC), 1,
                   _ADD)
    if MEAN:
        mf = offs_f < tl.where(valid, F, 0)
        m = tl.reduce(o, 0, _ADD) / H
        m += tl.load(h_raw + i * h_sn + root_off + offs_f, mask=mf, other=0).to(ACC)
        m += tl.load(bias + offs_f, mask=mf, other=0).to(ACC)
        tl.store(out + i * F + offs_f, m.to(out.dtype.element_ty), mask=mf)
    else:
        hf = offs_h[:, None] * F + offs_f[None, :]
        mhf = hm[:, None] & fm[None, :]
        o += tl.load(h_raw + i * h_sn + root_off + hf, mask=mhf, other=0).to(ACC)
        o += tl.load(bias + hf, mask=mhf, other=0).to(ACC)
        tl.store(out + i * (H * F) + hf, o.to(out.dtype.element_ty), mask=mhf)


@triton.jit
def layer_forward_rows(src, qn, log_beta, scale, rowptr, col, y_out, z_out, alpha_out, dot_out,
                       w, h_raw, h_sn, root_off, bias, out, H, M, F, N,
                       HAS_SCALE: tl.constexpr, MEAN: tl.constexpr, ACC: tl.constexpr,
                       BE: tl.constexpr,
                       BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                       BF: tl.constexpr, TARGETS: tl.constexpr):
    """:func:`forward_rows` with learned routing on the unit quaternions ``qn``
    (keys and transport of both ends; ``beta = exp(log_beta)``; each weight
    times the edge's ``scale`` when ``HAS_SCALE``: attention dropout), then the
    projection, root term and bias of :func:`_project_row`: the layer's output."""
    for t in tl.static_range(TARGETS):
        i = tl.program_id(0).to(tl.int64) * TARGETS + t
        z0, z1, z2, z3 = _forward_row(i, i < N, N, src, qn, qn, qn, log_beta, scale,
                                      log_beta, rowptr, col, y_out, z_out, alpha_out, dot_out,
                                      H, M, 4, False, True, True, HAS_SCALE, False, True,
                                      False, ACC, BE, BH, BM, BD)
        _project_row(i, i < N, z0, z1, z2, z3, w, h_raw, h_sn, root_off, bias, out, H, M, F,
                     MEAN, ACC, BH, BM, BF)


@triton.jit
def layer_backward_rows(g, galpha, w, src, qn, log_beta, scale, rowptr, col, alpha, y, ga_buf,
                        gd, gz, gh, gh_sn, root_off, beta_off, gqd, gkd, H, M, F, N,
                        HAS_GALPHA: tl.constexpr, HAS_SCALE: tl.constexpr,
                        MEAN: tl.constexpr, ACC: tl.constexpr, BE: tl.constexpr,
                        BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                        BF: tl.constexpr, TARGETS: tl.constexpr):
    """:func:`backward_rows` of :func:`layer_forward_rows`: ``gz = W_h g`` from the
    output gradient ``g`` (stored in ``gz`` for pass B), ``g`` copied into
    ``gh`` at ``root_off``, d log beta's per-target part into ``gh`` at
    ``beta_off`` (one sum over ``gh``'s rows then gives the biases' and log
    beta's gradients)."""
    for t in tl.static_range(TARGETS):
        i = tl.program_id(0).to(tl.int64) * TARGETS + t
        _backward_row(i, i < N, N, gz, galpha, src, qn, qn, qn, log_beta, scale, rowptr,
                      col, alpha, y, ga_buf, gd, ga_buf, gh + beta_off, gqd, gkd, H, M, 4, 0,
                      0, gh_sn, g, w, gh, gh_sn, root_off, F, False, True, True, HAS_GALPHA,
                      HAS_SCALE, True, True, False, True, MEAN, True, True, ACC, BE, BH, BM, BD,
                      BF)


@triton.jit
def layer_backward_cols(gz, v, qn, alpha, scale, gd, rowptr_t, perm_t, row_t, gv, gh, gh_sn,
                        gks, gqd, gkd, nrm, H, M, N, NEED_V: tl.constexpr,
                        HAS_SCALE: tl.constexpr, ACC: tl.constexpr,
                        BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
                        BD: tl.constexpr, TARGETS: tl.constexpr):
    """:func:`backward_cols` of the layer: d v and the summed gradient of the unit
    quaternions (transport and keys of both ends) taken back through the
    normalisation into the raw quaternions' columns of ``gh``."""
    for t in tl.static_range(TARGETS):
        j = tl.program_id(0).to(tl.int64) * TARGETS + t
        _backward_col(j, j < N, N, gz, v, qn, qn, qn, alpha, scale, gd, rowptr_t, perm_t,
                      row_t, gv, gh, gks, gqd, gkd, H, M, 4, H * M * 4, M * 4, True, HAS_SCALE,
                      True, NEED_V, True, True, True, True, True, ACC, BE, BH, BM, BD, nrm,
                      gh_sn, True)
