// Tests of the Domino objective on the CPU reference (src/model/domino_head, the Domino path of
// drafter_train_step, domino_block_targets, domino_lambda): float64 finite differences of every
// parameter for both shift_label settings, and the property tests of ../shared/OBJECTIVES.md §4
// (W2 = 0 ⇒ the loss is DFlash's whatever λ; causality of F for both shift settings; the
// teacher-forced sequential sampler reproduces the training F bit for bit; λ(0) = λ0 and
// λ(t ≥ ⌊T·r⌋) = 0).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.hpp"
#include "model/domino_head.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/drafter.hpp"
#include "model/step_plan.hpp"
#include "ops/linear.hpp"
#include "util/drafter_problem.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

struct HeadOpts {
  bool shift = false;
  int prefix = 0;  // pure_draft_prefix_len
  double lambda = 0.3;
};

// A small random Domino problem (test::DrafterProblem: one row of two documents plus a document
// without anchors, the target's features) with its γ.
template <typename S>
struct Problem : test::DrafterProblem<S> {
  explicit Problem(test::DrafterProblem<S> base) : test::DrafterProblem<S>(std::move(base)) {}
  double gamma = 4.0;

  DrafterBatch batch() const {
    return test::DrafterProblem<S>::batch(
        domino_block_targets(this->tokens, this->mask, this->doc_offsets, this->anchors,
                             this->cfg.block_size, gamma, this->obj.domino_shift_label));
  }
};

template <typename S>
Problem<S> make_problem(uint64_t seed, HeadOpts h, std::vector<Anchor> anchors, int K = 5,
                        int H = 16, int V = 23) {
  DrafterConfig cfg = test::small_drafter_config(K, H, V);
  cfg.domino.enabled = true;
  cfg.domino.emb_dim = 6;
  cfg.domino.gru_hidden_dim = 5;
  cfg.domino.pure_draft_prefix_len = h.prefix;
  cfg.domino.shift_label = h.shift;
  Rng rng(seed);
  Problem<S> p(test::draw_drafter_problem<S>(rng, std::move(cfg), std::move(anchors)));
  p.obj.kind = ObjectiveKind::domino;
  p.obj.domino_lambda = h.lambda;
  p.obj.domino_shift_label = h.shift;
  return p;
}

template <typename S>
DrafterTrainResult step_of(const Problem<S>& p, std::vector<S>* grads) {
  return test::drafter_problem_step(p, p.batch(), grads);
}

template <typename S>
std::vector<S> logits_of(const Problem<S>& p, DrafterWorkspace<S>& ws) {
  const DrafterBatch b = p.batch();
  return drafter_block_logits<S>(p.cfg, *p.layout, p.params.data(), p.tables(), b,
                                 p.features.data(), ws);
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

const std::vector<Anchor> kAnchors = {{1, 0}, {5, 0}, {7, 0}, {12, 1}, {16, 1}};

bool is_head(const std::string& name) {
  return name.rfind("prefix_gru", 0) == 0 || name.rfind("embed_proj", 0) == 0;
}

}  // namespace

TEST(Domino, TargetsFollowShiftLabel) {
  // Document [0, 10), loss mask 0 at 3: without shift, dflash's targets; with shift, labels
  // x[a+k+1], slot 0 supervised, each slot its own mask (not a prefix), weights exp(−k/γ).
  std::vector<int32_t> tokens = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  std::vector<uint8_t> mask(10, 1);
  mask[3] = 0;
  const std::vector<int32_t> off = {0, 10};
  const std::vector<Anchor> anchors = {{0, 0}, {6, 0}};
  const BlockTargets plain = domino_block_targets(tokens, mask, off, anchors, 4, 4.0, false);
  const BlockTargets dflash = block_targets(tokens, mask, off, anchors, 4, 4.0);
  EXPECT_EQ(plain.labels, dflash.labels);
  EXPECT_EQ(plain.weights, dflash.weights);
  EXPECT_EQ(plain.first_slot, 1);
  const BlockTargets t = domino_block_targets(tokens, mask, off, anchors, 4, 4.0, true);
  EXPECT_EQ(t.first_slot, 0);
  EXPECT_EQ(t.labels, (std::vector<int32_t>{11, 12, 13, 14, 17, 18, 19, -1}));
  EXPECT_EQ(t.counted, (std::vector<uint8_t>{1, 1, 0, 1, 1, 1, 1, 0}));
  EXPECT_FLOAT_EQ(t.weights[0], 1.0f);
  EXPECT_FLOAT_EQ(t.weights[3], static_cast<float>(std::exp(-0.75)));
  EXPECT_FLOAT_EQ(t.weights[6], static_cast<float>(std::exp(-0.5)));
  EXPECT_EQ(t.weights[2], 0.0f);
  const BlockTargets u = domino_block_targets(tokens, mask, off, anchors, 4, 0.0, true);
  EXPECT_EQ(u.weights, (std::vector<float>{1, 1, 0, 1, 1, 1, 1, 0}));
}

