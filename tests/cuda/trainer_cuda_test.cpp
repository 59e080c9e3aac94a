// `dflash train` on the CUDA backend (runtime.backend: cuda): an interrupted and resumed GPU run
// equals an uninterrupted one bit for bit (the device step is deterministic and the checkpoint
// holds the whole state), replayed CUDA graphs give the same bits as the op-by-op path, and the GPU
// run's loss follows the CPU run's from the same seed (same batches, same anchors) within 2 % at
// every step; the same for each objective (dspark, domino, dflash2, and dflash2 with D-PACE as its
// base) with its own terms. Tiny runs:
// a 200-conversation slice of the corpus, two 256-token rows per step, 2 anchors per document.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
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

// The metrics of the runs of expect_resumes_and_follows_cpu, for an objective's own checks.
struct RunMetrics {
  std::vector<json> gpu, cpu;  // the uninterrupted CUDA run's (graphs on) and the CPU run's
};

// 6-step runs of training with `overrides` (an objective and its keys) in `dir`: on the CUDA
// backend an interrupted (at step 3) and resumed run equals an uninterrupted one bit for bit (the
// master weights of checkpoint-6, and the metrics `keys` at every step: every parameter of the
// objective and its moments are in the checkpoint), the run enqueued op by op without graphs gives
// the same master bits, and the loss follows the CPU run's (same seed, batches and anchors) within
// 2 % at every step. Returns the CUDA run's and the CPU run's metrics.
RunMetrics expect_resumes_and_follows_cpu(const fs::path& dir,
                                          const std::vector<std::string>& overrides,
                                          const std::vector<std::string>& keys) {
  TrainOptions a;
  a.config = config_for(dir / "a", 6, "cuda", true, overrides);
  EXPECT_EQ(train(a).steps_done, 6);
  TrainOptions b;
  b.config = config_for(dir / "b", 6, "cuda", true, overrides);
  b.halt_at_step = 3;
  EXPECT_TRUE(train(b).interrupted);
  TrainOptions c;
  c.config = RunConfig::load((dir / "b" / "config.resolved.yaml").string());
  c.resume_dir = (dir / "b").string();
  EXPECT_EQ(train(c).steps_done, 6);
  EXPECT_EQ(master_bytes(dir / "a" / "checkpoint-6"), master_bytes(dir / "b" / "checkpoint-6"));
  RunMetrics m;
  m.gpu = metrics(dir / "a");
  const auto mb = metrics(dir / "b");
  EXPECT_EQ(m.gpu.size(), 6u);
  EXPECT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < std::min(m.gpu.size(), mb.size()); ++i) {
    for (const std::string& k : keys) {
      EXPECT_TRUE(m.gpu[i].contains(k) && mb[i].contains(k)) << k;
      if (!m.gpu[i].contains(k) || !mb[i].contains(k)) continue;
      EXPECT_EQ(m.gpu[i][k].get<double>(), mb[i][k].get<double>()) << k << " step " << i + 1;
    }
  }
  TrainOptions d;  // enqueued op by op: the same bits as the replayed graphs
  d.config = config_for(dir / "d", 6, "cuda", false, overrides);
  EXPECT_EQ(train(d).steps_done, 6);
  EXPECT_EQ(master_bytes(dir / "a" / "checkpoint-6"), master_bytes(dir / "d" / "checkpoint-6"));
  TrainOptions cpu;
  cpu.config = config_for(dir / "cpu", 6, "cpu", true, overrides);
  EXPECT_EQ(train(cpu).steps_done, 6);
  m.cpu = metrics(dir / "cpu");
  EXPECT_EQ(m.cpu.size(), 6u);
  for (size_t i = 0; i < std::min(m.cpu.size(), m.gpu.size()); ++i) {
    const double lc = m.cpu[i]["loss"].get<double>(), lg = m.gpu[i]["loss"].get<double>();
    EXPECT_NEAR(lg, lc, 0.02 * lc) << "step " << i + 1;
    std::printf("step %zu: loss cpu %.5f gpu %.5f\n", i + 1, lc, lg);
  }
  return m;
}

