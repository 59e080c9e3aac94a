// dflash.cpp — the device memory plan of `dflash train` on one GPU (issue: real scale), computed
// before anything is allocated: one arena holding the target's weights (layers up to the deepest
// tap), its tap-forward activations, the drafter's state, activations and workspaces, the op
// scratch pool and the step inputs (model/step_plan.hpp), plus what the CUDA runtime takes beside
// it (context and library handles, the cuBLASLt workspace). The CUDA backend allocates exactly the
// arena of this plan and takes every buffer from it by name, so the arena figure is the
// allocation; the context figure is a measurement (see kCudaContextBytes).
//
// Invariants: a pure function of (target config, drafter config, step capacity, options); no
// device is touched. `fits()` compares the total with runtime.device_memory_gib.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/arena_plan.hpp"
#include "model/config.hpp"
#include "model/drafter.hpp"
#include "model/step_plan.hpp"
#include "train/run_config.hpp"
#include "train/topology.hpp"

namespace dflash {

/// Blocks of a staged step are padded to a multiple of this many (CudaTrainBackend), so that
/// few shapes occur.
inline constexpr int64_t kBlockRowsMultiple = 64;
/// Device memory the CUDA context, the cuBLASLt handle and the kernels' modules take beside our
/// allocations: measured on the H200 (driver 580.159.04, CUDA 13.0) on 2026-12-01 as 560.8 MiB in
/// use after CudaContext creation, of which 32 MiB are the cuBLASLt workspace below. The train log
/// prints the value measured at start.
inline constexpr uint64_t kCudaContextBytes = uint64_t{529} << 20;
/// Device memory NCCL takes on the GPU of each rank beside our allocations (channel buffers for the
/// Simple, LL and LL128 protocols per channel and ring/tree peer, work FIFOs, proxy state). An
/// ESTIMATE, not a measurement: NCCL_BUFFSIZE's 4 MiB Simple buffer plus about 5 MiB of LL/LL128
/// buffers per channel and peer, 2 peers, up to 32 channels on NVLink, rounded up to 1.5 GiB; no
/// machine with two GPUs has been lent to measure it (the train log prints the device memory in
/// use after the communicator forms).
inline constexpr uint64_t kNcclReserveBytes = uint64_t{1536} << 20;
/// cuBLASLt workspace of a CudaContext (its default).
inline constexpr uint64_t kCublasLtWorkspaceBytes = uint64_t{32} << 20;
/// Device memory the cuDNN causal prefill takes beside the arena (runtime.target_prefill cudnn:
/// TargetCuda::use_cudnn_prefill): its handle, the kernels cuDNN loads, and one graph's index
/// arrays and workspace. Measured on the H200 (driver 580.159.04, cuDNN 9.14 at run time): on
/// 2026-12-01 the device memory in use exceeded the plan without it by 0.07 GiB both in the
/// target forward alone (16.53 against 16.46 GiB) and in the whole step (66.14 against 66.07);
/// on 2026-12-02 (`dflash bench`, Qwen3-8B batch) the step with the cuDNN prefill held 72.0 MiB
/// more than the same step with the kernels, and 0.16 MiB more than this plan (the kernels' step
/// 4.2 MiB more than its plan). Each further document bucket adds its index arrays
/// ((4·slots + 3)·4 bytes) and workspace (TargetCuda::cudnn_prefill_bytes).
inline constexpr uint64_t kCudnnPrefillBytes = uint64_t{76} << 20;

/// Largest shapes of a training step.
struct TrainStepCapacity {
  int64_t ctx_rows = 0;  ///< T = rows_per_step · token_budget
  int64_t blocks = 0;    ///< largest number of real blocks in one step
};

/// Block rows of a packed step with `blocks` blocks: the blocks padded to a multiple of
/// kBlockRowsMultiple (at least one multiple), times the block size K (the staged NK).
int64_t padded_block_rows(int64_t blocks, int K);

/// The capacity of `cfg`'s steps: T = rows·token_budget and rows·min(block_budget, token_budget−1)
/// blocks (a row of n tokens has at most n − 1 candidate anchors).
TrainStepCapacity train_step_capacity(const RunConfig& cfg);

/// The plan (see the file comment).
struct TrainMemoryPlan {
  ArenaPlan arena;
  int64_t T = 0, NK = 0;      ///< planned context rows and block rows (0: target forward alone)
  int64_t target_layers = 0;  ///< target layers uploaded (target_layers_for_drafter)
  uint64_t context_bytes = kCudaContextBytes;
  uint64_t cublaslt_bytes = kCublasLtWorkspaceBytes;
  /// cuDNN's prefill beside the arena: kCudnnPrefillBytes when the plan holds the target and its
  /// prefill runs on cuDNN (plan_target_prefill), else 0.
  uint64_t cudnn_bytes = 0;
  uint64_t device_bytes = 0;  ///< the budget (runtime.device_memory_gib)
  /// What the drafter's backward does with the forward's activations (model/step_plan.hpp).
  DrafterActivations activations = DrafterActivations::recompute;
  /// Why (training.recompute and, for auto, whether keeping fits); "" when no drafter is planned.
  std::string activations_reason;

