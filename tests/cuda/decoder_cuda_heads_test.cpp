// Tests of the decode heads' ops (the linear layer against a double reference, the slot argmax's
// ties, the slot draw's distribution by chi-square and its q row) and of the CUDA decoder with
// DSpark and Domino drafters (infer/decoder_cuda_heads.hpp,
// ops/decode_heads.hpp) on the tiny fixture, with seeded drafters whose heads are scaled up so
// that they move the argmax (as the CPU decode tests' drafters):
//   - the first step's proposals (greedy) and q rows (sampled) against the CPU decoder's head
//     functions (dspark_slot_logits, domino_feed, domino_slot_logits) applied to the same block
//     logits and final-norm rows, fed the GPU's previous proposals: the same tokens (or a near
//     tie), q within 5e-4; and the CPU decoder's own first step gives the same proposals up to a
//     near tie of its drafter's logits;
//   - greedy speculative output == greedy target-only output (lossless) at batch 1 and 3, every
//     acceptance length in [1, K + 1] for DSpark (all K slots draft) and [1, K] for Domino;
//   - a request's output (greedy and sampled) does not depend on the batch size, and graphs give
//     the eager launches' tokens;
//   - a DSpark head planted with the target's continuation makes steps accept K + 1 tokens.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>

#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "cuda_test_util.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder_cuda.hpp"
#include "infer/sampling.hpp"
#include "infer/speculative.hpp"
#include "model/domino_head.hpp"
#include "model/drafter_io.hpp"
#include "model/dspark_head.hpp"
#include "ops/decode_heads.hpp"
#include "tolerances.hpp"
#include "util/decode_fixture.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::TempDir;

const TargetModel& tiny() {
  static const TargetModel m = TargetModel::load(test::assets_dir() / "tiny-qwen3");
  return m;
}

constexpr int kBlock = 6;
constexpr int64_t kMaxNew = 32;

// A seeded DSpark drafter of Markov head `type` (rank 8, confidence head on), its W2 scaled up
// so that the bias moves the argmax (tests/dspark_decode_test's drafter).
LoadedDrafter dspark_drafter(const TempDir& dir, MarkovHeadType type, uint64_t seed) {
  const DsparkHeads heads{true, 8, type, true, false};
  return drafter_load(test::save_tiny_drafter(
      dir.path(), "dspark" + std::to_string(seed), kBlock, seed,
      [&](DrafterConfig& c) { c.dspark = heads; },
      [&](const DrafterConfig& c, const DrafterLayout& layout, std::vector<float>& params) {
        for (int64_t i = 0; i < c.vocab_size * heads.markov_rank; ++i)
          params[static_cast<size_t>(layout.dspark.markov_w2 + i)] *= 400.0f;
      }));
}

// A seeded Domino drafter (E 8, G 16, prefix P, shift_label `shift`), its projections scaled up
// so that the correction moves the argmax (tests/domino_decode_test's drafter).
LoadedDrafter domino_drafter(const TempDir& dir, int P, bool shift, uint64_t seed) {
  const DominoHead head{true, 8, 16, P, shift};
  return drafter_load(test::save_tiny_drafter(
      dir.path(), "domino" + std::to_string(seed), kBlock, seed,
      [&](DrafterConfig& c) { c.domino = head; },
      [&](const DrafterConfig& c, const DrafterLayout& layout, std::vector<float>& params) {
        auto scale = [&](int64_t offset, int64_t n, float by) {
          for (int64_t i = 0; i < n; ++i) params[static_cast<size_t>(offset + i)] *= by;
        };
        scale(layout.domino.proj2, c.vocab_size * head.emb_dim, 400.0f);
        scale(layout.domino.proj1, head.emb_dim * (c.hidden_size + head.gru_hidden_dim), 20.0f);
        scale(layout.domino.gru_ih, 3 * head.gru_hidden_dim * c.hidden_size, 20.0f);
      }));
}

struct HeadCase {
  std::string name;
  std::function<LoadedDrafter(const TempDir&)> make;
};

