// dflash.cpp — CUDA kernels of the AdamW op family (contract: src/ops/adamw.hpp): fused
// multi-tensor AdamW, the deterministic global gradient sum of squares (fixed-order two-pass
// reduction in double), the clip factor and the non-finite check. AdamW uses round-to-nearest
// intrinsics (no FMA contraction), IEEE sqrt and division, so with the same float scalars it is
// bit-identical to adamw_step_cpu (backend/cpu/adamw.cpp). No fmt in this file (nvcc).
#include <cmath>

#include "backend/cuda/adamw_launch.hpp"
#include "backend/cuda/common.cuh"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;

// blockIdx.y = segment; blocks of x stride over its elements.
__global__ void adamw_kernel(const AdamWSegment* segs, float b1, float b2, float eps, float decay,
                             float step_size, float inv_sqrt_bc2, const float* grad_scale,
                             const int32_t* skip) {
  if (skip && *skip) return;
  const AdamWSegment sg = segs[blockIdx.y];
  const float gs = grad_scale ? *grad_scale : 1.0f;
  const float omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < sg.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = __fmul_rn(sg.grad[i], gs);
    float p = __fmul_rn(sg.param[i], decay);
    const float m = __fadd_rn(__fmul_rn(b1, sg.m[i]), __fmul_rn(omb1, gi));
    const float v = __fadd_rn(__fmul_rn(b2, sg.v[i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_sqrt_bc2), eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, m), denom));
    sg.m[i] = m;
    sg.v[i] = v;
    sg.param[i] = p;
  }
}

// Pass 1: block b of segment s sums g² over i ≡ b·256 + tid (mod kSumsqBlocks·256), in double.
__global__ void sumsq_part_kernel(double* partials, const AdamWSegment* segs) {
  __shared__ double sh[32];
  const AdamWSegment sg = segs[blockIdx.y];
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < sg.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double g = sg.grad[i];
    acc += g * g;
  }
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) partials[blockIdx.y * gridDim.x + blockIdx.x] = acc;
}

// Pass 2: one block sums the partials in a fixed order.
__global__ void sumsq_final_kernel(double* out, const double* partials, int64_t n) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) *out = acc;
}

__global__ void clip_kernel(float* grad_scale, int32_t* skip, double* norm_out,
                            const double* sumsq, double max_norm) {
  const double norm = sqrt(*sumsq);
  const bool finite = isfinite(norm);
  double scale = 1.0;
  if (max_norm > 0) scale = fmin(1.0, max_norm / (norm + 1e-6));
  if (norm_out) *norm_out = norm;
  if (grad_scale) *grad_scale = finite ? static_cast<float>(scale) : 0.0f;
  if (skip) *skip = finite ? 0 : 1;
}

template <typename T>
__global__ void nonfinite_kernel(int32_t* flag, const T* x, int64_t n) {
  bool bad = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bad |= !isfinite(to_f32(x[i]));
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *flag = 1;  // same value: no race
}

}  // namespace

namespace launch {

void adamw(const AdamWSegment* segs, int n_segs, int64_t max_n, float b1, float b2, float eps,
           float decay, float step_size, float inv_sqrt_bc2, const float* grad_scale,
           const int32_t* skip, cudaStream_t s) {
  if (n_segs == 0 || max_n == 0) return;
  dim3 grid(grid_for(max_n, kThreads, 1024), static_cast<unsigned>(n_segs));
  adamw_kernel<<<grid, kThreads, 0, s>>>(segs, b1, b2, eps, decay, step_size, inv_sqrt_bc2,
                                         grad_scale, skip);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void grad_sumsq(double* out, double* partials, const AdamWSegment* segs, int n_segs,
                cudaStream_t s) {
  if (n_segs == 0) {
    DFLASH_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), s));
    return;
  }
  dim3 grid(kSumsqBlocks, static_cast<unsigned>(n_segs));
  sumsq_part_kernel<<<grid, kThreads, 0, s>>>(partials, segs);
  DFLASH_CUDA_LAUNCH_CHECK();
  sumsq_final_kernel<<<1, 1024, 0, s>>>(out, partials,
                                        static_cast<int64_t>(n_segs) * kSumsqBlocks);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void grad_clip(float* grad_scale, int32_t* skip, double* norm, const double* sumsq,
               double max_norm, cudaStream_t s) {
  clip_kernel<<<1, 1, 0, s>>>(grad_scale, skip, norm, sumsq, max_norm);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void nonfinite_check(int32_t* flag, const void* x, DType t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  if (t == DType::bf16)
    nonfinite_kernel<<<grid_for(n, kThreads, 2048), kThreads, 0, s>>>(
        flag, static_cast<const uint16_t*>(x), n);
  else
    nonfinite_kernel<<<grid_for(n, kThreads, 2048), kThreads, 0, s>>>(
        flag, static_cast<const float*>(x), n);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
