// Tests of the device memory plan: the arena packer (core/arena_plan: no two buffers that are live
// in a common phase overlap, the arena is never smaller than the live peak), the step plan at the
// Qwen3-8B reference batch (5-layer drafter, 4 × 2048 tokens, 512 anchors per document, block 16)
// against the 64 GiB target, the largest budget that fits a smaller device, and
// `dflash train --plan` (exit 0 / 1, the shortfall message), and the plans of the MoE families
// (the tiny Qwen3-MoE and gpt-oss goldens): their biases, sinks, router and expert weights, window
// ranges and expert workspace are planned buffers of the sizes TargetCuda takes; the plan of the
// target forward alone at Qwen2.5-32B (`dflash bench --target-only --plan`): it fits 140 GiB with
// the weights of the layers up to the deepest tap, biases included. The pipeline's per-worker
// arenas: a GPU's total is its workers' arenas and cuBLASLt workspaces plus one context, and a
// shared GPU that does not hold them all is refused naming it and its workers. training.recompute:
// auto keeps the drafter's forward activations exactly when that plan fits.
#include "train/memory_plan.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "core/arena_plan.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "model/config.hpp"
#include "model/drafter_io.hpp"
#include "model/presets.hpp"
#include "model/step_plan.hpp"
#include "ops/attention.hpp"
#include "ops/moe.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// Every pair of buffers that share a phase occupies disjoint bytes, and everything is aligned and
// inside the arena.
void expect_no_live_overlap(const ArenaPlan& p) {
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    const PlanBuffer& a = p.buffers[i];
    EXPECT_EQ(a.offset % kArenaAlign, 0u) << a.name;
    EXPECT_LE(a.offset + arena_round(a.bytes), p.arena_bytes) << a.name;
    for (size_t j = i + 1; j < p.buffers.size(); ++j) {
      const PlanBuffer& b = p.buffers[j];
      if ((a.phases & b.phases) == 0 || a.bytes == 0 || b.bytes == 0) continue;
      const bool disjoint = a.offset + arena_round(a.bytes) <= b.offset ||
                            b.offset + arena_round(b.bytes) <= a.offset;
      EXPECT_TRUE(disjoint) << a.name << " and " << b.name << " share a phase and bytes";
    }
  }
  EXPECT_GE(p.arena_bytes, p.live_peak_bytes);
}

// The drafter of the public Qwen3-8B DFlash config.
DrafterConfig qwen3_8b_drafter() {
  const ModelPreset& t = model_preset("qwen3-8b");
  return drafter_config_for_target(t.config, 5, {}, t.mask_token_id,
                                   std::vector<int>{1, 9, 17, 25, 33});
}

// The plan of a 1-layer drafter over `taps` of the tiny target in tests/fixtures/models/`name`, for
// one step of 256 context rows and 32 blocks.
TrainMemoryPlan tiny_family_plan(const std::string& name, const std::vector<int>& taps) {
  const ModelConfig t =
      model_config_load(test::source_dir() / "tests" / "fixtures" / "models" / name);
  const DrafterConfig d = drafter_config_for_target(t, 1, {}, t.vocab_size - 1, taps);
  return plan_train_memory(t, d, DrafterLayout(d), TrainStepCapacity{256, 32}, 1.0);
}

// The planned (unrounded) bytes of buffer `name`; 0 and a test failure when it is not planned.
uint64_t planned(const TrainMemoryPlan& plan, const std::string& name) {
  const PlanBuffer* b = plan.arena.try_find(name);
  EXPECT_NE(b, nullptr) << "no buffer '" << name << "' in the plan";
  return b ? b->bytes : 0;
}

// The sums the plan's table prints are the sums of its buffers.
void expect_totals_add_up(const TrainMemoryPlan& plan) {
  uint64_t groups = 0, unshared = 0;
  for (const std::string& g : plan.arena.groups()) groups += plan.arena.group_bytes(g);
  for (const PlanBuffer& b : plan.arena.buffers) unshared += arena_round(b.bytes);
  EXPECT_EQ(groups, unshared);
  for (size_t ph = 0; ph < plan.arena.live_per_phase.size(); ++ph) {
    uint64_t live = 0;
    for (const PlanBuffer& b : plan.arena.buffers) {
      if (b.phases & (PhaseMask{1} << ph)) live += arena_round(b.bytes);
    }
    EXPECT_EQ(plan.arena.live_per_phase[ph], live) << plan.arena.phase_names[ph];
  }
  EXPECT_EQ(plan.total_bytes(), plan.arena.arena_bytes + plan.context_bytes + plan.cublaslt_bytes);
  expect_no_live_overlap(plan.arena);
}

}  // namespace

TEST(ArenaPlan, BuffersOfDisjointPhasesShareAndOthersNever) {
  ArenaPlanner p({"a", "b", "c"});
  p.add("x", "g", 1000, 0b001);
  p.add("y", "g", 1000, 0b010);  // may share x's bytes
  p.add("z", "h", 100, 0b011);   // may share neither
  const ArenaPlan plan = p.finish();
  expect_no_live_overlap(plan);
  EXPECT_EQ(plan.find("x").offset, plan.find("y").offset);
  EXPECT_EQ(plan.arena_bytes, arena_round(1000) + arena_round(100));
  EXPECT_EQ(plan.live_peak_bytes, plan.arena_bytes);
  EXPECT_EQ(plan.group_bytes("g"), 2 * arena_round(1000));
  EXPECT_EQ(plan.groups(), (std::vector<std::string>{"g", "h"}));
  EXPECT_THROW(plan.find("nope"), Error);
}

