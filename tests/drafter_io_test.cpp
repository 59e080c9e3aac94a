// Tests of src/model/drafter_io: the export config against the public reference trainer's
// drafter config (golden fixture), config.json variants and errors, save/load round trips
// (bf16 and f32), missing/unexpected/misshapen tensors, target compatibility checks and the
// mask-token rules (tiny-qwen3 tokenizer and the real Qwen3 tokenizer).
#include "model/drafter_io.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/rng.hpp"
#include "data/tokenizer.hpp"
#include "model/config.hpp"
#include "model/safetensors.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

/// Runs `f`, expects a dflash::Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
    }
    return;
  }
  ADD_FAILURE() << "no dflash::Error thrown";
}

const json& golden() {
  static const json j = json_load_file(test::shared_dir() / "fixtures/dflash-step.golden.json");
  return j;
}
const json& golden_cfg() {
  return golden().at("drafter_config");
}

ModelConfig tiny_target() {
  return model_config_load(test::assets_dir() / "tiny-qwen3");
}

const Tokenizer& tiny_tok() {
  static const Tokenizer t = Tokenizer::load(test::assets_dir() / "tiny-qwen3");
  return t;
}

/// A small valid drafter config (2 layers, GQA 2) with non-trivial values everywhere.
DrafterConfig small_cfg() {
  DrafterConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 50;
  c.rms_norm_eps = 1e-5;
  c.rope.theta = 5e5;
  c.max_position_embeddings = 2048;
  c.block_size = 7;
  c.mask_token_id = 49;
  c.target_layer_ids = {0, 2, 3};
  c.num_target_layers = 5;
  c.validate();
  return c;
}

std::vector<float> random_params(const DrafterLayout& layout, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> p(static_cast<size_t>(layout.total));
  for (float& x : p) x = static_cast<float>(0.7 * rng.normal());
  return p;
}

void expect_same_config(const DrafterConfig& a, const DrafterConfig& b) {
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.block_size, b.block_size);
  EXPECT_EQ(a.mask_token_id, b.mask_token_id);
  EXPECT_EQ(a.target_layer_ids, b.target_layer_ids);
  EXPECT_EQ(a.num_target_layers, b.num_target_layers);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  // The op's frequencies and scaling are what matter downstream.
  EXPECT_EQ(rope_inv_freq(a.rope, a.head_dim), rope_inv_freq(b.rope, b.head_dim));
  EXPECT_EQ(rope_attention_scaling(a.rope), rope_attention_scaling(b.rope));
}


}  // namespace

// ---- config.json ----------------------------------------------------------------------------

TEST(DrafterIo, ExportConfigEqualsGoldenOnSharedKeys) {
  // The golden drafter: 2 layers, intermediate 256, over tiny-qwen3, mask 8000, taps [1, 3]
  // (= the DESIGN.md default for N = 6, n = 2).
  DrafterSizes sizes;
  sizes.intermediate_size = 256;
  const DrafterConfig c =
      drafter_config_for_target(tiny_target(), 2, sizes, 8000, std::nullopt, &tiny_tok());
  const json mine = drafter_export_config(c);
  const json& g = golden_cfg();
  int shared = 0;
  for (auto it = g.begin(); it != g.end(); ++it) {
    ASSERT_TRUE(mine.contains(it.key())) << "export config lacks golden key " << it.key();
    EXPECT_EQ(mine[it.key()], it.value()) << "key " << it.key();
    ++shared;
  }
  EXPECT_GE(shared, 18);
  EXPECT_EQ(mine["model_type"], "qwen3");
  EXPECT_TRUE(mine["rope_scaling"].is_null());
  // And it parses back to the same config.
  expect_same_config(drafter_config_from_json(mine, "mine"), c);
}

TEST(DrafterIo, ParsesGoldenConfigWithoutModelType) {
  ASSERT_FALSE(golden_cfg().contains("model_type"));
  const DrafterConfig c = drafter_config_from_json(golden_cfg(), "golden");
  EXPECT_EQ(c.hidden_size, 384);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 6);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 8192);
  EXPECT_EQ(c.block_size, 16);
  EXPECT_EQ(c.mask_token_id, 8000);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{1, 3}));
  EXPECT_EQ(c.num_target_layers, 6);
  EXPECT_EQ(c.rope.type, RopeType::standard);
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  // Without the DFlash architecture, a missing model_type is not guessed.
  json j = golden_cfg();
  j["architectures"] = json::array({"Qwen3ForCausalLM"});
  expect_error([&] { drafter_config_from_json(j, "cfg.json"); }, {"cfg.json", "model_type"});
  j = golden_cfg();
  j["model_type"] = "llama";
  expect_error([&] { drafter_config_from_json(j, "cfg.json"); }, {"cfg.json", "model_type"});
}