  /// Arena + context + cuBLASLt workspace + cuDNN's prefill.
  uint64_t total_bytes() const {
    return arena.arena_bytes + context_bytes + cublaslt_bytes + cudnn_bytes;
  }
  bool fits() const { return total_bytes() <= device_bytes; }
  /// The table printed by `--plan` and at the start of training: one row per group (bytes if
  /// nothing were shared), the arena, the live bytes of each phase, the total and the budget.
  /// Without `device_totals` (one worker among others on a GPU: PipelineMemoryPlan::table) the
  /// context, total and budget rows are left out.
  std::string table(bool device_totals = true) const;
};

/// Sets plan.cudnn_bytes for a plan that holds the target (T > 0, target_layers > 0) whose
/// causal prefill is `prefill`: kCudnnPrefillBytes for cudnn, 0 for kernels.
void plan_target_prefill(TrainMemoryPlan& plan, TargetPrefill prefill);

/// Plans a training step of `cap` on one device with `device_memory_gib` GiB, the drafter's
/// backward recomputing or keeping the forward's activations as `activations` says. Throws
/// dflash::Error for capacities ≤ 0.
TrainMemoryPlan plan_train_memory(const ModelConfig& target, const DrafterConfig& drafter,
                                  const DrafterLayout& layout, const TrainStepCapacity& cap,
                                  double device_memory_gib,
                                  int64_t ce_chunk_rows = kDrafterCeChunkRows,
                                  DrafterActivations activations = DrafterActivations::recompute);

/// The choice of training.recompute (`policy`: "auto", "always" or "never"; anything else throws
/// dflash::Error naming the key): `plan(a)` makes the plan with activations a and `fits(plan)`
/// says whether it fits. always → the recompute plan; never → the keep plan (fitting or not: the
/// caller reports a shortfall); auto → the keep plan when it fits, else the recompute plan. The
/// chosen plan's activations_reason says which and why (its activations field is set by `plan`).
template <typename Plan, typename MakePlan, typename Fits>
Plan plan_with_recompute_policy(const std::string& policy, MakePlan&& plan, Fits&& fits);

/// Names of a DSpark step's staged row index (DsparkRowIndex: prev, teacher_pos, w1_order [NK],
/// w1_seg [NK + 1], int32), in the plans of a drafter step (DSpark drafters only).
inline constexpr const char* kInputDsparkPrev = "inputs.dspark_prev";
inline constexpr const char* kInputDsparkTeacherPos = "inputs.dspark_teacher_pos";
inline constexpr const char* kInputDsparkW1Order = "inputs.dspark_w1_order";
inline constexpr const char* kInputDsparkW1Seg = "inputs.dspark_w1_seg";
/// Names of a Domino step's staged row index (DominoRowIndex: gru_tok [NK] int32, lambda [1]
/// f64), in the plans of a drafter step (Domino drafters only).
inline constexpr const char* kInputDominoGruTok = "inputs.domino_gru_tok";
inline constexpr const char* kInputDominoLambda = "inputs.domino_lambda";
/// Names of a DFlash2 step's staged inputs (dflash2_prev_tokens [NK] int32, the step's α_sel [1]
/// f64: dflash2_selector_alpha on the device, so that a replayed graph reads each step's), in the
/// plans of a drafter step (DFlash2 drafters only).
inline constexpr const char* kInputDflash2Prev = "inputs.dflash2_prev";
inline constexpr const char* kInputDflash2Alpha = "inputs.dflash2_alpha";

/// Name and group of the tap features in a plan of the target forward alone.
inline constexpr const char* kTargetOnlyFeatures = "taps.features";
inline constexpr const char* kGroupTapFeatures = "tap features (bf16, the drafter's input)";

/// Plans the target's tap forward alone on one device (what a target worker holds; `dflash bench
/// --target-only`), for up to `max_tokens` tokens and taps `taps` (layer ids), with
/// `device_memory_gib` GiB. One phase ("target"); buffers:
///   the target weights of layers [0, deepest tap] (plan_target_weights: embedding, untied LM
///   head, inv_freq, per layer projections with their biases, norms, MLP);
///   its activations (plan_target_activations);
///   kTargetOnlyFeatures bf16 [max_tokens, n_taps·H] (what forward_taps writes);
///   "workspace.op_scratch": target_op_scratch_bytes, at least kArenaAlign (a pool is never empty);
///   "inputs.tokens", "inputs.pos" int32 [max_tokens], "inputs.target_ranges" [max_tokens]
///   AttnRange.
/// T = max_tokens, NK = 0, target_layers = deepest tap + 1. Throws dflash::Error for max_tokens
/// ≤ 0, device_memory_gib ≤ 0, an empty tap list or a tap outside the target's layers.
TrainMemoryPlan plan_target_forward_memory(const ModelConfig& target, const std::vector<int>& taps,
                                           int64_t max_tokens, double device_memory_gib);

/// The plan of `cfg` (train_step_capacity, runtime.device_memory_gib, training.recompute).
TrainMemoryPlan plan_train_memory(const RunConfig& cfg, const ModelConfig& target,
                                  const DrafterConfig& drafter, const DrafterLayout& layout);

/// What fits when `cfg` does not: the largest token budget B (a multiple of 8, the batcher's shape
/// divisor) whose plan fits, with the block budget scaled in proportion
/// (ceil(block_budget·B / token_budget)); 0 when not even B = 8 fits.
struct FittingBudget {
  int64_t token_budget = 0;
  int64_t block_budget = 0;
};
FittingBudget largest_fitting_budget(const RunConfig& cfg, const ModelConfig& target,
                                     const DrafterConfig& drafter, const DrafterLayout& layout);
/// The same search for any plan: `fits(B, N)` says whether token budget B with block budget N
/// fits; `token_budget` and `block_budget` are the configured values (which do not fit).
FittingBudget largest_fitting_budget(int64_t token_budget, int64_t block_budget,
                                     const std::function<bool(int64_t, int64_t)>& fits);

/// "the training step does not fit the device: it needs X and runtime.device_memory_gib allows Y
/// (short by Z); the largest token budget that fits is <token_key>=B with <block_key>=N" (or that
/// none fits).
std::string plan_shortfall_message(const TrainMemoryPlan& plan, const FittingBudget& fit,
                                   const std::string& token_key = "data.token_budget",
                                   const std::string& block_key = "data.block_budget");

// ------------------------------------------------------------------ the pipeline's worker arenas
//
// With the pipeline (train/pipeline.hpp) every worker's CudaContext allocates an arena of its own
// (train/cuda_stages.cpp), and several workers may share one GPU. The primary CUDA context (and
// the kernels' modules) of a GPU is shared by the workers on it, so a GPU's total is its workers'
// arenas, cuBLASLt workspaces and cuDNN prefills (target workers) plus ONE kCudaContextBytes.

/// Names of the buffers a drafter worker adds to plan_drafter_step's: its own bf16 copies of the
/// target's embedding and (untied) LM head, [V, H] each.
inline constexpr const char* kDrafterWorkerEmbed = "target.embed";
inline constexpr const char* kDrafterWorkerLmHead = "target.lm_head";

/// Feature buffers a target worker's pool holds: as many as the pipeline can keep alive at once,
/// queue_depth in each drafter's queue, one in each drafter's step and one being made:
/// drafters·(queue_depth + 1) + 1.
int64_t target_feature_buffers(const PipelineTopology& topo);

/// A target worker's arena: plan_target_forward_memory's buffers (the tap forward of up to `T`
/// tokens, its output kTargetOnlyFeatures) plus `feature_buffers` buffers "taps.pool.{i}" bf16
/// [T, drafter_feature_cols] (the features in transit to the drafters). For a DSpark drafter the
/// forward runs every target layer, kTargetFinalNorm f32 [H] is planned and the features carry
/// the final-norm rows after the taps (model/step_plan.hpp). Throws dflash::Error as
/// plan_target_forward_memory, and for feature_buffers < 1.
TrainMemoryPlan plan_target_worker_memory(const ModelConfig& target, const DrafterConfig& drafter,
                                          int64_t T, int64_t feature_buffers,
                                          double device_memory_gib);

/// A drafter worker's arena: plan_drafter_step and the drafter part of plan_op_scratch for a step
/// of `cap`, its bf16 embedding and LM head copies (kDrafterWorkerEmbed, kDrafterWorkerLmHead,
/// the latter only for an untied target), and the step inputs it stages ("inputs.pos" int32
/// [T + NK], "inputs.block_tokens", "inputs.labels" int32 [NK], "inputs.block_ranges" AttnRange
/// [NK], "inputs.weights" f32 [NK]). target_layers = 0 (it holds no target layer). Throws
/// dflash::Error for capacities ≤ 0 or device_memory_gib ≤ 0.
TrainMemoryPlan plan_drafter_worker_memory(
    const ModelConfig& target, const DrafterConfig& drafter, const DrafterLayout& layout,
    const TrainStepCapacity& cap, double device_memory_gib,
    int64_t ce_chunk_rows = kDrafterCeChunkRows,
    DrafterActivations activations = DrafterActivations::recompute);

/// One worker's arena on its GPU.
struct WorkerMemoryPlan {
  std::string worker;  ///< "target0", "drafter1" (PipelineTopology::worker_name)
  int device = 0;      ///< its CUDA device
  TrainMemoryPlan plan;
};

/// What the CUDA kernels cannot run of this target and drafter (cuda_target_unsupported, then
/// cuda_drafter_unsupported), joined with "; "; empty when they run all of it.
std::string cuda_unsupported_message(const ModelConfig& target, const DrafterConfig& drafter);

/// The arenas of every worker of a CUDA pipeline and what each GPU needs in all.
struct PipelineMemoryPlan {
  std::vector<WorkerMemoryPlan> workers;       ///< targets first, then drafters, by index
  uint64_t context_bytes = kCudaContextBytes;  ///< the primary context, once per GPU
  uint64_t device_bytes = 0;                   ///< the budget of each GPU (device_memory_gib)
  /// GPUs holding a NCCL rank (PipelineTopology::uses_nccl), each planned nccl_bytes more.
  std::vector<int> nccl_devices;
  uint64_t nccl_bytes = kNcclReserveBytes;
  /// The drafter workers' choice (all alike; model/step_plan.hpp) and why (training.recompute).
  DrafterActivations activations = DrafterActivations::recompute;
  std::string activations_reason;

