// `mpirun --oversubscribe -np 2 dflash train` on the CPU backend (issue 15): two ranks of L
// drafter workers each train exactly like one process with 2·L drafter workers (the same weights,
// bit for bit, and the same metrics; with L = 2, four addends per sum, so that a summation order
// other than the global replica order would show), resume from their checkpoint with the same rank
// count and continue exactly, refuse another rank count, a fault on rank 1 stops rank 0 naming
// rank 1 and the worker, and a signal stops both ranks after the same step. Tiny runs (a
// 200-conversation slice of the corpus, one 256-token row per replica and step, 2 anchors per
// document): seconds on a 2-core machine.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
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

std::string yaml_for(const fs::path& out, int drafters) {
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
  max_steps: 20
  lr: 1.0e-3
  num_anchors: 2
  block_size: 8
  seed: 5
  log_interval: 1
  save_interval: 10
  keep_last: 10
runtime:
  threads: 1
  target_workers: 1
  drafter_workers: {}
  stall_timeout_s: 30
output_dir: {}
)",
                     (test::assets_dir() / "tiny-qwen3").string(), test::small_corpus().string(),
                     drafters, out.string());
}

std::string master_bytes(const fs::path& ckpt) {
  SafetensorsFile f(ckpt / "trainer_state" / "optimizer.safetensors");
  Tensor t = f.get("master");
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}

// Runs `mpirun -np 2 dflash ARGS` (as root too, oversubscribing the cores); its exit code, its
// console output and its seconds.
struct MpiRun {
  int exit_code = -1;
  std::string log;
  double seconds = 0;
};
MpiRun mpirun2(const fs::path& log, const std::vector<std::string>& args,
               const std::vector<std::string>& env = {}) {
#ifdef DFLASH_MPIEXEC
  // `args` holding ":" is mpirun's MPMD form: one rank with the arguments before it, then the
  // application context after it.
  const bool mpmd = std::find(args.begin(), args.end(), ":") != args.end();
  std::vector<std::string> argv = {"--oversubscribe", "-np", mpmd ? "1" : "2",
                                   test::dflash_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> e = {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                "OMPI_MCA_btl_vader_single_copy_mechanism=none"};
  e.insert(e.end(), env.begin(), env.end());
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = test::spawn_program(DFLASH_MPIEXEC, argv, log, e);
  MpiRun r;
  r.exit_code = test::wait_exit(pid, log, {.timeout_s = 120, .max_log_bytes = 1u << 20});
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.log = test::read_file(log);
  return r;
#else
  (void)log, (void)args, (void)env;
  return {};
#endif
}

#ifdef DFLASH_MPIEXEC
#define SKIP_WITHOUT_MPI()
#else
#define SKIP_WITHOUT_MPI() \
  GTEST_SKIP() << "this build has no MPI (configure with -DDFLASH_MPI=ON; Debian: libopenmpi-dev)"
#endif

// The one-process reference: one rank with the `drafters` drafter workers of the whole job.
fs::path reference_run(const test::TempDir& tmp, int drafters) {
  TrainOptions o;
  o.config = RunConfig::from_yaml(yaml_for(tmp / "one", drafters), "one.yaml");
  train(o);
  return tmp / "one";
}

}  // namespace

