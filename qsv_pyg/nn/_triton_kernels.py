r"""Triton kernels of ``qsv_pyg::attend`` (launched by :mod:`qsv_pyg.nn.triton_kernel`).

Kept apart from the launch code because :func:`triton.jit` decides at decoration
time whether a kernel is compiled or interpreted (``TRITON_INTERPRET``): the
launcher loads this file once per mode (a second, interpreted copy for CPU
tensors in the tests).

Layout (all contiguous; the features of one node and head are ``M`` blocks of
four channels):

* every program owns ``TARGETS`` consecutive nodes (grid axis 0: targets for
  the forward and backward pass A, sources for backward pass B; ``N`` nodes in
  all, rows past the last are masked) and a tile of ``BH`` heads (grid axis
  1); it walks each of its nodes' CSR rows ``BE`` edges at a time, one row
  after the other (``tl.static_range``: the loads of one row overlap the
  previous row's arithmetic, issue 32 item 8c);
* a feature tile is held as its four quaternion components, ``[BE, BH, BM]``
  each (component ``c`` of block ``m`` sits at offset ``4 m + c``), so the
  rotations :math:`Q = \mathrm{diag}(1, R(q))` are sixteen multiply-adds on
  whole tiles, with ``R(q)`` formed from ``q`` on the fly;
* a block's four components are contiguous and read (and written) as one
  ``[..., 4]`` tile, split into the four component tiles in registers
  (:func:`_load4`, :func:`_store4`): with 16-byte aligned tensors the compiler
  emits one 16-byte vector load per float32 block (issue 32 item 8a);
* everything accumulates in ``ACC`` (float32, float64 for float64 inputs)
  whatever the storage type; results are cast on store.
"""
import triton
import triton.language as tl


# tl.reduce with the library's combine functions rather than tl.sum / tl.max
# (jit functions themselves, fixed to one mode when triton.language was
# imported): these run compiled and interpreted alike, whichever was imported.
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def _rotate(w, x, y, z, a0, a1, a2, a3, TRANSPOSE: tl.constexpr):
    """``Q(q) a`` (``Q^T a`` when ``TRANSPOSE``) for the components ``a0..a3``;
    ``w..z`` broadcast against them (as quaternion_to_block_matrix: Q00 = |q|^2)."""
    ww, xx, yy, zz = w * w, x * x, y * y, z * z
    r11 = ww + xx - yy - zz
    r12 = 2 * (x * y - w * z)
    r13 = 2 * (x * z + w * y)
    r21 = 2 * (x * y + w * z)
    r22 = ww - xx + yy - zz
    r23 = 2 * (y * z - w * x)
    r31 = 2 * (x * z - w * y)
    r32 = 2 * (y * z + w * x)
    r33 = ww - xx - yy + zz
    o0 = (ww + xx + yy + zz) * a0
    if TRANSPOSE:
        o1 = r11 * a1 + r21 * a2 + r31 * a3
        o2 = r12 * a1 + r22 * a2 + r32 * a3
        o3 = r13 * a1 + r23 * a2 + r33 * a3
    else:
        o1 = r11 * a1 + r12 * a2 + r13 * a3
        o2 = r21 * a1 + r22 * a2 + r23 * a3
        o3 = r31 * a1 + r32 * a2 + r33 * a3
    return o0, o1, o2, o3


@triton.jit
def _quat_grad(w, x, y, z, a0, a1, a2, a3, b0, b1, b2, b3):
    """dL/dq ``[BH]`` x4 when dL/dQ(q) = sum_m a_m b_m^T (tiles ``[BH, BM]``):
    the derivative of the block matrix, as block_matrix_to_quaternion_grad."""
    g00 = tl.reduce(a0 * b0, 1, _ADD)
    g11 = tl.reduce(a1 * b1, 1, _ADD)
    g12 = tl.reduce(a1 * b2, 1, _ADD)
    g13 = tl.reduce(a1 * b3, 1, _ADD)
    g21 = tl.reduce(a2 * b1, 1, _ADD)
    g22 = tl.reduce(a2 * b2, 1, _ADD)
    g23 = tl.reduce(a2 * b3, 1, _ADD)
    g31 = tl.reduce(a3 * b1, 1, _ADD)
    g32 = tl.reduce(a3 * b2, 1, _ADD)
    g33 = tl.reduce(a3 * b3, 1, _ADD)
    dw = 2 * (w * (g00 + g11 + g22 + g33) - z * g12 + y * g13 + z * g21 - x * g23 - y * g31 +
              x * g32)
    dx = 2 * (x * (g00 + g11 - g22 - g33) + y * g12 + z * g13 + y * g21 - w * g23 + z * g31 +
              w * g32)
    dy = 2 * (y * (g00 - g11 + g22 - g33) + x * g12 + w * g13 + x * g21 + z * g23 - w * g31 +
              z * g32)
    dz = 2 * (z * (g00 - g11 - g22 + g33) - w * g12 + x * g13 + w * g21 + y * g23 + x * g31 +
              y * g32)
    return dw, dx, dy, dz


