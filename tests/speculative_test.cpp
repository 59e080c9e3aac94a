// Tests of speculative decoding (src/infer/speculative.hpp, src/infer/eval.hpp) on the tiny
// fixture: greedy output equals the target's own greedy decoding (greedy_generate, written
// independently in src/model) on eval prompts with an untrained random drafter and with oracle
// proposals that force every acceptance length; block size override; stop tokens; errors.
#include "infer/speculative.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

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

// An untrained drafter (seeded init) saved in the export format and loaded back through the
// normal path.
LoadedDrafter random_drafter(const TempDir& dir, int layers, int block_size, uint64_t seed,
                             std::optional<std::vector<int>> taps = std::nullopt) {
  DrafterSizes sizes;
  sizes.block_size = block_size;
  sizes.intermediate_size = 256;
  const auto d = dir / ("drafter" + std::to_string(seed));
  test::save_random_drafter(d, test::tiny_qwen3_f32().config(), layers, sizes, seed,
                            std::move(taps));
  return drafter_load(d);
}

// The first `per_source` records of every source, in file order (the file holds 700 wordnet,
// then 16 moby, 2 sotu and 400 math records).
std::vector<EvalPrompt> eval_subset(int per_source) {
  const Tokenizer tok = Tokenizer::load(test::tiny_qwen3_dir());
  const ChatTemplate tmpl = resolve_chat_template(test::tiny_qwen3_dir(), "");
  return load_eval_prompts(test::assets_dir() / "data" / "eval_prompts.jsonl", tmpl, tok, 0,
                           per_source);
}

const EvalPrompt& first_of(const std::vector<EvalPrompt>& ps, const std::string& source) {
  for (const auto& p : ps)
    if (p.source == source) return p;
  throw Error("no prompt of source " + source);
}

template <typename F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message '" << e.what() << "' lacks '" << p << "'";
  }
}

TEST(Speculative, PromptsAreFirstUserTurnWithGenerationPrompt) {
  const Tokenizer tok = Tokenizer::load(test::tiny_qwen3_dir());
  const auto prompts = eval_subset(2);
  ASSERT_EQ(prompts.size(), 8u);
  std::set<std::string> sources;
  for (const auto& p : prompts) sources.insert(p.source);
  EXPECT_EQ(sources, (std::set<std::string>{"math", "moby", "sotu", "wordnet"}));
  // wordnet-3 is the file's first record; its user turn, by the chatml template (hand-written).
  EXPECT_EQ(prompts[0].id, "wordnet-3");
  EXPECT_EQ(tok.decode(prompts[0].tokens),
            "<|im_start|>user\nWhat is the meaning of 'organisational'?<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(Speculative, GreedyLosslessRandomDrafterOnEvalPrompts) {
  TempDir dir;
  const LoadedDrafter d = random_drafter(dir, 1, 8, 11);
  const SpeculativeDecoder dec(test::tiny_qwen3_f32(), d);
  // Optimised builds: 20 prompts (6 wordnet, 6 moby, 2 sotu, 6 math) × 32 tokens; Debug and
  // sanitizer builds: 8 prompts × 16 tokens (CPU time).
#ifdef NDEBUG
  const auto prompts = eval_subset(6);
  ASSERT_EQ(prompts.size(), 20u);
  const int64_t max_new = 32;
#else
  const auto prompts = eval_subset(2);
  ASSERT_EQ(prompts.size(), 8u);
  const int64_t max_new = 16;
#endif
  DecodeOptions o;
  o.max_new_tokens = max_new;
  o.stop_ids = generation_eos_ids(test::tiny_qwen3_dir(), test::tiny_qwen3_f32().config());
  int64_t steps = 0, total = 0;
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const EvalPrompt& p = prompts[pi];
    const auto ref =
        greedy_generate(test::tiny_qwen3_f32(), p.tokens, o.max_new_tokens, o.stop_ids, true);
    std::vector<int32_t> streamed;
    const DecodeResult r = dec.generate(p.tokens, o, [&](std::span<const int32_t> t) {
      streamed.insert(streamed.end(), t.begin(), t.end());
    });
    EXPECT_EQ(r.tokens, ref) << "prompt " << p.id;
    EXPECT_EQ(streamed, r.tokens) << "prompt " << p.id;
    for (int a : r.accept_lengths) {
      EXPECT_GE(a, 1);
      EXPECT_LE(a, 8);
    }
    // Every step yields its acceptance length in tokens (the last one possibly trimmed).
    int64_t sum = 0;
    for (int a : r.accept_lengths) sum += a;
    EXPECT_GE(sum + 1, static_cast<int64_t>(r.tokens.size()));
    steps += static_cast<int64_t>(r.accept_lengths.size());
    total += sum;
    // Target-only baseline of eval agrees too (a few prompts: CPU time).
    if (pi % 5 == 0) {
      EXPECT_EQ(target_generate(test::tiny_qwen3_f32(), p.tokens, o).tokens, ref) << p.id;
    }
  }
  // An untrained drafter accepts (almost) nothing: τ ≈ 1.
  EXPECT_LT(static_cast<double>(total) / steps, 1.2);
}

