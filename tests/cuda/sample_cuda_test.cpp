// Tests of the sampling ops on the GPU (ops/sample.hpp): the processed distribution against the
// CPU's sampling_probs (infer/sampling.hpp) at V = 151,936 and on hand-made ties, a draw against
// the host's Philox, the bad-row status, and the speculative rule's output distribution over many
// requests (Pearson chi-square against the exact p at significance 1e-4, the statistic and
// threshold of tests/sampling_test.cpp, with the drafts themselves as the negative control).
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "backend/cuda/context.hpp"
#include "core/philox.hpp"
#include "core/rng.hpp"
#include "cuda_test_util.hpp"
#include "infer/sampling.hpp"
#include "ops/sample.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::chi2_critical_1e4;
using test::chi2_stat;

using test::DeviceGuarded;

// The GPU's processed rows of `logits` [R, V] under `sp`.
std::vector<float> gpu_probs(cuda::CudaContext& ctx, const std::vector<float>& logits, int64_t R,
                             int64_t V, const SamplingParams& sp, std::vector<int32_t>* status) {
  const SampleParamsDevice pd{static_cast<float>(1.0 / sp.temperature),
                              static_cast<int32_t>(sp.top_k), sp.top_p};
  DeviceGuarded<SampleParamsDevice> d_params(std::vector<SampleParamsDevice>{pd});
  DeviceGuarded<float> d_logits(logits), d_probs(logits.size());
  DeviceGuarded<int32_t> d_status(std::vector<int32_t>(static_cast<size_t>(R), 0));
  sample_probs_cuda(ctx, d_probs.get(), d_logits.get(), R, V, 0, d_params.get(), d_status.get(), 1);
  EXPECT_TRUE(d_probs.guard_intact() && d_status.guard_intact());
  if (status) *status = d_status.download();
  return d_probs.download();
}

// Every entry of the GPU row within 2e-6 + 2e-5 · p of the CPU's fp64 one, and the same tokens
// of probability 0.
void expect_rows_match(const std::vector<float>& gpu, const std::vector<float>& logits, int64_t R,
                       int64_t V, const SamplingParams& sp, const char* what) {
  std::vector<double> cpu;
  for (int64_t r = 0; r < R; ++r) {
    sampling_probs(cpu, std::span<const float>(logits.data() + r * V, static_cast<size_t>(V)), sp);
    int64_t kept_cpu = 0, kept_gpu = 0, bad = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double g = gpu[static_cast<size_t>(r * V + i)], c = cpu[static_cast<size_t>(i)];
      kept_cpu += c > 0;
      kept_gpu += g > 0;
      if ((g > 0) != (c > 0) || std::fabs(g - c) > 2e-6 + 2e-5 * c) ++bad;
    }
    EXPECT_EQ(bad, 0) << what << " row " << r << ": kept " << kept_gpu << " on the GPU, "
                      << kept_cpu << " on the CPU";
  }
}

TEST(SampleCuda, ProcessedRowsMatchTheCpuAtFullVocabulary) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t R = 3, V = 151936;
  std::vector<float> logits(static_cast<size_t>(R * V));
  Rng rng(5);
  for (float& x : logits) x = static_cast<float>(3.0 * rng.normal());
  logits[17] = -std::numeric_limits<float>::infinity();  // a masked token stays at 0
  const SamplingParams cases[] = {
      {1.0, 0, 1.0}, {0.7, 50, 1.0}, {1.3, 0, 0.9}, {0.5, 1000, 0.8}, {2.0, 1, 1.0}, {1.0, 0, 0.3},
  };
  for (const SamplingParams& sp : cases) {
    const std::string what = "T " + std::to_string(sp.temperature) + " k " +
                             std::to_string(sp.top_k) + " p " + std::to_string(sp.top_p);
    expect_rows_match(gpu_probs(ctx, logits, R, V, sp, nullptr), logits, R, V, sp, what.c_str());
  }
}

// Ties: top-k keeps every token tied with the k-th; top-p cuts tied tokens by id.
TEST(SampleCuda, TiesAreKeptOrCutAsOnTheCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t V = 12;
  const std::vector<float> logits = {0, 2, 1, 2, 0, 2, 1, -1, 0, 1, -3, 2};  // four 2s, three 1s
  const SamplingParams cases[] = {
      {1.0, 2, 1.0},  // the 2nd largest is 2: all four 2s kept
      {1.0, 5, 1.0},  // the 5th largest is 1: the 2s and the 1s
      {1.0, 0, 0.4},  // 2s have ≈ 0.16 each: the first three by id reach 0.4
      {1.0, 6, 0.7},  // top-k then top-p over the kept
      {0.5, 0, 0.05},
  };
  for (const SamplingParams& sp : cases) {
    const std::string what = "k " + std::to_string(sp.top_k) + " p " + std::to_string(sp.top_p);
    expect_rows_match(gpu_probs(ctx, logits, 1, V, sp, nullptr), logits, 1, V, sp, what.c_str());
  }
}

