// The pipeline's CUDA stages (src/train/cuda_stages.cpp) and collectives
// (src/train/collective_cuda.cpp) on the GPU: a target stage and a drafter stage, each with its own
// context, compute bit for bit what the one-context CudaTrainBackend computes; `dflash train` with
// two drafter replicas colocated on one GPU keeps them bit-identical (the in-process device
// collective); on two GPUs NCCL gives the bits of the in-process collective (two ranks: a + b
// either way); an injected error on a GPU replica stops the run naming it with a resumable
// checkpoint. Tiny runs on the bundled target. Skipped without a GPU (two for the NCCL test).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <random>

#include "backend/cuda/device.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_io.hpp"
#include "model/objective.hpp"
#include "model/safetensors.hpp"
#include "model/target.hpp"
#include "train/cuda_train.hpp"
#include "train/run_dir.hpp"
#include "train/train_backend.hpp"
#include "train/trainer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;

namespace {

const TargetModel& tiny_target() {
  static const TargetModel t = TargetModel::load(test::assets_dir() / "tiny-qwen3");
  return t;
}

DrafterConfig tiny_drafter() {
  DrafterSizes sizes;
  sizes.intermediate_size = 128;
  sizes.block_size = 8;
  return drafter_config_for_target(tiny_target().config(), 2, sizes, 8000, std::vector<int>{1, 3});
}

// Two rows of 128 slots with random documents of the given lengths (tokens below 8000), 3 anchors
// per document; the targets of objective `obj` (dflash's, or Domino's with its shift_label).
DrafterBatch make_batch(uint32_t seed, const Objective& obj = {},
                        const std::vector<std::vector<int>>& rows = {{40, 61}, {97}}) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 7999);
  std::bernoulli_distribution bit(0.7);
  Rng arng(seed);
  DrafterBatch d(8);
  d.objective = obj;
  for (const std::vector<int>& docs : rows) {
    std::vector<int32_t> t, off{0};
    std::vector<uint8_t> m;
    for (int n : docs) {
      for (int i = 0; i < n; ++i) {
        t.push_back(tok(rng));
        m.push_back(bit(rng) ? 1 : 0);
      }
      off.push_back(static_cast<int32_t>(t.size()));
    }
    const std::vector<Anchor> anchors = sample_anchors(m, off, 3, arng);
    d.append_row(t, off, anchors,
                 obj.domino()
                     ? domino_block_targets(t, m, off, anchors, 8, 7.0, obj.domino_shift_label)
                     : block_targets(t, m, off, anchors, 8, 7.0));
  }
  d.row_length = 128;
  return d;
}

DrafterState initial_state(const DrafterLayout& layout) {
  DrafterState s;
  s.params.resize(static_cast<size_t>(layout.total));
  drafter_init(s.params, layout, 11);
  s.adam_m.assign(s.params.size(), 0.0f);
  s.adam_v.assign(s.params.size(), 0.0f);
  return s;
}

std::string yaml_for(const fs::path& out, const std::string& drafter_devices) {
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
  max_steps: 6
  lr: 1.0e-3
  num_anchors: 2
  block_size: 8
  seed: 5
  log_interval: 1
  save_interval: 2
runtime:
  backend: cuda
  target_devices: [0]
  drafter_devices: {}
  colocated: true
output_dir: {}
)",
                     (test::assets_dir() / "tiny-qwen3").string(), test::small_corpus().string(),
                     drafter_devices, out.string());
}

std::string master_bytes(const fs::path& ckpt) {
  SafetensorsFile f(ckpt / "trainer_state" / "optimizer.safetensors");
  Tensor t = f.get("master");
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}

}  // namespace

