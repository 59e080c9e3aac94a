// dflash.cpp — DrafterBatch (see drafter_batch.hpp).
#include "model/drafter_batch.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "data/batcher.hpp"
#include "data/dataset.hpp"

namespace dflash {

namespace {

// Checks anchors (row-local) against their documents; `what` names the row in messages.
void check_anchors(std::span<const Anchor> anchors, std::span<const int32_t> doc_offsets,
                   const std::string& what) {
  for (size_t i = 0; i < anchors.size(); ++i) {
    const Anchor& a = anchors[i];
    DFLASH_CHECK(a.doc >= 0 && static_cast<size_t>(a.doc) + 1 < doc_offsets.size(),
                 "{}: anchor {} names document {} of {}", what, i, a.doc, doc_offsets.size() - 1);
    const int32_t s = doc_offsets[static_cast<size_t>(a.doc)];
    const int32_t e = doc_offsets[static_cast<size_t>(a.doc) + 1];
    DFLASH_CHECK(a.pos >= s && a.pos < e, "{}: anchor {} at {} is outside its document [{}, {})",
                 what, i, a.pos, s, e);
  }
}

void check_targets(const BlockTargets& t, int K, size_t n_anchors, const std::string& what) {
  const size_t n = n_anchors * static_cast<size_t>(K);
  DFLASH_CHECK(t.K == K && t.labels.size() == n && t.weights.size() == n && t.counted.size() == n,
               "{}: targets of block size {} with {} labels, {} weights, {} flags for {} anchors "
               "of block size {}",
               what, t.K, t.labels.size(), t.weights.size(), t.counted.size(), n_anchors, K);
}

}  // namespace

void DrafterBatch::append_row(std::span<const int32_t> row_tokens,
                              std::span<const int32_t> row_offsets,
                              std::span<const Anchor> row_anchors,
                              const BlockTargets& row_targets) {
  const std::string what = fmt::format("drafter batch row {}", rows);
  DFLASH_CHECK(block_size >= 2, "{}: block size {} (must be at least 2)", what, block_size);
  const auto n = static_cast<int64_t>(row_tokens.size());
  check_doc_offsets(row_offsets, n);
  DFLASH_CHECK(row_offsets.back() == n,
               "{}: its documents end at {} but it has {} tokens (a DrafterBatch holds no padding)",
               what, row_offsets.back(), n);
  check_anchors(row_anchors, row_offsets, what);
  check_targets(row_targets, block_size, row_anchors.size(), what);
  if (targets.labels.empty()) targets.first_slot = row_targets.first_slot;
  DFLASH_CHECK(row_targets.first_slot == targets.first_slot,
               "{}: targets whose first supervised slot is {} appended to a batch whose is {} "
               "(dflash and dspark targets mixed)",
               what, row_targets.first_slot, targets.first_slot);
  const auto t0 = static_cast<int32_t>(T());
  const auto d0 = static_cast<int32_t>(n_docs());
  tokens.insert(tokens.end(), row_tokens.begin(), row_tokens.end());
  for (size_t d = 1; d < row_offsets.size(); ++d) doc_offsets.push_back(t0 + row_offsets[d]);
  for (const Anchor& a : row_anchors) anchors.push_back({t0 + a.pos, d0 + a.doc});
  targets.labels.insert(targets.labels.end(), row_targets.labels.begin(), row_targets.labels.end());
  targets.weights.insert(targets.weights.end(), row_targets.weights.begin(),
                         row_targets.weights.end());
  targets.counted.insert(targets.counted.end(), row_targets.counted.begin(),
                         row_targets.counted.end());
  for (float w : row_targets.weights) weight_sum += w;
  rows += 1;
  row_length = std::max(row_length, n);
}

void DrafterBatch::validate() const {
  DFLASH_CHECK(block_size >= 2, "drafter batch: block size {} (must be at least 2)", block_size);
  check_doc_offsets(doc_offsets, T());
  DFLASH_CHECK(doc_offsets.back() == T(),
               "drafter batch: documents end at {} but the context has {} tokens",
               doc_offsets.back(), T());
  DFLASH_CHECK(T() <= rows * row_length, "drafter batch: {} context tokens exceed {} rows of {}",
               T(), rows, row_length);
  check_anchors(anchors, doc_offsets, "drafter batch");
  check_targets(targets, block_size, anchors.size(), "drafter batch");
  DFLASH_CHECK(targets.first_slot == objective.first_slot(),
               "drafter batch: the targets' first supervised slot is {}, the {} objective's is {}",
               targets.first_slot, objective_kind_name(objective.kind), objective.first_slot());
}

double DrafterBatch::loss_denominator() const {
  return objective.dpace() ? static_cast<double>(n_docs()) : weight_sum;
}

double DrafterBatch::loss_normaliser() const {
  if (objective.dpace()) return static_cast<double>(step_documents.value_or(n_docs()));
  return step_weight_sum.value_or(weight_sum);
}

uint64_t DrafterBatch::fingerprint() const {
  auto bytes = [](const auto& v) {
    return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v.front()));
  };
  uint64_t h = hash_bytes(bytes(tokens));
  h = hash_bytes(bytes(doc_offsets), h);
  h = hash_bytes(bytes(anchors), h);
  h = hash_bytes(bytes(targets.labels), h);
  return hash_bytes(bytes(targets.weights), h);
}

