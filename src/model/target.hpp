// dflash.cpp — the frozen target LLM (HF LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
// Qwen3MoeForCausalLM / GptOssForCausalLM) on the CPU backend: full forward over packed documents
// (taps, final norm, logits) and incremental decoding over a KV cache (prefill, block append,
// rollback) for speculative verification.
//
// Model (HF modeling_llama.py / modeling_qwen2.py / modeling_qwen3.py / modeling_qwen3_moe.py /
// modeling_gpt_oss.py, `*DecoderLayer.forward`):
//   h = embed_tokens[tokens]
//   per layer l: a = RMSNorm_in(h); q,k,v = a·Wqᵀ(+bq), a·Wkᵀ(+bk), a·Wvᵀ(+bv)
//                (Qwen3, Qwen3-MoE: q, k per-head RMSNorm q_norm/k_norm); RoPE(q, k) at each
//                token's position; h += o_proj(softmax(q·kᵀ/sqrt(D))·v)(+bo)  (causal, GQA;
//                sliding layers see only the last `sliding_window` keys; gpt-oss adds one sink
//                logit per head to the softmax, ops/attention.hpp);
//                b = RMSNorm_post(h); dense layers: h += down(silu(gate(b))·up(b));
//                MoE layers: h += Σ_k w_k·expert_k(b) over the router's top-k experts (ops/moe.hpp:
//                Qwen3-MoE softmax → top-k (→ renormalised), SwiGLU experts; gpt-oss biased
//                router, top-k → softmax, clamped SwiGLU experts with biases)
//   final = RMSNorm(h); logits = final·lm_headᵀ (lm_head = embed_tokens when tied)
// Tap `L` is the output of decoder layer L (HF `hidden_states[L+1]`), before the final norm even
// for the last layer, also for MoE targets (the residual stream after the sparse block).
//
// Invariants: weights are kept exactly as stored (bf16 or f32 zero-copy views of the mmap'd
// checkpoint; other float dtypes are converted to f32 once, at load), except gpt-oss experts,
// whose stacked x·W tensors are re-laid out once at load into [OUT, IN] matrices of the stored
// dtype (MXFP4 experts are dequantised to bf16). All compute is fp32
// (fp32 accumulate, fp32 norm statistics, fp32 RoPE angles as HF). Packed documents: positions
// restart at 0 per document and no token attends across documents, so packing changes nothing a
// document computes. A loaded TargetModel is immutable: forward calls are const and may run
// concurrently from several threads (activations live in per-thread scratch that is kept between
// calls, so a forward allocates only its outputs); a TargetKvCache belongs to one caller.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "model/config.hpp"
#include "ops/rope.hpp"

namespace dflash {

/// Options of TargetModel::load.
struct TargetLoadOptions {
  /// Store every weight as an f32 copy instead of the checkpoint's bf16 view (doubles the memory of
  /// a bf16 checkpoint; results are identical since bf16 → f32 is exact). For tests and tools.
  bool f32_weights = false;
};

/// Which rows of logits a forward computes. `none` skips the final norm and the LM head (and, for
/// a forward without KV cache, every layer after the deepest tap).
enum class LogitsRows { none, last, all };

/// What a forward returns besides filling the KV cache.
struct ForwardOptions {
  std::vector<int> tap_layers;  ///< decoder layers to tap (repeats allowed), in output order
  LogitsRows logits = LogitsRows::all;
  bool final_norm = false;  ///< also return the final-norm output [T, H]
};

/// Outputs of a forward. Undefined tensors for what was not asked.
struct ForwardResult {
  Tensor taps;        ///< f32 [T, n_taps·H]: tap i in columns [i·H, (i+1)·H)
  Tensor final_norm;  ///< f32 [T, H]
  Tensor logits;      ///< f32 [T, V] (all) or [1, V] (last: the last token of the input)
};

/// KV cache of one sequence (one document, positions 0..length-1): per layer the k rows (after
/// k_norm and RoPE) and v rows, [length, NKV·D] f32. Created for a model's config; grows on append.
class TargetKvCache {
 public:
  explicit TargetKvCache(const ModelConfig& c);
  /// Cached tokens.
  int64_t length() const { return len_; }
  /// Keeps the first `new_len` tokens (speculative rollback). Throws dflash::Error when
  /// new_len < 0 or new_len > length() (naming both).
  void truncate(int64_t new_len);
  /// Empties the cache (keeps its memory).
  void clear() { truncate(0); }

