// dflash.cpp — CPU attention over per-query key ranges (see ops/attention.hpp for shapes,
// visibility rule and the gradient contract).
//
// Forward: one (query row, head) at a time, two passes over its visible keys (scores into a
// per-worker buffer, then max / sum-exp / weighted sum of v). Backward (FlashAttention-2 style,
// recomputing probabilities from the saved lse):
//   p_j = exp(scale·q·k_j − lse),  dp_j = dO·v_j,  ds_j = p_j·(dp_j − Δ),  Δ = dO·o
//   dq = scale·Σ_j ds_j k_j,  dk_j = scale·Σ_rows ds_j q,  dv_j = Σ_rows p_j dO
// dq is parallel over query rows; dk/dv are parallel over blocks of keys, each worker scanning
// every query row in order and intersecting its ranges with the worker's key block. Float dot
// products of head vectors are summed in 16 lanes (backend/cpu/simd.hpp), in AVX-512/AVX2/SSE2
// builds of the same code chosen from the CPU.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "backend/cpu/simd.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/attention.hpp"

namespace dflash {

static_assert(sizeof(AttnRange) == 16, "AttnRange is four int32 (shared with the CUDA kernels)");

void attention_causal_varlen_ranges(AttnRange* ranges, const int32_t* doc_offsets,
                                    int64_t n_docs, int64_t T) {
  DFLASH_CHECK(n_docs >= 1 && T >= 0, "attention: bad document count {} or length {}", n_docs, T);
  DFLASH_CHECK(doc_offsets[0] == 0, "attention: doc_offsets[0] must be 0, got {}", doc_offsets[0]);
  DFLASH_CHECK(doc_offsets[n_docs] == T, "attention: doc_offsets[{}] must equal T={}, got {}",
               n_docs, T, doc_offsets[n_docs]);
  for (int64_t d = 0; d < n_docs; ++d)  // validate everything before writing anything
    DFLASH_CHECK(doc_offsets[d] <= doc_offsets[d + 1],
                 "attention: doc_offsets must be non-decreasing, [{}]={} > [{}]={}", d,
                 doc_offsets[d], d + 1, doc_offsets[d + 1]);
  for (int64_t d = 0; d < n_docs; ++d) {
    const int32_t s = doc_offsets[d], e = doc_offsets[d + 1];
    for (int32_t t = s; t < e; ++t) ranges[t] = AttnRange{s, t + 1, 0, 0};
  }
}

std::vector<AttnRange> attention_causal_varlen_ranges(const int32_t* doc_offsets, int64_t n_docs,
                                                      int64_t T) {
  std::vector<AttnRange> r(static_cast<size_t>(T));
  attention_causal_varlen_ranges(r.data(), doc_offsets, n_docs, T);
  return r;
}

std::vector<int32_t> attention_causal_varlen_docs(const AttnRange* ranges, int64_t T) {
  DFLASH_CHECK(T >= 1 && ranges, "attention_causal_varlen_docs: {} rows, ranges {}", T,
               ranges ? "set" : "null");
  std::vector<int32_t> off;
  for (int64_t t = 0; t < T; ++t) {
    const AttnRange& r = ranges[t];
    if (r.lo1 == t) off.push_back(static_cast<int32_t>(t));
    DFLASH_CHECK(!off.empty() && r.lo1 == off.back() && r.hi1 == t + 1 && r.lo2 == r.hi2,
                 "attention_causal_varlen_docs: row {} has range {{{}, {}, {}, {}}}, not the "
                 "causal varlen form {{doc_start, row+1, 0, 0}}",
                 t, r.lo1, r.hi1, r.lo2, r.hi2);
  }
  off.push_back(static_cast<int32_t>(T));
  return off;
}

void attention_window_ranges(AttnRange* out, const AttnRange* in, int64_t T, int64_t window) {
  DFLASH_CHECK(window >= 1 && T >= 0, "attention_window_ranges: window must be >= 1, got {} (T={})",
               window, T);
  for (int64_t t = 0; t < T; ++t) {
    AttnRange r = in[t];
    r.lo1 = static_cast<int32_t>(std::max<int64_t>(r.lo1, int64_t{r.hi1} - window));
    out[t] = r;
  }
}

namespace {

void check_params(const char* op, const AttnRange* ranges, const AttnParams& p) {
  DFLASH_CHECK(p.Tq >= 0 && p.Tk >= 0 && p.NH > 0 && p.NKV > 0 && p.D > 0 && p.NH % p.NKV == 0 &&
                   p.Tk <= std::numeric_limits<int32_t>::max(),
               "{}: bad sizes Tq={} Tk={} NH={} NKV={} D={} (NH must be a multiple of NKV)", op,
               p.Tq, p.Tk, p.NH, p.NKV, p.D);
  DFLASH_CHECK(std::isfinite(p.scale), "{}: scale must be finite, got {}", op, p.scale);
  for (int64_t t = 0; t < p.Tq; ++t) {
    const AttnRange& r = ranges[t];
    const bool ok = 0 <= r.lo1 && r.lo1 <= r.hi1 && r.hi1 <= p.Tk && 0 <= r.lo2 &&
                    r.lo2 <= r.hi2 && r.hi2 <= p.Tk;
    const bool disjoint = r.lo1 == r.hi1 || r.lo2 == r.hi2 || r.hi1 <= r.lo2 || r.hi2 <= r.lo1;
    DFLASH_CHECK(ok && disjoint,
                 "{}: query row {} has invalid key ranges [{}, {}) + [{}, {}) for Tk={} (need "
                 "0 <= lo <= hi <= Tk and no overlap)",
                 op, t, r.lo1, r.hi1, r.lo2, r.hi2, p.Tk);
  }
}

// Dot products of head vectors: float in the lane order of backend/cpu/simd.hpp (vectorised),
// double (the finite-difference tests) plainly in index order.
DFLASH_INLINE float dot(const float* a, const float* b, int64_t n) {
  return cpu::simd::dot(a, b, n);
}
DFLASH_INLINE double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Calls fn(j) for every visible key of `r` that lies in [j0, j1), in ascending order.
template <typename Fn>
DFLASH_INLINE void for_visible(const AttnRange& r, int64_t j0, int64_t j1, Fn&& fn) {
  int64_t a0 = r.lo1, a1 = r.hi1, b0 = r.lo2, b1 = r.hi2;
  if (b0 < a0) {  // visit the lower range first (the ranges are disjoint)
    std::swap(a0, b0);
    std::swap(a1, b1);
  }
  for (int64_t j = std::max(a0, j0); j < std::min(a1, j1); ++j) fn(j);
  for (int64_t j = std::max(b0, j0); j < std::min(b1, j1); ++j) fn(j);
}

// Forward of query rows [r0, r1) (row = t·NH + h); `s` is scratch for p.Tk scores.
template <typename S>
DFLASH_INLINE void fwd_rows(S* o, S* lse, const S* q, const S* k, const S* v,
                            const AttnRange* ranges, const AttnParams& p, int64_t r0, int64_t r1,
                            S* s) {
  const int64_t NH = p.NH, NKV = p.NKV, D = p.D, rep = NH / NKV;
  const S scale = static_cast<S>(p.scale);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t t = row / NH, h = row % NH, g = h / rep;
    const S* qr = q + row * D;
    S* orow = o + row * D;
    const AttnRange& rg = ranges[t];
    // Pass 1: scores and their maximum.
    S m = -std::numeric_limits<S>::infinity();
    int64_t n = 0;
    for_visible(rg, 0, p.Tk, [&](int64_t j) DFLASH_INLINE_LAMBDA {
      const S sj = scale * dot(qr, k + (j * NKV + g) * D, D);
      s[n++] = sj;
      m = std::max(m, sj);
    });
    std::fill(orow, orow + D, S(0));
    // A sink is one more logit in the softmax, without a value row.
    const S sink = p.sinks ? static_cast<S>(p.sinks[h]) : -std::numeric_limits<S>::infinity();
    if (n == 0) {
      if (lse) lse[h * p.Tq + t] = sink;
      continue;
    }
    m = std::max(m, sink);
    // Pass 2: unnormalised weights (exp of all scores at once) and the weighted sum of values.
    const S sum = cpu::simd::exp_shift_sum(s, n, m) + (p.sinks ? std::exp(sink - m) : S(0));
    n = 0;
    for_visible(rg, 0, p.Tk, [&](int64_t j) DFLASH_INLINE_LAMBDA {
      const S e = s[n++];
      const S* vj = v + (j * NKV + g) * D;
      for (int64_t d = 0; d < D; ++d) orow[d] += e * vj[d];
    });
    const S inv = S(1) / sum;
    for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
    if (lse) lse[h * p.Tq + t] = m + std::log(sum);
  }
}

// dq of query rows [r0, r1): keys ascending; `s` is scratch for p.Tk probabilities.
template <typename S>
DFLASH_INLINE void dq_rows(S* dq, const S* dout, const S* q, const S* k, const S* v, const S* lse,
                           const S* delta, const AttnRange* ranges, const AttnParams& p, int64_t r0,
                           int64_t r1, S* s) {
  const int64_t NH = p.NH, NKV = p.NKV, D = p.D, rep = NH / NKV;
  const S scale = static_cast<S>(p.scale);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t t = row / NH, h = row % NH, g = h / rep;
    const S* qr = q + row * D;
    const S* dor = dout + row * D;
    const S l = lse[h * p.Tq + t], dl = delta[row];
    S* dqr = dq + row * D;
    std::fill(dqr, dqr + D, S(0));
    // p_j = exp(scale·q·k_j − lse) of every visible key at once, then the sum over keys.
    int64_t n = 0;
    for_visible(ranges[t], 0, p.Tk, [&](int64_t j) DFLASH_INLINE_LAMBDA {
      s[n++] = scale * dot(qr, k + (j * NKV + g) * D, D);
    });
    cpu::simd::exp_shift_sum(s, n, l);
    n = 0;
    for_visible(ranges[t], 0, p.Tk, [&](int64_t j) DFLASH_INLINE_LAMBDA {
      const S* kj = k + (j * NKV + g) * D;
      const S ds = s[n++] * (dot(dor, v + (j * NKV + g) * D, D) - dl);
      for (int64_t d = 0; d < D; ++d) dqr[d] += scale * ds * kj[d];
    });
  }
}

