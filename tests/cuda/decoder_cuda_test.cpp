// Tests of speculative decoding on the GPU (infer/decoder_cuda.hpp, ops/decode.hpp) on the tiny
// fixture: the decoding ops against hand-made cases (greedy acceptance at every length, argmax
// ties), the target's cached forward (a prefill, and a prefill then an appended block) against
// the CPU target's logits, greedy speculative output == CUDA target-only output (bit for bit) ==
// CPU target-only output (up to a bf16 near-tie, checked), batch N == batch 1 per request,
// graphs == eager launches, the CLI, and the errors. Sampling: the output of the first two tokens
// over many seeds against the target's processed distribution (Pearson chi-square at significance
// 1e-4, the statistic and threshold of tests/sampling_test.cpp), batch N == batch 1 and reruns
// per request, top-k = 1 == greedy. Where the two backends' greedy paths part on the tiny
// reference's eval prompts, and that it is at near-ties on both.
// Skipped without a GPU.
#include "infer/decoder_cuda.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>

#include "backend/cuda/context.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/error.hpp"
#include "cuda_test_util.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder_cpu.hpp"
#include "infer/eval.hpp"
#include "model/drafter_io.hpp"
#include "model/target_cuda.hpp"
#include "ops/decode.hpp"
#include "ops/rmsnorm.hpp"
#include "tolerances.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::chi2_critical_1e4;
using test::chi2_stat;

using test::DeviceGuarded;

const TargetModel& tiny() {
  static const TargetModel m = TargetModel::load(test::assets_dir() / "tiny-qwen3");
  return m;
}

// An untrained drafter (seeded init) of `layers` layers and block size `block`, its matrices
// scaled by 4 (standard deviation 0.08): the attention over the context then moves the logits
// enough for the drafter comparison to see a wrong position or context row.
LoadedDrafter random_drafter(int layers, int block, uint64_t seed) {
  DrafterSizes sizes;
  sizes.block_size = block;
  sizes.intermediate_size = 256;
  const DrafterConfig c = drafter_config_for_target(tiny().config(), layers, sizes, 8000);
  LoadedDrafter d{c, DrafterLayout(c), {}};
  d.params.resize(static_cast<size_t>(d.layout.total));
  drafter_init(d.params, d.layout, seed);
  for (const ParamInfo& p : d.layout.params)
    if (!p.is_norm)
      for (int64_t i = 0; i < p.numel; ++i) d.params[static_cast<size_t>(p.offset + i)] *= 4.0f;
  return d;
}

// Prompts of different lengths from corpus-like text.
std::vector<std::vector<int32_t>> prompts() {
  const Tokenizer tok = Tokenizer::load(test::assets_dir() / "tiny-qwen3");
  const char* texts[] = {
      "What is 17 plus 25? Let us add the tens first.",
      "Call me Ishmael. Some years ago",
      "Define the word harbor.",
      "Mr. Speaker, Mr. Vice President, members of Congress, the state of our union",
      "A farmer has 12 cows and buys 7 more. Then he sells 5. How many cows",
  };
  std::vector<std::vector<int32_t>> out;
  for (const char* t : texts) out.push_back(tok.encode(t));
  return out;
}

DecodeOptions greedy_opts(int64_t max_new) {
  DecodeOptions o;
  o.max_new_tokens = max_new;
  return o;
}

// The CUDA target (bf16 weights and activations) may leave the CPU target's (fp32 activations)
// greedy path where two logits nearly tie. Where `gpu` first differs from `cpu`, the CPU's logits
// of the two tokens must be within the bf16 tolerance of whole target forwards
// (tol::kTargetTaps × the row's largest |logit|): a tie flipped by rounding, not a wrong token.
void expect_equal_or_near_tie(const std::vector<int32_t>& prompt, const std::vector<int32_t>& gpu,
                              const std::vector<int32_t>& cpu, size_t request) {
  size_t j = 0;
  while (j < gpu.size() && j < cpu.size() && gpu[j] == cpu[j]) ++j;
  if (j == gpu.size() && j == cpu.size()) return;
  ASSERT_TRUE(j < gpu.size() && j < cpu.size())
      << "request " << request << ": one output is a prefix of the other";
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), cpu.begin(), cpu.begin() + static_cast<std::ptrdiff_t>(j));
  const auto n = static_cast<int64_t>(seq.size()), V = tiny().vocab_size();
  const std::vector<int32_t> off = {0, static_cast<int32_t>(n)};
  const std::vector<float> all = tiny().forward_logits(seq, off).to_f32_vector();
  const float* row = all.data() + (n - 1) * V;
  float top = 0;
  for (int64_t v = 0; v < V; ++v) top = std::max(top, std::fabs(row[v]));
  const double gap = row[cpu[j]] - row[gpu[j]];
  std::printf(
      "request %zu: the CUDA target leaves the CPU's tokens at output token %zu (CPU %d, "
      "CUDA %d; CPU logit gap %.4f, row max |logit| %.2f)\n",
      request, j, cpu[j], gpu[j], gap, top);
  EXPECT_LE(gap, test::tol::kTargetTaps * top) << "request " << request << " token " << j;
}