DrafterBatch drafter_batch_from_rows(const Batch& b, int64_t row_begin, int64_t row_end,
                                     const DrafterBatchOptions& o) {
  const int64_t R = b.tokens.dim(0), L = b.row_length;
  DFLASH_CHECK(static_cast<int64_t>(b.doc_offsets.size()) == R,
               "batch {} of epoch {}: {} rows but document offsets for {}", b.index, b.epoch, R,
               b.doc_offsets.size());
  DFLASH_CHECK(0 <= row_begin && row_begin < row_end && row_end <= R,
               "batch {} of epoch {}: rows [{}, {}) of {}", b.index, b.epoch, row_begin, row_end,
               R);
  DrafterBatch out(o.block_size);
  out.objective = o.objective;
  out.targets.first_slot = o.objective.first_slot();
  int64_t supervised = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const std::vector<int32_t>& offsets = b.doc_offsets[static_cast<size_t>(r)];
    DFLASH_CHECK(!offsets.empty(), "batch {} of epoch {}: row {} has no document offsets", b.index,
                 b.epoch, r);
    const auto real = static_cast<size_t>(offsets.back());
    std::span<const int32_t> toks(b.tokens.data<int32_t>() + r * L, real);
    std::span<const uint8_t> mask(b.loss_mask.data<uint8_t>() + r * L, real);
    for (const uint8_t m : mask) supervised += m;
    Rng rng(derive_seed(o.seed, {static_cast<uint64_t>(b.epoch), static_cast<uint64_t>(b.index),
                                 static_cast<uint64_t>(r)}));
    const std::vector<Anchor> anchors = sample_anchors(mask, offsets, o.num_anchors, rng);
    out.append_row(toks, offsets, anchors, drafter_row_targets(o, toks, mask, offsets, anchors));
  }
  out.row_length = L;
  out.epoch = b.epoch;
  out.index = b.index;
  out.n_supervised = supervised;
  return out;
}

BlockTargets drafter_row_targets(const DrafterBatchOptions& opts, std::span<const int32_t> tokens,
                                 std::span<const uint8_t> loss_mask,
                                 std::span<const int32_t> doc_offsets,
                                 std::span<const Anchor> anchors) {
  if (opts.objective.dspark()) {
    return dspark_block_targets(tokens, loss_mask, doc_offsets, anchors, opts.block_size,
                                opts.gamma);
  }
  if (opts.objective.domino()) {
    return domino_block_targets(tokens, loss_mask, doc_offsets, anchors, opts.block_size,
                                opts.gamma, opts.objective.domino_shift_label);
  }
  // D-PACE ignores γ: every supervised slot gets the static weight 1 (its mask m_k).
  const double gamma = opts.objective.dpace() ? 0.0 : opts.gamma;
  return block_targets(tokens, loss_mask, doc_offsets, anchors, opts.block_size, gamma);
}

DrafterBatch drafter_batch_from_batch(const Batch& b, const DrafterBatchOptions& o) {
  return drafter_batch_from_rows(b, 0, b.tokens.dim(0), o);
}

void drafter_batch_context_positions(const DrafterBatch& b, std::span<int32_t> positions) {
  DFLASH_CHECK(static_cast<int64_t>(positions.size()) == b.T(),
               "drafter_batch_context_positions: {} slots for {} tokens", positions.size(), b.T());
  for (int64_t d = 0; d < b.n_docs(); ++d) {
    const int32_t s = b.doc_offsets[static_cast<size_t>(d)];
    const int32_t e = b.doc_offsets[static_cast<size_t>(d) + 1];
    for (int32_t p = s; p < e; ++p) positions[static_cast<size_t>(p)] = p - s;
  }
}

void drafter_batch_block_rows(const DrafterBatch& b, int32_t mask_token_id, int64_t block_key_start,
                              std::span<int32_t> tokens, std::span<int32_t> positions,
                              std::span<AttnRange> ranges) {
  const int64_t K = b.block_size, NK = b.N() * K;
  DFLASH_CHECK(static_cast<int64_t>(tokens.size()) == NK &&
                   static_cast<int64_t>(positions.size()) == NK &&
                   static_cast<int64_t>(ranges.size()) == NK,
               "drafter_batch_block_rows: {}/{}/{} slots for {} block rows", tokens.size(),
               positions.size(), ranges.size(), NK);
  DFLASH_CHECK(block_key_start >= b.T(),
               "drafter_batch_block_rows: block keys start at {}, inside the {} context rows",
               block_key_start, b.T());
  for (int64_t i = 0; i < b.N(); ++i) {
    const Anchor& a = b.anchors[static_cast<size_t>(i)];
    const int32_t s = b.doc_offsets[static_cast<size_t>(a.doc)];
    const auto own = static_cast<int32_t>(block_key_start + i * K);
    for (int64_t j = 0; j < K; ++j) {
      const auto q = static_cast<size_t>(i * K + j);
      tokens[q] = j == 0 ? b.tokens[static_cast<size_t>(a.pos)] : mask_token_id;
      positions[q] = a.pos - s + static_cast<int32_t>(j);
      ranges[q] = AttnRange{s, a.pos, own, own + static_cast<int32_t>(K)};
    }
  }
}