namespace {

// A target stage and a drafter stage against the one-context CudaTrainBackend over 3 steps of
// `obj` (Domino's λ and DFlash2's α_sel change every step, as the trainer sets them): the same
// sums, metrics, gradient norm and state bit for bit.
void expect_split_stages_match_one_context(const DrafterConfig& cfg, Objective obj) {
  const DrafterLayout layout(cfg);
  TrainBackendOptions opts;
  opts.backend = "cuda";
  opts.max_context_tokens = 256;
  opts.max_blocks = 256;
  opts.feature_buffers = 2;
  opts.clip_grad_norm = 0.5;
  const TrainMemoryPlan plan = plan_train_memory(
      tiny_target().config(), cfg, layout, TrainStepCapacity{256, 256}, opts.device_memory_gib);
  CudaTrainBackend one(0, tiny_target(), cfg, layout, plan, true, opts.adam, opts.clip_grad_norm);
  const std::unique_ptr<TargetStage> target = cuda_target_stage_create(opts, 0, tiny_target(), cfg);
  const std::unique_ptr<DrafterStage> drafter =
      cuda_drafter_stage_create(opts, 0, tiny_target(), cfg, layout, nullptr, 0);
  const DrafterState s0 = initial_state(layout);
  one.load_state(s0);
  drafter->load_state(s0);
  for (uint32_t step = 0; step < 3; ++step) {
    obj.domino_lambda = obj.domino() ? 1.0 - 0.4 * step : 0.0;
    obj.dflash2_selector_alpha = obj.dflash2() ? 0.5 * step : 0.0;  // 0 (captured), 0.5, 1
    const DrafterBatch b = make_batch(100 + step, obj);
    const auto f1 = one.forward_taps(b);
    one.step(b, *f1);
    one.update(1e-3);
    const DrafterStepResult r1 = one.result();
    const auto f2 = target->forward_taps(b);
    drafter->step(b, *f2);
    drafter->update(1e-3);
    const DrafterStepResult r2 = drafter->result();
    EXPECT_EQ(r1.metrics.loss_weighted_sum, r2.metrics.loss_weighted_sum) << step;
    EXPECT_EQ(r1.metrics.weight_sum, r2.metrics.weight_sum) << step;
    EXPECT_EQ(r1.metrics.slot_correct, r2.metrics.slot_correct) << step;
    EXPECT_EQ(r1.metrics.domino_final_ce_sum, r2.metrics.domino_final_ce_sum) << step;
    EXPECT_EQ(r1.metrics.domino_base_ce_sum, r2.metrics.domino_base_ce_sum) << step;
    EXPECT_EQ(r1.grad_norm, r2.grad_norm) << step;
    EXPECT_EQ(r1.clip, r2.clip) << step;
  }
  DrafterState a, b;
  one.save_state(a);
  drafter->save_state(b);
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(a.adam_v, b.adam_v);
  EXPECT_EQ(a.updates, 3);
  EXPECT_EQ(b.updates, 3);
  EXPECT_NE(drafter->summary().find("captured as CUDA graphs"), std::string::npos);
}

}  // namespace

// The target stage with runtime.target_prefill cudnn (the default) against the same stage with
// the kernels: the real rows' taps agree within the whole-forward tolerance (only the prefill
// differs), over batches of two document buckets (3 documents + 1 padding: 4 slots; 6 + 1: 8).
TEST(PipelineCuda, TheTargetStagesCudnnPrefillGivesTheKernelsTaps) {
  DFLASH_REQUIRE_GPU();
  const DrafterConfig cfg = tiny_drafter();
  TrainBackendOptions opts;
  opts.backend = "cuda";
  opts.max_context_tokens = 256;
  opts.max_blocks = 256;
  opts.feature_buffers = 1;
  opts.target_prefill = TargetPrefill::kernels;
  const std::unique_ptr<TargetStage> kernels =
      cuda_target_stage_create(opts, 0, tiny_target(), cfg);
  opts.target_prefill = TargetPrefill::cudnn;
  const std::unique_ptr<TargetStage> cudnn = cuda_target_stage_create(opts, 0, tiny_target(), cfg);
  const int64_t cols = drafter_feature_cols(cfg);
  int batches = 0;
  for (const std::vector<std::vector<int>>& rows :
       {std::vector<std::vector<int>>{{40, 61}, {97}},
        std::vector<std::vector<int>>{{10, 30, 50}, {20, 9, 70}}}) {
    const DrafterBatch b = make_batch(200 + static_cast<uint32_t>(batches), {}, rows);
    const auto real = static_cast<size_t>(b.T() * cols);
    std::vector<uint16_t> k = cuda_features_download(*kernels->forward_taps(b));
    std::vector<uint16_t> c = cuda_features_download(*cudnn->forward_taps(b));
    ASSERT_EQ(k.size(), c.size());
    k.resize(real);
    c.resize(real);
    const double e = test::rel_error(test::from_bf16(c), test::from_bf16(k));
    EXPECT_LT(e, test::tol::kTargetTaps) << "batch " << batches;
    EXPECT_GT(e, 0.0) << "the two prefills gave the same bits: is cuDNN on?";
    std::printf("batch %d (%lld documents): cuDNN vs kernels taps, relative error %.3g\n", batches,
                static_cast<long long>(b.n_docs()), e);
    ++batches;
  }
}

