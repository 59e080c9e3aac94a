// dflash.cpp — softmax cross-entropy with per-row weights, on logits or fused with the LM head.
//
// For row r with logits z [V], label y_r and weight w_r:
//     lse_r = log Σ_v exp(z_v),   loss_r = lse_r − z_{y_r},   loss_sum = Σ_r w_r·loss_r
//     dz = grad_scale · w_r · (softmax(z) − onehot(y_r))
// (torch.nn.functional.cross_entropy with reduction="none", times the weights; DESIGN.md §1 "Loss":
// the caller divides by Σ w through grad_scale = 1/Σw.) argmax_r is the first index of the
// largest logit (torch.argmax). Rows with w_r = 0 contribute nothing and their label is not
// read (padding may carry any label); any other row needs 0 ≤ y_r < V, else dflash::Error naming
// the row and the label. Statistics in fp32 (fp64 in the double overloads); loss_sum and
// weight_sum are summed in row order in double (deterministic).
// Gradient contract: dlogits and d_hidden are activation gradients, OVERWRITTEN. The fused variant
// never forms the whole [R, V] logits: it works on chunks of `chunk_rows` rows (workspace
// chunk_rows·V floats; the CPU entry keeps it per thread between calls, and turns each chunk's
// logits into their gradient in place with one exp per logit), and leaves the (frozen) LM head
// without a gradient.
#pragma once

#include <cstdint>

#include "core/arena_plan.hpp"

namespace dflash {

/// Sums returned by the cross-entropy ops.
struct CrossEntropyStats {
  double loss_sum = 0;    ///< Σ_r w_r·loss_r
  double weight_sum = 0;  ///< Σ_r w_r
};

/// Forward on materialised logits [R, V]. weights [R] (null = all 1). lse [R] and argmax [R] are
/// outputs and may be null.
CrossEntropyStats cross_entropy_fwd_cpu(float* lse, int32_t* argmax, const float* logits,
                                        const int32_t* labels, const float* weights, int64_t R,
                                        int64_t V);
CrossEntropyStats cross_entropy_fwd_cpu(double* lse, int32_t* argmax, const double* logits,
                                        const int32_t* labels, const double* weights, int64_t R,
                                        int64_t V);

/// Backward on logits: dlogits [R, V] = grad_scale·w_r·(softmax − onehot), from the forward's lse.
void cross_entropy_bwd_cpu(float* dlogits, const float* logits, const float* lse,
                           const int32_t* labels, const float* weights, double grad_scale,
                           int64_t R, int64_t V);
void cross_entropy_bwd_cpu(double* dlogits, const double* logits, const double* lse,
                           const int32_t* labels, const double* weights, double grad_scale,
                           int64_t R, int64_t V);

/// Sizes of the fused LM-head cross-entropy.
struct FusedCeParams {
  int64_t R = 0;            ///< rows (hidden states)
  int64_t H = 0;            ///< hidden size
  int64_t V = 0;            ///< vocabulary (rows of the LM head)
  int64_t chunk_rows = 64;  ///< rows per chunk; the workspace is chunk_rows·V values
  double grad_scale = 1.0;  ///< multiplies d_hidden (e.g. 1/Σw)
};

/// Fused LM head + cross-entropy: logits = hidden [R,H] · head [V,H]ᵀ chunk by chunk, then the
/// loss, lse [R], argmax [R] and row_loss [R] = w_r·loss_r (each may be null) and, when d_hidden
/// [R,H] is not null, the input gradient d_hidden = dlogits · head (overwritten). Equal to
/// linear_fwd_cpu + cross_entropy_fwd_cpu (+ cross_entropy_bwd_cpu + linear_bwd_cpu) up to GEMM
/// blocking.
CrossEntropyStats cross_entropy_fused_cpu(float* d_hidden, float* lse, int32_t* argmax,
                                          float* row_loss, const float* hidden, const float* head,
                                          const int32_t* labels, const float* weights,
                                          const FusedCeParams& p);
/// bf16 LM head (raw bits), converted tile by tile; fp32 everything else.
CrossEntropyStats cross_entropy_fused_cpu(float* d_hidden, float* lse, int32_t* argmax,
                                          float* row_loss, const float* hidden,
                                          const uint16_t* head_bf16, const int32_t* labels,
                                          const float* weights, const FusedCeParams& p);
CrossEntropyStats cross_entropy_fused_cpu(double* d_hidden, double* lse, int32_t* argmax,
                                          double* row_loss, const double* hidden,
                                          const double* head, const int32_t* labels,
                                          const double* weights, const FusedCeParams& p);

/// Device workspace of cross_entropy_fused_cuda, in bytes: the chunk's fp32 logits [C, V]
/// (C = min(chunk_rows, max(R, 1))), with `d_hidden` also their bf16 gradient [C, V], and without
/// `row_loss` a per-row loss buffer [R] f32; each block rounded to kArenaAlign.
constexpr uint64_t cross_entropy_fused_cuda_workspace_bytes(const FusedCeParams& p, bool d_hidden,
                                                            bool row_loss) {
  const int64_t r1 = p.R < 1 ? 1 : p.R;
  const auto C = static_cast<uint64_t>(p.chunk_rows < r1 ? p.chunk_rows : r1);
  const auto V = static_cast<uint64_t>(p.V);
  return arena_round(C * V * 4) + (d_hidden ? arena_round(C * V * 2) : 0) +
         (row_loss ? 0 : arena_round(static_cast<uint64_t>(r1) * 4));
}

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA fused LM head + CE. hidden [R,H] and head [V,H] bf16 (raw bits); labels int32 [R], weights
/// f32 [R] (null = all 1); all device pointers. Rows go in chunks of p.chunk_rows: the chunk's fp32
/// logits [chunk, V] (cuBLASLt, fp32 accumulate) and their bf16 gradient live in `workspace`
/// (device, workspace_bytes ≥ cross_entropy_fused_cuda_workspace_bytes, else dflash::Error), or,
/// when it is null, in ctx.scratch(); the full [R, V] logits never exist.
/// Outputs (each may be null): d_hidden f32 [R,H] = grad_scale·(w·(softmax − onehot))·head
/// (overwritten), lse f32 [R], argmax int32 [R], row_loss f32 [R] (w·loss), sums f64 [2] =
/// {Σ w·loss, Σ w} reduced in a fixed order. Nothing is copied to the host (graph-capturable).
/// A row with w ≠ 0 and a label outside [0, V) gets a NaN loss.
void cross_entropy_fused_cuda(cuda::CudaContext& ctx, float* d_hidden, float* lse, int32_t* argmax,
                              float* row_loss, double* sums, const uint16_t* hidden,
                              const uint16_t* head, const int32_t* labels, const float* weights,
                              const FusedCeParams& p, void* workspace = nullptr,
                              uint64_t workspace_bytes = 0);
#endif

}  // namespace dflash
