// dflash.cpp — CUDA kernel of the uniform fill (semantics: src/ops/fill.hpp): the same integer hash
// and the same two fp32 roundings as the CPU, so both give the same bits for the same
// (seed, index). No fmt in this file (nvcc).
#include "backend/cuda/common.cuh"
#include "backend/cuda/fill_launch.hpp"

namespace dflash::cuda {
namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename Y>
__global__ void fill_uniform_kernel(Y* y, int64_t n, float offset, float bound, uint64_t seed) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ (static_cast<uint64_t>(e) * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    const float t = __fmul_rn(bound, __fsub_rn(__fmul_rn(2.0f, u), 1.0f));
    y[e] = from_f32<Y>(__fadd_rn(offset, t));
  }
}

}  // namespace

namespace launch {

void fill_uniform(void* y, DType t, int64_t n, float offset, float bound, uint64_t seed,
                  cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(t, [&](auto v) {
    using Y = decltype(v);
    fill_uniform_kernel<Y><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
        static_cast<Y*>(y), n, offset, bound, seed);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
