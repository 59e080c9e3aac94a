// dflash.cpp — a HF `config.json` as a typed ModelConfig (qwen3, qwen2, llama, mistral, qwen3_moe,
// gpt_oss).
//
// Invariants of a returned ModelConfig: every size is positive; num_attention_heads is a multiple of
// num_key_value_heads; head_dim is even; layer_types has num_hidden_layers entries and a
// sliding-attention layer implies sliding_window > 0; rope fields are resolved to the values HF
// transformers would use (`modeling_rope_utils.py`, transformers 5: `rope_parameters`, or the
// classic `rope_theta` + `rope_scaling` keys). Keys HF gives a class default are optional here with
// that same default (e.g. num_key_value_heads = num_attention_heads); the keys listed as required
// have no sound default and their absence is an error naming the file and the key. Mixture-of-
// experts configs (qwen3_moe, gpt_oss) have num_experts ≥ num_experts_per_tok ≥ 1, expert_width
// > 0 and moe_layers with one entry per layer; dense configs have num_experts == 0 and no MoE
// layer.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ops/moe.hpp"
#include "ops/rope.hpp"

namespace dflash {

/// Decoder family. `llama` also covers `model_type: "mistral"` (same weights and blocks; Mistral
/// adds a sliding window). `qwen3_moe` is HF Qwen3MoeForCausalLM (Qwen3 attention, sparse MoE
/// blocks), `gpt_oss` is HF GptOssForCausalLM (biased attention with sinks, alternating sliding
/// and full layers, clamped-SwiGLU experts with biases).
enum class Arch { qwen3, qwen2, llama, qwen3_moe, gpt_oss };
/// "qwen3", "qwen2", "llama", "qwen3_moe", "gpt_oss".
std::string_view arch_name(Arch a);

/// The HF name of a RoPE variant (RopeType of ops/rope.hpp): "default", "linear", "llama3", "yarn".
std::string_view rope_type_name(RopeType t);

/// RoPE settings as HF resolves them (transformers `modeling_rope_utils.py`):
/// - default: inv_freq[i] = theta^(-2i/d), d = head_dim * partial_rotary_factor.
/// - linear: inv_freq / factor.
/// - llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by
///   factor, below original_max_position_embeddings / high_freq_factor kept, in between smoothly
///   interpolated.
/// - yarn: per-dimension blend of interpolated (/factor) and extrapolated frequencies with a linear
///   ramp between the correction dims of beta_fast and beta_slow rotations over
///   original_max_position_embeddings (floor/ceil when `truncate`), cos/sin scaled by
///   attention_factor.
struct RopeConfig {
  RopeType type = RopeType::standard;  ///< HF `rope_type` ("default" is standard)
  double theta = 10000.0;               ///< `rope_theta` (base)
  double partial_rotary_factor = 1.0;   ///< fraction of head_dim that is rotated
  double factor = 1.0;                  ///< linear/llama3/yarn scaling factor (1 for default)
  double low_freq_factor = 0.0;         ///< llama3 only
  double high_freq_factor = 0.0;        ///< llama3 only
  /// llama3: required key; yarn: the key, or max_position_embeddings when absent; else 0.
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;              ///< yarn (HF default 32)
  double beta_slow = 1.0;               ///< yarn (HF default 1)
  double mscale = 0.0;                  ///< yarn, 0 when absent
  double mscale_all_dim = 0.0;          ///< yarn, 0 when absent
  bool truncate = true;                 ///< yarn (HF default true)
  /// Scale applied to cos/sin. 1 except for yarn, where it is the key `attention_factor` if given,
  /// else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else
  /// get_mscale(factor) with get_mscale(s, m) = 1 if s <= 1 else 0.1 * m * ln(s) + 1.
  double attention_factor = 1.0;
};

/// Attention kind of one layer (HF `layer_types`).
enum class LayerType { full_attention, sliding_attention };

/// "softmax_topk", "topk_softmax" / "swiglu", "clamped_swiglu".
std::string_view moe_routing_name(MoeRoutingMode m);
std::string_view moe_activation_name(MoeActivation a);

/// The architecture-relevant content of a HF config.json.
struct ModelConfig {
  Arch arch = Arch::qwen3;
  std::string model_type;      ///< as written ("qwen3", "qwen2", "llama", "mistral")
  std::vector<std::string> architectures;  ///< `architectures` (may be empty)
  std::string source;          ///< the file it came from, for messages
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  ///< width of the dense MLP (gpt_oss: of the experts)
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  ///< default num_attention_heads
  int64_t head_dim = 0;             ///< `head_dim`, else hidden_size / num_attention_heads
  int64_t num_hidden_layers = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 0.0;
  bool tie_word_embeddings = false;  ///< HF default false
  bool attention_bias = false;  ///< q/k/v projections have biases (always true for qwen2)
  bool o_proj_bias = false;     ///< o_proj has a bias (attention_bias for llama/qwen3, never qwen2)
  bool mlp_bias = false;        ///< gate/up/down biases (llama `mlp_bias`)
  bool qk_norm = false;         ///< per-head RMSNorm on q and k (qwen3, qwen3_moe)
  bool attention_sinks = false;  ///< per-head sink logits `self_attn.sinks` (gpt_oss)
  std::vector<int64_t> eos_token_ids;  ///< `eos_token_id` (int or list; empty when absent/null)
  /// Window of sliding-attention layers in tokens; 0 when no layer slides.
  int64_t sliding_window = 0;
  std::vector<LayerType> layer_types;  ///< one per layer
  RopeConfig rope;
  std::string dtype;  ///< `dtype` / `torch_dtype` as written ("bfloat16"), may be empty

