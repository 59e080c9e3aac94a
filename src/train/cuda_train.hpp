// dflash.cpp — the CUDA backend of `dflash train` on one GPU: the target's tap forward and the
// drafter's step on the same device, driven by the trainer thread that owns the context.
//
// Graphs: with `use_graphs`, the target forward of each context length and the drafter
// forward/backward of each (context length, block rows) shape are captured once as CUDA graphs
// (inputs copied from fixed pinned host buffers inside the graph) and replayed; AdamW stays outside
// (its learning rate changes every step). The same kernels run with the same arguments either way,
// so both paths give identical bits. Gradients are computed unscaled on the device (so that the
// loss scale 1/Σw of a step is not baked into a graph) and the scale is applied by AdamW.
//
// Invariants: one CudaTrainBackend per thread and device; it owns its CudaContext, so nothing is
// shared between two backends. Every device buffer of the step (target weights and activations,
// drafter state, activations and workspaces, per-op scratch, step inputs) comes from ONE arena
// allocated at construction from a TrainMemoryPlan (train/memory_plan.hpp); steps of every shape
// use the same arena, and ops take their scratch from the plan's pool, so no step calls
// cudaMalloc.
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
#include "train/packed_step.hpp"

namespace dflash {

namespace cuda {
class CudaContext;
class DeviceArena;
}
class TargetCuda;
class DrafterCuda;

/// Target + drafter training step on one GPU.
class CudaTrainBackend {
 public:
  /// Creates the context on `device`, allocates the arena of `plan` (packed steps of at most
  /// plan.T context rows and plan.NK block rows) and uploads the target's layers up to the
  /// deepest tap into it. Throws dflash::Error when the device does not exist, the arena does not
  /// fit, or the models are not supported on CUDA.
  CudaTrainBackend(int device, const TargetModel& target, const DrafterConfig& cfg,
                   const DrafterLayout& layout, const TrainMemoryPlan& plan, bool use_graphs);
  ~CudaTrainBackend();

  /// Results of one step (host copies).
  struct StepResult {
    double loss_sum = 0, weight_sum = 0, grad_norm = 0;
    std::vector<int32_t> argmax;  ///< [NK] per block row of the packed step
    double target_s = 0, drafter_s = 0;  ///< GPU time of the target forward and of the drafter
  };
  /// Uploads the packed step, runs the target's tap forward and the drafter's forward/backward
  /// for gradients of grad_scale·Σ w·CE (grad_scale = 1/Σw; applied by the next adamw call, and
  /// to the returned grad_norm), and waits for the results.
  StepResult step(const PackedStep& s, double grad_scale);
  /// AdamW on the device state with the last step's gradients times its grad_scale times `clip`
  /// (see DrafterCuda::adamw).
  void adamw(const AdamWConfig& cfg, double lr, int64_t step, double clip);
  /// Graphs captured so far (0 when graphs are off).
  int64_t graphs_captured() const;
  /// Master weights and moments to / from the host (synchronous).
  void upload_state(std::span<const float> params, std::span<const float> m,
                    std::span<const float> v);
  void download_state(std::span<float> params, std::span<float> m, std::span<float> v);
  /// "cuda:0 NVIDIA H200 (...), CUDA graphs off".
  const std::string& description() const { return description_; }
  /// Measured device memory: "context and handles X (planned Y), arena Z, in use W; target
  /// upload G GB in S s (R GB/s)". Device memory in use is re-read at each call.
  std::string memory_report() const;
  /// Device memory in use now (cudaMemGetInfo: total − free), in bytes.
  uint64_t device_memory_used() const;

 private:
  std::unique_ptr<cuda::CudaContext> ctx_;
  std::unique_ptr<cuda::DeviceArena> arena_;
  std::unique_ptr<TargetCuda> target_;
  std::unique_ptr<DrafterCuda> drafter_;
  std::vector<int> taps_;
  int64_t max_ctx_ = 0, max_rows_ = 0;
  bool use_graphs_ = false;
  double pending_scale_ = 1.0;
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
