// `dflash train` with several pipeline workers on the CPU backend: the global batch order does
// not depend on the number of target workers, 2 target + 2 drafter workers resume bit-identically,
// a changed number of replicas is refused unless forced, status.json lists every worker, and the
// failure tests of the pipeline issue: a thrown error, a hang and a NaN streak, each with 2 target
// and 2 drafter workers, stop the run with a non-zero exit naming the worker, within 10 s of the
// failure, leaving a checkpoint that resumes. Tiny runs (a 200-conversation slice of the corpus,
// one 256-token row per batch, 2 anchors per document).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "model/safetensors.hpp"
#include "train/run_dir.hpp"
#include "train/trainer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string yaml_for(const fs::path& out, int64_t steps, int targets, int drafters) {
  return fmt::format(R"(model:
  target: {}
  drafter_layers: 1
  intermediate_size: 64
  mask_token_id: 8000
data:
  train_file: {}
  template: chatml
  max_length: 256
  token_budget: 256
  rows_per_step: 1
training:
  max_steps: {}
  lr: 1.0e-3
  num_anchors: 2
  block_size: 8
  seed: 5
  log_interval: 1
  save_interval: 2
  keep_last: 10
runtime:
  threads: 1
  target_workers: {}
  drafter_workers: {}
output_dir: {}
)",
                     (test::assets_dir() / "tiny-qwen3").string(), test::small_corpus().string(),
                     steps, targets, drafters, out.string());
}

RunConfig config_for(const fs::path& out, int64_t steps, int targets, int drafters,
                     const std::vector<std::string>& overrides = {}) {
  return RunConfig::from_yaml(yaml_for(out, steps, targets, drafters), "test.yaml", overrides);
}

std::string master_bytes(const fs::path& ckpt) {
  SafetensorsFile f(ckpt / "trainer_state" / "optimizer.safetensors");
  Tensor t = f.get("master");
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}


using SteadyClock = std::chrono::steady_clock;

// The most lines a 6-step failing run may log: its set-up, six steps, the failure report with one
// line per worker, the checkpoints; a stall must add none.
constexpr std::ptrdiff_t kMaxLogLines = 60;

// Runs `dflash train` with a fault injected; returns the exit code, the log, and the seconds from
// the first log line holding `failure_mark` to the process's exit. A run still going after
// `limits.timeout_s`, or whose log passes `limits.max_log_bytes`, is killed and fails the test.
struct FaultRun {
  int exit_code = -1;
  std::string log;
  double stop_s = -1;
};
FaultRun run_with_fault(const fs::path& yaml, const fs::path& log, const std::string& fault,
                        const std::string& failure_mark,
                        const std::vector<std::string>& overrides = {},
                        const test::RunLimits& limits = {}) {
  std::vector<std::string> args = {"train", "--config", yaml.string()};
  args.insert(args.end(), overrides.begin(), overrides.end());
  const auto start = SteadyClock::now();
  const pid_t pid = test::spawn_dflash(args, log, {"DFLASH_FAULT_INJECT=" + fault});
  std::optional<SteadyClock::time_point> seen;
  int status = 0;
  FaultRun r;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    const auto now = SteadyClock::now();
    if (!seen && test::read_file(log).find(failure_mark) != std::string::npos) seen = now;
    if (done == pid) {
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (seen) r.stop_s = std::chrono::duration<double>(now - *seen).count();
      break;
    }
    const double ran_s = std::chrono::duration<double>(now - start).count();
    std::error_code ec;
    const std::uintmax_t bytes = fs::file_size(log, ec);
    if ((!ec && bytes > limits.max_log_bytes) || ran_s > limits.timeout_s) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "dflash train (fault " << fault << ") killed after " << ran_s << " s with "
                    << bytes << " bytes of log (limits: " << limits.timeout_s << " s, "
                    << limits.max_log_bytes << " bytes)";
      r.exit_code = 128 + SIGKILL;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.log = test::read_file(log);
  return r;
}

// `dflash train --resume DIR` runs to the end and leaves checkpoint `last`.
void expect_resumes_to(const fs::path& dir, int64_t last) {
  const auto before = RunDir::complete_checkpoints(dir);
  ASSERT_FALSE(before.empty()) << "no complete checkpoint in " << dir;
  const auto r = test::run_dflash({"train", "--resume", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir / RunDir::checkpoint_name(last) / "COMPLETE")) << r.err;
}

}  // namespace

