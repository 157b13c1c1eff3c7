// The fused QSV aggregation on CPU: the same arithmetic as the PyTorch path of
// qsv_pyg/nn/qsv_kernel.py (block-major layout), in two passes over the graph
// instead of ~40 separate kernels. Parallel over targets (forward, backward
// pass A) and over sources via the transposed CSR lists (backward pass B), so
// no atomics are needed and the result is deterministic.
//
// Built with -fopenmp: ATen's parallel_for is header code that only runs in
// parallel when the including file is compiled with OpenMP (2x on 2 cores).
//
// Shapes (contiguous; T = float or double):
//   v, u             [Ns, H, M, 4]    source features, rotated sources
//   qs / qd          [Ns|Nd, H, 4]    unit quaternions (Q = diag(1, R(q)) is
//                                     computed on the fly, 16 multiply-adds)
//   beta             [H]
//   nbr              [Nd, k] int64    source of the k-th edge into each target
//   y, z, gy         [Nd, H, M, 4]
//   alpha, dot, gd   [Nd, H, k]       (target, head, edge) order = CSR value order
//   crow_t, col_t    int32, rows (j, h) of A^T; col_t = row (i, h) of A
//   perm             int64, position of each A^T entry in the (i, h, k) order
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
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

// y = sum_e w[e] * u[row(nb[e], h)], a row of blk values; the common widths
// accumulate in registers (a fixed-size local array) instead of in memory.
template <typename T, int BLK>
inline void weighted_rows_fixed(const T* w, const int64_t* nb, const T* u, int64_t H,
                                int64_t h, int64_t k, T* __restrict__ out) {
  T acc[BLK];
  for (int c = 0; c < BLK; ++c) acc[c] = 0;
  for (int64_t e = 0; e < k; ++e) {
    const T a = w[e];
    const T* __restrict__ uj = u + (nb[e] * H + h) * BLK;
    for (int c = 0; c < BLK; ++c) acc[c] += a * uj[c];
  }
  for (int c = 0; c < BLK; ++c) out[c] = acc[c];
}

template <typename T>
inline void weighted_rows(const T* w, const int64_t* nb, const T* u, int64_t H, int64_t h,
                          int64_t blk, int64_t k, T* __restrict__ out) {
  switch (blk) {
    case 8: return weighted_rows_fixed<T, 8>(w, nb, u, H, h, k, out);
    case 16: return weighted_rows_fixed<T, 16>(w, nb, u, H, h, k, out);
    case 32: return weighted_rows_fixed<T, 32>(w, nb, u, H, h, k, out);
    case 64: return weighted_rows_fixed<T, 64>(w, nb, u, H, h, k, out);
    default:
      for (int64_t c = 0; c < blk; ++c) out[c] = 0;
      for (int64_t e = 0; e < k; ++e) {
        const T a = w[e];
        const T* uj = u + (nb[e] * H + h) * blk;
        for (int64_t c = 0; c < blk; ++c) out[c] += a * uj[c];
      }
  }
}

template <typename T>
void forward_impl(const T* v, const T* qs, const T* qd, const T* beta, const int64_t* nbr,
                  int64_t Ns, int64_t Nd, int64_t H, int64_t M, int64_t k, bool use_abs,
                  T* u, T* y, T* z, T* alpha, T* dot) {
  const int64_t blk = M * 4;
  // u_m = Q_j v_m for every block of every source row (j, h).
  at::parallel_for(0, Ns * H, 64, [&](int64_t begin, int64_t end) {
    T Q[16];
    for (int64_t r = begin; r < end; ++r) {
      block_matrix(qs + r * 4, Q);
      const T* x = v + r * blk;
      T* o = u + r * blk;
      for (int64_t m = 0; m < M; ++m, x += 4, o += 4) {
        for (int a = 0; a < 4; ++a) {
          o[a] = Q[4 * a] * x[0] + Q[4 * a + 1] * x[1] + Q[4 * a + 2] * x[2] +
                 Q[4 * a + 3] * x[3];
        }
      }
    }
  });
  at::parallel_for(0, Nd, 16, [&](int64_t begin, int64_t end) {
    T Q[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* nb = nbr + i * k;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = i * H + h;
        const T* qi = qd + row * 4;
        T* al = alpha + row * k;
        T* dt = dot + row * k;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t e = 0; e < k; ++e) {
          const T* qj = qs + (nb[e] * H + h) * 4;
          const T d = qi[0] * qj[0] + qi[1] * qj[1] + qi[2] * qj[2] + qi[3] * qj[3];
          dt[e] = d;
          const T s = beta[h] * (use_abs ? std::abs(d) : d);
          al[e] = s;
          mx = s > mx ? s : mx;
        }
        T sum = 0;
        for (int64_t e = 0; e < k; ++e) {
          al[e] = std::exp(al[e] - mx);
          sum += al[e];
        }
        const T inv = T(1) / sum;
        for (int64_t e = 0; e < k; ++e) al[e] *= inv;
        T* yr = y + row * blk;
        weighted_rows<T>(al, nb, u, H, h, blk, k, yr);
        // z_m = Q_i^T y_m (rotate back by q_i*).
        block_matrix(qi, Q);
        T* zr = z + row * blk;
        for (int64_t m = 0; m < M; ++m) {
          const T* ym = yr + 4 * m;
          for (int a = 0; a < 4; ++a) {
            zr[4 * m + a] = Q[a] * ym[0] + Q[4 + a] * ym[1] + Q[8 + a] * ym[2] +
                            Q[12 + a] * ym[3];
          }
        }
      }
    }
  });
}