TEST(SampleCuda, BadRowsSetTheRequestStatus) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t V = 300;
  std::vector<float> logits(static_cast<size_t>(3 * V), 0.5f);
  logits[V + 7] = std::nanf("");
  for (int64_t i = 0; i < V; ++i) logits[static_cast<size_t>(2 * V + i)] = -INFINITY;
  std::vector<int32_t> status;
  const std::vector<float> p = gpu_probs(ctx, logits, 3, V, SamplingParams{1.0, 0, 1.0}, &status);
  EXPECT_EQ(status, (std::vector<int32_t>{0, kSampleStatusNan, kSampleStatusNoFinite}));
  EXPECT_FLOAT_EQ(p[5], 1.0f / 300.0f);
  EXPECT_EQ(p[static_cast<size_t>(V + 3)], 0.0f);
}

// The first token of a uniform row is floor(u · V) with u the host's philox_uniform: the device's
// generator and draw are the host's.
TEST(SampleCuda, FirstTokenIsTheHostPhiloxDraw) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t V = 1000;  // a power of two would make u · V exact; 1000 needs the rounding right
  DeviceGuarded<float> p(
      std::vector<float>(static_cast<size_t>(V), 1.0f));  // weights, unnormalised
  DeviceGuarded<uint64_t> seeds(std::vector<uint64_t>(3, 0));
  DeviceGuarded<int32_t> steps(std::vector<int32_t>(3, 0)), status(std::vector<int32_t>(3, 0));
  DeviceGuarded<int32_t> token(1);
  for (uint64_t seed : {1ull, 99ull, 0xfeedfacecafeull}) {
    sample_first_cuda(ctx, token.get(), p.get(), seeds.get(), steps.get(), status.get(), 2, seed,
                      V);
    const double u = philox_uniform(seed, 0, 0, PhiloxPurpose::token);
    EXPECT_EQ(token.download()[0], static_cast<int32_t>(std::floor(u * V))) << "seed " << seed;
    EXPECT_EQ(seeds.download()[2], seed);
    EXPECT_EQ(steps.download()[2], 1);
  }
  EXPECT_TRUE(token.guard_intact() && seeds.guard_intact() && steps.guard_intact());
}

