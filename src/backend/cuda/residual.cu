// dflash.cpp — CUDA kernels of the residual adds (semantics: src/ops/residual.hpp): y = a + b and
// y += b, elementwise, grid-stride, fp32 arithmetic, bf16 stores rounded as core/dtype.hpp.
// No fmt in this file (nvcc).
#include "backend/cuda/common.cuh"
#include "backend/cuda/residual_launch.hpp"

namespace dflash::cuda {
namespace {

template <typename T>
__global__ void residual_fwd_kernel(T* y, const T* a, const T* b, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = from_f32<T>(to_f32(a[e]) + to_f32(b[e]));
}

template <typename Y, typename B>
__global__ void residual_acc_kernel(Y* y, const B* b, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = from_f32<Y>(to_f32(y[e]) + to_f32(b[e]));
}

}  // namespace

namespace launch {

void residual_fwd(void* y, const void* a, const void* b, DType t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(t, [&](auto tv) {
    using X = decltype(tv);
    residual_fwd_kernel<X><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
        static_cast<X*>(y), static_cast<const X*>(a), static_cast<const X*>(b), n);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void residual_accumulate(void* y, DType yt, const void* b, DType bt, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(yt, [&](auto yv) {
    dispatch_dtype(bt, [&](auto bv) {
      using Y = decltype(yv);
      using B = decltype(bv);
      residual_acc_kernel<Y, B><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          static_cast<Y*>(y), static_cast<const B*>(b), n);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
