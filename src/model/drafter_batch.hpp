// dflash.cpp — DrafterBatch: the input of one training step in the DFlash training layout
// (DESIGN.md §1), built once from a data Batch and read by the target and drafter stages of every
// backend (src/train/train_backend.hpp).
//
// Layout: the real tokens of every row of a Batch, back to back, form one context sequence of T
// tokens. `doc_offsets` [n_docs+1] splits it into documents (rows' documents in row order, so a row
// is a run of consecutive documents). `anchors` [N] are positions in that sequence with their
// document index, ordered by document then position; `targets` holds the labels and loss weights
// of their N blocks of K slots ([N·K], block-major).
//
// Invariants:
// - Every context token belongs to one document: doc_offsets[0] = 0, non-decreasing, last = T.
//   Nothing in a DrafterBatch is padding: a backend with fixed step shapes pads in its own staging
//   (drafter_batch_stage), where padding is inert.
// - Each anchor lies inside its document; targets.K = block_size and targets has N·K entries.
// - weight_sum = Σ targets.weights, summed in index order in double (the step's loss normaliser
//   Σw of DESIGN.md §1: the gradient of a step is that of Σ w·CE / weight_sum; with several drafter
//   replicas, the normaliser is the Σw of all their batches, step_weight_sum).
// - The D-PACE losses (`objective`, OBJECTIVES.md §1.1) ignore γ: targets.weights is then the
//   supervision mask m_k (1 or 0), weight_sum counts the supervised slots, and the loss normaliser
//   is the number of sequences of the step: its documents (n_docs, step_documents across
//   replicas). The per-slot D-PACE weights depend on the drafter's CE and are computed in the
//   step (dpace_block_weights), not here.
// - The DSpark objective (OBJECTIVES.md §1.3) has dspark_block_targets (labels x[a+1+k], slot 0
//   supervised: targets.first_slot = 0); its loss normaliser is Σw as for dflash. Its teacher,
//   the target's final-norm hidden state of each context token, comes with the target features.
// - The Domino objective (OBJECTIVES.md §1.2) has domino_block_targets (dflash's targets, or with
//   shift_label labels x[a+k+1] and slot 0 supervised) and dflash's normaliser Σw; the λ of its
//   loss is objective.domino_lambda, set per optimizer step by the trainer.
// - Anchors are a pure function of (seed, epoch, batch index, row) (docs/design-notes.md), so a
//   batch is rebuilt identically from the same Batch and options.
// - The block-row rule (positions anchor − doc_start + j, keys [doc_start, anchor) plus the block's
//   own K keys) lives in one function, drafter_batch_block_rows, used by the CPU drafter and by the
//   device staging alike.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "model/objective.hpp"
#include "ops/attention.hpp"

namespace dflash {

struct Batch;

/// One training step's input (see the file comment for the layout and invariants).
struct DrafterBatch {
  int block_size = 0;                   ///< K
  std::vector<int32_t> tokens;          ///< [T] context token ids
  std::vector<int32_t> doc_offsets{0};  ///< [n_docs+1], from 0 to T
  std::vector<Anchor> anchors;          ///< [N] positions in [0, T) and document indices
  BlockTargets targets;                 ///< [N·K] labels, weights, supervised flags
  double weight_sum = 0;                ///< Σ targets.weights (double, index order)
  /// Σw of the whole optimizer step when this batch is one of several (one per drafter replica,
  /// docs/design-notes.md): each replica's gradient is that of Σw·CE / step_weight_sum, so that
  /// their sum is the gradient of the step's loss. Unset: the batch is the whole step.
  std::optional<double> step_weight_sum;
  /// The documents of the whole optimizer step when this batch is one of several (the D-PACE
  /// losses' normaliser, like step_weight_sum for dflash). Unset: the batch is the whole step.
  std::optional<int64_t> step_documents;
  Objective objective;                  ///< the loss of the step (training.loss_type, dpace_alpha)
  int64_t rows = 0;                     ///< rows of the source Batch
  int64_t row_length = 0;               ///< L of the source Batch (rows·L bounds T)
  int64_t epoch = 0, index = 0;         ///< the source Batch's epoch and index in it
  int64_t n_supervised = 0;             ///< context tokens with loss mask 1