// Oracle proposals: the target's greedy continuation with slot `wrong` (1-based) corrupted, so
// that exactly `wrong − 1` drafts are accepted (all K−1 when wrong ≥ K).
TEST(Speculative, GreedyOracleProposalsEveryAcceptLength) {
  TempDir dir;
  const LoadedDrafter d = random_drafter(dir, 1, 6, 12);
  const SpeculativeDecoder dec(test::tiny_qwen3_f32(), d);
  const auto prompts = eval_subset(1);
  const int64_t V = test::tiny_qwen3_f32().vocab_size();
  for (int K : {1, 2, 5, 9}) {
    for (const char* src : {"wordnet", "math"}) {
      const EvalPrompt& p = first_of(prompts, src);
      DecodeOptions o;
      o.max_new_tokens = 30;  // no stop token: the full length
      const auto ref = greedy_generate(test::tiny_qwen3_f32(), p.tokens, 30 + K, {}, true);
      SpecState s = dec.start(p.tokens, o);
      int step = 0;
      while (!s.done) {
        const size_t m = s.result.tokens.size();
        const int wrong = 1 + (step * 3 + K) % (K + 1);  // 1..K: cycles through every length
        std::vector<int32_t> prop(static_cast<size_t>(K - 1));
        for (int k = 1; k < K; ++k) {
          prop[k - 1] = ref[m + k - 1];
          if (k == wrong) prop[k - 1] = static_cast<int32_t>((prop[k - 1] + 1) % V);
        }
        dec.verify(s, o, prop, {});
        EXPECT_EQ(s.last_proposals, prop);
        const int expect = std::min(wrong, K);
        ASSERT_EQ(s.result.accept_lengths.back(), expect) << "K " << K << " step " << step;
        EXPECT_EQ(s.target_cache.length(), s.drafter_cache.len);
        ++step;
      }
      EXPECT_EQ(s.result.tokens, std::vector<int32_t>(ref.begin(), ref.begin() + 30))
          << "K " << K << " prompt " << p.id;
    }
  }
}

TEST(Speculative, BlockSizeOverrideAndRefusal) {
  TempDir dir;
  const LoadedDrafter d = random_drafter(dir, 2, 8, 13);
  const SpeculativeDecoder dec(test::tiny_qwen3_f32(), d);
  const auto prompts = eval_subset(1);
  const auto& prompt = first_of(prompts, "math").tokens;
  for (int K : {2, 3, 8}) {
    DecodeOptions o;
    o.max_new_tokens = 17;
    o.block_size = K;
    const auto ref = greedy_generate(test::tiny_qwen3_f32(), prompt, 17, {}, true);
    const DecodeResult r = dec.generate(prompt, o);
    EXPECT_EQ(r.tokens, ref) << "block " << K;
    for (int a : r.accept_lengths) EXPECT_LE(a, K);
  }
  DecodeOptions o;
  o.block_size = 9;
  expect_error([&] { dec.generate(prompt, o); }, {"block size 9", "[2, 8]"});
  o.block_size = 1;
  expect_error([&] { dec.generate(prompt, o); }, {"block size 1"});
}

