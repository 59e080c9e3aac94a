// Tests of the DFlash2 objective on the CPU reference (src/model/dflash2_conv, dflash2_selector,
// the DFlash2 path of drafter_train_step): the conv against a naive per-tap loop and its
// causality, the identity start against plain DFlash, float64 finite differences of every
// DFlash2 parameter (and a few of the backbone's) through the whole step, and the selector's
// properties of ../shared/OBJECTIVES.md §4 (top-K of the transformed logits = top-K of the raw
// ones; K = 1 gives selector CE 0 when the gold is the top-1; identity ⇒ walk = per-slot argmax).
// The step's tests run for each training.loss_type: with a D-PACE one the base is plain D-PACE on
// ū and the selector's CE takes the same per-slot weights (the identity start then equals plain
// D-PACE; the gradients are those of the loss with the weights frozen; chunks hold whole blocks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.hpp"
#include "model/dflash2_conv.hpp"
#include "model/dflash2_selector.hpp"
#include "model/drafter.hpp"
#include "util/drafter_problem.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

struct Sizes {
  int T = 3, group = 4, rank = 3, top_k = 5;
  double m = 1.0, cap = 0.0;
};

// A small random DFlash2 problem (test::DrafterProblem: one row of two documents plus a document
// without anchors, the target's features) with its γ. `dflash2` false gives the plain DFlash
// drafter of the same sizes, whose parameters are the DFlash2 drafter's first ones (DFlash2's
// tensors follow them in the layout).
template <typename S>
struct Problem : test::DrafterProblem<S> {
  explicit Problem(test::DrafterProblem<S> base) : test::DrafterProblem<S>(std::move(base)) {}
  double gamma = 4.0;

  // dflash's targets; a D-PACE loss ignores γ (drafter_row_targets): its static weights are the
  // mask.
  DrafterBatch batch() const {
    return test::DrafterProblem<S>::batch(block_targets(this->tokens, this->mask, this->doc_offsets,
                                                        this->anchors, this->cfg.block_size,
                                                        this->obj.dpace() ? 0.0 : gamma));
  }
};

const std::vector<Anchor> kAnchors = {{1, 0}, {5, 0}, {6, 0}, {12, 1}, {17, 1}};

// `random_dflash2`: DFlash2's tensors random too (else drafter_init's identity start).
template <typename S>
Problem<S> make_problem(uint64_t seed, bool dflash2, Sizes z, bool random_dflash2 = true,
                        double alpha = 0.7, int K = 4, int H = 16, int V = 23) {
  DrafterConfig cfg = test::small_drafter_config(K, H, V);
  Objective obj;
  if (dflash2) {
    cfg.dflash2 = {true, z.T, z.group, z.rank, z.top_k, z.m, z.cap};
    obj.kind = ObjectiveKind::dflash2;
    obj.dflash2_selector_alpha = alpha;
  }
  cfg.validate();
  const DrafterLayout layout(cfg);
  std::vector<float> init(static_cast<size_t>(layout.total));
  drafter_init(init, layout, seed);  // DFlash2's identity start
  auto identity = [&](const ParamInfo& info) {
    const bool extra = info.name.find("_conv.") != std::string::npos ||
                       info.name.rfind("candidate_selector", 0) == 0;
    return extra && !random_dflash2;
  };
  Rng rng(seed);
  Problem<S> p(test::draw_drafter_problem<S>(rng, std::move(cfg), kAnchors, {}, identity, init));
  p.obj = obj;
  return p;
}

template <typename S>
DrafterTrainResult step_of(const Problem<S>& p, std::vector<S>* grads) {
  return test::drafter_problem_step(p, p.batch(), grads);
}

// The loss types of training.loss_type; DFlash2's base takes each.
constexpr LossType kLossTypes[] = {LossType::dflash, LossType::dpace,
                                   LossType::dpace_cumulative_confidence_only,
                                   LossType::dpace_continuation_value_only};

// `p` with loss type `loss` (D-PACE's α 0.3).
template <typename S>
Problem<S> with_loss(Problem<S> p, LossType loss) {
  p.obj.loss = loss;
  p.obj.dpace_alpha = 0.3;
  return p;
}

