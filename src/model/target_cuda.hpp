// dflash.cpp — the frozen target on the CUDA backend: the tap forward of training (DESIGN.md §2,
// "target worker"), the same model as src/model/target.hpp computed with bf16 weights and bf16
// activations at GEMM inputs, fp32 residual stream, fp32 norm statistics and softmax.
//
// Invariants: one TargetCuda belongs to one CudaContext (one thread). Weights are uploaded once at
// construction (bf16; f32 checkpoints are rounded to bf16); every activation buffer is sized for
// `max_tokens` at construction, so forward_taps allocates nothing and is graph-capturable. All
// pointers taken and returned are device pointers. Supported: the Llama/Qwen2/Qwen3 decoder without
// projection biases and without sliding-window layers (construction fails naming the feature
// otherwise — never a silent fallback).
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <span>
#include <vector>

#include "backend/cuda/context.hpp"
#include "model/target.hpp"
#include "ops/attention.hpp"

namespace dflash {

/// Device copy of a TargetModel and the workspace of its tap forward.
class TargetCuda {
 public:
  /// Uploads `model`'s weights to ctx's device and plans buffers for up to `max_tokens` tokens per
  /// forward. Throws dflash::Error for unsupported architectures (biases, sliding windows, head_dim
  /// other than 64/128) naming the config field.
  TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens);

  /// Outputs of decoder layers `layer_ids` (each in [0, num_layers)) concatenated into `taps`
  /// bf16 [T, n_taps·H] (tap i in columns [i·H, (i+1)·H)). `tokens` [T] int32 ids, `pos` [T] int32
  /// positions (restarting at 0 per document), `ranges` [T] the causal key ranges of each token
  /// (its document's start up to itself; see attention_causal_varlen_ranges). Runs no layer after the
  /// deepest tap. Enqueued on ctx's stream; nothing is copied to the host.
  void forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                    const AttnRange* ranges, int64_t T, std::span<const int> layer_ids);

  /// The embedding table and LM head on the device, bf16 [V, H] (the same array when tied).
  const uint16_t* embed() const { return embed_.as<uint16_t>(); }
  const uint16_t* lm_head() const { return tied_ ? embed_.as<uint16_t>() : head_.as<uint16_t>(); }

 private:
  struct Layer {
    cuda::DeviceBuffer wq, wk, wv, wo, wgu, wdown;  // bf16; wgu = [gate; up] rows [2I, H]
    cuda::DeviceBuffer in_norm, post_norm, q_norm, k_norm;  // f32
  };
  cuda::CudaContext& ctx_;
  ModelConfig cfg_;
  int64_t max_tokens_;
  float rope_scaling_;
  bool tied_;
  cuda::DeviceBuffer embed_, head_, inv_freq_;
  std::vector<Layer> layers_;
  cuda::DeviceBuffer x_, hn_, q_, k_, v_, o_, gu_, act_, tap_;
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