// training.objective dspark on the CUDA backend with the DSpark options `dspark`: resumed, without
// graphs and against the CPU run as expect_resumes_and_follows_cpu, metrics.jsonl carrying the
// DSpark terms, the draft accuracy in [0, 1] and within 0.02 of the CPU run's.
void expect_dspark_resumes_and_follows_cpu(const std::vector<std::string>& dspark) {
  test::TempDir tmp;
  const RunMetrics m = expect_resumes_and_follows_cpu(
      tmp.path(), dspark, {"loss", "dspark_ce", "dspark_l1", "dspark_bce", "dspark_acc"});
  for (size_t i = 0; i < std::min(m.cpu.size(), m.gpu.size()); ++i) {
    const double ac = m.cpu[i]["dspark_acc"].get<double>();
    const double ag = m.gpu[i]["dspark_acc"].get<double>();
    EXPECT_TRUE(ag >= 0.0 && ag <= 1.0) << ag;
    EXPECT_NEAR(ag, ac, 0.02) << "step " << i + 1;
    std::printf("step %zu: dspark acc cpu %.4f gpu %.4f\n", i + 1, ac, ag);
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
// within the run (read on the device, so a replayed graph sees each step's); resumed, without
// graphs and against the CPU run as expect_resumes_and_follows_cpu, with Domino's two CE terms,
// CE(F) within 2 % of the CPU run's.
TEST(TrainerCuda, DominoResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  test::TempDir tmp;
  const RunMetrics m = expect_resumes_and_follows_cpu(
      tmp.path(),
      {"training.objective=domino", "training.emb_dim=16", "training.gru_hidden_dim=24",
       "training.pure_draft_prefix_len=1", "training.shift_label=true"},
      {"loss", "domino_ce_final", "domino_ce_base"});
  for (size_t i = 0; i < std::min(m.cpu.size(), m.gpu.size()); ++i) {
    const double fc = m.cpu[i]["domino_ce_final"].get<double>();
    EXPECT_NEAR(m.gpu[i]["domino_ce_final"].get<double>(), fc, 0.02 * fc) << "step " << i + 1;
  }
}

namespace {

// DFlash2 in the tiny runs: conv of 2 taps over groups of 16 channels (H 384), a selector of rank
// 8 over the top-512 of 8192 (wide enough that golds land among the candidates from the first
// steps), α_sel `alpha` after a warmup of 0.34 · 6 steps (steps 1 and 2 at α 0, 3 to 6 at α: no
// ramp).
std::vector<std::string> dflash2_overrides(double alpha) {
  return {"training.objective=dflash2",
          "training.conv_kernel_size=2",
          "training.conv_group_size=16",
          "training.selector_rank=8",
          "training.selector_top_k=512",
          fmt::format("training.dflash2_selector_loss_alpha={}", alpha),
          "training.dflash2_selector_warmup_ratio=0.34",
          "training.dflash2_selector_ramp_ratio=0"};
}

// A run with `overrides` halted after step 3 on `first` backend, resumed on `second`; returns its
// metrics.
std::vector<json> halted_and_resumed(const fs::path& dir, const std::vector<std::string>& overrides,
                                     const std::string& first, const std::string& second) {
  TrainOptions b;
  b.config = config_for(dir, 6, first, true, overrides);
  b.halt_at_step = 3;
  EXPECT_TRUE(train(b).interrupted);
  TrainOptions c;
  c.config = RunConfig::load((dir / "config.resolved.yaml").string());
  c.config.runtime.backend = second;
  c.resume_dir = dir.string();
  EXPECT_EQ(train(c).steps_done, 6);
  return metrics(dir);
}

}  // namespace

// training.objective dflash2 on the CUDA backend: resumed, without graphs and against the CPU run
// as expect_resumes_and_follows_cpu (the conv's β and W_kp per sublayer and the selector's A, Bs
// and P_h are in the checkpoint with their moments). α_sel's schedule reaches the device: the
// warmup's steps have no selector term (the same loss bits as a run at α 0), and at step 3, the
// first after the warmup (the same weights in both runs), the loss rises over the α-0 run's by
// α·CE_sel, as much as on the CPU (a graph that kept the warmup's α would add nothing). A CUDA
// checkpoint resumes on the CPU backend and a CPU one on the CUDA backend, the steps after
// following the CPU run.
TEST(TrainerCuda, Dflash2ResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  test::TempDir tmp;
  const RunMetrics m =
      expect_resumes_and_follows_cpu(tmp.path(), dflash2_overrides(1.0), {"loss", "accuracy"});
  ASSERT_EQ(m.gpu.size(), 6u);
  ASSERT_EQ(m.cpu.size(), 6u);
  TrainOptions g0, c0;  // α 0 throughout
  g0.config = config_for(tmp / "gpu0", 6, "cuda", true, dflash2_overrides(0.0));
  c0.config = config_for(tmp / "cpu0", 6, "cpu", true, dflash2_overrides(0.0));
  EXPECT_EQ(train(g0).steps_done, 6);
  EXPECT_EQ(train(c0).steps_done, 6);
  const auto mg0 = metrics(tmp / "gpu0"), mc0 = metrics(tmp / "cpu0");
  ASSERT_EQ(mg0.size(), 6u);
  ASSERT_EQ(mc0.size(), 6u);
  auto loss = [](const std::vector<json>& r, size_t step) {
    return r[step - 1]["loss"].get<double>();
  };
  for (const size_t step : {size_t{1}, size_t{2}}) {
    EXPECT_EQ(loss(m.gpu, step), loss(mg0, step)) << "step " << step << " is in the warmup";
  }
  const double sel_gpu = loss(m.gpu, 3) - loss(mg0, 3), sel_cpu = loss(m.cpu, 3) - loss(mc0, 3);
  std::printf("step 3: alpha_sel * CE_sel cpu %.5f gpu %.5f\n", sel_cpu, sel_gpu);
  EXPECT_GT(sel_cpu, 0.01 * loss(m.cpu, 3));  // the test's precondition: a visible selector term
  EXPECT_NEAR(sel_gpu, sel_cpu, 0.1 * sel_cpu);
  // Across backends: the resumed steps follow the CPU run.
  const auto to_cpu = halted_and_resumed(tmp / "to_cpu", dflash2_overrides(1.0), "cuda", "cpu");
  const auto to_gpu = halted_and_resumed(tmp / "to_gpu", dflash2_overrides(1.0), "cpu", "cuda");
  ASSERT_EQ(to_cpu.size(), 6u);
  ASSERT_EQ(to_gpu.size(), 6u);
  for (size_t step = 4; step <= 6; ++step) {
    EXPECT_NEAR(loss(to_cpu, step), loss(m.cpu, step), 0.02 * loss(m.cpu, step)) << step;
    EXPECT_NEAR(loss(to_gpu, step), loss(m.cpu, step), 0.02 * loss(m.cpu, step)) << step;
  }
}

// DFlash2 with D-PACE as its base (training.loss_type dpace: the base's and the selector's
// per-slot weights D-PACE's of the unary CE, the loss over the sequences): resumed, without graphs
// and against the CPU run as expect_resumes_and_follows_cpu.
TEST(TrainerCuda, Dflash2DpaceResumedRunIsBitIdenticalAndFollowsTheCpuRun) {
  DFLASH_REQUIRE_GPU();
  test::TempDir tmp;
  std::vector<std::string> overrides = dflash2_overrides(1.0);
  overrides.push_back("training.loss_type=dpace");
  expect_resumes_and_follows_cpu(tmp.path(), overrides, {"loss", "accuracy"});
}
