// QSV attention over a target-sorted CSR graph on CPU: the same arithmetic as
// qsv_pyg/nn/qsv_kernel.py's PyTorch implementation, in two passes over the
// graph instead of some forty separate kernels. Parallel over targets (forward,
// backward pass A) and over sources via the transposed CSR (backward pass B),
// so no atomics are needed and the result is deterministic.
//
// Built with -fopenmp: ATen's parallel_for is header code that only runs in
// parallel when the including file is compiled with OpenMP.
//
// Shapes (contiguous; T = float or double; E edges in target-sorted order):
//   v, u            [Ns, H, M, 4]  source features, rotated sources (u empty
//                                  when !rotate: then u = v)
//   qs / qd         [Ns|Nd, H, 4]  unit quaternions of the transport
//                                  (Q = diag(1, R(q)) computed on the fly)
//   ks / kd         [Ns|Nd, H, D]  routing keys: logit = beta_h * <kd_i, ks_j>
//                                  (D = 0: uniform routing)
//   beta            [H]
//   scale           [E, H]         optional per-edge scale of the aggregation,
//                                  y_i = sum_j alpha_ij scale_ij u_j (empty: none;
//                                  the kernels are then instantiated without it)
//   bias            [E, H]         optional additive logit term: logit = beta_h *
//                                  <kd_i, ks_j> + bias_ij (empty: none); its
//                                  gradient glogit [E, H] = dL/dlogit
//   rowptr          [Nd + 1]       CSR rows (targets); col [E] their sources
//   rowptr_t        [Ns + 1]       transposed rows (sources); perm_t [E] the
//                                  sorted-edge index of each entry, row_t [E]
//                                  its target
//   y, z, gy        [Nd, H, M, 4]  (y empty when !rotate: then y = z)
//   alpha, dot      [E, H]
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// Q = diag(1, R(q)) written as quadratic forms of q = (w, x, y, z), exactly as
// qsv_pyg.quaternion.quaternion_to_block_matrix (Q[0][0] = |q|^2), row-major.
template <typename T>
inline void block_matrix(const T* q, T* Q) {
  const T w = q[0], x = q[1], y = q[2], z = q[3];
  const T ww = w * w, xx = x * x, yy = y * y, zz = z * z;
  Q[0] = ww + xx + yy + zz; Q[1] = Q[2] = Q[3] = Q[4] = Q[8] = Q[12] = 0;
  Q[5] = ww + xx - yy - zz; Q[6] = 2 * (x * y - w * z); Q[7] = 2 * (x * z + w * y);
  Q[9] = 2 * (x * y + w * z); Q[10] = ww - xx + yy - zz; Q[11] = 2 * (y * z - w * x);
  Q[13] = 2 * (x * z - w * y); Q[14] = 2 * (y * z + w * x); Q[15] = ww - xx - yy + zz;
}

// out += dL/dq given G = dL/dQ (row-major 4x4), the derivative of block_matrix.
template <typename T>
inline void add_block_matrix_grad(const T* q, const T* G, T* out) {
  const T w = q[0], x = q[1], y = q[2], z = q[3];
  out[0] += 2 * (w * (G[0] + G[5] + G[10] + G[15]) - z * G[6] + y * G[7] + z * G[9] -
                 x * G[11] - y * G[13] + x * G[14]);
  out[1] += 2 * (x * (G[0] + G[5] - G[10] - G[15]) + y * G[6] + z * G[7] + y * G[9] -
                 w * G[11] + z * G[13] + w * G[14]);
  out[2] += 2 * (y * (G[0] - G[5] + G[10] - G[15]) + x * G[6] + w * G[7] + x * G[9] +
                 z * G[11] - w * G[13] + z * G[14]);
  out[3] += 2 * (z * (G[0] - G[5] - G[10] + G[15]) - w * G[6] + x * G[7] + w * G[9] +
                 y * G[11] + x * G[13] + y * G[14]);
}

// o_m = Q x_m (or Q^T x_m) for the M four-vectors of a row.
template <typename T>
inline void apply_rows(const T* Q, const T* x, T* o, int64_t M, bool transpose) {
  for (int64_t m = 0; m < M; ++m, x += 4, o += 4) {
    for (int a = 0; a < 4; ++a) {
      o[a] = transpose
                 ? Q[a] * x[0] + Q[4 + a] * x[1] + Q[8 + a] * x[2] + Q[12 + a] * x[3]
                 : Q[4 * a] * x[0] + Q[4 * a + 1] * x[1] + Q[4 * a + 2] * x[2] +
                       Q[4 * a + 3] * x[3];
    }
  }
}

// G = sum_m a_m b_m^T (row-major 4x4).
template <typename T>
inline void outer_rows(const T* a, const T* b, int64_t M, T* G) {
  for (int c = 0; c < 16; ++c) G[c] = 0;
  for (int64_t m = 0; m < M; ++m, a += 4, b += 4) {
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 4; ++c) G[4 * r + c] += a[r] * b[c];
    }
  }
}

// exp of a softmax argument (a logit minus its row's maximum, so <= 0; NaN
// stays NaN): the float case as a branch-free Cephes polynomial (relative
// error about 1e-7, underflow clamped at exp(-87.3) ~ 1e-38) that the compiler
// vectorises across heads (std::exp is a scalar call per (edge, head), ~30% of
// the forward at 16 heads of 4 channels); double keeps std::exp.
template <typename T>
inline T softmax_exp(T x) {
  return std::exp(x);
}

template <>
inline float softmax_exp<float>(float x) {
  x = x < -87.33654f ? -87.33654f : x;  // NaN compares false: kept
  x = x > 88.37626f ? 88.37626f : x;
  const float fx = x * 1.44269504088896341f + 0.5f;  // n = floor(x log2(e) + 1/2)
  int32_t n = static_cast<int32_t>(fx);
  n -= (fx < static_cast<float>(n));
  const float fn = static_cast<float>(n);
  const float r = x - fn * 0.693359375f - fn * -2.12194440e-4f;  // x - n ln 2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>(static_cast<int32_t>((n + 127) << 23));  // p 2^n
}

