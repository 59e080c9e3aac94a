// Tests of src/model/config: the embedded tiny-qwen3 config.json, qwen2/llama/mistral/qwen3_moe/
// gpt_oss configs as HF writes them (rope in the classic keys and in transformers-5
// `rope_parameters`), HF defaults, every error path (missing/ill-typed key, unknown model_type,
// unsupported rope or quantization) and the default DFlash tap layers; the tensors and parameter
// counts the MoE configs imply (model/weights), against the published totals of Qwen3-30B-A3B
// and gpt-oss-20b. Expected values are the numbers written in the JSON, or HF's formulas
// evaluated in the test (yarn attention factor), or Python's round() results.
#include "model/config.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/target.hpp"
#include "model/weights.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using ::testing::HasSubstr;
using nlohmann::json;

namespace {

void expect_config_error(const json& j, const std::vector<std::string>& parts) {
  try {
    model_config_from_json(j, "cfg/config.json");
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cfg/config.json"));
    for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
  }
}

// Qwen2.5-7B-Instruct's config.json (abridged to the keys HF reads; values as published).
json qwen2_config() {
  return json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 152064})");
}

// Llama-3.1-8B's config.json (classic rope_scaling keys).
json llama31_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "vocab_size": 128256})");
}

// Mistral-7B-v0.1's config.json.
json mistral_config() {
  return json::parse(R"({
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000})");
}

json tiny_config() {
  return json::parse(dflash::test::read_file(dflash::test::assets_dir() / "tiny-qwen3" / "config.json"));
}

}  // namespace

TEST(ModelConfig, TinyQwen3FromFolderAndFile) {
  for (const auto& p : {dflash::test::assets_dir() / "tiny-qwen3",
                        dflash::test::assets_dir() / "tiny-qwen3" / "config.json"}) {
    ModelConfig c = model_config_load(p);
    EXPECT_EQ(c.arch, Arch::qwen3);
    EXPECT_EQ(c.model_type, "qwen3");
    EXPECT_EQ(c.architectures, std::vector<std::string>{"Qwen3ForCausalLM"});
    EXPECT_EQ(c.hidden_size, 384);
    EXPECT_EQ(c.intermediate_size, 1024);
    EXPECT_EQ(c.num_attention_heads, 6);
    EXPECT_EQ(c.num_key_value_heads, 2);
    EXPECT_EQ(c.head_dim, 64);
    EXPECT_EQ(c.num_hidden_layers, 6);
    EXPECT_EQ(c.vocab_size, 8192);
    EXPECT_EQ(c.max_position_embeddings, 4096);
    EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_FALSE(c.attention_bias);
    EXPECT_FALSE(c.o_proj_bias);
    EXPECT_TRUE(c.qk_norm);
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
    EXPECT_EQ(c.rope.type, RopeType::standard);
    EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
    EXPECT_DOUBLE_EQ(c.rope.attention_factor, 1.0);
    EXPECT_EQ(c.sliding_window, 0);
    EXPECT_EQ(c.layer_types.size(), 6u);
    EXPECT_EQ(c.num_sliding_layers(), 0);
    EXPECT_EQ(c.dtype, "bfloat16");
  }
}

TEST(ModelConfig, Qwen2BiasesDerivedHeadDimAndDisabledWindow) {
  ModelConfig c = model_config_from_json(qwen2_config(), "qwen2.json");
  EXPECT_EQ(c.arch, Arch::qwen2);
  EXPECT_EQ(c.head_dim, 3584 / 28);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_TRUE(c.attention_bias);  // Qwen2Attention: q/k/v biases
  EXPECT_FALSE(c.o_proj_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_EQ(c.sliding_window, 0);  // use_sliding_window false
  EXPECT_EQ(c.num_sliding_layers(), 0);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.dtype, "bfloat16");
}

