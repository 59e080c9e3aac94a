// Tests of the DSpark objective on the CPU reference (src/model/dspark_head, the DSpark path of
// drafter_train_step, dspark_block_targets): float64 finite differences of every parameter of every
// head type, and the property tests of ../shared/OBJECTIVES.md §4 (aligned hidden ⇒ L1 = 0 and
// acc = 1; loss_mask[a+2] = 0 leaves slot 0 alone; rank 0 with αce = 1 is the pooled next-token CE;
// sequential Markov drafting with teacher forcing equals the block logits).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.hpp"
#include "model/drafter.hpp"
#include "model/dspark_head.hpp"
#include "model/dspark_head_cuda.hpp"
#include "model/step_plan.hpp"
#include "util/drafter_problem.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

struct Heads {
  int rank = 0;
  MarkovHeadType type = MarkovHeadType::vanilla;
  bool conf = false, conf_markov = false;
};

// A small random DSpark problem (test::DrafterProblem: one row of two documents plus a document
// without anchors, the target's features) with the target's final hidden states and γ.
template <typename S>
struct Problem : test::DrafterProblem<S> {
  explicit Problem(test::DrafterProblem<S> base) : test::DrafterProblem<S>(std::move(base)) {}
  std::vector<S> final_hidden;  // [T, H]
  double gamma = 4.0;

  DrafterBatch batch() const {
    return test::DrafterProblem<S>::batch(dspark_block_targets(
        this->tokens, this->mask, this->doc_offsets, this->anchors, this->cfg.block_size, gamma));
  }
};

template <typename S>
Problem<S> make_problem(uint64_t seed, Heads h, std::vector<Anchor> anchors, int K = 4, int H = 16,
                        int V = 23) {
  DrafterConfig cfg = test::small_drafter_config(K, H, V);
  cfg.dspark.enabled = true;
  cfg.dspark.markov_rank = h.rank;
  cfg.dspark.markov_type = h.type;
  cfg.dspark.confidence_head = h.conf;
  cfg.dspark.confidence_with_markov = h.conf_markov;
  Rng rng(seed);
  Problem<S> p(test::draw_drafter_problem<S>(rng, std::move(cfg), std::move(anchors)));
  p.final_hidden.resize(p.T * H);
  for (S& x : p.final_hidden) x = static_cast<S>(rng.normal());
  p.obj.kind = ObjectiveKind::dspark;
  p.obj.dspark_ce_alpha = 0.3;
  p.obj.dspark_l1_alpha = 0.9;
  p.obj.dspark_conf_alpha = 0.7;
  return p;
}

template <typename S>
DrafterTrainResult step_of(const Problem<S>& p, std::vector<S>* grads, const S* final_hidden) {
  return test::drafter_problem_step(p, p.batch(), grads, final_hidden);
}

// The loss with acc held at `acc0` (the BCE target is detached): the step's loss with its BCE
// terms recomputed against acc0 from the step's own confidence logits.
template <typename S>
double loss_acc_frozen(const Problem<S>& p, const std::vector<double>& acc0) {
  const DrafterTrainResult r = step_of<S>(p, nullptr, p.final_hidden.data());
  const DrafterBatch b = p.batch();
  double num = r.loss_sum;
  for (size_t i = 0; i < acc0.size(); ++i) {
    const double w = b.targets.weights[i];
    if (w == 0 || std::isnan(r.dspark_conf[i])) continue;
    const double z = r.dspark_conf[i];
    num += w * p.obj.dspark_conf_alpha * (z * (r.dspark_acc[i] - acc0[i]));
  }
  return num / r.weight_sum;
}

// Runs `stmt`, which must throw dflash::Error whose message contains `text`.
#define EXPECT_THAT_ERROR(stmt, text)                    \
  do {                                                   \
    try {                                                \
      (void)(stmt);                                      \
      ADD_FAILURE() << #stmt " did not throw";           \
    } catch (const Error& e) {                           \
      EXPECT_THAT(e.what(), ::testing::HasSubstr(text)); \
    }                                                    \
  } while (0)

const std::vector<Anchor> kAnchors = {{1, 0}, {5, 0}, {6, 0}, {12, 1}, {17, 1}};

}  // namespace

