// dflash.cpp — CUDA kernel of RoPE, rotate_half pairs (semantics: src/ops/rope.hpp). One thread per
// (row, head, pair) in a grid-stride loop; angles and products in fp32, sincosf per element, the
// rotation as common.cuh's rope_pair (explicit fma, the same bits in every RoPE kernel). The
// backward is the same rotation with the sine negated (sign = −1). The fused per-head RMSNorm +
// RoPE of the q/k path (one warp per head row) rounds the normed value to the storage type before
// the rotation, so it gives the bits of the two kernels in a row. No fmt in this file (nvcc).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/rope_launch.hpp"

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
    float lo, hi;
    rope_pair(to_f32(xr[i]), to_f32(xr[i + half]), c, s, lo, hi);
    yr[i] = from_f32<T>(lo);
    yr[i + half] = from_f32<T>(hi);
  }
}

// RMSNorm over each head's D values, then the rotation (ops/rope.hpp, rmsnorm_rope_fwd_cuda): one
// warp per (token, head) row. The normed value is rounded to Y before it is rotated, exactly as
// rmsnorm_fwd then rope_fwd store and reload it; lane l owns the pairs (i, i + D/2), i = l, l + 32,
// …, reads and writes only those, so y may alias x.
constexpr int kNormRopeRowsPerBlock = 8;

template <typename Y, typename X>
__global__ void rmsnorm_rope_kernel(Y* y, const X* x, const float* w, const int32_t* pos,
                                    const float* inv_freq, float scaling, int64_t Tn, int64_t NH,
                                    int64_t D, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormRopeRowsPerBlock + (threadIdx.x >> 5);
  if (row >= Tn * NH) return;
  const int64_t half = D / 2;
  const X* xr = x + row * D;
  Y* yr = y + row * D;
  const float rs = row_rstd(xr, D, eps);
  const float p = static_cast<float>(pos[row / NH]);
  for (int64_t i = threadIdx.x & 31; i < half; i += 32) {
    const float a = to_f32(from_f32<Y>(w[i] * (to_f32(xr[i]) * rs)));
    const float b = to_f32(from_f32<Y>(w[i + half] * (to_f32(xr[i + half]) * rs)));
    const float ang = p * inv_freq[i];
    float sn, cs;
    sincosf(ang, &sn, &cs);
    const float c = cs * scaling, sv = 1.0f * (sn * scaling);
    float lo, hi;
    rope_pair(a, b, c, sv, lo, hi);
    yr[i] = from_f32<Y>(lo);
    yr[i + half] = from_f32<Y>(hi);
  }
}

}  // namespace

namespace launch {

void rmsnorm_rope_fwd(void* y, DType yt, const void* x, DType xt, const float* w,
                      const int32_t* pos, const float* inv_freq, float scaling, int64_t T,
                      int64_t NH, int64_t D, float eps, cudaStream_t s) {
  const int64_t rows = T * NH;
  if (rows == 0) return;
  const auto grid =
      static_cast<unsigned>((rows + kNormRopeRowsPerBlock - 1) / kNormRopeRowsPerBlock);
  dispatch_dtype(yt, [&](auto yv) {
    dispatch_dtype(xt, [&](auto xv) {
      using Y = decltype(yv);
      using X = decltype(xv);
      rmsnorm_rope_kernel<Y, X><<<grid, 32 * kNormRopeRowsPerBlock, 0, s>>>(
          static_cast<Y*>(y), static_cast<const X*>(x), w, pos, inv_freq, scaling, T, NH, D, eps);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

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