@triton.jit
def _split4(t):
    """The four components ``t[..., 0..3]`` of a ``[..., 4]`` tile, in registers
    (the tile viewed as ``[..., 2, 2]`` and split twice: ``c = 2 hi + lo``)."""
    t = tl.reshape(t, t.shape[:-1] + [2, 2])
    even, odd = tl.split(t)  # lo = 0: components 0, 2; lo = 1: 1, 3
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3


@triton.jit
def _load4(ptr, off, mask, ACC: tl.constexpr):
    """The four components of the blocks at ``off`` (component stride 1), read
    as one ``[..., 4]`` tile: four contiguous elements per block, so a thread
    loads a block at once (a 16-byte vector in float32; issue 32 item 8a)."""
    comp = tl.arange(0, 4)
    t = tl.load(ptr + (tl.expand_dims(off, -1) + comp), mask=tl.expand_dims(mask, -1),
                other=0)
    return _split4(t.to(ACC))


@triton.jit
def _store4(ptr, off, mask, a0, a1, a2, a3):
    """Stores the components as one ``[..., 4]`` tile (the inverse of :func:`_split4`)."""
    ty = ptr.dtype.element_ty
    t = tl.join(tl.join(a0.to(ty), a2.to(ty)), tl.join(a1.to(ty), a3.to(ty)))  # [..., hi, lo]
    t = tl.reshape(t, t.shape[:-2] + [4])
    tl.store(ptr + (tl.expand_dims(off, -1) + tl.arange(0, 4)), t,
             mask=tl.expand_dims(mask, -1))


@triton.jit
def rotate_rows(v, q, out, R, M, TRANSPOSE: tl.constexpr, ACC: tl.constexpr,
                BR: tl.constexpr, BM: tl.constexpr):
    """``out[r] = Q(q[r]) v[r]`` (or ``Q^T``) for ``BR`` of the ``R = N H`` rows
    (node, head): the rotated sources ``u``."""
    offs_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs_m = tl.arange(0, BM)
    rm = offs_r < R
    mask = rm[:, None] & (offs_m < M)[None, :]
    off = offs_r[:, None] * (M * 4) + offs_m[None, :] * 4
    a0, a1, a2, a3 = _load4(v, off, mask, ACC)
    qw, qx, qy, qz = _load4(q, offs_r * 4, rm, ACC)
    o0, o1, o2, o3 = _rotate(qw[:, None], qx[:, None], qy[:, None], qz[:, None], a0, a1, a2,
                             a3, TRANSPOSE)
    _store4(out, off, mask, o0, o1, o2, o3)