TEST(PipelineTrain, TheNumberOfTargetWorkersDoesNotChangeTheBits) {
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "one", 4, 1, 1);
  train(a);
  TrainOptions b;
  b.config = config_for(tmp / "three", 4, 3, 1);
  train(b);
  EXPECT_EQ(master_bytes(tmp / "one" / "checkpoint-4"),
            master_bytes(tmp / "three" / "checkpoint-4"));
  EXPECT_EQ(test::deterministic_metrics(tmp / "one"), test::deterministic_metrics(tmp / "three"));
}

// The data-parallel equivalence: D replicas of R rows train as one replica of D·R rows (the same
// global batches, anchors and normaliser), up to float summation order. A whole epoch, so that
// the epoch's last batch (one real row and one empty row: replica 1's share is empty) is in it.
namespace {

// One epoch with 2 drafter replicas of 1 row against 1 replica of 2 rows (plus `objective`
// overrides): the same metrics up to summation order at every step, the same final weights.
void expect_two_replicas_train_like_one_of_two_rows(const std::vector<std::string>& objective) {
  test::TempDir tmp;
  std::vector<std::string> epoch = {"training.max_steps=0", "training.epochs=1",
                                    "training.save_interval=0"};
  epoch.insert(epoch.end(), objective.begin(), objective.end());
  std::vector<std::string> rows2 = epoch;
  rows2.push_back("data.rows_per_step=2");
  TrainOptions a;
  a.config = config_for(tmp / "dp", 0, 1, 2, epoch);
  const TrainResult ra = train(a);
  TrainOptions b;
  b.config = config_for(tmp / "rows", 0, 1, 1, rows2);
  const TrainResult rb = train(b);
  // 199 rows of one document: 100 global batches of 2 rows, the last with an empty row.
  ASSERT_EQ(ra.steps_done, 100);
  ASSERT_EQ(rb.steps_done, 100);
  const auto ma = test::deterministic_metrics(tmp / "dp");
  const auto mb = test::deterministic_metrics(tmp / "rows");
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    // The sums of floats differ by their summation order only (tighter while it has had few
    // steps to grow); an argmax near a tie may flip, which moves an accuracy by one slot in tens.
    EXPECT_EQ(ma[i]["step"], mb[i]["step"]);
    const double tol = i < 10 ? 1e-4 : 1e-2;
    for (const char* k : {"loss", "grad_norm"}) {
      const double x = ma[i][k].get<double>(), y = mb[i][k].get<double>();
      EXPECT_NEAR(x, y, tol * std::max(1.0, std::abs(y))) << k << " at step " << i + 1;
    }
    EXPECT_NEAR(ma[i]["accuracy"].get<double>(), mb[i]["accuracy"].get<double>(), 0.05)
        << "step " << i + 1;
  }
  SafetensorsFile fa(tmp / "dp" / "checkpoint-100" / "trainer_state" / "optimizer.safetensors");
  SafetensorsFile fb(tmp / "rows" / "checkpoint-100" / "trainer_state" / "optimizer.safetensors");
  const Tensor wa = fa.get("master"), wb = fb.get("master");
  ASSERT_EQ(wa.numel(), wb.numel());
  double max_diff = 0;
  for (int64_t i = 0; i < wa.numel(); ++i) {
    max_diff = std::max(max_diff, std::abs(double(wa.data<float>()[i]) - wb.data<float>()[i]));
  }
  // 100 AdamW steps of lr ≤ 1e-3 move a weight by up to ~0.1; summation order by far less.
  EXPECT_LT(max_diff, 1e-3);
}

}  // namespace

TEST(PipelineTrain, TwoReplicasOfOneRowTrainLikeOneReplicaOfTwoRows) {
  expect_two_replicas_train_like_one_of_two_rows({});
}

// D-PACE divides by the step's documents, which the replicas must sum like Σw (the last batch's
// second row is empty: that replica has no document and no supervised slot).
TEST(PipelineTrain, TwoDPaceReplicasOfOneRowTrainLikeOneReplicaOfTwoRows) {
  expect_two_replicas_train_like_one_of_two_rows(
      {"training.loss_type=dpace", "training.dpace_alpha=0.3"});
}

// DSpark divides by the step's Σw like dflash (its own prefix weights), the teacher rows travel with
// each replica's features, and the heads' gradients are all-reduced with the rest.
TEST(PipelineTrain, TwoDSparkReplicasOfOneRowTrainLikeOneReplicaOfTwoRows) {
  expect_two_replicas_train_like_one_of_two_rows(
      {"training.objective=dspark", "training.markov_rank=4", "training.markov_head_type=gated",
       "training.confidence_head_with_markov=true"});
}