// The base CE [N·K] of every supervised slot of `b`, CE(ū_k, y_k) from drafter_block_logits (the
// unary logits for DFlash2), 0 elsewhere.
std::vector<double> base_ce_of(const Problem<double>& p, const DrafterBatch& b) {
  auto ws = std::make_unique<DrafterWorkspace<double>>();
  const std::vector<double> u = drafter_block_logits<double>(p.cfg, *p.layout, p.params.data(),
                                                             p.tables(), b, p.features.data(), *ws);
  const int64_t V = p.cfg.vocab_size, NK = b.N() * b.block_size;
  std::vector<double> ce(static_cast<size_t>(NK), 0.0);
  for (int64_t i = 0; i < NK; ++i) {
    if (!b.targets.counted[i]) continue;
    const double* ui = u.data() + i * V;
    const double mx = *std::max_element(ui, ui + V);
    double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(ui[v] - mx);
    ce[i] = mx + std::log(z) - ui[b.targets.labels[i]];
  }
  return ce;
}

// Each slot's loss weight [N·K] written out from OBJECTIVES.md §1.1 for a D-PACE loss type (per
// block: s_k = (1−α)·exp(−CE_k) + α on supervised slots, P_k = Π_{j≤k} s_j, R_k = Σ_{j≥k,
// supervised} P_j; w_k = R_k | P_k | R_k/P_k), the static weight for dflash; 0 on unsupervised
// slots.
std::vector<double> slot_weights_of(const DrafterBatch& b, const std::vector<double>& ce) {
  const int64_t K = b.block_size, NK = b.N() * K;
  const Objective& o = b.objective;
  std::vector<double> w(static_cast<size_t>(NK), 0.0);
  for (int64_t blk = 0; blk < b.N(); ++blk) {
    std::vector<double> P(static_cast<size_t>(K)), R(static_cast<size_t>(K));
    double prefix = 1, suffix = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = blk * K + k;
      if (b.targets.counted[i]) prefix *= (1 - o.dpace_alpha) * std::exp(-ce[i]) + o.dpace_alpha;
      P[k] = prefix;
    }
    for (int64_t k = K - 1; k >= 0; --k) {
      const int64_t i = blk * K + k;
      if (b.targets.counted[i]) suffix += P[k];
      R[k] = suffix;
      if (!b.targets.counted[i]) continue;
      switch (o.loss) {
        case LossType::dflash:
          w[i] = b.targets.weights[i];
          break;
        case LossType::dpace:
          w[i] = R[k];
          break;
        case LossType::dpace_cumulative_confidence_only:
          w[i] = P[k];
          break;
        case LossType::dpace_continuation_value_only:
          w[i] = R[k] / P[k];
          break;
      }
    }
  }
  return w;
}

// `b` as a dflash-loss batch whose static weights are `w` (rounded to float): the DFlash2 loss
// with the weights held fixed (the sequences stay the D-PACE losses' denominator through
// loss_normaliser of `b`).
DrafterBatch frozen_batch(const DrafterBatch& b, const std::vector<double>& w) {
  DrafterBatch f = b;
  f.objective.loss = LossType::dflash;
  f.weight_sum = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    f.targets.weights[i] = static_cast<float>(w[i]);
    f.weight_sum += f.targets.weights[i];
  }
  return f;
}

// The conv written as the formula reads, one output at a time (model/dflash2_conv.hpp).
std::vector<double> naive_conv(const std::vector<double>& x, const std::vector<double>& base,
                               const std::vector<double>& delta, int side,
                               const Dflash2ConvShape& s) {
  std::vector<double> out(x.size(), 0.0);
  const int64_t G = s.groups();
  for (int64_t blk = 0; blk < s.rows / s.block; ++blk) {
    for (int64_t j = 0; j < s.block; ++j) {
      for (int64_t c = 0; c < s.H; ++c) {
        double sum = 0;
        for (int64_t t = 0; t < s.taps; ++t) {
          if (j - t < 0) continue;  // the tap would reach the previous block
          const int64_t i = blk * s.block + j;
          const double w = base[(side * s.taps + t) * s.H + c] +
                           delta[i * s.delta_width() + (side * s.taps + t) * G + c / s.group];
          sum += w * x[(i - t) * s.H + c];
        }
        out[(blk * s.block + j) * s.H + c] = sum;
      }
    }
  }
  return out;
}

