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
#include "model/objective.hpp"
#include "model/step_plan.hpp"
#include "train/collective.hpp"
#include "train/optimizer.hpp"
#include "train/run_config.hpp"
#include "train/topology.hpp"

namespace dflash {

class TargetModel;
class Job;

/// Target features of one DrafterBatch, [T, n_taps·H] (tap i in columns [i·H, (i+1)·H)), in
/// whatever memory the producing backend keeps them; only drafter stages of the same backend read
/// them. They may be handed to another thread (a target worker's features go to a drafter worker
/// through a queue) and destroyed there.
class TargetFeatures {
 public:
  virtual ~TargetFeatures() = default;
  /// Device seconds of the forward that made these features, when the stage measured it (CUDA
  /// events); absent otherwise (never 0 for "not measured").
  std::optional<double> device_s;
};

/// Device memory of the GPU a stage runs on (cudaMemGetInfo: the whole device, every process).
struct DeviceMemory {
  uint64_t used = 0;   ///< bytes
  uint64_t total = 0;  ///< bytes
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
  /// Fault injection (train/fault_inject.hpp): overwrites `features`, which this stage made, with
  /// NaN. Throws dflash::Error for features of another stage.
  virtual void fill_nan(TargetFeatures& features) = 0;
  /// The memory of the stage's GPU; nothing on the cpu backend. Call from the stage's thread.
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }
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
  std::optional<double> target_device_s;     ///< device time of the target forward, if measured
  std::optional<double> drafter_device_s;    ///< device time of the drafter step, if measured
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
  /// Fault injection (train/fault_inject.hpp): the loss of the next step() is reported as NaN, so
  /// that its update is skipped as non-finite.
  virtual void inject_nan() = 0;
  /// The memory of the stage's GPU; nothing on the cpu backend. Call from the stage's thread.
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }
};

/// What a backend needs to know before the first step.
struct TrainBackendOptions {
  std::string backend = "cpu";     ///< runtime.backend: "cpu" or "cuda"
  std::vector<int> devices = {0};  ///< runtime.devices (train_backend_create: exactly one on cuda)
  /// The run's workers (train/topology.hpp); when it has workers, train_backend_check checks its
  /// devices instead of `devices`.
  PipelineTopology topology;
  bool cuda_graphs = true;  ///< runtime.cuda_graphs
  /// runtime.target_prefill: the cuda target's causal prefill (cuDNN by default).
  TargetPrefill target_prefill = TargetPrefill::cudnn;
  int64_t max_context_tokens = 0;  ///< rows_per_step·token_budget: the largest rows·L of a batch
  /// cuda target stages: feature buffers in the pool (as many as the pipeline can hold alive).
  int64_t feature_buffers = 1;
  /// The largest number of blocks a batch can have (rows_per_step · min(block_budget,
  /// token_budget − 1)): device backends plan their memory for it (train/memory_plan.hpp).
  int64_t max_blocks = 0;
  double device_memory_gib = 139.0;  ///< runtime.device_memory_gib
  /// cuda drafter stages: recompute or keep the forward's activations for the backward (what the
  /// run's memory plan chose from training.recompute: plan_pipeline_memory).
  DrafterActivations drafter_activations = DrafterActivations::recompute;
  AdamWConfig adam;             ///< training.beta1/beta2/adam_eps/weight_decay
  double clip_grad_norm = 1.0;  ///< training.clip_grad_norm (≤ 0: no clipping)
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

/// One line for the log about the backend: "cpu, 2 threads per worker", or "cuda, CUDA graphs on;
/// GPU 0: NVIDIA H200 (sm_90, 139.8 GiB)" naming each GPU of opts.topology (else runtime.devices).
std::string train_backend_describe(const TrainBackendOptions& opts);
/// The cuda part of train_backend_describe (src/train/cuda_stages.cpp).
std::string cuda_backend_describe(const TrainBackendOptions& opts);

/// The CPU backend (src/train/cpu_train.cpp): the target's forward_taps and drafter_train_step
/// over the packed batch, AdamW of src/ops/adamw.hpp; bit-reproducible.
TrainBackend cpu_train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                      const DrafterConfig& cfg, const DrafterLayout& layout);
/// The CPU target stage of one worker (several may share `target`, which is read-only).
std::unique_ptr<TargetStage> cpu_target_stage_create(const TargetModel& target,
                                                     const DrafterConfig& cfg);
/// The CPU drafter stage of one replica; `collective` is its member (null: a single replica).
std::unique_ptr<DrafterStage> cpu_drafter_stage_create(const TrainBackendOptions& opts,
                                                       const TargetModel& target,
                                                       const DrafterConfig& cfg,
                                                       const DrafterLayout& layout,
                                                       std::unique_ptr<Collective> collective);