// The loops below are edge-outer, head-inner: a target row i walks its edges
// once, and for each edge reads the source's contiguous [H, D] keys and
// [H, blk] features and the edge's contiguous [H] weights; the per-head
// softmax state lives in arrays of size H and y_i is one contiguous [H * blk]
// accumulator. The widths blk = 4 M and D are template parameters for the
// common values (BLK > 0, DK >= 0; 0 and -1 mean "read it from Dims"), so the
// innermost loops are unrolled and vectorised. Every sum is taken in the same
// order as a head-by-head loop over the row's edges, so the results do not
// depend on the specialisation.

struct Dims {
  int64_t Ns, Nd, H, M, D, E;
  bool use_abs, rotate;
};

template <int BLK>
inline int64_t block_width(const Dims& s) {
  if constexpr (BLK > 0) {
    return BLK;
  } else {
    return s.M * 4;
  }
}

template <int DK>
inline int64_t key_width(const Dims& s) {
  if constexpr (DK >= 0) {
    return DK;
  } else {
    return s.D;
  }
}

template <typename T>
inline T dot_keys(const T* a, const T* b, int64_t D) {
  T d = 0;
  for (int64_t c = 0; c < D; ++c) d += a[c] * b[c];
  return d;
}

// Rows per parallel chunk: about 32k multiply-adds each, so that a few large
// rows (small graphs with a wide batch) still spread over the threads.
inline int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(work_per_row, 1));
}

// Ask for the cache lines of a row of n values that a loop will read soon
// (the rows of a target's sources, or of a source's targets, are scattered).
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

// One block of four channels per head (BLK == 4, the paper's 16 heads x 4): the
// per-(edge, head) loops would be four-long dot products and updates, which do
// not vectorise. Inside the kernels every node's rows are then held
// channel-major, [4, H] features and [D, H] keys, so that each such loop runs
// over the H heads with contiguous loads (a few vector operations per edge);
// the sums are the same, taken in the same order. The inputs and outputs keep
// their head-major layout: the transposed copies are O(N H) next to O(E H).
template <int BLK>
inline constexpr bool channel_major() {
  return BLK == 4;
}

// x [N, H, W] -> [N, W, H] (x may be null when W = 0).
template <typename T>
std::unique_ptr<T[]> to_channel_major(const T* x, int64_t N, int64_t H, int64_t W) {
  std::unique_ptr<T[]> out(new T[std::max<int64_t>(N * H * W, 1)]);
  if (N * H * W == 0) return out;
  T* o = out.get();
  at::parallel_for(0, N, grain(2 * H * W), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* xr = x + n * H * W;
      T* orow = o + n * H * W;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t c = 0; c < W; ++c) orow[c * H + h] = xr[h * W + c];
      }
    }
  });
  return out;
}

// The per-(node, head) quaternion work of a CM node, all heads at once (the
// loops over heads vectorise): qc [4, H] the heads' quaternions and the
// 4-vectors x, o, a, b [4, H], channel-major. The arithmetic is block_matrix,
// apply_rows, outer_rows and add_block_matrix_grad's, term for term.
//
// o_h = Q(q_h) x_h, or Q(q_h)^T x_h when TRANSPOSE.
template <bool TRANSPOSE, typename T>
inline void apply_heads(const T* __restrict__ qc, const T* __restrict__ x, T* __restrict__ o,
                        int64_t H) {
  for (int64_t h = 0; h < H; ++h) {
    const T q[4] = {qc[h], qc[H + h], qc[2 * H + h], qc[3 * H + h]};
    const T xh[4] = {x[h], x[H + h], x[2 * H + h], x[3 * H + h]};
    T Q[16], oh[4];
    block_matrix(q, Q);
    apply_rows(Q, xh, oh, 1, TRANSPOSE);
    for (int c = 0; c < 4; ++c) o[c * H + h] = oh[c];
  }
}

// out[h] = dL/dq_h (head-major [H, 4]) for dL/dQ_h = a_h b_h^T.
template <typename T>
inline void outer_grad_heads(const T* __restrict__ qc, const T* __restrict__ a,
                             const T* __restrict__ b, T* __restrict__ out, int64_t H) {
  for (int64_t h = 0; h < H; ++h) {
    const T q[4] = {qc[h], qc[H + h], qc[2 * H + h], qc[3 * H + h]};
    const T ah[4] = {a[h], a[H + h], a[2 * H + h], a[3 * H + h]};
    const T bh[4] = {b[h], b[H + h], b[2 * H + h], b[3 * H + h]};
    T G[16], oh[4] = {0, 0, 0, 0};
    outer_rows(ah, bh, 1, G);
    add_block_matrix_grad(q, G, oh);
    for (int c = 0; c < 4; ++c) out[h * 4 + c] = oh[c];
  }
}

// gk += w_h k_h for every head h: k, gk [H, D] rows, or [D, H] when CM; w [H].
template <bool CM, typename T>
inline void add_weighted_keys(T* __restrict__ gk, const T* __restrict__ w,
                              const T* __restrict__ k, int64_t H, int64_t D) {
  if constexpr (CM) {
    for (int64_t c = 0; c < D; ++c) {
      for (int64_t h = 0; h < H; ++h) gk[c * H + h] += w[h] * k[c * H + h];
    }
  } else {
    for (int64_t h = 0; h < H; ++h) {
      const T wh = w[h];
      for (int64_t c = 0; c < D; ++c) gk[h * D + c] += wh * k[h * D + c];
    }
  }
}

// One node's row [H, 4] <-> [4, H].
template <typename T>
inline void row_to_cm(const T* __restrict__ x, T* __restrict__ o, int64_t H) {
  for (int64_t h = 0; h < H; ++h) {
    for (int c = 0; c < 4; ++c) o[c * H + h] = x[h * 4 + c];
  }
}