@triton.jit
def _forward_row(i, valid, N, src, qd, ks, kd, beta, scale, bias, rowptr, col, y_out, z_out,
                 alpha_out, dot_out, H, M, D, USE_ABS: tl.constexpr, ROTATE: tl.constexpr,
                 HAS_KEYS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 LOG_BETA: tl.constexpr, STORE_Y: tl.constexpr, ACC: tl.constexpr,
                 BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    hm = offs_h < tl.where(valid, H, 0)  # no head of a row past the last
    mm = offs_m < M
    # a row past the last (i >= N, masked by valid) reads rowptr[N] twice: empty
    start = tl.load(rowptr + tl.where(valid, i, N)).to(tl.int64)
    end = tl.load(rowptr + tl.where(valid, i + 1, N)).to(tl.int64)
    b = tl.load(beta + offs_h, mask=hm, other=0).to(ACC)
    if LOG_BETA:  # beta given as its logarithm (the layer's parameter)
        b = tl.exp(b)
    hd = hm[:, None] & (offs_d < D)[None, :]
    kdi = tl.full([BH, BD], 0, ACC)
    if HAS_KEYS:
        kdi = tl.load(kd + i * H * D + offs_h[:, None] * D + offs_d[None, :], mask=hd,
                      other=0).to(ACC)
    run_max = tl.full([BH], float("-inf"), ACC)
    run_sum = tl.full([BH], 0, ACC)
    acc0 = tl.full([BH, BM], 0, ACC)
    acc1 = tl.full([BH, BM], 0, ACC)
    acc2 = tl.full([BH, BM], 0, ACC)
    acc3 = tl.full([BH, BM], 0, ACC)
    for e0 in range(start, end, BE):
        offs_e = e0 + tl.arange(0, BE)
        em = offs_e < end
        eh = em[:, None] & hm[None, :]
        j = tl.load(col + offs_e, mask=em, other=0).to(tl.int64)
        d = tl.full([BE, BH], 0, ACC)
        if HAS_KEYS:
            kj = tl.load(ks + j[:, None, None] * (H * D) + offs_h[None, :, None] * D +
                         offs_d[None, None, :], mask=eh[:, :, None] & hd[None, :, :],
                         other=0).to(ACC)
            d = tl.reduce(kj * kdi[None, :, :], 2, _ADD)
        tl.store(dot_out + offs_e[:, None] * H + offs_h[None, :],
                 d.to(dot_out.dtype.element_ty), mask=eh)
        if USE_ABS:
            logit = tl.abs(d) * b[None, :]
        else:
            logit = d * b[None, :]
        if HAS_BIAS:
            logit += tl.load(bias + offs_e[:, None] * H + offs_h[None, :], mask=eh,
                             other=0).to(ACC)
        logit = tl.where(em[:, None], logit, float("-inf"))
        new_max = tl.maximum(run_max, tl.reduce(logit, 0, _MAX))
        rescale = tl.exp(run_max - new_max)
        p = tl.exp(logit - new_max[None, :])
        run_sum = run_sum * rescale + tl.reduce(p, 0, _ADD)
        run_max = new_max
        off = j[:, None, None] * (H * M * 4) + offs_h[None, :, None] * (M * 4) + \
            offs_m[None, None, :] * 4
        x0, x1, x2, x3 = _load4(src, off, eh[:, :, None] & mm[None, None, :], ACC)
        if HAS_SCALE:  # y = sum_j alpha_ij s_ij u_j
            s = tl.load(scale + offs_e[:, None] * H + offs_h[None, :], mask=eh,
                        other=0).to(ACC)
            w = (p * s)[:, :, None]
        else:
            w = p[:, :, None]
        acc0 = acc0 * rescale[:, None] + tl.reduce(w * x0, 0, _ADD)
        acc1 = acc1 * rescale[:, None] + tl.reduce(w * x1, 0, _ADD)
        acc2 = acc2 * rescale[:, None] + tl.reduce(w * x2, 0, _ADD)
        acc3 = acc3 * rescale[:, None] + tl.reduce(w * x3, 0, _ADD)
    inv = tl.where(run_sum > 0, 1.0 / tl.where(run_sum > 0, run_sum, 1.0), 0.0)  # no edges: z = 0
    y0 = acc0 * inv[:, None]
    y1 = acc1 * inv[:, None]
    y2 = acc2 * inv[:, None]
    y3 = acc3 * inv[:, None]
    off_i = i * H * M * 4 + offs_h[:, None] * (M * 4) + offs_m[None, :] * 4
    mask_i = hm[:, None] & mm[None, :]
    if ROTATE:
        if STORE_Y:  # (else the backward recomputes y = Q_i z)
            _store4(y_out, off_i, mask_i, y0, y1, y2, y3)
        qw, qx, qy, qz = _load4(qd, i * H * 4 + offs_h * 4, hm, ACC)
        y0, y1, y2, y3 = _rotate(qw[:, None], qx[:, None], qy[:, None], qz[:, None], y0, y1,
                                 y2, y3, True)
    _store4(z_out, off_i, mask_i, y0, y1, y2, y3)
    for e0 in range(start, end, BE):  # normalised weights ([deg, BH] work only)
        offs_e = e0 + tl.arange(0, BE)
        em = offs_e < end
        eh = em[:, None] & hm[None, :]
        if HAS_KEYS or HAS_BIAS:  # the logits again, in ACC (dot_out may be half)
            logit = tl.full([BE, BH], 0, ACC)
            if HAS_KEYS:
                j = tl.load(col + offs_e, mask=em, other=0).to(tl.int64)
                kj = tl.load(ks + j[:, None, None] * (H * D) + offs_h[None, :, None] * D +
                             offs_d[None, None, :], mask=eh[:, :, None] & hd[None, :, :],
                             other=0).to(ACC)
                d = tl.reduce(kj * kdi[None, :, :], 2, _ADD)
                if USE_ABS:
                    logit = tl.abs(d) * b[None, :]
                else:
                    logit = d * b[None, :]
            if HAS_BIAS:
                logit += tl.load(bias + offs_e[:, None] * H + offs_h[None, :], mask=eh,
                                 other=0).to(ACC)
            a = tl.exp(logit - run_max[None, :]) * inv[None, :]
        else:
            a = tl.full([BE, BH], 0, ACC) + inv[None, :]
        tl.store(alpha_out + offs_e[:, None] * H + offs_h[None, :],
                 a.to(alpha_out.dtype.element_ty), mask=eh)
    return y0, y1, y2, y3


@triton.jit
def forward_rows(src, qd, ks, kd, beta, scale, bias, rowptr, col, y_out, z_out, alpha_out,
                 dot_out, H, M, D, N, USE_ABS: tl.constexpr, ROTATE: tl.constexpr,
                 HAS_KEYS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACC: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
                 BD: tl.constexpr, TARGETS: tl.constexpr):
    """One target ``i`` and ``BH`` heads: logits (plus the additive term
    ``bias`` when ``HAS_BIAS``), online softmax (running max
    and sum) and the weighted sum of the (rotated) sources in one walk over
    the row (each weight times the edge's ``scale`` when ``HAS_SCALE``; the
    softmax's sum is not scaled); ``z = Q_i^T y``; then a walk over the row's
    ``[deg, BH]`` logits only, to write the normalised (unscaled) weights.

    ``TARGETS`` consecutive targets per program (issue 32 item 8c; rows ``>= N`` masked)."""
    for t in tl.static_range(TARGETS):
        i = tl.program_id(0).to(tl.int64) * TARGETS + t
        z0, z1, z2, z3 = _forward_row(i, i < N, N, src, qd, ks, kd, beta, scale, bias, rowptr,
                                      col, y_out, z_out, alpha_out, dot_out, H, M, D, USE_ABS,
                                      ROTATE, HAS_KEYS, HAS_SCALE, HAS_BIAS, False, True, ACC,
                                      BE, BH, BM, BD)


@triton.jit
def _backward_row(i, valid, N, gz, galpha, src, qd, ks, kd, beta, scale, rowptr, col, alpha, y,
                  ga_buf, gd, glogit, gbeta_part, gqd, gkd, H, M, D, gz_sn, gz_sh, gbp_sn,
                  gout, w, gh, gh_sn, root_off, F, USE_ABS: tl.constexpr, ROTATE: tl.constexpr,
                  HAS_KEYS: tl.constexpr, HAS_GALPHA: tl.constexpr, HAS_SCALE: tl.constexpr,
                  NEED_Q: tl.constexpr, NEED_K: tl.constexpr, NEED_BIAS: tl.constexpr,
                  PROJECT: tl.constexpr, MEAN: tl.constexpr, LOG_BETA: tl.constexpr,
                  Y_FROM_Z: tl.constexpr, ACC: tl.constexpr,
                  BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                  BF: tl.constexpr):
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    hm = offs_h < tl.where(valid, H, 0)  # no head of a row past the last
    mm = offs_m < M
    # a row past the last (i >= N, masked by valid) reads rowptr[N] twice: empty
    start = tl.load(rowptr + tl.where(valid, i, N)).to(tl.int64)
    end = tl.load(rowptr + tl.where(valid, i + 1, N)).to(tl.int64)
    off_i = i * H * M * 4 + offs_h[:, None] * (M * 4) + offs_m[None, :] * 4
    mask_i = hm[:, None] & mm[None, :]
    # gz may be strided over nodes and heads (the transposed gradient of the
    # layer's per-head projection): blocks of four contiguous within a row
    if PROJECT:  # gz = W_h g_i from the layer's output gradient (stored for pass B)
        g0, g1, g2, g3 = _project_back(i, valid, offs_h, hm, offs_m, mm, gout, w, gh, gh_sn,
                                       root_off, H, M, F, MEAN, ACC, BF)
        _store4(gz, off_i, mask_i, g0, g1, g2, g3)
    else:
        off_g = i * gz_sn + offs_h[:, None].to(tl.int64) * gz_sh + offs_m[None, :] * 4
        g0, g1, g2, g3 = _load4(gz, off_g, mask_i, ACC)
    c0, c1, c2, c3 = g0, g1, g2, g3  # gz itself (d qd_i reads it)
    if ROTATE:
        qw, qx, qy, qz = _load4(qd, i * H * 4 + offs_h * 4, hm, ACC)
        g0, g1, g2, g3 = _rotate(qw[:, None], qx[:, None], qy[:, None], qz[:, None], g0, g1,
                                 g2, g3, False)
    sa = tl.full([BH], 0, ACC)
    for e0 in range(start, end, BE):  # ga = (s_ij) <gy_i, u_j> (+ galpha)
        offs_e = e0 + tl.arange(0, BE)
        em = offs_e < end
        eh = em[:, None] & hm[None, :]
        j = tl.load(col + offs_e, mask=em, other=0).to(tl.int64)
        off = j[:, None, None] * (H * M * 4) + offs_h[None, :, None] * (M * 4) + \
            offs_m[None, None, :] * 4
        x0, x1, x2, x3 = _load4(src, off, eh[:, :, None] & mm[None, None, :], ACC)
        ga = tl.reduce(g0[None, :, :] * x0 + g1[None, :, :] * x1 + g2[None, :, :] * x2 +
                    g3[None, :, :] * x3, 2, _ADD)
        off_eh = offs_e[:, None] * H + offs_h[None, :]
        if HAS_SCALE:
            ga = ga * tl.load(scale + off_eh, mask=eh, other=0).to(ACC)
        if HAS_GALPHA:
            ga += tl.load(galpha + off_eh, mask=eh, other=0).to(ACC)
        a = tl.load(alpha + off_eh, mask=eh, other=0).to(ACC)
        sa += tl.reduce(a * ga, 0, _ADD)
        tl.store(ga_buf + off_eh, ga, mask=eh)
    tl.debug_barrier()  # the second walk reads what the first stored
    b = tl.load(beta + offs_h, mask=hm, other=0).to(ACC)
    if LOG_BETA:
        b = tl.exp(b)
    hd = hm[:, None] & (offs_d < D)[None, :]
    kdi = tl.full([BH, BD], 0, ACC)
    if HAS_KEYS:
        kdi = tl.load(kd + i * H * D + offs_h[:, None] * D + offs_d[None, :], mask=hd,
                      other=0).to(ACC)
    gb = tl.full([BH], 0, ACC)
    gk = tl.full([BH, BD], 0, ACC)
    for e0 in range(start, end, BE):  # gs = alpha (ga - sum alpha ga) -> d beta, d <k, k>
        offs_e = e0 + tl.arange(0, BE)
        em = offs_e < end
        eh = em[:, None] & hm[None, :]
        off_eh = offs_e[:, None] * H + offs_h[None, :]
        a = tl.load(alpha + off_eh, mask=eh, other=0).to(ACC)
        gs = a * (tl.load(ga_buf + off_eh, mask=eh, other=0) - sa[None, :])
        if NEED_BIAS:  # d logit: the additive term's gradient
            tl.store(glogit + off_eh, gs.to(glogit.dtype.element_ty), mask=eh)
        if HAS_KEYS:  # the key product again, in ACC (the saved dot may be half)
            j = tl.load(col + offs_e, mask=em, other=0).to(tl.int64)
            kj = tl.load(ks + j[:, None, None] * (H * D) + offs_h[None, :, None] * D +
                         offs_d[None, None, :], mask=eh[:, :, None] & hd[None, :, :],
                         other=0).to(ACC)
            d = tl.reduce(kj * kdi[None, :, :], 2, _ADD)
            if USE_ABS:
                gb += tl.reduce(gs * tl.abs(d), 0, _ADD)
                g = gs * b[None, :] * tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
            else:
                gb += tl.reduce(gs * d, 0, _ADD)
                g = gs * b[None, :]
            tl.store(gd + off_eh, g, mask=eh)
            if NEED_K:
                gk += tl.reduce(g[:, :, None] * kj, 0, _ADD)
    if LOG_BETA:  # d log(beta) = beta d beta
        gb = gb * b
    tl.store(gbeta_part + i * gbp_sn + offs_h, gb.to(gbeta_part.dtype.element_ty), mask=hm)
    if NEED_K:
        tl.store(gkd + i * H * D + offs_h[:, None] * D + offs_d[None, :],
                 gk.to(gkd.dtype.element_ty), mask=hd)
    if NEED_Q:  # z = Q_i^T y  =>  dL/dQ_i = sum_m y_m gz_m^T
        y0, y1, y2, y3 = _load4(y, off_i, mask_i, ACC)
        if Y_FROM_Z:  # ``y`` holds z: y = Q_i z (Q Q^T = |q|^4 = 1 for a unit q_i)
            y0, y1, y2, y3 = _rotate(qw[:, None], qx[:, None], qy[:, None], qz[:, None], y0,
                                     y1, y2, y3, False)
        dw, dx, dy, dz = _quat_grad(qw, qx, qy, qz, y0, y1, y2, y3, c0, c1, c2, c3)
        _store4(gqd, i * H * 4 + offs_h * 4, hm, dw, dx, dy, dz)


@triton.jit
def backward_rows(gz, galpha, src, qd, ks, kd, beta, scale, rowptr, col, alpha, y, ga_buf,
                  gd, glogit, gbeta_part, gqd, gkd, H, M, D, gz_sn, gz_sh, N,
                  USE_ABS: tl.constexpr, ROTATE: tl.constexpr, HAS_KEYS: tl.constexpr,
                  HAS_GALPHA: tl.constexpr, HAS_SCALE: tl.constexpr, NEED_Q: tl.constexpr,
                  NEED_K: tl.constexpr, NEED_BIAS: tl.constexpr, ACC: tl.constexpr,
                  BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                  TARGETS: tl.constexpr):
    """Pass A, one target ``i`` and ``BH`` heads: ``gy = Q_i gz``, the softmax
    backward (``ga = s <gy_i, u_j> + galpha`` parked in ``ga_buf`` by the first
    walk over the row, read by the second, which writes the logit gradient
    ``gs`` to ``glogit`` when ``NEED_BIAS`` and the key-product gradient to
    ``gd``: no walk reads and writes one buffer, so no thread can read an entry
    another has already overwritten), the per-target part of d beta, d kd_i
    and d qd_i.

    ``TARGETS`` consecutive targets per program (issue 32 item 8c; rows ``>= N`` masked)."""
    for t in tl.static_range(TARGETS):
        i = tl.program_id(0).to(tl.int64) * TARGETS + t
        _backward_row(i, i < N, N, gz, galpha, src, qd, ks, kd, beta, scale, rowptr, col, alpha, y,
                      ga_buf, gd, glogit, gbeta_part, gqd, gkd, H, M, D, gz_sn, gz_sh, H,
                      gz, gz, gz, 0, 0, 0, USE_ABS, ROTATE, HAS_KEYS, HAS_GALPHA, HAS_SCALE,
                      NEED_Q, NEED_K, NEED_BIAS, False, False, False, False, ACC, BE, BH, BM,
                      BD, 1)


@triton.jit
def _backward_col(j, valid, N, gz, v, qs, qd, kd, alpha, scale, gd, rowptr_t, perm_t, row_t, gv,
                  gqs, gks, gqd, gkd, H, M, D, gz_sn, gz_sh, ROTATE: tl.constexpr,
                  HAS_SCALE: tl.constexpr, NEED_U: tl.constexpr, NEED_V: tl.constexpr,
                  NEED_Q: tl.constexpr, NEED_K: tl.constexpr, SUM_QD: tl.constexpr,
                  SUM_KD: tl.constexpr, KEYS_INTO_Q: tl.constexpr, ACC: tl.constexpr,
                  BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                  nrm, gq_sn, UNIT: tl.constexpr):
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    hm = offs_h < tl.where(valid, H, 0)  # no head of a row past the last
    mm = offs_m < M
    hd = hm[:, None] & (offs_d < D)[None, :]
    # a row past the last (j >= N, masked by valid) reads rowptr_t[N] twice: empty
    start = tl.load(rowptr_t + tl.where(valid, j, N)).to(tl.int64)
    end = tl.load(rowptr_t + tl.where(valid, j + 1, N)).to(tl.int64)
    u0 = tl.full([BH, BM], 0, ACC)
    u1 = tl.full([BH, BM], 0, ACC)
    u2 = tl.full([BH, BM], 0, ACC)
    u3 = tl.full([BH, BM], 0, ACC)
    gk = tl.full([BH, BD], 0, ACC)
    for p0 in range(start, end, BE):
        offs_p = p0 + tl.arange(0, BE)
        pm = offs_p < end
        eh = pm[:, None] & hm[None, :]
        e = tl.load(perm_t + offs_p, mask=pm, other=0).to(tl.int64)
        i = tl.load(row_t + offs_p, mask=pm, other=0).to(tl.int64)
        off_eh = e[:, None] * H + offs_h[None, :]
        if NEED_U:
            a = tl.load(alpha + off_eh, mask=eh, other=0).to(ACC)
            if HAS_SCALE:
                a = a * tl.load(scale + off_eh, mask=eh, other=0).to(ACC)
            off = i[:, None, None] * gz_sn + offs_h[None, :, None].to(tl.int64) * gz_sh + \
                offs_m[None, None, :] * 4
            g0, g1, g2, g3 = _load4(gz, off, eh[:, :, None] & mm[None, None, :], ACC)
            if ROTATE:
                qw, qx, qy, qz = _load4(qd, i[:, None] * (H * 4) + offs_h[None, :] * 4, eh,
                                        ACC)
                g0, g1, g2, g3 = _rotate(qw[:, :, None], qx[:, :, None], qy[:, :, None],
                                         qz[:, :, None], g0, g1, g2, g3, False)
            w = a[:, :, None]
            u0 += tl.reduce(w * g0, 0, _ADD)
            u1 += tl.reduce(w * g1, 0, _ADD)
            u2 += tl.reduce(w * g2, 0, _ADD)
            u3 += tl.reduce(w * g3, 0, _ADD)
        if NEED_K:
            g = tl.load(gd + off_eh, mask=eh, other=0)
            ki = tl.load(kd + i[:, None, None] * (H * D) + offs_h[None, :, None] * D +
                         offs_d[None, None, :], mask=eh[:, :, None] & hd[None, :, :],
                         other=0).to(ACC)
            gk += tl.reduce(g[:, :, None].to(ACC) * ki, 0, _ADD)
    off_j = j * H * M * 4 + offs_h[:, None] * (M * 4) + offs_m[None, :] * 4
    mask_j = hm[:, None] & mm[None, :]
    if NEED_K:
        if SUM_KD:  # ks is kd: pass A's d kd_j joins
            gk += tl.load(gkd + j * H * D + offs_h[:, None] * D + offs_d[None, :], mask=hd,
                          other=0).to(ACC)
        tl.store(gks + j * H * D + offs_h[:, None] * D + offs_d[None, :],
                 gk.to(gks.dtype.element_ty), mask=hd)
    if NEED_U:
        if ROTATE:
            qw, qx, qy, qz = _load4(qs, j * H * 4 + offs_h * 4, hm, ACC)
        if NEED_V:  # u = Q_j v  =>  gv = Q_j^T gu
            if ROTATE:
                o0, o1, o2, o3 = _rotate(qw[:, None], qx[:, None], qy[:, None], qz[:, None],
                                         u0, u1, u2, u3, True)
                _store4(gv, off_j, mask_j, o0, o1, o2, o3)
            else:
                _store4(gv, off_j, mask_j, u0, u1, u2, u3)
        if NEED_Q:  # u = Q_j v  =>  dL/dQ_j = sum_m gu_m v_m^T
            v0, v1, v2, v3 = _load4(v, off_j, mask_j, ACC)
            dw, dx, dy, dz = _quat_grad(qw, qx, qy, qz, u0, u1, u2, u3, v0, v1, v2, v3)
            if SUM_QD:  # qs is qd: pass A's d qd_j joins
                e0, e1, e2, e3 = _load4(gqd, j * H * 4 + offs_h * 4, hm, ACC)
                dw, dx, dy, dz = dw + e0, dx + e1, dy + e2, dz + e3
            if KEYS_INTO_Q:  # the keys are the quaternions (D = 4)
                col_d = offs_d[None, :]
                dw += tl.reduce(tl.where(col_d == 0, gk, 0.0), 1, _ADD)
                dx += tl.reduce(tl.where(col_d == 1, gk, 0.0), 1, _ADD)
                dy += tl.reduce(tl.where(col_d == 2, gk, 0.0), 1, _ADD)
                dz += tl.reduce(tl.where(col_d == 3, gk, 0.0), 1, _ADD)
            if UNIT:  # qs = unit(raw q_j): the normalisation's gradient, into gqs's rows
                dw, dx, dy, dz = _unit_grad(nrm, j * H + offs_h, hm, qw, qx, qy, qz, dw, dx,
                                            dy, dz, ACC)
                _store4(gqs, j * gq_sn + offs_h * 4, hm, dw, dx, dy, dz)
            else:
                _store4(gqs, j * H * 4 + offs_h * 4, hm, dw, dx, dy, dz)


@triton.jit
def backward_cols(gz, v, qs, qd, kd, alpha, scale, gd, rowptr_t, perm_t, row_t, gv, gqs,
                  gks, gqd, gkd, H, M, D, gz_sn, gz_sh, N, ROTATE: tl.constexpr,
                  HAS_SCALE: tl.constexpr, NEED_U: tl.constexpr, NEED_V: tl.constexpr,
                  NEED_Q: tl.constexpr, NEED_K: tl.constexpr, SUM_QD: tl.constexpr,
                  SUM_KD: tl.constexpr, KEYS_INTO_Q: tl.constexpr, ACC: tl.constexpr,
                  BE: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                  TARGETS: tl.constexpr):
    """Pass B, one source ``j`` and ``BH`` heads over its outgoing edges (the
    transposed CSR, so no atomics): ``gu_j = sum_i alpha_ij (s_ij) Q_i gz_i``
    (``gy`` recomputed, not stored; alpha and s read through ``perm_t``),
    ``gv = Q_j^T gu``, d qs_j, d ks_j.

    When one tensor is several inputs (homogeneous graphs: ``qs`` is ``qd``,
    ``ks`` is ``kd``, the keys are the quaternions) the gradients are summed
    here rather than by autograd (an add launch each): ``SUM_QD`` adds pass A's
    d qd_j to d qs_j, ``SUM_KD`` pass A's d kd_j to d ks_j, ``KEYS_INTO_Q`` the
    (summed) key gradient to d qs_j (``D = 4``); what is stored in ``gks`` is
    then the keys' part alone or with ``SUM_KD`` the two keys' sum.

    ``TARGETS`` consecutive sources per program (issue 32 item 8c; rows ``>= N`` masked)."""
    for t in tl.static_range(TARGETS):
        j = tl.program_id(0).to(tl.int64) * TARGETS + t
        _backward_col(j, j < N, N, gz, v, qs, qd, kd, alpha, scale, gd, rowptr_t, perm_t, row_t, gv,
                      gqs, gks, gqd, gkd, H, M, D, gz_sn, gz_sh, ROTATE, HAS_SCALE, NEED_U,
                      NEED_V, NEED_Q, NEED_K, SUM_QD, SUM_KD, KEYS_INTO_Q, ACC, BE, BH, BM,
                      BD, gqs, 0, False)


@triton.jit
def unit_rows(q, out, R, EPS: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr):
    """``out[r] = q[r] / |q[r]|`` for ``BR`` of the ``R`` quaternions, the identity
    where ``|q| <= EPS`` (as :func:`qsv_pyg.quaternion.unit_quaternion`: a NaN
    norm is not small, so the NaN propagates)."""
    offs = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = offs < R
    w, x, y, z = _load4(q, offs * 4, rm, ACC)
    norm = tl.sqrt(w * w + x * x + y * y + z * z)
    small = norm <= EPS
    n = tl.where(small, EPS, norm)  # clamp_min: a NaN norm stays NaN
    _store4(out, offs * 4, rm, tl.where(small, 1.0, w / n), tl.where(small, 0.0, x / n),
            tl.where(small, 0.0, y / n), tl.where(small, 0.0, z / n))


@triton.jit
def unit_rows_backward(q, g, out, R, EPS: tl.constexpr, ACC: tl.constexpr,
                       BR: tl.constexpr):
    """The gradient of :func:`unit_rows`, ``(g - u <u, g>) / |q|`` (0 where the
    identity was taken), with the norm recomputed from ``q``."""
    offs = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = offs < R
    w, x, y, z = _load4(q, offs * 4, rm, ACC)
    g0, g1, g2, g3 = _load4(g, offs * 4, rm, ACC)
    norm = tl.sqrt(w * w + x * x + y * y + z * z)
    small = norm <= EPS
    n = tl.where(small, EPS, norm)
    w, x, y, z = w / n, x / n, y / n, z / n
    d = w * g0 + x * g1 + y * g2 + z * g3
    _store4(out, offs * 4, rm, tl.where(small, 0.0, (g0 - w * d) / n),
            tl.where(small, 0.0, (g1 - x * d) / n), tl.where(small, 0.0, (g2 - y * d) / n),
            tl.where(small, 0.0, (g3 - z * d) / n))


# The layer's hooks into the row walks (qsv_pyg.nn._triton_layer_kernels: the
# ``PROJECT`` and ``UNIT`` flags of _backward_row / _backward_col).


@triton.jit
def _unit_grad(nrm, off, mask, w, x, y, z, dw, dx, dy, dz, ACC: tl.constexpr):
    """The gradient through :func:`_unit` of ``d`` (as :func:`unit_rows_backward`),
    from the unit quaternion ``w..z`` and its saved divisor ``nrm[off]`` (negative
    where the identity was taken: gradient 0)."""
    n = tl.load(nrm + off, mask=mask, other=1).to(ACC)
    small = n < 0
    d = w * dw + x * dx + y * dy + z * dz
    return (tl.where(small, 0.0, (dw - w * d) / n), tl.where(small, 0.0, (dx - x * d) / n),
            tl.where(small, 0.0, (dy - y * d) / n), tl.where(small, 0.0, (dz - z * d) / n))


@triton.jit
def _project_back(i, valid, offs_h, hm, offs_m, mm, g, w, gh, gh_sn, root_off, H, M, F,
                  MEAN: tl.constexpr, ACC: tl.constexpr, BF: tl.constexpr):
    """The transpose of :func:`_project_row` for one target: ``gz = W_h g_i^h``
    (four component tiles ``[BH, BM]``); ``g_i`` itself (the gradient of the root
    term and the bias) is copied into ``gh``'s row at ``root_off``."""
    offs_f = tl.arange(0, BF)
    fm = offs_f < F
    if MEAN:  # g_i [F], every head's share 1 / H
        mf = offs_f < tl.where(valid, F, 0)
        g1 = tl.load(g + i * F + offs_f, mask=mf, other=0).to(ACC)
        tl.store(gh + i * gh_sn + root_off + offs_f, g1.to(gh.dtype.element_ty), mask=mf)
        gt = (g1 / H)[None, :]
    else:
        hf = offs_h[:, None] * F + offs_f[None, :]
        mhf = hm[:, None] & fm[None, :]
        gt = tl.load(g + i * (H * F) + hf, mask=mhf, other=0).to(ACC)
        tl.store(gh + i * gh_sn + root_off + hf, gt.to(gh.dtype.element_ty), mask=mhf)
    wb = offs_h[:, None, None] * (M * 4 * F) + offs_m[None, :, None] * (4 * F) + \
        offs_f[None, None, :]
    wm = hm[:, None, None] & mm[None, :, None] & fm[None, None, :]
    gg = gt[:, None, :]
    c0 = tl.reduce(gg * tl.load(w + wb, mask=wm, other=0).to(ACC), 2, _ADD)
    c1 = tl.reduce(gg * tl.load(w + wb + F, mask=wm, other=0).to(ACC), 2, _ADD)
    c2 = tl.reduce(gg * tl.load(w + wb + 2 * F, mask=wm, other=0).to(ACC), 2, _ADD)
    c3 = tl.reduce(gg * tl.load(w + wb + 3 * F, mask=wm, other=0).to(ACC), 2, _ADD)
    return c0, c1, c2, c3
