// Tests of src/model/objective (anchors, labels, weights, metrics), src/train/optimizer and
// src/core/rng: each rule of DESIGN.md §1 has a test that fails when the rule is broken.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "model/objective.hpp"
#include "ops/loss_weights.hpp"
#include "train/optimizer.hpp"

using namespace dflash;

TEST(Rng, DeterministicAndStateRestorable) {
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  EXPECT_NE(a.next_u64(), c.next_u64());
  auto st = a.state();
  uint64_t x = a.next_u64();
  a.set_state(st);
  EXPECT_EQ(a.next_u64(), x);
  // below(n) stays in range and hits every value.
  std::set<uint64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    uint64_t v = a.below(7);
    ASSERT_LT(v, 7u);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 7u);
  // normal(): mean ≈ 0, variance ≈ 1 over many draws.
  double s = 0, s2 = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    double z = a.normal();
    s += z;
    s2 += z * z;
  }
  EXPECT_NEAR(s / n, 0.0, 0.03);
  EXPECT_NEAR(s2 / n, 1.0, 0.04);
  EXPECT_NE(derive_seed(1, {0, 1}), derive_seed(1, {1, 0}));
}

TEST(Anchors, CandidatesNeedTwoSupervisedTokensInOneDocument) {
  // doc0 = [0,5), doc1 = [5,9); padding at 9..11.
  std::vector<uint8_t> mask = {0, 1, 1, 1, 1, /*doc1*/ 1, 1, 0, 1, /*pad*/ 1, 1, 1};
  std::vector<int32_t> off = {0, 5, 9};
  EXPECT_EQ(anchor_candidates(mask, 0, 5), (std::vector<int32_t>{1, 2, 3}));
  // Position 4 is the last of doc0: its successor (5) is in doc1, so it is no candidate.
  EXPECT_EQ(anchor_candidates(mask, 5, 9), (std::vector<int32_t>{5}));
  Rng rng(1);
  auto anchors = sample_anchors(mask, off, 512, rng);
  std::vector<Anchor> expect = {{1, 0}, {2, 0}, {3, 0}, {5, 1}};
  EXPECT_EQ(anchors, expect);  // padding (9..11) gets no anchors even though its mask is 1
}

TEST(Anchors, DocumentWith200SupervisedTokensGetsEveryCandidate) {
  std::vector<uint8_t> mask(260, 0);
  for (int i = 50; i < 250; ++i) mask[i] = 1;
  std::vector<int32_t> off = {0, 260};
  Rng rng(7);
  auto a = sample_anchors(mask, off, 512, rng);
  ASSERT_EQ(a.size(), 199u);  // 200 supervised tokens -> 199 adjacent pairs
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].pos, 50 + static_cast<int>(i));
}

TEST(Anchors, SampledPerDocumentSortedWithoutReplacementAndSeeded) {
  std::vector<uint8_t> mask(300, 1);
  std::vector<int32_t> off = {0, 100, 300};
  Rng r1(5), r2(5), r3(6);
  auto a = sample_anchors(mask, off, 10, r1);
  auto b = sample_anchors(mask, off, 10, r2);
  auto c = sample_anchors(mask, off, 10, r3);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  ASSERT_EQ(a.size(), 20u);  // at most num_anchors per document, not per row
  for (size_t i = 0; i < a.size(); ++i) {
    const int d = i < 10 ? 0 : 1;
    EXPECT_EQ(a[i].doc, d);
    EXPECT_GE(a[i].pos, off[d]);
    EXPECT_LT(a[i].pos + 1, off[d + 1]);
    if (i % 10) {
      EXPECT_LT(a[i - 1].pos, a[i].pos);  // sorted, distinct
    }
  }
  // A fresh draw (next epoch) differs.
  auto a2 = sample_anchors(mask, off, 10, r1);
  EXPECT_NE(a, a2);
}

