// dflash.cpp — CPU SwiGLU (see ops/swiglu.hpp). float rows go 16 lanes at a time with the
// vectorised exp of backend/cpu/simd.hpp (within 2 ulp of std::exp); double (finite-difference
// tests) uses std::exp.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/simd.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

void check_sizes(const char* op, int64_t T, int64_t I, int64_t ld) {
  DFLASH_CHECK(T >= 0 && I > 0 && ld >= I, "{}: bad sizes T={} I={} ld_in={}", op, T, I, ld);
}

// σ(g) for 16 lanes: 1 / (1 + exp(−g)) with simd::exp16.
DFLASH_INLINE cpu::simd::f32x16 sigmoid16(cpu::simd::f32x16 g) {
  return 1.0f / (1.0f + cpu::simd::exp16(-g));
}

// 16 lanes from p[0, n), zero past n (n ≤ 16).
DFLASH_INLINE cpu::simd::f32x16 load_part(const float* p, int64_t n) {
  if (n == cpu::simd::kLanes) return cpu::simd::load16(p);
  float tmp[cpu::simd::kLanes] = {};
  std::memcpy(tmp, p, sizeof(float) * static_cast<size_t>(n));
  return cpu::simd::load16(tmp);
}
DFLASH_INLINE void store_part(float* p, cpu::simd::f32x16 v, int64_t n) {
  std::memcpy(p, &v, sizeof(float) * static_cast<size_t>(n));
}

// Elements [i, i + n) of one row (n ≤ 16), forward and backward.
DFLASH_INLINE void fwd_slice(float* y, const float* gate, const float* up, int64_t n) {
  const auto g = load_part(gate, n), u = load_part(up, n);
  store_part(y, g * sigmoid16(g) * u, n);
}
DFLASH_INLINE void bwd_slice(float* dgate, float* dup, const float* dy, const float* gate,
                             const float* up, int64_t n) {
  const auto g = load_part(gate, n), u = load_part(up, n), d = load_part(dy, n);
  const auto sg = sigmoid16(g);
  if (dgate) store_part(dgate, d * u * sg * (1.0f + g * (1.0f - sg)), n);
  if (dup) store_part(dup, d * g * sg, n);
}

// Rows [t0, t1) of the forward / backward, float: 16 lanes at a time (σ through simd::exp16).
DFLASH_CPU_CLONES void fwd_rows_f32(float* y, const float* gate, const float* up, int64_t t0,
                                    int64_t t1, int64_t I, int64_t ld) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < I; i += cpu::simd::kLanes)
      fwd_slice(y + t * I + i, gate + t * ld + i, up + t * ld + i,
                std::min(cpu::simd::kLanes, I - i));
}
DFLASH_CPU_CLONES void bwd_rows_f32(float* dgate, float* dup, const float* dy, const float* gate,
                                    const float* up, int64_t t0, int64_t t1, int64_t I,
                                    int64_t ld) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < I; i += cpu::simd::kLanes)
      bwd_slice(dgate ? dgate + t * ld + i : nullptr, dup ? dup + t * ld + i : nullptr,
                dy + t * I + i, gate + t * ld + i, up + t * ld + i,
                std::min(cpu::simd::kLanes, I - i));
}

// Double (the finite-difference tests): plain loops with std::exp.
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
void fwd_rows(double* y, const double* gate, const double* up, int64_t t0, int64_t t1, int64_t I,
              int64_t ld) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gate[t * ld + i];
      y[t * I + i] = g * sigmoid(g) * up[t * ld + i];
    }
}
void bwd_rows(double* dgate, double* dup, const double* dy, const double* gate, const double* up,
              int64_t t0, int64_t t1, int64_t I, int64_t ld) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gate[t * ld + i], u = up[t * ld + i], d = dy[t * I + i];
      const double sg = sigmoid(g);
      if (dgate) dgate[t * ld + i] = d * u * sg * (1.0 + g * (1.0 - sg));
      if (dup) dup[t * ld + i] = d * g * sg;
    }
}
void fwd_rows(float* y, const float* gate, const float* up, int64_t t0, int64_t t1, int64_t I,
              int64_t ld) {
  fwd_rows_f32(y, gate, up, t0, t1, I, ld);
}
void bwd_rows(float* dgate, float* dup, const float* dy, const float* gate, const float* up,
              int64_t t0, int64_t t1, int64_t I, int64_t ld) {
  bwd_rows_f32(dgate, dup, dy, gate, up, t0, t1, I, ld);
}

template <typename S>
void fwd_impl(S* y, const S* gate, const S* up, int64_t T, int64_t I, int64_t ld) {
  check_sizes("swiglu_fwd", T, I, ld);
  parallel_for(
      T, [&](int64_t t0, int64_t t1) { fwd_rows(y, gate, up, t0, t1, I, ld); }, 16);
}

template <typename S>
void bwd_impl(S* dgate, S* dup, const S* dy, const S* gate, const S* up, int64_t T, int64_t I,
              int64_t ld) {
  check_sizes("swiglu_bwd", T, I, ld);
  parallel_for(
      T, [&](int64_t t0, int64_t t1) { bwd_rows(dgate, dup, dy, gate, up, t0, t1, I, ld); }, 16);
}

}  // namespace

void swiglu_fwd_cpu(float* y, const float* gate, const float* up, int64_t T, int64_t I,
                    int64_t ld_in) {
  fwd_impl(y, gate, up, T, I, ld_in);
}
void swiglu_fwd_cpu(double* y, const double* gate, const double* up, int64_t T, int64_t I,
                    int64_t ld_in) {
  fwd_impl(y, gate, up, T, I, ld_in);
}
void swiglu_bwd_cpu(float* dgate, float* dup, const float* dy, const float* gate, const float* up,
                    int64_t T, int64_t I, int64_t ld_in) {
  bwd_impl(dgate, dup, dy, gate, up, T, I, ld_in);
}
void swiglu_bwd_cpu(double* dgate, double* dup, const double* dy, const double* gate,
                    const double* up, int64_t T, int64_t I, int64_t ld_in) {
  bwd_impl(dgate, dup, dy, gate, up, T, I, ld_in);
}

}  // namespace dflash
