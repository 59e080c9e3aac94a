// dflash.cpp — `dflash bench` (DESIGN.md §2): the training step's hot paths at real model shapes
// with random weights made on the device (no checkpoint), timed phase by phase, plus the hot
// kernels alone, each against its floor.
//
// The step is the training step of train/cuda_train.cpp: the same memory plan and arena, the same
// TargetCuda / DrafterCuda calls, inputs staged from pinned buffers, results read back, AdamW; its
// batch has rows of `token_budget` tokens holding documents of `doc_length` tokens (loss mask 1
// everywhere, so a document of n tokens has n − 1 candidate anchors), with fresh anchors every
// step. Phases are timed with device events around each (graphs off), and the whole step with
// graphs off and on. Host time is the step's wall time minus its device time: what the host does
// between device work (packing, staging, waiting for read-backs).
//
// With --target-only it times the target's tap forward alone (what a target worker runs), in the
// plan of that forward alone (plan_target_forward_memory: weights up to the deepest tap of the
// drafter's taps, activations, the tap features, inputs), so a 32B target fits one H200; its
// figures are printed as tools/hf_target_forward.py prints the HF forward's.
//
// The kernel rows time the DFlash attention families, the causal prefill of every family and of
// cuDNN (ops/attention_cudnn.hpp), one dense target layer op by op ("target ..."), the fused CE
// (or the DSpark head) and AdamW. --prefill cudnn runs the target forward's prefill on cuDNN.
//
// FLOP counts: model/step_plan.hpp (drafter_step_flops, target_forward_flops); rates are against
// 825 TFLOP/s (cuBLASLt bf16 8192³ on the H200, DESIGN.md §4) and bytes against 4.3 TB/s.
// Invariants: every figure not measured stays NaN and is printed as "-", never as 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/drafter.hpp"
#include "train/memory_plan.hpp"