std::vector<HeadCase> head_cases() {
  return {
      {"dspark vanilla",
       [](const TempDir& d) { return dspark_drafter(d, MarkovHeadType::vanilla, 3); }},
      {"dspark gated",
       [](const TempDir& d) { return dspark_drafter(d, MarkovHeadType::gated, 4); }},
      {"dspark rnn", [](const TempDir& d) { return dspark_drafter(d, MarkovHeadType::rnn, 5); }},
      {"domino P0", [](const TempDir& d) { return domino_drafter(d, 0, false, 6); }},
      {"domino P1 shift", [](const TempDir& d) { return domino_drafter(d, 1, true, 7); }},
  };
}

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

bool has_gpu() {
  return cuda::device_count() > 0;
}

// The CPU decoder's head rows of one block, teacher-forced with `proposals` (the anchor `first`
// before them): row j is the logits row proposal j was taken from (DSpark: D_k, k = j; Domino:
// F_k, k = j + 1 or j with shift_label), computed by the CPU's dspark_slot_logits /
// domino_feed + domino_slot_logits from the block logits U [K, V] and final-norm rows h [K, H].
std::vector<std::vector<float>> cpu_head_rows(const LoadedDrafter& d, const std::vector<float>& U,
                                              const std::vector<float>& h, int32_t first,
                                              const std::vector<int32_t>& proposals) {
  const DrafterConfig& c = d.config;
  const int64_t V = c.vocab_size, H = c.hidden_size;
  const std::vector<float> embed = tiny().embedding_f32();
  std::vector<std::vector<float>> rows;
  DsparkSlotState ds;
  DominoSlotState dm;
  if (c.domino.enabled) domino_block_start(c, dm);
  const int off = c.dspark.enabled || c.domino.shift_label ? 0 : 1;
  int32_t prev = first;
  for (size_t j = 0; j < proposals.size(); ++j) {
    const int k = off + static_cast<int>(j);
    std::vector<float> row(U.begin() + k * V, U.begin() + (k + 1) * V);
    if (c.dspark.enabled)
      dspark_slot_logits(c, d.layout, d.params.data(), row.data(), h.data() + k * H, prev, k, ds);
    if (c.domino.enabled) {
      domino_feed(c, d.layout, d.params.data(), embed.data(), prev, dm);
      domino_slot_logits(c, d.layout, d.params.data(), row.data(), h.data() + k * H, k, dm);
    }
    rows.push_back(std::move(row));
    prev = proposals[j];
  }
  return rows;
}

// `got` is the argmax of `row` or within a near tie of it (1e-4 of the row's largest |logit|:
// f32 sums in another order, not a wrong head).
void expect_argmax_or_tie(const std::vector<float>& row, int32_t got, const std::string& what) {
  const int32_t want = argmax_row(row.data(), static_cast<int64_t>(row.size()));
  if (got == want) return;
  float top = 0;
  for (float v : row) top = std::max(top, std::fabs(v));
  ASSERT_GE(got, 0);
  ASSERT_LT(got, static_cast<int32_t>(row.size()));
  EXPECT_LE(row[want] - row[got], 1e-4 * top) << what << ": GPU " << got << ", CPU " << want;
}

