// dflash.cpp — one training step flattened for a device backend: every row of a batch becomes one
// packed sequence of T = rows·row_length context tokens (padding included, each padding token its
// own one-token "document") followed by NK block rows (N blocks of K slots, padded with inert
// blocks to a multiple of `block_rows_multiple` so that shapes repeat between steps).
//
// Invariants (DESIGN.md §1, training layout): positions restart at 0 per document; block b of
// anchor a in document [s, e) (global indices) has queries at positions a−s..a−s+K−1, token
// [x[a], MASK×(K−1)], and sees context keys [s, a) and its own K keys (key rows T+bK..T+bK+K−1);
// labels/weights are those of BlockTargets (invalid labels become 0 with weight 0). Padding blocks
// hold MASK tokens, see only themselves and have weight 0, so they change no loss and no gradient.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ops/attention.hpp"
#include "train/objective.hpp"

namespace dflash {

/// One row of a batch as the trainer prepared it (host arrays).
struct PackedRowInput {
  std::span<const int32_t> tokens;       ///< the row's real tokens [real]
  std::span<const int32_t> doc_offsets;  ///< [n_docs+1], last = real
  std::span<const Anchor> anchors;       ///< sampled anchors (row positions)
  const BlockTargets* targets = nullptr; ///< labels/weights of the anchors' blocks
};

/// The flattened step (host arrays, ready to upload).
struct PackedStep {
  int64_t T = 0;                        ///< context rows = rows·row_length
  int64_t N = 0;                        ///< real blocks
  int64_t NK = 0;                       ///< block rows, padded (≥ N·K)
  std::vector<int32_t> tokens;          ///< [T] target input ids (padding: pad_id)
  std::vector<AttnRange> target_ranges; ///< [T] causal key ranges of the target forward
  std::vector<int32_t> pos;             ///< [T + NK] context positions, then block positions
  std::vector<int32_t> block_tokens;    ///< [NK]
  std::vector<AttnRange> block_ranges;  ///< [NK] drafter query ranges (keys: [ctx T ; blocks])
  std::vector<int32_t> labels;          ///< [NK] (0 where the weight is 0)
  std::vector<float> weights;           ///< [NK]
  std::vector<int64_t> row_block_start; ///< [rows+1] first block of each row
};

/// Builds the packed step of `rows` (each at most `row_length` real tokens) for block size `K`.
/// `block_rows_multiple` (≥ K, a multiple of K) pads NK; `pad_id` fills padding tokens. Throws
/// dflash::Error when a row is longer than row_length or its targets do not match its anchors.
PackedStep pack_step(std::span<const PackedRowInput> rows, int64_t row_length, int K,
                     int32_t mask_token_id, int32_t pad_id, int64_t block_rows_multiple);

}  // namespace dflash
