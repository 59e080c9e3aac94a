// dflash.cpp — AdamW on fp32 master weights and the global gradient norm with its clip factor, as
// ops: the CPU reference and the CUDA implementation with the same arithmetic.
//
// AdamW: Loshchilov & Hutter 2019 (decoupled weight decay), with PyTorch's torch.optim.AdamW
// semantics (bias correction, eps added after the bias-corrected square root). With g the
// gradient times `grad_scale` and t the 1-based step, every element is updated in this order:
//     p ← p·(1 − lr·wd)
//     m ← β1·m + (1 − β1)·g
//     v ← β2·v + (1 − β2)·g²
//     p ← p − (lr / (1 − β1^t)) · m / (sqrt(v)·(1/sqrt(1 − β2^t)) + eps)
// in fp32 with the scalars (1 − lr·wd, lr/(1 − β1^t), 1/sqrt(1 − β2^t)) computed once in double
// and rounded to float. p, m, v are updated in place (=); the gradient is only read. On CUDA a
// segment may also name a bf16 copy of its parameters, written (=) in the same pass as
// bf16(p) rounded to nearest even (f32_to_bf16_bits, as cast_cuda), so no separate cast pass
// reads p again.
// Grad norm: ‖g‖ = sqrt(Σ g²) over every parameter array, summed in double in a fixed order;
// clip factor = min(1, max_norm / (‖g‖ + 1e-6)) (torch.nn.utils.clip_grad_norm_), 1 when
// max_norm ≤ 0 (clipping off).
//
// Invariants: parameters, gradients and both moments are fp32 arrays of equal length n; no op here
// allocates (the CUDA grad sum takes its scratch from the context's caching allocator, sized by
// grad_sumsq_cuda_scratch_bytes); results are bit-identical for the same inputs on either backend
// (fixed-order reductions, no FMA contraction in the update).
#pragma once

#include <cstdint>

#include "core/arena_plan.hpp"

namespace dflash {

/// AdamW hyper-parameters (defaults: PyTorch's, weight decay off).
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

/// One parameter array of a multi-tensor AdamW update or gradient-norm reduction: param, m, v
/// (updated) and grad (read), n fp32 values each; param_bf16 (optional, n bf16 values) receives
/// the updated param rounded to bf16 (=), the weights the next forward reads. On CUDA a table of
/// these lives in device memory and all pointers are device pointers.
struct AdamWSegment {
  float* param = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const float* grad = nullptr;
  int64_t n = 0;
  uint16_t* param_bf16 = nullptr;  ///< null: no bf16 copy (adamw_step_cuda only)
};

/// One AdamW update (formula above) of the n values of param, m, v from grad at 1-based `step`
/// with learning rate `lr`; `grad_scale` multiplies g first (the clip factor). Throws
/// dflash::Error if step < 1.
void adamw_step_cpu(float* param, float* m, float* v, const float* grad, int64_t n,
                    const AdamWConfig& cfg, double lr, int64_t step, double grad_scale = 1.0);

/// Σ g² over g [n], accumulated in double in index order.
double sum_squares_cpu(const float* g, int64_t n);

/// The clip factor of a global gradient L2 norm: min(1, max_norm / (norm + 1e-6)); 1 when
/// max_norm ≤ 0 (clipping off).
double clip_scale(double global_norm, double max_norm);

/// Blocks per segment of the first pass of grad_sumsq_cuda: enough loads in flight to stream a
/// drafter's gradients at memory speed (64 blocks read the 4.2 GB of the Qwen3-8B drafter's
/// gradients in 7.4 ms, 0.57 TB/s: lead's call I, Nsight Compute).
inline constexpr int kGradSumsqCudaBlocks = 1024;
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
/// [n_segs] (max_n = the largest segment's n), per element bit for bit as adamw_step_cpu (same
/// float scalars, round-to-nearest intrinsics, no FMA contraction). `grad_scale` (device f32,
/// null = 1) and `skip` (device int32, null = never; non-zero leaves everything untouched) come
/// from grad_clip_cuda, so clipping and skipping need no host round trip. Throws dflash::Error if
/// step < 1 or the segment count is outside [0, 65536).
void adamw_step_cuda(cuda::CudaContext& ctx, const AdamWSegment* segs, int n_segs, int64_t max_n,
                     const AdamWConfig& cfg, double lr, int64_t step, const float* grad_scale,
                     const int32_t* skip);
/// *out (device double) = Σ over segments of Σ g² of their `grad` arrays (=, not +=): a fixed
/// two-pass reduction in double (kGradSumsqCudaBlocks blocks per segment, then one block),
/// bit-reproducible, no atomics. Its sum order differs from sum_squares_cpu's (results agree to
/// double rounding, not bit for bit).
void grad_sumsq_cuda(cuda::CudaContext& ctx, double* out, const AdamWSegment* segs, int n_segs);
/// From *sumsq (device): norm = sqrt(sumsq) → *norm (may be null); *grad_scale = clip_scale(norm,
/// max_norm) as f32, or 0 when norm is not finite; *skip = 1 when norm is not finite, else 0.
/// Every output is overwritten (=) and may be null.
void grad_clip_cuda(cuda::CudaContext& ctx, float* grad_scale, int32_t* skip, double* norm,
                    const double* sumsq, double max_norm);
/// Sets *flag (device int32) to 1 when any of x [n] (T ∈ {float, uint16_t bf16}) is NaN or ±Inf;
/// leaves it unchanged otherwise (the caller zeroes it). No float atomics.
template <typename T>
void nonfinite_check_cuda(cuda::CudaContext& ctx, int32_t* flag, const T* x, int64_t n);
#endif

}  // namespace dflash