TEST(DecodeOpsCuda, GreedyAcceptTakesTheLongestAgreeingPrefixAndTheBonus) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int B = 7, K = 5;
  const int32_t mask = 999;
  // Request b agrees on its first b proposals (b = 5, 6 agree on all K − 1); request 6 inactive.
  std::vector<int32_t> block(B * K), target(B * K), lens(B), active(B, 1);
  for (int b = 0; b < B; ++b) {
    lens[b] = 10 * b + 3;
    for (int k = 0; k < K; ++k) {
      block[b * K + k] = 100 * b + k;          // anchor, d_1 … d_4
      target[b * K + k] = 100 * b + k + 1;     // the target's token after row k
      if (k + 1 > b) target[b * K + k] += 50;  // first mismatch at proposal b + 1
    }
  }
  active[6] = 0;
  DeviceGuarded<int32_t> d_block(block), d_target(target), d_lens(lens), d_active(active);
  DeviceGuarded<int32_t> d_out(static_cast<size_t>(B * (K + 1)));
  greedy_accept_cuda(ctx, d_out.get(), d_lens.get(), d_block.get(), d_target.get(), d_active.get(),
                     B, K, mask);
  const std::vector<int32_t> out = d_out.download(), nl = d_lens.download(),
                             nb = d_block.download();
  for (int b = 0; b < 6; ++b) {
    const int n = std::min(b, K - 1);
    const int32_t* o = &out[static_cast<size_t>(b * (K + 1))];
    ASSERT_EQ(o[0], n + 1) << "request " << b;
    for (int i = 0; i < n; ++i) EXPECT_EQ(o[1 + i], 100 * b + i + 1) << "request " << b;
    const int32_t bonus = target[b * K + n];
    EXPECT_EQ(o[1 + n], bonus) << "request " << b;
    EXPECT_EQ(nl[b], lens[b] + n + 1);
    EXPECT_EQ(nb[b * K], bonus);
    for (int k = 1; k < K; ++k) EXPECT_EQ(nb[b * K + k], mask);
  }
  EXPECT_EQ(out[6 * (K + 1)], 0);
  EXPECT_EQ(nl[6], lens[6]);
  for (int k = 0; k < K; ++k) EXPECT_EQ(nb[6 * K + k], block[6 * K + k]);
  EXPECT_TRUE(d_out.guard_intact() && d_lens.guard_intact() && d_block.guard_intact());

  // K = 1: target-only decoding takes the target's token.
  DeviceGuarded<int32_t> one_block(std::vector<int32_t>{4}), one_target(std::vector<int32_t>{9});
  DeviceGuarded<int32_t> one_lens(std::vector<int32_t>{2}), one_active(std::vector<int32_t>{1});
  DeviceGuarded<int32_t> one_out(2);
  greedy_accept_cuda(ctx, one_out.get(), one_lens.get(), one_block.get(), one_target.get(),
                     one_active.get(), 1, 1, mask);
  EXPECT_EQ(one_out.download(), (std::vector<int32_t>{1, 9}));
  EXPECT_EQ(one_lens.download(), (std::vector<int32_t>{3}));
  EXPECT_EQ(one_block.download(), (std::vector<int32_t>{9}));
}

TEST(DecodeOpsCuda, ArgmaxTakesTheSmallestIndexOfTheMaximum) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t R = 4, V = 1001;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits(static_cast<size_t>(R * V));
  for (int64_t i = 0; i < R * V; ++i) logits[i] = std::sin(0.37f * static_cast<float>(i));
  logits[0 * V + 700] = 5.0f;  // row 0: a tie between 300 and 700 → 300
  logits[0 * V + 300] = 5.0f;
  logits[1 * V + 1000] = 9.0f;  // row 1: the last column
  logits[1 * V + 2] = std::nanf("");
  for (int64_t i = 0; i < V; ++i) logits[2 * V + i] = -inf;  // row 2: nothing finite → 0
  logits[3 * V + 0] = 3.0f;                                  // row 3: the first column
  DeviceGuarded<float> d_logits(logits);
  DeviceGuarded<int32_t> d_out(static_cast<size_t>(R));
  argmax_rows_cuda(ctx, d_out.get(), d_logits.get(), R, V);
  EXPECT_EQ(d_out.download(), (std::vector<int32_t>{300, 1000, 0, 0}));
  EXPECT_TRUE(d_out.guard_intact());
}

