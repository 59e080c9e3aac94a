// Tests of sampling and the speculative rejection rule (src/infer/sampling.hpp) and a statistical
// test that speculative sampling on the tiny model gives the target's own distribution.
//
// Statistical tests use Pearson's chi-square goodness of fit against EXACT probabilities (computed
// from the target's logits, or given by hand), at significance 1e-4: with fixed seeds each test is
// deterministic; over the choice of seeds the probability that a correct implementation fails a
// given check is 1e-4 (the critical value uses the Wilson–Hilferty approximation, accurate to <1 %
// for the degrees of freedom here). Each check has a negative control (samples drawn from the
// drafter's q, i.e. a rule that accepts everything), which must FAIL the same check: the test has
// power. Trial counts: 400 generations in optimised builds, 150 in Debug/sanitizer builds (each
// trial runs ~8 small target forwards, memory-bound on the CPU; the categories adapt: a category
// needs an expected count ≥ 5); DFLASH_SAMPLING_TRIALS overrides (2000 passes too, see the
// report of the eval branch).
#include "infer/sampling.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <optional>

#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/speculative.hpp"
#include "model/drafter_io.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::chi2_critical_1e4;
using test::chi2_stat;

std::vector<float> logits_of(std::initializer_list<double> probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(p > 0 ? static_cast<float>(std::log(p)) : -INFINITY);
  return l;
}