// The speculative rule over N requests of K = 3 (the same p and q rows for each, its own seed):
// drafts drawn from q by sample_drafts_cuda, then spec_sample_accept_cuda. The first output token
// must be distributed as p_0 and the pair (first, second) as p_0(a)·p_1(b) when the first was the
// accepted draft d_1 (the bonus row p_1 is only reached then; for a rejection the pair ends at the
// resampled token). The drafts alone (~q) must fail the same check.
TEST(SampleCuda, SpeculativeRuleGivesTheTargetDistribution) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t N = 20000, K = 3, V = 6;
  const int32_t mask = 5;
  // Rows of one request: p_0, p_1, p_2 (target), q_1, q_2 (drafter; q row 0 unused).
  const std::vector<double> p0 = {0.30, 0.25, 0.20, 0.15, 0.10, 0.00};
  const std::vector<double> p1 = {0.05, 0.05, 0.10, 0.30, 0.50, 0.00};
  const std::vector<double> q1 = {0.05, 0.45, 0.10, 0.10, 0.10, 0.20};  // mass where p_0 has none
  const std::vector<double> q2 = {0.20, 0.20, 0.20, 0.20, 0.20, 0.00};
  std::vector<float> p(static_cast<size_t>(N * K * V)), q(p.size());
  for (int64_t b = 0; b < N; ++b)
    for (int64_t i = 0; i < V; ++i) {
      const auto at = [&](int64_t k) { return static_cast<size_t>((b * K + k) * V + i); };
      p[at(0)] = static_cast<float>(p0[i]);
      p[at(1)] = static_cast<float>(p1[i]);
      p[at(2)] = static_cast<float>(p1[i]);
      q[at(1)] = static_cast<float>(q1[i]);
      q[at(2)] = static_cast<float>(q2[i]);
    }
  std::vector<uint64_t> seeds(static_cast<size_t>(N));
  for (int64_t b = 0; b < N; ++b) seeds[static_cast<size_t>(b)] = 1000 + static_cast<uint64_t>(b);
  DeviceGuarded<float> d_p(p), d_q(q);
  DeviceGuarded<uint64_t> d_seeds(seeds);
  DeviceGuarded<int32_t> d_steps(std::vector<int32_t>(static_cast<size_t>(N), 4));
  DeviceGuarded<int32_t> d_status(std::vector<int32_t>(static_cast<size_t>(N), 0));
  DeviceGuarded<int32_t> d_active(std::vector<int32_t>(static_cast<size_t>(N), 1));
  DeviceGuarded<int32_t> d_lens(std::vector<int32_t>(static_cast<size_t>(N), 10));
  std::vector<int32_t> block(static_cast<size_t>(N * K), mask);
  DeviceGuarded<int32_t> d_block(block), d_out(static_cast<size_t>(N * (K + 1)));
  sample_drafts_cuda(ctx, d_block.get(), d_q.get(), d_seeds.get(), d_steps.get(), N, K, V);
  const std::vector<int32_t> drafts = d_block.download();
  spec_sample_accept_cuda(ctx, d_out.get(), d_lens.get(), d_block.get(), d_steps.get(), d_p.get(),
                          d_q.get(), d_seeds.get(), d_status.get(), d_active.get(), N, K, V, mask);
  const std::vector<int32_t> out = d_out.download(), lens = d_lens.download(),
                             steps = d_steps.download(), nb = d_block.download();
  std::vector<int64_t> first(V, 0), draft1(V, 0), pairs(static_cast<size_t>(V * V), 0);
  int64_t n_pairs = 0, accepted_all = 0;
  for (int64_t b = 0; b < N; ++b) {
    const int32_t* o = &out[static_cast<size_t>(b * (K + 1))];
    ASSERT_TRUE(o[0] >= 1 && o[0] <= K) << "request " << b;
    EXPECT_EQ(lens[static_cast<size_t>(b)], 10 + o[0]);
    EXPECT_EQ(steps[static_cast<size_t>(b)], 5);
    EXPECT_EQ(nb[static_cast<size_t>(b * K)], o[o[0]]);  // the next anchor: the last token
    EXPECT_EQ(nb[static_cast<size_t>(b * K + 1)], mask);
    ++first[static_cast<size_t>(o[1])];
    ++draft1[static_cast<size_t>(drafts[static_cast<size_t>(b * K + 1)])];
    for (int i = 1; i < o[0]; ++i)  // accepted drafts are the drafted tokens
      EXPECT_EQ(o[i], drafts[static_cast<size_t>(b * K + i)]) << "request " << b;
    if (o[0] >= 2) {
      ++pairs[static_cast<size_t>(o[1] * V + o[2])];
      ++n_pairs;
    }
    accepted_all += o[0] == K;
  }
  const double crit = chi2_critical_1e4(static_cast<int>(V) - 2);  // p_0 has 5 tokens of mass
  const double x_first = chi2_stat(first, p0, N), x_drafts = chi2_stat(draft1, p0, N);
  // Given d_1 accepted, the pair (d_1, t_2) has probability ∝ min(p_0, q_1)(a) · p_1(b).
  std::vector<double> pair_p(static_cast<size_t>(V * V), 0.0);
  double acc_mass = 0;
  for (int64_t a = 0; a < V; ++a) acc_mass += std::min(p0[a], q1[a]);
  for (int64_t a = 0; a < V; ++a)
    for (int64_t c = 0; c < V; ++c)
      pair_p[static_cast<size_t>(a * V + c)] = std::min(p0[a], q1[a]) / acc_mass * p1[c];
  int df_pairs = -1;
  for (double x : pair_p) df_pairs += x > 0;
  const double x_pairs = chi2_stat(pairs, pair_p, n_pairs);
  std::printf(
      "N %lld: first token chi2 %.1f (critical %.1f), drafts alone %.1f; accepted-first pairs "
      "%lld chi2 %.1f (critical %.1f); all K-1 accepted %lld\n",
      static_cast<long long>(N), x_first, crit, x_drafts, static_cast<long long>(n_pairs), x_pairs,
      chi2_critical_1e4(df_pairs), static_cast<long long>(accepted_all));
  EXPECT_LT(x_first, crit);
  EXPECT_GT(x_drafts, crit) << "negative control: the check cannot tell q from p";
  EXPECT_LT(x_pairs, chi2_critical_1e4(df_pairs));
  EXPECT_GT(accepted_all, 0);
  EXPECT_TRUE(d_out.guard_intact() && d_block.guard_intact() && d_lens.guard_intact());
}

}  // namespace
}  // namespace dflash
