// dflash.cpp — the tensor names and shapes a HF decoder checkpoint must hold, and the check that a
// checkpoint matches its config.json.
//
// Names follow HF transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
// Qwen3MoeForCausalLM / GptOssForCausalLM checkpoints (`model.layers.{i}.self_attn.q_proj.weight`,
// …). Linear weights are [out_features, in_features]. Qwen3-MoE experts are stored one module per
// expert (`mlp.experts.{e}.gate_proj.weight`, as the released checkpoints and transformers 5's
// save_pretrained write them); gpt-oss experts are stacked 3-D tensors in the x·W layout
// (`mlp.experts.gate_up_proj` [E, H, 2I] with gate/up interleaved on the last axis), or MXFP4
// (`*_blocks` [E, OUT, IN/32, 16] and `*_scales` [E, OUT, IN/32], uint8) when config.json has
// `quantization_config.quant_method: mxfp4`.
// Invariant of check_weights: it never ignores anything silently — a missing tensor or a wrong shape
// is an error naming the tensor, the expected and the found shape; a tensor the architecture does
// not use is returned and logged as a warning.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/config.hpp"
#include "model/safetensors.hpp"

namespace dflash {

/// How a tensor is stored: a float tensor, or the uint8 blocks / scales of MXFP4 data.
enum class WeightFormat { float_any, mxfp4_blocks, mxfp4_scales };

/// One tensor the architecture needs.
struct WeightSpec {
  std::string name;
  Shape shape;
  WeightFormat format = WeightFormat::float_any;
  /// Parameters it holds: numel for float tensors, 2 per byte of MXFP4 blocks, 0 for scales.
  int64_t parameters() const;
};

/// Every tensor `c` requires, in a fixed order (embedding, then layer by layer, then final norm and
/// lm_head unless tied). Per layer (H hidden, D head_dim, NH/NKV heads, I intermediate):
/// q_proj [NH*D, H], k_proj/v_proj [NKV*D, H], o_proj [H, NH*D] (+ biases [NH*D]/[NKV*D]/[H] when
/// attention_bias/o_proj_bias), q_norm/k_norm [D] (qk_norm), gate_proj/up_proj [I, H], down_proj
/// [H, I] (+ biases with mlp_bias), input_layernorm/post_attention_layernorm [H]. Embedding and
/// lm_head [V, H], model.norm [H]. MoE layers (c.moe_layers) instead of gate/up/down:
/// qwen3_moe `mlp.gate.weight` [E, H] and per expert e `mlp.experts.{e}.gate_proj.weight` /
/// `up_proj.weight` [EI, H], `down_proj.weight` [H, EI] (EI = c.expert_width); gpt_oss
/// `self_attn.sinks` [NH], `mlp.router.weight` [E, H], `mlp.router.bias` [E],
/// `mlp.experts.gate_up_proj` [E, H, 2EI] and `down_proj` [E, EI, H] (mxfp4: the `_blocks` and
/// `_scales` listed in the file comment), `gate_up_proj_bias` [E, 2EI], `down_proj_bias` [E, H].
/// Throws dflash::Error naming the config when mxfp4 sizes are not multiples of 32.
std::vector<WeightSpec> expected_weights(const ModelConfig& c);

/// Parameters of a forward through one token: every non-expert parameter plus K of the E experts
/// of each MoE layer (equal to the total for dense models). From the config alone.
int64_t active_parameters(const ModelConfig& c);

/// Result of check_weights.
struct WeightReport {
  int64_t expected_parameters = 0;        ///< sum of WeightSpec::parameters() over expected_weights
  std::vector<std::string> unexpected;    ///< tensors in the checkpoint the architecture does not use
};

/// Checks that `ckpt` holds every tensor of expected_weights(c) with exactly its shape and a float
/// dtype (uint8 for MXFP4 blocks and scales). Throws dflash::Error listing (up to 20 of) the
/// problems — "missing tensor 'X' (expected [a, b])", "tensor 'X' has shape [..] but config.json
/// implies [..]" — together with the
/// checkpoint folder and config source. Tensors present but not expected are returned in
/// `unexpected` and logged with spdlog::warn.
WeightReport check_weights(const ModelConfig& c, const SafetensorsCheckpoint& ckpt);

}  // namespace dflash