// The whole drafter + Domino loss against central differences in float64, both shift settings,
// with and without a base-only prefix: a few coordinates of every backbone parameter and of the
// head's tensors (all of them for W1's rows of the GRU state, where the GRU's gradient enters).
TEST(Domino, GradientsMatchFiniteDifferencesInFloat64) {
  const std::vector<HeadOpts> cases = {
      {false, 0, 0.3}, {false, 1, 0.0}, {true, 0, 0.6}, {true, 2, 1.0}};
  for (const HeadOpts& h : cases) {
    auto p = make_problem<double>(7, h, kAnchors);
    std::vector<double> g(p.layout->total, 0.0);
    const DrafterTrainResult base = step_of(p, &g);
    ASSERT_GT(base.weight_sum, 0);
    Rng pick(11);
    double worst = 0;
    int nonzero = 0;
    for (const auto& info : p.layout->params) {
      const int64_t n = is_head(info.name) ? 24 : 3;
      for (int64_t s = 0; s < n; ++s) {
        const int64_t i = info.offset + static_cast<int64_t>(pick.below(info.numel));
        // eps 1e-4: at 1e-5 the differences' rounding (about |loss|·1e-16/eps) dominates on some
        // machines (an AVX-512 OpenBLAS: 6e-11 off a 2.4e-6 GRU gradient, 1.3e-5 relative; the
        // error grew as eps shrank), while the truncation at 1e-4 stays under 1.4e-6 relative.
        const double eps = 1e-4, old = p.params[i];
        p.params[i] = old + eps;
        const DrafterTrainResult rp = step_of<double>(p, nullptr);
        p.params[i] = old - eps;
        const DrafterTrainResult rm = step_of<double>(p, nullptr);
        p.params[i] = old;
        const double fd = (rp.loss_sum / rp.weight_sum - rm.loss_sum / rm.weight_sum) / (2 * eps);
        const double err = std::abs(fd - g[i]) / std::max(1e-6, std::abs(fd) + std::abs(g[i]));
        worst = std::max(worst, err);
        nonzero += is_head(info.name) && std::abs(g[i]) > 1e-8;
        EXPECT_LT(err, 1e-5) << info.name << " shift " << h.shift << " prefix " << h.prefix
                             << " fd " << fd << " analytic " << g[i];
      }
    }
    EXPECT_LT(worst, 1e-5);
    // λ = 1 trains only the base: the head's gradient is 0 then, and only then.
    if (h.lambda < 1) {
      EXPECT_GT(nonzero, 40);
    } else {
      EXPECT_EQ(nonzero, 0);
    }
  }
}

// The float32 step (the training path) agrees with float64.
TEST(Domino, Float32StepAgreesWithFloat64) {
  const HeadOpts h{true, 1, 0.4};
  auto pd = make_problem<double>(9, h, kAnchors);
  auto pf = make_problem<float>(9, h, kAnchors);
  std::vector<double> gd(pd.layout->total, 0.0);
  std::vector<float> gf(pf.layout->total, 0.0f);
  test::expect_float32_step_agrees(step_of(pd, &gd), gd, step_of(pf, &gf), gf);
}