TEST(MpiTrain, TwoRanksTrainBitIdenticallyToOneRankWithTwiceTheDrafters) {
  SKIP_WITHOUT_MPI();
  test::TempDir tmp;
  test::write_file(tmp / "run.yaml", yaml_for(tmp / "job", 2));
  const MpiRun r = mpirun2(tmp / "console.txt", {"train", "--config", (tmp / "run.yaml").string()});
  ASSERT_EQ(r.exit_code, 0) << r.log;
  const fs::path one = reference_run(tmp, 4);
  EXPECT_EQ(master_bytes(tmp / "job" / "checkpoint-20"), master_bytes(one / "checkpoint-20"));
  EXPECT_EQ(master_bytes(tmp / "job" / "checkpoint-10"), master_bytes(one / "checkpoint-10"));
  EXPECT_EQ(test::deterministic_metrics(tmp / "job"), test::deterministic_metrics(one));
  const std::string log = test::read_file(tmp / "job" / "log.txt");
  EXPECT_NE(log.find("the 4 drafter replicas are bit-identical after step 20"), std::string::npos)
      << log;
  EXPECT_NE(log.find("collective: mpi-host (2 ranks)"), std::string::npos) << log;
  // status.json is rank 0's and lists every rank's workers, each once, in its final phase.
  const json st = read_status(tmp / "job");
  EXPECT_EQ(st["workers"].size(), 6u) << st.dump();
  std::set<std::string> names;
  for (const json& w : st["workers"]) {
    names.insert(w["name"].get<std::string>());
    EXPECT_EQ(w["phase"], "finished") << w.dump();
  }
  EXPECT_EQ(names, (std::set<std::string>{"rank0/target0", "rank0/drafter0", "rank0/drafter1",
                                          "rank1/target0", "rank1/drafter0", "rank1/drafter1"}))
      << st.dump();
  const json state =
      json::parse(test::read_file(tmp / "job" / "checkpoint-20" / "trainer_state" / "state.json"));
  EXPECT_EQ(state["ranks"], 2);
  // Rank 1 wrote no checkpoint and kept its own log apart.
  EXPECT_TRUE(RunDir::complete_checkpoints(tmp / "job" / "rank1").empty());
  EXPECT_TRUE(fs::exists(tmp / "job" / "rank1" / "log.txt"));
  std::printf("2 ranks x 2 drafters, 20 steps: %.1f s (mpirun to exit)\n", r.seconds);
}

TEST(MpiTrain, ResumeWithTheSameRankCountContinuesExactlyAndAnotherIsRefused) {
  SKIP_WITHOUT_MPI();
  test::TempDir tmp;
  test::write_file(tmp / "run.yaml", yaml_for(tmp / "job", 1));
  const MpiRun halted =
      mpirun2(tmp / "console1.txt",
              {"train", "--config", (tmp / "run.yaml").string(), "--halt-at-step", "10"});
  ASSERT_EQ(halted.exit_code, 0) << halted.log;
  ASSERT_FALSE(fs::exists(tmp / "job" / "checkpoint-20"));
  // One process cannot continue a 2-rank job's checkpoint without --force.
  TrainOptions other;
  other.config = RunConfig::from_yaml(yaml_for(tmp / "job", 1), "other.yaml");
  other.resume_dir = (tmp / "job").string();
  try {
    train(other);
    ADD_FAILURE() << "a 1-rank resume of a 2-rank checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("trained by a job of 2 ranks (mpirun -np) and this one "
                                         "has 1"),
              std::string::npos)
        << e.what();
  }
  const MpiRun resumed =
      mpirun2(tmp / "console2.txt", {"train", "--resume", (tmp / "job").string()});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.log;
  const fs::path one = reference_run(tmp, 2);
  EXPECT_EQ(master_bytes(tmp / "job" / "checkpoint-20"), master_bytes(one / "checkpoint-20"));
  EXPECT_EQ(test::deterministic_metrics(tmp / "job"), test::deterministic_metrics(one));
}

TEST(MpiTrain, AFaultOnRankOneStopsRankZeroNamingRankAndWorker) {
  SKIP_WITHOUT_MPI();
  test::TempDir tmp;
  test::write_file(tmp / "run.yaml", yaml_for(tmp / "job", 1));
  const MpiRun r = mpirun2(tmp / "console.txt", {"train", "--config", (tmp / "run.yaml").string()},
                           {"DFLASH_FAULT_INJECT=rank1:drafter:0:4:throw"});
  EXPECT_NE(r.exit_code, 0) << r.log;
  const std::string log = test::read_file(tmp / "job" / "log.txt");
  EXPECT_NE(log.find("error: rank1/drafter0 (cpu) failed at step 4: fault injected at step 4"),
            std::string::npos)
      << log << "\n--- console:\n"
      << r.log;
  EXPECT_EQ(read_status(tmp / "job")["phase"], "failed");
  // Rank 0 checkpointed the last step it accounted (3) before ending the job.
  EXPECT_TRUE(fs::exists(tmp / "job" / "checkpoint-3" / "COMPLETE")) << log;
  // Bounded: the ranks stop within the pipeline's grace period, far below the stall timeout.
  EXPECT_LT(r.seconds, 60.0) << r.log;
}