TEST(Targets, SlotKPredictsTokenAtAnchorPlusKWithDecayedWeights) {
  std::vector<int32_t> tok = {10, 11, 12, 13, 14, 15, 16, 17};
  std::vector<uint8_t> mask = {0, 1, 1, 1, 0, 1, 1, 1};
  std::vector<int32_t> off = {0, 6, 8};
  std::vector<Anchor> anchors = {{2, 0}, {6, 1}};
  const int K = 4;
  auto t = block_targets(tok, mask, off, anchors, K, 7.0);
  // Block 0 at anchor 2: slots 0..3 -> positions 2,3,4,5.
  EXPECT_EQ(std::vector<int32_t>(t.labels.begin(), t.labels.begin() + 4),
            (std::vector<int32_t>{12, 13, 14, 15}));
  EXPECT_EQ(t.weights[0], 0.0f);                                   // slot 0 never trained
  EXPECT_FLOAT_EQ(t.weights[1], 1.0f);                             // exp(-0/7)
  EXPECT_EQ(t.weights[2], 0.0f);                                   // loss_mask[4] = 0
  EXPECT_FLOAT_EQ(t.weights[3], static_cast<float>(std::exp(-2.0 / 7.0)));
  // Block 1 at anchor 6 in doc [6,8): slots 2,3 are past the document end.
  EXPECT_EQ(t.labels[4 + 1], 17);
  EXPECT_EQ(t.labels[4 + 2], -1);
  EXPECT_EQ(t.weights[4 + 2], 0.0f);
  EXPECT_EQ(t.counted[4 + 3], 0);
  // gamma <= 0: all supervised slots weigh 1.
  auto t2 = block_targets(tok, mask, off, anchors, K, 0.0);
  EXPECT_FLOAT_EQ(t2.weights[3], 1.0f);
  // An anchor outside its document is an error.
  std::vector<Anchor> bad = {{6, 0}};
  EXPECT_THROW(block_targets(tok, mask, off, bad, K, 7.0), Error);
  EXPECT_THROW(block_targets(tok, mask, off, anchors, 1, 7.0), Error);
}

TEST(Metrics, AcceptanceLengthCountsLeadingCorrectSlots) {
  std::vector<int32_t> tok = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<uint8_t> mask(8, 1);
  std::vector<int32_t> off = {0, 8};
  std::vector<Anchor> anchors = {{0, 0}, {3, 0}};
  auto t = block_targets(tok, mask, off, anchors, 4, 7.0);
  // Block 0 predicts [x, 2, 3, 99] -> 2 leading correct -> length 3.
  // Block 1 predicts [x, 0, 6, 7]  -> 0 leading correct -> length 1 (slots 2,3 still count for acc).
  std::vector<int32_t> argmax = {0, 2, 3, 99, 0, 0, 6, 7};
  std::vector<float> ce = {9, 1, 1, 1, 9, 2, 2, 2};
  ObjectiveMetrics m(4);
  accumulate_metrics(m, t, argmax, ce);
  EXPECT_DOUBLE_EQ(m.tau(), 2.0);
  EXPECT_DOUBLE_EQ(m.accuracy(), 4.0 / 6.0);
  EXPECT_DOUBLE_EQ(m.slot_accuracy(1), 0.5);
  EXPECT_TRUE(std::isnan(m.slot_accuracy(0)));
  const double w1 = 1, w2 = std::exp(-1.0 / 7), w3 = std::exp(-2.0 / 7);
  const double expect = (1 * w1 + 1 * w2 + 1 * w3 + 2 * w1 + 2 * w2 + 2 * w3) / (2 * (w1 + w2 + w3));
  EXPECT_NEAR(m.loss(), expect, 1e-6);  // slot 0's CE (9) never contributes
}

TEST(AdamW, MatchesTheTextbookUpdateInDouble) {
  AdamWConfig c;
  c.weight_decay = 0.1;
  float p = 0.5f, m = 0, v = 0;
  double pd = 0.5, md = 0, vd = 0;
  const double lr = 1e-2;
  const float grads[3] = {0.3f, -0.2f, 0.05f};
  for (int step = 1; step <= 3; ++step) {
    adamw_step_cpu(&p, &m, &v, &grads[step - 1], 1, c, lr, step);
    double g = grads[step - 1];
    pd -= lr * c.weight_decay * pd;
    md = c.beta1 * md + (1 - c.beta1) * g;
    vd = c.beta2 * vd + (1 - c.beta2) * g * g;
    double mh = md / (1 - std::pow(c.beta1, step)), vh = vd / (1 - std::pow(c.beta2, step));
    pd -= lr * mh / (std::sqrt(vh) + c.eps);
    EXPECT_NEAR(p, pd, 1e-6) << "step " << step;
  }
  EXPECT_THROW(adamw_step_cpu(&p, &m, &v, grads, 1, c, lr, 0), Error);
}