TEST(Sampling, ProcessedDistribution) {
  std::vector<double> pr;
  const std::vector<float> l = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  // Temperature 2: softmax(l / 2), by hand.
  sampling_probs(pr, l, SamplingParams{2.0, 0, 1.0});
  double z = 0;
  for (float x : l) z += std::exp(x / 2.0);
  for (size_t i = 0; i < l.size(); ++i) EXPECT_NEAR(pr[i], std::exp(l[i] / 2.0) / z, 1e-15);
  // top-k 2 with a tie at the 2nd largest: both 3.0 kept, others 0.
  sampling_probs(pr, l, SamplingParams{1.0, 2, 1.0});
  EXPECT_EQ(pr, (std::vector<double>{0, 0.5, 0, 0.5, 0}));
  // top-k 3: 3, 3, 2 kept (ties at the threshold are kept).
  sampling_probs(pr, l, SamplingParams{1.0, 3, 1.0});
  const double z3 = 2 * std::exp(3.0) + std::exp(2.0);
  EXPECT_NEAR(pr[2], std::exp(2.0) / z3, 1e-15);
  EXPECT_EQ(pr[0], 0.0);
  EXPECT_EQ(pr[4], 0.0);
  // top-p on [0.5, 0.3, 0.15, 0.05]: 0.75 keeps 2 tokens, 0.81 keeps 3, 0.4 keeps 1.
  const auto l2 = logits_of({0.15, 0.5, 0.05, 0.3});
  sampling_probs(pr, l2, SamplingParams{1.0, 0, 0.75});
  EXPECT_NEAR(pr[1], 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(pr[3], 0.3 / 0.8, 1e-6);
  EXPECT_EQ(pr[0], 0.0);
  EXPECT_EQ(pr[2], 0.0);
  sampling_probs(pr, l2, SamplingParams{1.0, 0, 0.81});
  EXPECT_NEAR(pr[0], 0.15 / 0.95, 1e-6);
  EXPECT_EQ(pr[2], 0.0);
  sampling_probs(pr, l2, SamplingParams{1.0, 0, 0.4});
  EXPECT_EQ(pr, (std::vector<double>{0, 1, 0, 0}));
  // top-k then top-p (HF order): k = 3 drops 0.05; p = 0.9 of the renormalised [.5,.3,.15]/.95
  // needs all three (0.8/0.95 = 0.842 < 0.9).
  sampling_probs(pr, l2, SamplingParams{1.0, 3, 0.9});
  EXPECT_NEAR(pr[0], 0.15 / 0.95, 1e-6);
  EXPECT_EQ(pr[2], 0.0);
  // -inf logits get probability 0; a single finite logit gets 1.
  sampling_probs(pr, std::vector<float>{-INFINITY, 0.5f, -INFINITY}, SamplingParams{0.7, 0, 1.0});
  EXPECT_EQ(pr, (std::vector<double>{0, 1, 0}));
}

TEST(Sampling, Errors) {
  std::vector<double> pr;
  const std::vector<float> l = {0.0f, 1.0f};
  EXPECT_THROW(sampling_probs(pr, l, SamplingParams{}), Error);  // greedy
  EXPECT_THROW((SamplingParams{-1.0, 0, 1.0}.validate()), Error);
  EXPECT_THROW((SamplingParams{1.0, -1, 1.0}.validate()), Error);
  EXPECT_THROW((SamplingParams{1.0, 0, 0.0}.validate()), Error);
  EXPECT_THROW((SamplingParams{1.0, 0, 1.5}.validate()), Error);
  EXPECT_NO_THROW((SamplingParams{0.0, 0, 1.0}.validate()));
  EXPECT_THROW(sampling_probs(pr, std::vector<float>{NAN, 1.0f}, SamplingParams{1.0, 0, 1.0}),
               Error);
  EXPECT_THROW(sampling_probs(pr, std::vector<float>{-INFINITY}, SamplingParams{1.0, 0, 1.0}),
               Error);
  Rng rng(1);
  EXPECT_THROW(sample_index(std::vector<double>{0, 0}, rng), Error);
  const std::vector<double> p = {0.5, 0.5}, q = {1.0, 0.0};
  EXPECT_THROW(acceptance_probability(p, q, 1), Error);  // q(x) = 0: x cannot be a draft
  EXPECT_THROW(acceptance_probability(p, q, 2), Error);
}

TEST(Sampling, SampleIndexFrequenciesAndZeros) {
  const std::vector<double> p = {0.1, 0.0, 0.6, 0.0, 0.3};
  Rng rng(7);
  const int64_t n = 100000;
  std::vector<int64_t> c(5, 0);
  for (int64_t i = 0; i < n; ++i) ++c[static_cast<size_t>(sample_index(p, rng))];
  EXPECT_EQ(c[1], 0);
  EXPECT_EQ(c[3], 0);
  EXPECT_LT(chi2_stat(c, p, n), chi2_critical_1e4(2));
  // Unnormalised input: same distribution.
  std::vector<int64_t> c2(5, 0);
  const std::vector<double> p2 = {1, 0, 6, 0, 3};
  for (int64_t i = 0; i < n; ++i) ++c2[static_cast<size_t>(sample_index(p2, rng))];
  EXPECT_LT(chi2_stat(c2, p, n), chi2_critical_1e4(2));
}

// Analytic exactness: P(out = y) = q(y)·a(y) + (Σ_x q(x)(1 − a(x)))·r(y) must equal p(y), with
// a = acceptance_probability and r = residual_distribution as implemented.
TEST(Sampling, RejectionRuleExactInExpectation) {
  Rng rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t V = 1 + static_cast<size_t>(trial % 9);
    std::vector<double> p(V), q(V);
    for (size_t i = 0; i < V; ++i) {
      p[i] = rng.uniform() < 0.3 ? 0.0 : rng.uniform();
      q[i] = rng.uniform() < 0.3 ? 0.0 : rng.uniform();
    }
    p[rng.below(V)] += 0.1;
    q[rng.below(V)] += 0.1;
    if (trial % 10 == 0) q = p;  // identical distributions: never reject
    const double sp = std::accumulate(p.begin(), p.end(), 0.0);
    const double sq = std::accumulate(q.begin(), q.end(), 0.0);
    for (double& x : p) x /= sp;
    for (double& x : q) x /= sq;
    std::vector<double> r;
    residual_distribution(r, p, q);
    double reject_mass = 0;
    std::vector<double> out(V, 0.0);
    for (size_t x = 0; x < V; ++x) {
      if (q[x] == 0) continue;
      const double a = acceptance_probability(p, q, static_cast<int32_t>(x));
      EXPECT_GE(a, 0.0);
      EXPECT_LE(a, 1.0);
      out[x] += q[x] * a;
      reject_mass += q[x] * (1 - a);
    }
    for (size_t y = 0; y < V; ++y) out[y] += reject_mass * r[y];
    for (size_t y = 0; y < V; ++y) EXPECT_NEAR(out[y], p[y], 1e-12) << "trial " << trial;
    if (trial % 10 == 0) {
      EXPECT_NEAR(reject_mass, 0.0, 1e-15);
    }
  }
}

