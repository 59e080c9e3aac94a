// dflash.cpp — CUDA kernel of RoPE, rotate_half pairs (semantics: src/ops/rope.hpp). One thread per
// (row, head, pair) in a grid-stride loop; angles and products in fp32, sincosf per element. The
// backward is the same rotation with the sine negated (sign = −1). No fmt in this file (nvcc).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/launch.hpp"

namespace dflash::cuda {
namespace {

template <typename T>
__global__ void rope_kernel(T* y, const T* x, const int32_t* pos, const float* inv_freq,
                            float scaling, float sign, int64_t Tn, int64_t NH, int64_t D) {
  const int64_t half = D / 2;
  const int64_t n = Tn * NH * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, th = e / half, t = th / NH;
    const float ang = static_cast<float>(pos[t]) * inv_freq[i];
    float sn, cs;
    sincosf(ang, &sn, &cs);
    const float c = cs * scaling, s = sign * (sn * scaling);
    const T* xr = x + th * D;
    T* yr = y + th * D;
    const float a = to_f32(xr[i]), b = to_f32(xr[i + half]);
    yr[i] = from_f32<T>(a * c - b * s);
    yr[i + half] = from_f32<T>(b * c + a * s);
  }
}

}  // namespace

namespace launch {

void rope(void* y, const void* x, DType t, const int32_t* pos, const float* inv_freq, float scaling,
          float sign, int64_t T, int64_t NH, int64_t D, cudaStream_t s) {
  const int64_t n = T * NH * (D / 2);
  if (n == 0) return;
  dispatch_dtype(t, [&](auto tv) {
    using X = decltype(tv);
    rope_kernel<X><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
        static_cast<X*>(y), static_cast<const X*>(x), pos, inv_freq, scaling, sign, T, NH, D);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
