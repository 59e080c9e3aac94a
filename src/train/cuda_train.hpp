// dflash.cpp — the CUDA backend of `dflash train` on one GPU: the target's tap forward and the
// drafter's step on the same device, driven by the trainer thread that owns the context. It
// implements both stages of the step contract (train/train_backend.hpp) as one object, colocated:
// forward_taps() stages the whole step into pinned buffers and enqueues the target; step() enqueues
// the drafter and reads its results back; update() runs AdamW.
//
// Device layout: a DrafterBatch is staged with drafter_batch_stage into a fixed shape, its context
// padded to rows·L tokens of the batch's shape and its block rows to a multiple of
// kBlockRowsMultiple blocks (train/memory_plan.hpp), so that few distinct shapes occur (GEMM plans
// and graphs are per shape).
//
// Target prefill: with TargetPrefill::cudnn (runtime.target_prefill, the default) the target's
// causal prefill runs on cuDNN (TargetCuda::use_cudnn_prefill), the graph of a step chosen by the
// staged context's documents (cuda_target_prefill_select: the power-of-two bucket of the real and
// padding documents, documents of at most one row); a target cuDNN cannot run stops the
// construction naming the key (cuda_target_use_cudnn), never a fallback to the kernels.
//
// Graphs: with `use_graphs`, the target forward of each (context length, document bucket) and the
// drafter forward/backward of each (context length, block rows) shape are captured once as CUDA
// graphs (inputs copied from fixed pinned host buffers inside the graph) and replayed; AdamW stays
// outside (its learning rate changes every step). The same kernels run with the same arguments either way,
// so both paths give identical bits. Gradients are computed unscaled on the device (so that the
// loss scale 1/Σw of a step is not baked into a graph) and the scale is applied by AdamW.
//
// Invariants: one CudaTrainBackend per thread and device; it owns its CudaContext, so nothing is
// shared between two backends. One step is in flight: the pinned staging buffers and the feature
// buffer hold the batch of the last forward_taps() until its step() (a second forward_taps()
// before that step is an error). Every device buffer of the step (target weights and activations,
// drafter state, activations and workspaces, per-op scratch, step inputs) comes from ONE arena
// allocated at construction from a TrainMemoryPlan (train/memory_plan.hpp); steps of every shape
// use the same arena and ops take their scratch from the plan's pool, so no step calls cudaMalloc.
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "model/target.hpp"
#include "train/memory_plan.hpp"
#include "train/optimizer.hpp"
#include "train/target_prefill_cuda.hpp"
#include "train/train_backend.hpp"

namespace dflash {

namespace cuda {
class CudaContext;
class DeviceArena;
}  // namespace cuda
class TargetCuda;
class DrafterCuda;

/// The bf16 bits of features a CUDA target stage (cuda_target_stage_create) made, [rows, cols]
/// row-major, downloaded (synchronous; for tests and tools). Throws dflash::Error for features of
/// another stage kind.
std::vector<uint16_t> cuda_features_download(const TargetFeatures& features);

/// Target + drafter training step on one GPU (both stages of the step contract).
class CudaTrainBackend final : public TargetStage, public DrafterStage {
 public:
  /// Creates the context on `device`, allocates the arena of `plan` (packed steps of at most
  /// plan.T context rows and plan.NK block rows) and uploads the target's layers up to the
  /// deepest tap into it. Throws dflash::Error when the device does not exist, the arena does not
  /// fit, or the models are not supported on CUDA.
  CudaTrainBackend(int device, const TargetModel& target, const DrafterConfig& cfg,
                   const DrafterLayout& layout, const TrainMemoryPlan& plan, bool use_graphs,
                   const AdamWConfig& adam, double clip_grad_norm,
                   TargetPrefill prefill = TargetPrefill::cudnn);
  ~CudaTrainBackend() override;

  /// Stages `batch` (context and block rows) into the pinned buffers and enqueues the target's tap
  /// forward into the drafter's feature buffer. Throws dflash::Error when the padded step exceeds
  /// the planned capacity, or the previous features were not yet consumed by step().
  std::unique_ptr<TargetFeatures> forward_taps(const DrafterBatch& batch) override;
  /// Enqueues the drafter's forward/backward of the staged batch (gradients of Σ w·CE unscaled),
  /// waits for loss, Σw, gradient norm and argmax, and computes the step's metrics.
  void step(const DrafterBatch& batch, const TargetFeatures& features) override;
  /// Host-side skip/clip decision, then AdamW on the device with the gradient times clip/Σw.
  void update(double lr) override;
  DrafterStepResult result() override { return queue_.pop(); }
  /// Master weights, moments (downloaded, synchronous) and the update count.
  void save_state(DrafterState& out) override;
  /// Uploads master weights and moments (synchronous) and refreshes the bf16 weight copy.
  void load_state(const DrafterState& in) override;
  /// "cuda: N step shapes captured as CUDA graphs" or "cuda: CUDA graphs off".
  std::string summary() const override;
  /// Fault injection: the staged features become NaN (bf16 0xFFFF), enqueued on the stream.
  void fill_nan(TargetFeatures& features) override;
  /// Fault injection: the next step's loss is reported as NaN.
  void inject_nan() override { queue_.poison_next(); }

  /// Graphs captured so far (0 when graphs are off).
  int64_t graphs_captured() const;
  /// "cuda:0 NVIDIA H200 (...), CUDA graphs off".
  const std::string& description() const { return description_; }
  /// Measured device memory: "context, handles and cuBLASLt workspace X (planned Y), arena Z, in
  /// use now W; target weights G GB uploaded in S s (R GB/s)" (device memory re-read per call).
  std::string memory_report() const;
  /// Device memory in use now (cudaMemGetInfo: total − free), in bytes.
  uint64_t device_memory_used() const;

 private:
  std::unique_ptr<cuda::CudaContext> ctx_;
  std::unique_ptr<cuda::DeviceArena> arena_;
  std::unique_ptr<TargetCuda> target_;
  std::unique_ptr<DrafterCuda> drafter_;
  DrafterConfig cfg_;
  int64_t param_count_ = 0;
  std::vector<int> taps_;
  int64_t max_ctx_ = 0, max_rows_ = 0;
  bool use_graphs_ = false;
  AdamWConfig adam_;
  double clip_grad_norm_ = 0;
  int64_t updates_ = 0;         // AdamW updates applied
  double pending_scale_ = 1.0;  // 1/Σw of the step waiting for update()
  // The staged step: shape, which forward_taps() it came from, whether step() consumed it.
  int64_t staged_T_ = 0, staged_NK_ = 0, staged_ticket_ = 0;
  uint64_t staged_batch_ = 0;  // DrafterBatch::fingerprint of the staged batch
  bool staged_consumed_ = true;
  StepQueue queue_;
  std::string description_;
  uint64_t context_bytes_ = 0, planned_context_bytes_ = 0;
  struct Inputs;
  std::unique_ptr<Inputs> in_;
  // Enqueue one step's work (copies from the pinned staging buffers included).
  void enqueue_target(int64_t T);
  void enqueue_drafter(int64_t T, int64_t NK);
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
