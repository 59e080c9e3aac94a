#include "train/packed_step.hpp"

#include "core/error.hpp"

namespace dflash {

PackedStep pack_step(std::span<const PackedRowInput> rows, int64_t row_length, int K,
                     int32_t mask_token_id, int32_t pad_id, int64_t block_rows_multiple) {
  DFLASH_CHECK(K >= 2 && block_rows_multiple >= K && block_rows_multiple % K == 0,
               "pack_step: block_rows_multiple {} must be a positive multiple of the block size {}",
               block_rows_multiple, K);
  DFLASH_CHECK(row_length > 0 && !rows.empty(), "pack_step: no rows");
  PackedStep s;
  s.T = static_cast<int64_t>(rows.size()) * row_length;
  s.row_block_start.push_back(0);
  for (const auto& r : rows) {
    DFLASH_CHECK(r.targets && r.targets->K == K &&
                     r.targets->num_blocks() == static_cast<int64_t>(r.anchors.size()),
                 "pack_step: a row's targets do not match its {} anchors", r.anchors.size());
    s.N += static_cast<int64_t>(r.anchors.size());
    s.row_block_start.push_back(s.N);
  }
  const int64_t real_rows = s.N * K;
  s.NK = std::max<int64_t>(block_rows_multiple,
                           (real_rows + block_rows_multiple - 1) / block_rows_multiple *
                               block_rows_multiple);
  s.tokens.assign(static_cast<size_t>(s.T), pad_id);
  s.target_ranges.resize(static_cast<size_t>(s.T));
  s.pos.assign(static_cast<size_t>(s.T + s.NK), 0);
  s.block_tokens.assign(static_cast<size_t>(s.NK), mask_token_id);
  s.block_ranges.resize(static_cast<size_t>(s.NK));
  s.labels.assign(static_cast<size_t>(s.NK), 0);
  s.weights.assign(static_cast<size_t>(s.NK), 0.0f);
  // Padding tokens: each sees only itself.
  for (int64_t t = 0; t < s.T; ++t) {
    s.target_ranges[static_cast<size_t>(t)] =
        AttnRange{static_cast<int32_t>(t), static_cast<int32_t>(t + 1), 0, 0};
  }
  const auto T32 = static_cast<int32_t>(s.T);
  int64_t b = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const PackedRowInput& row = rows[r];
    const int64_t base = static_cast<int64_t>(r) * row_length;
    const int64_t real = static_cast<int64_t>(row.tokens.size());
    DFLASH_CHECK(real <= row_length, "pack_step: row {} has {} tokens, more than the row length {}",
                 r, real, row_length);
    check_doc_offsets(row.doc_offsets, real);
    for (size_t d = 0; d + 1 < row.doc_offsets.size(); ++d) {
      const int32_t ds = row.doc_offsets[d], de = row.doc_offsets[d + 1];
      for (int32_t p = ds; p < de; ++p) {
        const auto g = static_cast<size_t>(base + p);
        s.tokens[g] = row.tokens[static_cast<size_t>(p)];
        s.pos[g] = p - ds;
        s.target_ranges[g] = AttnRange{static_cast<int32_t>(base + ds),
                                       static_cast<int32_t>(base + p + 1), 0, 0};
      }
    }
    for (size_t i = 0; i < row.anchors.size(); ++i, ++b) {
      const Anchor& a = row.anchors[i];
      DFLASH_CHECK(a.doc >= 0 && static_cast<size_t>(a.doc) + 1 < row.doc_offsets.size(),
                   "pack_step: row {} anchor {} names document {}", r, i, a.doc);
      const int32_t ds = row.doc_offsets[static_cast<size_t>(a.doc)];
      const int32_t de = row.doc_offsets[static_cast<size_t>(a.doc) + 1];
      DFLASH_CHECK(a.pos >= ds && a.pos < de,
                   "pack_step: row {} anchor {} at {} is outside its document [{}, {})", r, i,
                   a.pos, ds, de);
      for (int j = 0; j < K; ++j) {
        const auto q = static_cast<size_t>(b * K + j);
        const size_t src = i * static_cast<size_t>(K) + static_cast<size_t>(j);
        s.pos[static_cast<size_t>(s.T) + q] = a.pos - ds + j;
        s.block_tokens[q] = j == 0 ? row.tokens[static_cast<size_t>(a.pos)] : mask_token_id;
        s.block_ranges[q] =
            AttnRange{static_cast<int32_t>(base + ds), static_cast<int32_t>(base + a.pos),
                      static_cast<int32_t>(T32 + b * K), static_cast<int32_t>(T32 + (b + 1) * K)};
        const float w = row.targets->weights[src];
        s.weights[q] = w;
        s.labels[q] = w != 0.0f ? row.targets->labels[src] : 0;
      }
    }
  }
  for (; b * K < s.NK; ++b) {
    for (int j = 0; j < K; ++j) {
      const auto q = static_cast<size_t>(b * K + j);
      s.pos[static_cast<size_t>(s.T) + q] = j;
      s.block_ranges[q] = AttnRange{0, 0, static_cast<int32_t>(T32 + b * K),
                                    static_cast<int32_t>(T32 + (b + 1) * K)};
    }
  }
  return s;
}

}  // namespace dflash