TEST(DSpark, TargetsAreShiftedWithAPrefixMask) {
  // Document [0, 10), loss mask 0 at 3: anchor 0's labels x[1..4]; slot 2 (x[3]) and every later
  // slot unsupervised; anchor 6's block runs past the document end at slot 3.
  std::vector<int32_t> tokens = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  std::vector<uint8_t> mask(10, 1);
  mask[3] = 0;
  const std::vector<int32_t> off = {0, 10};
  const std::vector<Anchor> anchors = {{0, 0}, {6, 0}};
  const BlockTargets t = dspark_block_targets(tokens, mask, off, anchors, 4, 4.0);
  EXPECT_EQ(t.first_slot, 0);
  EXPECT_EQ(t.labels, (std::vector<int32_t>{11, 12, 13, 14, 17, 18, 19, -1}));
  EXPECT_EQ(t.counted, (std::vector<uint8_t>{1, 1, 0, 0, 1, 1, 1, 0}));
  EXPECT_FLOAT_EQ(t.weights[0], 1.0f);
  EXPECT_FLOAT_EQ(t.weights[1], static_cast<float>(std::exp(-0.25)));
  EXPECT_FLOAT_EQ(t.weights[6], static_cast<float>(std::exp(-0.5)));
  EXPECT_EQ(t.weights[2], 0.0f);
  // γ ≤ 0: uniform weights on the supervised prefix.
  const BlockTargets u = dspark_block_targets(tokens, mask, off, anchors, 4, 0.0);
  EXPECT_EQ(u.weights, (std::vector<float>{1, 1, 0, 0, 1, 1, 1, 0}));
}

// OBJECTIVES.md §4: loss_mask[a+2] = 0 zeroes every slot k ≥ 1 (slot 0's label is x[a+1]).
TEST(DSpark, AMaskedSecondLabelZeroesEverySlotAfterTheFirst) {
  std::vector<int32_t> tokens(12, 5);
  std::vector<uint8_t> mask(12, 1);
  const int a = 3;
  mask[a + 2] = 0;
  const BlockTargets t = dspark_block_targets(tokens, mask, std::vector<int32_t>{0, 12},
                                              std::vector<Anchor>{{a, 0}}, 6, 4.0);
  EXPECT_EQ(t.counted, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0}));
  EXPECT_EQ(t.weights[0], 1.0f);
  for (int k = 1; k < 6; ++k) EXPECT_EQ(t.weights[k], 0.0f) << k;
}

// The whole drafter + DSpark loss against central differences in float64, every head type, the
// confidence head with and without the Markov input: a few coordinates of every parameter (all of
// them for the heads' small tensors). acc is a constant of the step (detached as SpecForge's), so
// the reference loss holds it at its value at the unperturbed parameters.
TEST(DSpark, GradientsMatchFiniteDifferencesInFloat64) {
  const std::vector<Heads> cases = {
      {0, MarkovHeadType::vanilla, false, false}, {0, MarkovHeadType::vanilla, true, false},
      {3, MarkovHeadType::vanilla, true, true},   {3, MarkovHeadType::gated, true, false},
      {3, MarkovHeadType::rnn, true, true},       {2, MarkovHeadType::rnn, false, false}};
  for (const Heads& h : cases) {
    auto p = make_problem<double>(7, h, kAnchors);
    std::vector<double> g(p.layout->total, 0.0);
    const DrafterTrainResult base = step_of(p, &g, p.final_hidden.data());
    ASSERT_GT(base.weight_sum, 0);
    Rng pick(11);
    double worst = 0;
    for (const auto& info : p.layout->params) {
      const bool head =
          info.name.rfind("markov_head", 0) == 0 || info.name.rfind("confidence_head", 0) == 0;
      const int64_t n = head && info.numel <= 64 ? info.numel : 3;
      for (int64_t s = 0; s < n; ++s) {
        // markov_w1: rows of tokens the batch reads as previous tokens (others have gradient 0).
        int64_t i =
            info.offset + (n == info.numel ? s : static_cast<int64_t>(pick.below(info.numel)));
        if (info.name == "markov_head.markov_w1.weight") {
          i = info.offset + p.tokens[kAnchors[s % kAnchors.size()].pos] * h.rank + s % h.rank;
        }
        const double eps = 1e-5, old = p.params[i];
        p.params[i] = old + eps;
        const double lp = loss_acc_frozen(p, base.dspark_acc);
        p.params[i] = old - eps;
        const double lm = loss_acc_frozen(p, base.dspark_acc);
        p.params[i] = old;
        const double fd = (lp - lm) / (2 * eps);
        const double err = std::abs(fd - g[i]) / std::max(1e-6, std::abs(fd) + std::abs(g[i]));
        worst = std::max(worst, err);
        EXPECT_LT(err, 1e-5) << info.name << " rank " << h.rank << " type "
                             << markov_head_type_name(h.type) << " fd " << fd << " analytic "
                             << g[i];
      }
    }
    EXPECT_LT(worst, 1e-5);
  }
}