TEST(ArenaPlan, RandomPlansNeverOverlapLiveBuffersAndAreDeterministic) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    ArenaPlanner p({"p0", "p1", "p2", "p3", "p4", "p5"});
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      const PhaseMask m = 1 + rng() % 63;
      p.add(fmt::format("b{}", i), "g", rng() % 100000, m);
    }
    const ArenaPlan a = p.finish(), b = p.finish();
    expect_no_live_overlap(a);
    for (size_t i = 0; i < a.buffers.size(); ++i)
      ASSERT_EQ(a.buffers[i].offset, b.buffers[i].offset);
    // Sharing pays: never more than the sum of all buffers.
    uint64_t sum = 0;
    for (const PlanBuffer& x : a.buffers) sum += arena_round(x.bytes);
    EXPECT_LE(a.arena_bytes, sum);
  }
}

TEST(ArenaPlan, RejectsBadBuffers) {
  ArenaPlanner p({"a", "b"});
  p.add("x", "g", 10, 0b01);
  EXPECT_THROW(p.add("x", "g", 10, 0b01), Error);   // twice
  EXPECT_THROW(p.add("y", "g", 10, 0), Error);      // live nowhere
  EXPECT_THROW(p.add("z", "g", 10, 0b100), Error);  // a phase the planner does not have
  EXPECT_THROW(p.add("", "g", 10, 0b01), Error);
}

TEST(MemoryPlan, TheQwen3ReferenceBatchFits64GiB) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  // 4 documents of 2048 tokens in one 8192-token row, 512 anchors each.
  const TrainMemoryPlan plan =
      plan_train_memory(t.config, d, layout, TrainStepCapacity{8192, 2048}, 64.0);
  std::printf("%s\n", plan.table().c_str());
  expect_no_live_overlap(plan.arena);
  EXPECT_EQ(plan.T, 8192);
  EXPECT_EQ(plan.NK, 2048 * 16);
  EXPECT_EQ(plan.target_layers, 34);  // layers after the deepest tap (33) are not uploaded
  EXPECT_TRUE(plan.fits()) << format_bytes(plan.total_bytes());
  EXPECT_LE(plan.total_bytes(), 64 * kGiB);
  // The drafter state is 14 bytes per parameter (fp32 master, m, v; bf16 copy) plus gradients.
  const auto P = static_cast<uint64_t>(layout.total);
  EXPECT_NEAR(static_cast<double>(plan.arena.group_bytes(kGroupDrafterState)),
              static_cast<double>(14 * P), 1e6);
  EXPECT_EQ(plan.arena.group_bytes(kGroupDrafterGrads), arena_round(4 * P));
  // The target's 34 layers and two vocab tables in bf16: about 14.5 GiB.
  EXPECT_NEAR(static_cast<double>(plan.arena.group_bytes(kGroupTargetWeights)) / kGiB, 14.5, 0.1);
  // Sharing by phase is what makes it fit: the buffers unshared would not.
  uint64_t unshared = 0;
  for (const PlanBuffer& b : plan.arena.buffers) unshared += arena_round(b.bytes);
  EXPECT_GT(unshared + plan.context_bytes + plan.cublaslt_bytes, 64 * kGiB);
}

TEST(MemoryPlan, EveryContextTokenAsAnAnchorWouldNotFit64GiB) {
  // Block rows for every context token as an anchor (the first CUDA trainer's capacity): the
  // block budget is what keeps the reference batch under 64 GiB.
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const TrainMemoryPlan plan =
      plan_train_memory(t.config, d, DrafterLayout(d), TrainStepCapacity{8192, 8192}, 64.0);
  EXPECT_FALSE(plan.fits()) << format_bytes(plan.total_bytes());
  EXPECT_EQ(plan.NK, 8192 * 16);
}

TEST(MemoryPlan, LargestFittingBudgetIsTheEdge) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  RunConfig cfg = RunConfig::from_yaml(R"(model:
  target: unused
  drafter_layers: 5
data:
  train_file: unused.jsonl
  max_length: 2048
  token_budget: 8192
runtime:
  device_memory_gib: 48
output_dir: unused
)",
                                       "test.yaml");
  ASSERT_EQ(cfg.block_budget(), 2048);
  EXPECT_FALSE(plan_train_memory(cfg, t.config, d, layout).fits());
  const FittingBudget f = largest_fitting_budget(cfg, t.config, d, layout);
  ASSERT_GT(f.token_budget, 0);
  EXPECT_EQ(f.token_budget % 8, 0);
  EXPECT_LT(f.token_budget, 8192);
  EXPECT_EQ(f.block_budget, (2048 * f.token_budget + 8191) / 8192);
  auto with = [&](int64_t budget) {
    RunConfig c = cfg;
    c.data.token_budget = static_cast<int>(budget);
    c.data.block_budget = static_cast<int>((2048 * budget + 8191) / 8192);
    return plan_train_memory(c, t.config, d, layout);
  };
  EXPECT_TRUE(with(f.token_budget).fits());
  EXPECT_FALSE(with(f.token_budget + 8).fits());
  const std::string msg = plan_shortfall_message(plan_train_memory(cfg, t.config, d, layout), f);
  EXPECT_NE(msg.find(fmt::format("data.token_budget={}", f.token_budget)), std::string::npos)
      << msg;
  // A device too small for the weights alone: nothing fits.
  cfg.runtime.device_memory_gib = 10;
  EXPECT_EQ(largest_fitting_budget(cfg, t.config, d, layout).token_budget, 0);
}