// The dk/dv terms of one query row (q_r, dO_r, lse l, Δ dl) for a group of n ≤ 16 keys js whose
// scores scale·q·k_j are in pk (turned into p_j here).
template <typename S>
DFLASH_INLINE void dkv_group(S* dk, S* dv, S* pk, const int64_t* js, int64_t n, const S* qr,
                             const S* dor, const S* v, S l, S dl, S scale, int64_t NKV, int64_t g,
                             int64_t D) {
  cpu::simd::exp_shift_sum(pk, n, l);
  for (int64_t c = 0; c < n; ++c) {
    const int64_t j = js[c];
    const S pj = pk[c];
    if (dv) {
      S* dvj = dv + (j * NKV + g) * D;
      for (int64_t d = 0; d < D; ++d) dvj[d] += pj * dor[d];
    }
    if (dk) {
      const S ds = pj * (dot(dor, v + (j * NKV + g) * D, D) - dl);
      S* dkj = dk + (j * NKV + g) * D;
      for (int64_t d = 0; d < D; ++d) dkj[d] += scale * ds * qr[d];
    }
  }
}

// dk, dv of keys [j0, j1) (zeroed here): every query row in order, its ranges cut to the keys.
template <typename S>
DFLASH_INLINE void dkv_keys(S* dk, S* dv, const S* dout, const S* q, const S* k, const S* v,
                            const S* lse, const S* delta, const AttnRange* ranges,
                            const AttnParams& p, int64_t j0, int64_t j1) {
  const int64_t Tq = p.Tq, NH = p.NH, NKV = p.NKV, D = p.D, rep = NH / NKV;
  const S scale = static_cast<S>(p.scale);
  if (dk) std::fill(dk + j0 * NKV * D, dk + j1 * NKV * D, S(0));
  if (dv) std::fill(dv + j0 * NKV * D, dv + j1 * NKV * D, S(0));
  for (int64_t g = 0; g < NKV; ++g)
    for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t row = t * NH + h;
        const S* qr = q + row * D;
        const S* dor = dout + row * D;
        const S l = lse[h * Tq + t], dl = delta[row];
        // The visible keys in groups of up to 16: p_j of a group at once, then its dk/dv terms
        // (each key still sums its terms over (h, t) in order).
        S pk[cpu::simd::kLanes];
        int64_t js[cpu::simd::kLanes];
        int64_t n = 0;
        for_visible(ranges[t], j0, j1, [&](int64_t j) DFLASH_INLINE_LAMBDA {
          js[n] = j;
          pk[n++] = scale * dot(qr, k + (j * NKV + g) * D, D);
          if (n == cpu::simd::kLanes) {
            dkv_group(dk, dv, pk, js, n, qr, dor, v, l, dl, scale, NKV, g, D);
            n = 0;
          }
        });
        if (n > 0) dkv_group(dk, dv, pk, js, n, qr, dor, v, l, dl, scale, NKV, g, D);
      }
}