int64_t drafter_batch_stage_context(const DrafterBatch& b, int32_t pad_id,
                                    std::span<int32_t> tokens, std::span<int32_t> positions,
                                    std::span<AttnRange> ranges) {
  const int64_t T = b.T();
  const auto T_pad = static_cast<int64_t>(tokens.size());
  DFLASH_CHECK(T_pad >= T && positions.size() == tokens.size() && ranges.size() == tokens.size(),
               "drafter_batch_stage_context: a context of {} tokens into arrays of {}, {} and {}",
               T, tokens.size(), positions.size(), ranges.size());
  // Real tokens, then the padding documents.
  std::copy(b.tokens.begin(), b.tokens.end(), tokens.begin());
  drafter_batch_context_positions(b, positions.first(static_cast<size_t>(T)));
  // A batch without documents (a replica's empty share of an epoch's last batch) is all padding.
  if (b.n_docs() > 0) {
    attention_causal_varlen_ranges(ranges.data(), b.doc_offsets.data(), b.n_docs(), T);
  }
  // Padding documents of at most one row (row_length tokens; all of the padding when the batch
  // has no row length): a document never outgrows the rows the real ones come from.
  const int64_t longest = b.row_length > 0 ? b.row_length : T_pad - T;
  int64_t docs = b.n_docs();
  for (int64_t start = T; start < T_pad; start += longest, ++docs) {
    const int64_t end = std::min(start + longest, T_pad);
    for (int64_t t = start; t < end; ++t) {
      const auto i = static_cast<size_t>(t);
      tokens[i] = pad_id;
      positions[i] = static_cast<int32_t>(t - start);
      ranges[i] = AttnRange{static_cast<int32_t>(start), static_cast<int32_t>(t + 1), 0, 0};
    }
  }
  return docs;
}

int64_t drafter_batch_stage(const DrafterBatch& b, int32_t mask_token_id, int32_t pad_id,
                            const DrafterStaging& out) {
  b.validate();
  const int64_t T = b.T(), K = b.block_size, NK = b.N() * K;
  const auto T_pad = static_cast<int64_t>(out.tokens.size());
  const auto NK_pad = static_cast<int64_t>(out.block_tokens.size());
  DFLASH_CHECK(T_pad >= T && NK_pad >= NK && NK_pad % K == 0,
               "drafter_batch_stage: a step of {} context and {} block rows does not fit a shape "
               "of {} and {} (a multiple of {})",
               T, NK, T_pad, NK_pad, K);
  DFLASH_CHECK(static_cast<int64_t>(out.context_ranges.size()) == T_pad &&
                   static_cast<int64_t>(out.positions.size()) == T_pad + NK_pad &&
                   static_cast<int64_t>(out.block_ranges.size()) == NK_pad &&
                   static_cast<int64_t>(out.labels.size()) == NK_pad &&
                   static_cast<int64_t>(out.weights.size()) == NK_pad,
               "drafter_batch_stage: staging arrays disagree with {} context and {} block rows",
               T_pad, NK_pad);
  const int64_t docs = drafter_batch_stage_context(
      b, pad_id, out.tokens, out.positions.first(static_cast<size_t>(T_pad)), out.context_ranges);
  // Blocks: real ones, then inert ones.
  auto block_pos = out.positions.subspan(static_cast<size_t>(T_pad));
  drafter_batch_block_rows(b, mask_token_id, T_pad, out.block_tokens.first(static_cast<size_t>(NK)),
                           block_pos.first(static_cast<size_t>(NK)),
                           out.block_ranges.first(static_cast<size_t>(NK)));
  for (int64_t q = 0; q < NK; ++q) {
    const float w = b.targets.weights[static_cast<size_t>(q)];
    out.weights[static_cast<size_t>(q)] = w;
    out.labels[static_cast<size_t>(q)] = w != 0.0f ? b.targets.labels[static_cast<size_t>(q)] : 0;
  }
  for (int64_t q = NK; q < NK_pad; ++q) {
    const auto own = static_cast<int32_t>(T_pad + q / K * K);
    out.block_tokens[static_cast<size_t>(q)] = mask_token_id;
    block_pos[static_cast<size_t>(q)] = static_cast<int32_t>(q % K);
    out.block_ranges[static_cast<size_t>(q)] = AttnRange{0, 0, own, own + static_cast<int32_t>(K)};
    out.labels[static_cast<size_t>(q)] = 0;
    out.weights[static_cast<size_t>(q)] = 0.0f;
  }
  return docs;
}

}  // namespace dflash