// head_linear_cuda against a double reference: strided output and base, bias, and in place.
TEST(DecodeHeadsOps, LinearIsTheRowsProductPlusBaseAndBias) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const int64_t B = 3, IN = 37, OUT = 129, ld = 140;
  const std::vector<float> w = test::randn(static_cast<size_t>(OUT * IN), 1);
  const std::vector<float> x = test::randn(static_cast<size_t>(B * IN), 2);
  const std::vector<float> bias = test::randn(static_cast<size_t>(OUT), 3);
  const std::vector<float> base = test::randn(static_cast<size_t>(B * ld), 4);
  test::DeviceGuarded<float> dw(w), dx(x), dbias(bias), dbase(base),
      dy(static_cast<size_t>(B * ld));
  head_linear_cuda(ctx, dy.get(), ld, dbase.get(), ld, dw.get(), dbias.get(), dx.get(), B, IN, OUT);
  head_linear_cuda(ctx, dbase.get(), ld, dbase.get(), ld, dw.get(), nullptr, dx.get(), B, IN, OUT);
  const std::vector<float> y = dy.download(), inplace = dbase.download();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t o = 0; o < OUT; ++o) {
      double dot = 0;
      for (int64_t i = 0; i < IN; ++i) dot += double{w[o * IN + i]} * x[b * IN + i];
      const size_t at = static_cast<size_t>(b * ld + o);
      EXPECT_NEAR(y[at], base[at] + bias[o] + dot, 1e-4) << b << " " << o;
      EXPECT_NEAR(inplace[at], base[at] + dot, 1e-4) << b << " " << o;
    }
  for (int64_t b = 0; b < B; ++b)  // columns past OUT are not written
    EXPECT_EQ(inplace[static_cast<size_t>(b * ld + OUT)], base[static_cast<size_t>(b * ld + OUT)]);
  EXPECT_TRUE(dy.guard_intact() && dbase.guard_intact());
}

// decode_slot_argmax_cuda: the smallest index of the maximum of strided rows, into one column.
TEST(DecodeHeadsOps, SlotArgmaxTakesTheSmallestIndexOfTheMaximum) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const int64_t B = 3, V = 3001, ld = 3 * V;
  std::vector<float> rows(static_cast<size_t>(B * ld), 0.0f);
  const int64_t best[] = {7, 2999, 1500};
  for (int64_t b = 0; b < B; ++b) {
    rows[static_cast<size_t>(b * ld + best[b])] = 5.0f;
    rows[static_cast<size_t>(b * ld + 3000)] = 5.0f;   // a tie at a larger index (b < 2)
    rows[static_cast<size_t>(b * ld + V + 1)] = 9.0f;  // past the row: not read
  }
  test::DeviceGuarded<float> drows(rows);
  test::DeviceGuarded<int32_t> block(static_cast<size_t>(B * 4));
  decode_slot_argmax_cuda(ctx, block.get(), 4, 2, drows.get(), ld, B, V);
  const std::vector<int32_t> got = block.download();
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_EQ(got[static_cast<size_t>(b * 4 + 2)], best[b]) << b;
    EXPECT_EQ(got[static_cast<size_t>(b * 4 + 1)], -1) << "another column was written";
  }
  EXPECT_TRUE(block.guard_intact());
}

// decode_slot_draw_cuda: 8,000 requests draw from the same row (seeds 0..n−1): the counts follow
// the row (Pearson chi-square at significance 1e-4), no token of probability 0 is drawn, and each
// request's q row is a copy of the row.
TEST(DecodeHeadsOps, SlotDrawFollowsTheRowAndCopiesIt) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const int64_t n = 8000, V = 1501, ld_block = 3, col = 2;
  std::vector<float> row(static_cast<size_t>(V), 0.0f);
  double sum = 0;
  for (int64_t i = 5; i < V; i += 47) sum += row[static_cast<size_t>(i)] = 1.0f + (i % 7);
  for (float& v : row) v = static_cast<float>(v / sum);
  std::vector<float> probs;
  for (int64_t b = 0; b < n; ++b) probs.insert(probs.end(), row.begin(), row.end());
  std::vector<uint64_t> seeds(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) seeds[static_cast<size_t>(b)] = static_cast<uint64_t>(b);
  test::DeviceGuarded<float> dprobs(probs), q(static_cast<size_t>(n * ld_block * V));
  test::DeviceGuarded<uint64_t> dseeds(seeds);
  test::DeviceGuarded<int32_t> steps(std::vector<int32_t>(static_cast<size_t>(n), 1));
  test::DeviceGuarded<int32_t> block(static_cast<size_t>(n * ld_block));
  decode_slot_draw_cuda(ctx, block.get(), ld_block, col, q.get(), dprobs.get(), dseeds.get(),
                        steps.get(), n, V);
  const std::vector<int32_t> got = block.download();
  const std::vector<float> qh = q.download();
  std::vector<int32_t> ids;
  std::vector<double> p;
  for (int64_t i = 0; i < V; ++i)
    if (row[static_cast<size_t>(i)] > 0) {
      ids.push_back(static_cast<int32_t>(i));
      p.push_back(row[static_cast<size_t>(i)]);
    }
  std::vector<int64_t> counts(ids.size(), 0);
  for (int64_t b = 0; b < n; ++b) {
    const int32_t t = got[static_cast<size_t>(b * ld_block + col)];
    const auto it = std::find(ids.begin(), ids.end(), t);
    ASSERT_NE(it, ids.end()) << "request " << b << " drew token " << t << " of probability 0";
    ++counts[static_cast<size_t>(it - ids.begin())];
    ASSERT_EQ(got[static_cast<size_t>(b * ld_block + 1)], -1) << "another column was written";
    const float* qr = qh.data() + (b * ld_block + col) * V;
    ASSERT_TRUE(std::equal(row.begin(), row.end(), qr)) << "q row of request " << b;
  }
  const double x = test::chi2_stat(counts, p, n);
  const int df = static_cast<int>(p.size()) - 1;
  std::printf("slot draw: chi2 %.1f over %d categories (critical %.1f)\n", x, df + 1,
              test::chi2_critical_1e4(df));
  EXPECT_LT(x, test::chi2_critical_1e4(df));
  EXPECT_TRUE(block.guard_intact() && q.guard_intact());
}

