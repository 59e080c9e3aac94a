// dflash.cpp — device helpers shared by the .cu files: bf16 (raw uint16_t bits) loads and stores
// with the same rounding as core/dtype.hpp (round to nearest even, NaN stays a quiet NaN with its
// sign), warp and block reductions in a fixed order (deterministic; a block argmax), launch checks.
// No fmt, no core/error.hpp here (nvcc cannot evaluate fmt's consteval checks).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/check.hpp"
#include "core/dtype.hpp"

namespace dflash::cuda {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
/// f32 -> bf16 bits, identical to dflash::f32_to_bf16_bits.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ uint16_t from_f32<uint16_t>(float v) {
  return f32_to_bf16(v);
}

/// f32_to_bf16(lo) | f32_to_bf16(hi) << 16 in one cvt.rn.bf16x2.f32 (round to nearest even, as
/// f32_to_bf16, subnormals kept) for every pair without a NaN; a pair with a NaN takes
/// f32_to_bf16's path (it keeps the NaN's sign and payload, cvt returns the canonical NaN), so
/// the bits are f32_to_bf16's for every input.
inline __device__ __noinline__ uint32_t pack_bf16x2_nan(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  if (__builtin_expect(lo != lo || hi != hi, 0)) return pack_bf16x2_nan(lo, hi);
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// The rotate_half rotation of one RoPE pair (lo, hi) = (x_i, x_{i+D/2}) by c and s (cos and sin
/// times the scaling; s negated for the backward): lo' = lo·c − hi·s, hi' = hi·c + lo·s, each the
/// first product fused with the rounded second one (fma). Written with explicit roundings, not left
/// to the compiler's contraction (which fused different products in different kernels), so that
/// every RoPE kernel (rope.cu, decode_fused.cuh's qkv_prepare) gives the same bits.
__device__ __forceinline__ void rope_pair(float lo, float hi, float c, float s, float& out_lo,
                                          float& out_hi) {
  out_lo = __fmaf_rn(lo, c, -__fmul_rn(hi, s));
  out_hi = __fmaf_rn(hi, c, __fmul_rn(lo, s));
}

/// 1/sqrt(mean_j x_j² + eps) of one row x[0, D), computed by the calling warp (lane l sums
/// j = l, l + 32, … in order, then warp_sum): every lane gets it. The RMSNorm kernels' statistic
/// (rmsnorm.cu, and the fused RMSNorm + RoPE of rope.cu, which must round the same way).
/// The loads run four columns ahead of the sums (the same order of additions as one at a time).
template <typename X>
__device__ __forceinline__ float row_rstd(const X* x, int64_t D, float eps) {
  float ss = 0.f;
  int64_t j = threadIdx.x & 31;
  for (; j + 96 < D; j += 128) {
    const float a = to_f32(x[j]), b = to_f32(x[j + 32]), c = to_f32(x[j + 64]),
                d = to_f32(x[j + 96]);
    ss += a * a;
    ss += b * b;
    ss += c * c;
    ss += d * d;
  }
  for (; j < D; j += 32) {
    const float v = to_f32(x[j]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  return 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
}

/// Calls f(j0, j1, j2, j3) for the calling lane's columns of a row of D, j = lane + 32·k, four at
/// a time, then f1(j) for the rest: a row loop whose body loads four columns before it uses
/// them (memory-level parallelism for the one-warp-per-row kernels).
template <typename F4, typename F1>
__device__ __forceinline__ void lane_cols(int64_t D, F4&& f4, F1&& f1) {
  int64_t j = threadIdx.x & 31;
  for (; j + 96 < D; j += 128) f4(j, j + 32, j + 64, j + 96);
  for (; j < D; j += 32) f1(j);
}

/// Sum over the block (blockDim.x a multiple of 32, ≤ 1024) in a fixed order; every thread gets the
/// result. `sh` holds at least 32 values.
template <typename S>
__device__ __forceinline__ S block_sum(S v, S* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  S r = lane < nw ? sh[lane] : S(0);
  return warp_sum(r);
}

/// The argmax of row[0, V) over the block (blockDim.x a power of two, ≤ kThreads): each thread
/// scans a strided slice keeping (max, smallest index), then a shared-memory tree prefers the
/// larger value and, on ties, the smaller index, so the result is the smallest index of the row's
/// maximum (the CPU's argmax_row). A row of −inf or NaN only gives 0. Every thread must call it;
/// the result is valid in thread 0.
template <int kThreads>
__device__ __forceinline__ int32_t block_argmax(const float* row, int64_t V) {
  float best = -INFINITY;
  int64_t idx = V;  // none yet
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float v = row[i];
    if (v > best) {  // strict: the smallest index of a thread's maximum; NaN never compares
      best = v;
      idx = i;
    }
  }
  __shared__ float sv[kThreads];
  __shared__ int64_t si[kThreads];
  sv[threadIdx.x] = best;
  si[threadIdx.x] = idx;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      const float ov = sv[threadIdx.x + w];
      const int64_t oi = si[threadIdx.x + w];
      if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
        sv[threadIdx.x] = ov;
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  return static_cast<int32_t>(si[0] < V ? si[0] : 0);
}

/// Threads per block of the grid-stride elementwise kernels (embedding, RMSNorm's dw, RoPE,
/// SwiGLU, residual, cast, fill, AdamW).
constexpr int kElementwiseThreads = 256;

/// Calls fn(T{}) with T = uint16_t (bf16 bits) for DType::bf16 and T = float otherwise: the
/// launchers' way from a runtime dtype tag to a kernel template argument.
template <typename Fn>
void dispatch_dtype(DType t, Fn&& fn) {
  if (t == DType::bf16)
    fn(uint16_t{});
  else
    fn(float{});
}

inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535LL * 8) {
  int64_t g = (n + threads - 1) / threads;
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return static_cast<unsigned>(g);
}

}  // namespace dflash::cuda

/// Checks the last launch (throws dflash::Error with file and line).
#define DFLASH_CUDA_LAUNCH_CHECK() DFLASH_CUDA_CHECK(cudaGetLastError())
