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
#include <cmath>
#include <limits>
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

// The weight of edge e (stride H): w[e * H], times sc[e * H] when SCALED (the
// unscaled instantiation never touches sc).
template <bool SCALED, typename T>
inline T edge_weight(const T* w, const T* sc, int64_t e, int64_t H) {
  if constexpr (SCALED) {
    return w[e * H] * sc[e * H];
  } else {
    return w[e * H];
  }
}

// out = sum_e w[e * H] (* sc[e * H]) * src[(idx[e] * H + h) * blk], one row of blk
// values; the common widths accumulate in registers instead of in memory.
template <bool SCALED, typename T, int BLK>
inline void weighted_rows_fixed(const T* w, const T* sc, const int64_t* idx, int64_t deg,
                                const T* src, int64_t H, int64_t h, T* __restrict__ out) {
  T acc[BLK];
  for (int c = 0; c < BLK; ++c) acc[c] = 0;
  for (int64_t e = 0; e < deg; ++e) {
    const T a = edge_weight<SCALED>(w, sc, e, H);
    const T* __restrict__ s = src + (idx[e] * H + h) * BLK;
    for (int c = 0; c < BLK; ++c) acc[c] += a * s[c];
  }
  for (int c = 0; c < BLK; ++c) out[c] = acc[c];
}

template <bool SCALED, typename T>
inline void weighted_rows(const T* w, const T* sc, const int64_t* idx, int64_t deg,
                          const T* src, int64_t H, int64_t h, int64_t blk,
                          T* __restrict__ out) {
  switch (blk) {
    case 4: return weighted_rows_fixed<SCALED, T, 4>(w, sc, idx, deg, src, H, h, out);
    case 8: return weighted_rows_fixed<SCALED, T, 8>(w, sc, idx, deg, src, H, h, out);
    case 16: return weighted_rows_fixed<SCALED, T, 16>(w, sc, idx, deg, src, H, h, out);
    case 32: return weighted_rows_fixed<SCALED, T, 32>(w, sc, idx, deg, src, H, h, out);
    case 64: return weighted_rows_fixed<SCALED, T, 64>(w, sc, idx, deg, src, H, h, out);
    default:
      for (int64_t c = 0; c < blk; ++c) out[c] = 0;
      for (int64_t e = 0; e < deg; ++e) {
        const T a = edge_weight<SCALED>(w, sc, e, H);
        const T* s = src + (idx[e] * H + h) * blk;
        for (int64_t c = 0; c < blk; ++c) out[c] += a * s[c];
      }
  }
}

template <typename T>
inline T dot_keys(const T* a, const T* b, int64_t D) {
  T d = 0;
  for (int64_t c = 0; c < D; ++c) d += a[c] * b[c];
  return d;
}

struct Dims {
  int64_t Ns, Nd, H, M, D, E;
  bool use_abs, rotate;
};

// Rows per parallel chunk: about 32k multiply-adds each, so that a few large
// rows (small graphs with a wide batch) still spread over the threads.
inline int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(work_per_row, 1));
}

