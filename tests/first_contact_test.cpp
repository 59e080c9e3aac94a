// First contact: what a new user who gets something wrong sees (issue 18, defects 3, 4, 8, 9,
// 10). Each test runs the `dflash` binary as a user would and checks that the answer names the
// cause: a misspelled command, a flag out of range, a folder that is no run directory, a resume
// that changes the drafter's size, a template whose special tokens the tokenizer lacks, a drafter
// whose mask id is a real token, eval flags that would fail only after the whole eval, a drafter
// folder given to `inspect`; and that `data prepare --config` builds the cache `train` reuses.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/drafter.hpp"
#include "model/drafter_io.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using test::run_dflash;
using test::TempDir;

std::string tiny() {
  return (test::assets_dir() / "tiny-qwen3").string();
}
std::string eval_prompts() {
  return (test::assets_dir() / "data" / "eval_prompts.jsonl").string();
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// The value `inspect` prints for `key` ("key:   value" line), or "" when absent.
std::string field(const std::string& out, const std::string& key) {
  std::smatch m;
  const std::regex re("(^|\n)" + key + ": *([^\n]*)");
  return std::regex_search(out, m, re) ? m[2].str() : std::string();
}

// A small training run: 1-layer drafter, 64-token rows, the 200-conversation corpus slice.
std::string run_yaml(const fs::path& out, const fs::path& cache_dir, int max_length = 64) {
  return fmt::format(R"(model:
  target: {}
  drafter_layers: 1
  intermediate_size: 64
  mask_token_id: 8000
data:
  train_file: {}
  template: chatml
  max_length: {}
  token_budget: 128
  cache_dir: {}
training:
  max_steps: 4
  num_anchors: 2
  block_size: 8
  log_interval: 1
runtime:
  threads: 2
output_dir: {}
)",
                     tiny(), test::small_corpus().string(), max_length, cache_dir.string(),
                     out.string());
}

std::vector<fs::path> files_in(const fs::path& dir, const std::string& ext) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ext) out.push_back(e.path());
  }
  return out;
}

// An untrained drafter for tiny-qwen3 saved as an export folder, with `mask` as its mask id
// (written into config.json after saving, as an edited or foreign config would hold it).
fs::path save_drafter(const fs::path& dir, int mask) {
  const ModelConfig tc = model_config_load(tiny());
  DrafterSizes sizes;
  sizes.block_size = 4;
  sizes.intermediate_size = 64;
  const DrafterConfig c = drafter_config_for_target(tc, 1, sizes, 8000, std::nullopt);
  const DrafterLayout layout(c);
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, 5);
  drafter_save(dir, c, layout, params, DType::f32);
  nlohmann::json j = nlohmann::json::parse(test::read_file(dir / "config.json"));
  j["dflash_config"]["mask_token_id"] = mask;
  test::write_file(dir / "config.json", j.dump(2));
  return dir;
}

// ---------------------------------------------------------------- defect 10: messages

TEST(FirstContact, MisspelledCommandIsNamedWithTheNearestOne) {
  auto r = run_dflash({"trian"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, "unknown command 'trian' (did you mean 'train'?)")) << r.err;
  EXPECT_TRUE(has(r.err, "generate, eval")) << r.err;  // the list of commands
  r = run_dflash({"data", "prepar", "--model", tiny()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, "unknown command 'prepar' (did you mean 'prepare'?)")) << r.err;
  r = run_dflash({"xyzzy"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, "unknown command 'xyzzy'; the commands of dflash are: ")) << r.err;
  EXPECT_FALSE(has(r.err, "did you mean")) << r.err;
}