TEST(DecoderCudaHeads, FirstStepProposalsAndQRowsAreTheCpuHeads) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const auto ps = prompts();
  TempDir dir;
  for (const HeadCase& hc : head_cases()) {
    const LoadedDrafter d = hc.make(dir);
    const int Kv = d.config.dspark.enabled ? kBlock + 1 : kBlock;
    SpeculativeDecoderCuda dec(ctx, tiny(), d, decoder_cuda_limits(ps, kMaxNew, kBlock, 2));
    const SpeculativeDecoder cpu(tiny(), d);
    int moved = 0;  // proposals the head changed from the base argmax (the test's power)
    for (size_t i : {size_t{0}, size_t{3}}) {
      const std::string what = hc.name + ", prompt " + std::to_string(i);
      DecodeOptions o;
      o.max_new_tokens = kMaxNew;
      const auto g = dec.draft_trace(ps[i], o);
      ASSERT_EQ(static_cast<int>(g.proposals.size()), Kv - 1) << what;
      EXPECT_TRUE(g.q.empty());
      const auto rows = cpu_head_rows(d, g.base_logits, g.hidden, g.first, g.proposals);
      const int off = d.config.dspark.enabled || d.config.domino.shift_label ? 0 : 1;
      const int64_t V = d.config.vocab_size;
      for (size_t j = 0; j < rows.size(); ++j) {
        expect_argmax_or_tie(rows[j], g.proposals[j], what + " proposal " + std::to_string(j));
        const float* u = g.base_logits.data() + (off + static_cast<int64_t>(j)) * V;
        if (argmax_row(u, V) != g.proposals[j]) ++moved;
      }
      // The CPU decoder's own first step (its drafter over its f32 target's taps): the same
      // proposals, or a divergence where its rows nearly tie (the bf16 drafter forward).
      SpecState st = cpu.start(ps[i], o);
      EXPECT_EQ(st.anchor, g.first) << what;
      cpu.step(st, o);
      size_t j = 0;
      while (j < g.proposals.size() && st.last_proposals[j] == g.proposals[j]) ++j;
      if (j < g.proposals.size()) {
        std::printf("%s: the CPU decoder's proposals leave the GPU's at %zu\n", what.c_str(), j);
        SpecState s2 = cpu.start(ps[i], o);
        const DrafterConfig c = cpu.config_for_block(kBlock);
        const std::vector<float> embed = tiny().embedding_f32();
        const DrafterTables<float> tables{embed.data(), embed.data()};
        const std::span<const float> U = drafter_draft_block(
            s2.drafter_cache, c, d.layout, d.params.data(), tables, s2.anchor, s2.drafter_ws);
        const auto crow = cpu_head_rows(d, std::vector<float>(U.begin(), U.end()), s2.drafter_ws.hf,
                                        st.anchor, st.last_proposals);
        float top = 0;
        for (float v : crow[j]) top = std::max(top, std::fabs(v));
        EXPECT_LE(crow[j][st.last_proposals[j]] - crow[j][g.proposals[j]],
                  test::tol::kTargetTaps * top)
            << what << " proposal " << j;
      }
      // Sampled: the q rows are the CPU's processed head rows of the GPU's own draws.
      o.sampling.temperature = 0.8;
      o.seed = 11 + i;
      const auto s = dec.draft_trace(ps[i], o);
      ASSERT_EQ(s.q.size(), static_cast<size_t>((Kv - 1) * V)) << what;
      const auto srows = cpu_head_rows(d, s.base_logits, s.hidden, s.first, s.proposals);
      std::vector<double> p;
      for (size_t k = 0; k < srows.size(); ++k) {
        sampling_probs(p, srows[k], o.sampling);
        double err = 0;
        for (int64_t v = 0; v < V; ++v)
          err = std::max(err, std::fabs(p[static_cast<size_t>(v)] - s.q[k * V + v]));
        EXPECT_LT(err, 5e-4) << what << " q row " << k;
        EXPECT_GT(s.q[k * V + s.proposals[k]], 0.0f) << what << " draft " << k;
      }
    }
    EXPECT_GT(moved, 0) << hc.name << ": the head never moved a proposal: the test has no power";
  }
}