// The float32 step agrees with float64 (the training path).
TEST(DSpark, Float32StepAgreesWithFloat64) {
  const Heads h{4, MarkovHeadType::rnn, true, true};
  auto pd = make_problem<double>(9, h, kAnchors);
  auto pf = make_problem<float>(9, h, kAnchors);
  std::vector<double> gd(pd.layout->total, 0.0);
  std::vector<float> gf(pf.layout->total, 0.0f);
  test::expect_float32_step_agrees(step_of(pd, &gd, pd.final_hidden.data()), gd,
                                   step_of(pf, &gf, pf.final_hidden.data()), gf);
}

// OBJECTIVES.md §4: when the draft logits are LMhead(Hl[a+k]) (no Markov bias, the target's final
// hidden state at a+k equal to the drafter's at slot k), L1 = 0 and acc = 1.
TEST(DSpark, AlignedHiddenStatesGiveL1ZeroAndAccOne) {
  // Blocks that do not overlap, so that each context position is one slot's.
  const std::vector<Anchor> anchors = {{0, 0}, {5, 0}, {11, 1}};
  auto p = make_problem<double>(5, Heads{0, MarkovHeadType::vanilla, true, false}, anchors);
  const DrafterBatch b = p.batch();
  auto ws = std::make_unique<DrafterWorkspace<double>>();
  drafter_block_logits<double>(p.cfg, *p.layout, p.params.data(), p.tables(), b, p.features.data(),
                               *ws);
  const int64_t K = p.cfg.block_size, H = p.cfg.hidden_size;
  for (size_t blk = 0; blk < anchors.size(); ++blk) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t pos = anchors[blk].pos + k;
      if (pos >= p.T) continue;
      std::copy_n(ws->hf.data() + (blk * K + k) * H, H, p.final_hidden.data() + pos * H);
    }
  }
  const DrafterTrainResult r = step_of<double>(p, nullptr, p.final_hidden.data());
  ASSERT_GT(r.weight_sum, 3);
  EXPECT_LT(r.dspark_l1_sum, 1e-12);
  EXPECT_NEAR(r.dspark_acc_sum, r.weight_sum, 1e-12);
  // One position further (the dflash alignment) is not the teacher: L1 > 0.
  std::vector<double> shifted(p.final_hidden.size(), 0.0);
  std::copy(p.final_hidden.begin(), p.final_hidden.end() - H, shifted.begin() + H);
  EXPECT_GT(step_of<double>(p, nullptr, shifted.data()).dspark_l1_sum, 0.1);
}