TEST(ModelConfig, Qwen2SlidingWindowFromMaxWindowLayers) {
  json j = qwen2_config();
  j["num_hidden_layers"] = 5;
  j["use_sliding_window"] = true;
  j["sliding_window"] = 1024;
  j["max_window_layers"] = 3;
  ModelConfig c = model_config_from_json(j, "q.json");
  EXPECT_EQ(c.sliding_window, 1024);
  ASSERT_EQ(c.layer_types.size(), 5u);
  EXPECT_EQ(c.layer_types[2], LayerType::full_attention);
  EXPECT_EQ(c.layer_types[3], LayerType::sliding_attention);
  EXPECT_EQ(c.layer_types[4], LayerType::sliding_attention);
  EXPECT_EQ(c.num_sliding_layers(), 2);
  // Explicit layer_types win over max_window_layers.
  j["layer_types"] = {"sliding_attention", "full_attention", "full_attention", "full_attention",
                      "full_attention"};
  c = model_config_from_json(j, "q.json");
  EXPECT_EQ(c.layer_types[0], LayerType::sliding_attention);
  EXPECT_EQ(c.num_sliding_layers(), 1);
}

TEST(ModelConfig, Llama31ClassicRopeScaling) {
  ModelConfig c = model_config_from_json(llama31_config(), "llama.json");
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c.rope.type, RopeType::llama3);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
}

TEST(ModelConfig, LlamaRopeParametersOfTransformers5) {
  json j = llama31_config();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "llama3"},
                          {"rope_theta", 500000.0},
                          {"factor", 32.0},
                          {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  j["attention_bias"] = true;
  j["mlp_bias"] = true;
  j["head_dim"] = 64;
  ModelConfig c = model_config_from_json(j, "llama5.json");
  EXPECT_EQ(c.rope.type, RopeType::llama3);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.o_proj_bias);
  EXPECT_TRUE(c.mlp_bias);
  EXPECT_EQ(c.head_dim, 64);
  // Default rope in rope_parameters.
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  c = model_config_from_json(j, "llama5.json");
  EXPECT_EQ(c.rope.type, RopeType::standard);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
}

TEST(ModelConfig, Llama3RopeNeedsAllItsKeys) {
  for (const char* k : {"factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"}) {
    json j = llama31_config();
    j["rope_scaling"].erase(k);
    expect_config_error(j, {std::string("rope_scaling.") + k});
  }
}

TEST(ModelConfig, LinearRopeWithLegacyTypeKey) {
  json j = llama31_config();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  ModelConfig c = model_config_from_json(j, "lin.json");
  EXPECT_EQ(c.rope.type, RopeType::linear);
  EXPECT_DOUBLE_EQ(c.rope.factor, 2.0);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
}

TEST(ModelConfig, YarnDefaultsAndAttentionFactor) {
  // Qwen3 long-context recipe: factor 4 over 32768 tokens. HF: attention_factor = 0.1 ln(4) + 1,
  // beta_fast 32, beta_slow 1.
  json j = tiny_config();
  j["max_position_embeddings"] = 131072;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0},
                       {"original_max_position_embeddings", 32768}};
  ModelConfig c = model_config_from_json(j, "yarn.json");
  EXPECT_EQ(c.rope.type, RopeType::yarn);
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_TRUE(c.rope.truncate);
  EXPECT_NEAR(c.rope.attention_factor, 1.138629436111989, 1e-12);

  // mscale / mscale_all_dim (DeepSeek style) and explicit betas, in rope_parameters.
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 40.0},
                          {"mscale", 0.707},     {"mscale_all_dim", 1.0}, {"beta_fast", 16},
                          {"beta_slow", 2},      {"truncate", false}};
  c = model_config_from_json(j, "yarn5.json");
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_NEAR(c.rope.attention_factor, 0.9210423553163399, 1e-12);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 2.0);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 131072);  // max_position_embeddings

  // Explicit attention_factor wins; no factor: max_position_embeddings / original.
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"original_max_position_embeddings", 32768},
                          {"attention_factor", 0.5}};
  j["max_position_embeddings"] = 40960;
  c = model_config_from_json(j, "yarn6.json");
  EXPECT_DOUBLE_EQ(c.rope.factor, 40960.0 / 32768.0);
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, 0.5);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);  // from the top-level rope_theta

  j["rope_parameters"] = {{"rope_type", "yarn"}};
  expect_config_error(j, {"factor"});
}