template <typename T>
inline void row_from_cm(const T* __restrict__ x, T* __restrict__ o, int64_t H) {
  for (int64_t h = 0; h < H; ++h) {
    for (int c = 0; c < 4; ++c) o[h * 4 + c] = x[c * H + h];
  }
}

// Rows [N, H, W] of both sides (keys, quaternions) in the kernels' layout:
// channel-major copies when CM and W > 0 (one copy when both sides pass the
// same tensor), the inputs themselves otherwise.
template <bool CM, typename T>
struct CMRows {
  std::unique_ptr<T[]> s_buf, d_buf;
  const T* s;
  const T* d;
  CMRows(const T* ks, const T* kd, int64_t Ns, int64_t Nd, int64_t H, int64_t D)
      : s(ks), d(kd) {
    if constexpr (CM) {
      if (D == 0) return;
      s_buf = to_channel_major(ks, Ns, H, D);
      s = s_buf.get();
      if (kd == ks) {
        d = s;
      } else {
        d_buf = to_channel_major(kd, Nd, H, D);
        d = d_buf.get();
      }
    }
  }
};

template <bool SCALED, int BLK, int DK, typename T>
void forward_impl(const Dims& s, const T* v, const T* qs, const T* qd, const T* ks,
                  const T* kd, const T* beta, const T* scale, const T* bias,
                  const int64_t* rowptr, const int64_t* col, T* u, T* y, T* z, T* alpha,
                  T* dot) {
  constexpr bool CM = channel_major<BLK>();
  const int64_t H = s.H, M = s.M, D = key_width<DK>(s), blk = block_width<BLK>(s);
  const int64_t HB = H * blk, HD = H * D;
  const CMRows<CM, T> keys(ks, kd, s.Ns, s.Nd, H, D);
  // CM: the quaternions channel-major too (the keys' copies when they are the
  // keys), and the sources' rows [Ns, 4, H] (rotated, or v itself); u is still
  // written, head-major.
  const bool q_keys = CM && s.rotate && D == 4 && qs == ks && qd == kd;
  const CMRows<CM, T> quats(qs, qd, s.Ns, s.Nd, H, CM && s.rotate && !q_keys ? 4 : 0);
  const T* qs_cm = q_keys ? keys.s : quats.s;
  const T* qd_cm = q_keys ? keys.d : quats.d;
  std::unique_ptr<T[]> src_cm(CM ? new T[std::max<int64_t>(s.Ns * HB, 1)] : nullptr);
  if constexpr (CM) {  // u_j = Q_j v_j, all heads of a source at once
    at::parallel_for(0, s.Ns, grain(16 * H), [&](int64_t begin, int64_t end) {
      std::vector<T> vc(HB);
      for (int64_t j = begin; j < end; ++j) {
        T* o = src_cm.get() + j * HB;
        if (s.rotate) {
          row_to_cm(v + j * HB, vc.data(), H);
          apply_heads<false>(qs_cm + j * HB, vc.data(), o, H);
          row_from_cm(o, u + j * HB, H);
        } else {
          row_to_cm(v + j * HB, o, H);
        }
      }
    });
  } else if (s.rotate) {  // u_m = Q_j v_m for every block of every source row (j, h)
    at::parallel_for(0, s.Ns * H, grain(16 * M), [&](int64_t begin, int64_t end) {
      T Q[16];
      for (int64_t r = begin; r < end; ++r) {
        block_matrix(qs + r * 4, Q);
        apply_rows(Q, v + r * blk, u + r * blk, M, false);
      }
    });
  }
  const T* src = CM ? src_cm.get() : (s.rotate ? u : v);
  T* sum = s.rotate ? y : z;
  const bool use_abs = s.use_abs;
  const int64_t row_work =
      H * (blk + D + 16 * M) * std::max<int64_t>(s.E / std::max<int64_t>(s.Nd, 1), 1);
  at::parallel_for(0, s.Nd, grain(row_work), [&](int64_t begin, int64_t end) {
    T Q[16];
    // per head: the running max (then 1 / total), the total, the edge's weight;
    // CM: the row's [4, H] accumulator and its rotation
    std::vector<T> state(3 * H + (CM ? 2 * HB : 0));
    T* __restrict__ mx = state.data();
    T* __restrict__ tot = mx + H;
    T* __restrict__ wt = tot + H;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e0 = rowptr[i], deg = rowptr[i + 1] - e0;
      const int64_t* nb = col + e0;
      const T* kdi = keys.d + i * HD;
      // Logits, and the per-head max over the row's edges.
      for (int64_t h = 0; h < H; ++h) {
        mx[h] = -std::numeric_limits<T>::infinity();
        tot[h] = 0;
      }
      for (int64_t e = 0; e < deg; ++e) {  // the sources' rows, for the loops below
        prefetch_row(keys.s + nb[e] * HD, HD);
        prefetch_row(src + nb[e] * HB, HB);
      }
      for (int64_t e = 0; e < deg; ++e) {
        const T* ksj = keys.s + nb[e] * HD;
        T* __restrict__ al = alpha + (e0 + e) * H;
        T* __restrict__ dt = dot + (e0 + e) * H;
        const T* bi = bias ? bias + (e0 + e) * H : nullptr;
        if constexpr (CM) {  // all heads' key products at once
          for (int64_t h = 0; h < H; ++h) dt[h] = 0;
          for (int64_t c = 0; c < D; ++c) {
            for (int64_t h = 0; h < H; ++h) dt[h] += kdi[c * H + h] * ksj[c * H + h];
          }
        }
        for (int64_t h = 0; h < H; ++h) {
          T d;
          if constexpr (CM) {
            d = dt[h];
          } else {
            d = dot_keys(kdi + h * D, ksj + h * D, D);
            dt[h] = d;
          }
          const T l = beta[h] * (use_abs ? std::abs(d) : d) + (bi ? bi[h] : T(0));
          al[h] = l;
          mx[h] = l > mx[h] ? l : mx[h];
        }
      }
      // exp(logit - max): the shift per edge, then the exp over the row's
      // contiguous [deg, H] block at once (a loop over 4 heads alone would not
      // fill 8-lane vectors), then the totals, each in edge order.
      T* __restrict__ row_al = alpha + e0 * H;
      for (int64_t e = 0; e < deg; ++e) {
        for (int64_t h = 0; h < H; ++h) row_al[e * H + h] -= mx[h];
      }
      for (int64_t t = 0; t < deg * H; ++t) row_al[t] = softmax_exp(row_al[t]);
      for (int64_t e = 0; e < deg; ++e) {
        for (int64_t h = 0; h < H; ++h) tot[h] += row_al[e * H + h];
      }
      for (int64_t h = 0; h < H; ++h) mx[h] = T(1) / tot[h];
      const T* __restrict__ inv = mx;
      // Normalise, and y_i = sum_e alpha_e (s_e) src_j over all heads at once.
      T* __restrict__ yr = CM ? wt + H : sum + i * HB;
      for (int64_t c = 0; c < HB; ++c) yr[c] = 0;
      for (int64_t e = 0; e < deg; ++e) {
        T* __restrict__ al = alpha + (e0 + e) * H;
        const T* __restrict__ sj = src + nb[e] * HB;
        const T* sc = SCALED ? scale + (e0 + e) * H : nullptr;
        if constexpr (CM) {
          for (int64_t h = 0; h < H; ++h) {
            const T a = al[h] * inv[h];
            al[h] = a;
            if constexpr (SCALED) {
              wt[h] = a * sc[h];
            } else {
              wt[h] = a;
            }
          }
          for (int c = 0; c < 4; ++c) {
            for (int64_t h = 0; h < H; ++h) yr[c * H + h] += wt[h] * sj[c * H + h];
          }
          continue;
        }
        for (int64_t h = 0; h < H; ++h) {
          const T a = al[h] * inv[h];
          al[h] = a;
          T w = a;
          if constexpr (SCALED) w = a * sc[h];
          T* __restrict__ yh = yr + h * blk;
          const T* __restrict__ sh = sj + h * blk;
          for (int64_t c = 0; c < blk; ++c) yh[c] += w * sh[c];
        }
      }
      if constexpr (CM) {  // the accumulator back to head-major rows; z_i = Q_i^T y_i
        row_from_cm(yr, sum + i * HB, H);
        if (s.rotate) {
          T* zc = yr + HB;
          apply_heads<true>(qd_cm + i * HB, yr, zc, H);
          row_from_cm(zc, z + i * HB, H);
        }
      } else if (s.rotate) {  // z_m = Q_i^T y_m (rotate back by q_i*)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = i * H + h;
          block_matrix(qd + row * 4, Q);
          apply_rows(Q, y + row * blk, z + row * blk, M, true);
        }
      }
    }
  });
}

