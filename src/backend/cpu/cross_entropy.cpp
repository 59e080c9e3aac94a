// dflash.cpp — CPU softmax cross-entropy, plain and fused with the LM head (see
// ops/cross_entropy.hpp for the formulas and the gradient contract).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/simd.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/linear.hpp"

namespace dflash {

namespace {

template <typename S>
S row_weight(const S* weights, int64_t r) {
  return weights ? weights[r] : S(1);
}

template <typename S>
void check_labels(const char* op, const int32_t* labels, const S* weights, int64_t R, int64_t V) {
  DFLASH_CHECK(R >= 0 && V > 0, "{}: bad sizes R={} V={}", op, R, V);
  for (int64_t r = 0; r < R; ++r) {
    const S w = row_weight(weights, r);
    DFLASH_CHECK(std::isfinite(static_cast<double>(w)), "{}: weight of row {} is not finite ({})",
                 op, r, static_cast<double>(w));
    if (w == S(0)) continue;
    DFLASH_CHECK(labels[r] >= 0 && labels[r] < V,
                 "{}: label {} of row {} (weight {}) is outside [0, {})", op, labels[r], r,
                 static_cast<double>(w), V);
  }
}

// lse and argmax of one row of logits.
template <typename S>
S row_lse(const S* z, int64_t V, int32_t* argmax) {
  S m = z[0];
  int64_t am = 0;
  for (int64_t v = 1; v < V; ++v)
    if (z[v] > m) {
      m = z[v];
      am = v;
    }
  if (argmax) *argmax = static_cast<int32_t>(am);
  if (std::isinf(m)) return m;  // all -inf (→ -inf) or a +inf logit (→ +inf)
  S sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
  return m + std::log(sum);
}

// dz = scale·w·(softmax(z) − onehot(label)), written to dz (may alias z).
template <typename S>
void row_grad(S* dz, const S* z, S lse, int32_t label, S w_scaled, int64_t V) {
  if (w_scaled == S(0)) {
    std::fill(dz, dz + V, S(0));
    return;
  }
  for (int64_t v = 0; v < V; ++v) dz[v] = w_scaled * std::exp(z[v] - lse);
  dz[label] -= w_scaled;
}

// Per-row forward over rows [0, R) of `logits`; row losses go to row_loss[R]; lse/argmax
// optional. Rows are independent (parallel); the caller sums row_loss in order.
template <typename S>
void rows_fwd(S* row_loss, S* lse, int32_t* argmax, const S* logits, const int32_t* labels,
              const S* weights, int64_t R, int64_t V) {
  parallel_for(
      R,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const S* z = logits + r * V;
          const S l = row_lse(z, V, argmax ? argmax + r : nullptr);
          if (lse) lse[r] = l;
          const S w = row_weight(weights, r);
          row_loss[r] = w == S(0) ? S(0) : w * (l - z[labels[r]]);
        }
      },
      4);
}

template <typename S>
CrossEntropyStats sum_stats(const S* row_loss, const S* weights, int64_t R) {
  CrossEntropyStats st;
  for (int64_t r = 0; r < R; ++r) {
    st.loss_sum += static_cast<double>(row_loss[r]);
    st.weight_sum += static_cast<double>(row_weight(weights, r));
  }
  return st;
}

template <typename S>
CrossEntropyStats fwd_impl(S* lse, int32_t* argmax, const S* logits, const int32_t* labels,
                           const S* weights, int64_t R, int64_t V) {
  check_labels("cross_entropy_fwd", labels, weights, R, V);
  std::vector<S> row_loss(static_cast<size_t>(R));
  rows_fwd(row_loss.data(), lse, argmax, logits, labels, weights, R, V);
  return sum_stats(row_loss.data(), weights, R);
}