TEST(ModelConfig, RopeErrors) {
  json j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  expect_config_error(j, {"'dynamic'", "default, linear, llama3, yarn"});
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  expect_config_error(j, {"rope_scaling", "rope_parameters", "disagree"});
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}},
                          {"sliding_attention", {{"rope_type", "default"}}}};
  expect_config_error(j, {"per-layer"});
  j["rope_parameters"] = {{"rope_type", "linear"}, {"factor", -1.0}};
  expect_config_error(j, {"rope_parameters.factor", "> 0"});
}

TEST(ModelConfig, MistralSlidingWindowAndDefaults) {
  ModelConfig c = model_config_from_json(mistral_config(), "mistral.json");
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.num_sliding_layers(), 32);  // Mistral slides on every layer
  EXPECT_EQ(c.rope.type, RopeType::standard);

  json j = mistral_config();
  j["sliding_window"] = nullptr;  // v0.2+: no window
  j["head_dim"] = nullptr;        // null head_dim: derived
  c = model_config_from_json(j, "m2.json");
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.num_sliding_layers(), 0);
  EXPECT_EQ(c.head_dim, 128);

  j.erase("sliding_window");  // MistralConfig's default window is 4096
  c = model_config_from_json(j, "m3.json");
  EXPECT_EQ(c.sliding_window, 4096);

  j = mistral_config();
  j.erase("num_key_value_heads");  // HF default: as many as query heads
  j.erase("tie_word_embeddings");  // HF default: untied
  c = model_config_from_json(j, "m4.json");
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(ModelConfig, MissingRequiredKeys) {
  for (const char* k : {"model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                        "head_dim"}) {
    json j = tiny_config();
    j.erase(k);
    expect_config_error(j, {std::string("'") + k + "'"});
  }
  // A null value counts as missing.
  json j = tiny_config();
  j["hidden_size"] = nullptr;
  expect_config_error(j, {"missing required key 'hidden_size'"});
}

TEST(ModelConfig, IllTypedOrOutOfRangeValues) {
  json j = tiny_config();
  j["hidden_size"] = "384";
  expect_config_error(j, {"'hidden_size'", "integer"});
  j = tiny_config();
  j["num_hidden_layers"] = 2.5;
  expect_config_error(j, {"'num_hidden_layers'", "integer"});
  j = tiny_config();
  j["vocab_size"] = 0;
  expect_config_error(j, {"'vocab_size'", ">= 1"});
  j = tiny_config();
  j["tie_word_embeddings"] = "yes";
  expect_config_error(j, {"'tie_word_embeddings'"});
  j = tiny_config();
  j["num_key_value_heads"] = 4;
  expect_config_error(j, {"num_key_value_heads", "multiple"});
  j = tiny_config();
  j["head_dim"] = 63;
  expect_config_error(j, {"head_dim", "even"});
  j = tiny_config();
  j["eos_token_id"] = "</s>";
  expect_config_error(j, {"'eos_token_id'"});
  j = tiny_config();
  j["layer_types"] = {"full_attention"};
  expect_config_error(j, {"'layer_types'", "1 entries", "6"});
  j = tiny_config();
  j["layer_types"][2] = "chunked_attention";
  expect_config_error(j, {"layer_types[2]", "chunked_attention"});
  j = tiny_config();
  j["layer_types"][0] = "sliding_attention";  // but use_sliding_window is false
  expect_config_error(j, {"sliding"});
  j = tiny_config();
  j["rms_norm_eps"] = "1e-6";
  expect_config_error(j, {"'rms_norm_eps'", "number"});
  // A whole-number float is accepted for an integer key (some exporters write 4096.0).
  j = tiny_config();
  j["max_position_embeddings"] = 4096.0;
  EXPECT_EQ(model_config_from_json(j, "f.json").max_position_embeddings, 4096);
}

// Qwen3-30B-A3B's config.json (values as published).
json qwen3_moe_config() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

// gpt-oss-20b's config.json (values as published; layer_types alternate, starting sliding).
json gpt_oss_config() {
  json j = json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
        "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
    "vocab_size": 201088})");
  for (int i = 0; i < 24; ++i)
    j["layer_types"].push_back(i % 2 ? "full_attention" : "sliding_attention");
  return j;
}