// OBJECTIVES.md §4: with W2 = 0, F = U, so the loss does not depend on λ and equals DFlash's with
// the same γ (non-shift; our denominator has no +1e-6), and so do the backbone's gradients.
TEST(Domino, ZeroW2GivesTheDFlashLossWhateverLambda) {
  auto p = make_problem<double>(21, HeadOpts{false, 0, 0.0}, kAnchors);
  const ParamInfo& w2 = p.layout->find("embed_proj.2.weight");
  std::fill_n(p.params.begin() + w2.offset, w2.numel, 0.0);
  // The DFlash drafter of the same sizes: the same tensors at the same offsets, no head.
  DrafterConfig plain = p.cfg;
  plain.domino = {};
  const DrafterLayout pl(plain);
  Objective dflash_obj;
  DrafterBatch b(p.cfg.block_size);
  b.objective = dflash_obj;
  b.append_row(
      p.tokens, p.doc_offsets, p.anchors,
      block_targets(p.tokens, p.mask, p.doc_offsets, p.anchors, p.cfg.block_size, p.gamma));
  auto ws = std::make_unique<DrafterWorkspace<double>>();
  std::vector<double> gd(pl.total, 0.0);
  const DrafterTrainResult rd =
      drafter_train_step<double>(plain, pl, p.params.data(), gd.data(), p.tables(), b,
                                 p.features.data(), 1.0 / b.weight_sum, *ws);
  for (double lambda : {0.0, 0.37, 1.0}) {
    p.obj.domino_lambda = lambda;
    std::vector<double> g(p.layout->total, 0.0);
    const DrafterTrainResult r = step_of(p, &g);
    EXPECT_DOUBLE_EQ(r.weight_sum, rd.weight_sum);
    EXPECT_NEAR(r.loss_sum / r.weight_sum, rd.loss_sum / rd.weight_sum, 1e-12) << lambda;
    EXPECT_NEAR(r.domino_final_ce_sum, r.domino_base_ce_sum, 1e-12);
    double worst = 0;
    for (int64_t i = 0; i < pl.total; ++i) worst = std::max(worst, std::abs(g[i] - gd[i]));
    EXPECT_LT(worst, 1e-12) << lambda;
  }
}

// OBJECTIVES.md §4: F_k does not change when x[a+j] changes for j ≥ k (no shift; k ≥ 1, slot 0
// being the anchor's own token) or for j > k (shift), and does change for the token just before.
TEST(Domino, CorrectedLogitsAreCausal) {
  for (bool shift : {false, true}) {
    auto p = make_problem<double>(31, HeadOpts{shift, 0, 0.5}, {{0, 0}});
    const int64_t K = p.cfg.block_size, V = p.cfg.vocab_size;
    auto ws = std::make_unique<DrafterWorkspace<double>>();
    const std::vector<double> ref = logits_of(p, *ws);
    const int first = shift ? 0 : 1;
    for (int k = first; k < K; ++k) {
      const int j_free = shift ? k + 1 : k;  // the first position F_k must not read
      for (int j = 1; j < K; ++j) {
        auto q = p;
        q.tokens[j] = (q.tokens[j] + 1) % (static_cast<int32_t>(V) - 1);
        const std::vector<double> out = logits_of(q, *ws);
        double diff = 0;
        for (int64_t v = 0; v < V; ++v)
          diff = std::max(diff, std::abs(out[k * V + v] - ref[k * V + v]));
        if (j >= j_free) {
          EXPECT_EQ(diff, 0.0) << "shift " << shift << " slot " << k << " position " << j;
        } else if (j == j_free - 1 && j >= 1) {
          EXPECT_GT(diff, 1e-6) << "shift " << shift << " slot " << k << " position " << j;
        }
      }
    }
  }
}

