// dflash.cpp — the frozen target on the CUDA backend: the tap forward of training (DESIGN.md §2,
// "target worker"), the same model as src/model/target.hpp computed with bf16 weights and bf16
// activations at GEMM inputs, fp32 residual stream, fp32 norm statistics, softmax and routing.
//
// Every family of the CPU target runs here: Llama/Mistral/Qwen2/Qwen3 (projection and MLP biases,
// every RoPE scaling, untied heads), sliding-window layers (their key ranges are the caller's
// causal ranges narrowed on the device by attention_window_ranges_cuda), Qwen3-MoE and gpt-oss
// (attention sinks; sparse blocks through the ops/moe.hpp pipeline: router GEMM, top-k routing,
// expert-sorted dispatch and grouped tensor-core GEMMs, no per-token loop, no host round trip).
//
// Invariants: one TargetCuda belongs to one CudaContext (one thread). Weights are uploaded once at
// construction (bf16; f32 checkpoints are rounded to bf16; biases, norms and sinks f32), one
// descriptor per layer; every activation buffer is sized for `max_tokens` at construction, so
// forward_taps allocates nothing beyond the ops' own scratch from the caching allocator and is
// graph-capturable. All pointers taken and returned are device pointers. Unsupported shapes fail
// at construction naming the config field — never a silent fallback.
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
  /// forward. Throws dflash::Error naming the config field for what the kernels cannot run:
  /// head_dim other than 64/128; for MoE targets hidden_size or the expert width not a multiple
  /// of 8, more than 1024 experts or top-k above 32.
  TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens);

  /// Outputs of decoder layers `layer_ids` (each in [0, num_layers)) concatenated into `taps`
  /// bf16 [T, n_taps·H] (tap i in columns [i·H, (i+1)·H)). `tokens` [T] int32 ids, `pos` [T] int32
  /// positions (restarting at 0 per document), `ranges` [T] the causal key ranges of each token
  /// (its document's start up to itself; see attention_causal_varlen_ranges); sliding layers narrow
  /// them to the config's window. Runs no layer after the deepest tap. Enqueued on ctx's stream;
  /// nothing is copied to the host.
  void forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                    const AttnRange* ranges, int64_t T, std::span<const int> layer_ids);

  /// The embedding table and LM head on the device, bf16 [V, H] (the same array when tied).
  const uint16_t* embed() const { return embed_.as<uint16_t>(); }
  const uint16_t* lm_head() const { return tied_ ? embed_.as<uint16_t>() : head_.as<uint16_t>(); }

 private:
  /// A sparse block on the device: E experts of width EI, stacked.
  struct Moe {
    cuda::DeviceBuffer router, router_bias;  // bf16 [E, H]; f32 [E] or empty
    cuda::DeviceBuffer wgu, wdown;  // bf16 [E, 2·EI, H] (gate rows, then up rows), [E, H, EI]
    cuda::DeviceBuffer gu_ptrs, down_ptrs;  // device arrays of E pointers into wgu / wdown
    cuda::DeviceBuffer gate_bias, up_bias, down_bias;  // f32 [E·EI], [E·EI], [E·H] or empty
  };
  /// One decoder layer's device weights; empty buffers for what the architecture lacks.
  struct Layer {
    cuda::DeviceBuffer wq, wk, wv, wo;                      // bf16
    cuda::DeviceBuffer bq, bk, bv, bo;                      // f32 projection biases
    cuda::DeviceBuffer in_norm, post_norm, q_norm, k_norm;  // f32
    cuda::DeviceBuffer sinks;                               // f32 [NH] (gpt-oss)
    cuda::DeviceBuffer wgu, wdown, bgu, bdown;  // dense MLP: bf16 [2I, H] = [gate; up], [H, I]; f32
    bool sliding = false;
    bool is_moe = false;
    Moe moe;
  };
  Layer upload_layer(const TargetLayer& L);
  void moe_forward(const Moe& m, float* x, const uint16_t* hn, int64_t T);

  cuda::CudaContext& ctx_;
  ModelConfig cfg_;
  int64_t max_tokens_;
  float rope_scaling_;
  bool tied_;
  cuda::DeviceBuffer embed_, head_, inv_freq_;
  std::vector<Layer> layers_;
  cuda::DeviceBuffer x_, hn_, q_, k_, v_, o_, gu_, act_, tap_, win_;
  // MoE workspace (empty for dense targets): R = max_tokens · top-k rows.
  cuda::DeviceBuffer logits_, ids_, weights_, perm_, slot_, rexp_, offsets_, xs_, egu_, eact_, ys_;
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