int64_t total_parameters(const ModelConfig& c) {
  int64_t n = 0;
  for (const WeightSpec& s : expected_weights(c)) n += s.parameters();
  return n;
}

TEST(ModelConfig, Qwen3MoeExpertsAndPublishedParameterCounts) {
  const ModelConfig c = model_config_from_json(qwen3_moe_config(), "q3moe.json");
  EXPECT_EQ(c.arch, Arch::qwen3_moe);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_sinks);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.expert_width, 768);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.routing, MoeRoutingMode::softmax_topk);
  EXPECT_EQ(c.expert_activation, MoeActivation::swiglu);
  EXPECT_EQ(c.num_moe_layers(), 48);
  EXPECT_EQ(c.num_sliding_layers(), 0);
  // HF's index.json of Qwen3-30B-A3B: 30,532,122,624 parameters; "3.3B activated".
  EXPECT_EQ(total_parameters(c), 30532122624);
  EXPECT_EQ(active_parameters(c), 30532122624 - 48LL * 120 * 3 * 768 * 2048);
  const auto w = expected_weights(c);
  auto has = [&](const std::string& n) {
    return std::any_of(w.begin(), w.end(), [&](const WeightSpec& s) { return s.name == n; });
  };
  EXPECT_TRUE(has("model.layers.47.mlp.experts.127.down_proj.weight"));
  EXPECT_TRUE(has("model.layers.0.mlp.gate.weight"));
  EXPECT_FALSE(has("model.layers.0.mlp.gate_proj.weight"));
}

TEST(ModelConfig, Qwen3MoeDenseLayersWindowAndKeyForms) {
  json j = qwen3_moe_config();
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;  // sparse: (l + 1) % 2 == 0 -> 1, 3, 5
  j["mlp_only_layers"] = {3};
  j.erase("num_experts");
  j["num_local_experts"] = 16;  // as transformers 5 writes it
  j["use_sliding_window"] = true;
  j.erase("sliding_window");  // Qwen3MoeConfig's default window: 4096, on every layer
  j.erase("norm_topk_prob");  // default false
  ModelConfig c = model_config_from_json(j, "q.json");
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.num_sliding_layers(), 6);
  EXPECT_EQ(active_parameters(c),
            total_parameters(c) - 2LL * (16 - 8) * 3 * 768 * 2048);  // 2 sparse layers

  j["layer_types"] = json::array();
  for (int i = 0; i < 6; ++i)
    j["layer_types"].push_back(i ? "sliding_attention" : "full_attention");
  expect_config_error(j, {"layer_types", "disagrees"});
  j.erase("layer_types");
  j["num_experts"] = 8;
  expect_config_error(j, {"'num_experts' (8)", "'num_local_experts' (16)", "disagree"});
  j.erase("num_experts");
  j.erase("num_local_experts");
  expect_config_error(j, {"missing required key 'num_experts'"});
  j["num_experts"] = 4;
  expect_config_error(j, {"num_experts_per_tok (8) exceeds the number of experts (4)"});
  j["num_experts"] = 16;
  j["mlp_only_layers"] = {6};
  expect_config_error(j, {"mlp_only_layers", "[0, 6)"});
  j["mlp_only_layers"] = json::array();
  j.erase("moe_intermediate_size");
  expect_config_error(j, {"missing required key 'moe_intermediate_size'"});
  j["moe_intermediate_size"] = 768;
  j.erase("head_dim");
  expect_config_error(j, {"missing required key 'head_dim'", "qwen3_moe"});
}