// The target's cached forward: all rows' logits of a prefill of P tokens, and of a prefill of P1
// followed by a block of P − P1 appended over the cache, against the CPU target's logits of the
// whole sequence (the bf16 tolerance of whole target forwards).
TEST(DecoderCuda, CachedTargetForwardMatchesTheCpuLogits) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const TargetModel& m = tiny();
  const ModelConfig& c = m.config();
  const std::vector<int32_t> toks = prompts()[3];
  const auto P = static_cast<int64_t>(toks.size());
  const int64_t P1 = P - 7, H = c.hidden_size, V = c.vocab_size;
  const int64_t KD = c.num_key_value_heads * c.head_dim, C = P + 9, first = 1;  // request 1 of 2
  ASSERT_GT(P1, 1);
  const std::vector<int32_t> off = {0, static_cast<int32_t>(P)};
  const std::vector<float> ref = m.forward_logits(toks, off).to_f32_vector();

  TargetCuda tc(ctx, m, P);
  std::vector<std::unique_ptr<DeviceGuarded<uint16_t>>> kv;
  TargetCacheCuda cache;
  cache.rows = 2 * C;
  for (int64_t l = 0; l < 2 * c.num_hidden_layers; ++l) {
    kv.push_back(std::make_unique<DeviceGuarded<uint16_t>>(static_cast<size_t>(2 * C * KD)));
    (l % 2 ? cache.v : cache.k).push_back(kv.back()->get());
  }
  DeviceGuarded<int32_t> d_toks(toks), pos(static_cast<size_t>(P)), slots(static_cast<size_t>(P));
  DeviceGuarded<AttnRange> ranges(static_cast<size_t>(P));
  DeviceGuarded<int32_t> lens(std::vector<int32_t>{0, 0});
  DeviceGuarded<float> fnorm_w(m.final_norm_weight());
  DeviceGuarded<uint16_t> normed(static_cast<size_t>(P * H));
  DeviceGuarded<float> logits(static_cast<size_t>(P * V));
  // Logits of residual rows [0, T) into rows [row0, row0 + T) of `logits`.
  auto head = [&](int64_t row0, int64_t T) {
    rmsnorm_fwd_cuda(ctx, normed.get(), static_cast<float*>(nullptr), tc.residual(), fnorm_w.get(),
                     T, H, c.rms_norm_eps);
    cuda::gemm_bf16(ctx, logits.get() + row0 * V, DType::f32, V, normed.get(), H, false,
                    tc.lm_head(), H, true, T, V, H);
  };
  // One forward of T tokens starting at token t0, with request 1 holding t0 tokens.
  auto forward = [&](int64_t t0, int64_t T) {
    lens.upload({0, static_cast<int32_t>(t0)});
    decode_rows_cuda(ctx, pos.get(), slots.get(), ranges.get(), nullptr, lens.get() + first, 1, T,
                     first, C);
    tc.forward_cached(nullptr, d_toks.get() + t0, pos.get(), slots.get(), ranges.get(), T, T, {},
                      cache);
    head(t0, T);
  };
  forward(0, P);
  const std::vector<float> whole = logits.download();
  EXPECT_LT(test::rel_error(whole, ref), test::tol::kTargetTaps);
  forward(0, P1);
  forward(P1, P - P1);
  const std::vector<float> split = logits.download();
  EXPECT_LT(test::rel_error(split, ref), test::tol::kTargetTaps);
  // The last rows (those of the appended block) alone.
  const std::vector<float> tail_ref(ref.begin() + P1 * V, ref.end());
  const std::vector<float> tail(split.begin() + P1 * V, split.end());
  EXPECT_LT(test::rel_error(tail, tail_ref), test::tol::kTargetTaps);
  for (const auto& b : kv) EXPECT_TRUE(b->guard_intact());
}

class DecoderCudaTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    ctx_ = std::make_unique<cuda::CudaContext>(0);
    drafter_ = random_drafter(2, 8, 7);
    ps_ = prompts();
    limits_ = decoder_cuda_limits(ps_, kMaxNew, drafter_->config.block_size, 4);
    dec_ = std::make_unique<SpeculativeDecoderCuda>(*ctx_, tiny(), *drafter_, limits_);
  }
  static constexpr int64_t kMaxNew = 40;
  std::unique_ptr<cuda::CudaContext> ctx_;
  std::optional<LoadedDrafter> drafter_;
  std::vector<std::vector<int32_t>> ps_;
  DecoderCudaLimits limits_;
  std::unique_ptr<SpeculativeDecoderCuda> dec_;
};

// The drafter on the GPU (context rows from the target's bf16 taps, block forward over its cache)
// against the CPU drafter over the CPU target's taps: the block logits of the first step.
TEST_F(DecoderCudaTiny, DrafterBlockLogitsMatchTheCpuDrafter) {
  const SpeculativeDecoder cpu(tiny(), *drafter_);
  for (int K : {8, 3}) {
    for (size_t i : {size_t{0}, size_t{3}}) {
      DecodeOptions o = greedy_opts(kMaxNew);
      o.block_size = K;
      SpecState st = cpu.start(ps_[i], o);
      const DrafterConfig c = cpu.config_for_block(K);
      const std::vector<float> embed = tiny().embedding_f32();
      const DrafterTables<float> tables{embed.data(), embed.data()};  // tiny-qwen3 ties them
      const std::span<const float> ref =
          drafter_draft_block(st.drafter_cache, c, drafter_->layout, drafter_->params.data(),
                              tables, st.anchor, st.drafter_ws);
      int32_t first = -1;
      const std::vector<float> got = dec_->draft_logits(ps_[i], K, first);
      EXPECT_EQ(first, st.anchor) << "prompt " << i;
      EXPECT_LT(test::rel_error(got, std::vector<float>(ref.begin(), ref.end())),
                test::tol::kTargetTaps)
          << "prompt " << i << ", block " << K;
    }
  }
}