TEST(DrafterIo, RopeVariantsRoundTrip) {
  std::vector<RopeParams> ropes(4);
  ropes[1].type = RopeType::linear;
  ropes[1].factor = 2.5;
  ropes[2].type = RopeType::llama3;
  ropes[2].factor = 8;
  ropes[2].low_freq_factor = 1;
  ropes[2].high_freq_factor = 4;
  ropes[2].original_max_position_embeddings = 8192;
  ropes[3].type = RopeType::yarn;
  ropes[3].factor = 4;
  ropes[3].original_max_position_embeddings = 1024;
  ropes[3].beta_fast = 16;
  ropes[3].truncate = false;
  for (const RopeParams& r : ropes) {
    DrafterConfig c = small_cfg();
    c.rope = r;
    c.rope.theta = 1e4;
    const json j = drafter_export_config(c);
    EXPECT_EQ(j["rope_scaling"].is_null(), r.type == RopeType::standard);
    if (r.type != RopeType::standard) {
      EXPECT_EQ(j["rope_scaling"]["rope_type"], rope_type_name(r.type));
    }
    expect_same_config(drafter_config_from_json(j, "x"), c);
  }
}

TEST(DrafterIo, NestedAndTopLevelKeys) {
  const json base = drafter_export_config(small_cfg());
  // Top-level mask and nested block size.
  json j = base;
  j["mask_token_id"] = 48;
  j["dflash_config"].erase("mask_token_id");
  j["dflash_config"]["block_size"] = 7;
  j.erase("block_size");
  DrafterConfig c = drafter_config_from_json(j, "a.json");
  EXPECT_EQ(c.mask_token_id, 48);
  EXPECT_EQ(c.block_size, 7);
  // Both places, same value: fine.
  j = base;
  j["mask_token_id"] = 49;
  j["dflash_config"]["block_size"] = 7;
  c = drafter_config_from_json(j, "a.json");
  EXPECT_EQ(c.mask_token_id, 49);
  // Both places, different values: error naming both keys.
  j = base;
  j["dflash_config"]["block_size"] = 8;
  expect_error([&] { drafter_config_from_json(j, "b.json"); },
               {"b.json", "'block_size' (7)", "'dflash_config.block_size' (8)"});
  j = base;
  j["mask_token_id"] = 3;
  expect_error([&] { drafter_config_from_json(j, "b.json"); },
               {"b.json", "mask_token_id", "dflash_config.mask_token_id"});
  // Top-level target_layer_ids only.
  j = base;
  j["target_layer_ids"] = j["dflash_config"]["target_layer_ids"];
  j.erase("dflash_config");
  j["mask_token_id"] = 49;
  c = drafter_config_from_json(j, "a.json");
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{0, 2, 3}));
}

TEST(DrafterIo, MissingOrBadDflashKeysAreErrors) {
  const json base = drafter_export_config(small_cfg());
  json j = base;
  j["dflash_config"].erase("target_layer_ids");
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "target_layer_ids"});
  j = base;
  j["dflash_config"].erase("mask_token_id");
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "mask_token_id"});
  j = base;
  j.erase("block_size");
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "block_size"});
  j = base;
  j.erase("num_target_layers");
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "num_target_layers"});
  j = base;
  j["dflash_config"]["target_layer_ids"] = {0, 5};  // 5 layers: ids in [0, 5)
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "dflash_config.target_layer_ids", "5"});
  j = base;
  j["dflash_config"]["mask_token_id"] = 50;  // vocab 50
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "mask_token_id"});
  j = base;
  j.erase("head_dim");
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "head_dim"});
  j = base;
  j["attention_bias"] = true;
  expect_error([&] { drafter_config_from_json(j, "d/config.json"); },
               {"d/config.json", "attention_bias"});
}