struct Needs {
  bool v, q, k;
};

// Longer than the usual 80 lines on purpose: the two passes share one argument
// list and pass B reads what pass A wrote (gy, gd); split, both halves would
// take the same twenty pointers.
//
// gd [E, H]: dL/d<kd, ks> of every edge (when the keys' gradients are needed),
// written by pass A in the sorted order, as alpha is. Pass B gathers both rows
// of each of its edges through perm_t (prefetched with the edge's other rows):
// a scatter into pass B's order instead, as until 2026-12-08, made pass A's
// stores miss (at 16 heads x 4 the backward took 1.16x as long).
template <bool SCALED, int BLK, int DK, typename T>
void backward_impl(const Dims& s, const Needs& need, const T* gz, const T* galpha,
                   const T* v, const T* qs, const T* qd, const T* ks, const T* kd,
                   const T* beta, const T* scale, const int64_t* rowptr, const int64_t* col,
                   const int64_t* rowptr_t, const int64_t* perm_t, const int64_t* row_t,
                   const T* alpha, const T* dot, const T* u, const T* y, T* gy_buf, T* gd,
                   T* glogit, T* gbeta_part, T* gqd, T* gkd, T* gv, T* gqs,
                   T* gks) {
  constexpr bool CM = channel_major<BLK>();
  const int64_t H = s.H, M = s.M, D = key_width<DK>(s), blk = block_width<BLK>(s);
  const int64_t HB = H * blk, HD = H * D;
  const bool use_abs = s.use_abs;
  const bool need_u = need.v || (need.q && s.rotate);
  const bool pass_b = need.v || need.q || need.k;
  // CM: the sources' rows and gy in [N, 4, H] (gy_buf is then unused), the
  // keys' rows in [N, D, H].
  std::unique_ptr<T[]> src_cm, gy_cm;
  if constexpr (CM) {
    src_cm = to_channel_major(s.rotate ? u : v, s.Ns, H, 4);
    gy_cm.reset(new T[std::max<int64_t>(s.Nd * HB, 1)]);
  }
  const CMRows<CM, T> keys(ks, kd, s.Ns, s.Nd, H, need.k ? D : 0);
  // CM: the quaternions [N, 4, H] (the keys' copies when they are the keys)
  const bool q_keys = CM && s.rotate && need.k && D == 4 && qs == ks && qd == kd;
  const CMRows<CM, T> quats(qs, qd, s.Ns, s.Nd, H, CM && s.rotate && !q_keys ? 4 : 0);
  const T* qs_cm = q_keys ? keys.s : quats.s;
  const T* qd_cm = q_keys ? keys.d : quats.d;
  const T* src = CM ? src_cm.get() : (s.rotate ? u : v);
  T* gy_rows = CM ? gy_cm.get() : gy_buf;
  const T* gy = CM || s.rotate ? gy_rows : gz;
  // Pass A, per target row i (all heads): gy = Q_i gz, softmax backward, logit
  // gradients, the target key's gradient and the target rotation's gradient.
  const int64_t row_work =
      H * (2 * blk + D + 32 * M) * std::max<int64_t>(s.E / std::max<int64_t>(s.Nd, 1), 1);
  at::parallel_for(0, s.Nd, grain(row_work), [&](int64_t begin, int64_t end) {
    T Q[16], G[16];
    // per head: sum_e alpha ga, beta's gradient; CM: the row's [D, H] key
    // gradient, and its gz and y [4, H]
    std::vector<T> state(2 * H + (CM ? HD + 2 * HB : 0)), ga_buf;
    T* __restrict__ sa = state.data();
    T* __restrict__ gb = sa + H;
    T* __restrict__ gzc = gb + H + (CM ? HD : 0);
    T* __restrict__ yc = gzc + (CM ? HB : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e0 = rowptr[i], deg = rowptr[i + 1] - e0;
      const int64_t* nb = col + e0;
      for (int64_t e = 0; e < deg; ++e) {  // the sources' rows, for the loops below
        prefetch_row(src + nb[e] * HB, HB);
        if (need.k) prefetch_row(keys.s + nb[e] * HD, HD);
      }
      const T* g = gz + i * HB;
      if constexpr (CM) {  // gy_i = Q_i gz_i, all heads at once
        if (s.rotate) {
          row_to_cm(g, gzc, H);
          apply_heads<false>(qd_cm + i * HB, gzc, gy_rows + i * HB, H);
        } else {
          row_to_cm(g, gy_rows + i * HB, H);
        }
      } else if (s.rotate) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = i * H + h;
          block_matrix(qd + row * 4, Q);
          apply_rows(Q, g + h * blk, gy_rows + row * blk, M, false);
        }
      }
      const T* __restrict__ gyr = gy + i * HB;
      if (static_cast<int64_t>(ga_buf.size()) < deg * H) ga_buf.resize(deg * H);
      T* __restrict__ gar = ga_buf.data();
      for (int64_t h = 0; h < H; ++h) sa[h] = gb[h] = 0;
      // ga = (s) <gy, u> + galpha; sa = sum_e alpha ga.
      for (int64_t e = 0; e < deg; ++e) {
        const T* __restrict__ uj = src + nb[e] * HB;
        const T* __restrict__ al = alpha + (e0 + e) * H;
        const T* ga = galpha ? galpha + (e0 + e) * H : nullptr;
        const T* sc = SCALED ? scale + (e0 + e) * H : nullptr;
        T* __restrict__ acc = gar + e * H;
        if constexpr (CM) {  // all heads at once, the sums in the order below
          for (int64_t h = 0; h < H; ++h) acc[h] = (SCALED || !ga) ? T(0) : ga[h];
          for (int c = 0; c < 4; ++c) {
            for (int64_t h = 0; h < H; ++h) acc[h] += gyr[c * H + h] * uj[c * H + h];
          }
          for (int64_t h = 0; h < H; ++h) {
            if constexpr (SCALED) acc[h] = sc[h] * acc[h] + (ga ? ga[h] : T(0));
            sa[h] += al[h] * acc[h];
          }
          continue;
        }
        for (int64_t h = 0; h < H; ++h) {
          const T* __restrict__ gh = gyr + h * blk;
          const T* __restrict__ uh = uj + h * blk;
          T a;
          if constexpr (SCALED) {  // y = sum alpha s u  =>  ga = s <gy, u> + galpha
            T d = 0;
            for (int64_t c = 0; c < blk; ++c) d += gh[c] * uh[c];
            a = sc[h] * d + (ga ? ga[h] : T(0));
          } else {
            a = ga ? ga[h] : T(0);
            for (int64_t c = 0; c < blk; ++c) a += gh[c] * uh[c];
          }
          acc[h] = a;
          sa[h] += al[h] * a;
        }
      }
      // dL/dlogit, beta's and the keys' gradients; gkd_i = sum_e gd_e ks_j.
      T* __restrict__ gk = need.k ? (CM ? gb + H : gkd + i * HD) : nullptr;
      if (need.k) {
        for (int64_t c = 0; c < HD; ++c) gk[c] = 0;
      }
      for (int64_t e = 0; e < deg; ++e) {
        const T* __restrict__ al = alpha + (e0 + e) * H;
        const T* __restrict__ dt = dot + (e0 + e) * H;
        T* __restrict__ gdr = gar + e * H;
        T* gl = glogit ? glogit + (e0 + e) * H : nullptr;
        for (int64_t h = 0; h < H; ++h) {
          const T gs = al[h] * (gdr[h] - sa[h]);  // dL/dlogit
          if (gl) gl[h] = gs;
          const T d = dt[h];
          gb[h] += gs * (use_abs ? std::abs(d) : d);
          T gdv = gs * beta[h];
          if (use_abs) gdv *= T((d > 0) - (d < 0));
          gdr[h] = gdv;
        }
        if (need.k) {  // pass B's input, gathered there
          T* __restrict__ out = gd + (e0 + e) * H;
          for (int64_t h = 0; h < H; ++h) out[h] = gdr[h];
        }
        if (need.k) {
          add_weighted_keys<CM>(gk, gdr, keys.s + nb[e] * HD, H, D);
        }
      }
      if constexpr (CM) {  // the key gradient back to head-major
        if (need.k) {
          for (int64_t h = 0; h < H; ++h) {
            for (int64_t c = 0; c < D; ++c) gkd[i * HD + h * D + c] = gk[c * H + h];
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) gbeta_part[i * H + h] = gb[h];
      if (need.q && s.rotate && CM) {  // z = Q^T y  =>  dL/dQ = y gz^T, all heads
        row_to_cm(y + i * HB, yc, H);
        outer_grad_heads(qd_cm + i * HB, yc, gzc, gqd + i * HB, H);
      } else if (need.q && s.rotate) {  // z = Q^T y  =>  dL/dQ = sum_m y_m gz_m^T
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = i * H + h;
          outer_rows(y + row * blk, g + h * blk, M, G);
          T* o = gqd + row * 4;
          o[0] = o[1] = o[2] = o[3] = 0;
          add_block_matrix_grad(qd + row * 4, G, o);
        }
      }
    }
  });
  if (!pass_b) return;
  // Pass B, per source node j over its outgoing edges (transposed CSR), all
  // heads of j at once: gu_j = sum_i alpha_ij (s_ij) gy_i, gks_j = sum_i gd_ij kd_i.
  const int64_t col_work =
      H * (blk + D) * std::max<int64_t>(s.E / std::max<int64_t>(s.Ns, 1), 1) + H * 32 * M;
  at::parallel_for(0, s.Ns, grain(col_work), [&](int64_t begin, int64_t end) {
    // the edge's weights [H]; gu (unless accumulated in gv in place); CM: the
    // [D, H] key gradient
    // [D, H] key gradient and a [4, H] row
    std::vector<T> buf(H + (need_u && (s.rotate || CM) ? HB : 0) + (CM ? HD + HB : 0));
    T* __restrict__ wa = buf.data();
    T* __restrict__ tmp = buf.data() + buf.size() - (CM ? HB : 0);
    T Q[16], G[16];
    for (int64_t j = begin; j < end; ++j) {
      const int64_t p0 = rowptr_t[j], p1 = rowptr_t[j + 1];
      for (int64_t p = p0; p < p1; ++p) {  // the rows the loop below gathers
        const int64_t e = perm_t[p];
        if (need_u) {
          prefetch_row(gy + row_t[p] * HB, HB);
          prefetch_row(alpha + e * H, H);
          if constexpr (SCALED) prefetch_row(scale + e * H, H);
        }
        if (need.k) {
          prefetch_row(keys.d + row_t[p] * HD, HD);
          prefetch_row(gd + e * H, H);
        }
      }
      // Without rotation (and head-major) gv = gu: accumulate in place.
      T* __restrict__ gu = s.rotate || CM ? wa + H : (need.v ? gv + j * HB : nullptr);
      T* __restrict__ gk =
          need.k ? (CM ? wa + H + (need_u ? HB : 0) : gks + j * HD) : nullptr;
      if (need_u) {
        for (int64_t c = 0; c < HB; ++c) gu[c] = 0;
      }
      if (need.k) {
        for (int64_t c = 0; c < HD; ++c) gk[c] = 0;
      }
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t i = row_t[p], e = perm_t[p];
        if (need_u) {  // the edge's alpha (s)
          const T* __restrict__ al = alpha + e * H;
          const T* sc = SCALED ? scale + e * H : nullptr;
          for (int64_t h = 0; h < H; ++h) {
            if constexpr (SCALED) {
              wa[h] = al[h] * sc[h];
            } else {
              wa[h] = al[h];
            }
          }
          const T* __restrict__ gyi = gy + i * HB;
          if constexpr (CM) {
            for (int c = 0; c < 4; ++c) {
              for (int64_t h = 0; h < H; ++h) gu[c * H + h] += wa[h] * gyi[c * H + h];
            }
          } else {
            for (int64_t h = 0; h < H; ++h) {
              const T a = wa[h];
              T* __restrict__ o = gu + h * blk;
              const T* __restrict__ gh = gyi + h * blk;
              for (int64_t c = 0; c < blk; ++c) o[c] += a * gh[c];
            }
          }
        }
        if (need.k) {
          add_weighted_keys<CM>(gk, gd + e * H, keys.d + i * HD, H, D);
        }
      }
      if constexpr (CM) {  // back to head-major: the key gradient, and gu per head
        if (need.k) {
          for (int64_t h = 0; h < H; ++h) {
            for (int64_t c = 0; c < D; ++c) gks[j * HD + h * D + c] = gk[c * H + h];
          }
        }
        if (need_u && s.rotate) {  // u = Q v  =>  gv = Q^T gu, dL/dQ = gu v^T
          if (need.v) {
            apply_heads<true>(qs_cm + j * HB, gu, tmp, H);
            row_from_cm(tmp, gv + j * HB, H);
          }
          if (need.q) {
            row_to_cm(v + j * HB, tmp, H);
            outer_grad_heads(qs_cm + j * HB, gu, tmp, gqs + j * HB, H);
          }
        } else if (need_u && need.v) {
          row_from_cm(gu, gv + j * HB, H);
        }
        continue;
      }
      if (s.rotate && need_u) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = j * H + h;
          const T* gur = gu + h * blk;
          block_matrix(qs + r * 4, Q);
          if (need.v) apply_rows(Q, gur, gv + r * blk, M, true);  // u = Q v  =>  gv = Q^T gu
          if (need.q) {  // u = Q v  =>  dL/dQ = sum_m gu_m v_m^T
            outer_rows(gur, v + r * blk, M, G);
            T* o = gqs + r * 4;
            o[0] = o[1] = o[2] = o[3] = 0;
            add_block_matrix_grad(qs + r * 4, G, o);
          }
        }
      }
    }
  });
}