// DFlash2 divides by the step's Σw like dflash, every replica's batch carries the step's α_sel
// (ramped here), and the conv's and selector's gradients are all-reduced with the rest.
TEST(PipelineTrain, TwoDflash2ReplicasOfOneRowTrainLikeOneReplicaOfTwoRows) {
  expect_two_replicas_train_like_one_of_two_rows(
      {"training.objective=dflash2", "training.conv_kernel_size=2", "training.conv_group_size=16",
       "training.selector_rank=4", "training.selector_top_k=8",
       "training.dflash2_selector_warmup_ratio=0.1", "training.dflash2_selector_ramp_ratio=0.3"});
}

// Domino divides both CE terms by the step's Σw (our global normalisation; SpecForge divides each
// micro-batch by its own), both replicas use the step's λ, and the head's gradients are
// all-reduced with the rest. λ decays over the run's 100 steps, so the test covers λ > 0 and 0.
TEST(PipelineTrain, TwoDominoReplicasOfOneRowTrainLikeOneReplicaOfTwoRows) {
  expect_two_replicas_train_like_one_of_two_rows(
      {"training.objective=domino", "training.emb_dim=16", "training.gru_hidden_dim=24",
       "training.pure_draft_prefix_len=1", "training.lambda_base_decay_ratio=0.3"});
}

TEST(PipelineTrain, TwoByTwoResumesBitIdenticallyAndRefusesAnotherReplicaCount) {
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "a", 4, 2, 2);
  const TrainResult ra = train(a);
  EXPECT_EQ(ra.steps_done, 4);
  const std::string log_a = test::read_file(tmp / "a" / "log.txt");
  EXPECT_NE(log_a.find("the 2 drafter replicas are bit-identical after step 4"), std::string::npos)
      << log_a;
  EXPECT_NE(log_a.find("cpu: 2 target workers, 2 drafter workers"), std::string::npos);
  // status.json lists every worker.
  const json st = read_status(tmp / "a");
  ASSERT_TRUE(st.contains("workers")) << st.dump();
  ASSERT_EQ(st["workers"].size(), 4u);
  EXPECT_EQ(st["workers"][3]["name"], "drafter1");
  EXPECT_EQ(st["workers"][3]["queue_capacity"], 2);
  for (const json& w : st["workers"]) {  // the run is over: no worker has a current rate
    EXPECT_EQ(w["phase"], "finished") << w.dump();
    EXPECT_FALSE(w.contains("tokens_per_s")) << w.dump();
  }
  const auto status = test::run_dflash({"status", (tmp / "a").string()});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  for (const char* w : {"target0", "target1", "drafter0", "drafter1"}) {
    EXPECT_NE(status.out.find(w), std::string::npos) << status.out;
  }
  // Metrics carry the stages' busy fractions and the queue depths.
  std::istringstream lines(test::read_file(tmp / "a" / "metrics.jsonl"));
  std::string first;
  std::getline(lines, first);
  const json m = json::parse(first);
  EXPECT_TRUE(m.contains("target_busy") && m.contains("drafter_busy")) << first;
  EXPECT_EQ(m["queue_depth"].size(), 2u) << first;

  TrainOptions b;
  b.config = config_for(tmp / "b", 4, 2, 2);
  b.halt_at_step = 2;
  EXPECT_TRUE(train(b).interrupted);
  TrainOptions other;
  other.config = config_for(tmp / "b", 4, 2, 1);
  other.resume_dir = (tmp / "b").string();
  try {
    train(other);
    FAIL() << "a resume with 1 replica instead of 2 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 drafter replicas and this run has 1 "
                                         "(runtime.drafter_workers)"),
              std::string::npos)
        << e.what();
  }
  TrainOptions c;
  c.config = config_for(tmp / "b", 4, 1, 2);  // another number of target workers is fine
  c.resume_dir = (tmp / "b").string();
  EXPECT_EQ(train(c).steps_done, 4);
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-4"), master_bytes(tmp / "b" / "checkpoint-4"));
  EXPECT_EQ(test::deterministic_metrics(tmp / "a"), test::deterministic_metrics(tmp / "b"));
}