// ---- save / load ----------------------------------------------------------------------------

TEST(DrafterIo, SaveLoadRoundTripF32AndBf16) {
  const DrafterConfig c = small_cfg();
  const DrafterLayout layout(c);
  const std::vector<float> params = random_params(layout, 7);
  for (DType dt : {DType::f32, DType::bf16}) {
    test::TempDir dir;
    const fs::path d = dir / "drafter";
    drafter_save(d, c, layout, params, dt);
    // The folder holds exactly the two files, tensors under the export names and the dtype.
    std::set<std::string> files;
    for (const auto& e : fs::directory_iterator(d)) files.insert(e.path().filename().string());
    EXPECT_EQ(files, (std::set<std::string>{"config.json", "model.safetensors"}));
    SafetensorsFile f(d / "model.safetensors");
    ASSERT_EQ(f.size(), layout.params.size());
    for (const ParamInfo& p : layout.params) {
      ASSERT_TRUE(f.contains(p.name)) << p.name;
      EXPECT_EQ(f.info(p.name).dtype, dt);
      EXPECT_EQ(f.info(p.name).shape, p.shape);
    }
    const json cj = json_load_file(d / "config.json");
    EXPECT_EQ(cj["dtype"], dt == DType::bf16 ? "bfloat16" : "float32");

    const LoadedDrafter ld = drafter_load(d);
    expect_same_config(ld.config, c);
    ASSERT_EQ(ld.layout.total, layout.total);
    ASSERT_EQ(ld.params.size(), params.size());
    size_t diffs = 0, rounded = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const float want = dt == DType::bf16 ? round_to_bf16(params[i]) : params[i];
      diffs += ld.params[i] != want;
      rounded += ld.params[i] != params[i];
    }
    EXPECT_EQ(diffs, 0u) << dtype_name(dt);
    if (dt == DType::bf16) {
      EXPECT_GT(rounded, params.size() / 2);  // bf16 really rounded
    }
  }
}

TEST(DrafterIo, SaveRejectsBadArguments) {
  const DrafterConfig c = small_cfg();
  const DrafterLayout layout(c);
  test::TempDir dir;
  std::vector<float> params = random_params(layout, 1);
  expect_error([&] { drafter_save(dir / "x", c, layout, params, DType::f16); }, {"bf16 or f32"});
  params.pop_back();
  expect_error([&] { drafter_save(dir / "x", c, layout, params); }, {std::to_string(layout.total)});
}

TEST(DrafterIo, LoadNamesMissingUnexpectedAndMisshapenTensors) {
  const DrafterConfig c = small_cfg();
  const DrafterLayout layout(c);
  const std::vector<float> params = random_params(layout, 3);
  test::TempDir dir;
  const fs::path d = dir / "drafter";
  drafter_save(d, c, layout, params, DType::f32);
  SafetensorsFile orig(d / "model.safetensors");
  auto rewrite = [&](const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    std::map<std::string, Tensor> m;
    for (const std::string& n : orig.names()) m[n] = orig.get(n).contiguous();
    edit(m);
    safetensors_write(d / "model.safetensors", m);
  };
  // Missing tensors.
  rewrite([](auto& m) {
    m.erase("layers.1.self_attn.k_norm.weight");
    m.erase("fc.weight");
  });
  expect_error([&] { drafter_load(d); },
               {d.string(), "missing", "layers.1.self_attn.k_norm.weight", "fc.weight"});
  // Unexpected tensors (an embedding, a third layer).
  rewrite([&](auto& m) {
    m.clear();
    for (const std::string& n : orig.names()) m[n] = orig.get(n).contiguous();
    m["embed_tokens.weight"] = Tensor::zeros({50, 16}, DType::f32);
    m["layers.2.mlp.up_proj.weight"] = Tensor::zeros({24, 16}, DType::f32);
  });
  expect_error([&] { drafter_load(d); },
               {d.string(), "unexpected", "embed_tokens.weight", "layers.2.mlp.up_proj.weight"});
  // A wrong shape (transposed) and a non-float dtype.
  rewrite([&](auto& m) {
    m.clear();
    for (const std::string& n : orig.names()) m[n] = orig.get(n).contiguous();
    m["layers.0.mlp.down_proj.weight"] = Tensor::zeros({24, 16}, DType::f32);
    m["norm.weight"] = Tensor::zeros({16}, DType::i32);
  });
  expect_error([&] { drafter_load(d); },
               {"layers.0.mlp.down_proj.weight", "[24, 16]", "[16, 24]", "norm.weight", "i32"});
  // A broken config.json is named.
  test::write_file(d / "config.json", "{\"model_type\": \"qwen3\"}");
  expect_error([&] { drafter_load(d); }, {(d / "config.json").string(), "hidden_size"});
}