TEST(FirstContact, IntegerFlagsOutOfRangeGiveTheBoundNotADoubleRange) {
  auto r = run_dflash({"generate", "--target", tiny(), "--drafter", "x", "--prompt", "hi",
                       "--max-new-tokens", "0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, "--max-new-tokens: must be an integer >= 1, got '0'")) << r.err;
  EXPECT_LT(r.err.size(), 200u) << r.err;
  r = run_dflash({"inspect", tiny(), "--max-new-tokens", "-3"});
  EXPECT_TRUE(has(r.err, "--max-new-tokens: must be an integer >= 1, got '-3'")) << r.err;
}

TEST(FirstContact, ResumeOfAFolderThatIsNoRunSaysSo) {
  TempDir tmp;
  fs::create_directories(tmp / "empty");
  auto r = run_dflash({"train", "--resume", (tmp / "empty").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "not a dflash run directory")) << r.err;
  EXPECT_FALSE(has(r.err, "config.resolved.yaml'")) << r.err;  // not "cannot read config file"
  r = run_dflash({"train", "--resume", (tmp / "missing").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "missing: no such directory")) << r.err;
  EXPECT_FALSE(fs::exists(tmp / "missing"));  // nothing was created
}

TEST(FirstContact, ResumeWithAnotherDrafterSizeNamesTheKeysEvenWithForce) {
  TempDir tmp;
  test::write_file(tmp / "run.yaml", run_yaml(tmp / "run", tmp / "cache"));
  auto r = run_dflash({"train", "--config", (tmp / "run.yaml").string(), "--halt-at-step", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (bool force : {false, true}) {
    std::vector<std::string> args = {"train", "--resume", (tmp / "run").string(),
                                     "model.drafter_layers=2"};
    if (force) args.push_back("--force");
    r = run_dflash(args);
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_TRUE(has(r.err, "model.drafter_layers: 1 -> 2")) << r.err;
    EXPECT_TRUE(has(r.err, "parameter shapes")) << r.err;
    EXPECT_FALSE(has(r.err, "values, the drafter")) << r.err;  // the old tensor-size message
  }
}

TEST(FirstContact, ForcedResumeWithAnotherBlockSizeRuns) {
  // Block size changes no parameter shape, so --force may continue with another one; the open
  // log interval's per-slot counts of the old block size are dropped, not merged.
  TempDir tmp;
  test::write_file(tmp / "run.yaml", run_yaml(tmp / "run", tmp / "cache"));
  auto r = run_dflash({"train", "--config", (tmp / "run.yaml").string(), "--halt-at-step", "2",
                       "training.log_interval=3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_dflash({"train", "--resume", (tmp / "run").string(), "training.block_size=4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "training.block_size: 8 -> 4")) << r.err;
  r = run_dflash({"train", "--resume", (tmp / "run").string(), "training.block_size=4", "--force"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "finished after 4 steps")) << r.out;
}

TEST(FirstContact, InspectDescribesADrafterFolder) {
  TempDir tmp;
  const fs::path d = save_drafter(tmp / "drafter", 8000);
  auto r = run_dflash({"inspect", d.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "DFlash drafter [DFlashDraftModel]")) << r.out;
  EXPECT_EQ(field(r.out, "drafter layers"), "1") << r.out;
  EXPECT_EQ(field(r.out, "block size"), "4") << r.out;
  EXPECT_EQ(field(r.out, "mask token id"), "8000") << r.out;
  EXPECT_EQ(field(r.out, "target layer ids"), "[3]") << r.out;
  EXPECT_FALSE(has(r.err + r.out, "missing")) << r.err;
  r = run_dflash({"inspect", d.string(), "--prompt", "hi"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "is a DFlash drafter")) << r.err;
}

// ---------------------------------------------------------------- defect 3: one cache key

TEST(FirstContact, DataPrepareWithAConfigBuildsTheCacheTrainReuses) {
  TempDir tmp;
  const fs::path cache = tmp / "shared-cache";
  test::write_file(tmp / "a.yaml", run_yaml(tmp / "a", cache));
  auto r = run_dflash({"data", "prepare", "--config", (tmp / "a.yaml").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto prepared = files_in(cache, ".dftok");
  ASSERT_EQ(prepared.size(), 1u);
  EXPECT_TRUE(has(r.out, prepared[0].string())) << r.out;
  r = run_dflash({"train", "--config", (tmp / "a.yaml").string(), "--halt-at-step", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(
      has(test::read_file(tmp / "a" / "log.txt"), "data: reusing cache " + prepared[0].string()))
      << test::read_file(tmp / "a" / "log.txt");
  // Another max length in the same cache folder gets its own file; the first stays as it was.
  const std::string before = test::read_file(prepared[0]);
  test::write_file(tmp / "b.yaml", run_yaml(tmp / "b", cache, 32));
  r = run_dflash({"train", "--config", (tmp / "b.yaml").string(), "--halt-at-step", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(files_in(cache, ".dftok").size(), 2u);
  EXPECT_EQ(test::read_file(prepared[0]), before);
}

// ---------------------------------------------------------------- defect 4: template tokens

TEST(FirstContact, TemplateWhoseSpecialTokensTheTokenizerLacksIsRefused) {
  TempDir tmp;
  auto r =
      run_dflash({"data", "prepare", "--model", tiny(), "--data", test::small_corpus().string(),
                  "--template", "llama3", "--cache", (tmp / "c.dftok").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "chat template 'llama3'")) << r.err;
  for (const char* tok :
       {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}) {
    EXPECT_TRUE(has(r.err, tok)) << r.err;
  }
  EXPECT_FALSE(fs::exists(tmp / "c.dftok"));
  // The same refusal for generation with --chat.
  const fs::path d = save_drafter(tmp / "drafter", 8000);
  r = run_dflash({"generate", "--target", tiny(), "--drafter", d.string(), "--prompt", "hi",
                  "--chat", "--template", "qwen3"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "<think> (")) << r.err;
}

// ---------------------------------------------------------------- defect 8: mask id

TEST(FirstContact, InferenceRefusesADrafterWhoseMaskIdIsARealToken) {
  TempDir tmp;
  const fs::path d = save_drafter(tmp / "drafter", 2);  // tiny-qwen3's <|im_end|> (eos)
  auto r = run_dflash({"generate", "--target", tiny(), "--drafter", d.string(), "--prompt",
                       "What is 2+2?", "--chat", "--max-new-tokens", "4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "mask_token_id 2 (token '<|im_end|>')")) << r.err;
  EXPECT_TRUE(has(r.err, "[8000, 8192)")) << r.err;
  r = run_dflash({"eval", "--target", tiny(), "--drafter", d.string(), "--prompts", eval_prompts(),
                  "--limit", "1", "--max-new-tokens", "4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "mask_token_id 2")) << r.err;
}

// ---------------------------------------------------------------- defect 9: eval arguments

TEST(FirstContact, EvalChecksEveryArgumentBeforeDecoding) {
  TempDir tmp;
  const fs::path d = save_drafter(tmp / "drafter", 8000);
  const std::vector<std::string> base = {
      "--log-level", "info",      "eval",         "--target",         tiny(), "--drafter",
      d.string(),    "--prompts", eval_prompts(), "--max-new-tokens", "4"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return run_dflash(args);
  };
  auto r = with({"--limit", "-1"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, "--limit: must be an integer >= 0, got '-1'")) << r.err;
  r = with({"--per-source", "-5"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, "--per-source: must be an integer >= 0, got '-5'")) << r.err;
  r = with({"--limit", "1", "--stop-id", "99999"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "--stop-id 99999 is not a token of the target's vocabulary [0, 8192)"))
      << r.err;
  r = with({"--limit", "1", "--output", (tmp / "no-such-folder" / "report.json").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(has(r.err, "--output '" + (tmp / "no-such-folder" / "report.json").string() +
                             "' cannot be written"))
      << r.err;
  // Refused before any prompt was decoded: the eval's start line never appears.
  EXPECT_FALSE(has(r.err, "eval: 1 prompts")) << r.err;
}

}  // namespace
}  // namespace dflash