std::vector<double> randn(Rng& rng, size_t n) {
  std::vector<double> v(n);
  for (double& x : v) x = rng.normal();
  return v;
}

}  // namespace

TEST(Dflash2Conv, MatchesANaivePerTapLoop) {
  Rng rng(3);
  const Dflash2ConvShape s{3 * 5, 12, 5, 3, 4};
  const std::vector<double> x = randn(rng, s.rows * s.H);
  const std::vector<double> base = randn(rng, 2 * s.taps * s.H);
  const std::vector<double> delta = randn(rng, s.rows * s.delta_width());
  for (int side : {0, 1}) {
    std::vector<double> out(x.size());
    dflash2_conv_fwd(out.data(), x.data(), base.data() + side * s.taps * s.H, delta.data(), side,
                     s);
    const std::vector<double> ref = naive_conv(x, base, delta, side, s);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-12) << side << " " << i;
  }
}

// Perturbing the sublayer input at row i (through the taps and through δ = W_kp·u) changes the
// pre-conv only at rows i .. i+T−1 of the same block (never an earlier slot or another block).
TEST(Dflash2Conv, PerturbingARowLeavesEarlierSlotsAndOtherBlocksUnchanged) {
  Rng rng(5);
  const Dflash2ConvShape s{3 * 4, 8, 4, 3, 2};
  const std::vector<double> u = randn(rng, s.rows * s.H);
  const std::vector<double> base = randn(rng, 2 * s.taps * s.H);
  const std::vector<double> w_kp = randn(rng, s.delta_width() * s.H);
  Dflash2ConvActs<double> acts;
  std::vector<double> ref = u;
  dflash2_conv_pre(ref.data(), acts, base.data(), w_kp.data(), s);
  for (int64_t i = 0; i < s.rows; ++i) {
    std::vector<double> v = u;
    for (int64_t c = 0; c < s.H; ++c) v[i * s.H + c] += 0.5 + 0.1 * static_cast<double>(c);
    dflash2_conv_pre(v.data(), acts, base.data(), w_kp.data(), s);
    for (int64_t r = 0; r < s.rows; ++r) {
      const bool same_block = r / s.block == i / s.block;
      bool changed = false;
      for (int64_t c = 0; c < s.H; ++c) changed |= v[r * s.H + c] != ref[r * s.H + c];
      // Rows i .. i+T−1 of the block read row i (their taps 0 .. T−1); no other row does.
      EXPECT_EQ(changed, same_block && r >= i && r < i + s.taps)
          << "perturbed row " << i << ", row " << r;
    }
  }
}