template <typename T>
void backward_impl(const T* gz, const T* galpha, const T* v, const T* qs, const T* qd,
                   const T* beta, const int64_t* nbr, const T* alpha, const T* dot,
                   const T* u, const T* y, const int32_t* crow_t, const int32_t* col_t,
                   const int64_t* perm, int64_t Ns, int64_t Nd, int64_t H, int64_t M,
                   int64_t k, bool use_abs, bool need_v, bool need_q, T* gy, T* gd,
                   T* gbeta_part, T* gqd, T* gv, T* gqs) {
  const int64_t blk = M * 4;
  // Pass A, per target row (i, h): gy = Q_i gz, softmax backward, logit gradients,
  // and the target quaternion's gradient (logits + rotation back).
  at::parallel_for(0, Nd, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> ga(k);
    T Q[16], G[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* nb = nbr + i * k;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = i * H + h;
        const T* qi = qd + row * 4;
        block_matrix(qi, Q);
        const T* g = gz + row * blk;
        T* gyr = gy + row * blk;
        for (int64_t m = 0; m < M; ++m) {
          const T* gm = g + 4 * m;
          for (int b = 0; b < 4; ++b) {
            gyr[4 * m + b] = Q[4 * b] * gm[0] + Q[4 * b + 1] * gm[1] +
                             Q[4 * b + 2] * gm[2] + Q[4 * b + 3] * gm[3];
          }
        }
        const T* al = alpha + row * k;
        T sa = 0;
        for (int64_t e = 0; e < k; ++e) {
          const T* uj = u + (nb[e] * H + h) * blk;
          T acc = galpha ? galpha[row * k + e] : T(0);
          for (int64_t c = 0; c < blk; ++c) acc += gyr[c] * uj[c];
          ga[e] = acc;
          sa += al[e] * acc;
        }
        const T* dt = dot + row * k;
        T* gdr = gd + row * k;
        T gb = 0;
        for (int64_t e = 0; e < k; ++e) {
          const T gs = al[e] * (ga[e] - sa);
          const T d = dt[e];
          gb += gs * (use_abs ? std::abs(d) : d);
          T gdv = gs * beta[h];
          if (use_abs) gdv *= (d > 0) - (d < 0);
          gdr[e] = gdv;
        }
        gbeta_part[row] = gb;
        if (need_q) {
          T* o = gqd + row * 4;
          o[0] = o[1] = o[2] = o[3] = 0;
          for (int64_t e = 0; e < k; ++e) {
            const T* qj = qs + (nb[e] * H + h) * 4;
            for (int c = 0; c < 4; ++c) o[c] += gdr[e] * qj[c];
          }
          // z = Q^T y  =>  dL/dQ[b][a] = sum_m y[m][b] gz[m][a]
          const T* yr = y + row * blk;
          for (int c = 0; c < 16; ++c) G[c] = 0;
          for (int64_t m = 0; m < M; ++m) {
            for (int b = 0; b < 4; ++b) {
              const T yb = yr[4 * m + b];
              for (int a = 0; a < 4; ++a) G[4 * b + a] += yb * g[4 * m + a];
            }
          }
          add_block_matrix_grad(qi, G, o);
        }
      }
    }
  });
  if (!need_v && !need_q) return;
  // Pass B, per source row (j, h) over its outgoing edges (A^T): gu = sum alpha gy.
  at::parallel_for(0, Ns * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> gu(blk);
    T Q[16], G[16];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < blk; ++c) gu[c] = 0;
      T gq[4] = {0, 0, 0, 0};
      for (int32_t p = crow_t[r]; p < crow_t[r + 1]; ++p) {
        const int64_t pos = perm[p];
        const int64_t target_row = col_t[p];
        const T a = alpha[pos];
        const T* gyr = gy + target_row * blk;
        for (int64_t c = 0; c < blk; ++c) gu[c] += a * gyr[c];
        if (need_q) {
          const T* qi = qd + target_row * 4;
          const T gdv = gd[pos];
          for (int c = 0; c < 4; ++c) gq[c] += gdv * qi[c];
        }
      }
      const T* qj = qs + r * 4;
      block_matrix(qj, Q);
      if (need_v) {  // u = Q v  =>  gv = Q^T gu
        T* o = gv + r * blk;
        for (int64_t m = 0; m < M; ++m) {
          const T* gm = gu.data() + 4 * m;
          for (int b = 0; b < 4; ++b) {
            o[4 * m + b] = Q[b] * gm[0] + Q[4 + b] * gm[1] + Q[8 + b] * gm[2] +
                           Q[12 + b] * gm[3];
          }
        }
      }
      if (need_q) {
        // u = Q v  =>  dL/dQ[a][b] = sum_m gu[m][a] v[m][b]
        const T* x = v + r * blk;
        for (int c = 0; c < 16; ++c) G[c] = 0;
        for (int64_t m = 0; m < M; ++m) {
          for (int a = 0; a < 4; ++a) {
            const T ga_ = gu[4 * m + a];
            for (int b = 0; b < 4; ++b) G[4 * a + b] += ga_ * x[4 * m + b];
          }
        }
        add_block_matrix_grad(qj, G, gq);
        for (int c = 0; c < 4; ++c) gqs[r * 4 + c] = gq[c];
      }
    }
  });
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "qsv_kernel_cpu: ", name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), "qsv_kernel_cpu: ", name, " must be contiguous");
}

