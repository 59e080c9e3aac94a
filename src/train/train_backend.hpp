// dflash.cpp — the step contract of `dflash train`: the two stages every training backend
// implements, so that the trainer (and the pipeline of target and drafter workers that DESIGN.md §2
// describes) drives any backend the same way:
//
//   DrafterBatch batch = drafter_batch_from_batch(batcher.next(), opts);  // once, on the host
//   std::unique_ptr<TargetFeatures> f = target->forward_taps(batch);      // target stage
//   drafter->step(batch, *f);     // drafter stage: forward and backward of Σw·CE/Σw
//   drafter->update(lr);          // gradient norm, non-finite skip, clip, AdamW
//   DrafterStepResult r = drafter->result();  // that step's loss, accuracy, τ, norm, skip
//
// Invariants:
// - The drafter stage owns everything between the loss and the weights: the step's gradient scale
//   1/Σw, the global gradient norm, the non-finite skip decision, clipping, AdamW and its update
//   counter (a skipped step does not advance bias correction). The caller supplies only the
//   learning rate, so a device backend can decide skip and clip on the device.
// - Results come out in step order, exactly one per step()/update() pair. result() may be called
//   after the next step() was issued: a backend that computes asynchronously may report a step
//   one step late without the host waiting; the CPU backend has each result ready at once.
//   save_state() sees every update issued before it.
// - Features are valid only for the drafter stage of the backend that made them and for the batch
//   they were computed from; a mismatch is an error naming both, never a silent wrong step.
// - Every backend computes the same objective on the same DrafterBatch (DESIGN.md §1); the CPU
//   backend is the reference (bit-reproducible), device backends agree with it within tolerance.
// - A stage is driven by one thread at a time; stages of one backend may share a device context
//   (the colocated CUDA backend), and then the same thread drives both.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"

namespace dflash {

class TargetModel;

/// Target features of one DrafterBatch, [T, n_taps·H] (tap i in columns [i·H, (i+1)·H)), in
/// whatever memory the producing backend keeps them; only that backend's drafter stage reads them.
class TargetFeatures {
 public:
  virtual ~TargetFeatures() = default;
};

/// The target stage: the frozen target's tap forward over a batch's context (DESIGN.md §1, taps
/// are the outputs of decoder layers `target_layer_ids`, documents attend only to themselves).
class TargetStage {
 public:
  virtual ~TargetStage() = default;
  /// Features of `batch`'s context. May return before the work is done (device backends enqueue
  /// it); the features are complete by the time the drafter stage uses them. Throws dflash::Error
  /// when the batch does not fit the stage's planned capacity.
  virtual std::unique_ptr<TargetFeatures> forward_taps(const DrafterBatch& batch) = 0;
};

/// Why a step changed no weight.
enum class StepSkip {
  none,                ///< the update was applied
  no_supervised_slot,  ///< Σw = 0: the batch has no supervised block slot (nothing was computed)
  non_finite,          ///< the loss or the gradient norm is NaN or infinite
};

/// Figures of one drafter step, as result() reports them.
struct DrafterStepResult {
  /// Σw·CE, Σw, per-slot accuracy and simulated τ of the step's blocks (before its update).
  ObjectiveMetrics metrics;
  /// Global L2 norm of the gradient of Σw·CE/Σw before clipping; NaN when none was computed.
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  double clip = 1.0;  ///< factor the gradient was multiplied by (1: not clipped)
  StepSkip skip = StepSkip::none;
  std::optional<double> target_device_s;   ///< device time of the target forward, if measured
  std::optional<double> drafter_device_s;  ///< device time of the drafter step, if measured
  std::optional<double> optimizer_device_s;  ///< device time of the update (AdamW), if measured
  /// Host seconds the stages spent blocked on the device for this step (read-backs, the update's
  /// synchronisation), if measured: the part of the step's wall time that is device time seen
  /// from the host; the rest of the wall time is host work on the critical path.
  std::optional<double> host_wait_s;
  bool skipped() const { return skip != StepSkip::none; }
};

/// The trained state of a drafter stage (host copies), what a checkpoint stores.
struct DrafterState {
  std::vector<float> params;  ///< fp32 master weights [layout.total], DrafterLayout order
  std::vector<float> adam_m;  ///< AdamW first moments [layout.total]
  std::vector<float> adam_v;  ///< AdamW second moments [layout.total]
  int64_t updates = 0;        ///< AdamW updates applied (the next one uses 1-based step updates+1)
};

/// The drafter stage: forward, backward and optimizer of the drafter (see the file invariants).
class DrafterStage {
 public:
  virtual ~DrafterStage() = default;
  /// Forward and backward of the drafter over `batch` with the target's `features` of it: the
  /// gradient of Σw·CE/Σw (Σw = batch.weight_sum) and the metrics of its blocks. A batch with
  /// Σw = 0 computes nothing and is reported as skipped (no_supervised_slot). Throws dflash::Error
  /// when the features come from another backend or another batch, or update() of the previous
  /// step is missing.
  virtual void step(const DrafterBatch& batch, const TargetFeatures& features) = 0;
  /// Finishes the last step(): its gradient norm; a non-finite loss or norm skips the step;
  /// otherwise clip (clip_grad_norm) and one AdamW update at learning rate `lr`. Throws
  /// dflash::Error when no step() is waiting for it.
  virtual void update(double lr) = 0;
  /// The result of the oldest updated step not yet reported (may wait for the device). Throws
  /// dflash::Error when every updated step was already reported.
  virtual DrafterStepResult result() = 0;
  /// Copies weights, moments and the update count out (waits for issued work). Throws
  /// dflash::Error between step() and update().
  virtual void save_state(DrafterState& out) = 0;
  /// Replaces weights, moments and the update count. Throws dflash::Error naming the array whose
  /// size differs from the layout's, or when called between step() and update().
  virtual void load_state(const DrafterState& in) = 0;
  /// One line for the end-of-run log (e.g. how many step shapes became CUDA graphs); empty when
  /// the backend has nothing to add.
  virtual std::string summary() const { return {}; }
};

/// What a backend needs to know before the first step.
struct TrainBackendOptions {
  std::string backend = "cpu";     ///< runtime.backend: "cpu" or "cuda"
  std::vector<int> devices = {0};  ///< runtime.devices (cuda: exactly one today)
  bool cuda_graphs = true;         ///< runtime.cuda_graphs
  int64_t max_context_tokens = 0;  ///< rows_per_step·token_budget: the largest rows·L of a batch
  /// The largest number of blocks a batch can have (rows_per_step · min(block_budget,
  /// token_budget − 1)): device backends plan their memory for it (train/memory_plan.hpp).
  int64_t max_blocks = 0;
  double device_memory_gib = 139.0;  ///< runtime.device_memory_gib
  AdamWConfig adam;                ///< training.beta1/beta2/adam_eps/weight_decay
  double clip_grad_norm = 1.0;     ///< training.clip_grad_norm (≤ 0: no clipping)
};

/// A target stage and a drafter stage that belong together (they may share one object and one
/// device context), and a description for the log.
struct TrainBackend {
  std::shared_ptr<TargetStage> target;
  std::shared_ptr<DrafterStage> drafter;
  std::string description;  ///< e.g. "cpu, 2 threads" or "cuda:0 NVIDIA H200 (...), CUDA graphs on"
  /// Device memory measured at start (context, arena, target upload speed); empty on the CPU.
  std::string memory_report;
};

/// Creates the backend `opts.backend` for `target` (which must outlive it) and a drafter of `cfg`
/// with zero weights and moments (load_state them before the first step). Throws dflash::Error
/// naming runtime.backend when it is unknown or not in this build (cuda without -DDFLASH_CUDA=ON),
/// naming runtime.devices when a device does not exist, or naming the unsupported model feature.
TrainBackend train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                  const DrafterConfig& cfg, const DrafterLayout& layout);