// OBJECTIVES.md §4: the decoder's sequential rollout (domino_block_start, domino_feed of the
// anchor and then each slot's ground-truth token, domino_slot_logits) reproduces the training F
// bit for bit, both shift settings, with a base-only prefix.
TEST(Domino, TeacherForcedSequentialRolloutReproducesTheTrainingLogits) {
  for (bool shift : {false, true}) {
    auto p = make_problem<float>(17, HeadOpts{shift, 1, 0.5}, kAnchors);
    auto ws = std::make_unique<DrafterWorkspace<float>>();
    const std::vector<float> block = logits_of(p, *ws);
    const int64_t K = p.cfg.block_size, V = p.cfg.vocab_size, H = p.cfg.hidden_size;
    const int first = shift ? 0 : 1;
    DominoSlotState st;
    int rows = 0;
    double corrected = 0;
    for (size_t blk = 0; blk < kAnchors.size(); ++blk) {
      const Anchor& a = kAnchors[blk];
      const int64_t end = p.doc_offsets[a.doc + 1];
      std::vector<float> base(K * V);
      linear_fwd_cpu(base.data(), ws->hf.data() + blk * K * H, p.head.data(), nullptr, K, H, V);
      domino_block_start(p.cfg, st);
      for (int64_t k = first; k < K; ++k) {
        // The proposal of slot k follows the tokens x[a..a+s(k)], all fed by now.
        const int64_t fed_until = a.pos + p.cfg.domino.state_of_slot(static_cast<int>(k));
        if (fed_until >= end) break;
        while (a.pos + st.fed <= fed_until) {
          domino_feed(p.cfg, *p.layout, p.params.data(), p.embed.data(), p.tokens[a.pos + st.fed],
                      st);
        }
        std::vector<float> row(base.begin() + k * V, base.begin() + (k + 1) * V);
        domino_slot_logits(p.cfg, *p.layout, p.params.data(), row.data(),
                           ws->hf.data() + (blk * K + k) * H, static_cast<int>(k), st);
        const float* want = block.data() + (blk * K + k) * V;
        EXPECT_TRUE(std::equal(row.begin(), row.end(), want)) << "block " << blk << " slot " << k;
        for (int64_t v = 0; v < V; ++v) {
          corrected = std::max(corrected, std::abs(double(row[v]) - base[k * V + v]));
        }
        ++rows;
      }
    }
    EXPECT_GT(rows, 12);
    EXPECT_GT(corrected, 1e-2);  // the head does correct the logits
  }
}

// OBJECTIVES.md §4 and SpecForge's linear_lambda_base: λ(0) = λ0, linear to 0 at ⌊T·r⌋, 0 after,
// clipped to [0, 1]; no horizon gives 0.
TEST(Domino, LambdaScheduleStartsAtLambda0AndReachesZeroAtTheHorizon) {
  EXPECT_EQ(domino_lambda(0, 100, 1.0, 0.5), 1.0);
  EXPECT_EQ(domino_lambda(0, 100, 0.7, 0.5), 0.7);
  EXPECT_DOUBLE_EQ(domino_lambda(25, 100, 1.0, 0.5), 0.5);
  EXPECT_NEAR(domino_lambda(49, 100, 1.0, 0.5), 1.0 / 50.0, 1e-15);
  for (int64_t t : {50, 51, 99, 100, 1000}) EXPECT_EQ(domino_lambda(t, 100, 1.0, 0.5), 0.0) << t;
  // ⌊T·r⌋: 7·0.5 = 3.5 → 3 steps.
  EXPECT_NEAR(domino_lambda(2, 7, 0.9, 0.5), 0.9 / 3.0, 1e-15);
  EXPECT_EQ(domino_lambda(3, 7, 0.9, 0.5), 0.0);
  // A horizon below one step is one step.
  EXPECT_EQ(domino_lambda(0, 1, 1.0, 0.5), 1.0);
  EXPECT_EQ(domino_lambda(1, 1, 1.0, 0.5), 0.0);
  EXPECT_EQ(domino_lambda(0, 0, 1.0, 0.5), 0.0);  // no horizon
}

