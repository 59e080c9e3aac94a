// dflash.cpp — the preset table (see presets.hpp). Sizes as in each model's published config.json.
#include "model/presets.hpp"

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace dflash {

namespace {

struct Row {
  const char* name;
  const char* hf_name;
  int mask_token_id;
  const char* config_json;
};

// Qwen family mask id: the first id past the tokenizer's added tokens (DESIGN.md §1, 151669; the
// same for Qwen2.5, whose tokenizer ends earlier, at 151665, and whose embedding has 152064 rows:
// drafter_config_for_target's default); Llama 3: a reserved special token
// (<|reserved_special_token_0|> = 128002). Qwen2.5-32B: the Instruct config (rms_norm_eps 1e-6,
// 32768 positions; the sizes equal the base model's); q/k/v biases come with model_type qwen2.
const Row kRows[] = {
    {"qwen3-8b", "Qwen/Qwen3-8B", 151669, R"({
      "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
      "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
      "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
    {"qwen3-32b", "Qwen/Qwen3-32B", 151669, R"({
      "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120,
      "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
      "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
    {"qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", 151669, R"({
      "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120,
      "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
      "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
      "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
      "use_sliding_window": false, "sliding_window": 131072, "max_window_layers": 64,
      "torch_dtype": "bfloat16"})"},
    {"llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", 128002, R"({
      "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
      "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
      "rope_theta": 500000, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16"})"},
};

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = [] {
    std::vector<ModelPreset> v;
    for (const Row& r : kRows) {
      ModelPreset p;
      p.name = r.name;
      p.hf_name = r.hf_name;
      p.mask_token_id = r.mask_token_id;
      p.config = model_config_from_json(nlohmann::json::parse(r.config_json),
                                        std::string("preset ") + r.name);
      v.push_back(std::move(p));
    }
    return v;
  }();
  return presets;
}

const ModelPreset& model_preset(std::string_view name) {
  std::string known;
  for (const ModelPreset& p : model_presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  fail("unknown preset '{}' (known: {})", name, known);
}

}  // namespace dflash