// OBJECTIVES.md §4: at the identity start (β = e₀, W_kp = 0, Bs = 0, m = 1, no softcap) the
// forward and the base loss are plain DFlash's, whatever A and P_h hold (the selector's CE adds
// to the loss, not to the base); with a D-PACE loss type the base is plain D-PACE's (the same
// weights of the same CE, the same denominator), so that with α_sel = 0 the whole step is.
TEST(Dflash2, IdentityStartEqualsPlainDflashAndDpace) {
  for (const LossType loss : kLossTypes) {
    SCOPED_TRACE(loss_type_name(loss));
    const auto d2 = with_loss(make_problem<double>(7, true, Sizes{}, false), loss);
    const auto d1 = with_loss(make_problem<double>(7, false, Sizes{}), loss);
    ASSERT_EQ(d2.layout->find("norm.weight").offset, d1.layout->find("norm.weight").offset);
    for (int64_t i = 0; i < d1.layout->total; ++i) ASSERT_EQ(d2.params[i], d1.params[i]) << i;
    auto ws1 = std::make_unique<DrafterWorkspace<double>>();
    auto ws2 = std::make_unique<DrafterWorkspace<double>>();
    const std::vector<double> l1 = drafter_block_logits<double>(
        d1.cfg, *d1.layout, d1.params.data(), d1.tables(), d1.batch(), d1.features.data(), *ws1);
    const std::vector<double> l2 = drafter_block_logits<double>(
        d2.cfg, *d2.layout, d2.params.data(), d2.tables(), d2.batch(), d2.features.data(), *ws2);
    EXPECT_EQ(l1, l2);  // bit for bit: the identity conv adds exact zeros
    std::vector<double> g1(d1.layout->total, 0.0), g2(d2.layout->total, 0.0);
    const DrafterTrainResult r1 = step_of(d1, &g1);
    const DrafterTrainResult r2 = step_of(d2, &g2);
    EXPECT_NEAR(r2.dflash2_base_sum, r1.loss_sum, 1e-12 * r1.loss_sum);
    EXPECT_NEAR(r2.weight_sum, r1.weight_sum, 1e-12 * r1.weight_sum);
    EXPECT_EQ(r2.argmax, r1.argmax);
    EXPECT_GT(r2.dflash2_selector_sum, 0.0);
    EXPECT_EQ(d2.batch().loss_normaliser(), d1.batch().loss_normaliser());
    // With α_sel = 0 the whole step is DFlash's (D-PACE's): the backbone's gradients agree.
    auto d0 = with_loss(make_problem<double>(7, true, Sizes{}, false, /*alpha=*/0.0), loss);
    std::vector<double> g0(d0.layout->total, 0.0);
    const DrafterTrainResult r0 = step_of(d0, &g0);
    EXPECT_NEAR(r0.loss_sum, r1.loss_sum, 1e-12 * r1.loss_sum);
    for (int64_t i = 0; i < d1.layout->total; ++i) {
      EXPECT_NEAR(g0[i], g1[i], 1e-12 + 1e-9 * std::abs(g1[i])) << i;
    }
  }
  // The D-PACE base is not the dflash one: its weights differ from γ's (the check above can fail).
  const auto a = with_loss(make_problem<double>(7, true, Sizes{}, false), LossType::dflash);
  const auto b = with_loss(make_problem<double>(7, true, Sizes{}, false), LossType::dpace);
  EXPECT_GT(
      std::abs(step_of<double>(a, nullptr).weight_sum - step_of<double>(b, nullptr).weight_sum),
      1e-3);
}

// The whole drafter + DFlash2 loss against central differences in float64: every coordinate of
// the conv tensors of layer 0 and of the selector's P_h, the rows of A of the predecessors the
// batch reads, the rows of Bs of the candidates, and a few of every other tensor; with and
// without the softcap and multiplier; for each loss type. D-PACE's weights are constants of the
// step: its gradient is that of the loss with the weights frozen at the step's values (slot
// weights written out here from the base CE), over the sequences; the step's loss is that loss.
TEST(Dflash2, GradientsMatchFiniteDifferencesInFloat64) {
  for (const LossType lt : kLossTypes) {
    for (const Sizes z : {Sizes{}, Sizes{2, 8, 2, 4, 0.7, 1.5}}) {
      SCOPED_TRACE(loss_type_name(lt));
      auto p = with_loss(make_problem<double>(11, true, z), lt);
      const DrafterBatch b = p.batch();
      // The loss with the weights frozen: a dflash batch whose static weights are the step's.
      const DrafterBatch frozen = frozen_batch(b, slot_weights_of(b, base_ce_of(p, b)));
      const double denom = b.loss_normaliser();
      std::vector<double> g(p.layout->total, 0.0);
      const DrafterTrainResult base = step_of(p, &g);
      ASSERT_GT(base.weight_sum, 0);
      ASSERT_GT(base.dflash2_in_topk_weight, 0);
      const DrafterTrainResult fr = test::drafter_problem_step<double>(p, frozen, nullptr);
      EXPECT_NEAR(base.loss_sum, fr.loss_sum, 1e-6 * fr.loss_sum);  // float-rounded frozen weights
      EXPECT_NEAR(base.weight_sum, fr.weight_sum, 1e-6 * fr.weight_sum);
      auto loss = [&] {
        const DrafterTrainResult r = test::drafter_problem_step<double>(p, frozen, nullptr);
        return r.loss_sum / denom;
      };
      Rng pick(13);
      double worst = 0;
      int nonzero = 0;
      for (const auto& info : p.layout->params) {
        const bool conv0 =
            info.name.rfind("layers.0.", 0) == 0 && info.name.find("_conv.") != std::string::npos;
        const bool all = conv0 || info.name.rfind("candidate_selector", 0) == 0;
        const int64_t n = all ? info.numel : 3;
        for (int64_t s = 0; s < n; ++s) {
          const int64_t i = info.offset + (all ? s : static_cast<int64_t>(pick.below(info.numel)));
          const double eps = 1e-5, old = p.params[i];
          p.params[i] = old + eps;
          const double lp = loss();
          p.params[i] = old - eps;
          const double lm = loss();
          p.params[i] = old;
          const double fd = (lp - lm) / (2 * eps);
          // Relative error, with a floor of 1e-5 on the scale (the FD's rounding noise is ~1e-10).
          const double err = std::abs(fd - g[i]) / (std::abs(fd) + std::abs(g[i]) + 1e-5);
          worst = std::max(worst, err);
          nonzero += std::abs(g[i]) > 1e-8;
          EXPECT_LT(err, 1e-5) << info.name << " [" << i - info.offset << "] fd " << fd
                               << " analytic " << g[i];
        }
      }
      EXPECT_LT(worst, 1e-5);
      EXPECT_GT(nonzero, 100);
    }
  }
}

