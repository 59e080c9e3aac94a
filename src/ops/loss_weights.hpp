// dflash.cpp — per-row loss weights that depend on the rows' own cross-entropy (D-PACE,
// ../shared/OBJECTIVES.md §1.1; the formula is dpace_block_weights below), and the
// row scaling that applies such weights to a gradient computed with unit weights.
//
// Layout: N blocks of K consecutive rows, block-major (slot k of block b is row b·K + k), as the
// drafter's block rows; a row is supervised where its mask is not 0.
// Invariants: `w` is in-out (each row's CE in, its weight out); rows that are not supervised get
// weight 0 and their CE is never read; sums are reduced in a fixed order (the same bits every
// run). Activation gradients scaled by rows_scale_* are updated in place.
#pragma once

#include <cstdint>
#include <span>

namespace dflash {

/// The loss of a training step (`training.loss_type`, OBJECTIVES.md §1.1). `dflash`: Σ w·CE / Σ w
/// with DESIGN.md §1's static slot weights. The three D-PACE losses weigh each supervised slot by a
/// function of the drafter's own per-slot confidences in the step (dpace_block_weights) and divide
/// by the number of sequences instead of Σ w; γ is ignored. Inference and export are the same for
/// all four.
enum class LossType {
  dflash,
  dpace,                             ///< w_k = R_k (continuation value)
  dpace_cumulative_confidence_only,  ///< w_k = P_k (cumulative confidence)
  dpace_continuation_value_only,     ///< w_k = R_k / max(P_k, tiny)
};

/// The training objective (`training.objective`): `dflash` (DESIGN.md §1, with the loss types of
/// LossType) or `dspark` (OBJECTIVES.md §1.3: labels shifted by one, a prefix-contiguous mask, the
/// drafter's logits plus a Markov bias, an L1 distance to the target's own distribution and a
/// confidence head; its loss is always Σ w·(αce·CE + αl1·L1 + αconf·BCE) / Σ w), `dflash2`
/// (OBJECTIVES.md §1.4: dflash's targets and the loss type's loss on the selector's unary logits,
/// plus α_sel(t) times the selector's K-way CE over the unary top-K candidates with the same
/// per-slot weights, over the same denominator: Σ w, or the sequences for D-PACE) or `domino`
/// (OBJECTIVES.md §1.2: a GRU prefix head corrects the logits, the loss blends the corrected and
/// the base CE by λ; model/domino_head.hpp).
enum class ObjectiveKind { dflash, dspark, dflash2, domino };

/// What a step optimises: the objective, the loss type and D-PACE's smoothing α ∈ [0, 1] (unused
/// by plain dflash), and DSpark's three loss weights (unused by dflash).
struct Objective {
  LossType loss = LossType::dflash;
  double dpace_alpha = 0.5;
  ObjectiveKind kind = ObjectiveKind::dflash;
  double dspark_ce_alpha = 0.1;    ///< αce of the DSpark loss (SpecForge dspark_ce_loss_alpha)
  double dspark_l1_alpha = 0.9;    ///< αl1 (dspark_l1_loss_alpha)
  double dspark_conf_alpha = 1.0;  ///< αconf (dspark_confidence_head_alpha)
  /// DFlash2's selector weight α_sel of this step (dflash2_selector_alpha of the run's
  /// dflash2_selector_loss_alpha, warmup and ramp at the step's index; set per step).
  double dflash2_selector_alpha = 0.0;
  /// DFlash2: the selector's CE does not reach the drafter (dflash2_selector_stop_gradient: its
  /// inputs h and the unary logits are detached; only A, Bs and P_h learn from it).
  bool dflash2_stop_gradient = false;
  /// Domino: λ of this step's loss (1−λ)·ΣwCE(F)/Σw + λ·ΣwCE(U)/Σw, in [0, 1]
  /// (domino_lambda of the optimizer step; unused by the other objectives).
  double domino_lambda = 0.0;
  /// Domino's shift_label: slot k predicts x[a+k+1] and slot 0 is supervised (else x[a+k]).
  bool domino_shift_label = false;
  /// True for the three D-PACE losses.
  bool dpace() const { return loss != LossType::dflash; }
  /// True for the DSpark objective.
  bool dspark() const { return kind == ObjectiveKind::dspark; }
  /// True for the DFlash2 objective.
  bool dflash2() const { return kind == ObjectiveKind::dflash2; }
  /// True for the Domino objective.
  bool domino() const { return kind == ObjectiveKind::domino; }
  /// The first block slot the objective can supervise: 0 for dspark and for domino with
  /// shift_label (labels shifted by one), else 1 (slot 0 holds the anchor's own token).
  int first_slot() const { return dspark() || (domino() && domino_shift_label) ? 0 : 1; }
  bool operator==(const Objective&) const = default;
};

/// D-PACE weights of one block of K slots (OBJECTIVES.md §1.1; SpecForge `_dpace_weight`):
///   q_k = exp(−ce_k), s_k = (1−α)·q_k + α where supervised[k], else 1,
///   P_k = Π_{j≤k} s_j,  R_k = Σ_{j≥k} [supervised_j]·P_j,
///   w_k = R_k (dpace) | P_k (…cumulative-confidence-only) | R_k / max(P_k, tiny)
///   (…continuation-value-only; tiny = the smallest normal double).
/// `ce` [K] is read only where `supervised` is set; `w` [K] is written for every slot (the loss
/// multiplies it by the mask, so an unsupervised slot's weight is never used). Computed in double
/// in slot order. The weights are constants of the step (no gradient flows through them).
/// Throws dflash::Error when the spans differ in size, for `dflash`, or α outside [0, 1].
void dpace_block_weights(std::span<double> w, std::span<const double> ce,
                         std::span<const uint8_t> supervised, const Objective& obj);

/// D-PACE weights of a list of block rows (the rows a loss head computed, packed): rows [R] are
/// indices into N·K block rows (block = row / K, slot = row % K), ascending, so that a block's
/// rows are consecutive; ce [R] is each row's CE and counted [N·K] the batch's supervision mask
/// (indexed by block row). w [R] out: each row's dpace_block_weights weight in its block, 0 where
/// the row is not counted; a block's slots that are not listed count as unsupervised. Computed in
/// double in row order. Throws dflash::Error when the spans' sizes differ, a row is out of
/// [0, counted.size()) or not ascending, or as dpace_weights_check.
void dpace_row_weights(std::span<double> w, std::span<const int32_t> rows,
                       std::span<const double> ce, std::span<const uint8_t> counted, int64_t K,
                       const Objective& obj);

/// The largest block the D-PACE weight ops take (training.block_size's bound).
inline constexpr int64_t kDpaceMaxBlock = 64;

/// Checks the arguments of the D-PACE weight ops (both backends); throws dflash::Error naming
/// `op` for a dflash objective, α outside [0, 1], N < 0 or K outside [1, kDpaceMaxBlock].
void dpace_weights_check(const char* op, int64_t N, int64_t K, const Objective& obj);

/// D-PACE weights of N blocks of K rows, in place: on entry w [N·K] holds each row's CE (read only
/// where mask [N·K] is not 0); on return each supervised row holds its dpace_block_weights weight
/// (computed in double, rounded once) and every other row 0. sums [2] = {Σ w·CE, Σ w} (double,
/// the unrounded weights). Throws dflash::Error as dpace_weights_check.
void dpace_weights_cpu(float* w, double* sums, const float* mask, int64_t N, int64_t K,
                       const Objective& obj);

/// x [R, H] (row-major): x[r, :] *= w[r].
void rows_scale_cpu(float* x, const float* w, int64_t R, int64_t H);

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA dpace_weights_cpu (device pointers; one CTA, one thread per block of rows, sums reduced
/// in a fixed order). Enqueue only, graph-capturable.
void dpace_weights_cuda(cuda::CudaContext& ctx, float* w, double* sums, const float* mask,
                        int64_t N, int64_t K, const Objective& obj);
/// CUDA rows_scale_cpu (device pointers). Enqueue only.
void rows_scale_cuda(cuda::CudaContext& ctx, float* x, const float* w, int64_t R, int64_t H);
#endif

}  // namespace dflash
