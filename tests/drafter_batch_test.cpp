// DrafterBatch (src/model/drafter_batch.hpp), the input of one training step:
// - drafter_batch_from_batch packs a Batch's rows back to back with per-row anchors (the row's
//   seeded Rng) and targets, and is a pure function of the Batch and the options;
// - append_row refuses malformed rows, naming the row;
// - drafter_batch_stage restates the training layout of DESIGN.md §1 in a device's fixed shape
//   (document-relative positions, causal context ranges, block rows with the anchor's token, MASK
//   slots, positions anchor−doc_start+j, keys [doc_start, anchor) ∪ own block, labels/weights) and
//   its padding is inert;
// - the CPU drafter over a packed multi-row batch equals the sum of the rows one by one (loss,
//   every gradient, argmax): what lets both backends run a whole step as one sequence.
#include "model/drafter_batch.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "data/batcher.hpp"
#include "model/drafter.hpp"
#include "model/objective.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

struct Rows {
  std::vector<std::vector<int32_t>> tokens, offsets;
  std::vector<std::vector<uint8_t>> mask;
  std::vector<std::vector<Anchor>> anchors;
  std::vector<BlockTargets> targets;
  // Rows [first, last) as one DrafterBatch.
  DrafterBatch batch(int K, size_t first = 0, size_t last = SIZE_MAX) const {
    DrafterBatch b(K);
    for (size_t r = first; r < std::min(last, tokens.size()); ++r) {
      b.append_row(tokens[r], offsets[r], anchors[r], targets[r]);
    }
    return b;
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

TokenDataset make_dataset(const std::vector<int64_t>& lengths) {
  std::vector<TokenizedDoc> docs;
  for (size_t d = 0; d < lengths.size(); ++d) {
    TokenizedDoc t;
    for (int64_t j = 0; j < lengths[d]; ++j) {
      t.tokens.push_back(static_cast<int32_t>(d * 100 + static_cast<size_t>(j)));
      t.loss_mask.push_back(static_cast<uint8_t>((j + static_cast<int64_t>(d)) % 4 != 0));
    }
    docs.push_back(std::move(t));
  }
  return TokenDataset::from_docs(docs);
}

}  // namespace

TEST(DrafterBatch, FromBatchPacksRowsWithPerRowAnchors) {
  BatcherOptions bo;
  bo.token_budget = 64;
  bo.rows = 3;
  bo.num_shapes = 1;
  bo.seed = 5;
  Batcher batcher(make_dataset({30, 17, 9, 40, 22, 5, 33, 12, 8, 27}), bo);
  const Batch src = batcher.batch_at(0, 0);
  DrafterBatchOptions o;
  o.block_size = 4;
  o.num_anchors = 3;
  o.gamma = 7.0;
  o.seed = 11;
  const DrafterBatch b = drafter_batch_from_batch(src, o);
  EXPECT_EQ(b.rows, 3);
  EXPECT_EQ(b.row_length, src.row_length);
  EXPECT_EQ(b.epoch, 0);
  EXPECT_EQ(b.index, 0);
  EXPECT_EQ(b.T(), src.n_tokens);
  EXPECT_EQ(b.n_supervised, src.n_supervised);
  b.validate();
  // Row by row: tokens back to back, documents shifted, anchors of the row's Rng, targets.
  int64_t t0 = 0, d0 = 0, a0 = 0;
  double w = 0;
  for (int64_t r = 0; r < 3; ++r) {
    const auto& off = src.doc_offsets[static_cast<size_t>(r)];
    const int64_t real = off.back();
    const int32_t* toks = src.tokens.data<int32_t>() + r * src.row_length;
    const uint8_t* mask = src.loss_mask.data<uint8_t>() + r * src.row_length;
    for (int64_t p = 0; p < real; ++p) EXPECT_EQ(b.tokens[static_cast<size_t>(t0 + p)], toks[p]);
    for (size_t d = 0; d < off.size(); ++d) {
      EXPECT_EQ(b.doc_offsets[static_cast<size_t>(d0) + d], t0 + off[d]);
    }
    Rng rng(derive_seed(11, {0, 0, static_cast<uint64_t>(r)}));
    std::span<const uint8_t> m(mask, static_cast<size_t>(real));
    const auto anchors = sample_anchors(m, off, 3, rng);
    const auto targets = block_targets(std::span<const int32_t>(toks, static_cast<size_t>(real)), m,
                                       off, anchors, 4, 7.0);
    for (size_t i = 0; i < anchors.size(); ++i) {
      const Anchor& a = b.anchors[static_cast<size_t>(a0) + i];
      EXPECT_EQ(a.pos, t0 + anchors[i].pos);
      EXPECT_EQ(a.doc, d0 + anchors[i].doc);
    }
    for (size_t q = 0; q < targets.labels.size(); ++q) {
      EXPECT_EQ(b.targets.labels[static_cast<size_t>(a0 * 4) + q], targets.labels[q]);
      EXPECT_EQ(b.targets.weights[static_cast<size_t>(a0 * 4) + q], targets.weights[q]);
      w += targets.weights[q];
    }
    t0 += real;
    d0 += static_cast<int64_t>(off.size()) - 1;
    a0 += static_cast<int64_t>(anchors.size());
  }
  EXPECT_EQ(b.N(), a0);
  EXPECT_EQ(b.n_docs(), d0);
  EXPECT_EQ(b.weight_sum, w);
  // A pure function of the Batch and the options; another seed draws other anchors.
  const DrafterBatch again = drafter_batch_from_batch(batcher.batch_at(0, 0), o);
  EXPECT_EQ(again.anchors, b.anchors);
  o.seed = 12;
  EXPECT_NE(drafter_batch_from_batch(src, o).anchors, b.anchors);
}

// A replica's share of a global batch: its rows with their anchors of the whole batch (the Rng of
// the row's place in the batch); the shares together are the whole batch. A share that is only an
// empty row (an epoch's last batch) has no documents and stages as padding.
TEST(DrafterBatch, SharesOfABatchHoldTheWholeBatchsRowsAndAnEmptyShareStagesAsPadding) {
  BatcherOptions bo;
  bo.token_budget = 64;
  bo.rows = 3;
  bo.num_shapes = 1;
  bo.seed = 5;
  // 4 documents of 40+ tokens: 4 rows, so the epoch's second batch has one real row of 3.
  Batcher batcher(make_dataset({41, 45, 50, 43}), bo);
  DrafterBatchOptions o;
  o.block_size = 4;
  o.num_anchors = 3;
  o.seed = 11;
  ASSERT_EQ(batcher.batches_in_epoch(0), 2);
  for (int64_t index = 0; index < 2; ++index) {
    const Batch src = batcher.batch_at(0, index);
    const DrafterBatch whole = drafter_batch_from_batch(src, o);
    std::vector<Anchor> anchors;
    int64_t tokens = 0, supervised = 0;
    for (int64_t r = 0; r < 3; ++r) {
      const DrafterBatch share = drafter_batch_from_rows(src, r, r + 1, o);
      share.validate();
      EXPECT_EQ(share.rows, 1);
      for (const Anchor& a : share.anchors) {
        anchors.push_back(Anchor{a.pos + static_cast<int32_t>(tokens), a.doc});
      }
      tokens += share.T();
      supervised += share.n_supervised;
      if (share.T() == 0) {
        EXPECT_EQ(share.n_docs(), 0);
        EXPECT_EQ(share.N(), 0);
        // One padding document (8 rows, within the share's row length of 64).
        ASSERT_GE(share.row_length, 8);
        std::vector<int32_t> tok(8), pos(8);
        std::vector<AttnRange> ranges(8);
        EXPECT_EQ(drafter_batch_stage_context(share, 0, tok, pos, ranges), 1);
        for (int32_t t = 0; t < 8; ++t) {
          EXPECT_EQ(ranges[static_cast<size_t>(t)].lo1, 0);
          EXPECT_EQ(ranges[static_cast<size_t>(t)].hi1, t + 1);
          EXPECT_EQ(pos[static_cast<size_t>(t)], t);
        }
      }
    }
    EXPECT_EQ(tokens, whole.T());
    EXPECT_EQ(supervised, whole.n_supervised);
    ASSERT_EQ(anchors.size(), whole.anchors.size());
    for (size_t i = 0; i < anchors.size(); ++i) EXPECT_EQ(anchors[i].pos, whole.anchors[i].pos);
  }
  const Batch src = batcher.batch_at(0, 0);
  for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 0}, {2, 4}, {-1, 1}}) {
    EXPECT_THROW(drafter_batch_from_rows(src, b, e, o), Error) << b << ", " << e;
  }
}