namespace {
// A cuda run of the Qwen3-8B reference batch with the given runtime lines.
// `runtime`: lines of the runtime section; `recompute`: training.recompute.
RunConfig qwen3_8b_run(const std::string& runtime, const std::string& recompute = "auto") {
  return RunConfig::from_yaml(fmt::format(R"(model:
  target: unused
  drafter_layers: 5
data:
  train_file: unused.jsonl
  max_length: 2048
  token_budget: 8192
training:
  recompute: {}
runtime:
  backend: cuda
{}
output_dir: unused
)",
                                          recompute, runtime),
                              "test.yaml");
}
}  // namespace

TEST(PipelineMemoryPlan, WorkersSharingAGpuAddUpWithOneContext) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  const RunConfig cfg = qwen3_8b_run(
      "  target_devices: [0]\n  drafter_devices: [0, 0]\n  colocated: true\n"
      "  device_memory_gib: 139");
  const PipelineMemoryPlan plan = plan_pipeline_memory(cfg, t.config, d, layout);
  std::printf("%s\n", plan.table().c_str());
  ASSERT_EQ(plan.workers.size(), 3u);
  EXPECT_EQ(plan.workers[0].worker, "target0");
  EXPECT_EQ(plan.workers[2].worker, "drafter1");
  EXPECT_EQ(plan.devices(), std::vector<int>{0});
  uint64_t sum = kCudaContextBytes;
  for (const WorkerMemoryPlan& w : plan.workers) {
    expect_no_live_overlap(w.plan.arena);
    sum += w.plan.arena.arena_bytes + kCublasLtWorkspaceBytes + w.plan.cudnn_bytes;
  }
  EXPECT_EQ(plan.device_total(0), sum);
  // runtime.target_prefill's default (cudnn): cuDNN's memory on the target worker only.
  EXPECT_EQ(plan.workers[0].plan.cudnn_bytes, kCudnnPrefillBytes);
  EXPECT_EQ(plan.workers[1].plan.cudnn_bytes, 0u);
  EXPECT_TRUE(plan.fits()) << format_bytes(sum);
  // The target worker: layers up to the deepest tap and a feature pool of 2·(2 + 1) + 1 buffers.
  const TrainMemoryPlan& tw = plan.workers[0].plan;
  EXPECT_EQ(tw.target_layers, 34);
  const uint64_t features = 8192ull * 5 * 4096 * 2;
  EXPECT_EQ(tw.arena.find("taps.pool.6").bytes, features);
  EXPECT_EQ(tw.arena.try_find("taps.pool.7"), nullptr);
  // A drafter worker: no target layer, its own bf16 embedding and (untied) LM head copies.
  const TrainMemoryPlan& dw = plan.workers[1].plan;
  EXPECT_EQ(dw.target_layers, 0);
  EXPECT_EQ(dw.NK, 2048 * 16);
  EXPECT_EQ(dw.arena.find(kDrafterWorkerLmHead).bytes, 151936ull * 4096 * 2);
  EXPECT_EQ(dw.arena.try_find("target.layers.0.wqkv"), nullptr);
  // The single-context plan of the same step is smaller than the two-worker GPU it replaces.
  EXPECT_LT(plan_train_memory(cfg, t.config, d, layout).total_bytes(), sum);
}