TEST(Domino, LayoutNamesTheHeadAsSpecForge) {
  auto p = make_problem<float>(1, HeadOpts{}, kAnchors);
  const auto& L = *p.layout;
  EXPECT_EQ(L.find("prefix_gru.weight_ih_l0").shape, (std::vector<int64_t>{15, 16}));
  EXPECT_EQ(L.find("prefix_gru.weight_hh_l0").shape, (std::vector<int64_t>{15, 5}));
  EXPECT_EQ(L.find("embed_proj.0.weight").shape, (std::vector<int64_t>{6, 16 + 5}));
  EXPECT_EQ(L.find("embed_proj.2.weight").shape, (std::vector<int64_t>{23, 6}));
  EXPECT_EQ(L.params.back().name, "embed_proj.2.weight");
  // The DFlash tensors come first, at the offsets and with the values of a plain drafter.
  DrafterConfig plain = p.cfg;
  plain.domino = {};
  const DrafterLayout pl(plain);
  EXPECT_EQ(L.domino.gru_ih, pl.total);
  std::vector<float> a(pl.total), b(L.total);
  drafter_init(a, pl, 5);
  drafter_init(b, L, 5);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
}

TEST(Domino, ConfigValidationNamesTheField) {
  auto p = make_problem<float>(1, HeadOpts{}, kAnchors);
  DrafterConfig c = p.cfg;
  c.domino.emb_dim = 0;
  EXPECT_THAT_ERROR(c.validate(), "emb_dim must be > 0");
  c = p.cfg;
  c.domino.gru_hidden_dim = -1;
  EXPECT_THAT_ERROR(c.validate(), "gru_hidden_dim must be > 0");
  c = p.cfg;
  c.domino.pure_draft_prefix_len = 4;  // K = 5: slots 1 + 4 = 5 ≥ K
  EXPECT_THAT_ERROR(c.validate(), "pure_draft_prefix_len 4 leaves no corrected slot");
  c.domino.shift_label = true;  // suffix_start 4 < 5
  c.validate();
  c = p.cfg;
  c.domino.enabled = false;
  EXPECT_THAT_ERROR(c.validate(), "projector_type is not domino");
  c = p.cfg;
  c.dspark.enabled = true;
  EXPECT_THAT_ERROR(c.validate(), "both the DSpark and the Domino head");
  // The CUDA drafter runs the head (model/domino_head_cuda): only this drafter's head_dim 8 is
  // refused.
  const std::vector<std::string> cuda = cuda_drafter_unsupported(p.cfg);
  ASSERT_EQ(cuda.size(), 1u);
  EXPECT_THAT(cuda[0], ::testing::HasSubstr("head_dim 64 or 128 (drafter head_dim 8)"));
  // Batches of another objective or shift setting are refused by the step.
  Problem<double> d = make_problem<double>(2, HeadOpts{}, kAnchors);
  auto ws = std::make_unique<DrafterWorkspace<double>>();
  Problem<double> shifted = d;
  shifted.obj.domino_shift_label = true;
  const DrafterBatch sb = shifted.batch();
  EXPECT_THAT_ERROR(drafter_train_step<double>(d.cfg, *d.layout, d.params.data(), nullptr,
                                               d.tables(), sb, d.features.data(), 1.0, *ws),
                    "a batch of the domino objective (shift_label true)");
  Problem<double> flash = d;
  flash.obj = Objective{};
  DrafterBatch fb(d.cfg.block_size);
  fb.objective = flash.obj;
  fb.append_row(d.tokens, d.doc_offsets, d.anchors,
                block_targets(d.tokens, d.mask, d.doc_offsets, d.anchors, d.cfg.block_size, 4.0));
  EXPECT_THAT_ERROR(drafter_train_step<double>(d.cfg, *d.layout, d.params.data(), nullptr,
                                               d.tables(), fb, d.features.data(), 1.0, *ws),
                    "for a drafter with the Domino head");
  d.obj.domino_lambda = 1.5;
  const DrafterBatch lb = d.batch();
  EXPECT_THAT_ERROR(drafter_train_step<double>(d.cfg, *d.layout, d.params.data(), nullptr,
                                               d.tables(), lb, d.features.data(), 1.0, *ws),
                    "lambda 1.5 outside [0, 1]");
}