std::vector<torch::Tensor> qsv_forward(torch::Tensor v, torch::Tensor qs, torch::Tensor qd,
                                       torch::Tensor beta, torch::Tensor nbr, bool use_abs) {
  for (auto* t : {&v, &qs, &qd, &beta, &nbr}) check(*t, "input");
  TORCH_CHECK(nbr.scalar_type() == torch::kLong, "qsv_kernel_cpu: nbr must be int64");
  const int64_t Ns = v.size(0), H = v.size(1), M = v.size(2);
  const int64_t Nd = nbr.size(0), k = nbr.size(1);
  auto u = torch::empty_like(v);
  auto y = torch::empty({Nd, H, M, 4}, v.options());
  auto z = torch::empty({Nd, H, M, 4}, v.options());
  auto alpha = torch::empty({Nd, H, k}, v.options());
  auto dot = torch::empty({Nd, H, k}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "qsv_forward", [&] {
    forward_impl<scalar_t>(v.data_ptr<scalar_t>(), qs.data_ptr<scalar_t>(),
                           qd.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(),
                           nbr.data_ptr<int64_t>(), Ns, Nd, H, M, k, use_abs,
                           u.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                           z.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>(),
                           dot.data_ptr<scalar_t>());
  });
  return {z, alpha, u, y, dot};
}

std::vector<torch::Tensor> qsv_backward(torch::Tensor gz, c10::optional<torch::Tensor> galpha,
                                        torch::Tensor v, torch::Tensor qs, torch::Tensor qd,
                                        torch::Tensor beta, torch::Tensor nbr,
                                        torch::Tensor alpha, torch::Tensor dot, torch::Tensor u,
                                        torch::Tensor y, torch::Tensor crow_t,
                                        torch::Tensor col_t, torch::Tensor perm, bool use_abs,
                                        bool need_v, bool need_q) {
  for (auto* t : {&gz, &v, &qs, &qd, &beta, &nbr, &alpha, &dot, &u, &y, &crow_t, &col_t, &perm})
    check(*t, "input");
  TORCH_CHECK(crow_t.scalar_type() == torch::kInt && col_t.scalar_type() == torch::kInt &&
                  perm.scalar_type() == torch::kLong,
              "qsv_kernel_cpu: crow_t/col_t must be int32 and perm int64");
  if (galpha.has_value()) check(*galpha, "grad_alpha");
  const int64_t Ns = v.size(0), H = v.size(1), M = v.size(2);
  const int64_t Nd = nbr.size(0), k = nbr.size(1);
  auto opts = v.options();
  auto gy = torch::empty({Nd, H, M, 4}, opts);
  auto gd = torch::empty({Nd, H, k}, opts);
  auto gbeta_part = torch::empty({Nd, H}, opts);
  auto gqd = need_q ? torch::empty({Nd, H, 4}, opts) : torch::empty({0}, opts);
  auto gv = need_v ? torch::empty_like(v) : torch::empty({0}, opts);
  auto gqs = need_q ? torch::empty({Ns, H, 4}, opts) : torch::empty({0}, opts);
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "qsv_backward", [&] {
    backward_impl<scalar_t>(
        gz.data_ptr<scalar_t>(), galpha.has_value() ? galpha->data_ptr<scalar_t>() : nullptr,
        v.data_ptr<scalar_t>(), qs.data_ptr<scalar_t>(), qd.data_ptr<scalar_t>(),
        beta.data_ptr<scalar_t>(), nbr.data_ptr<int64_t>(), alpha.data_ptr<scalar_t>(),
        dot.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
        crow_t.data_ptr<int32_t>(), col_t.data_ptr<int32_t>(), perm.data_ptr<int64_t>(), Ns,
        Nd, H, M, k, use_abs, need_v, need_q, gy.data_ptr<scalar_t>(), gd.data_ptr<scalar_t>(),
        gbeta_part.data_ptr<scalar_t>(), need_q ? gqd.data_ptr<scalar_t>() : nullptr,
        need_v ? gv.data_ptr<scalar_t>() : nullptr, need_q ? gqs.data_ptr<scalar_t>() : nullptr);
  });
  return {gv, gqs, gqd, gbeta_part.sum(0)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qsv_pyg: fused QSV aggregation on CPU";
  m.def("forward", &qsv_forward, "fused QSV aggregation, forward (CPU)");
  m.def("backward", &qsv_backward, "fused QSV aggregation, backward (CPU)");
}