template <bool SCALED, typename T>
void forward_impl(const Dims& s, const T* v, const T* qs, const T* qd, const T* ks,
                  const T* kd, const T* beta, const T* scale, const T* bias,
                  const int64_t* rowptr, const int64_t* col, T* u, T* y, T* z, T* alpha,
                  T* dot) {
  const int64_t H = s.H, M = s.M, D = s.D, blk = M * 4;
  if (s.rotate) {  // u_m = Q_j v_m for every block of every source row (j, h)
    at::parallel_for(0, s.Ns * H, grain(16 * M), [&](int64_t begin, int64_t end) {
      T Q[16];
      for (int64_t r = begin; r < end; ++r) {
        block_matrix(qs + r * 4, Q);
        apply_rows(Q, v + r * blk, u + r * blk, M, false);
      }
    });
  }
  const T* src = s.rotate ? u : v;
  T* sum = s.rotate ? y : z;
  const int64_t row_work =
      H * (blk + D + 16 * M) * std::max<int64_t>(s.E / std::max<int64_t>(s.Nd, 1), 1);
  at::parallel_for(0, s.Nd, grain(row_work), [&](int64_t begin, int64_t end) {
    T Q[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e0 = rowptr[i], deg = rowptr[i + 1] - e0;
      const int64_t* nb = col + e0;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = i * H + h;
        T* al = alpha + e0 * H + h;
        T* dt = dot + e0 * H + h;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t e = 0; e < deg; ++e) {
          const T d = dot_keys(kd + row * D, ks + (nb[e] * H + h) * D, D);
          dt[e * H] = d;
          const T l = beta[h] * (s.use_abs ? std::abs(d) : d) +
                      (bias ? bias[(e0 + e) * H + h] : T(0));
          al[e * H] = l;
          mx = l > mx ? l : mx;
        }
        T total = 0;
        for (int64_t e = 0; e < deg; ++e) {
          const T ex = std::exp(al[e * H] - mx);
          al[e * H] = ex;
          total += ex;
        }
        const T inv = T(1) / total;
        for (int64_t e = 0; e < deg; ++e) al[e * H] *= inv;
        T* yr = sum + row * blk;
        weighted_rows<SCALED, T>(al, SCALED ? scale + e0 * H + h : nullptr, nb, deg, src, H,
                                 h, blk, yr);
        if (s.rotate) {  // z_m = Q_i^T y_m (rotate back by q_i*)
          block_matrix(qd + row * 4, Q);
          apply_rows(Q, yr, z + row * blk, M, true);
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
template <bool SCALED, typename T>
void backward_impl(const Dims& s, const Needs& need, const T* gz, const T* galpha,
                   const T* v, const T* qs, const T* qd, const T* ks, const T* kd,
                   const T* beta, const T* scale, const int64_t* rowptr, const int64_t* col,
                   const int64_t* rowptr_t, const int64_t* perm_t, const int64_t* row_t,
                   const T* alpha, const T* dot, const T* u, const T* y, T* gy_buf, T* gd,
                   T* glogit, T* gbeta_part, T* gqd, T* gkd, T* gv, T* gqs, T* gks) {
  const int64_t H = s.H, M = s.M, D = s.D, blk = M * 4;
  const T* src = s.rotate ? u : v;
  const T* gy = s.rotate ? gy_buf : gz;
  // Pass A, per target row (i, h): gy = Q_i gz, softmax backward, logit
  // gradients, the target key's gradient and the target rotation's gradient.
  const int64_t row_work =
      H * (2 * blk + D + 32 * M) * std::max<int64_t>(s.E / std::max<int64_t>(s.Nd, 1), 1);
  at::parallel_for(0, s.Nd, grain(row_work), [&](int64_t begin, int64_t end) {
    T Q[16], G[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e0 = rowptr[i], deg = rowptr[i + 1] - e0;
      const int64_t* nb = col + e0;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = i * H + h;
        const T* g = gz + row * blk;
        if (s.rotate) {
          block_matrix(qd + row * 4, Q);
          apply_rows(Q, g, gy_buf + row * blk, M, false);
        }
        const T* gyr = gy + row * blk;
        const T* al = alpha + e0 * H + h;
        const T* dt = dot + e0 * H + h;
        T* gdr = gd + e0 * H + h;
        T sa = 0;
        for (int64_t e = 0; e < deg; ++e) {  // ga (held in gd for now)
          const T* uj = src + (nb[e] * H + h) * blk;
          T acc;
          if constexpr (SCALED) {  // y = sum alpha s u  =>  ga = s <gy, u> + galpha
            T d = 0;
            for (int64_t c = 0; c < blk; ++c) d += gyr[c] * uj[c];
            acc = scale[(e0 + e) * H + h] * d + (galpha ? galpha[(e0 + e) * H + h] : T(0));
          } else {
            acc = galpha ? galpha[(e0 + e) * H + h] : T(0);
            for (int64_t c = 0; c < blk; ++c) acc += gyr[c] * uj[c];
          }
          gdr[e * H] = acc;
          sa += al[e * H] * acc;
        }
        T gb = 0;
        for (int64_t e = 0; e < deg; ++e) {
          const T gs = al[e * H] * (gdr[e * H] - sa);  // dL/dlogit
          if (glogit) glogit[(e0 + e) * H + h] = gs;
          const T d = dt[e * H];
          gb += gs * (s.use_abs ? std::abs(d) : d);
          T gdv = gs * beta[h];
          if (s.use_abs) gdv *= T((d > 0) - (d < 0));
          gdr[e * H] = gdv;
        }
        gbeta_part[row] = gb;
        if (need.k) {
          T* o = gkd + row * D;
          for (int64_t c = 0; c < D; ++c) o[c] = 0;
          for (int64_t e = 0; e < deg; ++e) {
            const T* kj = ks + (nb[e] * H + h) * D;
            for (int64_t c = 0; c < D; ++c) o[c] += gdr[e * H] * kj[c];
          }
        }
        if (need.q && s.rotate) {  // z = Q^T y  =>  dL/dQ = sum_m y_m gz_m^T
          outer_rows(y + row * blk, g, M, G);
          T* o = gqd + row * 4;
          o[0] = o[1] = o[2] = o[3] = 0;
          add_block_matrix_grad(qd + row * 4, G, o);
        }
      }
    }
  });
  if (!need.v && !need.q && !need.k) return;
  // Pass B, per source node j over its outgoing edges (transposed CSR).
  const int64_t col_work =
      H * (blk + D) * std::max<int64_t>(s.E / std::max<int64_t>(s.Ns, 1), 1) + H * 32 * M;
  at::parallel_for(0, s.Ns, grain(col_work), [&](int64_t begin, int64_t end) {
    std::vector<T> gu(H * blk);
    T Q[16], G[16];
    for (int64_t j = begin; j < end; ++j) {
      const bool need_u = need.v || (need.q && s.rotate);
      if (need_u) std::fill(gu.begin(), gu.end(), T(0));
      if (need.k) {
        for (int64_t c = 0; c < H * D; ++c) gks[j * H * D + c] = 0;
      }
      for (int64_t p = rowptr_t[j]; p < rowptr_t[j + 1]; ++p) {
        const int64_t e = perm_t[p], i = row_t[p];
        for (int64_t h = 0; h < H; ++h) {
          if (need_u) {  // gu_j = sum_i alpha_ij (s_ij) gy_i
            const T a = SCALED ? alpha[e * H + h] * scale[e * H + h] : alpha[e * H + h];
            const T* gyr = gy + (i * H + h) * blk;
            T* o = gu.data() + h * blk;
            for (int64_t c = 0; c < blk; ++c) o[c] += a * gyr[c];
          }
          if (need.k) {
            const T gdv = gd[e * H + h];
            const T* ki = kd + (i * H + h) * D;
            T* o = gks + (j * H + h) * D;
            for (int64_t c = 0; c < D; ++c) o[c] += gdv * ki[c];
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = j * H + h;
        const T* gur = gu.data() + h * blk;
        if (s.rotate && need_u) block_matrix(qs + r * 4, Q);
        if (need.v) {  // u = Q v  =>  gv = Q^T gu
          if (s.rotate) {
            apply_rows(Q, gur, gv + r * blk, M, true);
          } else {
            std::copy(gur, gur + blk, gv + r * blk);
          }
        }
        if (need.q && s.rotate) {  // u = Q v  =>  dL/dQ = sum_m gu_m v_m^T
          outer_rows(gur, v + r * blk, M, G);
          T* o = gqs + r * 4;
          o[0] = o[1] = o[2] = o[3] = 0;
          add_block_matrix_grad(qs + r * 4, G, o);
        }
      }
    }
  });
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
    auto run = [&](auto scaled_tag) {
      forward_impl<decltype(scaled_tag)::value, scalar_t>(
          s, v.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(qs), ptr_or_null<scalar_t>(qd),
          ptr_or_null<scalar_t>(ks), ptr_or_null<scalar_t>(kd), beta.data_ptr<scalar_t>(),
          ptr_or_null<scalar_t>(scale), ptr_or_null<scalar_t>(bias),
          rowptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), ptr_or_null<scalar_t>(u), ptr_or_null<scalar_t>(y), z.data_ptr<scalar_t>(),
          alpha.data_ptr<scalar_t>(), dot.data_ptr<scalar_t>());
    };
    if (scaled) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
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
  auto gy = maybe(rotate, {s.Nd, s.H, s.M, 4});
  auto gd = torch::empty({E, s.H}, opts);
  auto glogit = maybe(need_bias, {E, s.H});
  auto gbeta_part = torch::empty({s.Nd, s.H}, opts);
  auto gqd = maybe(need.q, {s.Nd, s.H, 4});
  auto gqs = maybe(need.q, {s.Ns, s.H, 4});
  auto gkd = maybe(need.k, {s.Nd, s.H, s.D});
  auto gks = maybe(need.k, {s.Ns, s.H, s.D});
  auto gv = maybe(need_v, v.sizes().vec());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "qsv_backward", [&] {
    auto run = [&](auto scaled_tag) {
      backward_impl<decltype(scaled_tag)::value, scalar_t>(
          s, need, gz.data_ptr<scalar_t>(),
          galpha.has_value() ? galpha->data_ptr<scalar_t>() : nullptr, v.data_ptr<scalar_t>(),
          ptr_or_null<scalar_t>(qs), ptr_or_null<scalar_t>(qd), ptr_or_null<scalar_t>(ks),
          ptr_or_null<scalar_t>(kd), beta.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(scale),
          rowptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), rowptr_t.data_ptr<int64_t>(),
          perm_t.data_ptr<int64_t>(), row_t.data_ptr<int64_t>(), alpha.data_ptr<scalar_t>(),
          dot.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(u), ptr_or_null<scalar_t>(y),
          ptr_or_null<scalar_t>(gy), gd.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(glogit),
          gbeta_part.data_ptr<scalar_t>(),
          ptr_or_null<scalar_t>(gqd), ptr_or_null<scalar_t>(gkd), ptr_or_null<scalar_t>(gv),
          ptr_or_null<scalar_t>(gqs), ptr_or_null<scalar_t>(gks));
    };
    if (scaled) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  return {gv, gqs, gqd, gks, gkd, gbeta_part.sum(0), glogit};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qsv_pyg: QSV attention over a CSR graph on CPU";
  m.def("forward", &qsv_forward, "QSV attention, forward (CPU)");
  m.def("backward", &qsv_backward, "QSV attention, backward (CPU)");
}