namespace dflash {

/// Ceilings the figures are compared with (DESIGN.md §4, measured on the H200 here).
inline constexpr double kPeakBf16Flops = 825e12;
inline constexpr double kPeakCopyBytesPerS = 4.3e12;

/// What `dflash bench` runs. Defaults: the reference batch (Qwen3-8B, 5-layer drafter, one row of
/// 4 × 2048 tokens, 512 anchors per document, block 16).
struct BenchOptions {
  std::string preset = "qwen3-8b";  ///< a model/presets.hpp name (ignored with config_json)
  std::string config_json;          ///< an HF config.json (file or folder) instead of a preset
  int drafter_layers = 5;
  int64_t token_budget = 8192;  ///< tokens per row
  int64_t rows = 1;             ///< rows per step
  int64_t doc_length = 2048;    ///< tokens per document (token_budget / doc_length per row)
  int anchors = 512;            ///< per document
  int block_size = 16;
  std::optional<int> mask_token_id;  ///< default: the preset's (required with config_json)
  int warmup = 3, steps = 10;        ///< per graph mode; figures are medians over `steps`
  int kernel_reps = 10;              ///< timed runs of each kernel (after 2 warm-up runs)
  int device = 0;
  double device_memory_gib = 139.0;
  bool graphs_off = true, graphs_on = true;  ///< which step modes to time
  bool target_only = false;  ///< time the target's tap forward alone (no drafter, no kernels)
  /// The drafter backward's activations, as training.recompute: auto (keep them when the plan
  /// with them fits device_memory_gib), always (recompute), never (keep).
  std::string recompute = "auto";
  /// The loss, as training.loss_type and training.dpace_alpha (OBJECTIVES.md §1.1): dflash weighs
  /// slots by γ = 7 decay and divides by Σw; the D-PACE losses weigh them by the step's own CE and
  /// divide by the documents.
  Objective objective;
  /// objective dspark: the Markov head's rank r and type, as training.markov_rank and
  /// training.markov_head_type; the confidence head is on when objective.dspark_conf_alpha > 0.
  int markov_rank = 32;
  MarkovHeadType markov_type = MarkovHeadType::vanilla;
  /// objective domino: the head's sizes, as training.emb_dim, gru_hidden_dim,
  /// pure_draft_prefix_len and shift_label (defaults: SpecForge's example Domino config).
  int64_t domino_emb_dim = 256, domino_gru_dim = 1024;
  int domino_prefix_len = 1;
  bool domino_shift_label = true;
  /// objective dflash2: the conv's taps and group width and the selector's rank and candidates,
  /// as training.conv_kernel_size, conv_group_size, selector_rank and selector_top_k (defaults:
  /// the public recipes'), ū = U (output_multiplier 1, no softcap); α_sel is
  /// objective.dflash2_selector_alpha (the same kernels run at every α, so the step's cost does
  /// not depend on it).
  int dflash2_conv_kernel_size = 2, dflash2_conv_group_size = 16;
  int dflash2_selector_rank = 256, dflash2_selector_top_k = 16;
  uint64_t seed = 0;
  /// Where new cuBLASLt GEMM plans come from (backend/cuda/gemm.hpp, GemmPlanSource): "table"
  /// (the measured table, the heuristic for shapes it lacks) or "heuristic" (the table ignored).
  std::string gemm_plans = "table";
  /// The target's causal prefill, as runtime.target_prefill: "cudnn" (TargetCuda's cuDNN graph of
  /// the power-of-two bucket of the bench step's documents, rows of --token-budget; the plan holds
  /// kCudnnPrefillBytes) or "kernels" (attention_fwd_cuda's automatic family).
  std::string prefill = "cudnn";
};

/// The shapes of a bench run.
struct BenchSetup {
  std::string model_name;  ///< preset name or config path
  ModelConfig target;
  DrafterConfig drafter;
  int64_t docs_per_row = 0, blocks = 0, tokens = 0;  ///< real documents, blocks, tokens per step
  TrainStepCapacity capacity;
};

/// Resolves the options into shapes; throws dflash::Error naming the bad option.
BenchSetup bench_setup(const BenchOptions& o);
/// The memory plan of the bench step (the training plan of its shapes; with target_only the plan of
/// the target forward alone over rows · token_budget tokens, plan_target_forward_memory).
TrainMemoryPlan bench_plan(const BenchSetup& s, const BenchOptions& o);
/// "does not fit ...; the largest token budget that fits is --token-budget=B with N blocks per
/// row" for a bench whose plan does not fit.
std::string bench_shortfall_message(const BenchSetup& s, const BenchOptions& o);

/// One timed phase of the step (graphs off) or the whole step.
struct BenchPhase {
  std::string name;
  double ms = NAN;   ///< median device time
  double flops = 0;  ///< FLOPs counted for it (0: not compute-bound, see bytes)
  double bytes = 0;  ///< bytes it must move (optimizer), 0 otherwise
};
/// One kernel timed alone.
struct BenchKernel {
  std::string name, shape;
  double ms = NAN;      ///< median
  double flops = 0;     ///< useful FLOPs (visible keys only for attention)
  double floor_ms = 0;  ///< flops / kPeakBf16Flops
};
/// One cuBLASLt GEMM plan of the bench's context after the timed steps: its key
/// (gemm_shape_key_string) and where its algorithm came from (GemmPlan::source).
struct BenchGemmPlan {
  std::string shape, source;
};
/// Everything `dflash bench` measured.
struct BenchReport {
  std::string header;              ///< model, shapes, device
  bool target_only = false;        ///< phases hold the target forward alone (graphs off)
  int64_t documents = 0;           ///< documents per step (each attends only to itself)
  int64_t doc_length = 0;          ///< tokens per document
  int steps = 0;                   ///< timed steps (or forwards) per graph mode
  std::vector<BenchPhase> phases;  ///< graphs off
  double host_ms_off = NAN;        ///< median wall − device time per step, graphs off
  double host_pack_ms = NAN;       ///< of which: anchors, block targets, staging (graphs off)
  double host_stage_ms = NAN;      ///< of which: copies into the pinned input buffers
  double step_ms_off = NAN, device_ms_off = NAN;  ///< medians: wall and device time per step
  double host_ms_on = NAN, step_ms_on = NAN, device_ms_on = NAN;
  std::vector<BenchKernel> kernels;
  int64_t tokens_per_step = 0;
  /// The drafter backward's activations: "keep" or "recompute" ("" with --target-only).
  std::string activations;
  std::string loss_type;  ///< the timed step's loss (loss_type_name; "" with --target-only)
  double planned_bytes = NAN, arena_bytes = NAN;  ///< the plan's total and arena
  double context_bytes = NAN;  ///< measured: device memory in use after context creation
  double used_bytes = NAN;     ///< measured: device memory in use after the steps (cudaMemGetInfo)
  std::string gemm_plan_source;           ///< BenchOptions::gemm_plans
  std::vector<BenchGemmPlan> gemm_plans;  ///< the step's GEMM plans, sorted by shape
};

/// Runs the bench on the GPU (CUDA builds only; otherwise throws dflash::Error).
BenchReport run_bench(const BenchOptions& o);
/// The human-readable table.
std::string bench_table(const BenchReport& r);
/// The JSON form (NaN figures as null).
nlohmann::json bench_json(const BenchReport& r);

}  // namespace dflash