/// The CUDA backend on one GPU (src/train/cuda_train.cpp). In a build without CUDA it throws
/// dflash::Error saying so.
TrainBackend cuda_train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                       const DrafterConfig& cfg, const DrafterLayout& layout);
/// train_backend_check for the CUDA backend: the build has CUDA and the devices exist (every
/// device of opts.topology when it has workers, else runtime.devices, which must list exactly one
/// device).
void cuda_train_backend_check(const TrainBackendOptions& opts);
/// The CUDA target stage of one worker on `device`, with a context of its own
/// (src/train/cuda_stages.cpp). Throws dflash::Error in a build without CUDA.
std::unique_ptr<TargetStage> cuda_target_stage_create(const TrainBackendOptions& opts, int device,
                                                      const TargetModel& target,
                                                      const DrafterConfig& cfg);
/// The CUDA drafter stage of replica `replica` on `device`, with a context of its own and its
/// member of `group` (null: a single replica). Throws dflash::Error in a build without CUDA.
std::unique_ptr<DrafterStage> cuda_drafter_stage_create(
    const TrainBackendOptions& opts, int device, const TargetModel& target,
    const DrafterConfig& cfg, const DrafterLayout& layout,
    const std::shared_ptr<CollectiveGroup>& group, int replica);

/// The collective group of the drafter replicas on `backend`, this process's on `devices` (one
/// entry per replica): null for one replica in a one-process run; the local host group on cpu; on
/// cuda an NCCL group when every replica has a GPU of its own and the in-process device group
/// when two share one (NCCL refuses two ranks on one GPU). In an MPI job (`job` non-null,
/// train/job.hpp) the group spans every rank's replicas: the job's host group on cpu (sums in
/// global replica order), one NCCL communicator on cuda (rank 0's unique id broadcast over MPI;
/// replicas sharing a GPU are refused). Call on the coordinating thread of every rank before the
/// replicas' stages are made.
std::shared_ptr<CollectiveGroup> collective_group_create(const std::string& backend,
                                                         const std::vector<int>& devices,
                                                         Job* job = nullptr);

/// The target stage of one target worker on `device` (a CUDA device index; −1 on the cpu
/// backend), for the taps of `cfg`. Call it on the thread that will drive the stage (a CUDA stage
/// creates its context there); `target` must outlive the stage. Throws dflash::Error as
/// train_backend_create.
std::unique_ptr<TargetStage> target_stage_create(const TrainBackendOptions& opts, int device,
                                                 const TargetModel& target,
                                                 const DrafterConfig& cfg);

/// The drafter stage of drafter replica `replica` on `device` (−1 on cpu), with zero weights and
/// moments (load_state them before the first step). `group` is the replicas' collective (null for
/// a single replica): the stage takes its member `replica` and all-reduces its gradient and its
/// skip decision in update(). Call it on the thread that will drive the stage; for an NCCL group
/// every replica's thread must call it at about the same time (the communicator forms when all
/// ranks have joined). Throws dflash::Error as train_backend_create.
std::unique_ptr<DrafterStage> drafter_stage_create(const TrainBackendOptions& opts, int device,
                                                   const TargetModel& target,
                                                   const DrafterConfig& cfg,
                                                   const DrafterLayout& layout,
                                                   const std::shared_ptr<CollectiveGroup>& group,
                                                   int replica);

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
  /// Fault injection: the next stepped() result gets a NaN loss.
  void poison_next() { poison_next_ = true; }

 private:
  bool poison_next_ = false;
  std::optional<DrafterStepResult> waiting_;
  std::deque<DrafterStepResult> done_;
};

/// Throws dflash::Error naming the array when `s` does not hold `total` values per array.
void drafter_state_check(const DrafterState& s, int64_t total);

/// The update decision of a stepped result `r` made on the host: when its loss (Σw·CE) or
/// gradient norm is not finite, or `peer_non_finite` (another replica's loss is not finite), marks
/// it skipped (non_finite) and returns false; otherwise sets r.clip = clip_scale(grad_norm,
/// clip_grad_norm) and returns true (apply the update). A result already skipped (no supervised
/// slot) returns false unchanged.
bool step_decide_update(DrafterStepResult& r, double clip_grad_norm, bool peer_non_finite = false);

/// For data-parallel replicas: all-reduces whether each replica's loss of `r` is finite, so that
/// every replica makes the same skip decision. Returns true when any replica's loss is not finite.
/// Throws dflash::Error when the collective fails.
bool replicas_non_finite(Collective& collective, const DrafterStepResult& r);

}  // namespace dflash
