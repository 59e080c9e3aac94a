// `dflash train` on the CUDA backend (runtime.backend: cuda): an interrupted and resumed GPU run
// equals an uninterrupted one bit for bit (the device step is deterministic and the checkpoint
// holds the whole state), replayed CUDA graphs give the same bits as the op-by-op path, and the GPU run's loss follows the CPU run's from the same seed (same
// batches, same anchors) within 2 % at every step. Tiny runs: a 200-conversation slice of the
// corpus, two 256-token rows per step, 2 anchors per document.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cuda/cuda_test_util.hpp"
#include "model/safetensors.hpp"
#include "train/trainer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {


RunConfig config_for(const fs::path& out, int64_t steps, const std::string& backend,
                     bool graphs = true, const std::vector<std::string>& overrides = {}) {
  const std::string yaml =
      fmt::format(R"(model:
  target: {}
  drafter_layers: 2
  intermediate_size: 64
  mask_token_id: 8000
data:
  train_file: {}
  template: chatml
  max_length: 256
  token_budget: 256
  rows_per_step: 2
  block_budget: 256  # = token_budget: never binds, rows keep several conversations
training:
  max_steps: {}
  lr: 1.0e-3
  num_anchors: 2
  block_size: 8
  seed: 3
  log_interval: 1
  save_interval: 0
runtime:
  backend: {}
  cuda_graphs: {}
  threads: 2
output_dir: {}
)",
                  (test::assets_dir() / "tiny-qwen3").string(), test::small_corpus().string(),
                  steps, backend, graphs, out.string());
  return RunConfig::from_yaml(yaml, "test.yaml", overrides);
}

std::vector<json> metrics(const fs::path& dir) {
  std::vector<json> out;
  std::istringstream in(test::read_file(dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

std::string master_bytes(const fs::path& ckpt) {
  SafetensorsFile f(ckpt / "trainer_state" / "optimizer.safetensors");
  Tensor t = f.get("master");
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}

}  // namespace

TEST(TrainerCuda, ResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "a", 6, "cuda");
  EXPECT_EQ(train(a).steps_done, 6);

  TrainOptions b;
  b.config = config_for(tmp / "b", 6, "cuda");
  b.halt_at_step = 3;
  EXPECT_TRUE(train(b).interrupted);
  TrainOptions c;
  c.config = RunConfig::load((tmp / "b" / "config.resolved.yaml").string());
  c.resume_dir = (tmp / "b").string();
  EXPECT_EQ(train(c).steps_done, 6);
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "b" / "checkpoint-6"));
  const auto ma = metrics(tmp / "a"), mb = metrics(tmp / "b");
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(ma[i]["accuracy"].get<double>(), mb[i]["accuracy"].get<double>());
  }

  // Enqueued op by op instead of replayed graphs: the same bits.
  TrainOptions d;
  d.config = config_for(tmp / "d", 6, "cuda", false);
  EXPECT_EQ(train(d).steps_done, 6);
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "d" / "checkpoint-6"));
  EXPECT_NE(test::read_file(tmp / "a" / "log.txt").find("CUDA graphs on"), std::string::npos);
  EXPECT_NE(test::read_file(tmp / "d" / "log.txt").find("CUDA graphs off"), std::string::npos);

  TrainOptions cpu;
  cpu.config = config_for(tmp / "cpu", 6, "cpu");
  EXPECT_EQ(train(cpu).steps_done, 6);
  const auto mc = metrics(tmp / "cpu");
  ASSERT_EQ(mc.size(), 6u);
  for (size_t i = 0; i < mc.size(); ++i) {
    const double lc = mc[i]["loss"].get<double>(), lg = ma[i]["loss"].get<double>();
    EXPECT_NEAR(lg, lc, 0.02 * lc) << "step " << i + 1;
    std::printf("step %zu: loss cpu %.5f gpu %.5f\n", i + 1, lc, lg);
  }
}

