// dflash.cpp — CUDA kernel of the element type conversion (semantics: src/ops/cast.hpp): f32 <->
// bf16 or a same-type copy, grid-stride, rounding as core/dtype.hpp. No fmt in this file (nvcc).
#include "backend/cuda/cast_launch.hpp"
#include "backend/cuda/common.cuh"

namespace dflash::cuda {
namespace {

template <typename D, typename S>
__global__ void cast_kernel(D* dst, const S* src, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[e] = from_f32<D>(to_f32(src[e]));
}

}  // namespace

namespace launch {

void cast(void* dst, DType dt, const void* src, DType st, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch_dtype(dt, [&](auto dv) {
    dispatch_dtype(st, [&](auto sv) {
      using Dd = decltype(dv);
      using Ss = decltype(sv);
      cast_kernel<Dd, Ss><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          static_cast<Dd*>(dst), static_cast<const Ss*>(src), n);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
