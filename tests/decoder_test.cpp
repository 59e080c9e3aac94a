// Tests of the CPU decoder (src/infer/decoder_cpu.hpp) on the tiny fixture: batched decoding gives
// every request exactly its batch-1 output (greedy: also the target's own greedy decoding; sampled:
// also SpeculativeDecoder::generate with seed + index), whatever the batch size, with prompts of
// different lengths finishing at different rounds; the token stream per request; errors naming
// the request.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder_cpu.hpp"
#include "infer/eval.hpp"
#include "model/drafter_io.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::TempDir;

const std::filesystem::path& tiny_dir() {
  static const std::filesystem::path p = test::assets_dir() / "tiny-qwen3";
  return p;
}

const TargetModel& tiny() {
  static const TargetModel m = TargetModel::load(tiny_dir());
  return m;
}

// An untrained drafter (seeded init), block size 4, saved and loaded through the export path.
const LoadedDrafter& random_drafter() {
  static const TempDir dir;
  static const LoadedDrafter d = [] {
    DrafterSizes sizes;
    sizes.block_size = 4;
    sizes.intermediate_size = 256;
    test::save_random_drafter(dir / "drafter", tiny().config(), 1, sizes, 21);
    return drafter_load(dir / "drafter");
  }();
  return d;
}

// Eval prompts of every source (different lengths), as token lists.
std::vector<std::vector<int32_t>> prompts(int per_source) {
  const Tokenizer tok = Tokenizer::load(tiny_dir());
  const ChatTemplate tmpl = resolve_chat_template(tiny_dir(), "");
  std::vector<std::vector<int32_t>> out;
  for (const EvalPrompt& p : load_eval_prompts(test::assets_dir() / "data" / "eval_prompts.jsonl",
                                               tmpl, tok, 0, per_source))
    out.push_back(p.tokens);
  return out;
}

DecodeOptions options(double temperature) {
  DecodeOptions o;
#ifdef NDEBUG
  o.max_new_tokens = 24;
#else
  o.max_new_tokens = 10;  // sanitizer builds: CPU time
#endif
  o.stop_ids = generation_eos_ids(tiny_dir(), tiny().config());
  o.sampling.temperature = temperature;
  o.seed = 1234;
  return o;
}

// Runs `fn(batch_size)` for batch sizes 1, 3 and 8 and checks every request's tokens and
// acceptance lengths agree with batch 1; returns the batch-1 results.
template <typename F>
std::vector<DecodeResult> expect_batch_independent(const F& fn, size_t n) {
  const std::vector<DecodeResult> one = fn(1);
  EXPECT_EQ(one.size(), n);
  for (int b : {3, 8}) {
    const std::vector<DecodeResult> r = fn(b);
    EXPECT_EQ(r.size(), n);
    for (size_t i = 0; i < std::min(n, r.size()); ++i) {
      EXPECT_EQ(r[i].tokens, one[i].tokens) << "batch " << b << " request " << i;
      EXPECT_EQ(r[i].accept_lengths, one[i].accept_lengths) << "batch " << b << " request " << i;
      EXPECT_EQ(r[i].stopped, one[i].stopped) << "batch " << b << " request " << i;
    }
  }
  return one;
}

TEST(DecoderCpu, GreedyBatchesEqualBatchOneAndTheTargetAlone) {
  const auto ps = prompts(2);  // 8 prompts: 2 per source
  DecodeOptions o = options(0.0);
  // Requests must end at different rounds (slots refilled mid-batch): the third token of the first
  // request's answer becomes a stop token too, so that request ends early.
  o.stop_ids.push_back(greedy_generate(tiny(), ps[0], 3, o.stop_ids, true).back());
  DecoderCpu dec(tiny(), &random_drafter());
  const auto spec = expect_batch_independent(
      [&](int b) {
        // The stream of each request, in order, is its output.
        std::vector<std::vector<int32_t>> streamed(ps.size());
        auto r = dec.generate(ps, o, b, [&](size_t i, std::span<const int32_t> t) {
          streamed[i].insert(streamed[i].end(), t.begin(), t.end());
        });
        for (size_t i = 0; i < r.size(); ++i) EXPECT_EQ(streamed[i], r[i].tokens) << i;
        return r;
      },
      ps.size());
  const auto target =
      expect_batch_independent([&](int b) { return dec.target_generate(ps, o, b); }, ps.size());
  std::set<size_t> lengths;
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto ref = greedy_generate(tiny(), ps[i], o.max_new_tokens, o.stop_ids, true);
    EXPECT_EQ(spec[i].tokens, ref) << "request " << i;
    EXPECT_EQ(target[i].tokens, ref) << "request " << i;
    lengths.insert(spec[i].tokens.size());
  }
  // Requests end at different rounds (stop tokens), so slots are refilled mid-batch.
  EXPECT_GT(lengths.size(), 1u);
}

