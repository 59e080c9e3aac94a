// dflash.cpp — CUDA kernels of SwiGLU, y = silu(gate) ⊙ up, and its backward (semantics:
// src/ops/swiglu.hpp). Elementwise, fp32 arithmetic with expf; gate and up rows have the stride ld
// (the fused [gate | up] GEMM output). Two paths with the same per-element arithmetic (the same
// bits): bf16 rows whose I, ld and pointers allow 16-byte accesses run the vector kernels (8
// values per load and store, blocks striding over rows, no index division); anything else the
// grid-stride scalar kernels. No fmt in this file (nvcc).
#include <cmath>
#include <initializer_list>

#include "backend/cuda/common.cuh"
#include "backend/cuda/swiglu_launch.hpp"

namespace dflash::cuda {
namespace {

// silu(g)·u in fp32, shared by the scalar and the vector forward.
__device__ __forceinline__ float swiglu_value(float g, float u) {
  const float sig = 1.0f / (1.0f + expf(-g));
  return g * sig * u;
}

template <typename T>
__global__ void swiglu_fwd_kernel(T* y, const T* gate, const T* up, int64_t Tn, int64_t I,
                                  int64_t ld) {
  const int64_t n = Tn * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / I, i = e % I;
    y[e] = from_f32<T>(swiglu_value(to_f32(gate[t * ld + i]), to_f32(up[t * ld + i])));
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(T* dgate, T* dup, const T* dy, const T* gate, const T* up,
                                  int64_t Tn, int64_t I, int64_t ld) {
  const int64_t n = Tn * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / I, i = e % I, o = t * ld + i;
    const float g = to_f32(gate[o]), u = to_f32(up[o]), d = to_f32(dy[e]);
    const float sig = 1.0f / (1.0f + expf(-g));
    const float dg = d * u * sig * (1.0f + g * (1.0f - sig));
    const float du = d * g * sig;
    dgate[o] = from_f32<T>(dg);
    dup[o] = from_f32<T>(du);
  }
}

// Eight bf16 values, one 16-byte access.
struct alignas(16) Bf16x8 {
  uint16_t v[8];
};

// Vector forward: blocks stride over rows, threads over the row's groups of 8 (I % 8 == 0).
__global__ void swiglu_fwd_vec_kernel(uint16_t* y, const uint16_t* gate, const uint16_t* up,
                                      int64_t Tn, int64_t I, int64_t ld) {
  const int64_t groups = I / 8;
  for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
    const auto* g8 = reinterpret_cast<const Bf16x8*>(gate + t * ld);
    const auto* u8 = reinterpret_cast<const Bf16x8*>(up + t * ld);
    auto* y8 = reinterpret_cast<Bf16x8*>(y + t * I);
    for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
      const Bf16x8 g = g8[c], u = u8[c];
      Bf16x8 out;
#pragma unroll
      for (int k = 0; k < 8; ++k)
        out.v[k] = f32_to_bf16(swiglu_value(to_f32(g.v[k]), to_f32(u.v[k])));
      y8[c] = out;
    }
  }
}

// Vector backward, the scalar kernel's arithmetic on groups of 8.
__global__ void swiglu_bwd_vec_kernel(uint16_t* dgate, uint16_t* dup, const uint16_t* dy,
                                      const uint16_t* gate, const uint16_t* up, int64_t Tn,
                                      int64_t I, int64_t ld) {
  const int64_t groups = I / 8;
  for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
    const auto* g8 = reinterpret_cast<const Bf16x8*>(gate + t * ld);
    const auto* u8 = reinterpret_cast<const Bf16x8*>(up + t * ld);
    const auto* d8 = reinterpret_cast<const Bf16x8*>(dy + t * I);
    auto* dg8 = reinterpret_cast<Bf16x8*>(dgate + t * ld);
    auto* du8 = reinterpret_cast<Bf16x8*>(dup + t * ld);
    for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
      const Bf16x8 gv = g8[c], uv = u8[c], dv = d8[c];
      Bf16x8 dgo, duo;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float g = to_f32(gv.v[k]), u = to_f32(uv.v[k]), d = to_f32(dv.v[k]);
        const float sig = 1.0f / (1.0f + expf(-g));
        dgo.v[k] = f32_to_bf16(d * u * sig * (1.0f + g * (1.0f - sig)));
        duo.v[k] = f32_to_bf16(d * g * sig);
      }
      dg8[c] = dgo;
      du8[c] = duo;
    }
  }
}

// Whether the bf16 vector kernels apply: 8 values per row group and 16-byte aligned rows.
bool vec_ok(int64_t I, int64_t ld, std::initializer_list<const void*> ptrs) {
  if (I % 8 != 0 || ld % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Blocks of the vector kernels: one row per block at first, at most 8 per SM's worth of rows.
unsigned vec_grid(int64_t Tn) {
  return static_cast<unsigned>(Tn < 65535 * 4 ? Tn : 65535 * 4);
}

}  // namespace

namespace launch {

void swiglu_fwd(void* y, const void* gate, const void* up, DType t, int64_t T, int64_t I,
                int64_t ld_in, cudaStream_t s) {
  if (T * I == 0) return;
  if (t == DType::bf16 && vec_ok(I, ld_in, {y, gate, up})) {
    swiglu_fwd_vec_kernel<<<vec_grid(T), kElementwiseThreads, 0, s>>>(
        static_cast<uint16_t*>(y), static_cast<const uint16_t*>(gate),
        static_cast<const uint16_t*>(up), T, I, ld_in);
    DFLASH_CUDA_LAUNCH_CHECK();
    return;
  }
  dispatch_dtype(t, [&](auto tv) {
    using X = decltype(tv);
    swiglu_fwd_kernel<X><<<grid_for(T * I, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
        static_cast<X*>(y), static_cast<const X*>(gate), static_cast<const X*>(up), T, I, ld_in);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void swiglu_bwd(void* dgate, void* dup, const void* dy, const void* gate, const void* up, DType t,
                int64_t T, int64_t I, int64_t ld_in, cudaStream_t s) {
  if (T * I == 0) return;
  if (t == DType::bf16 && vec_ok(I, ld_in, {dgate, dup, dy, gate, up})) {
    swiglu_bwd_vec_kernel<<<vec_grid(T), kElementwiseThreads, 0, s>>>(
        static_cast<uint16_t*>(dgate), static_cast<uint16_t*>(dup),
        static_cast<const uint16_t*>(dy), static_cast<const uint16_t*>(gate),
        static_cast<const uint16_t*>(up), T, I, ld_in);
    DFLASH_CUDA_LAUNCH_CHECK();
    return;
  }
  dispatch_dtype(t, [&](auto tv) {
    using X = decltype(tv);
    swiglu_bwd_kernel<X><<<grid_for(T * I, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
        static_cast<X*>(dgate), static_cast<X*>(dup), static_cast<const X*>(dy),
        static_cast<const X*>(gate), static_cast<const X*>(up), T, I, ld_in);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