  // Mixture of experts (qwen3_moe, gpt_oss). Dense configs: num_experts 0, moe_layers all false.
  int64_t num_experts = 0;          ///< `num_experts` / `num_local_experts` (E)
  int64_t num_experts_per_tok = 0;  ///< top-k (K)
  /// Width of one expert's MLP: qwen3_moe `moe_intermediate_size`, gpt_oss `intermediate_size`.
  int64_t expert_width = 0;
  bool norm_topk_prob = false;  ///< qwen3_moe: renormalise the top-k probabilities to sum 1
  int64_t decoder_sparse_step = 1;      ///< qwen3_moe: layer l is sparse when (l+1) % step == 0
  std::vector<int64_t> mlp_only_layers;  ///< qwen3_moe: layers forced dense
  std::vector<bool> moe_layers;  ///< one per layer: a sparse MoE block (true) or a dense MLP
  MoeRoutingMode routing = MoeRoutingMode::softmax_topk;
  bool router_bias = false;  ///< the router has a bias (gpt_oss)
  bool expert_bias = false;  ///< experts' gate/up/down have biases (gpt_oss)
  MoeActivation expert_activation = MoeActivation::swiglu;
  double swiglu_alpha = 1.702;  ///< clamped_swiglu: GptOssExperts.alpha (a constant in HF)
  double swiglu_limit = 7.0;    ///< clamped_swiglu: `swiglu_limit` (HF default 7.0)
  /// `quantization_config.quant_method` when present: "" or "mxfp4" (gpt_oss experts stored as
  /// `*_blocks`/`*_scales`, dequantised at load). Any other method is an error at parse time.
  std::string quantization;

  /// Number of layers of type sliding_attention.
  int num_sliding_layers() const;
  /// Number of layers with a sparse MoE block.
  int num_moe_layers() const;
  /// True for a mixture-of-experts config (num_experts > 0).
  bool is_moe() const { return num_experts > 0; }
};

/// Parses a config.json object. `source` names the file in error messages. Required keys:
/// `model_type`, `hidden_size`, `intermediate_size`, `num_attention_heads`, `num_hidden_layers`,
/// `vocab_size`, `rms_norm_eps`, `max_position_embeddings` (and `head_dim` for qwen3 and
/// qwen3_moe, whose HF default of 128 is not derived from the other sizes). Widths (hidden,
/// intermediate, heads, head_dim, expert count and width) must be <= 2^20, num_hidden_layers <=
/// 2^16, vocab_size <= 2^24 and max_position_embeddings < 2^31: far above real models, they keep
/// size products from overflowing. MoE keys: qwen3_moe `num_experts` (or `num_local_experts`, as
/// transformers 5 writes it), `num_experts_per_tok`, `moe_intermediate_size` are required;
/// `norm_topk_prob` (false), `decoder_sparse_step` (1), `mlp_only_layers` ([]) have HF's defaults.
/// gpt_oss: `num_local_experts` and `num_experts_per_tok` required; `head_dim` (64),
/// `sliding_window` (128), `layer_types` (sliding on even layers), `attention_bias` (true),
/// `rope_parameters` (yarn, factor 32, original 4096, truncate false, theta 150000) and
/// `swiglu_limit` (7) have GptOssConfig's defaults. Throws dflash::Error "<source>: ..." naming the
/// key for a missing/ill-typed/out-of-range key, listing the supported model types for an unknown
/// `model_type`, and naming an unsupported `quantization_config.quant_method`.
ModelConfig model_config_from_json(const nlohmann::json& j, const std::string& source);

/// Loads `path`: a config.json file, or a folder holding one. Errors as model_config_from_json.
ModelConfig model_config_load(const std::filesystem::path& path);

/// Default DFlash target layers (0-based decoder layer indices whose outputs are tapped) for a
/// drafter of `num_draft_layers` over a target of `num_target_layers` (DESIGN.md §1, the DFlash
/// reference): n == 1 -> [N / 2]; else round(1 + i * (N - 4) / (n - 1)) for i in 0..n-1, with
/// Python's round (ties to even), computed exactly in integers. Qwen3-8B, N = 36, n = 5 ->
/// [1, 9, 17, 25, 33]. Ids may repeat for small N (N = 6, n = 5 -> [1, 2, 2, 2, 3]), as in the
/// reference. Throws dflash::Error when n < 1, N < 1, or an id falls outside [0, N).
std::vector<int> default_target_layer_ids(int num_target_layers, int num_draft_layers);

/// The op-level RoPE settings (ops/rope.hpp) of a resolved RopeConfig. `context` names the model in
/// the error thrown when partial_rotary_factor != 1 (the rope op rotates the whole head).
RopeParams rope_params_from_config(const RopeConfig& r, const std::string& context);

}  // namespace dflash