TEST(Schedule, WarmupThenCosineToFloor) {
  LrSchedule s{1e-3, 10, 110, 0.1};
  EXPECT_DOUBLE_EQ(s.at(0), 0.0);
  EXPECT_DOUBLE_EQ(s.at(5), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 1e-3 * (0.1 + 0.9 * 0.5), 1e-12);
  EXPECT_NEAR(s.at(110), 1e-4, 1e-12);
  EXPECT_GT(s.at(30), s.at(31));
  EXPECT_DOUBLE_EQ(clip_scale(2.0, 1.0), 1.0 / (2.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_scale(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_scale(5.0, 0.0), 1.0);
}

TEST(Objective, DocumentBlocksCountWhatSampleAnchorsTakes) {
  const std::vector<uint8_t> m = {1, 1, 0, 1, 1, 1};  // candidates 0, 3, 4 (5 is the last token)
  EXPECT_EQ(document_blocks(m, 512), 3);
  EXPECT_EQ(document_blocks(m, 2), 2);
  EXPECT_EQ(document_blocks(std::vector<uint8_t>{1}, 4), 0);
  EXPECT_THROW(document_blocks(m, 0), Error);
  // The same count as sample_anchors on the document alone.
  Rng rng(1);
  const std::vector<int32_t> off = {0, 6};
  EXPECT_EQ(static_cast<int32_t>(sample_anchors(m, off, 2, rng).size()), document_blocks(m, 2));
}

// ------------------------------------------------------------------------------------- D-PACE

namespace {

// dpace_block_weights of one block given the confidences q_k (CE = −log q_k) and the mask.
std::vector<double> dpace_weights_of(LossType loss, double alpha, const std::vector<double>& q,
                                     const std::vector<uint8_t>& mask) {
  std::vector<double> ce(q.size()), w(q.size());
  for (size_t k = 0; k < q.size(); ++k) ce[k] = -std::log(q[k]);
  dpace_block_weights(w, ce, mask, Objective{loss, alpha});
  return w;
}

}  // namespace

TEST(DPace, LossTypeNamesRoundTripAndOthersAreRefused) {
  for (LossType t : {LossType::dflash, LossType::dpace, LossType::dpace_cumulative_confidence_only,
                     LossType::dpace_continuation_value_only}) {
    EXPECT_EQ(loss_type_parse(loss_type_name(t)), t);
  }
  EXPECT_STREQ(loss_type_name(LossType::dpace_continuation_value_only),
               "dpace-continuation-value-only");
  EXPECT_FALSE(loss_type_parse("DPACE").has_value());
  EXPECT_FALSE(loss_type_parse("dpace_cumulative_confidence_only").has_value());
  EXPECT_FALSE(loss_type_parse("").has_value());
}

// OBJECTIVES.md §4: three supervised slots with q = 0.5 and α = 0.5 give s = 0.75, so
// P = (0.75, 0.5625, 0.421875) and R = (1.734375, 0.984375, 0.421875); slot 0 is the anchor.
TEST(DPace, ClosedFormWeightsOfThreeSupervisedSlots) {
  const std::vector<double> q = {0.5, 0.5, 0.5, 0.5};
  const std::vector<uint8_t> m = {0, 1, 1, 1};
  const std::vector<double> R = {1.734375, 1.734375, 0.984375, 0.421875};
  const std::vector<double> P = {1.0, 0.75, 0.5625, 0.421875};
  const auto wr = dpace_weights_of(LossType::dpace, 0.5, q, m);
  const auto wp = dpace_weights_of(LossType::dpace_cumulative_confidence_only, 0.5, q, m);
  const auto wc = dpace_weights_of(LossType::dpace_continuation_value_only, 0.5, q, m);
  for (int k = 1; k < 4; ++k) {
    EXPECT_NEAR(wr[k], R[k], 1e-15) << "dpace slot " << k;
    EXPECT_NEAR(wp[k], P[k], 1e-15) << "cumulative-confidence slot " << k;
    EXPECT_NEAR(wc[k], R[k] / P[k], 1e-14) << "continuation-value slot " << k;
  }
  EXPECT_NEAR(wc[1], 2.3125, 1e-14);
  EXPECT_NEAR(wc[3], 1.0, 1e-14);
}

// A masked slot inside the block multiplies the prefix by 1 and is left out of the suffix sums;
// its CE is never read (NaN here). α = 0.25, q = (·, 0.8, ·, 0.4, 0.6): s = (·, 0.85, 1, 0.55,
// 0.7), P = (1, 0.85, 0.85, 0.4675, 0.32725), R = (·, 1.64475, ·, 0.79475, 0.32725).
TEST(DPace, AMaskedSlotInTheMiddleIsANoOpInTheProductAndLeftOutOfTheSum) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> ce = {nan, -std::log(0.8), nan, -std::log(0.4), -std::log(0.6)};
  const std::vector<uint8_t> m = {0, 1, 0, 1, 1};
  auto weights = [&](LossType t) {
    std::vector<double> w(5);
    dpace_block_weights(w, ce, m, Objective{t, 0.25});
    return w;
  };
  const auto wr = weights(LossType::dpace);
  const auto wp = weights(LossType::dpace_cumulative_confidence_only);
  const auto wc = weights(LossType::dpace_continuation_value_only);
  const std::vector<double> R = {0, 1.64475, 0, 0.79475, 0.32725};
  const std::vector<double> P = {0, 0.85, 0, 0.4675, 0.32725};
  const std::vector<double> C = {0, 1.935, 0, 1.7, 1.0};
  for (int k : {1, 3, 4}) {
    EXPECT_NEAR(wr[k], R[k], 1e-14) << "dpace slot " << k;
    EXPECT_NEAR(wp[k], P[k], 1e-14) << "cumulative-confidence slot " << k;
    EXPECT_NEAR(wc[k], C[k], 1e-13) << "continuation-value slot " << k;
  }
  for (double w : wr) EXPECT_TRUE(std::isfinite(w));
}

// α = 1: every s_k = 1, so P ≡ 1 and R_k = the number of supervised slots at or after k; with a
// fully supervised block of K slots, R_k = K − k (see DPace in tests/drafter_test.cpp).
TEST(DPace, AlphaOneGivesTheCountOfSupervisedSlotsFromK) {
  const std::vector<double> q = {0.9, 0.1, 0.3, 0.7, 0.2, 0.05};
  const std::vector<uint8_t> m = {0, 1, 0, 1, 1, 1};
  const auto wr = dpace_weights_of(LossType::dpace, 1.0, q, m);
  const auto wp = dpace_weights_of(LossType::dpace_cumulative_confidence_only, 1.0, q, m);
  const auto wc = dpace_weights_of(LossType::dpace_continuation_value_only, 1.0, q, m);
  const std::vector<double> count = {4, 4, 3, 3, 2, 1};
  for (int k = 0; k < 6; ++k) {
    EXPECT_EQ(wr[k], count[k]) << k;
    EXPECT_EQ(wp[k], 1.0) << k;
    EXPECT_EQ(wc[k], count[k]) << k;
  }
}

TEST(DPace, BadArgumentsAreErrors) {
  std::vector<double> w(3), ce = {1, 1, 1};
  const std::vector<uint8_t> m = {0, 1, 1};
  EXPECT_THROW(dpace_block_weights(w, ce, m, Objective{LossType::dflash, 0.5}), Error);
  EXPECT_THROW(dpace_block_weights(w, ce, m, Objective{LossType::dpace, 1.5}), Error);
  EXPECT_THROW(dpace_block_weights(w, ce, m, Objective{LossType::dpace, -0.1}), Error);
  std::vector<double> short_w(2);
  EXPECT_THROW(dpace_block_weights(short_w, ce, m, Objective{LossType::dpace, 0.5}), Error);
}

// dpace_row_weights over a packed list of block rows (what a loss head computed): each listed row
// gets dpace_block_weights' weight in its own block (unlisted slots count as unsupervised), an
// unsupervised listed row 0; rows out of order or out of range are errors naming the row.
TEST(DPace, RowWeightsArePerBlockWeightsOfThePackedRows) {
  const int64_t K = 4;
  // Blocks 0 and 2 (rows 0..3 and 8..11); row 2 listed but not counted, rows 0 and 9 not listed.
  const std::vector<uint8_t> counted = {0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1};
  const std::vector<int32_t> rows = {1, 2, 3, 10, 11};
  const std::vector<double> ce = {0.3, 9.0, 1.2, 0.7, 2.5};
  const Objective obj{LossType::dpace, 0.25};
  std::vector<double> w(rows.size());
  dpace_row_weights(w, rows, ce, counted, K, obj);
  std::vector<double> b0(K), b2(K);
  dpace_block_weights(b0, std::vector<double>{0, 0.3, 0, 1.2}, std::vector<uint8_t>{0, 1, 0, 1},
                      obj);
  dpace_block_weights(b2, std::vector<double>{0, 0, 0.7, 2.5}, std::vector<uint8_t>{0, 0, 1, 1},
                      obj);
  EXPECT_EQ(w, (std::vector<double>{b0[1], 0.0, b0[3], b2[2], b2[3]}));
  EXPECT_GT(w[0], w[2]);  // R_1 = P_1 + P_3 > R_3 = P_3
  const std::vector<int32_t> unordered = {3, 1, 2, 10, 11}, outside = {1, 2, 3, 10, 12};
  auto err = [&](const std::vector<int32_t>& r) {
    try {
      dpace_row_weights(w, r, ce, counted, K, obj);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(err(unordered).find("row 1 (entry 1) is out of [0, 12) or not ascending"),
            std::string::npos)
      << err(unordered);
  EXPECT_NE(err(outside).find("row 12 (entry 4) is out of [0, 12) or not ascending"),
            std::string::npos)
      << err(outside);
}