 private:
  friend class TargetModel;
  int64_t n_layers_ = 0, kv_dim_ = 0, len_ = 0;
  std::vector<std::vector<float>> k_, v_;  // per layer, [capacity, kv_dim] (size ≥ len·kv_dim)
};

/// Weights of a sparse MoE block (HF Qwen3MoeSparseMoeBlock / GptOssMLP): E experts of width EI.
/// Expert matrices are [OUT, IN], bf16 or f32, all of one dtype: gate[e], up[e] [EI, H],
/// down[e] [H, EI] (zero-copy views for Qwen3-MoE, owning tensors for gpt-oss). Biases are f32.
struct TargetMoe {
  Tensor router;                   ///< [E, H] as stored
  std::vector<float> router_bias;  ///< [E] (gpt-oss), empty otherwise
  std::vector<Tensor> gate, up, down;
  std::vector<float> gate_bias, up_bias, down_bias;  ///< [E·EI], [E·EI], [E·H] or empty
};

/// Weights of one decoder layer. Matrices are [OUT, IN] as stored (bf16 or f32); norm weights and
/// biases are f32 copies (empty when the architecture has none). A MoE layer has no dense
/// wgate/wup/wdown and holds its experts in `moe`.
struct TargetLayer {
  Tensor wq, wk, wv, wo, wgate, wup, wdown;
  std::vector<float> bq, bk, bv, bo, bgate, bup, bdown;
  std::vector<float> input_norm, post_norm, q_norm, k_norm;
  std::vector<float> sinks;  ///< [NH] attention sink logits (gpt-oss), empty otherwise
  bool sliding = false;      ///< HF layer_types[l] == "sliding_attention"
  bool is_moe = false;       ///< config.moe_layers[l]
  TargetMoe moe;
};

/// The target model. Load with TargetModel::load.
class TargetModel {
 public:
  /// Loads a HF model folder: config.json (model_config_load) and the safetensors checkpoint
  /// (single file or sharded). Every weight is read once from the mmap'd file, kept as a zero-copy
  /// view when bf16/f32 (or converted to f32 on the fly for other float dtypes; gpt-oss experts
  /// are re-laid out, see the file invariants). Throws
  /// dflash::Error naming the folder and key/tensor for a bad config, a missing tensor or a wrong
  /// shape (check_weights), partial_rotary_factor != 1 (not supported by these architectures' HF
  /// attention), or head_dim odd.
  static TargetModel load(const std::filesystem::path& dir, const TargetLoadOptions& opts = {});

  const ModelConfig& config() const { return cfg_; }
  int64_t num_layers() const { return cfg_.num_hidden_layers; }
  int64_t hidden_size() const { return cfg_.hidden_size; }
  int64_t vocab_size() const { return cfg_.vocab_size; }

  /// Full forward over packed documents. tokens [T] (T ≥ 1, each in [0, V)); doc_offsets
  /// [n_docs+1] (cu_seqlens: 0 = o_0 ≤ o_1 ≤ … ≤ o_n = T). Causal attention inside each document;
  /// positions restart at 0 per document. Throws dflash::Error for empty input, a token id outside
  /// the vocabulary (naming position and id), offsets that do not cover [0, T), a tap layer outside
  /// [0, num_layers) (naming the valid range).
  ForwardResult forward(std::span<const int32_t> tokens, std::span<const int32_t> doc_offsets,
                        const ForwardOptions& opts) const;

  /// Outputs of decoder layers `layer_ids` concatenated: f32 [T, n_taps·H]. Computes no logits
  /// and no layer after the deepest tap. Errors as forward(); an empty `layer_ids` is an error.
  Tensor forward_taps(std::span<const int32_t> tokens, std::span<const int32_t> doc_offsets,
                      std::span<const int> layer_ids) const;

  /// Logits f32 [T, V] of a full forward (for tests and tools).
  Tensor forward_logits(std::span<const int32_t> tokens,
                        std::span<const int32_t> doc_offsets) const;

