// Tests of src/model/config: the embedded tiny-qwen3 config.json, qwen2/llama/mistral configs as HF
// writes them (rope in the classic keys and in transformers-5 `rope_parameters`), HF defaults,
// every error path (missing/ill-typed key, unknown model_type, unsupported rope) and the default
// DFlash tap layers. Expected values are the numbers written in the JSON, or HF's formulas
// evaluated in the test (yarn attention factor), or Python's round() results.
#include "model/config.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/target.hpp"
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
  expect_config_error(j, {"'gpt2'", "qwen3", "qwen2", "llama", "mistral"});
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
