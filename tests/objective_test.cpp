// Tests of src/model/objective (anchors, labels, weights, metrics), src/train/optimizer and
// src/core/rng: each rule of DESIGN.md §1 has a test that fails when the rule is broken.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "model/objective.hpp"
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
