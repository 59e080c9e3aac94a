// dflash.cpp — CUDA kernels of SwiGLU, y = silu(gate) ⊙ up, and its backward (semantics:
// src/ops/swiglu.hpp). Elementwise, grid-stride, fp32 arithmetic with expf; gate and up rows have
// the stride ld (the fused [gate | up] GEMM output). No fmt in this file (nvcc).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/launch.hpp"

namespace dflash::cuda {
namespace {

template <typename T>
__global__ void swiglu_fwd_kernel(T* y, const T* gate, const T* up, int64_t Tn, int64_t I,
                                  int64_t ld) {
  const int64_t n = Tn * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / I, i = e % I;
    const float g = to_f32(gate[t * ld + i]), u = to_f32(up[t * ld + i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    y[e] = from_f32<T>(g * sig * u);
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

}  // namespace

namespace launch {

void swiglu_fwd(void* y, const void* gate, const void* up, DType t, int64_t T, int64_t I,
                int64_t ld_in, cudaStream_t s) {
  if (T * I == 0) return;
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
