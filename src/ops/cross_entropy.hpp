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
  /// CUDA only. > 1: the rows come in blocks of this many and the first row of every block is
  /// skipped: it never enters the LM head (DFlash's anchor slot, which block_targets never
  /// supervises: 1/K of the logits GEMM, the row pass and the d_hidden GEMM saved). A skipped row's
  /// hidden state and label are not read; its d_hidden row is 0, row_loss 0, lse NaN (not
  /// computed), argmax −1 (as the CPU trainer reports an unsupervised row); its weight still
  /// enters Σw and must be 0, else its row_loss is NaN. R must be a multiple of it; a chunk is
  /// max(1, chunk_rows / skip_first_of) whole blocks. 0 or 1: every row goes through the head.
  int64_t skip_first_of = 0;
};

/// Rows of `p` that go through the LM head: R, or R·(K − 1)/K with skip_first_of K > 1.
constexpr int64_t fused_ce_head_rows(const FusedCeParams& p) {
  return p.skip_first_of > 1 ? p.R / p.skip_first_of * (p.skip_first_of - 1) : p.R;
}

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

/// Byte offsets of the blocks of cross_entropy_fused_cuda's device workspace (each block rounded
/// to kArenaAlign; an absent block has the offset of the next one), for a chunk of C head rows (C =
/// min(chunk_rows, max(R, 1)); with skip_first_of K > 1, C = min(max(1, chunk_rows / K),
/// max(R / K, 1))·(K − 1)): the chunk's fp32 logits [C, V]; with `d_hidden` their bf16 gradient
/// [C, V]; without `row_loss` a per-row loss buffer [R] f32; with K > 1 the chunk's gathered
/// hidden states [C, H] bf16, with `d_hidden` its fp32 gradient [C, H], and five [C] 4-byte
/// arrays (labels, weights, row loss, lse, argmax of the gathered rows).
struct FusedCeWorkspace {
  uint64_t logits = 0, dlogits = 0, row_loss = 0, hidden_c = 0, d_hidden_c = 0, rows_c = 0;
  uint64_t total = 0;  ///< bytes in all
  int64_t chunk = 0;   ///< C, head rows per chunk
};
constexpr FusedCeWorkspace fused_ce_workspace(const FusedCeParams& p, bool d_hidden,
                                              bool row_loss) {
  const int64_t r1 = p.R < 1 ? 1 : p.R;
  const bool skip = p.skip_first_of > 1;
  int64_t C = p.chunk_rows < r1 ? p.chunk_rows : r1;
  if (skip) {
    const int64_t K = p.skip_first_of, blocks = p.R / K < 1 ? 1 : p.R / K;
    const int64_t per = p.chunk_rows / K < 1 ? 1 : p.chunk_rows / K;
    C = (per < blocks ? per : blocks) * (K - 1);
  }
  const auto c = static_cast<uint64_t>(C), V = static_cast<uint64_t>(p.V);
  const auto H = static_cast<uint64_t>(p.H);
  FusedCeWorkspace w;
  w.chunk = C;
  uint64_t at = 0;
  w.logits = at;
  at += arena_round(c * V * 4);
  w.dlogits = at;
  if (d_hidden) at += arena_round(c * V * 2);
  w.row_loss = at;
  if (!row_loss) at += arena_round(static_cast<uint64_t>(r1) * 4);
  w.hidden_c = at;
  if (skip) at += arena_round(c * H * 2);
  w.d_hidden_c = at;
  if (skip && d_hidden) at += arena_round(c * H * 4);
  w.rows_c = at;
  if (skip) at += arena_round(5 * c * 4);
  w.total = at;
  return w;
}

/// Device workspace of cross_entropy_fused_cuda, in bytes (fused_ce_workspace's total).
constexpr uint64_t cross_entropy_fused_cuda_workspace_bytes(const FusedCeParams& p, bool d_hidden,
                                                            bool row_loss) {
  return fused_ce_workspace(p, d_hidden, row_loss).total;
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
/// A row with w ≠ 0 and a label outside [0, V) gets a NaN loss. With p.skip_first_of K > 1 each
/// chunk's head rows are first gathered (hidden states, labels, weights) and the outputs scattered
/// back, skipped rows taking the values FusedCeParams::skip_first_of names; R % K ≠ 0 is a
/// dflash::Error.
void cross_entropy_fused_cuda(cuda::CudaContext& ctx, float* d_hidden, float* lse, int32_t* argmax,
                              float* row_loss, double* sums, const uint16_t* hidden,
                              const uint16_t* head, const int32_t* labels, const float* weights,
                              const FusedCeParams& p, void* workspace = nullptr,
                              uint64_t workspace_bytes = 0);
#endif

}  // namespace dflash