TEST_F(DecoderCudaTiny, GreedySpeculativeEqualsTargetOnlyOnGpuAndCpu) {
  const DecodeOptions o = greedy_opts(kMaxNew);
  const std::vector<DecodeResult> spec = dec_->generate(ps_, o, 1);
  const std::vector<DecodeResult> tgt = dec_->target_generate(ps_, o, 1);
  ASSERT_EQ(spec.size(), ps_.size());
  for (size_t i = 0; i < ps_.size(); ++i) {
    const DecodeResult cpu = target_generate(tiny(), ps_[i], o);
    EXPECT_EQ(spec[i].tokens, tgt[i].tokens) << "request " << i;
    expect_equal_or_near_tie(ps_[i], tgt[i].tokens, cpu.tokens, i);
    EXPECT_EQ(static_cast<int64_t>(tgt[i].tokens.size()), kMaxNew);
    EXPECT_TRUE(tgt[i].accept_lengths.empty());
    int sum = 0;
    for (int a : spec[i].accept_lengths) {
      EXPECT_GE(a, 1);
      EXPECT_LE(a, 8);
      sum += a;
    }
    // The first token comes from the prefill; a last step may overshoot max_new_tokens.
    EXPECT_GE(sum + 1, static_cast<int>(spec[i].tokens.size())) << "request " << i;
    EXPECT_GT(spec[i].prefill_seconds, 0.0);
  }
  // Block size 3 changes the steps, not the output.
  DecodeOptions o3 = o;
  o3.block_size = 3;
  const std::vector<DecodeResult> spec3 = dec_->generate(ps_, o3, 1);
  for (size_t i = 0; i < ps_.size(); ++i) EXPECT_EQ(spec3[i].tokens, tgt[i].tokens);
}

TEST_F(DecoderCudaTiny, StopTokensEndTheOutputAsOnTheCpu) {
  DecodeOptions o = greedy_opts(kMaxNew);
  const DecodeResult cpu_free = target_generate(tiny(), ps_[0], o);
  ASSERT_GE(cpu_free.tokens.size(), 6u);
  o.stop_ids = {cpu_free.tokens[5]};  // a token of the output: it ends there (or earlier)
  const DecodeResult cpu = target_generate(tiny(), ps_[0], o);
  const std::vector<std::vector<int32_t>> one = {ps_[0]};
  const std::vector<DecodeResult> spec = dec_->generate(one, o, 1);
  const std::vector<DecodeResult> tgt = dec_->target_generate(one, o, 1);
  EXPECT_EQ(spec[0].tokens, cpu.tokens);
  EXPECT_EQ(tgt[0].tokens, cpu.tokens);
  EXPECT_TRUE(spec[0].stopped && tgt[0].stopped);
}

TEST_F(DecoderCudaTiny, BatchOutputEqualsBatchOneOutputPerRequest) {
  const DecodeOptions o = greedy_opts(kMaxNew);
  const std::vector<DecodeResult> one = dec_->generate(ps_, o, 1);
  const std::vector<DecodeResult> t_one = dec_->target_generate(ps_, o, 1);
  for (int batch : {3, 4}) {  // 5 requests: slots are reused after the first ones end
    std::vector<std::vector<int32_t>> streamed(ps_.size());
    const std::vector<DecodeResult> many =
        dec_->generate(ps_, o, batch, [&](size_t i, std::span<const int32_t> t) {
          streamed[i].insert(streamed[i].end(), t.begin(), t.end());
        });
    const std::vector<DecodeResult> t_many = dec_->target_generate(ps_, o, batch);
    for (size_t i = 0; i < ps_.size(); ++i) {
      EXPECT_EQ(many[i].tokens, one[i].tokens) << "batch " << batch << " request " << i;
      EXPECT_EQ(many[i].accept_lengths, one[i].accept_lengths) << "batch " << batch;
      EXPECT_EQ(streamed[i], many[i].tokens) << "batch " << batch << " request " << i;
      EXPECT_EQ(t_many[i].tokens, t_one[i].tokens) << "batch " << batch << " request " << i;
    }
  }
}

TEST_F(DecoderCudaTiny, GraphReplaysEqualEagerLaunches) {
  const DecodeOptions o = greedy_opts(kMaxNew);
  const std::vector<DecodeResult> g = dec_->generate(ps_, o, 2);
  EXPECT_GE(dec_->graphs_captured(), 1u);
  const size_t captured = dec_->graphs_captured();
  (void)dec_->generate(ps_, o, 2);
  EXPECT_EQ(dec_->graphs_captured(), captured) << "a second call captured again";
  dec_->use_graphs(false);
  const std::vector<DecodeResult> e = dec_->generate(ps_, o, 2);
  for (size_t i = 0; i < ps_.size(); ++i) {
    EXPECT_EQ(g[i].tokens, e[i].tokens) << "request " << i;
    EXPECT_EQ(g[i].accept_lengths, e[i].accept_lengths) << "request " << i;
  }
}