// ---- target compatibility and defaults --------------------------------------------------------

TEST(DrafterIo, CheckTargetNamesEachMismatch) {
  const ModelConfig t = tiny_target();
  const DrafterConfig good = drafter_config_from_json(golden_cfg(), "golden");
  EXPECT_NO_THROW(drafter_check_target(good, t));
  DrafterConfig c = good;
  c.hidden_size = 256;
  expect_error([&] { drafter_check_target(c, t); }, {"hidden_size", "256", "384"});
  c = good;
  c.vocab_size = 9000;
  expect_error([&] { drafter_check_target(c, t); }, {"vocab_size", "9000", "8192"});
  c = good;
  c.num_target_layers = 8;
  expect_error([&] { drafter_check_target(c, t); }, {"num_target_layers", "8", "6"});
  c = good;
  ModelConfig t2 = t;
  t2.num_hidden_layers = 3;
  c.num_target_layers = 3;
  expect_error([&] { drafter_check_target(c, t2); }, {"target_layer_ids", "layer 3"});
  c = good;
  ModelConfig t3 = t;
  t3.vocab_size = 8000;
  c.vocab_size = 8000;
  expect_error([&] { drafter_check_target(c, t3); }, {"mask_token_id", "8000"});
}

TEST(DrafterIo, ConfigForTargetDefaults) {
  const ModelConfig t = tiny_target();
  const DrafterConfig c = drafter_config_for_target(t, 5, {}, 8000, std::nullopt, &tiny_tok());
  EXPECT_EQ(c.hidden_size, 384);
  EXPECT_EQ(c.intermediate_size, 1024);
  EXPECT_EQ(c.num_heads, 6);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 8192);
  EXPECT_EQ(c.block_size, 16);
  EXPECT_EQ(c.num_target_layers, 6);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{1, 2, 2, 2, 3}));  // DESIGN.md rule, N=6, n=5
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_NO_THROW(drafter_check_target(c, t));
  DrafterSizes s;
  s.num_heads = 4;
  s.head_dim = 32;
  s.block_size = 8;
  const DrafterConfig c2 =
      drafter_config_for_target(t, 1, s, 8001, std::vector<int>{4}, &tiny_tok());
  EXPECT_EQ(c2.num_heads, 4);
  EXPECT_EQ(c2.num_kv_heads, 2);  // the target's
  s.num_heads = 3;                // not a multiple of the target's 2 kv heads, and none given
  expect_error([&] { drafter_config_for_target(t, 1, s, 8001, std::nullopt, &tiny_tok()); },
               {"num_attention_heads (3)", "num_key_value_heads (2)"});
  EXPECT_EQ(c2.head_dim, 32);
  EXPECT_EQ(c2.block_size, 8);
  EXPECT_EQ(c2.target_layer_ids, std::vector<int>{4});
  expect_error([&] { drafter_config_for_target(t, 1, {}, 8000, std::vector<int>{6}, &tiny_tok()); },
               {"target_layer_ids", "6"});
}

