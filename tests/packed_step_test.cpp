// pack_step (src/train/packed_step.hpp): the packed layout of a device step restates the training
// layout of DESIGN.md §1 — context tokens at row·L + p with document-relative positions and causal
// ranges, block rows with the anchor's token, MASK slots, positions anchor−doc_start+j, key ranges
// [doc_start, anchor) ∪ own block, the BlockTargets labels/weights — and padding blocks are inert.
// Also: the CPU drafter over the packed layout (all rows as one row of documents) equals the sum of
// the per-row results, which is what the device step relies on.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "model/drafter.hpp"
#include "train/objective.hpp"
#include "train/packed_step.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

struct Rows {
  std::vector<std::vector<int32_t>> tokens, offsets;
  std::vector<std::vector<uint8_t>> mask;
  std::vector<std::vector<Anchor>> anchors;
  std::vector<BlockTargets> targets;
  std::vector<PackedRowInput> inputs() const {
    std::vector<PackedRowInput> r(tokens.size());
    for (size_t i = 0; i < r.size(); ++i) {
      r[i].tokens = tokens[i];
      r[i].doc_offsets = offsets[i];
      r[i].anchors = anchors[i];
      r[i].targets = &targets[i];
    }
    return r;
  }
};

Rows make_rows(const std::vector<std::vector<int>>& docs, int K, int V, uint64_t seed) {
  Rows r;
  Rng rng(seed);
  for (const auto& lens : docs) {
    std::vector<int32_t> t, off{0};
    std::vector<uint8_t> m;
    for (int n : lens) {
      for (int i = 0; i < n; ++i) {
        t.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(V)));
        m.push_back(rng.next_u64() % 4 != 0 ? 1 : 0);
      }
      off.push_back(static_cast<int32_t>(t.size()));
    }
    r.anchors.push_back(sample_anchors(m, off, 5, rng));
    r.targets.push_back(block_targets(t, m, off, r.anchors.back(), K, 7.0));
    r.tokens.push_back(std::move(t));
    r.offsets.push_back(std::move(off));
    r.mask.push_back(std::move(m));
  }
  return r;
}

}  // namespace

TEST(PackStep, LayoutFollowsTheTrainingRules) {
  const int K = 4, MASK = 99;
  const int64_t L = 40;
  Rows rows = make_rows({{3, 20, 9}, {40}, {}}, K, 50, 1);
  const PackedStep s = pack_step(rows.inputs(), L, K, MASK, 7, 6 * K);
  ASSERT_EQ(s.T, 3 * L);
  int64_t n = 0;
  for (const auto& a : rows.anchors) n += static_cast<int64_t>(a.size());
  ASSERT_EQ(s.N, n);
  EXPECT_EQ(s.NK % (6 * K), 0);
  EXPECT_GE(s.NK, s.N * K);
  ASSERT_EQ(s.row_block_start, (std::vector<int64_t>{0, static_cast<int64_t>(rows.anchors[0].size()),
                                                     n, n}));
  const auto T32 = static_cast<int32_t>(s.T);
  int64_t b = 0;
  for (size_t r = 0; r < rows.tokens.size(); ++r) {
    const int32_t base = static_cast<int32_t>(r * L);
    const auto& off = rows.offsets[r];
    // Context rows.
    for (int32_t p = 0; p < L; ++p) {
      const size_t g = static_cast<size_t>(base + p);
      if (p < off.back()) {
        size_t d = 0;
        while (off[d + 1] <= p) ++d;
        EXPECT_EQ(s.tokens[g], rows.tokens[r][static_cast<size_t>(p)]);
        EXPECT_EQ(s.pos[g], p - off[d]);
        EXPECT_EQ(s.target_ranges[g].lo1, base + off[d]);
        EXPECT_EQ(s.target_ranges[g].hi1, base + p + 1);
      } else {  // padding: its own one-token document
        EXPECT_EQ(s.tokens[g], 7);
        EXPECT_EQ(s.target_ranges[g].lo1, base + p);
        EXPECT_EQ(s.target_ranges[g].hi1, base + p + 1);
      }
      EXPECT_EQ(s.target_ranges[g].lo2, s.target_ranges[g].hi2);
    }
    // Block rows.
    for (size_t i = 0; i < rows.anchors[r].size(); ++i, ++b) {
      const Anchor& a = rows.anchors[r][i];
      const int32_t ds = off[static_cast<size_t>(a.doc)];
      for (int j = 0; j < K; ++j) {
        const size_t q = static_cast<size_t>(b * K + j);
        EXPECT_EQ(s.pos[static_cast<size_t>(s.T) + q], a.pos - ds + j);
        EXPECT_EQ(s.block_tokens[q], j == 0 ? rows.tokens[r][static_cast<size_t>(a.pos)] : MASK);
        EXPECT_EQ(s.block_ranges[q].lo1, base + ds);
        EXPECT_EQ(s.block_ranges[q].hi1, base + a.pos);
        EXPECT_EQ(s.block_ranges[q].lo2, T32 + b * K);
        EXPECT_EQ(s.block_ranges[q].hi2, T32 + (b + 1) * K);
        const size_t src = i * K + static_cast<size_t>(j);
        EXPECT_EQ(s.weights[q], rows.targets[r].weights[src]);
        if (s.weights[q] != 0.0f) {
          EXPECT_EQ(s.labels[q], rows.targets[r].labels[src]);
        }
        EXPECT_GE(s.labels[q], 0);
      }
    }
  }
  // Padding blocks: MASK tokens, only themselves visible, weight 0.
  for (; b * K < s.NK; ++b) {
    for (int j = 0; j < K; ++j) {
      const size_t q = static_cast<size_t>(b * K + j);
      EXPECT_EQ(s.block_tokens[q], MASK);
      EXPECT_EQ(s.weights[q], 0.0f);
      EXPECT_EQ(s.block_ranges[q].lo1, s.block_ranges[q].hi1);
      EXPECT_EQ(s.block_ranges[q].lo2, T32 + b * K);
    }
  }
}