TEST(DecoderCudaHeads, GreedyOutputIsTheTargetsAtBatchOneAndThree) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const auto ps = prompts();
  DecodeOptions o;
  o.max_new_tokens = kMaxNew;
  TempDir dir;
  for (const HeadCase& hc : head_cases()) {
    const LoadedDrafter d = hc.make(dir);
    const int max_accept = d.config.dspark.enabled ? kBlock + 1 : kBlock;
    SpeculativeDecoderCuda dec(ctx, tiny(), d, decoder_cuda_limits(ps, kMaxNew, kBlock, 3));
    const auto tgt = dec.target_generate(ps, o, 1);
    const auto one = dec.generate(ps, o, 1);
    const auto three = dec.generate(ps, o, 3);
    int longest = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::string what = hc.name + ", request " + std::to_string(i);
      EXPECT_EQ(one[i].tokens, tgt[i].tokens) << what;
      EXPECT_EQ(three[i].tokens, tgt[i].tokens) << what;
      EXPECT_EQ(three[i].accept_lengths, one[i].accept_lengths) << what;
      EXPECT_EQ(static_cast<int64_t>(one[i].tokens.size()), kMaxNew) << what;
      ASSERT_FALSE(one[i].accept_lengths.empty()) << what;
      for (int a : one[i].accept_lengths) {
        EXPECT_GE(a, 1) << what;
        EXPECT_LE(a, max_accept) << what;
        longest = std::max(longest, a);
      }
    }
    std::printf("%s: longest acceptance %d of %d\n", hc.name.c_str(), longest, max_accept);
  }
}