/// Checks, before anything is loaded, that `opts` names a backend this build has and devices that
/// exist; throws dflash::Error naming runtime.backend or runtime.devices otherwise.
void train_backend_check(const TrainBackendOptions& opts);

/// The CPU backend (src/train/cpu_train.cpp): the target's forward_taps and drafter_train_step
/// over the packed batch, AdamW of src/train/optimizer.hpp; bit-reproducible.
TrainBackend cpu_train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                      const DrafterConfig& cfg, const DrafterLayout& layout);

/// The CUDA backend on one GPU (src/train/cuda_train.cpp). In a build without CUDA it throws
/// dflash::Error saying so.
TrainBackend cuda_train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                       const DrafterConfig& cfg, const DrafterLayout& layout);
/// train_backend_check for the CUDA backend: the build has CUDA, runtime.devices lists exactly
/// one device and it exists.
void cuda_train_backend_check(const TrainBackendOptions& opts);

/// The bookkeeping every drafter stage shares: one step waiting for update(), then results in
/// order. Backends call stepped() from step(), take_stepped() from update() and push the
/// finished result with finish(); result() pops.
class StepQueue {
 public:
  /// Records the figures of a step()'s forward/backward. Throws when update() of the previous
  /// step is missing.
  void stepped(DrafterStepResult r);
  /// The step waiting for update(); throws dflash::Error when there is none.
  DrafterStepResult take_stepped();
  /// Queues a finished step's result.
  void finish(DrafterStepResult r) { done_.push_back(std::move(r)); }
  /// The oldest unreported result; throws dflash::Error when there is none.
  DrafterStepResult pop();
  /// True between step() and update().
  bool waiting_for_update() const { return waiting_.has_value(); }

 private:
  std::optional<DrafterStepResult> waiting_;
  std::deque<DrafterStepResult> done_;
};

/// Throws dflash::Error naming the array when `s` does not hold `total` values per array.
void drafter_state_check(const DrafterState& s, int64_t total);

/// The update decision of a stepped result `r` made on the host: when its loss (Σw·CE) or
/// gradient norm is not finite, marks it skipped (non_finite) and returns false; otherwise sets
/// r.clip = clip_scale(grad_norm, clip_grad_norm) and returns true (apply the update). A result
/// already skipped (no supervised slot) returns false unchanged.
bool step_decide_update(DrafterStepResult& r, double clip_grad_norm);

}  // namespace dflash