TEST(PipelineTrain, ForcedResumeWithAnotherReplicaCountContinuesFromTheDataPosition) {
  test::TempDir tmp;
  TrainOptions b;
  b.config = config_for(tmp / "f", 4, 1, 2);
  b.halt_at_step = 2;
  train(b);
  TrainOptions c;
  c.config = config_for(tmp / "f", 4, 1, 1);
  c.resume_dir = (tmp / "f").string();
  c.force = true;
  EXPECT_EQ(train(c).steps_done, 4);
  const std::string log = test::read_file(tmp / "f" / "log.txt");
  EXPECT_NE(log.find("--force: continuing with 1 drafter replicas (the checkpoint had 2)"),
            std::string::npos)
      << log;
  // Steps 1-2 took the 2-row batches 0 and 1 (4 rows); the 1-row plan continues at batch 4, so
  // steps 3-4 take batches 4 and 5 and the cursor ends at batch 6.
  const json state =
      json::parse(test::read_file(tmp / "f" / "checkpoint-4" / "trainer_state" / "state.json"));
  EXPECT_EQ(state["data_cursor"]["batch"], 6);
}

TEST(PipelineTrain, AThrownErrorStopsEveryWorkerNamingItAndLeavesAResumableCheckpoint) {
  test::TempDir tmp;
  const fs::path dir = tmp / "throw";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6, 2, 2));
  const FaultRun r = run_with_fault(tmp / "run.yaml", tmp / "log.txt", "drafter:1:4:throw",
                                    "stopping every worker");
  EXPECT_EQ(r.exit_code, 1) << r.log;
  EXPECT_NE(r.log.find("drafter1 (cpu) failed at step 4: fault injected"), std::string::npos)
      << r.log;
  EXPECT_GE(r.stop_s, 0) << r.log;
  EXPECT_LT(r.stop_s, 10.0) << r.log;
  // Steps 1-3 completed: checkpoint-2 (save_interval) and checkpoint-3 (the last completed step).
  EXPECT_TRUE(fs::exists(dir / "checkpoint-3" / "COMPLETE")) << r.log;
  EXPECT_EQ(read_status(dir)["phase"], "failed");
  expect_resumes_to(dir, 6);
}

TEST(PipelineTrain, AHangIsReportedAsStuckWithEveryWorkersPhase) {
  test::TempDir tmp;
  const fs::path dir = tmp / "hang";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6, 2, 2));
  // The stall adds nothing to the log (a run once filled a disk with its output): killed past
  // 64 KiB or 3 min, and a bounded number of lines.
  const FaultRun r = run_with_fault(tmp / "run.yaml", tmp / "log.txt", "target:1:3:hang",
                                    "is stuck", {"runtime.stall_timeout_s=10"},
                                    {.timeout_s = 180, .max_log_bytes = 64u << 10});
  EXPECT_EQ(r.exit_code, 1) << r.log;
  EXPECT_LT(std::count(r.log.begin(), r.log.end(), '\n'), kMaxLogLines) << r.log;
  EXPECT_NE(r.log.find("target1 (cpu) is stuck: no progress for"), std::string::npos) << r.log;
  for (const char* w : {"target0 (cpu): ", "drafter0 (cpu): ", "drafter1 (cpu): "}) {
    EXPECT_NE(r.log.find(w), std::string::npos) << r.log;
  }
  EXPECT_NE(r.log.find("left behind (did not stop within"), std::string::npos) << r.log;
  EXPECT_GE(r.stop_s, 0) << r.log;
  EXPECT_LT(r.stop_s, 10.0) << r.log;
  ASSERT_FALSE(RunDir::complete_checkpoints(dir).empty()) << r.log;
  expect_resumes_to(dir, 6);
}

TEST(PipelineTrain, ANanStreakStopsTheRunNamingTheReplicaAndKeepsTheLastGoodState) {
  test::TempDir tmp;
  const fs::path dir = tmp / "nan";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6, 2, 2));
  const FaultRun r = run_with_fault(tmp / "run.yaml", tmp / "log.txt", "drafter:0:3:nan",
                                    "stopping every worker", {"training.max_consecutive_skips=3"});
  EXPECT_EQ(r.exit_code, 1) << r.log;
  EXPECT_NE(r.log.find("3 steps in a row were skipped (non-finite loss or gradient; non-finite "
                       "loss on drafter0 (features from target"),
            std::string::npos)
      << r.log;
  EXPECT_GE(r.stop_s, 0) << r.log;
  EXPECT_LT(r.stop_s, 10.0) << r.log;
  // Steps 3 and 4 were counted as skipped before step 5 stopped the run: checkpoint-4 holds the
  // weights of step 2 (skipped steps change nothing).
  ASSERT_TRUE(fs::exists(dir / "checkpoint-4" / "COMPLETE")) << r.log;
  EXPECT_EQ(master_bytes(dir / "checkpoint-2"), master_bytes(dir / "checkpoint-4"));
  expect_resumes_to(dir, 6);
}