TEST(Domino, RolloutStepsAreChecked) {
  auto p = make_problem<float>(3, HeadOpts{false, 0, 0.5}, kAnchors);
  std::vector<float> logits(p.cfg.vocab_size, 0.0f), h(p.cfg.hidden_size, 0.5f);
  DominoSlotState st;
  domino_block_start(p.cfg, st);
  // Slot 1 reads g_0: the anchor must have been fed.
  EXPECT_THAT_ERROR(
      domino_slot_logits(p.cfg, *p.layout, p.params.data(), logits.data(), h.data(), 1, st),
      "slot 1 reads the state after 1 tokens, the GRU has read 0");
  EXPECT_THAT_ERROR(
      domino_feed(p.cfg, *p.layout, p.params.data(), p.embed.data(), p.cfg.vocab_size, st),
      "outside [0, 23)");
  for (int i = 0; i < p.cfg.block_size - 1; ++i) {
    domino_feed(p.cfg, *p.layout, p.params.data(), p.embed.data(), 3, st);
  }
  EXPECT_THAT_ERROR(domino_feed(p.cfg, *p.layout, p.params.data(), p.embed.data(), 3, st),
                    "has read all its 4 tokens");
}

// The CUDA head's host-side row index (model/domino_head_cuda.hpp): block b's GRU input j at row
// b·K + j + off (off 1 without shift_label), the token x[a+j] (0 past the document end), −1 on
// rows without an input and on padding blocks; λ carried; bad inputs refused by name.
TEST(Domino, CudaRowIndexPlacesEachGruInputAtItsReadersRow) {
  int past_end = 0;  // GRU inputs past their document's end (shift_label true reads one more)
  for (bool shift : {false, true}) {
    auto p = make_problem<float>(3, HeadOpts{shift, 1, 0.25}, kAnchors);
    const DrafterBatch b = p.batch();
    const int64_t K = p.cfg.block_size, NK = b.N() * K, off = shift ? 0 : 1;
    const DominoRowIndex x = domino_row_index(p.cfg, b, NK + 2 * K);
    ASSERT_EQ(static_cast<int64_t>(x.gru_tok.size()), NK + 2 * K);
    EXPECT_EQ(x.lambda, 0.25);
    for (int64_t row = 0; row < NK + 2 * K; ++row) {
      const int64_t j = row % K - off;
      int32_t want = -1;
      if (row < NK && j >= 0 && j < p.cfg.domino.gru_steps(p.cfg.block_size)) {
        const Anchor& a = b.anchors[static_cast<size_t>(row / K)];
        const int64_t pos = a.pos + j;
        const bool inside = pos < b.doc_offsets[static_cast<size_t>(a.doc) + 1];
        past_end += inside ? 0 : 1;
        want = inside ? b.tokens[static_cast<size_t>(pos)] : 0;
      }
      EXPECT_EQ(x.gru_tok[static_cast<size_t>(row)], want) << "row " << row << " shift " << shift;
    }
    EXPECT_THAT_ERROR(domino_row_index(p.cfg, b, NK + 1), "must be whole blocks");
    DrafterBatch wrong = b;
    wrong.objective.domino_shift_label = !shift;
    EXPECT_THAT_ERROR(domino_row_index(p.cfg, wrong, NK), "shift_label");
    wrong = b;
    wrong.objective.domino_lambda = 1.5;
    EXPECT_THAT_ERROR(domino_row_index(p.cfg, wrong, NK), "lambda 1.5 outside [0, 1]");
  }
  EXPECT_GT(past_end, 0);  // blocks that run past their document are exercised
  // Chunks are whole blocks: 12 rows of blocks of 5 are 10, fewer than a block are one block.
  auto p = make_problem<float>(4, HeadOpts{}, kAnchors);
  EXPECT_EQ(domino_chunk_rows(p.cfg, 100, 12), 10);
  EXPECT_EQ(domino_chunk_rows(p.cfg, 100, 3), 5);
  EXPECT_EQ(domino_chunk_rows(p.cfg, 15, 8192), 15);
}