TEST(PipelineMemoryPlan, AGpuThatCannotHoldItsWorkersIsNamedWithTheShortfall) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  // Two drafter replicas on GPU 1, the target on GPU 0; each GPU gets 1 GiB less than GPU 1's
  // workers need: GPU 0 fits, GPU 1 does not. The replicas recompute their activations (with
  // training.recompute=auto the plan would switch to recomputing when keeping does not fit).
  const std::string devices = "  target_devices: [0]\n  drafter_devices: [1, 1]\n";
  const uint64_t need =
      plan_pipeline_memory(qwen3_8b_run(devices, "always"), t.config, d, layout).device_total(1);
  // Rounded down to the 6 decimals written: the budget is at most need − 1 GiB (by < 2 KiB), so
  // the shortfall reads 1.00 GiB whatever the plan's total.
  const double gib =
      std::floor(static_cast<double>(need - kGiB) / static_cast<double>(kGiB) * 1e6) / 1e6;
  const RunConfig cfg =
      qwen3_8b_run(devices + fmt::format("  device_memory_gib: {:.6f}", gib), "always");
  const PipelineMemoryPlan plan = plan_pipeline_memory(cfg, t.config, d, layout);
  EXPECT_EQ(plan.device_total(1), need);
  EXPECT_LE(plan.device_total(0), plan.device_bytes);
  EXPECT_GT(plan.device_total(1), plan.device_bytes);
  EXPECT_FALSE(plan.fits());
  const FittingBudget f = largest_fitting_pipeline_budget(cfg, t.config, d, layout);
  ASSERT_GT(f.token_budget, 0);
  EXPECT_LT(f.token_budget, 8192);
  const std::string msg = pipeline_shortfall_message(plan, f);
  EXPECT_NE(msg.find("does not fit GPU 1: its workers drafter0, drafter1 need"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("short by 1.00 GiB"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("GPU 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("data.token_budget={}", f.token_budget)), std::string::npos)
      << msg;
  RunConfig smaller = cfg;
  smaller.data.token_budget = static_cast<int>(f.token_budget);
  smaller.data.block_budget = static_cast<int>(f.block_budget);
  EXPECT_TRUE(plan_pipeline_memory(smaller, t.config, d, layout).fits());
  // One replica on GPU 1 fits where two do not.
  const RunConfig one = qwen3_8b_run("  target_devices: [0]\n  drafter_devices: [1]\n" +
                                     fmt::format("  device_memory_gib: {:.6f}", gib));
  EXPECT_TRUE(plan_pipeline_memory(one, t.config, d, layout).fits());
}

// runtime.target_prefill: cuDNN's handle, kernels and workspace (kCudnnPrefillBytes) are planned
// beside the arena of every plan that holds the target when the prefill runs on cuDNN, and
// nowhere with the kernels; an unknown value is an error naming the key.
TEST(PipelineMemoryPlan, TheCudnnPrefillIsPlannedWhereTheTargetRuns) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  const std::string devices = "  target_devices: [0]\n  drafter_devices: [1]\n";
  const RunConfig cudnn = qwen3_8b_run(devices);
  const RunConfig kernels = qwen3_8b_run(devices + "  target_prefill: kernels\n");
  EXPECT_EQ(cudnn.runtime.target_prefill, "cudnn");
  const PipelineMemoryPlan pc = plan_pipeline_memory(cudnn, t.config, d, layout);
  const PipelineMemoryPlan pk = plan_pipeline_memory(kernels, t.config, d, layout);
  EXPECT_EQ(pc.device_total(0), pk.device_total(0) + kCudnnPrefillBytes);
  EXPECT_EQ(pc.device_total(1), pk.device_total(1));
  EXPECT_NE(pc.table().find("cuDNN causal prefill"), std::string::npos) << pc.table();
  EXPECT_EQ(pk.table().find("cuDNN causal prefill"), std::string::npos) << pk.table();
  EXPECT_EQ(plan_train_memory(cudnn, t.config, d, layout).total_bytes(),
            plan_train_memory(kernels, t.config, d, layout).total_bytes() + kCudnnPrefillBytes);
  try {
    (void)qwen3_8b_run(devices + "  target_prefill: flash\n");
    ADD_FAILURE() << "runtime.target_prefill: flash was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("runtime.target_prefill must be cudnn or kernels"),
              std::string::npos)
        << e.what();
  }
}

// training.recompute: auto keeps the drafter's forward activations when that plan fits and
// recomputes them when it does not; always and never do not look at the budget. The plan that
// keeps them has each layer's kvin, q, k, hn2 and act of its own (and no shared layer scratch).
TEST(MemoryPlan, RecomputeAutoKeepsActivationsWhenThePlanFits) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  const std::string one_gpu = "  devices: [0]";
  const TrainMemoryPlan keep =
      plan_train_memory(qwen3_8b_run(one_gpu, "never"), t.config, d, layout);
  const TrainMemoryPlan recompute =
      plan_train_memory(qwen3_8b_run(one_gpu, "always"), t.config, d, layout);
  ASSERT_EQ(keep.activations, DrafterActivations::keep);
  ASSERT_EQ(recompute.activations, DrafterActivations::recompute);
  expect_no_live_overlap(keep.arena);
  EXPECT_EQ(keep.arena.try_find("drafter.act"), nullptr);
  EXPECT_EQ(keep.arena.try_find("drafter.kvin"), nullptr);
  EXPECT_EQ(recompute.arena.try_find("drafter.layers.4.act"), nullptr);
  // Per layer: kvin [TK, H], q [NK, QD], k [TK, KD], hn2 [NK, H], act [NK, I], bf16.
  const uint64_t T = 8192, NK = 2048 * 16, TK = T + NK, H = 4096, QD = 32 * 128, KD = 8 * 128;
  const uint64_t I = 12288;
  EXPECT_EQ(planned(keep, "drafter.layers.4.kvin"), TK * H * 2);
  EXPECT_EQ(planned(keep, "drafter.layers.4.q"), NK * QD * 2);
  EXPECT_EQ(planned(keep, "drafter.layers.4.k"), TK * KD * 2);
  EXPECT_EQ(planned(keep, "drafter.layers.4.hn2"), NK * H * 2);
  EXPECT_EQ(planned(keep, "drafter.layers.4.act"), NK * I * 2);
  const uint64_t per_layer = (TK * H + NK * QD + TK * KD + NK * H + NK * I) * 2;
  EXPECT_EQ(keep.arena.group_bytes(kGroupSaved),
            recompute.arena.group_bytes(kGroupSaved) + 5 * per_layer);
  EXPECT_EQ(keep.arena.group_bytes(kGroupLayerScratch), 0u);
  EXPECT_GT(keep.total_bytes(), recompute.total_bytes());
  std::printf("keep %s, recompute %s\n", format_bytes(keep.total_bytes()).c_str(),
              format_bytes(recompute.total_bytes()).c_str());

  // auto on 139 GiB: keeping fits, and the table says so.
  const TrainMemoryPlan roomy = plan_train_memory(qwen3_8b_run(one_gpu), t.config, d, layout);
  EXPECT_EQ(roomy.activations, DrafterActivations::keep);
  EXPECT_EQ(roomy.total_bytes(), keep.total_bytes());
  EXPECT_NE(roomy.table().find("drafter backward: keeps the forward's activations "
                               "(training.recompute=auto: the plan that keeps them fits)"),
            std::string::npos)
      << roomy.table();
  // auto on a budget between the two: recompute, and it fits; never keeps and does not fit.
  const double gib = static_cast<double>(keep.total_bytes() - kGiB) / static_cast<double>(kGiB);
  const std::string tight = one_gpu + fmt::format("\n  device_memory_gib: {:.6f}", gib);
  const TrainMemoryPlan fallback = plan_train_memory(qwen3_8b_run(tight), t.config, d, layout);
  EXPECT_EQ(fallback.activations, DrafterActivations::recompute);
  EXPECT_TRUE(fallback.fits());
  EXPECT_NE(fallback.table().find("recomputes the forward's activations (training.recompute=auto: "
                                  "the plan that keeps them does not fit)"),
            std::string::npos)
      << fallback.table();
  const TrainMemoryPlan never =
      plan_train_memory(qwen3_8b_run(tight, "never"), t.config, d, layout);
  EXPECT_EQ(never.activations, DrafterActivations::keep);
  EXPECT_FALSE(never.fits());
  // The pipeline plan chooses the same way for its drafter workers.
  const PipelineMemoryPlan pipe = plan_pipeline_memory(qwen3_8b_run(one_gpu), t.config, d, layout);
  EXPECT_EQ(pipe.activations, DrafterActivations::keep);
  EXPECT_NE(pipe.workers.back().plan.arena.try_find("drafter.layers.0.q"), nullptr);
  EXPECT_EQ(plan_pipeline_memory(qwen3_8b_run(tight), t.config, d, layout).activations,
            DrafterActivations::recompute);
  // A value other than the three is refused naming the key.
  try {
    qwen3_8b_run(one_gpu, "sometimes");
    ADD_FAILURE() << "training.recompute=sometimes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("training.recompute must be auto, always or never"),
              std::string::npos)
        << e.what();
  }
}