// Monte Carlo of speculative_reject itself on hand-made distributions (q puts mass where p has
// none and vice versa).
TEST(Sampling, RejectionRuleMonteCarlo) {
  const std::vector<double> p = {0.05, 0.4, 0.0, 0.25, 0.3};
  const std::vector<double> q = {0.3, 0.1, 0.2, 0.4, 0.0};
  Rng rng(5), draft_rng(6);
  std::vector<double> scratch;
  const int64_t n = 200000;
  std::vector<int64_t> out(5, 0), naive(5, 0);
  int64_t accepted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t x = sample_index(q, draft_rng);
    const RejectionOutcome o = speculative_reject(p, q, x, rng, scratch);
    accepted += o.accepted;
    if (o.accepted) {
      EXPECT_EQ(o.token, x);
    }
    ++out[static_cast<size_t>(o.token)];
    ++naive[static_cast<size_t>(x)];
  }
  EXPECT_EQ(out[2], 0);  // p(2) = 0 is never output
  EXPECT_LT(chi2_stat(out, p, n), chi2_critical_1e4(3));
  EXPECT_GT(chi2_stat(naive, p, n), chi2_critical_1e4(3));  // negative control
  // Acceptance rate Σ min(p, q) = 0.05 + 0.1 + 0 + 0.25 + 0 = 0.4.
  EXPECT_NEAR(static_cast<double>(accepted) / n, 0.4, 5 * std::sqrt(0.24 / n));
}

// ---------------------------------------------------------------------------------- tiny model

int64_t trial_count() {
  if (const char* e = std::getenv("DFLASH_SAMPLING_TRIALS")) return std::atoll(e);
#ifdef NDEBUG
  return 400;
#else
  return 150;
#endif
}

const std::filesystem::path& tiny_dir() {
  static const std::filesystem::path p = test::assets_dir() / "tiny-qwen3";
  return p;
}

// Categories over token pairs (t2, t3) with exact probability ≥ 5/n, plus "other" (last).
struct PairCategories {
  std::map<std::pair<int32_t, int32_t>, size_t> index;
  std::vector<double> probs;  // last: other
  size_t of(int32_t a, int32_t b) const {
    const auto it = index.find({a, b});
    return it == index.end() ? probs.size() - 1 : it->second;
  }
};