TEST(ModelConfig, GptOssReleasedConfigAndPublishedParameterCounts) {
  const ModelConfig c = model_config_from_json(gpt_oss_config(), "goss.json");
  EXPECT_EQ(c.arch, Arch::gpt_oss);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.o_proj_bias);
  EXPECT_TRUE(c.attention_sinks);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.expert_width, 2880);
  EXPECT_EQ(c.routing, MoeRoutingMode::topk_softmax);
  EXPECT_TRUE(c.router_bias && c.expert_bias);
  EXPECT_EQ(c.expert_activation, MoeActivation::clamped_swiglu);
  EXPECT_EQ(c.swiglu_limit, 7.0);
  EXPECT_EQ(c.quantization, "mxfp4");
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_EQ(c.num_sliding_layers(), 12);
  EXPECT_EQ(c.layer_types[0], LayerType::sliding_attention);
  EXPECT_EQ(c.rope.type, RopeType::yarn);
  EXPECT_EQ(c.rope.theta, 150000.0);
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_NEAR(c.rope.attention_factor, 0.1 * std::log(32.0) + 1.0, 1e-12);
  // OpenAI's model card: 20.91B parameters, 3.61B active (the card leaves the embedding table
  // out of the active count; ours keeps it, as Qwen's "3.3B activated" does). Per layer: q/k/v/o
  // with biases, sinks, a biased router, 32 experts (gate_up, its bias, down, its bias), 2 norms.
  const int64_t H = 2880, attn = 4096 * H * 2 + 512 * H * 2 + 4096 + 512 * 2 + H + 64;
  const int64_t expert = H * 2 * H + 2 * H + H * H + H, router = 32 * H + 32;
  const int64_t embedding = 201088LL * H;
  EXPECT_EQ(total_parameters(c), 24 * (attn + router + 32 * expert + 2 * H) + 2 * embedding + H);
  EXPECT_EQ(total_parameters(c), 20914757184);  // "20.91B"
  EXPECT_EQ(active_parameters(c) - embedding, 3608307264);  // "3.61B"
  const auto w = expected_weights(c);
  const auto it = std::find_if(w.begin(), w.end(), [](const WeightSpec& s) {
    return s.name == "model.layers.3.mlp.experts.gate_up_proj_blocks";
  });
  ASSERT_NE(it, w.end());
  EXPECT_EQ(it->shape, (Shape{32, 5760, 90, 16}));
  EXPECT_EQ(it->format, WeightFormat::mxfp4_blocks);
}

TEST(ModelConfig, GptOssClassDefaultsAndQuantizationErrors) {
  json j = gpt_oss_config();
  for (const char* k : {"layer_types", "sliding_window", "rope_scaling", "rope_theta", "head_dim",
                        "attention_bias", "swiglu_limit", "quantization_config"})
    j.erase(k);
  const ModelConfig c = model_config_from_json(j, "g.json");
  EXPECT_EQ(c.head_dim, 64);  // GptOssConfig default, not 2880 / 64
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_EQ(c.layer_types[0], LayerType::sliding_attention);
  EXPECT_EQ(c.layer_types[1], LayerType::full_attention);
  EXPECT_EQ(c.rope.type, RopeType::yarn);
  EXPECT_EQ(c.rope.theta, 150000.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.quantization.empty());
  const auto w = expected_weights(c);
  EXPECT_TRUE(std::any_of(w.begin(), w.end(), [](const WeightSpec& s) {
    return s.name == "model.layers.0.mlp.experts.gate_up_proj" && s.shape == Shape{32, 2880, 5760};
  }));

  j["quantization_config"] = {{"quant_method", "gptq"}};
  expect_config_error(j, {"quant_method 'gptq' is not supported"});
  json q = qwen2_config();
  q["quantization_config"] = {{"quant_method", "mxfp4"}};
  expect_config_error(q, {"quant_method 'mxfp4' is not supported for qwen2"});
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  j["hidden_size"] = 2888;  // not a multiple of 32
  const ModelConfig bad = model_config_from_json(j, "g.json");
  try {
    expected_weights(bad);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("multiples of 32"));
  }
}

TEST(ModelConfig, SizesHaveUpperBounds) {
  // Far above real models; a corrupt size would overflow parameter counts or allocate per layer.
  for (const auto& [key, big] : std::vector<std::pair<std::string, int64_t>>{
           {"hidden_size", (int64_t{1} << 20) + 1},
           {"num_hidden_layers", int64_t{1} << 40},
           {"vocab_size", (int64_t{1} << 24) + 1},
           {"head_dim", int64_t{1} << 22},
           {"max_position_embeddings", int64_t{1} << 31}}) {
    json j = tiny_config();
    j[key] = big;
    expect_config_error(j, {"'" + key + "'", "must be <="});
  }
  for (const std::string key : {"num_experts", "moe_intermediate_size"}) {
    json j = qwen3_moe_config();
    j[key] = (int64_t{1} << 20) + 1;
    expect_config_error(j, {"'" + key + "'", "must be <="});
  }
}