TEST(PackStep, RejectsBadInput) {
  Rows rows = make_rows({{30}}, 4, 50, 2);
  EXPECT_THROW(pack_step(rows.inputs(), 20, 4, 9, 0, 8), Error);  // row longer than L
  EXPECT_THROW(pack_step(rows.inputs(), 40, 4, 9, 0, 6), Error);  // multiple not of K
  rows.targets[0].labels.pop_back();
  EXPECT_THROW(pack_step(rows.inputs(), 40, 4, 9, 0, 8), Error);  // targets do not match
}

TEST(PackStep, PackedRowEqualsSumOfRowsOnCpu) {
  // The CPU drafter over the packed context (one row whose documents are every row's documents,
  // padding as one-token documents) gives the loss of the rows one by one.
  DrafterConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.vocab_size = 50;
  c.block_size = 4;
  c.mask_token_id = 49;
  c.target_layer_ids = {0};
  c.num_target_layers = 1;
  const DrafterLayout layout(c);
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, 3);
  Rng rng(4);
  std::vector<float> embed(50 * 16), feats(2 * 30 * 16);
  for (float& x : embed) x = static_cast<float>(rng.normal());
  for (float& x : feats) x = static_cast<float>(rng.normal());
  DrafterTables<float> tables{embed.data(), embed.data()};
  Rows rows = make_rows({{12, 9}, {30}}, 4, 48, 5);
  DrafterWorkspace<float> ws;
  double sep = 0;
  for (size_t r = 0; r < 2; ++r) {
    DrafterRow<float> row{feats.data() + r * 30 * 16, rows.tokens[r].data(),
                          static_cast<int64_t>(rows.tokens[r].size()), rows.offsets[r],
                          rows.anchors[r], &rows.targets[r]};
    sep += drafter_train_row<float>(c, layout, params.data(), nullptr, tables, row, 1.0, ws).loss_sum;
  }
  // Packed: row 0's 21 tokens, 9 padding documents, row 1's 30 tokens.
  std::vector<int32_t> tok(60, 0), off{0};
  for (size_t i = 0; i < 21; ++i) tok[i] = rows.tokens[0][i];
  for (size_t i = 0; i < 30; ++i) tok[30 + i] = rows.tokens[1][i];
  off = {0, 12, 21};
  for (int32_t p = 22; p <= 30; ++p) off.push_back(p);
  off.push_back(60);
  std::vector<Anchor> anchors;
  BlockTargets targets;
  targets.K = 4;
  for (size_t r = 0; r < 2; ++r) {
    for (const Anchor& a : rows.anchors[r]) {
      anchors.push_back(r == 0 ? a : Anchor{a.pos + 30, static_cast<int32_t>(off.size() - 2)});
    }
    const auto& t = rows.targets[r];
    targets.labels.insert(targets.labels.end(), t.labels.begin(), t.labels.end());
    targets.weights.insert(targets.weights.end(), t.weights.begin(), t.weights.end());
    targets.counted.insert(targets.counted.end(), t.counted.begin(), t.counted.end());
  }
  DrafterRow<float> packed{feats.data(), tok.data(), 60, off, anchors, &targets};
  const double joint =
      drafter_train_row<float>(c, layout, params.data(), nullptr, tables, packed, 1.0, ws).loss_sum;
  EXPECT_NEAR(joint, sep, 1e-4 * std::abs(sep));
}