TEST(DrafterBatch, AppendRowRefusesMalformedRowsNamingThem) {
  Rows rows = make_rows({{12, 9}, {30}}, 4, 50, 2);
  DrafterBatch b(4);
  b.append_row(rows.tokens[0], rows.offsets[0], rows.anchors[0], rows.targets[0]);
  auto expect_error = [&](auto&& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("drafter batch row 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const std::vector<int32_t> short_offsets = {0, 20};  // tokens past the last document
  expect_error(
      [&] {
        b.append_row(rows.tokens[1], short_offsets, {}, BlockTargets{4, {}, {}, {}});
      },
      "holds no padding");
  std::vector<Anchor> outside = {{30, 0}};
  expect_error([&] { b.append_row(rows.tokens[1], rows.offsets[1], outside, rows.targets[1]); },
               "outside its document");
  BlockTargets wrong = rows.targets[1];
  wrong.labels.pop_back();
  expect_error([&] { b.append_row(rows.tokens[1], rows.offsets[1], rows.anchors[1], wrong); },
               "labels");
  EXPECT_EQ(b.rows, 1);  // nothing half-appended
  EXPECT_EQ(b.T(), 21);
}

TEST(DrafterBatch, StageLayoutFollowsTheTrainingRules) {
  const int K = 4, MASK = 99;
  Rows rows = make_rows({{3, 20, 9}, {40}, {}}, K, 50, 1);
  const DrafterBatch b = rows.batch(K);
  const int64_t T_pad = 3 * 40, NK_pad = 6 * K * ((b.N() * K + 6 * K - 1) / (6 * K));
  std::vector<int32_t> tokens(T_pad), pos(T_pad + NK_pad), btok(NK_pad), labels(NK_pad);
  std::vector<AttnRange> cr(T_pad), br(NK_pad);
  std::vector<float> weights(NK_pad);
  const int64_t docs =
      drafter_batch_stage(b, MASK, 7, {tokens, cr, pos, btok, br, labels, weights});
  ASSERT_EQ(b.T(), 32 + 40);
  EXPECT_EQ(docs, b.n_docs() + 2);  // the real documents and two padding ones
  // Context rows: document-relative positions, causal ranges inside the document; padding tokens
  // after the real ones, in documents of one row (40) each: [72, 112) and [112, 120).
  ASSERT_EQ(b.row_length, 40);
  std::vector<int32_t> tokens2(T_pad), pos2(T_pad);
  std::vector<AttnRange> cr2(T_pad);
  EXPECT_EQ(drafter_batch_stage_context(b, 7, tokens2, pos2, cr2), b.n_docs() + 2);
  for (int64_t t = 0; t < T_pad; ++t) {
    const auto g = static_cast<size_t>(t);
    if (t < b.T()) {
      int64_t d = 0;
      while (b.doc_offsets[static_cast<size_t>(d) + 1] <= t) ++d;
      const int32_t s = b.doc_offsets[static_cast<size_t>(d)];
      EXPECT_EQ(tokens[g], b.tokens[g]);
      EXPECT_EQ(pos[g], t - s);
      EXPECT_EQ(cr[g].lo1, s);
      EXPECT_EQ(cr[g].hi1, t + 1);
    } else {
      const int64_t s = t < 112 ? 72 : 112;
      EXPECT_EQ(tokens[g], 7);
      EXPECT_EQ(pos[g], t - s);
      EXPECT_EQ(cr[g].lo1, s);
      EXPECT_EQ(cr[g].hi1, t + 1);
    }
    EXPECT_EQ(cr[g].lo2, cr[g].hi2);
    EXPECT_EQ(tokens2[g], tokens[g]);  // the context part alone stages the same rows
    EXPECT_EQ(pos2[g], pos[g]);
    EXPECT_EQ(cr2[g].lo1, cr[g].lo1);
    EXPECT_EQ(cr2[g].hi1, cr[g].hi1);
  }
  // Block rows of the real blocks.
  const auto T32 = static_cast<int32_t>(T_pad);
  for (int64_t i = 0; i < b.N(); ++i) {
    const Anchor& a = b.anchors[static_cast<size_t>(i)];
    const int32_t ds = b.doc_offsets[static_cast<size_t>(a.doc)];
    for (int j = 0; j < K; ++j) {
      const auto q = static_cast<size_t>(i * K + j);
      EXPECT_EQ(pos[static_cast<size_t>(T_pad) + q], a.pos - ds + j);
      EXPECT_EQ(btok[q], j == 0 ? b.tokens[static_cast<size_t>(a.pos)] : MASK);
      EXPECT_EQ(br[q].lo1, ds);
      EXPECT_EQ(br[q].hi1, a.pos);
      EXPECT_EQ(br[q].lo2, T32 + i * K);
      EXPECT_EQ(br[q].hi2, T32 + (i + 1) * K);
      EXPECT_EQ(weights[q], b.targets.weights[q]);
      if (weights[q] != 0.0f) {
        EXPECT_EQ(labels[q], b.targets.labels[q]);
      } else {
        EXPECT_EQ(labels[q], 0);
      }
    }
  }
  // Padding blocks: MASK tokens, only themselves visible, weight 0.
  ASSERT_GT(NK_pad, b.N() * K);
  for (int64_t q = b.N() * K; q < NK_pad; ++q) {
    const auto u = static_cast<size_t>(q);
    EXPECT_EQ(btok[u], MASK);
    EXPECT_EQ(weights[u], 0.0f);
    EXPECT_EQ(labels[u], 0);
    EXPECT_EQ(pos[static_cast<size_t>(T_pad) + u], q % K);
    EXPECT_EQ(br[u].lo1, br[u].hi1);
    EXPECT_EQ(br[u].lo2, T32 + q / K * K);
    EXPECT_EQ(br[u].hi2, T32 + q / K * K + K);
  }
}

TEST(DrafterBatch, StageRefusesShapesThatDoNotFit) {
  const int K = 4;
  Rows rows = make_rows({{30}}, K, 50, 2);
  const DrafterBatch b = rows.batch(K);
  auto stage = [&](int64_t T_pad, int64_t NK_pad) {
    std::vector<int32_t> tokens(T_pad), pos(T_pad + NK_pad), btok(NK_pad), labels(NK_pad);
    std::vector<AttnRange> cr(T_pad), br(NK_pad);
    std::vector<float> weights(NK_pad);
    drafter_batch_stage(b, 9, 0, {tokens, cr, pos, btok, br, labels, weights});
  };
  const int64_t NK = b.N() * K;
  EXPECT_NO_THROW(stage(30, NK));
  EXPECT_THROW(stage(29, NK), Error);      // context does not fit
  EXPECT_THROW(stage(30, NK - K), Error);  // blocks do not fit
  EXPECT_THROW(stage(30, NK + 2), Error);  // not a multiple of K
}

TEST(DrafterBatch, PackedRowsEqualTheSumOfRowsOnCpu) {
  // The CPU drafter over the packed batch (all rows as one sequence of documents) gives the loss,
  // the gradients and the argmax of the rows one by one.
  DrafterConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
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
  std::vector<float> embed(50 * 16);
  for (float& x : embed) x = static_cast<float>(rng.normal());
  DrafterTables<float> tables{embed.data(), embed.data()};
  Rows rows = make_rows({{12, 9}, {30}, {7, 8, 6}}, 4, 48, 5);
  const DrafterBatch packed = rows.batch(4);
  std::vector<float> feats(static_cast<size_t>(packed.T() * 16));
  for (float& x : feats) x = static_cast<float>(rng.normal());
  const double scale = 1.0 / packed.weight_sum;
  DrafterWorkspace<float> ws;
  double loss = 0;
  std::vector<float> grads(params.size(), 0.0f);
  std::vector<int32_t> argmax;
  int64_t t0 = 0;
  for (size_t r = 0; r < rows.tokens.size(); ++r) {
    const DrafterBatch one = rows.batch(4, r, r + 1);
    const auto res = drafter_train_step<float>(c, layout, params.data(), grads.data(), tables, one,
                                               feats.data() + t0 * 16, scale, ws);
    loss += res.loss_sum;
    argmax.insert(argmax.end(), res.argmax.begin(), res.argmax.end());
    t0 += one.T();
  }
  std::vector<float> joint_grads(params.size(), 0.0f);
  const auto joint = drafter_train_step<float>(c, layout, params.data(), joint_grads.data(), tables,
                                               packed, feats.data(), scale, ws);
  EXPECT_NEAR(joint.loss_sum, loss, 1e-5 * std::abs(loss));
  EXPECT_LT(test::rel_error(joint_grads, grads), 1e-5);
  EXPECT_EQ(joint.argmax, argmax);
}