// OBJECTIVES.md §4: rank 0, αl1 = αconf = 0, αce = 1 and uniform weights give the mean next-token
// CE of the drafter's logits over the supervised slots (labels x[a+1+k]).
TEST(DSpark, RankZeroWithOnlyCeIsThePooledNextTokenCe) {
  auto p = make_problem<double>(13, Heads{0, MarkovHeadType::vanilla, true, false}, kAnchors);
  p.obj.dspark_ce_alpha = 1.0;
  p.obj.dspark_l1_alpha = 0.0;
  p.obj.dspark_conf_alpha = 0.0;
  p.gamma = 0.0;
  const DrafterBatch b = p.batch();
  auto ws = std::make_unique<DrafterWorkspace<double>>();
  const std::vector<double> logits = drafter_block_logits<double>(
      p.cfg, *p.layout, p.params.data(), p.tables(), b, p.features.data(), *ws);
  const int64_t K = p.cfg.block_size, V = p.cfg.vocab_size;
  double ce = 0;
  int n = 0;
  for (size_t blk = 0; blk < kAnchors.size(); ++blk) {
    const Anchor& a = kAnchors[blk];
    for (int64_t k = 0; k < K; ++k) {
      const int64_t pos = a.pos + 1 + k;
      bool supervised = pos < p.doc_offsets[a.doc + 1];
      for (int64_t j = a.pos + 1; j <= pos && supervised; ++j) supervised = p.mask[j] != 0;
      if (!supervised) break;
      const double* l = logits.data() + (blk * K + k) * V;
      double mx = l[0], s = 0;
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, l[v]);
      for (int64_t v = 0; v < V; ++v) s += std::exp(l[v] - mx);
      ce += mx + std::log(s) - l[p.tokens[pos]];
      ++n;
    }
  }
  ASSERT_GT(n, 10);
  const DrafterTrainResult r = step_of<double>(p, nullptr, p.final_hidden.data());
  EXPECT_DOUBLE_EQ(r.weight_sum, n);
  EXPECT_NEAR(r.loss_sum / r.weight_sum, ce / n, 1e-12);
}

// OBJECTIVES.md §4: drafting slot after slot (dspark_slot_logits, prev₀ = the token at the anchor,
// then each slot's label as the previous token) reproduces the training block's logits, for each
// head type.
TEST(DSpark, SequentialTeacherForcedDraftingEqualsTheBlockLogits) {
  for (MarkovHeadType type :
       {MarkovHeadType::vanilla, MarkovHeadType::gated, MarkovHeadType::rnn}) {
    auto p = make_problem<float>(17, Heads{5, type, true, true}, kAnchors);
    const DrafterBatch b = p.batch();
    auto ws = std::make_unique<DrafterWorkspace<float>>();
    const std::vector<float> block = drafter_block_logits<float>(
        p.cfg, *p.layout, p.params.data(), p.tables(), b, p.features.data(), *ws);
    const int64_t K = p.cfg.block_size, V = p.cfg.vocab_size, H = p.cfg.hidden_size;
    DsparkSlotState st;
    double worst = 0, bias = 0;
    for (size_t blk = 0; blk < kAnchors.size(); ++blk) {
      const Anchor& a = kAnchors[blk];
      for (int64_t k = 0; k < K && a.pos + k < p.doc_offsets[a.doc + 1]; ++k) {
        const int64_t row = static_cast<int64_t>(blk) * K + k;
        std::vector<float> logits(V);
        for (int64_t v = 0; v < V; ++v) {
          double acc = 0;
          for (int64_t i = 0; i < H; ++i) acc += p.head[v * H + i] * ws->hf[row * H + i];
          logits[v] = static_cast<float>(acc);
        }
        std::vector<float> base = logits;
        dspark_slot_logits(p.cfg, *p.layout, p.params.data(), logits.data(),
                           ws->hf.data() + row * H, p.tokens[a.pos + k], static_cast<int>(k), st);
        for (int64_t v = 0; v < V; ++v) {
          worst = std::max(worst, std::abs(double(logits[v]) - block[row * V + v]));
          bias = std::max(bias, std::abs(double(logits[v]) - base[v]));
        }
      }
    }
    EXPECT_LT(worst, 1e-4) << markov_head_type_name(type);
    EXPECT_GT(bias, 1e-2) << markov_head_type_name(type);  // the head does add a bias
  }
}

TEST(DSpark, SlotsAreDraftedInOrder) {
  auto p = make_problem<float>(3, Heads{2, MarkovHeadType::rnn, false, false}, kAnchors);
  std::vector<float> logits(p.cfg.vocab_size, 0.0f), h(p.cfg.hidden_size, 0.5f);
  DsparkSlotState st;
  dspark_slot_logits(p.cfg, *p.layout, p.params.data(), logits.data(), h.data(), 1, 0, st);
  EXPECT_THROW(
      dspark_slot_logits(p.cfg, *p.layout, p.params.data(), logits.data(), h.data(), 1, 2, st),
      Error);
  EXPECT_THROW(dspark_slot_logits(p.cfg, *p.layout, p.params.data(), logits.data(), h.data(),
                                  p.cfg.vocab_size, 1, st),
               Error);
}