// Calls f(std::integral_constant<int, BLK>, std::integral_constant<int, DK>)
// with the specialised widths of (blk, D), or 0 / -1 (read at run time).
// Specialised: blk in {4, 8, 16, 32} (M = 1, 2, 4, 8: the paper's head layouts
// 16x4, 8x8, 4x16, 2x32 of 64 channels) and D in {0, 4} (uniform routing,
// quaternion keys).
template <typename F>
void with_widths(int64_t blk, int64_t D, F&& f) {
  auto keys = [&](auto b) {
    switch (D) {
      case 0: return f(b, std::integral_constant<int, 0>{});
      case 4: return f(b, std::integral_constant<int, 4>{});
      default: return f(b, std::integral_constant<int, -1>{});
    }
  };
  switch (blk) {
    case 4: return keys(std::integral_constant<int, 4>{});
    case 8: return keys(std::integral_constant<int, 8>{});
    case 16: return keys(std::integral_constant<int, 16>{});
    case 32: return keys(std::integral_constant<int, 32>{});
    default: return keys(std::integral_constant<int, 0>{});
  }
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "qsv_kernel_cpu: ", name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), "qsv_kernel_cpu: ", name, " must be contiguous");
}

void check_index(const torch::Tensor& t, const char* name) {
  check(t, name);
  TORCH_CHECK(t.scalar_type() == torch::kLong, "qsv_kernel_cpu: ", name, " must be int64");
}

