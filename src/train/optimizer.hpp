// dflash.cpp — AdamW on fp32 master weights, global grad-norm clipping, learning-rate schedule.
//
// Invariants: parameters, gradients and both moments are fp32 arrays of equal length; the optimizer
// never allocates after construction; results are bit-identical for the same inputs (sequential
// reductions in a fixed order, in double).
#pragma once

#include <cstdint>
#include <span>

#include "core/arena_plan.hpp"

namespace dflash {

/// AdamW hyper-parameters (Loshchilov & Hutter 2019, decoupled weight decay; PyTorch's
/// torch.optim.AdamW semantics with bias correction).
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

/// One parameter array of a multi-tensor AdamW update or gradient-norm reduction (CUDA: a table of
/// these lives in device memory and all pointers are device pointers).
struct AdamWSegment {
  float* param = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const float* grad = nullptr;
  int64_t n = 0;
};

/// One AdamW update of `n` parameters at 1-based `step` with learning rate `lr`:
///   p ← p − lr·wd·p;  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
///   p ← p − lr · (m / (1−β1^step)) / (sqrt(v / (1−β2^step)) + eps).
/// `grad_scale` multiplies g first (clipping). Throws dflash::Error if step < 1.
void adamw_step_cpu(float* param, float* m, float* v, const float* grad, int64_t n,
                    const AdamWConfig& cfg, double lr, int64_t step, double grad_scale = 1.0);

/// Σ g² over one array, accumulated in double in index order.
double sum_squares_cpu(const float* g, int64_t n);

/// Clip factor for a global gradient L2 norm: min(1, max_norm / (norm + 1e-6)); 1 when
/// max_norm ≤ 0 (clipping off).
double clip_scale(double global_norm, double max_norm);

/// Learning-rate schedule: linear warmup then cosine decay to `min_lr_ratio`·`base_lr`
/// (HF `get_cosine_schedule_with_warmup` with a floor):
///   step < warmup:  base·step/warmup
///   else:           base·(min + (1−min)·½(1 + cos(π·(step−warmup)/(total−warmup))))
/// `step` is 0-based (the step about to be taken).
struct LrSchedule {
  double base_lr = 6e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.0;
  /// The learning rate of 0-based step `step`.
  double at(int64_t step) const;
};

/// Blocks per segment of the first pass of grad_sumsq_cuda.
inline constexpr int kGradSumsqCudaBlocks = 64;
/// Device scratch grad_sumsq_cuda takes from its context, in bytes: the first pass's partial sums
/// [max(n_segs, 1), kGradSumsqCudaBlocks] f64, rounded to kArenaAlign.
constexpr uint64_t grad_sumsq_cuda_scratch_bytes(int n_segs) {
  return arena_round(static_cast<uint64_t>(n_segs < 1 ? 1 : n_segs) * kGradSumsqCudaBlocks * 8);
}

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA fused multi-tensor AdamW: one launch updates every segment of the DEVICE table `segs`
/// [n_segs] (max_n = the largest segment's n). The per-element math equals adamw_step_cpu
/// bit for bit (same float scalars, no FMA contraction). `grad_scale` (device f32, null = 1) and
/// `skip` (device int32, null = never; non-zero leaves everything untouched) come from
/// grad_clip_cuda, so clipping and skipping need no host round trip.
void adamw_step_cuda(cuda::CudaContext& ctx, const AdamWSegment* segs, int n_segs, int64_t max_n,
                     const AdamWConfig& cfg, double lr, int64_t step, const float* grad_scale,
                     const int32_t* skip);
/// *out (device double) = Σ over segments of Σ g² of their `grad` arrays: fixed two-pass reduction
/// in double (64 blocks per segment, then one block), bit-reproducible, no atomics.
void grad_sumsq_cuda(cuda::CudaContext& ctx, double* out, const AdamWSegment* segs, int n_segs);
/// From *sumsq (device): norm = sqrt(sumsq) → *norm (may be null); *grad_scale = clip_scale(norm,
/// max_norm) as f32, or 0 when norm is not finite; *skip = 1 when norm is not finite, else 0.
void grad_clip_cuda(cuda::CudaContext& ctx, float* grad_scale, int32_t* skip, double* norm,
                    const double* sumsq, double max_norm);
/// Sets *flag (device int32) to 1 when any of x [n] (T ∈ {float, uint16_t bf16}) is NaN or ±Inf;
/// leaves it unchanged otherwise (the caller zeroes it). No float atomics.
template <typename T>
void nonfinite_check_cuda(cuda::CudaContext& ctx, int32_t* flag, const T* x, int64_t n);
#endif

}  // namespace dflash