// The float kernels in the CPU's best instruction set (simd.hpp); double as plain code.
DFLASH_CPU_CLONES void fwd_rows_f32(float* o, float* lse, const float* q, const float* k,
                                    const float* v, const AttnRange* ranges, const AttnParams& p,
                                    int64_t r0, int64_t r1, float* s) {
  fwd_rows(o, lse, q, k, v, ranges, p, r0, r1, s);
}
DFLASH_CPU_CLONES void dq_rows_f32(float* dq, const float* dout, const float* q, const float* k,
                                   const float* v, const float* lse, const float* delta,
                                   const AttnRange* ranges, const AttnParams& p, int64_t r0,
                                   int64_t r1, float* s) {
  dq_rows(dq, dout, q, k, v, lse, delta, ranges, p, r0, r1, s);
}
DFLASH_CPU_CLONES void dkv_keys_f32(float* dk, float* dv, const float* dout, const float* q,
                                    const float* k, const float* v, const float* lse,
                                    const float* delta, const AttnRange* ranges,
                                    const AttnParams& p, int64_t j0, int64_t j1) {
  dkv_keys(dk, dv, dout, q, k, v, lse, delta, ranges, p, j0, j1);
}
void fwd_rows_any(float* o, float* lse, const float* q, const float* k, const float* v,
                  const AttnRange* ranges, const AttnParams& p, int64_t r0, int64_t r1, float* s) {
  fwd_rows_f32(o, lse, q, k, v, ranges, p, r0, r1, s);
}
void fwd_rows_any(double* o, double* lse, const double* q, const double* k, const double* v,
                  const AttnRange* ranges, const AttnParams& p, int64_t r0, int64_t r1, double* s) {
  fwd_rows(o, lse, q, k, v, ranges, p, r0, r1, s);
}
void dq_rows_any(float* dq, const float* dout, const float* q, const float* k, const float* v,
                 const float* lse, const float* delta, const AttnRange* ranges, const AttnParams& p,
                 int64_t r0, int64_t r1, float* s) {
  dq_rows_f32(dq, dout, q, k, v, lse, delta, ranges, p, r0, r1, s);
}
void dq_rows_any(double* dq, const double* dout, const double* q, const double* k, const double* v,
                 const double* lse, const double* delta, const AttnRange* ranges,
                 const AttnParams& p, int64_t r0, int64_t r1, double* s) {
  dq_rows(dq, dout, q, k, v, lse, delta, ranges, p, r0, r1, s);
}
void dkv_keys_any(float* dk, float* dv, const float* dout, const float* q, const float* k,
                  const float* v, const float* lse, const float* delta, const AttnRange* ranges,
                  const AttnParams& p, int64_t j0, int64_t j1) {
  dkv_keys_f32(dk, dv, dout, q, k, v, lse, delta, ranges, p, j0, j1);
}
void dkv_keys_any(double* dk, double* dv, const double* dout, const double* q, const double* k,
                  const double* v, const double* lse, const double* delta, const AttnRange* ranges,
                  const AttnParams& p, int64_t j0, int64_t j1) {
  dkv_keys(dk, dv, dout, q, k, v, lse, delta, ranges, p, j0, j1);
}