TEST(Speculative, StopTokensAndMaxNewTokens) {
  TempDir dir;
  const LoadedDrafter d = random_drafter(dir, 1, 4, 14);
  const SpeculativeDecoder dec(test::tiny_qwen3_f32(), d);
  const auto prompts = eval_subset(1);
  const auto& prompt = prompts[0].tokens;
  const auto ref = greedy_generate(test::tiny_qwen3_f32(), prompt, 30, {}, true);
  ASSERT_EQ(ref.size(), 30u);
  // Stop on the token at index 7 (its first occurrence): output ends right after it.
  const int32_t stop = ref[7];
  const size_t first = static_cast<size_t>(std::find(ref.begin(), ref.end(), stop) - ref.begin());
  DecodeOptions o;
  o.max_new_tokens = 30;
  o.stop_ids = {stop};
  DecodeResult r = dec.generate(prompt, o);
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.tokens, std::vector<int32_t>(ref.begin(), ref.begin() + first + 1));
  // Odd maxima, including 1 (the prefill token only: no step).
  for (int64_t n : {1, 7, 17}) {
    o.stop_ids.clear();
    o.max_new_tokens = n;
    r = dec.generate(prompt, o);
    EXPECT_FALSE(r.stopped);
    EXPECT_EQ(r.tokens, std::vector<int32_t>(ref.begin(), ref.begin() + n));
    if (n == 1) {
      EXPECT_TRUE(r.accept_lengths.empty());
    }
  }
  // The fixture's generation_config.json lists two eos ids ([2, 0]): both are read.
  const auto eos = generation_eos_ids(test::tiny_qwen3_dir(), test::tiny_qwen3_f32().config());
  EXPECT_EQ(eos, (std::vector<int64_t>{2, 0}));
  o.max_new_tokens = 0;
  expect_error([&] { dec.generate(prompt, o); }, {"max_new_tokens"});
}

TEST(Speculative, DrafterTargetMismatchNamed) {
  TempDir dir;
  // num_target_layers != the target's 6.
  {
    DrafterSizes sizes;
    sizes.block_size = 4;
    ModelConfig other = test::tiny_qwen3_f32().config();
    other.num_hidden_layers = 8;
    const DrafterConfig c = drafter_config_for_target(other, 1, sizes, 8000);
    const DrafterLayout layout(c);
    std::vector<float> params(static_cast<size_t>(layout.total));
    drafter_init(params, layout, 1);
    drafter_save(dir / "layers", c, layout, params);
    const LoadedDrafter d = drafter_load(dir / "layers");
    expect_error([&] { SpeculativeDecoder dec(test::tiny_qwen3_f32(), d); },
                 {"num_target_layers", "8", "6"});
  }
  // Hidden size != the target's 384.
  {
    DrafterSizes sizes;
    sizes.block_size = 4;
    ModelConfig other = test::tiny_qwen3_f32().config();
    other.hidden_size = 256;
    other.head_dim = 64;
    const DrafterConfig c = drafter_config_for_target(other, 1, sizes, 8000);
    const DrafterLayout layout(c);
    std::vector<float> params(static_cast<size_t>(layout.total));
    drafter_init(params, layout, 1);
    drafter_save(dir / "hidden", c, layout, params);
    const LoadedDrafter d = drafter_load(dir / "hidden");
    expect_error([&] { SpeculativeDecoder dec(test::tiny_qwen3_f32(), d); },
                 {"hidden", "256", "384"});
  }
  // A tap outside the target's layers (drafter exported for a deeper target).
  {
    DrafterSizes sizes;
    sizes.block_size = 4;
    ModelConfig other = test::tiny_qwen3_f32().config();
    other.num_hidden_layers = 12;
    const DrafterConfig c = drafter_config_for_target(other, 1, sizes, 8000, std::vector<int>{9});
    const DrafterLayout layout(c);
    std::vector<float> params(static_cast<size_t>(layout.total));
    drafter_init(params, layout, 1);
    drafter_save(dir / "taps", c, layout, params);
    const LoadedDrafter d = drafter_load(dir / "taps");
    try {
      SpeculativeDecoder dec(test::tiny_qwen3_f32(), d);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_TRUE(m.find("num_target_layers") != std::string::npos ||
                  m.find("target_layer_ids") != std::string::npos)
          << m;
    }
  }
}

