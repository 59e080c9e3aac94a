// dflash.cpp — CUDA kernels of the linear op family that cuBLASLt does not cover: the bias added to
// every row of a GEMM's output (semantics: src/ops/linear.hpp). Elementwise, one thread per
// element, fp32 arithmetic, bf16 outputs rounded as core/dtype.hpp. No fmt in this file (nvcc).
#include "backend/cuda/common.cuh"
#include "backend/cuda/linear_launch.hpp"

namespace dflash::cuda {
namespace {

template <typename Y>
__global__ void bias_add_kernel(Y* y, const float* bias, int64_t T, int64_t OUT) {
  const int64_t n = T * OUT;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = from_f32<Y>(to_f32(y[i]) + bias[i % OUT]);
}

}  // namespace

namespace launch {

void bias_add(void* y, DType yt, const float* bias, int64_t T, int64_t OUT, cudaStream_t s) {
  if (T == 0) return;
  const unsigned g = grid_for(T * OUT, 256);
  if (yt == DType::f32)
    bias_add_kernel<float><<<g, 256, 0, s>>>(static_cast<float*>(y), bias, T, OUT);
  else
    bias_add_kernel<uint16_t><<<g, 256, 0, s>>>(static_cast<uint16_t*>(y), bias, T, OUT);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
