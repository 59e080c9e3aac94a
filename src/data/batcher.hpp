// dflash.cpp — batches of packed documents with a small fixed set of shapes, deterministic
// shuffling and a resumable data cursor.
//
// Invariants:
// - A batch is `rows` rows of `L` tokens, L one of shapes() = {budget, budget/2, ...,
//   budget/2^(num_shapes-1)} (the smallest that holds the batch's fullest row), so that each shape
//   can be captured once as a CUDA graph.
// - A row holds whole documents back to back from position 0, padding only at the row end
//   (pad token, mask 0, position 0, segment -1). A document is never split across rows or batches.
//   Positions restart at 0 for every document. Rows may be entirely padding (only in the last
//   batch of an epoch, when the epoch's rows do not fill it).
// - Every document appears exactly once per epoch. The plan of an epoch (which documents share a
//   row, the order of batches) is a pure function of (dataset, options, seed, epoch): shuffle with
//   core/rng's Rng (no std:: shuffle or distribution, whose results differ between standard
//   libraries), then first-fit-decreasing packing inside windows of
//   `window_rows` rows' worth of tokens (first-fit in shuffled order by default, first-fit
//   decreasing with sort_by_length), rows grouped by fill, batch order shuffled.
// - With a block budget B (0 < B < token budget), a row also holds at most B training blocks:
//   Σ over its documents of doc_blocks[d] ≤ B, where doc_blocks[d] is the number of blocks the
//   objective will draw from document d (min(anchors per document, candidate anchors); the caller
//   computes it). A step therefore never has more blocks than rows·B, and no anchor is dropped to
//   meet that bound. A budget B ≥ the token budget can never bind (a document of n tokens has at
//   most n − 1 candidates) and is treated as no budget.
// - A DataCursor (seed, epoch, next batch) restored into a Batcher over the same dataset and
//   options makes it produce exactly the batches it would have produced.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "data/dataset.hpp"

namespace dflash {

/// Options of a Batcher.
struct BatcherOptions {
  int64_t token_budget = 8192;  ///< tokens per row of the largest shape
  int64_t rows = 1;             ///< rows per batch
  int num_shapes = 4;           ///< row lengths budget, budget/2, ... (budget divisible by 2^(n-1))
  int64_t window_rows = 64;     ///< packing window, in rows' worth of tokens
  /// Sort each window's documents by decreasing length before first-fit (least padding, but rows
  /// become length-homogeneous: long and short documents no longer share a step). Off: first-fit
  /// in shuffled order, so every row is a random mix of the corpus.
  bool sort_by_length = false;
  uint64_t seed = 0;
  int32_t pad_token = 0;
  /// Training blocks per row (see the file invariants); 0 = no bound. Needs `doc_blocks`.
  int64_t block_budget = 0;
  /// Blocks each document yields ([num_docs] entries, each in [0, block_budget]); read only when
  /// the block budget binds.
  std::vector<int32_t> doc_blocks;
};

/// Where a document sits in a batch.
struct DocSlot {
  int32_t row = 0;
  int32_t start = 0;   ///< first token column in the row
  int32_t length = 0;  ///< tokens
  int64_t doc = 0;     ///< index in the dataset
};

/// One batch. Tensors are CPU, contiguous, [rows, L].
struct Batch {
  int64_t epoch = 0;
  int64_t index = 0;                     ///< batch index within the epoch
  int64_t row_length = 0;                ///< L
  Tensor tokens;                         ///< i32 [rows, L]
  Tensor loss_mask;                      ///< boolean (u8 0/1) [rows, L]
  Tensor positions;                      ///< i32 [rows, L], 0.. within each document, 0 on padding
  Tensor segments;                       ///< i32 [rows, L], index into `docs`, -1 on padding
  std::vector<DocSlot> docs;             ///< by row, then by start
  std::vector<int32_t> row_doc_offsets;  ///< rows + 1: row r holds docs [o[r], o[r+1])
  /// Per row: token offsets of its documents, n_docs_in_row + 1 entries from 0 to the row's real
  /// token count (the `doc_offsets` of model/objective.hpp).
  std::vector<std::vector<int32_t>> doc_offsets;
  int64_t n_docs = 0;
  int64_t n_tokens = 0;      ///< non-padding tokens
  int64_t n_supervised = 0;  ///< tokens with mask 1
};

/// Position of a batcher in its stream of batches; saved in checkpoints.
struct DataCursor {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t batch = 0;     ///< the next batch to produce within `epoch`
  uint64_t dataset = 0;  ///< TokenDataset::fingerprint()
  std::string config;    ///< the packing options that shape the plan
  nlohmann::json to_json() const;
  /// Throws dflash::Error naming the missing/bad key.
  static DataCursor from_json(const nlohmann::json& j);
  bool operator==(const DataCursor&) const = default;
};

/// Padding figures of an epoch plan.
struct PackingStats {
  int64_t batches = 0;
  int64_t docs = 0;
  int64_t tokens = 0;                            ///< real tokens
  int64_t slots = 0;                             ///< rows * L summed over batches
  std::map<int64_t, int64_t> batches_per_shape;  ///< L -> count
  /// Padding share of all slots (0..1).
  double waste() const { return slots > 0 ? 1.0 - static_cast<double>(tokens) / slots : 0.0; }
};

/// Packs a TokenDataset into batches; see the file comment. Not thread-safe (one owner).
class Batcher {
 public:
  /// Throws dflash::Error when an option is invalid or a document is longer than the budget.
  Batcher(TokenDataset data, BatcherOptions opts);

  /// The row lengths, largest first.
  const std::vector<int64_t>& shapes() const { return shapes_; }
  const BatcherOptions& options() const { return opts_; }
  /// Number of batches in `epoch`.
  int64_t batches_in_epoch(int64_t epoch);
  /// Padding figures of `epoch`'s plan.
  PackingStats epoch_stats(int64_t epoch);
  /// The next batch (moving to the next epoch after the last batch of one).
  Batch next();
  /// The batch `index` of `epoch`, without moving the cursor.
  Batch batch_at(int64_t epoch, int64_t index);
  /// The current position.
  DataCursor cursor() const;
  /// Continues from `c`; throws dflash::Error when the cursor belongs to another dataset, seed or
  /// packing configuration, or points past its epoch.
  void restore(const DataCursor& c);

 private:
  struct Row {
    std::vector<int64_t> docs;
    int64_t used = 0;    // tokens
    int64_t blocks = 0;  // training blocks (Σ doc_blocks)
  };
  struct PlannedBatch {
    int64_t length = 0;
    std::vector<Row> rows;
  };
  void plan_epoch(int64_t epoch);
  std::string config_string() const;
  // True when the block budget can bind (0 < budget < token budget).
  bool block_budget_binds() const;

  TokenDataset data_;
  BatcherOptions opts_;
  std::vector<int64_t> shapes_;
  int64_t epoch_ = 0, batch_ = 0;
  int64_t planned_epoch_ = -1;
  std::vector<PlannedBatch> plan_;
};

/// Deterministic pseudo-random permutation of 0..n-1 for (seed, stream): Fisher-Yates driven by
/// Rng(derive_seed(seed, {tag, stream})).below(). Same result on every platform.
std::vector<int64_t> deterministic_permutation(int64_t n, uint64_t seed, uint64_t stream);

}  // namespace dflash