// The kernels index with these arrays unchecked: refuse a malformed graph (one
// pass over E integers, negligible next to the E * H * M * 4 products).
void check_graph(const torch::Tensor& rowptr, const torch::Tensor& col, int64_t Ns) {
  const int64_t* rp = rowptr.data_ptr<int64_t>();
  const int64_t* c = col.data_ptr<int64_t>();
  const int64_t Nd = rowptr.size(0) - 1, E = col.size(0);
  TORCH_CHECK(Nd >= 0 && rp[0] == 0 && rp[Nd] == E, "qsv_kernel_cpu: rowptr must run from 0 to E");
  for (int64_t i = 0; i < Nd; ++i) {
    TORCH_CHECK(rp[i] <= rp[i + 1], "qsv_kernel_cpu: rowptr must be non-decreasing");
  }
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(c[e] >= 0 && c[e] < Ns, "qsv_kernel_cpu: source index ", c[e],
                " out of range [0, ", Ns, ")");
  }
}

Dims dims(const torch::Tensor& v, const torch::Tensor& ks, const torch::Tensor& rowptr,
          bool use_abs, bool rotate) {
  return Dims{v.size(0), rowptr.size(0) - 1, v.size(1), v.size(2), ks.size(2), 0, use_abs,
              rotate};
}