TEST(MemoryPlan, TrainPlanCommandExitsZeroWhenItFitsAndOneWithTheShortfall) {
  const test::TempDir tmp;
  const fs::path dir = tmp.path();
  fs::create_directories(dir / "target");
  const ModelPreset& t = model_preset("qwen3-8b");
  write_file_atomic(dir / "target" / "config.json", R"({
      "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
      "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
      "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": false})");
  const std::string yaml =
      fmt::format(R"(model:
  target: {}
  drafter_layers: 5
  mask_token_id: {}
  target_layer_ids: [1, 9, 17, 25, 33]
data:
  train_file: unused.jsonl
  max_length: 2048
  token_budget: 8192
training:
  num_anchors: 512
runtime:
  backend: cuda
output_dir: {}
)",
                  (dir / "target").string(), t.mask_token_id, (dir / "run").string());
  write_file_atomic(dir / "run.yaml", yaml);
  const std::string config = (dir / "run.yaml").string();
  const test::RunResult ok = test::run_dflash({"train", "--config", config, "--plan"});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("fits"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("arena"), std::string::npos) << ok.out;
  const test::RunResult no =
      test::run_dflash({"train", "--config", config, "--plan", "runtime.device_memory_gib=40"});
  EXPECT_EQ(no.exit_code, 1) << no.out << no.err;
  EXPECT_NE(no.err.find("largest token budget that fits is data.token_budget="), std::string::npos)
      << no.err;
  EXPECT_FALSE(fs::exists(dir / "run")) << "--plan must not create the run directory";
}

TEST(ArenaPlan, WithoutSharingEveryBufferHasItsOwnBytes) {
  ArenaPlanner p({"a", "b"});
  p.add("x", "g", 1000, 0b01);
  p.add("y", "g", 3000, 0b10);
  const ArenaPlan shared = p.finish();
  const ArenaPlan own = arena_plan_without_sharing(shared);
  EXPECT_EQ(shared.find("x").offset, shared.find("y").offset);
  EXPECT_NE(own.find("x").offset, own.find("y").offset);
  EXPECT_EQ(own.arena_bytes, arena_round(1000) + arena_round(3000));
  EXPECT_EQ(own.find("y").bytes, 3000u);
}

