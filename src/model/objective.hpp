// dflash.cpp — the DFlash training objective around the drafter: anchors, labels, weights, metrics,
// and the loss types of `training.loss_type` (DFlash's static slot weights, D-PACE's weights
// computed from the step's own CE). Formulas: DESIGN.md §1 ("Training"), ../shared/OBJECTIVES.md
// §1.1 (D-PACE).
//
// Invariants: positions are indices into one packed row of T tokens; `doc_offsets` has n_docs+1
// entries, starts at 0, is non-decreasing and ends at the number of real tokens (padding, if any,
// lies after the last offset and belongs to no document, so it never yields anchors or labels).
// Blocks are ordered as their anchors: by document, then by position.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "core/rng.hpp"
#include "ops/loss_weights.hpp"

namespace dflash {

/// One block of the training layout: its anchor position in the row and its document index.
struct Anchor {
  int32_t pos = 0;
  int32_t doc = 0;
  bool operator==(const Anchor&) const = default;
};

/// Checks `doc_offsets` against a row of `T` tokens (see the file invariants); throws dflash::Error
/// naming the offending entry.
void check_doc_offsets(std::span<const int32_t> doc_offsets, int64_t T);

/// Candidate anchors of the document [doc_start, doc_end): positions p with loss_mask[p] and
/// loss_mask[p+1] both set and p+1 < doc_end, ascending.
std::vector<int32_t> anchor_candidates(std::span<const uint8_t> loss_mask, int32_t doc_start,
                                       int32_t doc_end);

/// Blocks the objective draws from one document (mask of its tokens): min(num_anchors, number of
/// anchor_candidates), what sample_anchors takes from it. Throws dflash::Error when
/// num_anchors <= 0.
int32_t document_blocks(std::span<const uint8_t> doc_loss_mask, int num_anchors);

/// Samples up to `num_anchors` anchors per document without replacement (partial Fisher–Yates on
/// the candidates, with `rng`), sorted by position within each document; documents in order.
/// A document with at most `num_anchors` candidates gets all of them.
std::vector<Anchor> sample_anchors(std::span<const uint8_t> loss_mask,
                                   std::span<const int32_t> doc_offsets, int num_anchors, Rng& rng);

/// Labels and loss weights of N blocks of K slots, [N*K] each (slot-major within a block).
/// dflash (block_targets): slot k predicts x[a+k], slot 0 is never supervised (first_slot 1).
/// dspark (dspark_block_targets): slot k predicts x[a+1+k], slot 0 included (first_slot 0).
struct BlockTargets {
  int K = 0;
  std::vector<int32_t> labels;   ///< the slot's label, or -1 where it is past the document end
  std::vector<float> weights;    ///< the slot's loss weight (0 where not supervised)
  std::vector<uint8_t> counted;  ///< 1 where the slot is supervised
  int first_slot = 1;            ///< the first slot that can be supervised (1 dflash, 0 dspark)
  int64_t num_blocks() const { return K ? static_cast<int64_t>(labels.size()) / K : 0; }
};

/// Slot weight of DESIGN.md §1 before the loss mask: 0 for k = 0, exp(-(k-1)/gamma) for k ≥ 1,
/// 1 when gamma ≤ 0.
double slot_decay(int k, double gamma);

/// Builds labels/weights for blocks of `K` slots at `anchors` (tokens and loss_mask of the row).
/// Throws dflash::Error if an anchor lies outside its document.
BlockTargets block_targets(std::span<const int32_t> tokens, std::span<const uint8_t> loss_mask,
                           std::span<const int32_t> doc_offsets, std::span<const Anchor> anchors,
                           int K, double gamma);

/// DSpark's labels and weights (OBJECTIVES.md §1.3, SpecForge `_build_dspark_labels_and_mask`)
/// for blocks of `K` slots at `anchors`: slot k's label is x[a+1+k] (−1 past the document end),
/// its mask the prefix product e_k = Π_{j≤k} [a+1+j < doc_end]·loss_mask[a+1+j] (a slot after an
/// unsupervised one is never supervised), its weight e_k·exp(−k/γ) (γ ≤ 0: e_k). first_slot is 0.
/// Throws dflash::Error as block_targets.
BlockTargets dspark_block_targets(std::span<const int32_t> tokens,
                                  std::span<const uint8_t> loss_mask,
                                  std::span<const int32_t> doc_offsets,
                                  std::span<const Anchor> anchors, int K, double gamma);

/// Domino's labels and weights (OBJECTIVES.md §1.2, SpecForge `OnlineDominoModel.forward`) for
/// blocks of `K` slots at `anchors`. shift_label false: block_targets (labels x[a+k], slot 0 never
/// supervised, weights m_k·exp(−(k−1)/γ)). shift_label true: slot k's label is x[a+k+1] (−1 past
/// the document end), its mask m_k = [a+k+1 < doc_end]·loss_mask[a+k+1] (per slot, not a prefix),
/// its weight m_k·exp(−k/γ) (γ ≤ 0: m_k); first_slot 0. Throws dflash::Error as block_targets.
BlockTargets domino_block_targets(std::span<const int32_t> tokens,
                                  std::span<const uint8_t> loss_mask,
                                  std::span<const int32_t> doc_offsets,
                                  std::span<const Anchor> anchors, int K, double gamma,
                                  bool shift_label);

// LossType, Objective and dpace_block_weights: ops/loss_weights.hpp (the ops layer).

/// The ObjectiveKind named by a `training.objective` value (`dflash`, `dspark`, `dflash2`,
/// `domino`); nullopt else.
std::optional<ObjectiveKind> objective_kind_parse(std::string_view name);
/// The config spelling of `k`.
const char* objective_kind_name(ObjectiveKind k);

/// The LossType named by a `training.loss_type` value (`dflash`, `dpace`,
/// `dpace-cumulative-confidence-only`, `dpace-continuation-value-only`); nullopt for any other.
std::optional<LossType> loss_type_parse(std::string_view name);
/// The config spelling of `t` (the inverse of loss_type_parse).
const char* loss_type_name(LossType t);

/// Accumulated metrics over blocks (one batch, or a log interval).
struct ObjectiveMetrics {
  int K = 0;
  /// Σ w·CE (w: the step's loss weights, D-PACE's included); for DSpark the whole numerator
  /// Σ w·(αce·CE + αl1·L1 + αconf·BCE)
  double loss_weighted_sum = 0;
  /// Σ of the loss's denominators: Σ w for dflash, the number of sequences (documents) for the
  /// D-PACE losses, so that loss() is the loss the steps optimised.
  double weight_sum = 0;
  /// Per slot k (k < BlockTargets::first_slot never counted)
  std::vector<int64_t> slot_correct, slot_count;
  double accept_len_sum = 0;  ///< Σ over blocks of (1 + leading correct supervised slots)
  int64_t blocks = 0;
  /// DSpark only (dspark true): Σ w·CE, Σ w·L1, Σ w·BCE and Σ w·acc of its loss's terms
  /// (DsparkSums; loss_weighted_sum is their αs' combination), each over weight_sum.
  bool dspark = false;
  double dspark_ce_sum = 0, dspark_l1_sum = 0, dspark_bce_sum = 0, dspark_acc_sum = 0;
  /// Domino only (domino true): Σ w·CE(F) and Σ w·CE(U) of its two terms (DominoSums;
  /// loss_weighted_sum is their blend by the step's λ), each over weight_sum.
  bool domino = false;
  double domino_final_ce_sum = 0, domino_base_ce_sum = 0;

  explicit ObjectiveMetrics(int K_ = 0) : K(K_), slot_correct(K_, 0), slot_count(K_, 0) {}
  /// loss_weighted_sum / weight_sum (0 when weight_sum = 0).
  double loss() const { return weight_sum > 0 ? loss_weighted_sum / weight_sum : 0.0; }
  /// Accuracy over all supervised slots.
  double accuracy() const;
  /// Accuracy of slot k (NaN when the slot was never supervised).
  double slot_accuracy(int k) const;
  /// Simulated acceptance length: mean over blocks of 1 + the number of leading slots
  /// k ≥ first_slot that are supervised and whose argmax equals the label.
  double tau() const { return blocks ? accept_len_sum / static_cast<double>(blocks) : 0.0; }
  /// Adds another accumulation (same K).
  void merge(const ObjectiveMetrics& o);
};

/// Adds the metrics of blocks given the drafter's argmax per slot [N*K] and per-slot CE [N*K]
/// (CE may be empty: then the loss terms are not accumulated).
void accumulate_metrics(ObjectiveMetrics& m, const BlockTargets& t, std::span<const int32_t> argmax,
                        std::span<const float> ce);

}  // namespace dflash
