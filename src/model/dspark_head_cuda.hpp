// dflash.cpp — DSpark's heads and loss on the CUDA backend: the same step as dspark_head_step
// (src/model/dspark_head.hpp, whose formulas and conventions this follows) over device buffers,
// chunk by chunk of block rows:
//   E = W1[p] (gathered); the latent z of the Markov head (MarkovHeadType, model/drafter.hpp):
//     vanilla z = E; gated: pre = [hf ; E]·Wgᵀ (cuBLASLt) + bg, z = σ(pre)⊙E (elementwise);
//     rnn: u = [0 ; E ; hf]·Jᵀ (cuBLASLt), then one thread block per block of K slots adds
//     bJ + s_{k−1}·J[:, :r]ᵀ slot after slot and forms s_k and z = tanh(u[2r:3r])
//   D = hf·LMheadᵀ (+ z·W2ᵀ: further cuBLASLt GEMMs accumulating)
//   TL = Hl[a+k]·LMheadᵀ (teacher rows gathered; 0 on unsupervised rows)
//   one row kernel: softmax D and TL, argmax D, CE, L1, acc, the confidence logit and BCE, dD
//     (bf16, written over TL's rows in place: the workspace holds two [C, V] f32 buffers)
//   dhf = dD·LMhead (+ the confidence head's part), dW2 += dDᵀ·z, dz = dD·W2; the Markov head's
//   backward from dz (gated: elementwise, then two GEMMs for ∂[hf ; E] and ∂Wg and a column sum
//   for ∂bg; rnn: the slots of each block last to first in one thread block, then the same GEMMs
//   and column sum for J and bJ) adds its parts to dhf and dE (+ the confidence head's part)
// and after the last chunk dW1[p] += dE, scattered by segments of rows sorted by p on the host
// (DsparkRowIndex): a fixed order of additions, no atomics.
//
// Numerics (DESIGN.md §3): hf, Hl, LMhead, W1, W2, Wg and J bf16 at GEMM inputs (the bf16 copy of
// the master weights), fp32 accumulate and fp32 logits; the biases bg, bJ and the confidence head
// are read from their fp32 master weights; the rnn recurrence, the gate and the state are fp32. A
// gated or rnn latent z enters the bias GEMM as [z_hi | z_lo] (bf16 [C, 2r], ~16 bits: the CPU
// step's z is fp32) against [W2 | W2] (one GEMM of K = 2r). dD, ∂pre and ∂u are bf16 at the
// backward GEMMs' inputs (as the fused CE's dlogits); the rnn recurrence's own ∂u is fp32. Every
// reduction is in a fixed order: two runs give the same bits.
//
// Supported heads: every DSpark head: markov_head_type vanilla, gated or rnn with any rank r ≥ 0,
// with or without a confidence head (and confidence_head_with_markov). The rnn head runs in chunks
// of whole blocks (chunk_rows rounded down to a multiple of K, at least K) and needs R to be a
// multiple of K.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena_plan.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"