TEST(MemoryPlan, GptOssTargetPlansBiasesSinksExpertsAndWindows) {
  // tests/fixtures/models/gpt-oss: H 64, 4 heads and 1 KV head of 64, V 512 untied, 3 layers (all
  // sparse; sliding, full, sliding), 8 experts of width 16, top-2, every bias.
  const TrainMemoryPlan plan = tiny_family_plan("gpt-oss", {0, 1});
  SCOPED_TRACE(plan.table());
  EXPECT_EQ(plan.target_layers, 2);
  EXPECT_EQ(plan.arena.try_find("target.layers.2.wqkv"), nullptr)
      << "layer 2 is past the deepest tap";
  EXPECT_EQ(planned(plan, "target.lm_head"), 512u * 64 * 2);
  for (const char* l : {"target.layers.0.", "target.layers.1."}) {
    const std::string n = l;
    EXPECT_EQ(planned(plan, n + "bqkv"), (256u + 2 * 64) * 4);
    EXPECT_EQ(planned(plan, n + "bo"), 64u * 4);
    EXPECT_EQ(planned(plan, n + "sinks"), 4u * 4);
    EXPECT_EQ(planned(plan, n + "moe.router"), 8u * 64 * 2);
    EXPECT_EQ(planned(plan, n + "moe.router_bias"), 8u * 4);
    EXPECT_EQ(planned(plan, n + "moe.wgu"), 8u * 2 * 16 * 64 * 2);
    EXPECT_EQ(planned(plan, n + "moe.wdown"), 8u * 64 * 16 * 2);
    EXPECT_EQ(planned(plan, n + "moe.gu_ptrs"), 8u * sizeof(void*));
    EXPECT_EQ(planned(plan, n + "moe.down_ptrs"), 8u * sizeof(void*));
    EXPECT_EQ(planned(plan, n + "moe.gate_bias"), 8u * 16 * 4);
    EXPECT_EQ(planned(plan, n + "moe.up_bias"), 8u * 16 * 4);
    EXPECT_EQ(planned(plan, n + "moe.down_bias"), 8u * 64 * 4);
    EXPECT_EQ(plan.arena.try_find(n + "wgu"), nullptr) << "a sparse layer has no dense MLP";
  }
  // Activations of 256 tokens: the window ranges and the expert workspace over 512 routed rows;
  // no dense MLP buffers.
  EXPECT_EQ(planned(plan, "target.act.win"), 256u * sizeof(AttnRange));
  EXPECT_EQ(planned(plan, "target.act.moe.logits"), 256u * 8 * 4);
  EXPECT_EQ(planned(plan, "target.act.moe.offsets"), 9u * 4);
  EXPECT_EQ(planned(plan, "target.act.moe.xs"), 512u * 64 * 2);
  EXPECT_EQ(planned(plan, "target.act.moe.gu"), 512u * 32 * 2);
  EXPECT_EQ(planned(plan, "target.act.moe.ys"), 512u * 64 * 4);
  EXPECT_EQ(plan.arena.try_find("target.act.gu"), nullptr);
  EXPECT_GE(planned(plan, "workspace.op_scratch"), moe_dispatch_cuda_scratch_bytes(8));
  // Target weights in all: 2 vocab tables, inv_freq, 2 layers of 22 buffers, each rounded.
  const uint64_t layer = arena_round(32768) * 2 + arena_round(8192) * 2 + arena_round(1024) +
                         arena_round(256) * 5 + arena_round(16) + arena_round(1024) +
                         arena_round(32) + arena_round(32768) + arena_round(16384) +
                         arena_round(64) * 2 + arena_round(512) * 2 + arena_round(2048);
  EXPECT_EQ(plan.arena.group_bytes(kGroupTargetWeights),
            2 * arena_round(65536) + arena_round(128) + 2 * layer);
  expect_totals_add_up(plan);
}

TEST(MemoryPlan, Qwen3MoeTargetPlansOnlyTheLayerKindsItRuns) {
  // tests/fixtures/models/qwen3-moe: layers 0 and 1 sparse (8 experts of width 16, top-2), layer
  // 2 dense (mlp_only_layers, intermediate 96), tied embeddings, q/k norms, no biases or windows.
  const TrainMemoryPlan all = tiny_family_plan("qwen3-moe", {0, 2});
  SCOPED_TRACE(all.table());
  EXPECT_EQ(all.target_layers, 3);
  EXPECT_EQ(all.arena.try_find("target.lm_head"), nullptr) << "tied";
  EXPECT_EQ(planned(all, "target.layers.0.moe.wgu"), 8u * 2 * 16 * 64 * 2);
  EXPECT_EQ(planned(all, "target.layers.1.moe.router"), 8u * 64 * 2);
  EXPECT_EQ(all.arena.try_find("target.layers.0.moe.router_bias"), nullptr);
  EXPECT_EQ(all.arena.try_find("target.layers.0.moe.gate_bias"), nullptr);
  EXPECT_EQ(all.arena.try_find("target.layers.0.sinks"), nullptr);
  EXPECT_EQ(all.arena.try_find("target.layers.0.bq"), nullptr);
  EXPECT_EQ(planned(all, "target.layers.2.wgu"), 2u * 96 * 64 * 2);
  EXPECT_EQ(planned(all, "target.layers.2.wdown"), 64u * 96 * 2);
  EXPECT_EQ(all.arena.try_find("target.layers.2.moe.wgu"), nullptr);
  EXPECT_EQ(planned(all, "target.act.gu"), 256u * 2 * 96 * 2);
  EXPECT_EQ(planned(all, "target.act.moe.act"), 512u * 16 * 2);
  EXPECT_EQ(all.arena.try_find("target.act.win"), nullptr);
  expect_totals_add_up(all);
  // Taps up to layer 1 run sparse layers only: no dense MLP weights or activations.
  const TrainMemoryPlan sparse = tiny_family_plan("qwen3-moe", {0, 1});
  EXPECT_EQ(sparse.target_layers, 2);
  EXPECT_EQ(sparse.arena.try_find("target.layers.2.wgu"), nullptr);
  EXPECT_EQ(sparse.arena.try_find("target.act.gu"), nullptr);
  EXPECT_EQ(planned(sparse, "target.act.moe.ys"), 512u * 64 * 4);
  expect_totals_add_up(sparse);
}

