// dflash.cpp — DFlash2's candidate selector and loss on the CUDA backend: the same loss and
// gradients as dflash2_head_step (src/model/dflash2_selector.hpp, whose header holds the
// formulas) over the block rows of a packed step. Per chunk of rows: U = hf·LMheadᵀ (cuBLASLt, f32
// logits), the row kernel of backend/cuda/dflash2_selector.cu (ū, argmax, base CE, top-K, scores,
// the K-way CE and its gradient pieces, dl = ∂/∂U in bf16), dhf = dl·LMhead (cuBLASLt) plus the
// selector's P_hᵀ·∂(P_h·h) (unless stop_gradient); then dP_h over the rows in order and dA, dBs
// per token over a stable radix sort of the rows / candidates (no float atomics: the same bits
// every run).
//
// Numerics: hf and the LM head bf16 at the GEMM inputs, fp32 logits and row statistics; A, Bs and
// P_h read from their fp32 master weights; dl bf16 (as the fused CE's dlogits); sums in double.
// Limits (dflash2_cuda_unsupported): selector_top_k and selector_rank at most 1024.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"

namespace dflash {

/// What the CUDA selector cannot run of this drafter: one line per setting (empty: all of it).
std::vector<std::string> dflash2_cuda_unsupported(const DrafterConfig& cfg);

/// The predecessor token of each of `rows` block rows of a dflash2 batch: x[a] (the anchor) at
/// slot 1, the previous slot's label x[a+k−1] at slot k ≥ 2; `vocab` (no selector term) at slot
/// 0, on rows of weight 0 and on the padding rows past the batch's N·K. Throws dflash::Error for a
/// batch of another objective, fewer rows than N·K, or a predecessor outside [0, V).
std::vector<int32_t> dflash2_prev_tokens(const DrafterBatch& b, int64_t rows, int64_t vocab);

/// Device bytes of the chunk workspace for chunks of `chunk_rows` rows (C = min(chunk_rows,
/// max(R, 1))): the logits f32 [C, V] and dl bf16 [C, V], each rounded to kArenaAlign.
uint64_t dflash2_head_cuda_workspace_bytes(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows);
/// Device bytes of the step-long buffers: base, sel, in_topk f32 [R]; e, dproj, da f32 [R, r];
/// cand i32 and ds f32 [R, K]; the sort's keys and indices i32 [3, R·K] and its scratch (an upper
/// bound of cub's: 16 bytes an item plus 1 MiB, checked when the step runs); each rounded.
uint64_t dflash2_head_cuda_rows_bytes(const DrafterConfig& cfg, int64_t R);

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// Device pointers of one DFlash2 head step over R block rows.
struct Dflash2CudaArgs {
  int64_t R = 0;
  const float* params = nullptr;      ///< f32 master weights (A, Bs, P_h at layout.dflash2)
  float* grads = nullptr;             ///< f32 gradients (+=)
  const uint16_t* lm_head = nullptr;  ///< [V, H] bf16
  const uint16_t* hf = nullptr;       ///< [R, H] bf16 final-norm block rows
  const int32_t* labels = nullptr;    ///< [R]
  const float* weights = nullptr;     ///< [R]
  const int32_t* prev = nullptr;      ///< [R] dflash2_prev_tokens
  /// [1] α_sel of the step (dflash2_selector_alpha), on the device so that a replayed CUDA graph
  /// reads each step's; the objective's dflash2_selector_alpha is not read.
  const double* alpha = nullptr;
  /// [R, H] f32: grad_scale·∂loss/∂hf, overwritten with base_in_head; without, the selector's
  /// part is added to the base CE's gradient already there (ū = U: the fused CE's).
  float* dhf = nullptr;
  bool base_in_head = true;   ///< the head computes the base CE's gradient too
  int32_t* argmax = nullptr;  ///< [R] out: argmax ū (−1 on rows of weight 0); null: none
  double* sums = nullptr;     ///< [5] out: Σ w·base, Σ w, Σ w·sel, Σ w·[y ∈ C],
                              ///< Σ w·(base + α·sel)
  void* workspace = nullptr;  ///< dflash2_head_cuda_workspace_bytes
  uint64_t workspace_bytes = 0;
  void* rows = nullptr;  ///< dflash2_head_cuda_rows_bytes
  uint64_t rows_bytes = 0;
  double grad_scale = 0;  ///< 1/Σw of the step (1/sequences for the D-PACE losses)
  int64_t chunk_rows = 0;
  /// D-PACE loss types only (`obj.dpace()`; null otherwise): [R] f32, in-out. On entry, without
  /// base_in_head, each row's base CE with unit weight (the fused CE's per-row loss); with
  /// base_in_head it is ignored (the head's own base CE is used). On return each row's D-PACE
  /// weight of its block (dpace_weights_cuda; 0 on rows of mask 0). `weights` must then be the
  /// rows' mask (D-PACE's static weights, γ ignored), R a multiple of the block size.
  float* dpace_w = nullptr;
  /// D-PACE only: [2] out {Σ w·CE, Σ w} of the base (dpace_weights_cuda's sums, w unrounded).
  double* dpace_sums = nullptr;
};

/// The DFlash2 loss of the step (α_sel = *a.alpha on the device; stop_gradient from `obj`) and its
/// gradient: the selector's parameter gradients +=, dhf overwritten (or += without base_in_head),
/// argmax and sums written (the base CE's too; the sums' first entry uses them). The same kernels
/// run at every α_sel (at 0 without base_in_head they add zeros), so one captured graph serves the
/// warmup, the ramp and the rest. With a D-PACE loss type the rows run with unit weights, then
/// each row's D-PACE weight w (from its block's base CE, detached) scales what is linear in it:
/// dhf's row (the base's and the selector's part, also the fused CE's without base_in_head), the
/// selector's ∂S, ∂A and ∂(P_h·h) rows before the parameter reductions, and the sums' weights.
/// Enqueue only.
/// Throws dflash::Error when the drafter is not DFlash2, the objective is not dflash2, a size is
/// outside dflash2_cuda_unsupported's limits, a pointer is null or a buffer is too small (naming
/// it).
void dflash2_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg,
                       const DrafterLayout& layout, const Objective& obj, const Dflash2CudaArgs& a);
#endif

}  // namespace dflash
