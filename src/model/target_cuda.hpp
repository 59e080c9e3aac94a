// dflash.cpp — the frozen target on the CUDA backend: the tap forward of training (DESIGN.md §2,
// "target worker"), the same model as src/model/target.hpp computed with bf16 weights and bf16
// activations at GEMM inputs, fp32 residual stream, fp32 norm statistics and softmax.
//
// Invariants: one TargetCuda belongs to one CudaContext (one thread). Weights of the layers it
// runs are uploaded once at construction (bf16; f32 checkpoints are rounded to bf16) through pinned
// staging buffers; weights and activations are the "target.*" buffers of a memory plan
// (model/step_plan.hpp) in a DeviceArena, sized for `max_tokens`, so forward_taps allocates
// nothing and is graph-capturable. All pointers taken and returned are device pointers. Supported:
// the Llama/Qwen2/Qwen3 decoder without projection biases and without sliding-window layers
// (construction fails naming the feature otherwise — never a silent fallback).
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/context.hpp"
#include "model/target.hpp"
#include "ops/attention.hpp"

namespace dflash {

/// Device copy of a TargetModel and the workspace of its tap forward.
class TargetCuda {
 public:
  /// Uploads the weights of `model`'s layers [0, n_layers) (0 = all) to ctx's device, into
  /// `arena`'s buffers of plan_target_weights / plan_target_activations for up to `max_tokens`
  /// tokens per forward, or into an arena of its own when `arena` is null. Throws dflash::Error
  /// for unsupported architectures (biases, sliding windows, head_dim other than 64/128) naming
  /// the config field, and for n_layers outside [0, num_hidden_layers].
  TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens,
             int64_t n_layers = 0, cuda::DeviceArena* arena = nullptr);
  /// The same with random weights of `cfg`'s shapes filled on the device from `seed` (no
  /// checkpoint; for `dflash bench`): matrices and tables uniform with standard deviation 0.02
  /// (HF's initializer_range), norm weights 1 (ops/fill.hpp).
  TargetCuda(cuda::CudaContext& ctx, const ModelConfig& cfg, uint64_t seed, int64_t max_tokens,
             int64_t n_layers = 0, cuda::DeviceArena* arena = nullptr);

  /// Outputs of decoder layers `layer_ids` (each in [0, num_layers)) concatenated into `taps`
  /// bf16 [T, n_taps·H] (tap i in columns [i·H, (i+1)·H)). `tokens` [T] int32 ids, `pos` [T] int32
  /// positions (restarting at 0 per document), `ranges` [T] the causal key ranges of each token
  /// (its document's start up to itself; see attention_causal_varlen_ranges). Runs no layer after
  /// the deepest tap (which must be an uploaded layer). Enqueued on ctx's stream; nothing is copied
  /// to the host.
  void forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                    const AttnRange* ranges, int64_t T, std::span<const int> layer_ids);

  /// The embedding table and LM head on the device, bf16 [V, H] (the same array when tied).
  const uint16_t* embed() const { return embed_; }
  const uint16_t* lm_head() const { return tied_ ? embed_ : head_; }
  /// Layers uploaded (the deepest usable tap + 1).
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  /// Weight bytes uploaded at construction and the seconds it took (host reads included).
  uint64_t upload_bytes() const { return upload_bytes_; }
  double upload_seconds() const { return upload_s_; }

 private:
  struct Layer {
    uint16_t *wq, *wk, *wv, *wo, *wgu, *wdown;     // bf16; wgu = [gate; up] rows [2I, H]
    float *in_norm, *post_norm, *q_norm, *k_norm;  // f32 (q/k norms null without qk_norm)
  };
  cuda::CudaContext& ctx_;
  ModelConfig cfg_;
  int64_t max_tokens_;
  float rope_scaling_;
  bool tied_;
  std::unique_ptr<cuda::DeviceArena> own_arena_;
  uint16_t *embed_ = nullptr, *head_ = nullptr;
  float* inv_freq_ = nullptr;
  std::vector<Layer> layers_;
  float* x_ = nullptr;
  uint16_t *hn_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *o_ = nullptr;
  uint16_t *gu_ = nullptr, *act_ = nullptr, *tap_ = nullptr;
  uint64_t upload_bytes_ = 0;
  double upload_s_ = 0;
  // Constructor steps: checks and the arena (a plan of its own when `arena` is null), the weight
  // pointers of layers [0, n_layers), the activations.
  cuda::DeviceArena& setup(int64_t n_layers, cuda::DeviceArena* arena);
  void take_weights(cuda::DeviceArena& arena);
  void take_activations(cuda::DeviceArena& arena);
  void upload_weights(const TargetModel& model);
  void random_weights(uint64_t seed);
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