template <typename S>
void fwd_impl(S* o, S* lse, const S* q, const S* k, const S* v, const AttnRange* ranges,
              const AttnParams& p) {
  check_params("attention_fwd", ranges, p);
  parallel_for(
      p.Tq * p.NH,
      [&](int64_t r0, int64_t r1) {
        std::vector<S> s(static_cast<size_t>(p.Tk));
        fwd_rows_any(o, lse, q, k, v, ranges, p, r0, r1, s.data());
      },
      4);
}

template <typename S>
void bwd_impl(S* dq, S* dk, S* dv, const S* dout, const S* q, const S* k, const S* v, const S* o,
              const S* lse, const AttnRange* ranges, const AttnParams& p) {
  check_params("attention_bwd", ranges, p);
  DFLASH_CHECK(dout && q && k && v && o && lse, "attention_bwd: an input pointer is null");
  const int64_t Tq = p.Tq, Tk = p.Tk, NH = p.NH, D = p.D;
  // Δ[row] = dO·o per (query row, head), row = t*NH + h.
  std::vector<S> delta(static_cast<size_t>(Tq * NH));
  parallel_for(
      Tq * NH,
      [&](int64_t r0, int64_t r1) {
        for (int64_t row = r0; row < r1; ++row)
          delta[static_cast<size_t>(row)] = dot(dout + row * D, o + row * D, D);
      },
      64);

  // dq: one row at a time, keys ascending.
  if (dq) {
    parallel_for(
        Tq * NH,
        [&](int64_t r0, int64_t r1) {
          std::vector<S> s(static_cast<size_t>(Tk));
          dq_rows_any(dq, dout, q, k, v, lse, delta.data(), ranges, p, r0, r1, s.data());
        },
        4);
  }

  // dk, dv: workers own blocks of keys; each scans all query rows in order.
  if (!dk && !dv) return;
  constexpr int64_t kKeyBlock = 16;
  const int64_t n_blocks = (Tk + kKeyBlock - 1) / kKeyBlock;
  parallel_for(n_blocks, [&](int64_t b0, int64_t b1) {
    dkv_keys_any(dk, dv, dout, q, k, v, lse, delta.data(), ranges, p, b0 * kKeyBlock,
                 std::min(Tk, b1 * kKeyBlock));
  });
}

}  // namespace

void attention_fwd_cpu(float* o, float* lse, const float* q, const float* k, const float* v,
                       const AttnRange* ranges, const AttnParams& p) {
  fwd_impl(o, lse, q, k, v, ranges, p);
}
void attention_fwd_cpu(double* o, double* lse, const double* q, const double* k, const double* v,
                       const AttnRange* ranges, const AttnParams& p) {
  fwd_impl(o, lse, q, k, v, ranges, p);
}
void attention_bwd_cpu(float* dq, float* dk, float* dv, const float* dout, const float* q,
                       const float* k, const float* v, const float* o, const float* lse,
                       const AttnRange* ranges, const AttnParams& p) {
  bwd_impl(dq, dk, dv, dout, q, k, v, o, lse, ranges, p);
}
void attention_bwd_cpu(double* dq, double* dk, double* dv, const double* dout, const double* q,
                       const double* k, const double* v, const double* o, const double* lse,
                       const AttnRange* ranges, const AttnParams& p) {
  bwd_impl(dq, dk, dv, dout, q, k, v, o, lse, ranges, p);
}

}  // namespace dflash