namespace {

// training.objective dspark on the CUDA backend with the DSpark options `dspark`: an interrupted
// and resumed run equals an uninterrupted one bit for bit (the heads' parameters and moments are
// in the checkpoint with the rest), metrics.jsonl carries the DSpark terms, and the loss follows
// the CPU run's within 2 % at every step.
void expect_dspark_resumes_and_follows_cpu(const std::vector<std::string>& dspark) {
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "a", 6, "cuda", true, dspark);
  EXPECT_EQ(train(a).steps_done, 6);
  TrainOptions b;
  b.config = config_for(tmp / "b", 6, "cuda", true, dspark);
  b.halt_at_step = 3;
  EXPECT_TRUE(train(b).interrupted);
  TrainOptions c;
  c.config = RunConfig::load((tmp / "b" / "config.resolved.yaml").string());
  c.resume_dir = (tmp / "b").string();
  EXPECT_EQ(train(c).steps_done, 6);
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "b" / "checkpoint-6"));
  const auto ma = metrics(tmp / "a"), mb = metrics(tmp / "b");
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < ma.size(); ++i) {
    for (const char* k : {"loss", "dspark_ce", "dspark_l1", "dspark_bce", "dspark_acc"}) {
      ASSERT_TRUE(ma[i].contains(k)) << k;
      EXPECT_EQ(ma[i][k].get<double>(), mb[i][k].get<double>()) << k << " step " << i + 1;
    }
    const double acc = ma[i]["dspark_acc"].get<double>();
    EXPECT_TRUE(acc >= 0.0 && acc <= 1.0) << acc;
  }
  TrainOptions cpu;
  cpu.config = config_for(tmp / "cpu", 6, "cpu", true, dspark);
  EXPECT_EQ(train(cpu).steps_done, 6);
  const auto mc = metrics(tmp / "cpu");
  ASSERT_EQ(mc.size(), 6u);
  for (size_t i = 0; i < mc.size(); ++i) {
    const double lc = mc[i]["loss"].get<double>(), lg = ma[i]["loss"].get<double>();
    EXPECT_NEAR(lg, lc, 0.02 * lc) << "step " << i + 1;
    const double ac = mc[i]["dspark_acc"].get<double>(), ag = ma[i]["dspark_acc"].get<double>();
    EXPECT_NEAR(ag, ac, 0.02) << "step " << i + 1;
    std::printf("step %zu: dspark loss cpu %.5f gpu %.5f, acc cpu %.4f gpu %.4f\n", i + 1, lc, lg,
                ac, ag);
  }
}

}  // namespace

// The vanilla Markov head of rank 3 with the confidence head on the Markov input.
TEST(TrainerCuda, DsparkResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  expect_dspark_resumes_and_follows_cpu({"training.objective=dspark", "training.gamma=4",
                                         "training.markov_rank=3",
                                         "training.confidence_head_with_markov=true"});
}

// The rnn Markov head (its state through each block's slots) of rank 3, the same way.
TEST(TrainerCuda, DsparkRnnHeadResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  expect_dspark_resumes_and_follows_cpu({"training.objective=dspark", "training.gamma=4",
                                         "training.markov_rank=3", "training.markov_head_type=rnn",
                                         "training.confidence_head_with_markov=true"});
}

// training.objective domino on the CUDA backend (shift_label true, P 1): λ decays from 1 to 0
// within the run (read on the device, so a replayed graph sees each step's), an interrupted and
// resumed run equals an uninterrupted one bit for bit (the head's parameters and moments are in
// the checkpoint with the rest), the run without graphs gives the same bits, and the loss follows
// the CPU run's within 2 % at every step.
TEST(TrainerCuda, DominoResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  const std::vector<std::string> domino = {
      "training.objective=domino", "training.emb_dim=16", "training.gru_hidden_dim=24",
      "training.pure_draft_prefix_len=1", "training.shift_label=true"};
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "a", 6, "cuda", true, domino);
  EXPECT_EQ(train(a).steps_done, 6);
  TrainOptions b;
  b.config = config_for(tmp / "b", 6, "cuda", true, domino);
  b.halt_at_step = 3;
  EXPECT_TRUE(train(b).interrupted);
  TrainOptions c;
  c.config = RunConfig::load((tmp / "b" / "config.resolved.yaml").string());
  c.resume_dir = (tmp / "b").string();
  EXPECT_EQ(train(c).steps_done, 6);
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "b" / "checkpoint-6"));
  const auto ma = metrics(tmp / "a"), mb = metrics(tmp / "b");
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < ma.size(); ++i) {
    for (const char* k : {"loss", "domino_ce_final", "domino_ce_base"}) {
      ASSERT_TRUE(ma[i].contains(k)) << k;
      EXPECT_EQ(ma[i][k].get<double>(), mb[i][k].get<double>()) << k << " step " << i + 1;
    }
  }
  TrainOptions d;  // enqueued op by op: the same bits as the replayed graphs
  d.config = config_for(tmp / "d", 6, "cuda", false, domino);
  EXPECT_EQ(train(d).steps_done, 6);
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "d" / "checkpoint-6"));
  TrainOptions cpu;
  cpu.config = config_for(tmp / "cpu", 6, "cpu", true, domino);
  EXPECT_EQ(train(cpu).steps_done, 6);
  const auto mc = metrics(tmp / "cpu");
  ASSERT_EQ(mc.size(), 6u);
  for (size_t i = 0; i < mc.size(); ++i) {
    const double lc = mc[i]["loss"].get<double>(), lg = ma[i]["loss"].get<double>();
    EXPECT_NEAR(lg, lc, 0.02 * lc) << "step " << i + 1;
    const double fc = mc[i]["domino_ce_final"].get<double>();
    EXPECT_NEAR(ma[i]["domino_ce_final"].get<double>(), fc, 0.02 * fc) << "step " << i + 1;
    std::printf("step %zu: domino loss cpu %.5f gpu %.5f\n", i + 1, lc, lg);
  }
}