TEST(MemoryPlan, Qwen25_32bTargetForwardFits140GiB) {
  // `dflash bench --preset qwen2.5-32b --target-only`: the taps of a 5-layer drafter's default
  // spread over 64 layers, 8192 tokens (4 documents of 2048), on a 140 GiB H200.
  const ModelPreset& t = model_preset("qwen2.5-32b");
  const ModelConfig& c = t.config;
  ASSERT_TRUE(c.attention_bias);
  ASSERT_FALSE(c.o_proj_bias);
  ASSERT_FALSE(c.tie_word_embeddings);
  const std::vector<int> taps = default_target_layer_ids(64, 5);
  EXPECT_EQ(taps, (std::vector<int>{1, 16, 31, 46, 61}));
  const TrainMemoryPlan plan = plan_target_forward_memory(c, taps, 8192, 140.0);
  SCOPED_TRACE(plan.table());
  EXPECT_TRUE(plan.fits()) << format_bytes(plan.total_bytes());
  EXPECT_EQ(plan.target_layers, 62);
  EXPECT_EQ(plan.NK, 0);
  EXPECT_EQ(plan.arena.phase_names, std::vector<std::string>{"target"});
  // Weights, counted here from the published sizes (H 5120, I 27648, 40 heads and 8 KV heads of
  // 128, V 152064): bf16 matrices, f32 q/k/v biases and norms. Every size is a multiple of 256.
  const uint64_t H = 5120, I = 27648, QD = 40 * 128, KD = 8 * 128, V = 152064;
  const uint64_t matrices = (QD * H + 2 * KD * H + H * QD + 2 * I * H + H * I) * 2;
  const uint64_t vectors = (QD + 2 * KD + 2 * H) * 4;
  const uint64_t weights = 2 * V * H * 2 + 64 * 4 + 62 * (matrices + vectors);
  EXPECT_EQ(plan.arena.group_bytes(kGroupTargetWeights), weights);
  EXPECT_NEAR(static_cast<double>(weights) / kGiB, 59.2, 0.05);
  EXPECT_EQ(planned(plan, "target.layers.61.bqkv"), (QD + 2 * KD) * 4);
  EXPECT_EQ(plan.arena.try_find("target.layers.61.bo"), nullptr) << "Qwen2's o_proj has no bias";
  EXPECT_EQ(plan.arena.try_find("target.layers.62.wqkv"), nullptr) << "past the deepest tap";
  EXPECT_EQ(plan.arena.try_find("drafter.features"), nullptr) << "no drafter";
  EXPECT_EQ(planned(plan, kTargetOnlyFeatures), 8192u * 5 * H * 2);
  EXPECT_EQ(planned(plan, "target.act.gu"), 8192u * 2 * I * 2);
  EXPECT_EQ(planned(plan, "inputs.pos"), 8192u * 4);
  // One phase: everything is live at once, so the arena is the sum of the buffers.
  EXPECT_EQ(plan.arena.arena_bytes, plan.arena.live_peak_bytes);
  expect_totals_add_up(plan);
  EXPECT_LT(plan.total_bytes(), 66 * kGiB);
  // Not every layer: the full 64 would need two more.
  EXPECT_GT(plan_target_forward_memory(c, {63}, 8192, 140.0).arena.group_bytes(kGroupTargetWeights),
            weights + matrices);
  EXPECT_THROW(plan_target_forward_memory(c, {64}, 8192, 140.0), Error);
  EXPECT_THROW(plan_target_forward_memory(c, taps, 0, 140.0), Error);
}

TEST(MemoryPlan, BenchTargetOnlyPlanCommandExitsZeroWhenItFitsAndOneWithTheShortfall) {
  const test::RunResult ok =
      test::run_dflash({"bench", "--preset", "qwen2.5-32b", "--target-only", "--plan"});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("taps [1, 16, 31, 46, 61]"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("target forward only, 62 target layers uploaded"), std::string::npos)
      << ok.out;
  EXPECT_NE(ok.out.find(": fits"), std::string::npos) << ok.out;
  EXPECT_EQ(ok.out.find("drafter."), std::string::npos) << ok.out;
  const test::RunResult no = test::run_dflash(
      {"bench", "--preset", "qwen2.5-32b", "--target-only", "--plan", "--device-memory-gib", "40"});
  EXPECT_EQ(no.exit_code, 1) << no.out << no.err;
  EXPECT_NE(no.err.find("the target forward does not fit the device"), std::string::npos) << no.err;
  EXPECT_NE(no.err.find("no token budget fits (the target weights alone"), std::string::npos)
      << no.err;
}

