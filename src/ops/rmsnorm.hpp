// dflash.cpp — RMSNorm, as HF `Qwen3RMSNorm` (modeling_qwen3.py):
//     y = w ⊙ (x · rsqrt(mean(x²) + eps))      (statistics in fp32; here inputs are already fp32)
//
// Invariants: x, y, dy, dx [R, D] row-major, w [D]. One row is normalised over its D values, so the
// full-width norm is R = T rows of D = H and the per-head norm (Qwen3 q_norm/k_norm) is
// R = T·NH rows of D = head_dim: the same function. Backward: dx is OVERWRITTEN, dw ACCUMULATES
// (+=). The sum over rows for dw runs in row order for every column (deterministic for any thread
// count). y may alias x in the forward.
#pragma once

#include <cstdint>

#include "core/arena_plan.hpp"

namespace dflash {

/// y[r,:] = w ⊙ x[r,:] · rstd[r], rstd[r] = 1/sqrt(mean_j x[r,j]² + eps).
/// `rstd` (may be null) receives the per-row reciprocal RMS, [R].
void rmsnorm_fwd_cpu(float* y, float* rstd, const float* x, const float* w, int64_t R, int64_t D,
                     double eps);
void rmsnorm_fwd_cpu(double* y, double* rstd, const double* x, const double* w, int64_t R,
                     int64_t D, double eps);

/// Backward: with g = w ⊙ dy and r = rstd of the row,
///   dx = r·g − x · r³/D · Σ_j g_j x_j     (overwritten; dx may be null)
///   dw += Σ_rows dy ⊙ x · r               (accumulated; dw may be null)
/// Recomputes r from x and eps (no saved statistics needed).
void rmsnorm_bwd_cpu(float* dx, float* dw, const float* dy, const float* x, const float* w,
                     int64_t R, int64_t D, double eps);
void rmsnorm_bwd_cpu(double* dx, double* dw, const double* dy, const double* x, const double* w,
                     int64_t R, int64_t D, double eps);

/// Rows per chunk of the two-pass weight gradient of rmsnorm_bwd_cuda: max(16, ceil(R/256)).
constexpr int64_t rmsnorm_cuda_dw_rows_per_chunk(int64_t R) {
  return (R + 255) / 256 < 16 ? 16 : (R + 255) / 256;
}
/// Number of those chunks (at most 256).
constexpr int64_t rmsnorm_cuda_dw_chunks(int64_t R) {
  const int64_t rows = rmsnorm_cuda_dw_rows_per_chunk(R);
  return R == 0 ? 0 : (R + rows - 1) / rows;
}
/// Device scratch rmsnorm_bwd_cuda takes from its context, in bytes: rstd [R] f32 and, with a
/// weight gradient, the partial sums [rmsnorm_cuda_dw_chunks(R), D] f32; each block rounded to
/// kArenaAlign (what a memory plan reserves for it).
constexpr uint64_t rmsnorm_bwd_cuda_scratch_bytes(int64_t R, int64_t D, bool dw) {
  if (R == 0) return 0;
  const uint64_t rstd = arena_round(static_cast<uint64_t>(R) * 4);
  return rstd + (dw ? arena_round(static_cast<uint64_t>(rmsnorm_cuda_dw_chunks(R) * D) * 4) : 0);
}

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA forward, same formula in fp32 (fixed-order sums: one CTA per row with 16-byte vector
/// loads when D is a multiple of 512, at most 16,384, and y, x, w are 16-byte aligned; else one
/// warp per row). Y, X ∈ {float, uint16_t (bf16 bits)}; w and rstd (may be null) are f32. y may
/// alias x when Y == X.
template <typename Y, typename X>
void rmsnorm_fwd_cuda(cuda::CudaContext& ctx, Y* y, float* rstd, const X* x, const float* w,
                      int64_t R, int64_t D, double eps);
/// CUDA backward: dx (overwritten, may be null) and dy have type G ∈ {float, bf16 bits}; x has
/// type X; dw f32 ACCUMULATES (may be null). dw is summed over fixed row chunks, then the chunks
/// in order: deterministic, no atomics. Scratch (rmsnorm_bwd_cuda_scratch_bytes) comes from
/// ctx.scratch().
template <typename G, typename X>
void rmsnorm_bwd_cuda(cuda::CudaContext& ctx, G* dx, float* dw, const G* dy, const X* x,
                      const float* w, int64_t R, int64_t D, double eps);
/// CUDA backward fused with the gradient of the residual stream that feeds the norm (the drafter's
/// full-width norms, whose input x is the fp32 stream and whose dx joins the stream's gradient).
/// With dx[r,:] the fp32 value rmsnorm_bwd_cuda<float, float> computes (kept in registers):
///   dres[r,:] = dx[r,:]                   when !accumulate (overwritten),
///   dres[r,:] = dres[r,:] + dx[r,:]       when accumulate (fp32 add, one rounding),
///   dres_bf[r,:] = bf16(dres[r,:])        (round to nearest even; dres_bf may be null),
///   dw += Σ_rows dy ⊙ x · rstd           (as rmsnorm_bwd_cuda; dw may be null).
/// dres null: only dw (dres_bf must then be null). dy, x, dres [R, D] f32, dres_bf [R, D] bf16
/// bits, w, dw [D] f32. The same bits as rmsnorm_bwd_cuda into a temporary, then
/// residual_accumulate_cuda (or the copy) and cast_cuda, in one pass: the temporary's write and
/// two reads, and the cast's read of dres, are saved. Scratch as rmsnorm_bwd_cuda.
void rmsnorm_bwd_res_cuda(cuda::CudaContext& ctx, float* dres, uint16_t* dres_bf, bool accumulate,
                          float* dw, const float* dy, const float* x, const float* w, int64_t R,
                          int64_t D, double eps);
#endif

}  // namespace dflash