TEST(Speculative, EvalReportFigures) {
  TempDir dir;
  const LoadedDrafter d = random_drafter(dir, 1, 4, 15);
  DecoderCpu dec(test::tiny_qwen3_f32(), &d);
  const auto prompts = eval_subset(1);
  DecodeOptions o;
  o.max_new_tokens = 9;
  o.stop_ids = generation_eos_ids(test::tiny_qwen3_dir(), test::tiny_qwen3_f32().config());
  std::vector<std::pair<std::string, size_t>> done;
  std::string phase;
  EvalProgress progress;
  progress.phase_start = [&](const char* p) { phase = p; };
  progress.request_done = [&](size_t i) { done.emplace_back(phase, i); };
  const EvalRun run = run_eval(dec, prompts, o, 2, true, progress);
  const auto& res = run.results;
  // Every request of both phases is reported done once.
  ASSERT_EQ(done.size(), 2 * prompts.size());
  std::set<std::pair<std::string, size_t>> unique(done.begin(), done.end());
  EXPECT_EQ(unique.size(), done.size());
  const nlohmann::json rep = eval_report(run, 4, true, true, {{"x", 1}});
  EXPECT_EQ(rep["settings"]["x"], 1);
  // Totals: the calls' wall times, tokens/s over them.
  EXPECT_EQ(rep["total"]["batch_size"], 2);
  EXPECT_DOUBLE_EQ(rep["total"]["seconds_spec"].get<double>(), run.seconds_spec);
  EXPECT_DOUBLE_EQ(rep["total"]["seconds_target"].get<double>(), run.seconds_target);
  EXPECT_DOUBLE_EQ(rep["total"]["tokens_per_s_spec"].get<double>(),
                   rep["total"]["new_tokens"].get<double>() / run.seconds_spec);
  EXPECT_DOUBLE_EQ(rep["total"]["speedup"].get<double>(), run.seconds_target / run.seconds_spec);
  ASSERT_EQ(rep["prompts"].size(), prompts.size());
  int64_t steps = 0, acc = 0;
  std::vector<int64_t> hist(4, 0);
  for (size_t i = 0; i < res.size(); ++i) {
    const auto& row = rep["prompts"][i];
    EXPECT_EQ(row["id"], prompts[i].id);
    EXPECT_EQ(row["source"], prompts[i].source);
    EXPECT_TRUE(row["lossless"].get<bool>());
    EXPECT_EQ(row["new_tokens"].get<size_t>(), res[i].spec.tokens.size());
    for (int a : res[i].spec.accept_lengths) {
      ++steps;
      acc += a;
      ++hist[static_cast<size_t>(a - 1)];
    }
  }
  EXPECT_EQ(rep["total"]["steps"].get<int64_t>(), steps);
  EXPECT_DOUBLE_EQ(rep["total"]["tau"].get<double>(), static_cast<double>(acc) / steps);
  EXPECT_EQ(rep["total"]["accept_histogram"].get<std::vector<int64_t>>(), hist);
  EXPECT_TRUE(rep["total"]["lossless"].get<bool>());
  EXPECT_GT(rep["total"]["speedup"].get<double>(), 0.0);
  int64_t src_prompts = 0;
  for (const auto& [k, v] : rep["per_source"].items()) src_prompts += v["prompts"].get<int64_t>();
  EXPECT_EQ(src_prompts, static_cast<int64_t>(prompts.size()));
}