// Padding the GEMMs' rows to 16 leaks nothing into the real rows: padded speculative output
// equals padded target-only output, and that one the CPU target's up to a bf16 near-tie (a row
// count may pick another cuBLASLt kernel, so bits may move, never by more than rounding).
TEST_F(DecoderCudaTiny, PaddedGemmRowsChangeNoToken) {
  const DecodeOptions o = greedy_opts(kMaxNew);
  dec_->pad_gemm_rows(16);
  const std::vector<DecodeResult> spec = dec_->generate(ps_, o, 2);
  const std::vector<DecodeResult> tgt = dec_->target_generate(ps_, o, 2);
  for (size_t i = 0; i < ps_.size(); ++i) {
    EXPECT_EQ(spec[i].tokens, tgt[i].tokens) << "request " << i;
    expect_equal_or_near_tie(ps_[i], tgt[i].tokens, target_generate(tiny(), ps_[i], o).tokens, i);
  }
  try {
    dec_->pad_gemm_rows(17);
    ADD_FAILURE() << "no error for a padding of 17";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside [1, 16]"), std::string::npos) << e.what();
  }
}

TEST_F(DecoderCudaTiny, RefusesWhatItCannotDoNamingIt) {
  auto expect_error = [](auto&& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error thrown (expected '" << part << "')";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  DecodeOptions o = greedy_opts(kMaxNew);
  o.sampling.top_p = 1.5;
  expect_error([&] { dec_->generate(ps_, o, 1); }, "top_p must be in (0, 1]");
  const DecodeOptions g = greedy_opts(kMaxNew);
  expect_error([&] { dec_->generate(ps_, g, 5); }, "batch size 5 exceeds the 4 requests");
  expect_error([&] { dec_->generate(ps_, g, 0); }, "batch size must be >= 1");
  std::vector<std::vector<int32_t>> long_one = ps_;
  long_one[1].resize(static_cast<size_t>(limits_.max_prefill) + 1, 5);
  expect_error([&] { dec_->generate(long_one, g, 1); }, "request 1: prompt of");
  expect_error([&] { dec_->generate(ps_, greedy_opts(kMaxNew + 50), 1); }, "request 0: prompt");
  std::vector<std::vector<int32_t>> bad = ps_;
  bad[2][0] = 9000;
  expect_error([&] { dec_->generate(bad, g, 1); }, "request 2: token 9000");
  DecodeOptions b9 = g;
  b9.block_size = 9;
  expect_error([&] { dec_->generate(ps_, b9, 1); }, "block size 9 is outside [2, 8]");
}

DecodeOptions sampled_opts(int64_t max_new, const SamplingParams& sp, uint64_t seed) {
  DecodeOptions o = greedy_opts(max_new);
  o.sampling = sp;
  o.seed = seed;
  return o;
}

// Request i draws from seed + i alone: batch 3 and 4 (slots refilled) give batch 1's tokens and
// acceptance lengths, speculative and target-only; a rerun gives them again, graphs or eager;
// another seed gives other tokens.
TEST_F(DecoderCudaTiny, SampledOutputDependsOnTheSeedAloneNotTheBatch) {
  const DecodeOptions o = sampled_opts(kMaxNew, SamplingParams{0.8, 0, 0.95}, 11);
  const std::vector<DecodeResult> one = dec_->generate(ps_, o, 1);
  const std::vector<DecodeResult> t_one = dec_->target_generate(ps_, o, 1);
  for (int batch : {3, 4}) {
    const std::vector<DecodeResult> many = dec_->generate(ps_, o, batch);
    const std::vector<DecodeResult> t_many = dec_->target_generate(ps_, o, batch);
    for (size_t i = 0; i < ps_.size(); ++i) {
      EXPECT_EQ(many[i].tokens, one[i].tokens) << "batch " << batch << " request " << i;
      EXPECT_EQ(many[i].accept_lengths, one[i].accept_lengths) << "batch " << batch;
      EXPECT_EQ(t_many[i].tokens, t_one[i].tokens) << "batch " << batch << " request " << i;
    }
  }
  dec_->use_graphs(false);
  const std::vector<DecodeResult> eager = dec_->generate(ps_, o, 2);
  size_t differ = 0;
  const std::vector<DecodeResult> other =
      dec_->generate(ps_, sampled_opts(kMaxNew, SamplingParams{0.8, 0, 0.95}, 12), 1);
  for (size_t i = 0; i < ps_.size(); ++i) {
    EXPECT_EQ(eager[i].tokens, one[i].tokens) << "request " << i;
    EXPECT_EQ(static_cast<int64_t>(one[i].tokens.size()), kMaxNew);
    differ += other[i].tokens != one[i].tokens;
  }
  EXPECT_GT(differ, 0u) << "seed 12 gave seed 11's tokens for every request";
}

// top-k = 1 leaves one token per row (q and p one-hot at the argmax): the rule then accepts exactly
// the drafts greedy decoding accepts and resamples the target's argmax, so the output, and the
// acceptance lengths, are greedy decoding's.
TEST_F(DecoderCudaTiny, TopKOneSamplingEqualsGreedy) {
  const DecodeOptions g = greedy_opts(kMaxNew);
  const DecodeOptions o = sampled_opts(kMaxNew, SamplingParams{0.7, 1, 1.0}, 3);
  const std::vector<DecodeResult> greedy = dec_->generate(ps_, g, 2);
  const std::vector<DecodeResult> t_greedy = dec_->target_generate(ps_, g, 2);
  const std::vector<DecodeResult> k1 = dec_->generate(ps_, o, 2);
  const std::vector<DecodeResult> t_k1 = dec_->target_generate(ps_, o, 2);
  for (size_t i = 0; i < ps_.size(); ++i) {
    EXPECT_EQ(k1[i].tokens, greedy[i].tokens) << "request " << i;
    EXPECT_EQ(k1[i].accept_lengths, greedy[i].accept_lengths) << "request " << i;
    EXPECT_EQ(t_k1[i].tokens, t_greedy[i].tokens) << "request " << i;
  }
}

// Categories over (t1, t2) with exact probability ≥ 5/n, plus "other" (last).
struct PairCategories {
  std::map<std::pair<int32_t, int32_t>, size_t> index;
  std::vector<double> probs;
  size_t of(int32_t a, int32_t b) const {
    const auto it = index.find({a, b});
    return it == index.end() ? probs.size() - 1 : it->second;
  }
};

// n = 3,000 requests of one prompt (request i: seed 500 + i) decoded speculatively on the GPU, 2
// tokens each, batch 64: t1 is drawn from the target's processed p(·|prompt) at the prefill, t2 by
// the speculative rule over the untrained drafter's q (mostly rejections and resamples). Both the
// first token alone and the pair (t1, t2) are checked against the exact probabilities from the CPU
// target's fp32 logits (p(t1)·p(t2|t1)); the GPU's bf16 target is within its tolerance of them,
// far below what 3,000 draws can see. The prompt (the start of an assistant turn) leaves the tiny
// target uncertain: T 1 gives 10 first-token and 42 pair categories (79 % of the mass), T 0.8 with
// top-k 40 gives 5 and 22 (96 %). top-p is left to the op test (tests/cuda/sample_cuda_test): its
// cut sits within 0.0004 of the mass p on these rows, inside the bf16 target's rounding, so the
// CPU's kept set is not the GPU's there. A rule that accepts every draft fails (t2 ~ q).
TEST(DecoderCudaSampling, FirstTwoTokensFollowTheTargetDistribution) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const TargetModel& m = tiny();
  const int64_t V = m.vocab_size(), n = 3000;
  const LoadedDrafter drafter = random_drafter(2, 4, 21);
  const Tokenizer tok = Tokenizer::load(test::assets_dir() / "tiny-qwen3");
  const std::vector<int32_t> prompt = tok.encode(
      "<|im_start|>user\nGive a short definition of dog.<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(n), prompt);
  SpeculativeDecoderCuda dec(ctx, m, drafter, decoder_cuda_limits(prompts, 2, 4, 64));
  for (const SamplingParams& sp : {SamplingParams{1.0, 0, 1.0}, SamplingParams{0.8, 40, 1.0}}) {
    // Exact probabilities of t1 and of the pairs (t1, t2) from the CPU target.
    TargetKvCache c0 = m.new_cache();
    const ForwardOptions last{{}, LogitsRows::last, false};
    const ForwardResult r0 = m.prefill(c0, prompt, last);
    std::vector<double> p1, p2;
    sampling_probs(p1, std::span<const float>(r0.logits.data<float>(), static_cast<size_t>(V)), sp);
    PairCategories cats;
    const double thr = 5.0 / static_cast<double>(n);
    double covered = 0;
    for (int32_t a = 0; a < V; ++a) {
      if (p1[a] < thr) continue;
      TargetKvCache c1 = c0;
      const ForwardResult r1 = m.append(c1, std::span<const int32_t>(&a, 1), last);
      sampling_probs(p2, std::span<const float>(r1.logits.data<float>(), static_cast<size_t>(V)),
                     sp);
      for (int32_t b = 0; b < V; ++b) {
        if (p1[a] * p2[b] < thr) continue;
        cats.index[{a, b}] = cats.probs.size();
        cats.probs.push_back(p1[a] * p2[b]);
        covered += p1[a] * p2[b];
      }
    }
    cats.probs.push_back(std::max(0.0, 1.0 - covered));
    // t1 alone: the tokens of probability ≥ 5/n, plus "other".
    std::vector<int32_t> first_ids;
    std::vector<double> first_p;
    double first_covered = 0;
    for (int32_t a = 0; a < V; ++a)
      if (p1[a] >= thr) {
        first_ids.push_back(a);
        first_p.push_back(p1[a]);
        first_covered += p1[a];
      }
    first_p.push_back(std::max(0.0, 1.0 - first_covered));
    const int df_pairs = static_cast<int>(cats.probs.size()) - 1;
    const int df_first = static_cast<int>(first_p.size()) - 1;
    ASSERT_GE(df_pairs, 3) << "the prompt's continuation is too predictable for a useful test";

    const std::vector<DecodeResult> out = dec.generate(prompts, sampled_opts(2, sp, 500), 64);
    std::vector<int64_t> pairs(cats.probs.size(), 0), first(first_p.size(), 0);
    for (const DecodeResult& r : out) {
      ASSERT_EQ(r.tokens.size(), 2u);
      ++pairs[cats.of(r.tokens[0], r.tokens[1])];
      const auto it = std::find(first_ids.begin(), first_ids.end(), r.tokens[0]);
      ++first[static_cast<size_t>(it - first_ids.begin())];  // the end is "other"
    }
    const double x_pairs = chi2_stat(pairs, cats.probs, n), x_first = chi2_stat(first, first_p, n);
    std::printf(
        "T %.2f top-k %lld top-p %.2f, %lld requests: t1 chi2 %.1f (%d categories, critical "
        "%.1f); (t1, t2) chi2 %.1f (%d categories, covered mass %.3f, critical %.1f)\n",
        sp.temperature, static_cast<long long>(sp.top_k), sp.top_p, static_cast<long long>(n),
        x_first, df_first + 1, chi2_critical_1e4(df_first), x_pairs, df_pairs + 1, covered,
        chi2_critical_1e4(df_pairs));
    EXPECT_LT(x_first, chi2_critical_1e4(df_first));
    EXPECT_LT(x_pairs, chi2_critical_1e4(df_pairs));
  }
}

// The CUDA target's logits of the last position of `seq` (one prefill over an empty cache; the
// decoder reached that position by one-token steps, so its bits may differ by rounding).
std::vector<float> gpu_last_logits(cuda::CudaContext& ctx, TargetCuda& tc, const TargetModel& m,
                                   const std::vector<int32_t>& seq) {
  const ModelConfig& c = m.config();
  const auto P = static_cast<int64_t>(seq.size());
  const int64_t H = c.hidden_size, V = c.vocab_size, KD = c.num_key_value_heads * c.head_dim;
  std::vector<std::unique_ptr<DeviceGuarded<uint16_t>>> kv;
  TargetCacheCuda cache;
  cache.rows = P;
  for (int64_t l = 0; l < 2 * c.num_hidden_layers; ++l) {
    kv.push_back(std::make_unique<DeviceGuarded<uint16_t>>(static_cast<size_t>(P * KD)));
    (l % 2 ? cache.v : cache.k).push_back(kv.back()->get());
  }
  DeviceGuarded<int32_t> toks(seq), pos(static_cast<size_t>(P)), slots(static_cast<size_t>(P));
  DeviceGuarded<AttnRange> ranges(static_cast<size_t>(P));
  DeviceGuarded<int32_t> lens(std::vector<int32_t>{0});
  DeviceGuarded<float> fnorm_w(m.final_norm_weight()), logits(static_cast<size_t>(V));
  DeviceGuarded<uint16_t> normed(static_cast<size_t>(H));
  decode_rows_cuda(ctx, pos.get(), slots.get(), ranges.get(), nullptr, lens.get(), 1, P, 0, P);
  tc.forward_cached(nullptr, toks.get(), pos.get(), slots.get(), ranges.get(), P, P, {}, cache);
  rmsnorm_fwd_cuda(ctx, normed.get(), static_cast<float*>(nullptr), tc.residual() + (P - 1) * H,
                   fnorm_w.get(), 1, H, c.rms_norm_eps);
  cuda::gemm_bf16(ctx, logits.get(), DType::f32, V, normed.get(), H, false, tc.lm_head(), H, true,
                  1, V, H);
  return logits.download();
}

// Where the greedy paths of the two backends part on the prompts of the tiny reference's eval
// (`dflash eval --limit 150 --per-source 66 --max-new-tokens 96`, target-only: speculative
// output equals it on either backend). At the first differing token, the CPU's logits (fp32
// activations) and the CUDA target's (bf16) of the two tokens must each be within the bf16
// tolerance of whole target forwards (tol::kTargetTaps × the row's largest |logit|) of a tie: a
// near-tie taken the other way, not a wrong token. Prints each such prompt (the τ of `dflash eval`
// on the other prompts is compared in docs/perf-runs-decoding.md).
TEST(DecoderCudaGreedyPaths, EvalPromptsLeaveTheCpuOnlyAtNearTies) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const TargetModel& m = tiny();
  const std::filesystem::path dir = test::assets_dir() / "tiny-qwen3";
  const Tokenizer tok = Tokenizer::load(dir);
  const std::vector<EvalPrompt> prompts =
      load_eval_prompts(test::assets_dir() / "data" / "eval_prompts.jsonl",
                        resolve_chat_template(dir, ""), tok, 150, 66);
  std::vector<std::vector<int32_t>> ids;
  for (const EvalPrompt& p : prompts) ids.push_back(p.tokens);
  DecodeOptions o = greedy_opts(96);
  o.stop_ids = generation_eos_ids(dir, m.config());
  const LoadedDrafter d = random_drafter(2, 8, 7);
  std::vector<DecodeResult> gpu;
  {
    SpeculativeDecoderCuda dec(ctx, m, d, decoder_cuda_limits(ids, 96, 8, 64));
    gpu = dec.target_generate(ids, o, 64);
  }
  const std::vector<DecodeResult> cpu = DecoderCpu(m, nullptr).target_generate(ids, o, 16);
  size_t max_len = 0;
  for (const auto& p : ids) max_len = std::max(max_len, p.size() + 96);
  TargetCuda tc(ctx, m, static_cast<int64_t>(max_len));
  const int64_t V = m.vocab_size();
  int agree = 0;
  std::string parted;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::vector<int32_t>&g = gpu[i].tokens, &c = cpu[i].tokens;
    size_t j = 0;
    while (j < g.size() && j < c.size() && g[j] == c[j]) ++j;
    if (j == g.size() && j == c.size()) {
      ++agree;
      continue;
    }
    parted += (parted.empty() ? "" : " ") + prompts[i].id;
    ASSERT_TRUE(j < g.size() && j < c.size()) << prompts[i].id << ": one output is a prefix";
    std::vector<int32_t> seq = ids[i];
    seq.insert(seq.end(), c.begin(), c.begin() + static_cast<std::ptrdiff_t>(j));
    const auto n = static_cast<int64_t>(seq.size());
    const std::vector<int32_t> off = {0, static_cast<int32_t>(n)};
    const std::vector<float> all = m.forward_logits(seq, off).to_f32_vector();
    const std::vector<float> cl(all.end() - V, all.end()), gl = gpu_last_logits(ctx, tc, m, seq);
    float top = 0;
    for (int64_t v = 0; v < V; ++v) top = std::max({top, std::fabs(cl[v]), std::fabs(gl[v])});
    const double cpu_gap = cl[c[j]] - cl[g[j]], gpu_gap = gl[g[j]] - gl[c[j]];
    std::printf(
        "%s: output token %zu: CPU %d (logits CPU %.4f / CUDA %.4f), CUDA %d (CPU %.4f / CUDA "
        "%.4f); CPU gap %.4f, CUDA gap %.4f, max |logit| %.2f\n",
        prompts[i].id.c_str(), j, c[j], cl[c[j]], gl[c[j]], g[j], cl[g[j]], gl[g[j]], cpu_gap,
        gpu_gap, top);
    EXPECT_LE(cpu_gap, test::tol::kTargetTaps * top) << prompts[i].id;
    EXPECT_LE(gpu_gap, test::tol::kTargetTaps * top) << prompts[i].id;
  }
  std::printf("greedy target-only outputs equal on %d of %zu eval prompts; parted: %s\n", agree,
              ids.size(), parted.c_str());
}

