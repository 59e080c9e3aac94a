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

}  // namespace dflash