// stop_gradient: the selector's CE reaches A, Bs and P_h only; the backbone's gradients are the
// base loss's (those of α_sel = 0).
TEST(Dflash2, StopGradientKeepsTheSelectorOffTheBackbone) {
  auto ps = make_problem<double>(17, true, Sizes{});
  ps.obj.dflash2_stop_gradient = true;
  auto p0 = make_problem<double>(17, true, Sizes{}, true, /*alpha=*/0.0);
  auto pf = make_problem<double>(17, true, Sizes{});
  std::vector<double> gs(ps.layout->total, 0.0), g0(gs), gf(gs);
  step_of(ps, &gs);
  step_of(p0, &g0);
  step_of(pf, &gf);
  const int64_t selector = ps.layout->dflash2.predecessor;  // the selector's tensors come last
  double backbone_diff = 0, free_diff = 0, selector_grad = 0;
  for (int64_t i = 0; i < selector; ++i) {
    backbone_diff = std::max(backbone_diff, std::abs(gs[i] - g0[i]));
    free_diff = std::max(free_diff, std::abs(gf[i] - g0[i]));
  }
  for (int64_t i = selector; i < ps.layout->total; ++i) {
    selector_grad = std::max(selector_grad, std::abs(gs[i]));
    EXPECT_EQ(gs[i], gf[i]) << i;
  }
  EXPECT_EQ(backbone_diff, 0.0);
  EXPECT_GT(free_diff, 1e-6);  // without stop_gradient the selector does reach the backbone
  EXPECT_GT(selector_grad, 1e-6);
}

// The float32 step (training) agrees with float64.
TEST(Dflash2, Float32StepAgreesWithFloat64) {
  const Sizes z{2, 8, 2, 4, 0.7, 1.5};
  auto pd = make_problem<double>(9, true, z);
  auto pf = make_problem<float>(9, true, z);
  std::vector<double> gd(pd.layout->total, 0.0);
  std::vector<float> gf(pf.layout->total, 0.0f);
  test::expect_float32_step_agrees(step_of(pd, &gd), gd, step_of(pf, &gf), gf);
}