TEST(DSpark, LayoutNamesTheHeadsAsTheReleasedCheckpoints) {
  auto p = make_problem<float>(1, Heads{3, MarkovHeadType::rnn, true, true}, kAnchors);
  const auto& L = *p.layout;
  EXPECT_EQ(L.find("markov_head.markov_w1.weight").shape, (std::vector<int64_t>{23, 3}));
  EXPECT_EQ(L.find("markov_head.markov_w2.weight").shape, (std::vector<int64_t>{23, 3}));
  EXPECT_EQ(L.find("markov_head.joint_proj.weight").shape, (std::vector<int64_t>{9, 6 + 16}));
  EXPECT_EQ(L.find("markov_head.joint_proj.bias").shape, (std::vector<int64_t>{9}));
  EXPECT_EQ(L.find("confidence_head.proj.weight").shape, (std::vector<int64_t>{1, 19}));
  EXPECT_EQ(L.find("confidence_head.proj.bias").shape, (std::vector<int64_t>{1}));
  EXPECT_THROW(L.find("markov_head.gate_proj.weight"), Error);
  auto g = make_problem<float>(1, Heads{3, MarkovHeadType::gated, false, false}, kAnchors);
  EXPECT_EQ(g.layout->find("markov_head.gate_proj.weight").shape,
            (std::vector<int64_t>{3, 16 + 3}));
  EXPECT_THROW(g.layout->find("confidence_head.proj.weight"), Error);
  // The DFlash tensors come first, at the offsets a DFlash drafter of the same sizes has, and
  // drafter_init gives them the same values (the heads are drawn after them, biases are 0).
  DrafterConfig plain = p.cfg;
  plain.dspark = {};
  const DrafterLayout pl(plain);
  std::vector<float> a(pl.total), b(L.total);
  drafter_init(a, pl, 5);
  drafter_init(b, L, 5);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
  EXPECT_EQ(b[L.dspark.joint_b], 0.0f);
  EXPECT_EQ(b[L.dspark.conf_b], 0.0f);
}

TEST(DSpark, ConfigValidationNamesTheField) {
  auto p = make_problem<float>(1, Heads{0, MarkovHeadType::vanilla, false, false}, kAnchors);
  DrafterConfig c = p.cfg;
  c.dspark.markov_type = MarkovHeadType::gated;
  EXPECT_THAT_ERROR(c.validate(), "markov_head_type gated needs markov_rank > 0");
  c = p.cfg;
  c.dspark.confidence_head = true;
  c.dspark.confidence_with_markov = true;
  EXPECT_THAT_ERROR(c.validate(), "confidence_head_with_markov needs");
  // The CUDA drafter step runs every DSpark head: only head_dim 8 is refused here, for each
  // Markov head type (the CUDA decoder refuses DSpark in src/cli).
  for (MarkovHeadType t : {MarkovHeadType::vanilla, MarkovHeadType::gated, MarkovHeadType::rnn}) {
    DrafterConfig h = p.cfg;
    h.dspark.markov_rank = 2;
    h.dspark.markov_type = t;
    const std::vector<std::string> cuda = cuda_drafter_unsupported(h);
    ASSERT_EQ(cuda.size(), 1u) << markov_head_type_name(t);
    EXPECT_THAT(cuda[0], ::testing::HasSubstr("head_dim"));
  }
  c = p.cfg;
  c.dspark.enabled = false;
  c.dspark.markov_rank = 2;
  EXPECT_THAT_ERROR(c.validate(), "projector_type is not dspark");
  // A dflash batch for a DSpark drafter, and a DSpark step without the teacher.
  Problem<double> d =
      make_problem<double>(2, Heads{2, MarkovHeadType::vanilla, false, false}, kAnchors);
  DrafterBatch b = d.batch();
  auto ws = std::make_unique<DrafterWorkspace<double>>();
  EXPECT_THAT_ERROR(drafter_train_step<double>(d.cfg, *d.layout, d.params.data(), nullptr,
                                               d.tables(), b, d.features.data(), 1.0, *ws),
                    "without the target's final hidden states");
  DrafterConfig dflash_cfg = d.cfg;
  dflash_cfg.dspark = {};
  const DrafterLayout dl(dflash_cfg);
  EXPECT_THAT_ERROR(drafter_train_step<double>(dflash_cfg, dl, d.params.data(), nullptr, d.tables(),
                                               b, d.features.data(), 1.0, *ws),
                    "a batch of the dspark objective for a drafter without DSpark heads");
}