// `dflash bench --objective dflash2 --plan`: the recipes' sizes fit the reference batch, with the
// dflash base or a D-PACE one; a size out of range and a --dflash2-* option without --objective
// dflash2 are refused by name.
TEST(MemoryPlan, BenchPlansDflash2AndRefusesItsOptionsElsewhere) {
  const test::RunResult ok = test::run_dflash({"bench", "--objective", "dflash2", "--plan"});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find(": fits"), std::string::npos) << ok.out;
  // Its base takes a D-PACE loss (the selector weighted alike).
  const test::RunResult dpace = test::run_dflash({"bench", "--objective", "dflash2", "--loss-type",
                                                  "dpace", "--dpace-alpha", "0.3", "--plan"});
  EXPECT_EQ(dpace.exit_code, 0) << dpace.out << dpace.err;
  EXPECT_NE(dpace.out.find(": fits"), std::string::npos) << dpace.out;
  const test::RunResult group = test::run_dflash(
      {"bench", "--objective", "dflash2", "--dflash2-conv-group-size", "7", "--plan"});
  EXPECT_EQ(group.exit_code, 1) << group.out << group.err;
  EXPECT_NE(group.err.find("conv_group_size 7 must be >= 1 and divide hidden_size 4096"),
            std::string::npos)
      << group.err;
  const test::RunResult stray = test::run_dflash(
      {"bench", "--objective", "domino", "--dflash2-selector-rank", "8", "--plan"});
  EXPECT_EQ(stray.exit_code, 1) << stray.out << stray.err;
  EXPECT_NE(stray.err.find("--dflash2-* options apply only to --objective dflash2 (got "
                           "--objective domino)"),
            std::string::npos)
      << stray.err;
  // An option given at its default value is still given: refused the same way.
  const test::RunResult stray_default =
      test::run_dflash({"bench", "--dflash2-conv-group-size", "16", "--plan"});
  EXPECT_EQ(stray_default.exit_code, 1) << stray_default.out << stray_default.err;
  EXPECT_NE(stray_default.err.find("--dflash2-* options apply only to --objective dflash2 (got "
                                   "--objective dflash)"),
            std::string::npos)
      << stray_default.err;
}

TEST(PipelineMemoryPlan, GpusHoldingANcclRankPlanItsReserve) {
  const ModelPreset& t = model_preset("qwen3-8b");
  const DrafterConfig d = qwen3_8b_drafter();
  const DrafterLayout layout(d);
  // Replicas on GPUs of their own all-reduce through NCCL: each of their GPUs plans the reserve,
  // the target's GPU does not.
  const PipelineMemoryPlan nccl = plan_pipeline_memory(
      qwen3_8b_run("  target_devices: [0]\n  drafter_devices: [1, 2]\n"), t.config, d, layout);
  EXPECT_EQ(nccl.nccl_devices, (std::vector<int>{1, 2}));
  uint64_t gpu1 = kCudaContextBytes + kNcclReserveBytes;
  for (const WorkerMemoryPlan& w : nccl.workers) {
    if (w.device == 1) gpu1 += w.plan.arena.arena_bytes + kCublasLtWorkspaceBytes;
  }
  EXPECT_EQ(nccl.device_total(1), gpu1);
  EXPECT_EQ(nccl.device_total(0), kCudaContextBytes + nccl.workers[0].plan.arena.arena_bytes +
                                      kCublasLtWorkspaceBytes + kCudnnPrefillBytes);
  EXPECT_NE(nccl.table().find(
                "GPU 2: drafter1 (arenas, cuBLASLt workspaces, cuDNN prefills) + CUDA context "
                "529.0 MiB + NCCL 1.50 GiB (estimate)"),
            std::string::npos)
      << nccl.table();
  // Replicas sharing a GPU use the in-process collective (no NCCL), one replica none at all.
  EXPECT_TRUE(
      plan_pipeline_memory(qwen3_8b_run("  target_devices: [0]\n  drafter_devices: [1, 1]\n"),
                           t.config, d, layout)
          .nccl_devices.empty());
  EXPECT_TRUE(plan_pipeline_memory(qwen3_8b_run("  target_devices: [0]\n  drafter_devices: [1]\n"),
                                   t.config, d, layout)
                  .nccl_devices.empty());
}

TEST(MemoryPlan, TrainPlanCommandNamesWhatTheCudaKernelsCannotRun) {
  const test::TempDir tmp;
  const fs::path dir = tmp.path();
  fs::create_directories(dir / "target");
  // A Gemma-like head_dim of 256: the plan would fit, the CUDA attention cannot run it.
  write_file_atomic(dir / "target" / "config.json", R"({
      "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
      "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
      "head_dim": 256, "vocab_size": 32000, "max_position_embeddings": 40960,
      "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": false})");
  write_file_atomic(dir / "run.yaml",
                    fmt::format(R"(model:
  target: {}
  drafter_layers: 1
  mask_token_id: 7
  target_layer_ids: [1, 5]
data:
  train_file: unused.jsonl
  max_length: 1024
  token_budget: 1024
training:
  num_anchors: 64
runtime:
  backend: cuda
output_dir: {}
)",
                                (dir / "target").string(), (dir / "run").string()));
  const std::string config = (dir / "run.yaml").string();
  const test::RunResult r = test::run_dflash({"train", "--config", config, "--plan"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("the CUDA backend cannot run this model: the CUDA attention supports "
                       "head_dim 64 or 128"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("head_dim 256"), std::string::npos) << r.err;
  // The drafter inherits head_dim 256 from the target: named too.
  EXPECT_NE(r.err.find("the CUDA drafter supports head_dim 64 or 128 (drafter head_dim 256)"),
            std::string::npos)
      << r.err;
  // A drafter of head_dim 128 on that target still cannot run: the target's forward can't.
  const test::RunResult d =
      test::run_dflash({"train", "--config", config, "--plan", "model.head_dim=128"});
  EXPECT_EQ(d.exit_code, 1) << d.out << d.err;
  EXPECT_EQ(d.err.find("CUDA drafter"), std::string::npos) << d.err;
}