TEST(Speculative, CliGenerateAndEval) {
  TempDir dir;
  const auto d = random_drafter(dir, 1, 4, 16);
  const std::string ddir = (dir / "drafter16").string();
  const std::string tdir = test::tiny_qwen3_dir().string();
  auto g = test::run_dflash({"generate", "--target", tdir, "--drafter", ddir, "--prompt",
                             "What is 10 times 6?", "--chat", "--max-new-tokens", "12"});
  ASSERT_EQ(g.exit_code, 0) << g.err;
  for (const char* key : {"tokens: ", "steps: ", "tau: ", "tokens/s: "})
    EXPECT_NE(g.out.find(key), std::string::npos) << g.out;
  // The streamed text is the target's greedy continuation of the rendered prompt.
  const Tokenizer tok = Tokenizer::load(test::tiny_qwen3_dir());
  const auto ids =
      tok.encode("<|im_start|>user\nWhat is 10 times 6?<|im_end|>\n<|im_start|>assistant\n");
  const auto ref = greedy_generate(
      test::tiny_qwen3_f32(), ids, 12,
      generation_eos_ids(test::tiny_qwen3_dir(), test::tiny_qwen3_f32().config()), true);
  EXPECT_EQ(g.out.rfind(tok.decode(ref), 0), 0u) << g.out;

  // --show-steps: the same stdout text, and on stderr one line per step whose acceptance lengths
  // give the printed τ.
  auto gs = test::run_dflash({"--log-level", "off", "generate", "--target", tdir, "--drafter", ddir,
                              "--prompt", "What is 10 times 6?", "--chat", "--max-new-tokens", "12",
                              "--show-steps"});
  ASSERT_EQ(gs.exit_code, 0) << gs.err;
  EXPECT_EQ(gs.out.substr(0, gs.out.find("tokens/s: ")), g.out.substr(0, g.out.find("tokens/s: ")));
  std::istringstream lines(gs.err);
  std::string line;
  int n_steps = 0, accept_sum = 0;
  while (std::getline(lines, line)) {
    const std::string key = fmt::format("step {}: accepted ", n_steps + 1);
    ASSERT_EQ(line.rfind(key, 0), 0u) << gs.err;
    int n = -1, total = -1;
    ASSERT_EQ(std::sscanf(line.c_str() + key.size(), "%d/%d", &n, &total), 2) << line;
    EXPECT_EQ(total, 3) << line;  // block size 4: three drafts per step
    EXPECT_NE(line.find(", anchor '"), std::string::npos) << line;
    accept_sum += n + 1;
    ++n_steps;
  }
  ASSERT_GT(n_steps, 0);
  EXPECT_NE(gs.out.find(fmt::format("steps: {}\n", n_steps)), std::string::npos) << gs.out;
  EXPECT_NE(gs.out.find(fmt::format("tau: {:.3f}\n", double(accept_sum) / n_steps)),
            std::string::npos)
      << gs.out;

  // Several prompts decoded together: each output after its header, in prompt order, each the
  // target's greedy continuation of its prompt.
  auto g2 = test::run_dflash({"generate", "--target", tdir, "--drafter", ddir, "--prompt",
                              "What is 10 times 6?", "--prompt", "Define the word cat.", "--chat",
                              "--max-new-tokens", "12", "--batch-size", "2"});
  ASSERT_EQ(g2.exit_code, 0) << g2.err;
  const auto ids2 =
      tok.encode("<|im_start|>user\nDefine the word cat.<|im_end|>\n<|im_start|>assistant\n");
  const auto ref2 = greedy_generate(
      test::tiny_qwen3_f32(), ids2, 12,
      generation_eos_ids(test::tiny_qwen3_dir(), test::tiny_qwen3_f32().config()), true);
  EXPECT_EQ(g2.out.rfind("[prompt 1]\n" + tok.decode(ref) + "\n\n[prompt 2]\n" + tok.decode(ref2) +
                             "\n\ntokens: " + std::to_string(ref.size() + ref2.size()) + "\n",
                         0),
            0u)
      << g2.out;

  const std::string out = (dir / "report.json").string();
  auto e = test::run_dflash({"eval", "--target", tdir, "--drafter", ddir, "--prompts",
                             (test::assets_dir() / "data" / "eval_prompts.jsonl").string(),
                             "--per-source", "1", "--max-new-tokens", "6", "--output", out,
                             "--batch-size", "3"});
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_NE(e.out.find("batch size: 3\n"), std::string::npos) << e.out;
  EXPECT_NE(e.out.find("lossless: true (4/4 prompts)"), std::string::npos) << e.out;
  EXPECT_NE(e.out.find("tau[math]: "), std::string::npos) << e.out;
  const auto rep = nlohmann::json::parse(test::read_file(out));
  EXPECT_EQ(rep["total"]["prompts"], 4);
  EXPECT_EQ(rep["total"]["batch_size"], 3);
  EXPECT_EQ(rep["settings"]["batch_size"], 3);
  EXPECT_EQ(rep["per_source"].size(), 4u);

  // Any JSONL of conversations: prompt-only records (a trailing user turn), either message form,
  // integer ids, records without `source` (grouped as "(none)").
  const auto bench = dir / "bench.jsonl";
  {
    std::ofstream f(bench);
    f << R"({"id": 1, "source": "gsm8k", "messages": [{"role": "user", "content": "What is 3 + 4?"}]})"
      << "\n"
      << R"({"id": "b", "conversations": [{"from": "human", "value": "Define the word dog."}]})"
      << "\n"
      << R"({"id": 3, "source": "gsm8k", "messages": [{"role": "system", "content": "Be brief."}, )"
      << R"({"role": "user", "content": "What is 9 - 2?"}]})"
      << "\n";
  }
  auto eb = test::run_dflash({"eval", "--target", tdir, "--drafter", ddir, "--prompts",
                              bench.string(), "--max-new-tokens", "4", "--batch-size", "2"});
  ASSERT_EQ(eb.exit_code, 0) << eb.err;
  EXPECT_NE(eb.out.find("tau[gsm8k]: "), std::string::npos) << eb.out;
  EXPECT_NE(eb.out.find("(2 prompts, "), std::string::npos) << eb.out;
  EXPECT_NE(eb.out.find("tau[(none)]: "), std::string::npos) << eb.out;
  EXPECT_NE(eb.out.find("lossless: true (3/3 prompts)"), std::string::npos) << eb.out;

  auto bad = test::run_dflash({"eval", "--target", tdir, "--drafter", ddir, "--prompts",
                               (test::assets_dir() / "data" / "eval_prompts.jsonl").string(),
                               "--limit", "1", "--block-size", "5"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("block size 5"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace dflash