  explicit DrafterBatch(int K = 0) : block_size(K) { targets.K = K; }

  int64_t T() const { return static_cast<int64_t>(tokens.size()); }
  int64_t N() const { return static_cast<int64_t>(anchors.size()); }
  int64_t n_docs() const { return static_cast<int64_t>(doc_offsets.size()) - 1; }
  /// This batch's part of the loss's denominator: weight_sum (Σw) for dflash; for the D-PACE
  /// losses its number of sequences, n_docs (OBJECTIVES.md §1.1: SpecForge divides by the batch's
  /// samples, one conversation each; our rows pack several, each a document).
  double loss_denominator() const;
  /// The step's loss normaliser, the sum of loss_denominator() over the step's batches: for
  /// dflash step_weight_sum when set, else weight_sum; for D-PACE step_documents when set, else
  /// n_docs. The gradient of each batch is that of its Σ w·CE divided by this.
  double loss_normaliser() const;
  /// Whether the whole step supervises some slot (its Σ targets.weights, step_weight_sum when
  /// set, is > 0); a step that does not is skipped by every replica alike.
  bool step_supervises() const { return step_weight_sum.value_or(weight_sum) > 0; }

  /// Appends one row: `tokens` [n] with its documents `doc_offsets` [d+1] (0 .. n), its anchors
  /// (row positions, row document indices) and their targets (K = block_size, one block per
  /// anchor). Shifts positions and document indices into the batch's sequence; adds one to `rows`
  /// and raises row_length to at least n. Throws dflash::Error naming the row on malformed offsets,
  /// an anchor outside its document or targets that do not match the anchors.
  void append_row(std::span<const int32_t> tokens, std::span<const int32_t> doc_offsets,
                  std::span<const Anchor> anchors, const BlockTargets& targets);

