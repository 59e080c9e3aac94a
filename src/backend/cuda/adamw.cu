// dflash.cpp — CUDA kernels of the AdamW op family (contract: src/ops/adamw.hpp): fused
// multi-tensor AdamW, the deterministic global gradient sum of squares (fixed-order two-pass
// reduction in double), the clip factor and the non-finite check. AdamW uses round-to-nearest
// intrinsics (no FMA contraction), IEEE sqrt and division, so with the same float scalars it is
// bit-identical to adamw_step_cpu (backend/cpu/adamw.cpp); it writes a segment's bf16 copy of the
// updated parameters in the same pass when the segment names one. No fmt in this file (nvcc).
#include <cmath>

#include "backend/cuda/adamw_launch.hpp"
#include "backend/cuda/common.cuh"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;

// The per-element constants of one AdamW launch.
struct AdamWScalars {
  float b1, b2, omb1, omb2, eps, decay, step_size, inv_sqrt_bc2, gs;
};

// One element's update (ops/adamw.hpp's order, round-to-nearest intrinsics): p, m, v in place.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float grad,
                                              const AdamWScalars& c) {
  const float gi = __fmul_rn(grad, c.gs);
  p = __fmul_rn(p, c.decay);
  m = __fadd_rn(__fmul_rn(c.b1, m), __fmul_rn(c.omb1, gi));
  v = __fadd_rn(__fmul_rn(c.b2, v), __fmul_rn(__fmul_rn(c.omb2, gi), gi));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), c.inv_sqrt_bc2), c.eps);
  p = __fsub_rn(p, __fdiv_rn(__fmul_rn(c.step_size, m), denom));
}

// Elements [first, n) of a segment, one at a time, thread `t` of `stride`.
__device__ void adamw_scalar(const AdamWSegment& sg, int64_t first, int64_t t, int64_t stride,
                             const AdamWScalars& c) {
  for (int64_t i = first + t; i < sg.n; i += stride) {
    float p = sg.param[i], m = sg.m[i], v = sg.v[i];
    adamw_element(p, m, v, sg.grad[i], c);
    sg.m[i] = m;
    sg.v[i] = v;
    sg.param[i] = p;
    if (sg.param_bf16) sg.param_bf16[i] = f32_to_bf16(p);
  }
}

// blockIdx.y = segment; blocks of x stride over its elements. When the four fp32 arrays are
// 16-byte aligned (and the bf16 copy 8-byte aligned) groups of four elements move as float4 (and
// four bf16 as one 8-byte store), the tail n mod 4 one by one: the same per-element arithmetic,
// more bytes in flight per load.
__global__ void adamw_kernel(const AdamWSegment* segs, AdamWScalars c, const float* grad_scale,
                             const int32_t* skip) {
  if (skip && *skip) return;
  const AdamWSegment sg = segs[blockIdx.y];
  c.gs = grad_scale ? *grad_scale : 1.0f;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const auto addr = [](const void* q) { return reinterpret_cast<uintptr_t>(q); };
  const bool vec = ((addr(sg.param) | addr(sg.m) | addr(sg.v) | addr(sg.grad)) & 15) == 0 &&
                   (addr(sg.param_bf16) & 7) == 0;
  if (!vec) {
    adamw_scalar(sg, 0, t, stride, c);
    return;
  }
  const int64_t groups = sg.n / 4;
  auto* p4 = reinterpret_cast<float4*>(sg.param);
  auto* m4 = reinterpret_cast<float4*>(sg.m);
  auto* v4 = reinterpret_cast<float4*>(sg.v);
  const auto* g4 = reinterpret_cast<const float4*>(sg.grad);
  for (int64_t j = t; j < groups; j += stride) {
    float4 p = p4[j], m = m4[j], v = v4[j];
    const float4 g = g4[j];
    adamw_element(p.x, m.x, v.x, g.x, c);
    adamw_element(p.y, m.y, v.y, g.y, c);
    adamw_element(p.z, m.z, v.z, g.z, c);
    adamw_element(p.w, m.w, v.w, g.w, c);
    m4[j] = m;
    v4[j] = v;
    p4[j] = p;
    if (sg.param_bf16) {
      const uint2 packed{
          static_cast<uint32_t>(f32_to_bf16(p.x)) | (static_cast<uint32_t>(f32_to_bf16(p.y)) << 16),
          static_cast<uint32_t>(f32_to_bf16(p.z)) |
              (static_cast<uint32_t>(f32_to_bf16(p.w)) << 16)};
      reinterpret_cast<uint2*>(sg.param_bf16)[j] = packed;
    }
  }
  adamw_scalar(sg, groups * 4, t, stride, c);
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

__global__ void clip_kernel(float* grad_scale, int32_t* skip, double* norm_out, const double* sumsq,
                            double max_norm) {
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
  const AdamWScalars c{b1, b2, 1.0f - b1, 1.0f - b2, eps, decay, step_size, inv_sqrt_bc2, 1.0f};
  adamw_kernel<<<grid, kThreads, 0, s>>>(segs, c, grad_scale, skip);
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
  sumsq_final_kernel<<<1, 1024, 0, s>>>(out, partials, static_cast<int64_t>(n_segs) * kSumsqBlocks);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void grad_clip(float* grad_scale, int32_t* skip, double* norm, const double* sumsq, double max_norm,
               cudaStream_t s) {
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
