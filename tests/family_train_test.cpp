// A DFlash drafter trains against every target family the CPU backend supports: `dflash train`
// (in process) runs a few steps on each random golden checkpoint of tests/fixtures/models (Qwen2
// with biases, Llama 3 and yarn RoPE, Qwen3-MoE dense+sparse and windowed, gpt-oss with bf16 and
// MXFP4 experts), with the byte-level tokenizer of tests/fixtures/byte-tokenizer and the first 200
// conversations of the bundled corpus. Each run must finish its steps with a finite loss that
// falls from the first logged step to the last, and export a drafter that names the target's
// layer count and taps.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "train/run_config.hpp"
#include "train/trainer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

fs::path fixtures() { return test::source_dir() / "tests" / "fixtures"; }

// A model folder: the golden checkpoint's files (linked) plus the byte-level tokenizer.
void make_target(const fs::path& dir, const std::string& family) {
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(fixtures() / "models" / family)) {
    if (e.path().filename() == "golden.safetensors") continue;
    fs::create_symlink(e.path(), dir / e.path().filename());
  }
  fs::copy_file(fixtures() / "byte-tokenizer" / "tokenizer.json", dir / "tokenizer.json");
}

std::string yaml_for(const fs::path& target, const fs::path& out) {
  return fmt::format(R"(model:
  target: {}
  drafter_layers: 1
  intermediate_size: 64
  mask_token_id: 300
data:
  train_file: {}
  template: chatml
  max_length: 256
  token_budget: 256
  rows_per_step: 2
training:
  max_steps: 6
  lr: 3.0e-3
  warmup_ratio: 0.0
  num_anchors: 4
  block_size: 4
  seed: 5
  log_interval: 1
  save_interval: 6
runtime:
  threads: 2
output_dir: {}
)",
                     target.string(), test::small_corpus().string(), out.string());
}

std::vector<double> logged_losses(const fs::path& run) {
  std::vector<double> out;
  std::istringstream in(test::read_file(run / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line).at("loss"));
  return out;
}

class FamilyTrain : public ::testing::TestWithParam<const char*> {};

}  // namespace

TEST_P(FamilyTrain, DrafterTrainsAFewStepsOnTheCpu) {
  const std::string family = GetParam();
  test::TempDir tmp;
  make_target(tmp / "target", family);
  TrainOptions o;
  o.config = RunConfig::from_yaml(yaml_for(tmp / "target", tmp / "run"), "family.yaml", {});
  const TrainResult r = train(o);
  EXPECT_EQ(r.steps_done, 6);
  EXPECT_EQ(r.skipped_steps, 0);
  const std::vector<double> loss = logged_losses(tmp / "run");
  ASSERT_EQ(loss.size(), 6u);
  for (double l : loss) EXPECT_TRUE(std::isfinite(l) && l > 0) << l;
  EXPECT_LT(loss.back(), loss.front()) << family << ": the drafter did not learn";
  const json cfg = json::parse(test::read_file(tmp / "run" / "checkpoint-6" / "config.json"));
  const json target = json::parse(test::read_file(tmp / "target" / "config.json"));
  EXPECT_EQ(cfg.at("num_target_layers"), target.at("num_hidden_layers"));
  EXPECT_EQ(cfg.at("dflash_config").at("target_layer_ids").size(), 1u);
  std::printf("%s: loss %.4f -> %.4f over 6 steps\n", family.c_str(), loss.front(), loss.back());
}

INSTANTIATE_TEST_SUITE_P(GoldenCheckpoints, FamilyTrain,
                         ::testing::Values("qwen2-bias", "llama3-rope", "llama-yarn", "qwen3-moe",
                                           "qwen3-moe-window", "gpt-oss", "gpt-oss-mxfp4"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });
