// Tests of `dflash train` (src/train/trainer): exact resume, signals, the run lock, torn
// checkpoints, resume guards, and `dflash status` on a live run; what a run reports about skipped
// steps and its data, resume from damaged checkpoints, the status of a finished run resumed, and
// metrics.jsonl after crashes (issue 18). Runs are tiny (a 200-conversation slice of the corpus,
// 256-token rows, 2 anchors per document) so that each takes seconds.
#include <gtest/gtest.h>

#include <algorithm>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "model/safetensors.hpp"
#include "train/run_dir.hpp"
#include "train/trainer.hpp"
#include "model/drafter_io.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {


std::string yaml_for(const fs::path& out, int64_t steps) {
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
  rows_per_step: 2
  block_budget: 256  # = token_budget: never binds, rows keep several conversations
training:
  max_steps: {}
  lr: 1.0e-3
  num_anchors: 2
  block_size: 8
  seed: 3
  log_interval: 1
  save_interval: 2
  keep_last: 5
runtime:
  threads: 2
output_dir: {}
)",
                     (test::assets_dir() / "tiny-qwen3").string(), test::small_corpus().string(),
                     steps, out.string());
}

RunConfig config_for(const fs::path& out, int64_t steps,
                     const std::vector<std::string>& overrides = {}) {
  return RunConfig::from_yaml(yaml_for(out, steps), "test.yaml", overrides);
}


// The steps of metrics.jsonl's records, in file order.
std::vector<int64_t> metrics_steps(const fs::path& dir) {
  std::vector<int64_t> out;
  std::istringstream in(test::read_file(dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line).at("step"));
  return out;
}

std::vector<int64_t> steps_1_to(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i) out.push_back(i);
  return out;
}

std::string master_bytes(const fs::path& ckpt) {
  SafetensorsFile f(ckpt / "trainer_state" / "optimizer.safetensors");
  Tensor t = f.get("master");
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}

}  // namespace

namespace {

// A 6-step run against one halted after step 3 and resumed (with `overrides`): same master weights,
// export and metrics, bit for bit.
void expect_resume_bit_identical(const std::vector<std::string>& overrides) {
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "a", 6, overrides);
  TrainResult ra = train(a);
  EXPECT_EQ(ra.steps_done, 6);
  EXPECT_FALSE(ra.interrupted);

  TrainOptions b;
  b.config = config_for(tmp / "b", 6, overrides);
  b.halt_at_step = 3;  // checkpoint and stop after step 3, as a signal would
  TrainResult rb = train(b);
  EXPECT_TRUE(rb.interrupted);
  EXPECT_EQ(rb.steps_done, 3);
  ASSERT_TRUE(fs::exists(tmp / "b" / "checkpoint-3" / "COMPLETE"));
  TrainOptions c;
  c.config = RunConfig::load((tmp / "b" / "config.resolved.yaml").string());
  c.resume_dir = (tmp / "b").string();
  TrainResult rc = train(c);
  EXPECT_EQ(rc.steps_done, 6);

  // Same master weights bit for bit, same exported drafter, same metrics at every step.
  EXPECT_EQ(master_bytes(tmp / "a" / "checkpoint-6"), master_bytes(tmp / "b" / "checkpoint-6"));
  EXPECT_EQ(test::read_file(tmp / "a" / "checkpoint-6" / "model.safetensors"),
            test::read_file(tmp / "b" / "checkpoint-6" / "model.safetensors"));
  auto ma = test::deterministic_metrics(tmp / "a"), mb = test::deterministic_metrics(tmp / "b");
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_EQ(ma[i], mb[i]) << "metrics line " << i;
  // The export folder is a loadable drafter config.
  json cfg = json::parse(test::read_file(tmp / "a" / "checkpoint-6" / "config.json"));
  const bool dspark = std::find(overrides.begin(), overrides.end(), "training.objective=dspark") !=
                      overrides.end();
  const bool dflash2 = std::find(overrides.begin(), overrides.end(),
                                 "training.objective=dflash2") != overrides.end();
  const bool domino = std::find(overrides.begin(), overrides.end(), "training.objective=domino") !=
                      overrides.end();
  EXPECT_EQ(cfg["architectures"][0],
            dspark    ? "DSparkDraftModel"
            : dflash2 ? "DFlash2DraftModel"
            : domino  ? "DominoDraftModel"
                      : "DFlashDraftModel");
  EXPECT_EQ(cfg["dflash_config"]["mask_token_id"], 8000);
  // The loss went down over the run (first vs last logged step).
  EXPECT_LT(ma.back()["loss"].get<double>(), ma.front()["loss"].get<double>());
}

}  // namespace

TEST(Trainer, InterruptedAndResumedRunIsBitIdenticalToAnUninterruptedOne) {
  expect_resume_bit_identical({});
}

TEST(Trainer, InterruptedAndResumedDPaceRunIsBitIdenticalToAnUninterruptedOne) {
  expect_resume_bit_identical({"training.loss_type=dpace"});
  // The run did optimise D-PACE: its first loss is not the dflash run's, and the log says so.
  test::TempDir tmp;
  for (const char* loss : {"dflash", "dpace"}) {
    TrainOptions o;
    o.config = config_for(tmp / loss, 1, {std::string("training.loss_type=") + loss});
    train(o);
  }
  const double l_dflash = test::deterministic_metrics(tmp / "dflash").at(0)["loss"];
  const double l_dpace = test::deterministic_metrics(tmp / "dpace").at(0)["loss"];
  EXPECT_GT(std::abs(l_dpace - l_dflash), 0.1 * l_dflash);
  EXPECT_NE(test::read_file(tmp / "dpace" / "log.txt").find("loss: dpace (alpha 0.5)"),
            std::string::npos);
}

// DSpark: its heads (every type) are in the optimizer state and the checkpoint like the rest of
// the drafter; the run optimises the DSpark loss (the log says so) and exports a DSpark drafter.
TEST(Trainer, InterruptedAndResumedDSparkRunIsBitIdenticalToAnUninterruptedOne) {
  for (const char* type : {"vanilla", "gated", "rnn"}) {
    expect_resume_bit_identical({"training.objective=dspark", "training.gamma=4",
                                 "training.markov_rank=4",
                                 std::string("training.markov_head_type=") + type,
                                 "training.confidence_head_with_markov=true"});
  }
  test::TempDir tmp;
  TrainOptions o;
  o.config = config_for(tmp / "s", 1,
                        {"training.objective=dspark", "training.markov_rank=4",
                         "training.markov_head_type=rnn"});
  train(o);
  EXPECT_NE(test::read_file(tmp / "s" / "log.txt")
                .find("objective: dspark, Σ w·(0.1·CE + 0.9·L1 + 1·BCE) / Σ w"),
            std::string::npos);
  const LoadedDrafter d = drafter_load(tmp / "s" / "checkpoint-1");
  EXPECT_EQ(d.config.dspark, (DsparkHeads{true, 4, MarkovHeadType::rnn, true, false}));
  // The heads trained: their exported weights are not drafter_init's (biases start at 0).
  EXPECT_NE(d.params[d.layout.dspark.joint_b], 0.0f);
  EXPECT_NE(d.params[d.layout.dspark.conf_b], 0.0f);
}

// DFlash2: its conv and selector are in the optimizer state and the checkpoint like the rest of the
// drafter; α_sel follows the run's global step across the resume (a warmup and a ramp inside the
// 6 steps); the run logs its objective and exports a DFlash2 drafter whose new tensors trained.
TEST(Trainer, InterruptedAndResumedDflash2RunIsBitIdenticalToAnUninterruptedOne) {
  const std::vector<std::string> d2 = {"training.objective=dflash2",
                                       "training.gamma=4",
                                       "training.conv_kernel_size=2",
                                       "training.conv_group_size=16",
                                       "training.selector_rank=4",
                                       "training.selector_top_k=8",
                                       "training.dflash2_selector_warmup_ratio=0.2",
                                       "training.dflash2_selector_ramp_ratio=0.5"};
  expect_resume_bit_identical(d2);
  test::TempDir tmp;
  TrainOptions o;
  o.config = config_for(tmp / "s", 2, d2);
  train(o);
  EXPECT_NE(test::read_file(tmp / "s" / "log.txt")
                .find("objective: dflash2, Σ w·(CE(ū) + α_sel·CE_sel) / Σ w"),
            std::string::npos);
  const LoadedDrafter d = drafter_load(tmp / "s" / "checkpoint-2");
  EXPECT_EQ(d.config.dflash2, (Dflash2Heads{true, 2, 16, 4, 8, 1.0, 0.0}));
  // The conv and the selector trained: their exported weights are not drafter_init's zeros
  // (the successor codebook starts at 0 and trains once α_sel > 0: 0.6 at step 1 of 2).
  const ParamInfo& kp = d.layout.find("layers.0.mlp_conv.kernel_projection.weight");
  const ParamInfo& bs = d.layout.find("candidate_selector.successor_codebook");
  auto any_nonzero = [&](const ParamInfo& p) {
    for (int64_t i = 0; i < p.numel; ++i) {
      if (d.params[p.offset + i] != 0.0f) return true;
    }
    return false;
  };
  EXPECT_TRUE(any_nonzero(kp));
  EXPECT_TRUE(any_nonzero(bs));
  // D-PACE as the base: resumed bit for bit; the run optimised it (the log says so, and its first
  // loss is not the dflash base's).
  std::vector<std::string> d2p = d2;
  d2p.push_back("training.loss_type=dpace");
  expect_resume_bit_identical(d2p);
  TrainOptions op;
  op.config = config_for(tmp / "p", 2, d2p);  // the α_sel schedule of run s
  train(op);
  const std::string log = test::read_file(tmp / "p" / "log.txt");
  EXPECT_NE(log.find("objective: dflash2, Σ w·(CE(ū) + α_sel·CE_sel) / sequences (w: D-PACE's"),
            std::string::npos);
  EXPECT_NE(log.find("loss: dpace (alpha 0.5)"), std::string::npos);
  const double l_dflash = test::deterministic_metrics(tmp / "s").at(0)["loss"];
  const double l_dpace = test::deterministic_metrics(tmp / "p").at(0)["loss"];
  EXPECT_GT(std::abs(l_dpace - l_dflash), 0.1 * l_dflash);
}

// Domino: the head is in the optimizer state and the checkpoint like the rest of the drafter, λ
// follows the step across the resume (it decays over these 6 steps), and the run exports a Domino
// drafter whose head trained.
TEST(Trainer, InterruptedAndResumedDominoRunIsBitIdenticalToAnUninterruptedOne) {
  for (const char* shift : {"false", "true"}) {
    expect_resume_bit_identical({"training.objective=domino", "training.gamma=4",
                                 "training.emb_dim=16", "training.gru_hidden_dim=24",
                                 "training.pure_draft_prefix_len=1",
                                 std::string("training.shift_label=") + shift});
  }
  test::TempDir tmp;
  TrainOptions o;
  o.config = config_for(tmp / "s", 1,
                        {"training.objective=domino", "training.emb_dim=16",
                         "training.gru_hidden_dim=24", "training.lambda_base_start=0.5",
                         "training.export_dtype=f32"});
  train(o);
  EXPECT_NE(test::read_file(tmp / "s" / "log.txt")
                .find("objective: domino, (1-λ)·Σ w·CE(F) / Σ w + λ·Σ w·CE(U) / Σ w, λ from 0.5"),
            std::string::npos);
  // metrics.jsonl carries the two terms (each Σ w·CE / Σ w); the loss is their blend at λ 0.5.
  const auto m = test::deterministic_metrics(tmp / "s");
  ASSERT_EQ(m.size(), 1u);
  const double ce_f = m[0].at("domino_ce_final").get<double>();
  const double ce_u = m[0].at("domino_ce_base").get<double>();
  EXPECT_NEAR(m[0].at("loss").get<double>(), 0.5 * ce_f + 0.5 * ce_u, 1e-12 * (ce_f + ce_u));
  EXPECT_NE(ce_f, ce_u);
  const LoadedDrafter d = drafter_load(tmp / "s" / "checkpoint-1");
  EXPECT_EQ(d.config.domino, (DominoHead{true, 16, 24, 0, false}));
  // The head trained (λ = 0.5 at step 0): W2 is not drafter_init's.
  std::vector<float> init(static_cast<size_t>(d.layout.total));
  drafter_init(init, d.layout, o.config.training.seed);
  EXPECT_NE(d.params[d.layout.domino.proj2], init[d.layout.domino.proj2]);
}