// OBJECTIVES.md §4: the transform softcap(m·z) is monotone for m > 0, so the top-K of the
// transformed logits is the top-K of the raw ones (ties, which the softcap can create in float,
// aside: the raw values here are well apart).
TEST(Dflash2Selector, TopKOfTransformedLogitsIsTopKOfRawLogits) {
  Rng rng(21);
  const int64_t V = 500;
  std::vector<double> raw(V);
  for (int64_t v = 0; v < V; ++v) raw[v] = 3.0 * rng.normal();
  for (auto [m, cap] : {std::pair{1.0, 0.0}, {0.19611613513818404, 20.0}, {4.0, 3.0}}) {
    std::vector<double> u(V);
    for (int64_t v = 0; v < V; ++v) u[v] = dflash2_unary(raw[v], m, cap);
    std::vector<int32_t> a, b;
    dflash2_topk(a, raw.data(), V, 16);
    dflash2_topk(b, u.data(), V, 16);
    EXPECT_EQ(a, b) << m << " " << cap;
    // And the top-K is the K largest, in descending order.
    std::vector<int32_t> order(V);
    for (int32_t v = 0; v < V; ++v) order[v] = v;
    std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return raw[x] > raw[y]; });
    EXPECT_EQ(a, std::vector<int32_t>(order.begin(), order.begin() + 16));
  }
}

// OBJECTIVES.md §4: with K = 1 the selector's CE is 0 on every slot whose gold is the top-1 (and
// the slots whose gold is not a candidate contribute nothing).
TEST(Dflash2Selector, TopOneGivesSelectorCeZero) {
  auto p = make_problem<double>(23, true, Sizes{3, 4, 3, /*top_k=*/1});
  // Plant the gold as the unary top-1 of some rows: a huge LM-head logit is not possible per row,
  // so count instead: every supervised slot whose argmax is its label has the gold in C_k.
  const DrafterTrainResult r = step_of<double>(p, nullptr);
  const DrafterBatch b = p.batch();
  double hit_weight = 0;
  for (size_t i = 0; i < r.argmax.size(); ++i) {
    if (b.targets.counted[i] && r.argmax[i] == b.targets.labels[i]) {
      hit_weight += b.targets.weights[i];
    }
  }
  ASSERT_GT(hit_weight, 0);
  EXPECT_EQ(r.dflash2_selector_sum, 0.0);
  EXPECT_DOUBLE_EQ(r.dflash2_in_topk_weight, hit_weight);
  EXPECT_NEAR(r.loss_sum, r.dflash2_base_sum, 0.0);
}

// OBJECTIVES.md §4: at the identity start (Bs = 0) the walk's greedy choice is the slot's argmax
// whatever the predecessor, and sampling puts softmax(ū/T) on C_k.
TEST(Dflash2Selector, IdentityWalkIsThePerSlotArgmax) {
  auto p = make_problem<float>(29, true, Sizes{2, 4, 3, 5}, /*random_dflash2=*/false);
  Rng rng(31);
  const int64_t V = p.cfg.vocab_size, H = p.cfg.hidden_size;
  Dflash2SlotScores s;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> logits(V), h(H);
    for (float& x : logits) x = static_cast<float>(2.0 * rng.normal());
    for (float& x : h) x = static_cast<float>(rng.normal());
    const auto prev = static_cast<int32_t>(rng.below(V));
    dflash2_slot_scores(p.cfg, *p.layout, p.params.data(), logits.data(), h.data(), prev, s);
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    EXPECT_EQ(dflash2_greedy(s), best);
    std::vector<double> q;
    dflash2_sampling_probs(q, s, V, 0.7);
    double z = 0;
    for (int32_t c : s.cand) z += std::exp((logits[c] - logits[best]) / 0.7);
    double total = 0;
    for (int64_t v = 0; v < V; ++v) {
      const bool cand = std::find(s.cand.begin(), s.cand.end(), v) != s.cand.end();
      EXPECT_NEAR(q[v], cand ? std::exp((logits[v] - logits[best]) / 0.7) / z : 0.0, 1e-6);
      total += q[v];
    }
    EXPECT_NEAR(total, 1.0, 1e-6);
  }
  // A trained successor codebook changes the choice with the predecessor (not a no-op).
  auto r = make_problem<float>(29, true, Sizes{2, 4, 3, 5}, /*random_dflash2=*/true);
  int differs = 0;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> logits(V), h(H);
    for (float& x : logits) x = static_cast<float>(0.05 * rng.normal());
    for (float& x : h) x = static_cast<float>(rng.normal());
    dflash2_slot_scores(r.cfg, *r.layout, r.params.data(), logits.data(), h.data(), 0, s);
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    differs += dflash2_greedy(s) != best;
  }
  EXPECT_GT(differs, 0);
}

