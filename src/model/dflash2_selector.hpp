// dflash.cpp — DFlash2's candidate selector and loss on top of the drafter's final hidden states
// (../shared/OBJECTIVES.md §1.4; the public DFlash2 references: SpecForge's DFlash2 concept page
// as summarised there, and TorchSpec / Qualcomm's DFlash2 models, read to learn, not copied).
//
// For block slot k ≥ 1 of the block at anchor a (h_k the drafter's final-norm hidden state [H]):
//   U_k = LMhead(h_k)                                   [V]
//   ū_k = softcap(m·U_k),  softcap(z) = c·tanh(z/c) (c = final_logit_softcapping > 0; else z)
//   C_k = topK(ū_k)                                     K = selector_top_k, by value then lower id
//   S_k(p, c) = ū_k[c] + ⟨A[p] ⊙ (P_h·h_k), Bs[c]⟩        A, Bs [V, r], P_h [r, H]
// Training (teacher-forced predecessor p_k = x[a+k−1], gold y_k = x[a+k]):
//   base_k = CE(ū_k, y_k)
//   sel_k  = −log softmax_{c ∈ C_k} S_k(p_k, c)[y_k]     0 when y_k ∉ C_k
//   loss   = Σ_k w_k·(base_k + α_sel·sel_k) / D
//   loss_type dflash: w_k dflash's static weight, D = the step's Σ w (as dflash);
//   loss_type dpace*: w_k = dpace_block_weights of the block's base_k (q_k = exp(−base_k),
//   detached), D = the step's sequences (as plain D-PACE), so that at the identity start with
//   α_sel = 0 the step is plain D-PACE's (docs/design-notes.md, "D-PACE as the base").
//   The denominator D is the caller's (grad_scale = 1/D; DrafterBatch::loss_normaliser).
//   α_sel(t) = α·clip((t + 1 − W)/R, 0, 1), W = warmup_ratio·steps, R = ramp_ratio·steps
//   (R = 0: α once t + 1 > W; t the 0-based optimizer step)
// stop_gradient detaches the selector's inputs (ū and h): only A, Bs and P_h learn from sel.
// Decoding (walk over slots 1..b−1, prev₁ = the anchor): greedy argmax_{c ∈ C_k} S_k(prev, c);
// sampling q_k = softmax(S_k(prev, ·)/T) on C_k, 0 elsewhere (fp32). Greedy left to right.
// At identity (Bs = 0, m = 1, no softcap) S = U on C_k and the walk is the per-slot argmax.
//
// Invariants: rows are the training layout's block rows (block-major, N·K); only supervised rows
// add to the loss and the gradients; parameter gradients accumulate (+=); dhf is overwritten;
// sums are in double in row order (the same bits every run).
#pragma once

#include <cstdint>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"

namespace dflash {

/// α_sel of 0-based optimizer step `step` of `total_steps` (the formula of the file header;
/// SpecForge's dflash2_selector_loss_alpha, _warmup_ratio, _ramp_ratio).
double dflash2_selector_alpha(double alpha, double warmup_ratio, double ramp_ratio, int64_t step,
                              int64_t total_steps);

/// ū = softcap(m·z) of one logit (m = output_multiplier, c = final_logit_softcapping, 0: none).
template <typename S>
S dflash2_unary(S z, double m, double c);

/// The candidates C [K] of unary logits ū [V]: the K largest, by value descending then id
/// ascending (the transform is monotone, so they are also the K largest raw logits).
template <typename S>
void dflash2_topk(std::vector<int32_t>& cand, const S* unary, int64_t V, int K);

/// Sums of a DFlash2 step (over the supervised rows, in double; w the rows' loss weights:
/// dflash's static ones or D-PACE's).
struct Dflash2Sums {
  double loss_sum = 0;        ///< Σ w·(base + α_sel·sel)
  double weight_sum = 0;      ///< Σ w (not D-PACE's denominator: that is the sequences)
  double base_sum = 0;        ///< Σ w·base
  double selector_sum = 0;    ///< Σ w·sel
  double in_topk_weight = 0;  ///< Σ w over the slots whose gold is in C_k
};

/// The DFlash2 loss over the N·K block rows of `batch` (dflash targets; with a D-PACE loss_type
/// their weights are the mask and each row's weight is D-PACE's of its block's base CE, computed
/// here) and, when `grads` is not null, its gradient scaled by `grad_scale` with the weights held
/// fixed: selector parameter gradients += (layout.dflash2), dhf [N·K, H] = ∂/∂hf (0 on
/// unsupervised rows). hf [N·K, H] are the final-norm block rows, lm_head [V, H] the frozen head;
/// argmax [N·K] receives argmax ū on supervised rows, −1 elsewhere. Rows are processed in chunks
/// of whole blocks. Throws dflash::Error when the drafter is not DFlash2, the batch's objective is
/// not dflash2, or a label or anchor token is outside [0, V).
template <typename S>
Dflash2Sums dflash2_head_step(const DrafterConfig& cfg, const DrafterLayout& layout,
                              const S* params, S* grads, const S* lm_head,
                              const DrafterBatch& batch, const S* hf, double grad_scale, S* dhf,
                              int32_t* argmax, Dflash2Workspace<S>& ws);

/// The unary logits ū [N·K, V] of the block rows (hf [N·K, H]). For tests and tools.
template <typename S>
std::vector<S> dflash2_unary_logits(const DrafterConfig& cfg, const S* lm_head, const S* hf,
                                    int64_t rows);

/// One slot of the decoding walk: C_k and S_k(prev, c) over it.
struct Dflash2SlotScores {
  std::vector<int32_t> cand;       ///< C_k [K], unary descending
  std::vector<float> score;        ///< S_k(prev, C_k[j]) [K]
  std::vector<float> unary, proj;  // scratch: ū [V], P_h·h [r]
};

/// C_k and S_k(prev, ·) of one slot from its logits U [V] (drafter_draft_block's row) and its
/// final-norm hidden state h [H]. Throws dflash::Error when the drafter is not DFlash2 or prev is
/// outside [0, V).
void dflash2_slot_scores(const DrafterConfig& cfg, const DrafterLayout& layout, const float* params,
                         const float* logits, const float* h, int32_t prev, Dflash2SlotScores& out);

/// The walk's greedy choice: the candidate of the largest score (the first on ties).
int32_t dflash2_greedy(const Dflash2SlotScores& s);

/// The walk's sampling distribution q [V] (double, from fp32 arithmetic): softmax(S/T) on C_k, 0
/// elsewhere. Throws dflash::Error when temperature is not > 0.
void dflash2_sampling_probs(std::vector<double>& q, const Dflash2SlotScores& s, int64_t V,
                            double temperature);

}  // namespace dflash