// The CUDA head's host-side row index (model/dspark_head_cuda.hpp): teacher-forced previous tokens
// and teacher rows as the CPU step reads them, and W1's rows in segments of one token each, rows
// ascending within a segment; padding rows unsupervised.
TEST(DSpark, CudaRowIndexSortsSupervisedRowsIntoTokenSegments) {
  Problem<float> p =
      make_problem<float>(3, Heads{2, MarkovHeadType::vanilla, false, false}, kAnchors);
  p.tokens[1] = p.tokens[6] = p.tokens[12] = 7;  // several rows share previous token 7
  const DrafterBatch b = p.batch();
  const int64_t K = b.block_size, NK = b.N() * K, rows = NK + 3;
  const DsparkRowIndex x = dspark_row_index(b, rows, p.cfg.vocab_size);
  ASSERT_EQ(x.prev.size(), static_cast<size_t>(rows));
  ASSERT_EQ(x.w1_seg.size(), static_cast<size_t>(rows) + 1);
  std::vector<int32_t> sup;
  for (int64_t row = 0; row < rows; ++row) {
    const auto i = static_cast<size_t>(row);
    if (row >= NK) {
      EXPECT_EQ(x.prev[i], 0);
      EXPECT_EQ(x.teacher_pos[i], -1);
      continue;
    }
    const Anchor& a = b.anchors[static_cast<size_t>(row / K)];
    const int32_t pos = a.pos + static_cast<int32_t>(row % K);
    const bool in_doc = pos < b.doc_offsets[static_cast<size_t>(a.doc) + 1];
    EXPECT_EQ(x.prev[i], in_doc ? b.tokens[static_cast<size_t>(pos)] : 0) << row;
    const bool s = b.targets.weights[i] != 0.0f;
    EXPECT_EQ(x.teacher_pos[i], s ? pos : -1) << row;
    if (s) sup.push_back(static_cast<int32_t>(row));
  }
  // Every supervised row once; segments partition them by token, rows ascending inside.
  const auto n = static_cast<int32_t>(sup.size());
  std::vector<int32_t> seen(x.w1_order.begin(), x.w1_order.begin() + n);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, sup);
  for (size_t i = static_cast<size_t>(n); i < x.w1_order.size(); ++i) EXPECT_EQ(x.w1_order[i], -1);
  EXPECT_EQ(x.w1_seg[0], 0);
  int segments = 0;
  for (size_t s = 0; s + 1 < x.w1_seg.size(); ++s) {
    const int32_t lo = x.w1_seg[s], hi = x.w1_seg[s + 1];
    ASSERT_LE(lo, hi);
    if (lo == hi) {
      EXPECT_EQ(lo, n);  // trailing empty segments only
      continue;
    }
    ++segments;
    const int32_t tok = x.prev[static_cast<size_t>(x.w1_order[static_cast<size_t>(lo)])];
    if (s > 0) {
      EXPECT_LT(x.prev[static_cast<size_t>(x.w1_order[static_cast<size_t>(lo) - 1])], tok);
    }
    for (int32_t k = lo + 1; k < hi; ++k) {
      EXPECT_EQ(x.prev[static_cast<size_t>(x.w1_order[static_cast<size_t>(k)])], tok);
      EXPECT_LT(x.w1_order[static_cast<size_t>(k) - 1], x.w1_order[static_cast<size_t>(k)]);
    }
  }
  EXPECT_LT(segments, n);  // token 7 collects several rows
  EXPECT_EQ(x.w1_seg.back(), n);
  // Errors: too few rows, a label outside the vocabulary.
  EXPECT_THAT_ERROR(dspark_row_index(b, NK - 1, p.cfg.vocab_size), "rows for a batch of");
  EXPECT_THAT_ERROR(dspark_row_index(b, rows, 3), "outside [0, 3)");
}
