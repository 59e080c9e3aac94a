// dflash.cpp — DSpark's heads and loss on top of the drafter's final hidden states
// (../shared/OBJECTIVES.md §1.3; SpecForge `OnlineDSparkModel` and `modeling/draft/dspark.py`).
//
// For block slot k (block at anchor a, labels y_k = x[a+1+k], previous tokens p_k = x[a+k], h_k
// the drafter's final-norm hidden state of the slot, Hl the target's final-norm hidden states):
//   U_k = LMhead(h_k)                        draft base logits [V]
//   D_k = U_k + Bias_k(p_k, h_k)             MarkovHeadType (model/drafter.hpp); 0 when r = 0
//   T_k = softmax(LMhead(Hl[a+k]))           the target's own next-token distribution (teacher)
//   CE_k = −log softmax(D_k)[y_k]
//   L1_k = ‖softmax(D_k) − T_k‖₁,  acc_k = clip(1 − L1_k/2, 0, 1)   (acc: no gradient)
//   c_k = wc·x_k + bc (x_k = h_k or [h_k; W1[p_k]]), BCE_k = softplus(c_k) − acc_k·c_k
//   numerator = Σ_k w_k·(αce·CE_k + αl1·L1_k + αconf·BCE_k), w = BlockTargets::weights
// The loss of a step is numerator / Σ w over the whole step (all replicas), as dflash's.
// ∂|u|/∂u is taken as sign(u) with sign(0) = 0 (torch's abs).
//
// Invariants: rows are the training layout's block rows (block-major, N·K); only supervised rows
// (weight ≠ 0; with the prefix-contiguous mask a prefix of each block) add to the loss and the
// gradients; the rnn state of slot k depends only on slots ≤ k of its block. Parameter gradients
// accumulate (+=); dhf is overwritten. Sums are in double in row order (the same bits every run).
#pragma once

#include <cstdint>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"

namespace dflash {

// DsparkWorkspace: model/drafter.hpp (a member of the drafter step's workspace).

/// Sums of a DSpark step (each over the supervised rows, in double).
struct DsparkSums {
  double loss_sum = 0;    ///< Σ w·(αce·CE + αl1·L1 + αconf·BCE)
  double weight_sum = 0;  ///< Σ w
  double ce_sum = 0;      ///< Σ w·CE
  double l1_sum = 0;      ///< Σ w·L1
  double bce_sum = 0;     ///< Σ w·BCE (0 without a confidence head)
  double acc_sum = 0;     ///< Σ w·acc
  /// Per block row [N·K]: the confidence logit c_k (NaN without a confidence head) and acc_k, on
  /// supervised rows; NaN elsewhere.
  std::vector<double> conf, acc;
};

/// The DSpark head's loss over the N·K block rows of `batch` (its targets from
/// dspark_block_targets) and, when `grads` is not null, its gradient scaled by `grad_scale`:
/// parameter gradients of the heads += (layout.dspark offsets), dhf [N·K, H] = the gradient with
/// respect to hf (0 on unsupervised rows). hf [N·K, H] are the drafter's final-norm block rows,
/// target_final [T, H] the target's final-norm hidden states of the batch's context, lm_head
/// [V, H] the frozen head. argmax [N·K] receives argmax D_k on supervised rows and −1 elsewhere.
/// Throws dflash::Error when the config has no DSpark heads, the batch's objective is not dspark,
/// target_final is null or a label is outside [0, V).
template <typename S>
DsparkSums dspark_head_step(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                            S* grads, const S* lm_head, const DrafterBatch& batch, const S* hf,
                            const S* target_final, double grad_scale, S* dhf, int32_t* argmax,
                            const Objective& obj, DsparkWorkspace<S>& ws);

/// The draft logits D [N·K, V] of the block rows of `batch` with teacher-forced previous tokens
/// p_k = x[a+k] (0 past the document end): U + Bias. For tests and tools.
template <typename S>
std::vector<S> dspark_block_logits(const DrafterConfig& cfg, const DrafterLayout& layout,
                                   const S* params, const S* lm_head, const DrafterBatch& batch,
                                   const S* hf, DsparkWorkspace<S>& ws);

/// The decoding side, one slot at a time (vLLM `v1/spec_decode/dspark.py`: slot k's bias uses the
/// token drafted at slot k−1, prev₀ = the bonus token). Holds the rnn state between slots.
struct DsparkSlotState {
  std::vector<float> s, e, in, u, z;
  int next = 0;  ///< the slot the next call may compute (besides 0)
};

/// D_k in place: `logits` [V] holds U_k on entry and D_k = U_k + Bias_k(prev, h_k) on return; h
/// [H] is slot k's final-norm hidden state. Slot 0 resets the rnn state. A drafter without a
/// Markov head leaves the logits unchanged. Throws dflash::Error when `prev` is outside [0, V) or
/// `k` is not the slot after the previous call's (or 0).
void dspark_slot_logits(const DrafterConfig& cfg, const DrafterLayout& layout, const float* params,
                        float* logits, const float* h, int32_t prev, int k, DsparkSlotState& st);

}  // namespace dflash
