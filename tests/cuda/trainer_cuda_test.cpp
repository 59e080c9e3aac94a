// `dflash train` on the CUDA backend (runtime.backend: cuda): an interrupted and resumed GPU run
// equals an uninterrupted one bit for bit (the device step is deterministic and the checkpoint
// holds the whole state), replayed CUDA graphs give the same bits as the op-by-op path, and the
// GPU run's loss follows the CPU run's from the same seed (same batches, same anchors) within 2 %
// at every step; for plain DFlash and each objective the CUDA backend trains (one
// expect_resumes_and_follows_cpu call per objective and head variant). Tiny runs: a
// 200-conversation slice of the corpus, two 256-token rows per step, 2 anchors per document.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

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

// A metrics.jsonl value of the GPU run that follows the CPU run's at every step: |gpu − cpu| <
// tol·cpu when `relative`, else < tol.
struct CpuBound {
  std::string key{};
  double tol = 0.02;
  bool relative = true;
};

// One objective's resume test (expect_resumes_and_follows_cpu). A new objective's test names its
// overrides, its metrics.jsonl terms and their bounds against the CPU run.
struct ObjectiveRun {
  std::string name{};                    // printed with each step's figures
  std::vector<std::string> overrides{};  // the objective and its keys (none: plain DFlash)
  // metrics.jsonl keys beside `loss` that the resumed run must give bit for bit (each present)
  std::vector<std::string> terms{};
  // values checked against the CPU run at every step beside `loss` (always within 2 %)
  std::vector<CpuBound> follow_cpu{};
  std::vector<std::string> unit_interval{};  // values that must lie in [0, 1] at every step
  // also a run enqueued op by op (cuda_graphs false): the same checkpoint bits, and log.txt says
  // graphs were on in the first run and off in this one
  bool graphs_off_run = true;
};

// Six steps of `run` on the CUDA backend: an uninterrupted run (a) equals one halted after step 3
// and resumed (b) bit for bit (the checkpoint's master weights, `loss` and every term of
// metrics.jsonl), optionally equals a run without CUDA graphs (d), and its loss and the bounded
// terms follow the CPU run's from the same seed (same batches and anchors) at every step.
void expect_resumes_and_follows_cpu(const ObjectiveRun& run) {
  const std::vector<std::string>& o = run.overrides;
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "a", 6, "cuda", true, o);
  EXPECT_EQ(train(a).steps_done, 6);

  TrainOptions b;
  b.config = config_for(tmp / "b", 6, "cuda", true, o);
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
  std::vector<std::string> exact = {"loss"};
  exact.insert(exact.end(), run.terms.begin(), run.terms.end());
  for (size_t i = 0; i < ma.size(); ++i) {
    for (const std::string& k : exact) {
      ASSERT_TRUE(ma[i].contains(k)) << k;
      EXPECT_EQ(ma[i][k].get<double>(), mb[i][k].get<double>()) << k << " step " << i + 1;
    }
    for (const std::string& k : run.unit_interval) {
      const double v = ma[i][k].get<double>();
      EXPECT_TRUE(v >= 0.0 && v <= 1.0) << k << " " << v;
    }
  }

  if (run.graphs_off_run) {  // enqueued op by op instead of replayed graphs: the same bits
    TrainOptions d;
    d.config = config_for(tmp / "d", 6, "cuda", false, o);
    EXPECT_EQ(train(d).steps_done, 6);
    EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "d" / "checkpoint-6"));
    EXPECT_NE(test::read_file(tmp / "a" / "log.txt").find("CUDA graphs on"), std::string::npos);
    EXPECT_NE(test::read_file(tmp / "d" / "log.txt").find("CUDA graphs off"), std::string::npos);
  }

  TrainOptions cpu;
  cpu.config = config_for(tmp / "cpu", 6, "cpu", true, o);
  EXPECT_EQ(train(cpu).steps_done, 6);
  const auto mc = metrics(tmp / "cpu");
  ASSERT_EQ(mc.size(), 6u);
  std::vector<CpuBound> bounds = {{"loss", 0.02, true}};
  bounds.insert(bounds.end(), run.follow_cpu.begin(), run.follow_cpu.end());
  for (size_t i = 0; i < mc.size(); ++i) {
    std::string line = fmt::format("step {}: {}", i + 1, run.name);
    for (const CpuBound& bound : bounds) {
      const double vc = mc[i][bound.key].get<double>(), vg = ma[i][bound.key].get<double>();
      EXPECT_NEAR(vg, vc, bound.relative ? bound.tol * vc : bound.tol)
          << bound.key << " step " << i + 1;
      line += fmt::format(", {} cpu {:.5f} gpu {:.5f}", bound.key, vc, vg);
    }
    std::printf("%s\n", line.c_str());
  }
}

// training.objective dspark: the heads' parameters and moments are in the checkpoint with the
// rest, metrics.jsonl carries the DSpark terms and the accuracy follows the CPU run's within 0.02.
ObjectiveRun dspark_run(std::vector<std::string> heads) {
  std::vector<std::string> o = {"training.objective=dspark", "training.gamma=4"};
  o.insert(o.end(), heads.begin(), heads.end());
  return {.name = "dspark",
          .overrides = o,
          .terms = {"dspark_ce", "dspark_l1", "dspark_bce", "dspark_acc"},
          .follow_cpu = {{"dspark_acc", 0.02, false}},
          .unit_interval = {"dspark_acc"},
          .graphs_off_run = false};
}

}  // namespace

TEST(TrainerCuda, ResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  expect_resumes_and_follows_cpu({.name = "dflash", .terms = {"accuracy"}});
}

// The vanilla Markov head of rank 3 with the confidence head on the Markov input.
TEST(TrainerCuda, DsparkResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  expect_resumes_and_follows_cpu(
      dspark_run({"training.markov_rank=3", "training.confidence_head_with_markov=true"}));
}

// The rnn Markov head (its state through each block's slots) of rank 3, the same way.
TEST(TrainerCuda, DsparkRnnHeadResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  expect_resumes_and_follows_cpu(
      dspark_run({"training.markov_rank=3", "training.markov_head_type=rnn",
                  "training.confidence_head_with_markov=true"}));
}

// training.objective domino (shift_label true, P 1): λ decays from 1 to 0 within the run (read on
// the device, so a replayed graph sees each step's), the head's parameters and moments are in the
// checkpoint with the rest, the run without graphs gives the same bits, and the final CE follows
// the CPU run's within 2 %.
TEST(TrainerCuda, DominoResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  expect_resumes_and_follows_cpu(
      {.name = "domino",
       .overrides = {"training.objective=domino", "training.emb_dim=16",
                     "training.gru_hidden_dim=24", "training.pure_draft_prefix_len=1",
                     "training.shift_label=true"},
       .terms = {"domino_ce_final", "domino_ce_base"},
       .follow_cpu = {{"domino_ce_final", 0.02, true}}});
}
