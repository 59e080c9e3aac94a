// dflash.cpp — Domino's GRU prefix head and loss on the CUDA backend: the same step as
// domino_head_step (src/model/domino_head.hpp, whose formulas and conventions this follows) over
// device buffers, chunk by chunk of whole blocks:
//   U = hf·LMheadᵀ                                   (cuBLASLt, f32 [C, V])
//   XI = Embed(x)·W_ihᵀ over all the chunk's rows     (one GEMM; teacher-forced inputs gathered)
//   for j in steps: HH = g_{j−1}·W_hhᵀ (M = blocks), then one gate kernel gives g_j
//   A = hf·W1[:, :H]ᵀ + g_{s(k)}·W1[:, H:]ᵀ,  Z = SiLU(A) (0 on slots k < suffix_start)
//   F = U + Z·W2ᵀ                                    (the GEMM's epilogue reads U)
//   one row kernel: both CEs, argmax F, dU and dF (domino_head.cpp's formulas)
//   dhf = dU·LMhead + dA·W1[:, :H], dW2 += dFᵀ·Z, dW1 += dAᵀ·[hf | g], the GRU's backward through
//   time (one kernel and one GEMM W_hhᵀ·dhh per step), dW_ih += dXIᵀ·E, dW_hh += dHHᵀ·g_{j−1}.
//
// Row layout (domino_head_launch.hpp): the state g_j of block b and everything per GRU step sit
// at row b·K + j + off (off = 0 with shift_label, 1 without), the row of the slot that reads it,
// so the head's input [h_k; g_{s(k)}] is two row-aligned matrices and dW_hh's pairs (dhh_j,
// g_{j−1}) are rows r and r − 1 of two matrices (dhh is 0 at j = 0).
//
// Numerics (DESIGN.md §3): hf, Embed, LMhead, W_ih, W_hh, W1 and W2 bf16 at GEMM inputs (the bf16
// copy of the master weights), fp32 accumulate; the GRU state, gates, A, logits, softmax and CE
// fp32; the GEMM inputs of the backward (dU, dF, dA, dxi, dhh, g) bf16. Every reduction is in a
// fixed order (GEMMs with fixed plans, no atomics): two runs give the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena_plan.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"

namespace dflash {

/// Host-side row index of a Domino step over `rows` block rows (the batch's N·K rows, then
/// padding rows with weight 0 up to `rows`): gru_tok [rows], at the row b·K + j + off of block
/// b's GRU input j (domino_head_cuda.hpp's layout), the token x[a+j] (0 past the document end, as
/// domino_head_step), and −1 on rows that hold no GRU input and on padding rows; lambda, the
/// batch's objective.domino_lambda (staged to the device with the step's inputs). Throws
/// dflash::Error when the batch is not of objective domino or its shift_label differs from the
/// config's, λ is outside [0, 1], `rows` < N·K or is not a multiple of K, or a token or a
/// supervised row's label is outside [0, vocab) (naming the row).
struct DominoRowIndex {
  std::vector<int32_t> gru_tok;
  double lambda = 0;
};
DominoRowIndex domino_row_index(const DrafterConfig& cfg, const DrafterBatch& batch, int64_t rows);

/// The rows of a chunk: `chunk_rows` rounded down to whole blocks (at least one block), at most
/// max(R, K).
int64_t domino_chunk_rows(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows);

/// Device bytes of the Domino head's chunk workspace for chunks of `chunk_rows` rows (C =
/// domino_chunk_rows, nb = C/K): U and F f32 [C, V], dU and dF bf16 [C, V], the GRU inputs bf16
/// [C, H], XI f32 [C, 3G], HH f32 [nb, 3G], g f32 and bf16 [C, G], gates f32 [C, 4G], A f32, Z
/// bf16, dZ f32, dA bf16 [C, E], dg f32 [C, G], dXI and dHH bf16 [C, 3G], the carry and dprev f32
/// [nb, G]; each rounded to kArenaAlign.
uint64_t domino_head_cuda_workspace_bytes(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows);
/// Device bytes of the step-long per-row buffers: CE_F and CE_U f32 [R] each, rounded to
/// kArenaAlign.
uint64_t domino_head_cuda_rows_bytes(int64_t R);

/// Views of the per-row CEs in a Domino step's row buffers (domino_head_cuda_rows_bytes; device
/// pointers when `rows` is one): [R] f32 each, 0 on unsupervised rows.
struct DominoRowsView {
  const float *ce_f, *ce_u;
};
DominoRowsView domino_rows_view(const void* rows, int64_t R);

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// Device pointers of one Domino head step (R block rows, a multiple of K).
struct DominoCudaArgs {
  int64_t R = 0;                           ///< block rows (N·K, padded with whole blocks)
  const uint16_t* weights_bf16 = nullptr;  ///< the bf16 copy of the master weights [total]
  float* grads = nullptr;                  ///< gradients [layout.total], +=; null: no backward
  const uint16_t* embed = nullptr;         ///< the target's embedding [V, H] bf16 (frozen)
  const uint16_t* lm_head = nullptr;       ///< [V, H] bf16
  const uint16_t* hf = nullptr;            ///< drafter final-norm block rows [R, H] bf16
  const int32_t* labels = nullptr;         ///< [R] (domino_block_targets)
  const float* weights = nullptr;          ///< [R] loss weights (0: unsupervised)
  const int32_t* gru_tok = nullptr;        ///< DominoRowIndex::gru_tok [R]
  const double* lambda = nullptr;          ///< λ [1] of the step (DominoRowIndex::lambda)
  float* dhf = nullptr;                    ///< [R, H] f32, overwritten (with grads)
  int32_t* argmax = nullptr;               ///< [R] argmax F (−1 on unsupervised rows)
  double* sums = nullptr;                  ///< [4] see domino_head_cuda
  void* workspace = nullptr;               ///< domino_head_cuda_workspace_bytes
  uint64_t workspace_bytes = 0;
  void* rows = nullptr;  ///< domino_head_cuda_rows_bytes
  uint64_t rows_bytes = 0;
  double grad_scale = 1.0;  ///< multiplies every gradient (1/Σw of the step)
  int64_t chunk_rows = 0;   ///< rows per chunk (the memory plan's; rounded to whole blocks)
};

/// The Domino head step on the device (enqueue only; graph-capturable: no host copies). With
/// grads: parameter gradients of the head += grad_scale·∂(numerator)/∂θ, dhf = grad_scale·
/// ∂(numerator)/∂hf. sums f64 [4] = {Σ w·((1−λ)·CE_F + λ·CE_U), Σ w, Σ w·CE_F, Σ w·CE_U} over the
/// supervised rows (DominoSums' fields, reduced in a fixed order), λ = a.lambda[0] read on the
/// device (a captured graph replays the step with each step's λ; domino_row_index checks it is in
/// [0, 1]). Throws dflash::Error for a drafter without the Domino head, an objective other than
/// domino or of another shift_label, R not a multiple of K, null pointers, or a workspace smaller
/// than planned (naming it).
void domino_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                      const Objective& obj, const DominoCudaArgs& a);
#endif

}  // namespace dflash