namespace dflash {

/// Host-side row indices of a DSpark step over `rows` block rows (the batch's N·K rows, then
/// padding rows with weight 0 up to `rows`), uploaded with the step's inputs:
///   prev [rows]        p_k = x[a+k] (teacher forcing; 0 past the document end and on padding)
///   teacher_pos [rows] the context row a+k of the teacher Hl on supervised rows, −1 elsewhere
///   w1_order [rows]    the supervised rows sorted by (p_k, row), then −1 (unused)
///   w1_seg [rows + 1]  segment s = w1_order[w1_seg[s], w1_seg[s+1]) holds the rows of one token;
///                      trailing entries equal the number of supervised rows (empty segments)
/// Throws dflash::Error when the batch is not of objective dspark, `rows` < N·K, or a supervised
/// row's label is outside [0, vocab) (naming the row and the label).
struct DsparkRowIndex {
  std::vector<int32_t> prev, teacher_pos, w1_order, w1_seg;
};
DsparkRowIndex dspark_row_index(const DrafterBatch& batch, int64_t rows, int64_t vocab);

/// Device bytes of the DSpark head's chunk workspace for chunks of `chunk_rows` rows (C = min(
/// chunk_rows, max(R, 1)); for the rnn head a multiple of K, at least K): D and TL f32 [C, V] (dD
/// bf16 is written over TL: 8 bytes per logit), the gathered teacher rows bf16 [C, H], E bf16 [C,
/// r]; for a gated or rnn head also
/// z as bf16 hi | lo [C, 2r], [W2 | W2] bf16 [V, 2r], the head's input bf16 [C, X] and its gradient
/// f32 [C, X] (X = H + r gated, 2r + H rnn), the pre-activations f32 [C, A] and their gradient f32
/// and bf16 [C, A] (A = r gated, 3r rnn), dz f32 [C, r] and (rnn) s_{k−1} f32 [C, r]; each rounded
/// to kArenaAlign.
uint64_t dspark_head_cuda_workspace_bytes(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows);
/// Device bytes of the step-long buffers: dE f32 [R, r] and the per-row statistics f32 [6, R]
/// (ce, l1, bce, acc, conf, dconf); each rounded to kArenaAlign.
uint64_t dspark_head_cuda_rows_bytes(const DrafterConfig& cfg, int64_t R);

/// Views of the per-row statistics in a DSpark step's row buffers (dspark_head_cuda_rows_bytes;
/// device pointers when `rows` is one): [R] f32 each, CE, L1, BCE (0 on unsupervised rows), acc
/// and the confidence logit c (NaN on unsupervised rows; c NaN without a confidence head).
struct DsparkRowsView {
  const float *ce, *l1, *bce, *acc, *conf;
};
DsparkRowsView dspark_rows_view(const DrafterConfig& cfg, const void* rows, int64_t R);

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// Device pointers of one DSpark head step (R block rows, T context rows).
struct DsparkCudaArgs {
  int64_t R = 0;                           ///< block rows (N·K, padded)
  const float* params = nullptr;           ///< fp32 master weights [layout.total]
  const uint16_t* weights_bf16 = nullptr;  ///< their bf16 copy [layout.total]
  float* grads = nullptr;                  ///< gradients [layout.total], +=; null: no backward
  const uint16_t* lm_head = nullptr;       ///< [V, H] bf16
  const uint16_t* hf = nullptr;            ///< drafter final-norm block rows [R, H] bf16
  const uint16_t* target_final = nullptr;  ///< the target's final-norm rows Hl [T, H] bf16
  const int32_t* labels = nullptr;         ///< [R] (shifted: y_k = x[a+1+k])
  const float* weights = nullptr;          ///< [R] loss weights (0: unsupervised)
  const int32_t* prev = nullptr;           ///< DsparkRowIndex::prev [R]
  const int32_t* teacher_pos = nullptr;    ///< DsparkRowIndex::teacher_pos [R]
  const int32_t* w1_order = nullptr;       ///< DsparkRowIndex::w1_order [R]
  const int32_t* w1_seg = nullptr;         ///< DsparkRowIndex::w1_seg [R + 1]
  float* dhf = nullptr;                    ///< [R, H] f32, overwritten (with grads)
  int32_t* argmax = nullptr;               ///< [R] argmax D (−1 on unsupervised rows)
  double* sums = nullptr;                  ///< [6] see dspark_head_cuda
  void* workspace = nullptr;               ///< dspark_head_cuda_workspace_bytes
  uint64_t workspace_bytes = 0;
  void* rows = nullptr;  ///< dspark_head_cuda_rows_bytes
  uint64_t rows_bytes = 0;
  double grad_scale = 1.0;  ///< multiplies every gradient (1/Σw of the step)
  int64_t chunk_rows = 0;   ///< rows per chunk (the memory plan's)
};

/// The DSpark head step on the device (enqueue only; graph-capturable: no host copies). With
/// grads: parameter gradients of the heads += grad_scale·∂(numerator)/∂θ, dhf = grad_scale·
/// ∂(numerator)/∂hf. sums f64 [6] = {Σ w·(αce·CE + αl1·L1 + αconf·BCE), Σ w, Σ w·CE, Σ w·L1,
/// Σ w·BCE, Σ w·acc} over the supervised rows (DsparkSums' fields, reduced in a fixed order).
/// Throws dflash::Error for a drafter without DSpark heads, null pointers, an rnn head with R not a
/// multiple of block_size, or a workspace smaller than planned (naming it).
void dspark_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                      const Objective& obj, const DsparkCudaArgs& a);
#endif

}  // namespace dflash