TEST(Trainer, ResumeRefusesChangedModelOrDataKeysUnlessForced) {
  test::TempDir tmp;
  TrainOptions a;
  a.config = config_for(tmp / "r", 2);
  train(a);
  TrainOptions b;
  b.config = config_for(tmp / "r", 4, {"training.seed=4", "training.log_interval=2"});
  b.resume_dir = (tmp / "r").string();
  try {
    train(b);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("training.seed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("training.max_steps"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("log_interval"), std::string::npos) << msg;
  }
  b.force = true;
  EXPECT_EQ(train(b).steps_done, 4);
  // A fresh run into a directory with checkpoints is refused too.
  TrainOptions c;
  c.config = config_for(tmp / "r", 2);
  EXPECT_THROW(train(c), Error);
}

TEST(Trainer, SecondRunOnALockedDirectoryFailsAtOnceNamingThePid) {
  test::TempDir tmp;
  RunDir holder(tmp / "locked");
  TrainOptions a;
  a.config = config_for(tmp / "locked", 2);
  try {
    train(a);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("in use by process " + std::to_string(::getpid())),
              std::string::npos)
        << e.what();
  }
}

TEST(Trainer, SigtermCheckpointsAndExitsZeroAndStatusSeesTheLiveRun) {
  test::TempDir tmp;
  const fs::path dir = tmp / "sig";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 100000));
  pid_t pid = test::spawn_dflash(
      {"train", "--config", (tmp / "run.yaml").string(), "training.save_interval=0"},
      tmp / "log.txt");
  // Wait until a step has been logged.
  bool live = false;
  for (int i = 0; i < 600 && !live; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (fs::exists(dir / "status.json")) {
      try {
        json st = read_status(dir);
        live = st.value("step", 0) >= 1;
      } catch (const Error&) {
      }
    }
  }
  if (!live) {
    ::kill(pid, SIGKILL);  // not left running on its 100000 steps
    test::wait_exit(pid);
    FAIL() << "no step logged within 60 s\n" << test::read_file(tmp / "log.txt");
  }
  auto status = test::run_dflash({"status", dir.string()});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_NE(status.out.find("running (pid " + std::to_string(pid) + ")"), std::string::npos)
      << status.out;
  ::kill(pid, SIGTERM);
  EXPECT_EQ(test::wait_exit(pid, tmp / "log.txt"), 0) << test::read_file(tmp / "log.txt");
  auto cps = RunDir::complete_checkpoints(dir);
  ASSERT_EQ(cps.size(), 1u);
  EXPECT_NE(test::read_file(tmp / "log.txt").find("stopped by signal"), std::string::npos);
  EXPECT_EQ(read_status(dir)["phase"], "interrupted");
  status = test::run_dflash({"status", dir.string()});
  EXPECT_NE(status.out.find("not running"), std::string::npos) << status.out;
}