// The selector's sums against the formula written out per slot: ū from the step's final-norm rows,
// C_k by a full sort, the teacher-forced predecessor x[a+k−1] read from the row's tokens, the
// K-way CE when the gold is a candidate and nothing otherwise, each slot weighted by the loss
// type's weight (dflash's static one, or D-PACE's of the block's base CE, written out here).
TEST(Dflash2Selector, SumsMatchTheFormulaPerSlot) {
  for (const LossType lt : kLossTypes) {
    SCOPED_TRACE(loss_type_name(lt));
    const Sizes z{2, 8, 3, 4, 0.7, 1.5};
    auto p = with_loss(make_problem<double>(37, true, z), lt);
    const DrafterBatch b = p.batch();
    const std::vector<double> weights = slot_weights_of(b, base_ce_of(p, b));
    auto ws = std::make_unique<DrafterWorkspace<double>>();
    const std::vector<double> u = drafter_block_logits<double>(
        p.cfg, *p.layout, p.params.data(), p.tables(), b, p.features.data(), *ws);
    const DrafterTrainResult r = step_of<double>(p, nullptr);
    const int64_t K = p.cfg.block_size, V = p.cfg.vocab_size, H = p.cfg.hidden_size;
    const int64_t rank = z.rank;
    const double* A = p.params.data() + p.layout->dflash2.predecessor;
    const double* Bs = p.params.data() + p.layout->dflash2.successor;
    const double* Ph = p.params.data() + p.layout->dflash2.hidden_proj;
    double sel = 0, in_topk = 0, base = 0;
    int outside = 0;
    for (int64_t i = 0; i < b.N() * K; ++i) {
      if (!b.targets.counted[i]) continue;
      const double w = weights[i];
      const double* ui = u.data() + i * V;
      const int32_t gold = b.targets.labels[i];
      double z_all = 0;
      for (int64_t v = 0; v < V; ++v) z_all += std::exp(ui[v]);
      base += w * (std::log(z_all) - ui[gold]);
      std::vector<int32_t> order(V);
      for (int32_t v = 0; v < V; ++v) order[v] = v;
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t x, int32_t y) { return ui[x] > ui[y]; });
      order.resize(z.top_k);
      if (std::find(order.begin(), order.end(), gold) == order.end()) {
        ++outside;
        continue;
      }
      const Anchor& a = b.anchors[i / K];
      const int32_t prev = p.tokens[a.pos + i % K - 1];
      const double* h = ws->hf.data() + i * H;
      double zs = 0, s_gold = 0;
      for (int32_t c : order) {
        double s = ui[c];
        for (int64_t q = 0; q < rank; ++q) {
          double ph = 0;
          for (int64_t e = 0; e < H; ++e) ph += Ph[q * H + e] * h[e];
          s += A[prev * rank + q] * ph * Bs[c * rank + q];
        }
        zs += std::exp(s);
        if (c == gold) s_gold = s;
      }
      sel += w * (std::log(zs) - s_gold);
      in_topk += w;
    }
    ASSERT_GT(outside, 0);  // some golds are outside C_k: they must add nothing
    ASSERT_GT(in_topk, 0);
    EXPECT_NEAR(r.dflash2_base_sum, base, 1e-10 * base);
    EXPECT_NEAR(r.dflash2_selector_sum, sel, 1e-10 * sel);
    EXPECT_DOUBLE_EQ(r.dflash2_in_topk_weight, in_topk);
    EXPECT_NEAR(r.loss_sum, base + p.obj.dflash2_selector_alpha * sel, 1e-10 * r.loss_sum);
  }
}