  /// The GPUs used, ascending.
  std::vector<int> devices() const;
  /// What GPU `device` needs: its workers' arenas, cuBLASLt workspaces and cuDNN prefills, plus
  /// context_bytes, plus nccl_bytes when it holds a NCCL rank.
  uint64_t device_total(int device) const;
  /// Every GPU's total is within device_bytes.
  bool fits() const;
  /// Per worker its arena's table (TrainMemoryPlan::table), then one line per GPU: its workers,
  /// the total and the budget.
  std::string table() const;
};

/// Plans every worker of `topo` (a cuda topology) for steps of `cap`: a target worker with
/// plan_target_worker_memory (feature buffers: target_feature_buffers(topo)), a drafter worker
/// with plan_drafter_worker_memory (with `activations`). Throws dflash::Error as those do.
PipelineMemoryPlan plan_pipeline_memory(
    const PipelineTopology& topo, const ModelConfig& target, const DrafterConfig& drafter,
    const DrafterLayout& layout, const TrainStepCapacity& cap, double device_memory_gib,
    DrafterActivations activations = DrafterActivations::recompute);

/// The pipeline plan of `cfg` (topology_of(cfg.runtime), train_step_capacity,
/// runtime.device_memory_gib), its drafter activations chosen by training.recompute
/// (plan_with_recompute_policy: auto keeps them when every GPU fits with them), its target
/// workers' prefill runtime.target_prefill (plan_target_prefill).
PipelineMemoryPlan plan_pipeline_memory(const RunConfig& cfg, const ModelConfig& target,
                                        const DrafterConfig& drafter, const DrafterLayout& layout);

/// largest_fitting_budget for the pipeline plan of `cfg`: the largest token budget (with the
/// block budget scaled in proportion) for which every GPU fits.
FittingBudget largest_fitting_pipeline_budget(const RunConfig& cfg, const ModelConfig& target,
                                              const DrafterConfig& drafter,
                                              const DrafterLayout& layout);

/// "the pipeline does not fit GPU N: its workers target0, drafter0, drafter1 need X and
/// runtime.device_memory_gib allows Y (short by Z)" for each GPU that does not fit, then the
/// largest token budget that fits (or that none does).
std::string pipeline_shortfall_message(const PipelineMemoryPlan& plan, const FittingBudget& fit);

/// "training.recompute must be auto, always or never, got '<policy>'" unless it is one of them.
void check_recompute_policy(const std::string& policy);

template <typename Plan, typename MakePlan, typename Fits>
Plan plan_with_recompute_policy(const std::string& policy, MakePlan&& plan, Fits&& fits) {
  check_recompute_policy(policy);
  if (policy == "always") {
    Plan p = plan(DrafterActivations::recompute);
    p.activations_reason = "training.recompute=always";
    return p;
  }
  Plan keep = plan(DrafterActivations::keep);
  if (policy == "never") {
    keep.activations_reason = "training.recompute=never";
    return keep;
  }
  if (fits(keep)) {
    keep.activations_reason = "training.recompute=auto: the plan that keeps them fits";
    return keep;
  }
  Plan p = plan(DrafterActivations::recompute);
  p.activations_reason = "training.recompute=auto: the plan that keeps them does not fit";
  return p;
}

}  // namespace dflash