template <typename T>
T* ptr_or_null(torch::Tensor& t) {
  return t.numel() ? t.data_ptr<T>() : nullptr;
}

// scale / bias: empty (none) or [E, H] of v's dtype.
void check_edge_input(const torch::Tensor& t, const char* name, const torch::Tensor& v,
                      int64_t E, int64_t H) {
  if (t.numel() == 0) return;
  check(t, name);
  TORCH_CHECK(t.scalar_type() == v.scalar_type(), "qsv_kernel_cpu: ", name,
              " must have the features' dtype");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == E && t.size(1) == H, "qsv_kernel_cpu: ", name,
              " ", t.sizes(), " must be empty or [E, H] = [", E, ", ", H, "]");
}

std::vector<torch::Tensor> qsv_forward(torch::Tensor v, torch::Tensor qs, torch::Tensor qd,
                                       torch::Tensor ks, torch::Tensor kd, torch::Tensor beta,
                                       torch::Tensor scale, torch::Tensor bias,
                                       torch::Tensor rowptr, torch::Tensor col, bool use_abs,
                                       bool rotate) {
  for (auto* t : {&v, &qs, &qd, &ks, &kd, &beta}) check(*t, "input");
  check_index(rowptr, "rowptr");
  check_index(col, "col");
  Dims s = dims(v, ks, rowptr, use_abs, rotate);
  const int64_t E = s.E = col.size(0);
  check_graph(rowptr, col, s.Ns);
  check_edge_input(scale, "scale", v, E, s.H);
  check_edge_input(bias, "bias", v, E, s.H);
  const bool scaled = scale.numel() > 0;
  auto opts = v.options();
  auto u = rotate ? torch::empty_like(v) : torch::empty({0}, opts);
  auto y = rotate ? torch::empty({s.Nd, s.H, s.M, 4}, opts) : torch::empty({0}, opts);
  auto z = torch::empty({s.Nd, s.H, s.M, 4}, opts);
  auto alpha = torch::empty({E, s.H}, opts);
  auto dot = torch::empty({E, s.H}, opts);
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "qsv_forward", [&] {
    auto run = [&](auto scaled_tag, auto blk_tag, auto key_tag) {
      forward_impl<decltype(scaled_tag)::value, decltype(blk_tag)::value,
                   decltype(key_tag)::value, scalar_t>(
          s, v.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(qs), ptr_or_null<scalar_t>(qd),
          ptr_or_null<scalar_t>(ks), ptr_or_null<scalar_t>(kd), beta.data_ptr<scalar_t>(),
          ptr_or_null<scalar_t>(scale), ptr_or_null<scalar_t>(bias),
          rowptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), ptr_or_null<scalar_t>(u), ptr_or_null<scalar_t>(y), z.data_ptr<scalar_t>(),
          alpha.data_ptr<scalar_t>(), dot.data_ptr<scalar_t>());
    };
    with_widths(s.M * 4, s.D, [&](auto blk_tag, auto key_tag) {
      if (scaled) {
        run(std::true_type{}, blk_tag, key_tag);
      } else {
        run(std::false_type{}, blk_tag, key_tag);
      }
    });
  });
  return {z, alpha, u, y, dot};
}