TEST(PipelineCuda, SplitStagesComputeWhatTheOneContextBackendComputes) {
  DFLASH_REQUIRE_GPU();
  expect_split_stages_match_one_context(tiny_drafter(), Objective{});
}

// The same for training.objective domino (E 16, G 24, P 1, shift_label): the stage's captured
// graphs read each step's λ from the device, as CudaTrainBackend's.
TEST(PipelineCuda, DominoSplitStagesComputeWhatTheOneContextBackendComputes) {
  DFLASH_REQUIRE_GPU();
  DrafterConfig cfg = tiny_drafter();
  cfg.domino = DominoHead{true, 16, 24, 1, true};
  cfg.validate();
  Objective obj;
  obj.kind = ObjectiveKind::domino;
  obj.domino_shift_label = true;
  expect_split_stages_match_one_context(cfg, obj);
}

// The same for training.objective dflash2 (conv T 2 over groups of 16, selector r 8, top-64):
// the stage's captured graphs read each step's predecessor tokens and α_sel from the device, as
// CudaTrainBackend's.
TEST(PipelineCuda, Dflash2SplitStagesComputeWhatTheOneContextBackendComputes) {
  DFLASH_REQUIRE_GPU();
  DrafterConfig cfg = tiny_drafter();
  cfg.dflash2 = Dflash2Heads{true, 2, 16, 8, 64, 1.0, 0.0};
  cfg.validate();
  Objective obj;
  obj.kind = ObjectiveKind::dflash2;
  expect_split_stages_match_one_context(cfg, obj);
}

TEST(PipelineCuda, TwoReplicasOnOneGpuStayBitIdentical) {
  DFLASH_REQUIRE_GPU();
  test::TempDir tmp;
  TrainOptions o;
  o.config = RunConfig::from_yaml(yaml_for(tmp / "two", "[0, 0]"), "test.yaml");
  EXPECT_EQ(train(o).steps_done, 6);
  const std::string log = test::read_file(tmp / "two" / "log.txt");
  EXPECT_NE(log.find("collective: cuda-local"), std::string::npos) << log;
  EXPECT_NE(log.find("the 2 drafter replicas are bit-identical after step 6"), std::string::npos)
      << log;
  const auto st = read_status(tmp / "two");
  ASSERT_EQ(st["workers"].size(), 3u);
  EXPECT_TRUE(st["workers"][1].contains("memory_used_bytes")) << st.dump();
}

TEST(PipelineCuda, NcclOnTwoGpusGivesTheBitsOfTheInProcessCollective) {
  DFLASH_REQUIRE_GPU();
  if (cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  test::TempDir tmp;
  TrainOptions local;
  local.config = RunConfig::from_yaml(yaml_for(tmp / "local", "[0, 0]"), "test.yaml");
  train(local);
  TrainOptions nccl;
  nccl.config = RunConfig::from_yaml(yaml_for(tmp / "nccl", "[0, 1]"), "test.yaml");
  train(nccl);
  EXPECT_NE(test::read_file(tmp / "nccl" / "log.txt").find("collective: nccl"), std::string::npos);
  EXPECT_EQ(master_bytes(tmp / "local" / "checkpoint-6"),
            master_bytes(tmp / "nccl" / "checkpoint-6"));
}

TEST(PipelineCuda, AnErrorOnAGpuReplicaStopsTheRunNamingItAndLeavesAResumableCheckpoint) {
  DFLASH_REQUIRE_GPU();
  test::TempDir tmp;
  const fs::path dir = tmp / "fault";
  test::write_file(tmp / "run.yaml", yaml_for(dir, "[0, 0]"));
  const pid_t pid = test::spawn_dflash({"train", "--config", (tmp / "run.yaml").string()},
                                       tmp / "log.txt", {"DFLASH_FAULT_INJECT=drafter:1:4:throw"});
  EXPECT_EQ(test::wait_exit(pid, tmp / "log.txt"), 1);
  const std::string log = test::read_file(tmp / "log.txt");
  EXPECT_NE(log.find("drafter1 (cuda:0) failed at step 4: fault injected"), std::string::npos)
      << log;
  EXPECT_TRUE(fs::exists(dir / "checkpoint-3" / "COMPLETE")) << log;
  const auto r = test::run_dflash({"train", "--resume", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir / "checkpoint-6" / "COMPLETE")) << r.err;
}