  /// Checks the invariants of the file comment; throws dflash::Error naming the first broken one.
  void validate() const;
  /// A 64-bit hash of the batch's contents (tokens, documents, anchors, labels, weights): stages
  /// use it to check that features and staged inputs belong to the batch they are given with.
  uint64_t fingerprint() const;
};

/// How drafter_batch_from_batch samples anchors and weighs slots (the `training` section).
struct DrafterBatchOptions {
  int block_size = 16;    ///< K
  int num_anchors = 512;  ///< per document
  double gamma = 7.0;     ///< slot decay, see slot_decay (ignored by the D-PACE losses)
  uint64_t seed = 0;      ///< run seed; row r of batch (epoch, index) samples with
                          ///< Rng(derive_seed(seed, {epoch, index, r}))
  Objective objective;    ///< the step's loss (DrafterBatch::objective)
};

/// The block targets of one row's anchors under `opts`' objective: dspark_block_targets for
/// DSpark (shifted labels), domino_block_targets for Domino (with its shift_label), else block_targets with `opts.gamma` for dflash and with all
/// supervised weights 1 for the D-PACE losses (they ignore γ, OBJECTIVES.md §1.1). `tokens` and
/// `loss_mask` are the row's real tokens [n], `doc_offsets` its documents [d+1] (0 .. n).
/// Throws as block_targets.
BlockTargets drafter_row_targets(const DrafterBatchOptions& opts, std::span<const int32_t> tokens,
                                 std::span<const uint8_t> loss_mask,
                                 std::span<const int32_t> doc_offsets,
                                 std::span<const Anchor> anchors);

/// The DrafterBatch of a data Batch: per row, anchors sampled per document (sample_anchors with
/// the row's Rng above) and their block targets (block_targets with `gamma` for dflash, with all
/// supervised weights 1 for the D-PACE losses, dspark_block_targets for DSpark), rows appended in
/// order; rows without tokens add
/// nothing but count in `rows`. Throws dflash::Error on malformed batches.
DrafterBatch drafter_batch_from_batch(const Batch& batch, const DrafterBatchOptions& opts);

/// The same for rows [row_begin, row_end) of `batch` only (one drafter replica's share of a
/// step's global batch, train/pipeline.hpp). Row r keeps its Rng of the whole batch (r is the
/// row's index in `batch`), so the shares of a batch hold exactly the anchors and targets of the
/// whole batch's DrafterBatch; n_supervised counts the share's tokens. Throws dflash::Error for
/// a range outside [0, rows] or empty, and on malformed batches.
DrafterBatch drafter_batch_from_rows(const Batch& batch, int64_t row_begin, int64_t row_end,
                                     const DrafterBatchOptions& opts);

/// Position of every context token inside its document, [T] (0 at each document start).
void drafter_batch_context_positions(const DrafterBatch& b, std::span<int32_t> positions);

/// The block rows of the training layout, [N·K] each, for a key array that holds the context rows
/// and then the block rows starting at key row `block_key_start` (≥ T; device layouts pad the
/// context). Row q = i·K + j (block i at anchor a in document [s, e), slot j): token x[a] for
/// j = 0 else `mask_token_id`; position a − s + j; keys [s, a) ∪ [block_key_start + i·K,
/// block_key_start + (i+1)·K) (DESIGN.md §1 visibility). Throws dflash::Error on span sizes.
void drafter_batch_block_rows(const DrafterBatch& b, int32_t mask_token_id, int64_t block_key_start,
                              std::span<int32_t> tokens, std::span<int32_t> positions,
                              std::span<AttnRange> ranges);

/// The fixed-shape arrays of a device step (host memory, usually pinned staging buffers): T_pad
/// context rows and NK_pad block rows, the sizes given by the spans themselves.
struct DrafterStaging {
  std::span<int32_t> tokens;            ///< [T_pad] target input ids
  std::span<AttnRange> context_ranges;  ///< [T_pad] causal key ranges of the target forward
  std::span<int32_t> positions;         ///< [T_pad + NK_pad] context, then block rows
  std::span<int32_t> block_tokens;      ///< [NK_pad]
  std::span<AttnRange> block_ranges;    ///< [NK_pad] keys over [context T_pad ; blocks NK_pad]
  std::span<int32_t> labels;            ///< [NK_pad], 0 where the weight is 0 (always in [0, V))
  std::span<float> weights;             ///< [NK_pad]
};

/// The context part of drafter_batch_stage, for a stage that runs only the target: writes `b`'s
/// tokens, positions and causal key ranges into `tokens`, `positions` and `ranges` (all of size
/// T_pad ≥ T), the rows [T, T_pad) being padding documents of `pad_id`: consecutive documents of
/// b.row_length rows (the last one shorter; all of [T, T_pad) in one when row_length is 0), so
/// usually ONE, each seeing only itself with positions from 0 (inert: no real row sees a padding
/// row, and a row's values depend only on the rows it sees). Returns the documents staged, real
/// and padding (what sizes the cuDNN prefill's slots: TargetCuda::cudnn_prefill_select). Throws
/// dflash::Error when the spans differ in size or are shorter than the context.
int64_t drafter_batch_stage_context(const DrafterBatch& b, int32_t pad_id,
                                    std::span<int32_t> tokens, std::span<int32_t> positions,
                                    std::span<AttnRange> ranges);

/// Writes `b` into `out` padded to its sizes: context rows [T, T_pad) are the padding documents of
/// drafter_batch_stage_context (`pad_id` tokens, seeing only their own document); block rows [N·K,
/// NK_pad) are inert blocks (MASK tokens, positions 0..K−1, weight 0, label 0, seeing only their
/// own block), so padding changes no loss, no gradient and no real row. Real rows follow
/// drafter_batch_context_positions, attention_causal_varlen_ranges and drafter_batch_block_rows
/// with block_key_start = T_pad. Returns the documents of the staged context, real and padding
/// (drafter_batch_stage_context). Throws dflash::Error when T_pad < T, NK_pad < N·K, NK_pad is not
/// a multiple of K or the spans' sizes disagree.
int64_t drafter_batch_stage(const DrafterBatch& b, int32_t mask_token_id, int32_t pad_id,
                            const DrafterStaging& out);

}  // namespace dflash