// `dflash status --watch` into a file (not a terminal) appends a snapshot only when the run moved
// on: a stalled run adds nothing however long it is watched.
TEST(Trainer, StatusWatchIntoAFileWritesASnapshotOnlyWhenTheRunMovesOn) {
  test::TempDir tmp;
  const fs::path dir = tmp / "watched";
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  pid_t pid = -1;
  {
    RunDir holder(dir);  // holds the run's lock: the run counts as alive
    holder.write_status(json{{"phase", "training"}, {"step", 3}, {"total_steps", 10}});
    pid = test::spawn_dflash({"status", dir.string(), "--watch", "--every", "0.02"},
                             tmp / "watch.txt");
    std::this_thread::sleep_for(std::chrono::seconds(1));  // about 50 refreshes of a stalled run
    EXPECT_EQ(count(test::read_file(tmp / "watch.txt"), "step      3/10"), 1u);
    holder.write_status(json{{"phase", "training"}, {"step", 4}, {"total_steps", 10}});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }  // the lock goes: the watch prints the last snapshot and ends
  EXPECT_EQ(test::wait_exit(pid, tmp / "watch.txt", {.timeout_s = 30}), 0);
  const std::string out = test::read_file(tmp / "watch.txt");
  EXPECT_EQ(count(out, "step      3/10"), 1u) << out;
  EXPECT_EQ(count(out, "step      4/10"), 2u) << out;  // moved on; then no longer alive
  EXPECT_EQ(out.find("\033"), std::string::npos) << out;
}