TEST(DrafterIo, MaskTokenValidationTinyQwen3) {
  const ModelConfig t = tiny_target();
  ASSERT_EQ(tiny_tok().vocab_size(), 8000);
  EXPECT_EQ(drafter_config_for_target(t, 2, {}, 8000, std::nullopt, &tiny_tok()).mask_token_id,
            8000);
  EXPECT_EQ(drafter_config_for_target(t, 2, {}, 8191, std::nullopt, &tiny_tok()).mask_token_id,
            8191);
  // A normal vocabulary id, and the tokenizer's last id, are produced by the tokenizer.
  expect_error([&] { drafter_config_for_target(t, 2, {}, 100, std::nullopt, &tiny_tok()); },
               {"mask_token_id 100", "[8000, 8192)"});
  expect_error([&] { drafter_config_for_target(t, 2, {}, 7999, std::nullopt, &tiny_tok()); },
               {"mask_token_id 7999"});
  // Past the target's embedding rows.
  expect_error([&] { drafter_config_for_target(t, 2, {}, 8192, std::nullopt, &tiny_tok()); },
               {"mask_token_id 8192", "8192"});
  expect_error([&] { drafter_config_for_target(t, 2, {}, -1, std::nullopt, &tiny_tok()); },
               {"mask_token_id -1"});
  // No default for a family without a reserved id: the error says what to set.
  expect_error(
      [&] { drafter_config_for_target(t, 2, {}, std::nullopt, std::nullopt, &tiny_tok()); },
      {"set mask_token_id", "[8000, 8192)"});
  // Without a tokenizer an explicit id is needed (and then only the target bound is checked).
  expect_error([&] { drafter_config_for_target(t, 2); }, {"mask_token_id"});
  EXPECT_EQ(drafter_config_for_target(t, 2, {}, 100).mask_token_id, 100);
}

TEST(DrafterIo, InferenceRefusesAMaskIdTheTokenizerProduces) {
  const ModelConfig t = tiny_target();
  DrafterConfig c = drafter_config_for_target(t, 1, {}, 8000, std::nullopt, &tiny_tok());
  EXPECT_NO_THROW(drafter_check_tokenizer(c, tiny_tok(), "d"));
  c.mask_token_id = 8191;
  EXPECT_NO_THROW(drafter_check_tokenizer(c, tiny_tok(), "d"));
  c.mask_token_id = 2;  // <|im_end|>, the tiny model's eos: every MASK slot would read as eos
  expect_error([&] { drafter_check_tokenizer(c, tiny_tok(), "runs/x/checkpoint-9"); },
               {"runs/x/checkpoint-9: mask_token_id 2 (token '<|im_end|>')", "[8000, 8192)"});
  c.mask_token_id = 7999;
  expect_error([&] { drafter_check_tokenizer(c, tiny_tok(), "d"); }, {"mask_token_id 7999"});
}

TEST(DrafterIo, MaskTokenDefaultQwen3Family) {
  test::TempDir dir;
  test::write_file(
      dir / "tokenizer.json",
      test::xz_decompress(test::shared_dir() / "fixtures/qwen3-tokenizer/tokenizer.json.xz"));
  const Tokenizer tok = Tokenizer::load(dir.path());
  ASSERT_EQ(tok.vocab_size(), 151669);
  ModelConfig t = tiny_target();  // a Qwen3 target with Qwen3-8B's vocabulary and depth
  t.vocab_size = 151936;
  t.num_hidden_layers = 36;
  const DrafterConfig c = drafter_config_for_target(t, 5, {}, std::nullopt, std::nullopt, &tok);
  EXPECT_EQ(c.mask_token_id, 151669);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{1, 9, 17, 25, 33}));
  // An added token (<|im_end|> = 151645) is refused as a mask.
  expect_error([&] { drafter_config_for_target(t, 5, {}, 151645, std::nullopt, &tok); },
               {"mask_token_id 151645", "[151669, 151936)"});
  // A vocabulary that ends at the tokenizer's end has no free row.
  t.vocab_size = 151669;
  expect_error([&] { drafter_config_for_target(t, 5, {}, std::nullopt, std::nullopt, &tok); },
               {"never produces"});
  // Qwen3-MoE (Qwen3-30B-A3B) shares the tokenizer and the reserved id.
  t.vocab_size = 151936;
  t.arch = Arch::qwen3_moe;
  EXPECT_EQ(drafter_config_for_target(t, 5, {}, std::nullopt, std::nullopt, &tok).mask_token_id,
            151669);
  // The family rule needs a Qwen target: a llama or gpt-oss target with this tokenizer gets no
  // default.
  t.arch = Arch::gpt_oss;
  expect_error([&] { drafter_config_for_target(t, 5, {}, std::nullopt, std::nullopt, &tok); },
               {"set mask_token_id"});
  t.arch = Arch::llama;
  expect_error([&] { drafter_config_for_target(t, 5, {}, std::nullopt, std::nullopt, &tok); },
               {"set mask_token_id", "[151669, 151936)"});
}