TEST(DecoderCpu, SampledBatchesEqualBatchOneWithTheRequestSeed) {
  const auto ps = prompts(2);
  // A high temperature flattens both distributions: the random drafter's drafts are then often
  // accepted, so requests advance by different amounts per step.
  DecodeOptions o = options(20.0);
  o.sampling.top_p = 0.99;
  DecoderCpu dec(tiny(), &random_drafter());
  const auto spec =
      expect_batch_independent([&](int b) { return dec.generate(ps, o, b); }, ps.size());
  const auto target =
      expect_batch_independent([&](int b) { return dec.target_generate(ps, o, b); }, ps.size());
  const SpeculativeDecoder& single = *dec.speculative();
  int64_t accepted_drafts = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    DecodeOptions oi = o;
    oi.seed = o.seed + i;
    EXPECT_EQ(spec[i].tokens, single.generate(ps[i], oi).tokens) << "request " << i;
    EXPECT_EQ(target[i].tokens, target_generate(tiny(), ps[i], oi).tokens) << "request " << i;
    for (int a : spec[i].accept_lengths) accepted_drafts += a - 1;
  }
  EXPECT_GT(accepted_drafts, 0);
  // Different seeds per request: two requests on the same prompt differ.
  const std::vector<std::vector<int32_t>> same(2, ps[0]);
  const auto two = dec.generate(same, o, 2);
  EXPECT_NE(two[0].tokens, two[1].tokens);
}

TEST(DecoderCpu, BadRequestsAreNamedByIndexBeforeAnyDecoding) {
  DecoderCpu dec(tiny(), &random_drafter());
  const DecodeOptions o = options(0.0);
  auto ps = prompts(1);
  ps[2].clear();
  int calls = 0;
  const BatchTokenCallback count = [&](size_t, std::span<const int32_t>) { ++calls; };
  try {
    dec.generate(ps, o, 2, count);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("request 2: empty prompt"), std::string::npos) << e.what();
  }
  ps = prompts(1);
  ps[1][3] = 9000;
  try {
    dec.target_generate(ps, o, 3, count);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("request 1: prompt token 3 is 9000, outside the "
                                         "vocabulary [0, 8192)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 0);
  try {
    dec.generate(prompts(1), o, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch size must be >= 1 (got 0)"), std::string::npos)
        << e.what();
  }
  // A request's error raised while decoding is named too (a bad option reaches every request;
  // the first one to start names itself).
  DecodeOptions bad = o;
  bad.block_size = 9;
  try {
    dec.generate(prompts(1), bad, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("request 0: block size 9"), std::string::npos) << e.what();
  }
}

TEST(DecoderCpu, WithoutDrafterOnlyTargetDecoding) {
  DecoderCpu dec(tiny(), nullptr);
  EXPECT_EQ(dec.speculative(), nullptr);
  EXPECT_STREQ(dec.backend(), "cpu");
  const auto ps = prompts(1);
  const DecodeOptions o = options(0.0);
  EXPECT_EQ(dec.target_generate(ps, o, 2).size(), ps.size());
  try {
    dec.generate(ps, o, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a drafter"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(dec.target_generate({}, o, 4).empty());
}

}  // namespace
}  // namespace dflash