TEST(Trainer, CrashWhileWritingACheckpointLeavesThePreviousOneUsable) {
  test::TempDir tmp;
  const fs::path dir = tmp / "crash";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6));
  // The writer dies (as on SIGKILL) in the middle of writing checkpoint-4.
  pid_t pid = test::spawn_dflash({"train", "--config", (tmp / "run.yaml").string()},
                                 tmp / "log.txt", {"DFLASH_TEST_CRASH_IN_CHECKPOINT=4"});
  EXPECT_EQ(test::wait_exit(pid, tmp / "log.txt"), 86) << test::read_file(tmp / "log.txt");
  auto cps = RunDir::complete_checkpoints(dir);
  ASSERT_EQ(cps.size(), 1u);
  EXPECT_EQ(cps.back().first, 2);
  // Resume continues from checkpoint-2 and ends where an uninterrupted run ends.
  auto r = test::run_dflash({"train", "--resume", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The reference run goes through the same executable (not in-process): `dflash` may select
  // other OpenBLAS kernels than this test binary (see backend/cpu/blas_core.hpp), and bit
  // equality needs the same kernels.
  test::write_file(tmp / "ref.yaml", yaml_for(tmp / "ref", 6));
  auto ref = test::run_dflash({"train", "--config", (tmp / "ref.yaml").string()});
  ASSERT_EQ(ref.exit_code, 0) << ref.err;
  EXPECT_EQ(master_bytes(dir / "checkpoint-6"), master_bytes(tmp / "ref" / "checkpoint-6"));
}

TEST(Trainer, MetricsHoldEachStepOnceAfterACrashAndResumeOrAFreshStart) {
  test::TempDir tmp;
  // Resume: the crash at checkpoint-4 leaves records of steps 3 and 4 past checkpoint-2.
  const fs::path dir = tmp / "crash";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6));
  pid_t pid =
      test::spawn_dflash({"train", "--config", (tmp / "run.yaml").string()}, tmp / "log.txt",
                         {"DFLASH_TEST_CRASH_IN_CHECKPOINT=4"});
  ASSERT_EQ(test::wait_exit(pid, tmp / "log.txt"), 86) << test::read_file(tmp / "log.txt");
  EXPECT_EQ(metrics_steps(dir), steps_1_to(4));
  auto r = test::run_dflash({"train", "--resume", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(metrics_steps(dir), steps_1_to(6));
  EXPECT_NE(test::read_file(dir / "log.txt").find("dropped 2 past it"), std::string::npos);

  // A fresh run into a directory whose first attempt died before any checkpoint.
  const fs::path fresh = tmp / "fresh";
  test::write_file(tmp / "fresh.yaml", yaml_for(fresh, 3));
  pid = test::spawn_dflash({"train", "--config", (tmp / "fresh.yaml").string()}, tmp / "log2.txt",
                           {"DFLASH_TEST_CRASH_IN_CHECKPOINT=2"});
  ASSERT_EQ(test::wait_exit(pid, tmp / "log2.txt"), 86) << test::read_file(tmp / "log2.txt");
  ASSERT_TRUE(RunDir::complete_checkpoints(fresh).empty());
  EXPECT_EQ(metrics_steps(fresh), steps_1_to(2));
  r = test::run_dflash({"train", "--config", (tmp / "fresh.yaml").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(metrics_steps(fresh), steps_1_to(3));
}

TEST(Trainer, SkippedStepsAreReportedAsSkippedNeverAsZeros) {
  test::TempDir tmp;
  const fs::path dir = tmp / "skip";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6));
  // The issue's reproduction: the first update blows the weights up, the next steps are
  // non-finite, and the run stops after two of them in a row.
  auto r = test::run_dflash({"train", "--config", (tmp / "run.yaml").string(), "training.lr=1e30",
                             "training.clip_grad_norm=0", "training.max_consecutive_skips=2"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("2 steps in a row were skipped"), std::string::npos) << r.err;
  std::istringstream in(test::read_file(dir / "metrics.jsonl"));
  int skipped_records = 0;
  for (std::string line; std::getline(in, line);) {
    const json m = json::parse(line);
    if (m.value("interval_skipped", 0) == 0) continue;
    ++skipped_records;
    EXPECT_EQ(m.at("interval_skip_reasons").at("non_finite"), 1) << line;
    for (const char* k : {"loss", "accuracy", "tau", "grad_norm", "slot_accuracy"}) {
      EXPECT_FALSE(m.contains(k)) << k << " in " << line;
    }
  }
  EXPECT_EQ(skipped_records, 1);  // step 2; step 3's skip stops the run before its record
  const std::string log = test::read_file(dir / "log.txt");
  EXPECT_EQ(log.find("loss 0.0000"), std::string::npos) << log;
  EXPECT_NE(log.find("skipped 1 of 1 steps (non_finite 1): no loss"), std::string::npos) << log;

  // A run that stops before its first log interval says so instead of printing zeros.
  test::write_file(tmp / "halt.yaml", yaml_for(tmp / "halt", 6));
  r = test::run_dflash({"train", "--config", (tmp / "halt.yaml").string(), "--halt-at-step", "1",
                        "training.log_interval=10"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("0.0000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no log interval has completed (training.log_interval 10)"),
            std::string::npos)
      << r.out;
}

TEST(Trainer, ResumeSkipsDamagedCheckpointsAndContinuesFromTheNewestIntactOne) {
  test::TempDir tmp;
  const fs::path dir = tmp / "run";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 6));
  auto r = test::run_dflash({"train", "--config", (tmp / "run.yaml").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string finished = master_bytes(dir / "checkpoint-6");
  // The issue's reproduction (checkpoint-6 without its model), and a damaged trainer_state.
  fs::remove(dir / "checkpoint-6" / "model.safetensors");
  const fs::path state = dir / "checkpoint-4" / "trainer_state" / "state.json";
  std::string text = test::read_file(state);
  text[text.find("\"step\": 4")] = ' ';  // same size, other bytes
  test::write_file(state, text);

  r = test::run_dflash({"train", "--resume", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string log = test::read_file(dir / "log.txt");
  EXPECT_NE(log.find("skipping checkpoint-6 (" +
                     (dir / "checkpoint-6" / "model.safetensors").string() + ": missing"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("skipping checkpoint-4 (" + state.string() + ": content differs"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("resumed from " + (dir / "checkpoint-2").string()), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(dir / "rejected-checkpoint-6"));
  EXPECT_TRUE(fs::exists(dir / "rejected-checkpoint-4"));
  // Steps 3..6 again, bit-identical to the first attempt.
  ASSERT_TRUE(fs::exists(dir / "checkpoint-6" / "model.safetensors"));
  EXPECT_EQ(master_bytes(dir / "checkpoint-6"), finished);
  EXPECT_EQ(metrics_steps(dir), steps_1_to(6));

  // When no checkpoint verifies, resume fails and names each one's fault.
  for (const auto& [step, path] : RunDir::complete_checkpoints(dir)) {
    fs::resize_file(path / "trainer_state" / "optimizer.safetensors", 100);
  }
  r = test::run_dflash({"train", "--resume", dir.string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("no checkpoint passes verification"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("optimizer.safetensors: 100 bytes, the marker lists"), std::string::npos)
      << r.err;
}

TEST(Trainer, ResumingAFinishedRunKeepsItsStatusAndFigures) {
  test::TempDir tmp;
  const fs::path dir = tmp / "done";
  test::write_file(tmp / "run.yaml", yaml_for(dir, 2));
  auto r = test::run_dflash({"train", "--config", (tmp / "run.yaml").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json before = read_status(dir);
  r = test::run_dflash({"train", "--resume", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("finished after 2 steps"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(fmt::format("loss {:.4f}", before["last"]["loss"].get<double>())),
            std::string::npos)
      << r.out;
  const json after = read_status(dir);
  EXPECT_EQ(after["phase"], "done");
  EXPECT_EQ(after["step"], 2);
  EXPECT_EQ(after["total_steps"], 2);
  EXPECT_EQ(after["last"], before["last"]);
  auto st = test::run_dflash({"status", dir.string()});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  EXPECT_NE(st.out.find("step      2/2\n"), std::string::npos) << st.out;
  EXPECT_NE(st.out.find("loss "), std::string::npos) << st.out;
}

TEST(Trainer, DataErrorsNameTheTrainSettingAndSkippedAndTruncatedRecordsAreCounted) {
  test::TempDir tmp;
  // The corpus with one bad record (a number where the turns belong) after its first line.
  const std::string corpus = test::read_file(test::small_corpus());
  const size_t first = corpus.find('\n') + 1;
  test::write_file(tmp / "bad.jsonl",
                   corpus.substr(0, first) + "{\"conversations\": 5}\n" + corpus.substr(first));
  std::string yaml = yaml_for(tmp / "data", 2);
  yaml.replace(yaml.find(test::small_corpus().string()), test::small_corpus().string().size(),
               (tmp / "bad.jsonl").string());
  test::write_file(tmp / "run.yaml", yaml);
  auto r = test::run_dflash({"train", "--config", (tmp / "run.yaml").string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("bad.jsonl:2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("data.skip_invalid=true"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("--skip-invalid"), std::string::npos) << r.err;

  r = test::run_dflash({"train", "--config", (tmp / "run.yaml").string(), "data.skip_invalid=true",
                        "output_dir=" + (tmp / "skip").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json data = read_status(tmp / "skip").at("data");
  EXPECT_EQ(data.at("records"), 201);
  EXPECT_EQ(data.at("skipped_invalid"), 1);
  const auto truncated = data.at("truncated").get<int64_t>();
  EXPECT_GT(truncated, 0);  // max_length 256
  EXPECT_GT(data.at("truncated_tokens").get<int64_t>(), truncated);
  const std::string log = test::read_file(tmp / "skip" / "log.txt");
  EXPECT_NE(log.find("1 invalid records skipped"), std::string::npos) << log;
  EXPECT_NE(log.find(fmt::format("{} truncated to max_length 256", truncated)), std::string::npos)
      << log;
  auto st = test::run_dflash({"status", (tmp / "skip").string()});
  EXPECT_NE(st.out.find("1 invalid records skipped"), std::string::npos) << st.out;
}