template <typename S>
void bwd_impl(S* dlogits, const S* logits, const S* lse, const int32_t* labels, const S* weights,
              double grad_scale, int64_t R, int64_t V) {
  check_labels("cross_entropy_bwd", labels, weights, R, V);
  parallel_for(
      R,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          row_grad(dlogits + r * V, logits + r * V, lse[r], labels[r],
                   static_cast<S>(grad_scale) * row_weight(weights, r), V);
      },
      4);
}

// Σ_v exp(z_v − m) over a row; with `store`, z_v is replaced by exp(z_v − m). float: 16 lanes
// of simd::exp16 (the tail padded with −inf, whose exp adds 0), lanes summed pairwise; double:
// std::exp in index order.
DFLASH_CPU_CLONES float exp_sum_f32(float* z, int64_t V, float m, bool store) {
  using namespace cpu::simd;
  if (store) return exp_shift_sum(z, V, m);
  f32x16 acc{};
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes) acc += exp16(load16(z + v) - m);
  float tail[kLanes];
  std::fill(tail, tail + kLanes, -std::numeric_limits<float>::infinity());
  std::copy(z + v, z + V, tail);
  acc += exp16(load16(tail) - m);
  float lane[kLanes];
  std::memcpy(lane, &acc, sizeof lane);
  for (int64_t half = kLanes / 2; half >= 1; half /= 2)
    for (int64_t l = 0; l < half; ++l) lane[l] += lane[l + half];
  return lane[0];
}
float exp_sum(float* z, int64_t V, float m, bool store) { return exp_sum_f32(z, V, m, store); }
double exp_sum(double* z, int64_t V, double m, bool store) {
  if (store) return cpu::simd::exp_shift_sum(z, V, m);
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
  return sum;
}

// One row of the fused op, in place: returns lse(z), writes argmax and the row's weighted loss,
// and, when `grad`, overwrites z with w_scaled·(softmax(z) − onehot(label)) (zeros when
// w_scaled = 0). exp is evaluated once per logit (vectorised for float, exp_sum):
// softmax(z)_v = exp(z_v − m) / Σ_u exp(z_u − m), m the row maximum.
template <typename S>
S row_fused(S* z, int64_t V, int32_t label, S w, S w_scaled, bool grad, int32_t* argmax, S* loss) {
  S m = z[0];
  int64_t am = 0;
  for (int64_t v = 1; v < V; ++v)
    if (z[v] > m) {
      m = z[v];
      am = v;
    }
  if (argmax) *argmax = static_cast<int32_t>(am);
  const S z_label = w == S(0) ? S(0) : z[label];
  const bool keep_exp = grad && w_scaled != S(0);
  S lse = m;  // all -inf (→ -inf) or a +inf logit (→ +inf): no finite softmax
  S sum = 0;
  if (!std::isinf(m)) {
    sum = exp_sum(z, V, m, keep_exp);
    lse = m + std::log(sum);
  }
  *loss = w == S(0) ? S(0) : w * (lse - z_label);
  if (!grad) return lse;
  if (w_scaled == S(0)) {
    std::fill(z, z + V, S(0));
  } else if (std::isinf(m)) {
    std::fill(z, z + V, std::numeric_limits<S>::quiet_NaN());  // non-finite: the step is skipped
  } else {
    const S scale = w_scaled / sum;
    for (int64_t v = 0; v < V; ++v) z[v] *= scale;
    z[label] -= w_scaled;
  }
  return lse;
}