std::vector<torch::Tensor> qsv_backward(
    torch::Tensor gz, c10::optional<torch::Tensor> galpha, torch::Tensor v, torch::Tensor qs,
    torch::Tensor qd, torch::Tensor ks, torch::Tensor kd, torch::Tensor beta,
    torch::Tensor scale, torch::Tensor rowptr, torch::Tensor col, torch::Tensor rowptr_t,
    torch::Tensor perm_t, torch::Tensor row_t, torch::Tensor alpha, torch::Tensor dot,
    torch::Tensor u, torch::Tensor y, bool use_abs, bool rotate, bool need_v, bool need_q,
    bool need_k, bool need_bias) {
  for (auto* t : {&gz, &v, &qs, &qd, &ks, &kd, &beta, &alpha, &dot, &u, &y}) check(*t, "input");
  for (auto* t : {&rowptr, &col, &rowptr_t, &perm_t, &row_t}) check_index(*t, "index");
  if (galpha.has_value()) check(*galpha, "grad_alpha");
  Dims s = dims(v, ks, rowptr, use_abs, rotate);
  const Needs need{need_v, need_q && rotate, need_k && s.D > 0};
  const int64_t E = s.E = col.size(0);
  check_edge_input(scale, "scale", v, E, s.H);
  const bool scaled = scale.numel() > 0;
  auto opts = v.options();
  // Unneeded outputs are distinct empty tensors (returns may not alias).
  auto maybe = [&](bool need, std::vector<int64_t> shape) {
    return need ? torch::empty(shape, opts) : torch::empty({0}, opts);
  };
  auto gy = maybe(rotate && s.M != 1, {s.Nd, s.H, s.M, 4});  // M = 1: channel-major inside
  auto gd = maybe(need.k, {E, s.H});
  auto glogit = maybe(need_bias, {E, s.H});
  auto gbeta_part = torch::empty({s.Nd, s.H}, opts);
  auto gqd = maybe(need.q, {s.Nd, s.H, 4});
  auto gqs = maybe(need.q, {s.Ns, s.H, 4});
  auto gkd = maybe(need.k, {s.Nd, s.H, s.D});
  auto gks = maybe(need.k, {s.Ns, s.H, s.D});
  auto gv = maybe(need_v, v.sizes().vec());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "qsv_backward", [&] {
    auto run = [&](auto scaled_tag, auto blk_tag, auto key_tag) {
      backward_impl<decltype(scaled_tag)::value, decltype(blk_tag)::value,
                    decltype(key_tag)::value, scalar_t>(
          s, need, gz.data_ptr<scalar_t>(),
          galpha.has_value() ? galpha->data_ptr<scalar_t>() : nullptr, v.data_ptr<scalar_t>(),
          ptr_or_null<scalar_t>(qs), ptr_or_null<scalar_t>(qd), ptr_or_null<scalar_t>(ks),
          ptr_or_null<scalar_t>(kd), beta.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(scale),
          rowptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), rowptr_t.data_ptr<int64_t>(),
          perm_t.data_ptr<int64_t>(), row_t.data_ptr<int64_t>(), alpha.data_ptr<scalar_t>(),
          dot.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(u), ptr_or_null<scalar_t>(y),
          ptr_or_null<scalar_t>(gy), ptr_or_null<scalar_t>(gd), ptr_or_null<scalar_t>(glogit),
          gbeta_part.data_ptr<scalar_t>(),
          ptr_or_null<scalar_t>(gqd), ptr_or_null<scalar_t>(gkd), ptr_or_null<scalar_t>(gv),
          ptr_or_null<scalar_t>(gqs), ptr_or_null<scalar_t>(gks));
    };
    with_widths(s.M * 4, s.D, [&](auto blk_tag, auto key_tag) {
      if (scaled) {
        run(std::true_type{}, blk_tag, key_tag);
      } else {
        run(std::false_type{}, blk_tag, key_tag);
      }
    });
  });
  return {gv, gqs, gqd, gks, gkd, gbeta_part.sum(0), glogit};
}

// unit[r] = q[r] / |q[r]| for the R = numel / 4 quaternions of q, the identity
// where |q| <= eps (as qsv_pyg.quaternion.unit_quaternion: a NaN norm is not
// small, so the NaN propagates); one pass instead of nine PyTorch ops.
torch::Tensor unit_forward(torch::Tensor q, double eps) {
  check(q, "q");
  TORCH_CHECK(q.numel() % 4 == 0, "qsv_kernel_cpu: q must end in a dimension of 4");
  auto out = torch::empty_like(q);
  const int64_t R = q.numel() / 4;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "unit_forward", [&] {
    const scalar_t* src = q.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const scalar_t e = static_cast<scalar_t>(eps);
    at::parallel_for(0, R, 8192, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* a = src + 4 * r;
        scalar_t* o = dst + 4 * r;
        const scalar_t norm = std::sqrt(a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3]);
        if (norm <= e) {
          o[0] = 1; o[1] = o[2] = o[3] = 0;
        } else {
          for (int c = 0; c < 4; ++c) o[c] = a[c] / norm;
        }
      }
    });
  });
  return out;
}

// The gradient of unit_forward for the incoming grad, (g - u <u, g>) / |q|
// (0 where the identity was taken), with the norm recomputed from q.
torch::Tensor unit_backward(torch::Tensor q, torch::Tensor grad, double eps) {
  check(q, "q");
  check(grad, "grad");
  TORCH_CHECK(grad.sizes() == q.sizes() && grad.scalar_type() == q.scalar_type(),
              "qsv_kernel_cpu: grad must match q");
  auto out = torch::empty_like(q);
  const int64_t R = q.numel() / 4;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "unit_backward", [&] {
    const scalar_t* src = q.data_ptr<scalar_t>();
    const scalar_t* gr = grad.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const scalar_t e = static_cast<scalar_t>(eps);
    at::parallel_for(0, R, 8192, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* a = src + 4 * r;
        const scalar_t* g = gr + 4 * r;
        scalar_t* o = dst + 4 * r;
        const scalar_t norm = std::sqrt(a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3]);
        if (norm <= e) {
          o[0] = o[1] = o[2] = o[3] = 0;
          continue;
        }
        scalar_t u[4], d = 0;
        for (int c = 0; c < 4; ++c) {
          u[c] = a[c] / norm;
          d += u[c] * g[c];
        }
        for (int c = 0; c < 4; ++c) o[c] = (g[c] - u[c] * d) / norm;
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qsv_pyg: QSV attention over a CSR graph on CPU";
  m.def("forward", &qsv_forward, "QSV attention, forward (CPU)");
  m.def("backward", &qsv_backward, "QSV attention, backward (CPU)");
  m.def("unit_forward", &unit_forward, "q / |q|, the identity where |q| <= eps (CPU)");
  m.def("unit_backward", &unit_backward, "the gradient of unit_forward (CPU)");
}
