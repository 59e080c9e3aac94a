// dflash.cpp — the tensor names and shapes a HF decoder checkpoint must hold, and the check that a
// checkpoint matches its config.json.
//
// Names follow HF transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM state dicts
// (`model.layers.{i}.self_attn.q_proj.weight`, …). Linear weights are [out_features, in_features].
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

/// One tensor the architecture needs.
struct WeightSpec {
  std::string name;
  Shape shape;
};

/// Every tensor `c` requires, in a fixed order (embedding, then layer by layer, then final norm and
/// lm_head unless tied). Per layer (H hidden, D head_dim, NH/NKV heads, I intermediate):
/// q_proj [NH*D, H], k_proj/v_proj [NKV*D, H], o_proj [H, NH*D] (+ biases [NH*D]/[NKV*D]/[H] when
/// attention_bias/o_proj_bias), q_norm/k_norm [D] (qk_norm), gate_proj/up_proj [I, H], down_proj
/// [H, I] (+ biases with mlp_bias), input_layernorm/post_attention_layernorm [H]. Embedding and
/// lm_head [V, H], model.norm [H].
std::vector<WeightSpec> expected_weights(const ModelConfig& c);

/// Result of check_weights.
struct WeightReport {
  int64_t expected_parameters = 0;        ///< sum of numel over expected_weights
  std::vector<std::string> unexpected;    ///< tensors in the checkpoint the architecture does not use
};

/// Checks that `ckpt` holds every tensor of expected_weights(c) with exactly its shape and a float
/// dtype. Throws dflash::Error listing (up to 20 of) the problems — "missing tensor 'X' (expected
/// [a, b])", "tensor 'X' has shape [..] but config.json implies [..]" — together with the
/// checkpoint folder and config source. Tensors present but not expected are returned in
/// `unexpected` and logged with spdlog::warn.
WeightReport check_weights(const ModelConfig& c, const SafetensorsCheckpoint& ckpt);

}  // namespace dflash
