// dflash.cpp — Domino's GRU prefix head and loss on top of the drafter's final hidden states
// (../shared/OBJECTIVES.md §1.2; SpecForge `OnlineDominoModel`, `modeling/draft/domino.py`).
//
// For the block at anchor a (K slots, h_k the drafter's final-norm hidden state of slot k,
// e_j = Embed_target(x[a+j]) teacher-forced, 0's embedding past the document end):
//   GRU (1 layer, no bias, PyTorch gate order r, z, n; g_{−1} = 0 in every block):
//     r = σ(W_ir·e_j + W_hr·g_{j−1}),  z = σ(W_iz·e_j + W_hz·g_{j−1})
//     n = tanh(W_in·e_j + r ⊙ (W_hn·g_{j−1})),  g_j = (1 − z) ⊙ n + z ⊙ g_{j−1}
//   U_k = LMhead(h_k)
//   F_k = U_k + W2·SiLU(W1·[h_k; g_s(k)])   for k ≥ suffix_start, else F_k = U_k
//     shift_label false: s(k) = k − 1, suffix_start = 1 + P, labels y_k = x[a+k]
//     shift_label true:  s(k) = k,     suffix_start = P,     labels y_k = x[a+k+1]
//   numerator = Σ_k w_k·((1−λ)·CE(F_k, y_k) + λ·CE(U_k, y_k)),  w = BlockTargets::weights
// The loss of a step is numerator / Σ w over the whole step (all replicas), as dflash's: SpecForge
// divides each micro-batch's two sums by its own Σw + 1e-6 (it has no loss_terms); one step of one
// micro-batch is the same loss without the 1e-6 (docs/design-notes.md).
//
// Invariants: rows are the training layout's block rows (block-major, N·K); only supervised rows
// (weight ≠ 0) add to the loss and the gradients; the state a slot reads depends only on tokens
// before its label (causality). Every GRU step and every row's correction goes through one
// function shared by the training step and the decoder, so teacher-forced decoding reproduces the
// training F bit for bit. Parameter gradients accumulate (+=); dhf is overwritten. Sums are in
// double in row order (the same bits every run). The target's embedding is frozen (no gradient).
#pragma once

#include <cstdint>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"

namespace dflash {

/// Sums of a Domino step (each over the supervised rows, in double).
struct DominoSums {
  double loss_sum = 0;      ///< Σ w·((1−λ)·CE(F) + λ·CE(U))
  double weight_sum = 0;    ///< Σ w
  double final_ce_sum = 0;  ///< Σ w·CE(F)
  double base_ce_sum = 0;   ///< Σ w·CE(U)
};

/// The Domino loss over the N·K block rows of `batch` (targets from domino_block_targets, λ =
/// batch.objective.domino_lambda) and, when `grads` is not null, its gradient scaled by
/// `grad_scale`: parameter gradients of the head += (layout.domino offsets), dhf [N·K, H] = the
/// gradient with respect to hf (0 on rows no supervised row depends on). hf [N·K, H] are the
/// drafter's final-norm block rows; tables the target's frozen embedding and LM head. argmax [N·K]
/// receives argmax F_k on supervised rows and −1 elsewhere. Throws dflash::Error when the config
/// has no Domino head, the batch's objective is not domino, λ is outside [0, 1] or a label is
/// outside [0, V).
template <typename S>
DominoSums domino_head_step(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                            S* grads, const DrafterTables<S>& tables, const DrafterBatch& batch,
                            const S* hf, double grad_scale, S* dhf, int32_t* argmax,
                            DominoWorkspace<S>& ws);

/// The corrected logits F [N·K, V] of the block rows of `batch` with teacher-forced GRU inputs
/// (F = U on slots before suffix_start). For tests and tools.
template <typename S>
std::vector<S> domino_block_logits(const DrafterConfig& cfg, const DrafterLayout& layout,
                                   const S* params, const DrafterTables<S>& tables,
                                   const DrafterBatch& batch, const S* hf, DominoWorkspace<S>& ws);

/// The decoding side (SpecForge `DominoDraftModel._sample_draft_tokens`): the GRU state of one
/// block, fed the verified anchor and then each drafted token.
struct DominoSlotState {
  std::vector<float> g;  ///< the state after the tokens fed so far [G]
  int fed = 0;           ///< tokens fed since the block started
  DominoWorkspace<float> ws;
};

/// Starts a block: g = 0, nothing fed.
void domino_block_start(const DrafterConfig& cfg, DominoSlotState& st);

/// One GRU step: g ← GRU(Embed(token), g). Throws dflash::Error when `token` is outside [0, V) or
/// the block has had all its GRU steps (DominoHead::gru_steps).
void domino_feed(const DrafterConfig& cfg, const DrafterLayout& layout, const float* params,
                 const float* embed, int32_t token, DominoSlotState& st);

/// F_k in place: `logits` [V] holds U_k on entry and F_k on return (unchanged for k <
/// suffix_start); h [H] is slot k's final-norm hidden state. The state read is the current one,
/// which must be g_{s(k)}: the GRU must have been fed s(k) + 1 tokens (an error otherwise, naming
/// both counts).
void domino_slot_logits(const DrafterConfig& cfg, const DrafterLayout& layout, const float* params,
                        float* logits, const float* h, int k, DominoSlotState& st);

}  // namespace dflash