// The fused op's per-thread workspace: chunk logits [chunk_rows, V], kept between calls so that
// its pages are touched once per thread (the chunk is megabytes; a fresh buffer per call would be
// mapped and zero-filled by the kernel on every step).
template <typename S>
S* fused_workspace(int64_t n) {
  thread_local std::vector<S> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

template <typename S, typename W>
CrossEntropyStats fused_impl(S* d_hidden, S* lse, int32_t* argmax, S* row_loss_out, const S* hidden,
                             const W* head, const int32_t* labels, const S* weights,
                             const FusedCeParams& p) {
  const int64_t R = p.R, H = p.H, V = p.V;
  DFLASH_CHECK(R >= 0 && H > 0 && V > 0 && p.chunk_rows > 0,
               "cross_entropy_fused: bad sizes R={} H={} V={} chunk_rows={}", R, H, V,
               p.chunk_rows);
  DFLASH_CHECK(p.skip_first_of <= 1,
               "cross_entropy_fused_cpu: skip_first_of {} is CUDA only (the CPU trainer packs its "
               "supervised rows itself)",
               p.skip_first_of);
  check_labels("cross_entropy_fused", labels, weights, R, V);
  const int64_t C = std::min(p.chunk_rows, std::max<int64_t>(R, 1));
  S* logits = fused_workspace<S>(C * V);
  std::vector<S> row_loss(static_cast<size_t>(R));
  const bool grad = d_hidden != nullptr;
  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t n = std::min(C, R - r0);
    linear_fwd_cpu(logits, hidden + r0 * H, head, static_cast<const S*>(nullptr), n, H, V);
    parallel_for(
        n,
        [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t r = r0 + i;
            const S w = row_weight(weights, r);
            const S l = row_fused(logits + i * V, V, labels[r], w, static_cast<S>(p.grad_scale) * w,
                                  grad, argmax ? argmax + r : nullptr, row_loss.data() + r);
            if (lse) lse[r] = l;
          }
        },
        4);
    if (!grad) continue;
    linear_bwd_cpu(d_hidden + r0 * H, static_cast<S*>(nullptr), static_cast<S*>(nullptr), logits,
                   hidden + r0 * H, head, n, H, V);
  }
  if (row_loss_out) std::copy(row_loss.begin(), row_loss.end(), row_loss_out);
  return sum_stats(row_loss.data(), weights, R);
}

}  // namespace

CrossEntropyStats cross_entropy_fwd_cpu(float* lse, int32_t* argmax, const float* logits,
                                        const int32_t* labels, const float* weights, int64_t R,
                                        int64_t V) {
  return fwd_impl(lse, argmax, logits, labels, weights, R, V);
}
CrossEntropyStats cross_entropy_fwd_cpu(double* lse, int32_t* argmax, const double* logits,
                                        const int32_t* labels, const double* weights, int64_t R,
                                        int64_t V) {
  return fwd_impl(lse, argmax, logits, labels, weights, R, V);
}
void cross_entropy_bwd_cpu(float* dlogits, const float* logits, const float* lse,
                           const int32_t* labels, const float* weights, double grad_scale,
                           int64_t R, int64_t V) {
  bwd_impl(dlogits, logits, lse, labels, weights, grad_scale, R, V);
}
void cross_entropy_bwd_cpu(double* dlogits, const double* logits, const double* lse,
                           const int32_t* labels, const double* weights, double grad_scale,
                           int64_t R, int64_t V) {
  bwd_impl(dlogits, logits, lse, labels, weights, grad_scale, R, V);
}
CrossEntropyStats cross_entropy_fused_cpu(float* d_hidden, float* lse, int32_t* argmax,
                                          float* row_loss, const float* hidden, const float* head,
                                          const int32_t* labels, const float* weights,
                                          const FusedCeParams& p) {
  return fused_impl(d_hidden, lse, argmax, row_loss, hidden, head, labels, weights, p);
}
CrossEntropyStats cross_entropy_fused_cpu(float* d_hidden, float* lse, int32_t* argmax,
                                          float* row_loss, const float* hidden,
                                          const uint16_t* head_bf16, const int32_t* labels,
                                          const float* weights, const FusedCeParams& p) {
  return fused_impl(d_hidden, lse, argmax, row_loss, hidden, head_bf16, labels, weights, p);
}
CrossEntropyStats cross_entropy_fused_cpu(double* d_hidden, double* lse, int32_t* argmax,
                                          double* row_loss, const double* hidden,
                                          const double* head, const int32_t* labels,
                                          const double* weights, const FusedCeParams& p) {
  return fused_impl(d_hidden, lse, argmax, row_loss, hidden, head, labels, weights, p);
}

}  // namespace dflash