TEST(ModelConfig, EosTokenIdForms) {
  json j = tiny_config();
  j["eos_token_id"] = {5, 7};
  EXPECT_EQ(model_config_from_json(j, "e").eos_token_ids, (std::vector<int64_t>{5, 7}));
  j["eos_token_id"] = nullptr;
  EXPECT_TRUE(model_config_from_json(j, "e").eos_token_ids.empty());
  j.erase("eos_token_id");
  EXPECT_TRUE(model_config_from_json(j, "e").eos_token_ids.empty());
  // An id outside the vocabulary could never be generated: the config is wrong.
  j["eos_token_id"] = {5, j["vocab_size"]};
  expect_config_error(j, {"'eos_token_id'", "[0, vocab_size = 8192)"});
  j["eos_token_id"] = -1;
  expect_config_error(j, {"'eos_token_id'"});
}

TEST(ModelConfig, GenerationEosIdsMustBeTokensOfTheVocabulary) {
  test::TempDir dir;
  const ModelConfig c = model_config_from_json(tiny_config(), "config.json");
  test::write_file(dir / "generation_config.json", R"({"eos_token_id": [2, 99999]})");
  try {
    generation_eos_ids(dir.path(), c);
    ADD_FAILURE() << "an eos id outside the vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("99999, which is not a token"), std::string::npos)
        << e.what();
  }
  test::write_file(dir / "generation_config.json", R"({"eos_token_id": [2, 1]})");
  EXPECT_EQ(generation_eos_ids(dir.path(), c), (std::vector<int64_t>{2, 1}));
}

TEST(ModelConfig, UnknownModelTypeListsTheSupportedOnes) {
  json j = tiny_config();
  j["model_type"] = "gpt2";
  expect_config_error(j, {"'gpt2'", "qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "gpt_oss"});
}

TEST(ModelConfig, LoadErrorsNameTheFile) {
  dflash::test::TempDir dir;
  try {
    model_config_load(dir.path());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr((dir / "config.json").string()));
  }
  dflash::test::write_file(dir / "config.json", R"({"model_type": "qwen3", "hidden_size": })");
  try {
    model_config_load(dir.path());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("config.json"));
    EXPECT_THAT(e.what(), HasSubstr("malformed JSON"));
  }
}

TEST(DefaultTargetLayerIds, MatchesPythonRound) {
  // Values of Python's [N//2] if n == 1 else [round(1 + i*(N-4)/(n-1)) for i in range(n)].
  EXPECT_EQ(default_target_layer_ids(36, 5), (std::vector<int>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_target_layer_ids(36, 1), (std::vector<int>{18}));
  EXPECT_EQ(default_target_layer_ids(7, 1), (std::vector<int>{3}));
  EXPECT_EQ(default_target_layer_ids(6, 2), (std::vector<int>{1, 3}));
  EXPECT_EQ(default_target_layer_ids(6, 5), (std::vector<int>{1, 2, 2, 2, 3}));  // ties to even
  EXPECT_EQ(default_target_layer_ids(28, 3), (std::vector<int>{1, 13, 25}));
  EXPECT_EQ(default_target_layer_ids(32, 4), (std::vector<int>{1, 10, 20, 29}));
  EXPECT_EQ(default_target_layer_ids(40, 6), (std::vector<int>{1, 8, 15, 23, 30, 37}));
  EXPECT_EQ(default_target_layer_ids(12, 5), (std::vector<int>{1, 3, 5, 7, 9}));
  EXPECT_EQ(default_target_layer_ids(5, 4), (std::vector<int>{1, 1, 2, 2}));
  EXPECT_EQ(default_target_layer_ids(64, 8), (std::vector<int>{1, 10, 18, 27, 35, 44, 52, 61}));
}

TEST(DefaultTargetLayerIds, RejectsImpossibleRequests) {
  EXPECT_THROW(default_target_layer_ids(36, 0), Error);
  EXPECT_THROW(default_target_layer_ids(0, 1), Error);
  EXPECT_THROW(default_target_layer_ids(2, 3), Error);  // would give layer -1
}
