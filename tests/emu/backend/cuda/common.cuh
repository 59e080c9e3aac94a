// dflash.cpp — the emulator's stand-in for src/backend/cuda/common.cuh: the CUDA keywords and
// built-ins the tensor-core attention and fused decoding kernels use, mapped onto
// tests/emu/cuda_emu.hpp, plus the bf16 helpers of the real header (same rounding, from
// core/dtype.hpp). Found before the real header because the emulator test puts tests/emu first on
// its include path.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.hpp"
#include "cuda_emu.hpp"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define gridDim (::emu::grid_dim())
#define blockDim (::emu::block_dim())

struct uint4 {
  uint32_t x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};

inline int min(int a, int b) {
  return a < b ? a : b;
}
inline int max(int a, int b) {
  return a > b ? a : b;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void __syncthreads() {
  ::emu::syncthreads();
}

template <typename T>
inline void warp_all(const T& mine, T (&all)[32]) {
  ::emu::warp_exchange(&mine, sizeof(T), all);
}
inline float __shfl_xor_sync(unsigned, float v, int m) {
  float all[32];
  warp_all(v, all);
  return all[(::emu::thread_idx().x % 32) ^ static_cast<unsigned>(m)];
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  T all[32];
  warp_all(v, all);
  return all[src & 31];
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline bool __any_sync(unsigned, bool p) {
  int all[32];
  warp_all(static_cast<int>(p), all);
  return std::any_of(all, all + 32, [](int x) { return x != 0; });
}
inline bool __all_sync(unsigned, bool p) {
  int all[32];
  warp_all(static_cast<int>(p), all);
  return std::all_of(all, all + 32, [](int x) { return x != 0; });
}
inline int __reduce_min_sync(unsigned, int v) {
  int all[32];
  warp_all(v, all);
  return *std::min_element(all, all + 32);
}
inline int __reduce_max_sync(unsigned, int v) {
  int all[32];
  warp_all(v, all);
  return *std::max_element(all, all + 32);
}
// CTAs run one at a time and fibers switch only at barriers: a plain read-modify-write is atomic.
inline int atomicMin(int* p, int v) {
  const int old = *p;
  *p = std::min(old, v);
  return old;
}
inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = std::max(old, v);
  return old;
}

namespace dflash::cuda {
inline uint16_t f32_to_bf16(float f) {
  return dflash::f32_to_bf16_bits(f);
}
inline float to_f32(float x) {
  return x;
}
inline float to_f32(uint16_t b) {
  return dflash::bf16_bits_to_f32(b);
}
template <typename T>
T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
  return v;
}
template <>
inline uint16_t from_f32<uint16_t>(float v) {
  return dflash::f32_to_bf16_bits(v);
}
// The real header's pair of bf16 (cvt.rn.bf16x2.f32 there, the same bits as f32_to_bf16 twice).
inline uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}
// The real header's rotation of a RoPE pair: fma as __fmaf_rn (std::fma rounds once), products
// rounded as __fmul_rn.
inline void rope_pair(float lo, float hi, float c, float s, float& out_lo, float& out_hi) {
  out_lo = std::fma(lo, c, -(hi * s));
  out_hi = std::fma(hi, c, lo * s);
}
// The real header's butterfly order (xor 16, 8, 4, 2, 1), so sums round as on the GPU.
inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
}  // namespace dflash::cuda