// A DSpark drafter whose vanilla Markov head is planted with the target's own greedy
// continuation: W1[t_i] = e_i and W2[t_{i+1}] = 1000·e_i for the continuation's tokens t_i (the
// first successor of a repeated token), every other W1 and W2 value 0. Then slot k, fed
// prev = the token before it, proposes the target's next token wherever the table knows it, so
// steps accept all K drafts and the bonus (K + 1): the acceptance of long prefixes and of DSpark's
// extra row, which the random drafters above never reach. The output stays the target's.
TEST(DecoderCudaHeads, PlantedDsparkHeadAcceptsAllKDraftsAndTheBonus) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const auto ps = prompts();
  const std::vector<std::vector<int32_t>> one = {ps[1]};
  DecodeOptions o;
  o.max_new_tokens = kMaxNew;
  std::vector<int32_t> cont;
  {
    SpeculativeDecoderCuda target_only(ctx, tiny(), decoder_cuda_limits(one, kMaxNew, 1, 1));
    cont = target_only.target_generate(one, o, 1)[0].tokens;
  }
  ASSERT_EQ(static_cast<int64_t>(cont.size()), kMaxNew);
  std::vector<std::pair<int32_t, int32_t>> table;  // (t_i, its first successor)
  for (size_t i = 0; i + 1 < cont.size(); ++i) {
    const bool known =
        std::any_of(table.begin(), table.end(), [&](const auto& e) { return e.first == cont[i]; });
    if (!known) table.emplace_back(cont[i], cont[i + 1]);
  }
  const auto r = static_cast<int>(table.size());
  const DsparkHeads heads{true, r, MarkovHeadType::vanilla, false, false};
  TempDir dir;
  const LoadedDrafter d = drafter_load(test::save_tiny_drafter(
      dir.path(), "planted", kBlock, 9, [&](DrafterConfig& c) { c.dspark = heads; },
      [&](const DrafterConfig& c, const DrafterLayout& layout, std::vector<float>& params) {
        const auto w1 = static_cast<size_t>(layout.dspark.markov_w1);
        const auto w2 = static_cast<size_t>(layout.dspark.markov_w2);
        std::fill_n(params.begin() + static_cast<std::ptrdiff_t>(w1), c.vocab_size * r, 0.0f);
        std::fill_n(params.begin() + static_cast<std::ptrdiff_t>(w2), c.vocab_size * r, 0.0f);
        for (int i = 0; i < r; ++i) {
          params[w1 + static_cast<size_t>(table[i].first) * r + i] = 1.0f;
          params[w2 + static_cast<size_t>(table[i].second) * r + i] = 1000.0f;
        }
      }));
  SpeculativeDecoderCuda dec(ctx, tiny(), d, decoder_cuda_limits(one, kMaxNew, kBlock, 1));
  const DecodeResult res = dec.generate(one, o, 1)[0];
  EXPECT_EQ(res.tokens, cont);
  int full = 0;
  for (int a : res.accept_lengths) {
    EXPECT_GE(a, 1);
    EXPECT_LE(a, kBlock + 1);
    full += a == kBlock + 1 ? 1 : 0;
  }
  std::printf(
      "planted DSpark head: %d distinct tokens, %zu steps, %d of them accepting K + 1 = %d\n", r,
      res.accept_lengths.size(), full, kBlock + 1);
  EXPECT_GT(full, 0) << "no step accepted all K drafts and the bonus";
}

TEST(DecoderCudaHeads, OutputDependsOnNeitherBatchNorGraphs) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  cuda::CudaContext ctx(0);
  const auto ps = prompts();
  TempDir dir;
  for (const HeadCase& hc : head_cases()) {
    const LoadedDrafter d = hc.make(dir);
    SpeculativeDecoderCuda dec(ctx, tiny(), d, decoder_cuda_limits(ps, kMaxNew, kBlock, 4));
    DecodeOptions o;
    o.max_new_tokens = kMaxNew;
    o.sampling.temperature = 0.9;
    o.sampling.top_k = 40;
    o.seed = 5;
    const auto one = dec.generate(ps, o, 1);
    const auto four = dec.generate(ps, o, 4);
    dec.use_graphs(false);
    const auto eager = dec.generate(ps, o, 3);
    dec.use_graphs(true);
    o.block_size = 4;  // another block size: another graph, the same rule
    const auto k4 = dec.generate(ps, o, 2);
    const auto k4_one = dec.generate(ps, o, 1);
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::string what = hc.name + ", request " + std::to_string(i);
      EXPECT_EQ(four[i].tokens, one[i].tokens) << what;
      EXPECT_EQ(four[i].accept_lengths, one[i].accept_lengths) << what;
      EXPECT_EQ(eager[i].tokens, one[i].tokens) << what;
      EXPECT_EQ(k4[i].tokens, k4_one[i].tokens) << what;
      EXPECT_EQ(static_cast<int64_t>(one[i].tokens.size()), kMaxNew) << what;
    }
  }
}

}  // namespace
}  // namespace dflash