// Chunks of the LM head hold whole blocks: the step's loss (bit for bit) and gradients (to
// rounding) are the same at every chunk size, including sizes that do not divide the block rows
// (a D-PACE block split across two chunks would get the weights of its halves).
TEST(Dflash2, ChunkSizeChangesNoBitOfTheLoss) {
  for (const LossType lt : kLossTypes) {
    SCOPED_TRACE(loss_type_name(lt));
    const auto p = with_loss(make_problem<double>(41, true, Sizes{2, 8, 3, 4, 0.7, 1.5}), lt);
    const DrafterBatch b = p.batch();
    auto run = [&](int64_t chunk_rows, std::vector<double>& g) {
      auto ws = std::make_unique<DrafterWorkspace<double>>();
      ws->dflash2.chunk_rows = chunk_rows;
      return drafter_train_step<double>(p.cfg, *p.layout, p.params.data(), g.data(), p.tables(), b,
                                        p.features.data(), 1.0 / b.loss_normaliser(), *ws);
    };
    std::vector<double> g0(p.layout->total, 0.0);
    const DrafterTrainResult r0 = run(0, g0);  // one chunk
    const int64_t K = p.cfg.block_size;
    for (const int64_t chunk : {K, K + 1, 2 * K - 1}) {
      std::vector<double> g(p.layout->total, 0.0);
      const DrafterTrainResult r = run(chunk, g);
      EXPECT_EQ(r.loss_sum, r0.loss_sum) << chunk;
      EXPECT_EQ(r.weight_sum, r0.weight_sum) << chunk;
      EXPECT_EQ(r.dflash2_selector_sum, r0.dflash2_selector_sum) << chunk;
      EXPECT_EQ(r.argmax, r0.argmax) << chunk;
      // The LM head's GEMMs over chunks of other row counts may round differently (their
      // blocking): the gradients agree to rounding.
      double diff = 0, scale = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        diff = std::max(diff, std::abs(g[i] - g0[i]));
        scale = std::max(scale, std::abs(g0[i]));
      }
      EXPECT_LE(diff, 1e-13 * scale) << chunk;
    }
  }
}

// α_sel: 0 through the warmup, then a linear ramp (the public trainer's schedule: warmup 0.2 and
// ramp 0.3 of 10 steps give 0, 1/3 and 1 at steps 0, 2 and 5).
TEST(Dflash2Selector, AlphaScheduleWarmsUpThenRamps) {
  EXPECT_EQ(dflash2_selector_alpha(1.0, 0.2, 0.3, 0, 10), 0.0);
  EXPECT_EQ(dflash2_selector_alpha(1.0, 0.2, 0.3, 1, 10), 0.0);
  EXPECT_DOUBLE_EQ(dflash2_selector_alpha(1.0, 0.2, 0.3, 2, 10), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(dflash2_selector_alpha(1.0, 0.2, 0.3, 3, 10), 2.0 / 3.0);
  EXPECT_EQ(dflash2_selector_alpha(1.0, 0.2, 0.3, 5, 10), 1.0);
  EXPECT_EQ(dflash2_selector_alpha(0.5, 0.2, 0.3, 9, 10), 0.5);
  EXPECT_EQ(dflash2_selector_alpha(0.5, 0.0, 0.0, 0, 10), 0.5);  // no warmup, no ramp
}

TEST(Dflash2, ConfigValidationNamesTheKey) {
  auto p = make_problem<float>(1, true, Sizes{});
  auto expect_error = [&](auto mutate, const char* text) {
    DrafterConfig c = p.cfg;
    mutate(c);
    try {
      c.validate();
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(text));
    }
  };
  expect_error([](DrafterConfig& c) { c.dflash2.conv_kernel_size = 5; }, "conv_kernel_size");
  expect_error([](DrafterConfig& c) { c.dflash2.conv_group_size = 5; }, "conv_group_size");
  expect_error([](DrafterConfig& c) { c.dflash2.selector_rank = 0; }, "selector_rank");
  expect_error([](DrafterConfig& c) { c.dflash2.selector_top_k = 24; }, "selector_top_k");
  expect_error([](DrafterConfig& c) { c.dflash2.output_multiplier = 0; }, "output_multiplier");
  expect_error([](DrafterConfig& c) { c.dflash2.final_logit_softcapping = -1; },
               "final_logit_softcapping");
  expect_error([](DrafterConfig& c) { c.dflash2.enabled = false; }, "DFlash2DraftModel");
}