// `dflash generate --backend cuda` prints the text and the step count of the CPU backend (greedy:
// the same tokens; the drafter's τ may differ in bf16, so only "tokens:" is compared); sampled, it
// prints the same text for the same seed.
TEST(DecoderCudaCli, GenerateOnCudaPrintsTheCpuText) {
  DFLASH_REQUIRE_GPU();
  const test::TempDir dir;
  const LoadedDrafter d = random_drafter(2, 8, 11);
  drafter_save(dir / "drafter", d.config, d.layout, d.params, DType::f32);
  const std::string target = (test::assets_dir() / "tiny-qwen3").string();
  auto gen = [&](const std::string& backend, const std::string& temperature,
                 const std::string& seed = "0") {
    return test::run_dflash({"generate", "--target", target, "--drafter",
                             (dir / "drafter").string(), "--prompt", "Call me Ishmael.",
                             "--max-new-tokens", "24", "--backend", backend, "--temperature",
                             temperature, "--seed", seed});
  };
  const test::RunResult cpu = gen("cpu", "0"), gpu = gen("cuda", "0");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  ASSERT_EQ(gpu.exit_code, 0) << gpu.err;
  auto text = [](const std::string& out) { return out.substr(0, out.find("\nsteps:")); };
  EXPECT_EQ(text(gpu.out), text(cpu.out));
  EXPECT_NE(gpu.out.find("tokens: "), std::string::npos) << gpu.out;
  const test::RunResult sampled = gen("cuda", "0.8", "5"), again = gen("cuda", "0.8", "5");
  ASSERT_EQ(sampled.exit_code, 0) << sampled.err;
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(text(sampled.out), text(again.out));
  EXPECT_NE(sampled.out.find("tokens: "), std::string::npos) << sampled.out;
}

}  // namespace
}  // namespace dflash