  /// Appends `tokens` [K] (K ≥ 1) to `cache` at positions length()..length()+K-1: row j attends
  /// causally to the K' = length()+j+1 first tokens (the cache and the block up to itself; block
  /// verification for speculative decoding). Returns logits/taps/final norm of the K rows as
  /// asked; the cache then holds length()+K tokens. Every layer runs (the cache needs them).
  /// Errors as forward() plus a cache built for another config; on error the cache is unchanged.
  ForwardResult append(TargetKvCache& cache, std::span<const int32_t> tokens,
                       const ForwardOptions& opts) const;

  /// Prefill: append() to an empty cache (throws dflash::Error if the cache is not empty).
  /// Default options give the logits of the last prompt token only.
  ForwardResult prefill(TargetKvCache& cache, std::span<const int32_t> tokens,
                        const ForwardOptions& opts = {{}, LogitsRows::last, false}) const;

  /// Logits of final-norm rows (ForwardOptions::final_norm output): logits [rows, V] =
  /// normed [rows, H] · lm_headᵀ. For rows ≤ 16 each row's bits equal those a forward computes
  /// for it (LogitsRows::all or last), whichever rows are asked together: a decoding loop can
  /// compute the rows it needs, one at a time. Throws dflash::Error for rows < 0.
  void lm_head_rows(float* logits, const float* normed, int64_t rows) const;

  /// A fresh, empty KV cache for this model.
  TargetKvCache new_cache() const { return TargetKvCache(cfg_); }

  /// The embedding table as stored: [V, H], bf16 or f32 (a view; do not write).
  const Tensor& embed_tokens() const { return embed_; }
  /// The LM head as stored: [V, H] (the embedding tensor itself when tied).
  const Tensor& lm_head() const { return lm_head_; }
  /// f32 copies of the tables (the drafter's float [V, H] tables; tied → same values).
  std::vector<float> embedding_f32() const { return embed_.to_f32_vector(); }
  std::vector<float> lm_head_f32() const { return lm_head_.to_f32_vector(); }

  /// The RoPE parameters of the ops (from config().rope).
  const RopeParams& rope() const { return rope_; }
  /// RoPE inverse frequencies [D/2] (fp32 as HF) and the attention scaling applied to cos/sin.
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  float rope_scaling() const { return rope_scaling_; }
  /// The decoder layers' weights (read-only; for other backends that copy them).
  const std::vector<TargetLayer>& layers() const { return layers_; }
  /// The final RMSNorm weight [H] (f32).
  const std::vector<float>& final_norm_weight() const { return final_norm_; }

 private:
  struct Rows;  // positions and key ranges of one forward (internal)
  ForwardResult run(const int32_t* tokens, int64_t T, const Rows& rows, TargetKvCache* cache,
                    const ForwardOptions& opts) const;
  void check_request(std::span<const int32_t> tokens, const ForwardOptions& opts) const;

  ModelConfig cfg_;
  RopeParams rope_;
  std::vector<float> inv_freq_;  // [D/2], fp32 as HF
  float rope_scaling_ = 1.0f;
  Tensor embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<TargetLayer> layers_;
};

/// The RoPE op parameters of a config (HF rope_type/rope_parameters resolved by the config
/// loader). Throws dflash::Error naming the config for partial_rotary_factor != 1.
RopeParams rope_params_from_config(const ModelConfig& c);

/// Index of the largest value of `row` [n], the first one on ties (torch.argmax).
int32_t argmax_row(const float* row, int64_t n);

/// Greedy decoding of `prompt` (≥ 1 token): up to `max_new_tokens` tokens, stopping after the
/// first token in `eos_ids` (which is included in the result). With `use_cache` it prefills a KV
/// cache and appends one token per step; without it, every step reruns the full forward on
/// prompt + generated so far (the O(n²) reference loop).
std::vector<int32_t> greedy_generate(const TargetModel& model, std::span<const int32_t> prompt,
                                     int64_t max_new_tokens, std::span<const int64_t> eos_ids,
                                     bool use_cache);

/// The end-of-sequence ids used for generation from model folder `dir`: `eos_token_id` of
/// generation_config.json when present (int or list), else config.json's (`c.eos_token_ids`).
/// Throws dflash::Error naming the file for malformed JSON, a non-integer id or an id outside the
/// vocabulary [0, c.vocab_size).
std::vector<int64_t> generation_eos_ids(const std::filesystem::path& dir, const ModelConfig& c);

}  // namespace dflash