TEST(Sampling, SpeculativeSamplingMatchesTargetOnTinyModel) {
  // f32 weight copies: same results as the bf16 views (exact conversion), no per-call conversion.
  const TargetModel target = TargetModel::load(tiny_dir(), TargetLoadOptions{.f32_weights = true});
  const int64_t V = target.vocab_size();
  const int64_t n = trial_count();
  ASSERT_GE(n, 100);
  const SamplingParams sp{1.0, 0, 1.0};
  // An untrained drafter (block 3) for the full loop.
  test::TempDir dir;
  DrafterSizes sizes;
  sizes.block_size = 3;
  sizes.intermediate_size = 128;
  const DrafterConfig dc = drafter_config_for_target(target.config(), 1, sizes, 8000);
  const DrafterLayout layout(dc);
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, 21);
  drafter_save(dir / "d", dc, layout, params, DType::f32);
  const LoadedDrafter drafter = drafter_load(dir / "d");
  const SpeculativeDecoder dec(target, drafter);
  // A DSpark drafter (block 3: all 3 slots draft, each from the previous draft through its
  // Markov head), its bias scaled up so that it shapes the drafts' q.
  DrafterConfig sc = dc;
  sc.dspark = DsparkHeads{true, 8, MarkovHeadType::rnn, false, false};
  const DrafterLayout slayout(sc);
  std::vector<float> sparams(static_cast<size_t>(slayout.total));
  drafter_init(sparams, slayout, 22);
  for (int64_t i = 0; i < sc.vocab_size * 8; ++i) sparams[slayout.dspark.markov_w2 + i] *= 100.0f;
  drafter_save(dir / "s", sc, slayout, sparams, DType::f32);
  const LoadedDrafter sdrafter = drafter_load(dir / "s");
  const SpeculativeDecoder sdec(target, sdrafter);
  // A DFlash2 drafter (block 3: slots 1 and 2 walk the selector over the unary top 4), its
  // codebooks random and scaled up so that the walk's q is not the softmax of the slot's logits.
  // Untrained, its drafts are rarely accepted (none at 400 trials): mostly the rejection path.
  DrafterConfig fc = dc;
  fc.dflash2 = Dflash2Heads{true, 2, 16, 8, 4, 1.0, 0.0};
  const DrafterLayout flayout(fc);
  std::vector<float> fparams(static_cast<size_t>(flayout.total));
  drafter_init(fparams, flayout, 23);
  {
    Rng frng(24);
    for (int64_t i = 0; i < fc.vocab_size * 8; ++i) {
      fparams[flayout.dflash2.successor + i] = static_cast<float>(frng.normal());
      fparams[flayout.dflash2.predecessor + i] *= 50.0f;
    }
    for (int64_t i = 0; i < 8 * fc.hidden_size; ++i)
      fparams[flayout.dflash2.hidden_proj + i] *= 50.0f;
  }
  drafter_save(dir / "f", fc, flayout, fparams, DType::f32);
  const LoadedDrafter fdrafter = drafter_load(dir / "f");
  const SpeculativeDecoder fdec(target, fdrafter);

  const Tokenizer tok = Tokenizer::load(tiny_dir());
  // A definition being written: the next tokens are uncertain but not spread over the whole
  // vocabulary (13 pair categories cover 82 % of the mass at 2000 trials, 6 cover 78 % at 400).
  // The exact probabilities come from the target's own logits, the samples from three samplers.
  const std::vector<int32_t> prompt = tok.encode(
      "<|im_start|>user\nGive a short definition of dog.<|im_end|>\n"
      "<|im_start|>assistant\n\"dog\" is a");
  DecodeOptions o;
  o.max_new_tokens = 3;
  o.sampling = sp;
  // t1 (fixed for every trial; caches prefilled): the first seed whose t1 is the target's argmax.
  TargetKvCache c0 = target.new_cache();
  const ForwardResult r0 = target.prefill(c0, prompt);
  const int32_t t1_argmax = argmax_row(r0.logits.data<float>(), V);
  std::optional<SpecState> base_opt;
  for (o.seed = 1; o.seed < 50; ++o.seed) {
    base_opt.emplace(dec.start(prompt, o));
    if (base_opt->anchor == t1_argmax) break;
  }
  ASSERT_EQ(base_opt->anchor, t1_argmax);
  const SpecState base = *base_opt;
  const SpecState sbase = sdec.start(prompt, o);  // the same seed: the same first token
  ASSERT_EQ(sbase.anchor, t1_argmax);
  const SpecState fbase = fdec.start(prompt, o);
  ASSERT_EQ(fbase.anchor, t1_argmax);
  ASSERT_FALSE(base.done);
  const int32_t t1 = base.anchor;

  // Exact distribution of (t2, t3) given prompt + t1.
  TargetKvCache c1 = target.new_cache();
  target.prefill(c1, prompt);
  const ForwardOptions last{{}, LogitsRows::last, false};
  const ForwardResult r1 = target.append(c1, std::span<const int32_t>(&t1, 1), last);
  std::vector<double> p2;
  sampling_probs(p2, std::span<const float>(r1.logits.data<float>(), V), sp);
  PairCategories cats;
  const double thr = 5.0 / static_cast<double>(n);
  double covered = 0;
  for (int32_t a = 0; a < V; ++a) {
    if (p2[a] < thr) continue;
    TargetKvCache c2 = c1;
    const ForwardResult r2 = target.append(c2, std::span<const int32_t>(&a, 1), last);
    std::vector<double> p3;
    sampling_probs(p3, std::span<const float>(r2.logits.data<float>(), V), sp);
    for (int32_t b = 0; b < V; ++b) {
      if (p2[a] * p3[b] < thr) continue;
      cats.index[{a, b}] = cats.probs.size();
      cats.probs.push_back(p2[a] * p3[b]);
      covered += p2[a] * p3[b];
    }
  }
  cats.probs.push_back(std::max(0.0, 1.0 - covered));
  const int df = static_cast<int>(cats.probs.size()) - 1;
  ASSERT_GE(df, 3) << "the prompt's continuation is too predictable for a useful test";
  const double crit = chi2_critical_1e4(df);

  // A Domino drafter (block 3: 2 proposals, each corrected by the GRU state after the anchor and
  // the drafts before it): W2 lifts the tokens the target is likely to say next by W2·SiLU(W1·[h;
  // g]) (W1 scaled up; a weight of 50 outweighs the untrained base logits), so that the first
  // draft's q is concentrated on them by the correction and many drafts are accepted.
  DrafterConfig mc = dc;
  mc.domino = DominoHead{true, 8, 16, 0, false};
  const DrafterLayout mlayout(mc);
  std::vector<float> mparams(static_cast<size_t>(mlayout.total));
  drafter_init(mparams, mlayout, 23);
  for (int64_t i = 0; i < 8 * (mc.hidden_size + 16); ++i) {
    mparams[mlayout.domino.proj1 + i] *= 10.0f;
  }
  for (int32_t a = 0; a < V; ++a) {
    if (p2[a] < thr) continue;
    for (int64_t e = 0; e < 8; ++e) mparams[mlayout.domino.proj2 + a * 8 + e] = 50.0f;
  }
  drafter_save(dir / "m", mc, mlayout, mparams, DType::f32);
  const LoadedDrafter mdrafter = drafter_load(dir / "m");
  const SpeculativeDecoder mdec(target, mdrafter);
  const SpecState mbase = mdec.start(prompt, o);  // the same seed: the same first token
  ASSERT_EQ(mbase.anchor, t1_argmax);

  std::vector<int64_t> plain(cats.probs.size(), 0), spec(cats.probs.size(), 0),
      oracle(cats.probs.size(), 0), naive(cats.probs.size(), 0), dspark(cats.probs.size(), 0),
      dflash2(cats.probs.size(), 0), domino(cats.probs.size(), 0);
  int64_t dspark_accepted = 0;   // drafts the DSpark loop accepted (the check's power)
  int64_t dflash2_accepted = 0;  // the DFlash2 loop
  int64_t domino_accepted = 0;   // and the Domino loop
  std::vector<double> scratch, pa;
  const SamplingParams soft{1.6, 0, 1.0};  // the oracle drafter's q: the target at temperature 1.6
  for (int64_t i = 0; i < n; ++i) {
    // Plain sampling from the target.
    {
      Rng rng(derive_seed(100, {static_cast<uint64_t>(i)}));
      TargetKvCache c = c1;
      const int32_t a =
          sample_token(std::span<const float>(r1.logits.data<float>(), V), sp, rng, scratch);
      const ForwardResult r = target.append(c, std::span<const int32_t>(&a, 1), last);
      const int32_t b =
          sample_token(std::span<const float>(r.logits.data<float>(), V), sp, rng, scratch);
      ++plain[cats.of(a, b)];
    }
    // Full speculative loop with the untrained drafter.
    {
      SpecState s = base;
      s.rng.reseed(derive_seed(200, {static_cast<uint64_t>(i)}));
      while (!s.done) dec.step(s, o);
      ASSERT_EQ(s.result.tokens.size(), 3u);
      ASSERT_EQ(s.result.tokens[0], t1);
      ++spec[cats.of(s.result.tokens[1], s.result.tokens[2])];
    }
    // Full speculative loop with the DSpark drafter.
    {
      SpecState s = sbase;
      s.rng.reseed(derive_seed(500, {static_cast<uint64_t>(i)}));
      while (!s.done) sdec.step(s, o);
      ASSERT_EQ(s.result.tokens.size(), 3u);
      for (int a : s.result.accept_lengths) dspark_accepted += a - 1;
      ++dspark[cats.of(s.result.tokens[1], s.result.tokens[2])];
    }
    // Full speculative loop with the DFlash2 drafter.
    {
      SpecState s = fbase;
      s.rng.reseed(derive_seed(600, {static_cast<uint64_t>(i)}));
      while (!s.done) fdec.step(s, o);
      ASSERT_EQ(s.result.tokens.size(), 3u);
      for (int a : s.result.accept_lengths) dflash2_accepted += a - 1;
      ++dflash2[cats.of(s.result.tokens[1], s.result.tokens[2])];
    }
    // Full speculative loop with the Domino drafter.
    {
      SpecState s = mbase;
      s.rng.reseed(derive_seed(600, {static_cast<uint64_t>(i)}));
      while (!s.done) mdec.step(s, o);
      ASSERT_EQ(s.result.tokens.size(), 3u);
      for (int a : s.result.accept_lengths) domino_accepted += a - 1;
      ++domino[cats.of(s.result.tokens[1], s.result.tokens[2])];
    }
    // Oracle drafter: d1 ~ q1 = target(·|…t1) at temperature 1.6, d2 ~ q2 = target(·|…t1 d1).
    {
      SpecState s = base;
      s.rng.reseed(derive_seed(300, {static_cast<uint64_t>(i)}));
      Rng drng(derive_seed(400, {static_cast<uint64_t>(i)}));
      TargetKvCache c = c1;
      std::vector<std::vector<double>> q(2);
      sampling_probs(q[0], std::span<const float>(r1.logits.data<float>(), V), soft);
      const int32_t d1 = sample_index(q[0], drng);
      const ForwardResult r = target.append(c, std::span<const int32_t>(&d1, 1), last);
      sampling_probs(q[1], std::span<const float>(r.logits.data<float>(), V), soft);
      const int32_t d2 = sample_index(q[1], drng);
      const int32_t props[2] = {d1, d2};
      dec.verify(s, o, props, q);
      while (!s.done) dec.step(s, o);
      ASSERT_EQ(s.result.tokens.size(), 3u);
      ++oracle[cats.of(s.result.tokens[1], s.result.tokens[2])];
      ++naive[cats.of(d1, d2)];  // negative control: the drafts themselves (~ q, not p)
    }
  }
  const double x_plain = chi2_stat(plain, cats.probs, n), x_spec = chi2_stat(spec, cats.probs, n),
               x_oracle = chi2_stat(oracle, cats.probs, n),
               x_naive = chi2_stat(naive, cats.probs, n),
               x_dspark = chi2_stat(dspark, cats.probs, n),
               x_dflash2 = chi2_stat(dflash2, cats.probs, n),
               x_domino = chi2_stat(domino, cats.probs, n);
  std::printf(
      "trials %lld, categories %d (covered mass %.3f), critical %.1f: plain %.1f, "
      "spec(random drafter) %.1f, spec(random DSpark drafter, %lld drafts accepted) %.1f, "
      "spec(random DFlash2 drafter, %lld drafts accepted) %.1f, spec(random Domino drafter, %lld "
      "drafts accepted) %.1f, spec(oracle q) %.1f, drafts alone %.1f\n",
      static_cast<long long>(n), df + 1, covered, crit, x_plain, x_spec,
      static_cast<long long>(dspark_accepted), x_dspark, static_cast<long long>(dflash2_accepted),
      x_dflash2, static_cast<long long>(domino_accepted), x_domino, x_oracle, x_naive);
  EXPECT_LT(x_plain, crit);
  EXPECT_LT(x_spec, crit);
  EXPECT_LT(x_dspark, crit);
  EXPECT_LT(x_dflash2, crit);
  EXPECT_LT(x_domino, crit);
  EXPECT_GT(domino_accepted, n / 2) << "the Domino drafts are rejected: the check has no power";
  EXPECT_LT(x_oracle, crit);
  EXPECT_GT(x_naive, crit) << "negative control: the test cannot tell q from p";
}

}  // namespace
}  // namespace dflash
