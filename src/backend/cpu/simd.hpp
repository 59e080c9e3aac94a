// dflash.cpp — 16-lane float vectors for the CPU kernels (internal to src/backend/cpu; include it
// only from kernel .cpp files).
//
// Invariants: a dot product is summed in a fixed order whatever the instruction set: element i
// goes to lane i mod 16, each lane accumulates in index order, and the 16 lanes are added pairwise
// (8, 4, 2, 1). Kernels built with DFLASH_CPU_CLONES exist as AVX-512, AVX2+FMA and baseline
// (SSE2) builds of the same code, one chosen per process from the CPU at load time (GCC
// target_clones, an ifunc); the build can change rounding (FMA contraction), never the order.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/dtype.hpp"

// Not under ThreadSanitizer: the ifunc resolver runs while the dynamic loader relocates the
// binary, before the TSan runtime is initialised, and TSan's instrumentation of the resolver
// crashes the process at load (the TSan build then runs the baseline build of each kernel).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define DFLASH_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DFLASH_CPU_CLONES
#endif
#define DFLASH_INLINE inline __attribute__((always_inline))
// On a lambda inside a DFLASH_CPU_CLONES kernel: inlined, so compiled for the clone's
// instruction set (an out-of-line lambda would be built for the baseline only).
#define DFLASH_INLINE_LAMBDA __attribute__((always_inline))

// The 64-byte vector type is only passed between always-inlined functions, so the ABI note GCC
// gives for it (its passing convention differs with and without AVX-512) is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dflash::cpu::simd {

constexpr int64_t kLanes = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/// 16 floats from `p` (unaligned).
DFLASH_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// 16 bf16 values (raw bits) from `p`, widened to f32 (exact: the bits are the f32 high half).
DFLASH_INLINE f32x16 load16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

DFLASH_INLINE float scalar(float v) { return v; }
DFLASH_INLINE float scalar(uint16_t v) { return bf16_bits_to_f32(v); }

/// Finishes a lane-ordered dot product: adds a[i]·b[i] for the tail i in [main, n) to lane
/// i − main (main is a multiple of 16), then sums the lanes pairwise.
template <typename W>
DFLASH_INLINE float finish(f32x16 acc, const float* a, const W* b, int64_t main, int64_t n) {
  float lane[kLanes];
  std::memcpy(lane, &acc, sizeof lane);
  for (int64_t i = main; i < n; ++i) lane[i - main] += a[i] * scalar(b[i]);
  for (int64_t half = kLanes / 2; half >= 1; half /= 2)
    for (int64_t l = 0; l < half; ++l) lane[l] += lane[l + half];
  return lane[0];
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

/// exp of 16 floats: Cephes expf (range reduction x = n·ln2 + r with ln2 split in two, a degree-6
/// polynomial on |r| ≤ ln2/2, scaling by 2^n through the exponent bits); within 2 ulp of
/// std::exp. x > 88.376 gives exp(88.376) (≈ 2.4e38, finite), x < −87.337 gives 0, −inf gives 0,
/// NaN stays NaN.
DFLASH_INLINE f32x16 exp16(f32x16 x) {
  const i32x16 nan = x != x;
  const i32x16 under = x < -87.33654475f;
  x = x > 88.3762626647949f ? f32x16{} + 88.3762626647949f : x;
  x = x < -87.33654475f ? f32x16{} - 87.33654475f : x;
  x = nan ? f32x16{} : x;
  // n = round(x / ln2) via the 1.5·2^23 shift (exact for |x / ln2| < 2^22).
  const f32x16 fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const f32x16 r = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  const f32x16 r2 = r * r;
  f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(fn, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const f32x16 y = p * scale;
  const f32x16 zero{};
  return nan ? f32x16{} + __builtin_nanf("") : (under ? zero : y);
}

/// z[i] = exp(z[i] − m) for i < n (in place) and returns Σ_i z[i], summed in the lane order of
/// the file comment (the tail padded with −inf, whose exp adds 0).
DFLASH_INLINE float exp_shift_sum(float* z, int64_t n, float m) {
  f32x16 acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f32x16 e = exp16(load16(z + i) - m);
    std::memcpy(z + i, &e, sizeof e);
    acc += e;
  }
  if (i < n) {
    float tail[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) tail[l] = i + l < n ? z[i + l] : -__builtin_inff();
    const f32x16 e = exp16(load16(tail) - m);
    std::memcpy(z + i, &e, sizeof(float) * static_cast<size_t>(n - i));
    acc += e;
  }
  float lane[kLanes];
  std::memcpy(lane, &acc, sizeof lane);
  for (int64_t half = kLanes / 2; half >= 1; half /= 2)
    for (int64_t l = 0; l < half; ++l) lane[l] += lane[l + half];
  return lane[0];
}

/// The double twin (finite-difference tests): std::exp, summed in index order.
DFLASH_INLINE double exp_shift_sum(double* z, int64_t n, double m) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (z[i] = __builtin_exp(z[i] - m));
  return sum;
}

/// Σ_i a[i]·b[i] over n elements in the lane order of the file comment.
DFLASH_INLINE float dot(const float* a, const float* b, int64_t n) {
  const int64_t main = n / kLanes * kLanes;
  f32x16 acc{};
  for (int64_t i = 0; i < main; i += kLanes) acc += load16(a + i) * load16(b + i);
  return finish(acc, a, b, main, n);
}

}  // namespace dflash::cpu::simd