// The pid of rank `rank` among the children of mpirun `launcher` (its OMPI_COMM_WORLD_RANK), or
// -1 when it has not started yet.
pid_t rank_pid(pid_t launcher, int rank) {
  std::istringstream children(test::read_file(fmt::format(
      "/proc/{}/task/{}/children", static_cast<int>(launcher), static_cast<int>(launcher))));
  const std::string want = fmt::format("OMPI_COMM_WORLD_RANK={}", rank);
  for (int child = 0; children >> child;) {
    std::string env = test::read_file(fmt::format("/proc/{}/environ", child));
    std::replace(env.begin(), env.end(), '\0', '\n');
    if (("\n" + env + "\n").find("\n" + want + "\n") != std::string::npos) return child;
  }
  return -1;
}

// SIGTERM to rank 0 (mpirun itself SIGKILLs the ranks 1 s after forwarding a signal): rank 0
// picks the stop step and tells rank 1, which got no signal, so both stop after the same step, in
// the same state, and rank 0 checkpoints it.
TEST(MpiTrain, ASignalToRankZeroStopsEveryRankAfterTheSameStep) {
  SKIP_WITHOUT_MPI();
#ifdef DFLASH_MPIEXEC
  test::TempDir tmp;
  test::write_file(tmp / "run.yaml", yaml_for(tmp / "job", 1));
  const std::vector<std::string> argv = {"--oversubscribe",
                                         "-np",
                                         "2",
                                         test::dflash_binary(),
                                         "train",
                                         "--config",
                                         (tmp / "run.yaml").string(),
                                         "training.max_steps=100000",
                                         "training.log_interval=1"};
  const pid_t pid =
      test::spawn_program(DFLASH_MPIEXEC, argv, tmp / "console.txt",
                          {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                           "OMPI_MCA_btl_vader_single_copy_mechanism=none"});
  // Signalled once rank 0 has logged step 5 (within a minute).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (test::read_file(tmp / "console.txt").find("step 5/") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const pid_t rank0 = rank_pid(pid, 0);
  ASSERT_GT(rank0, 0) << test::read_file(tmp / "console.txt");
  ::kill(rank0, SIGTERM);
  EXPECT_EQ(test::wait_exit(pid, tmp / "console.txt", {.timeout_s = 60}), 0);
  const std::string log = test::read_file(tmp / "job" / "log.txt");
  ASSERT_NE(log.find("stopped by signal 15 after step"), std::string::npos)
      << log << "\n--- console:\n"
      << test::read_file(tmp / "console.txt");
  EXPECT_NE(log.find("the 2 drafter replicas are bit-identical after step"), std::string::npos)
      << log;
  const auto ckpts = RunDir::complete_checkpoints(tmp / "job");
  ASSERT_FALSE(ckpts.empty()) << log;
  const std::string rank1 = test::read_file(tmp / "job" / "rank1" / "log.txt");
  EXPECT_NE(
      rank1.find(fmt::format("stopped after step {} (rank 0 stopped the job)", ckpts.back().first)),
      std::string::npos)
      << rank1;
#endif
}

// Ranks that resolve different configurations are stopped before the first step, naming the
// rank and the first line that differs (mpirun's MPMD form gives rank 1 other arguments).
TEST(MpiTrain, RanksWithAnotherConfigurationAreRefusedAtStart) {
  SKIP_WITHOUT_MPI();
  test::TempDir tmp;
  test::write_file(tmp / "run.yaml", yaml_for(tmp / "job", 1));
  const std::string cfg = (tmp / "run.yaml").string();
  const MpiRun r = mpirun2(tmp / "console.txt",
                           {"train", "--config", cfg, ":", "-np", "1", test::dflash_binary(),
                            "train", "--config", cfg, "training.lr=2e-3"});
  EXPECT_NE(r.exit_code, 0) << r.log;
  const std::string log = test::read_file(tmp / "job" / "log.txt");
  EXPECT_NE(log.find("rank 1 does not match rank 0: its configuration has 'training: lr: 0.002', "
                     "rank 0's 'training: lr: 0.001'"),
            std::string::npos)
      << log << "\n--- console:\n"
      << r.log;
  EXPECT_TRUE(RunDir::complete_checkpoints(tmp / "job").empty());
}
