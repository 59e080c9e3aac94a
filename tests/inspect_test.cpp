// Tests of `dflash inspect` (run as a separate process): the figures of the embedded tiny-qwen3
// model, cross-checked against what HF wrote into its index.json, and clear errors (exit code 1,
// never a crash) for a weight shape that contradicts config.json, a missing tensor, a corrupt shard
// and a missing folder.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <regex>

#include "util/test_util.hpp"

using dflash::test::read_file;
using dflash::test::run_dflash;
using dflash::test::TempDir;
using dflash::test::write_file;
using ::testing::HasSubstr;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

fs::path tiny() { return dflash::test::assets_dir() / "tiny-qwen3"; }

/// The value printed for `key` ("key:   value" line), or "" when absent.
std::string field(const std::string& out, const std::string& key) {
  std::smatch m;
  std::regex re("(^|\n)" + key + ": *([^\n]*)");
  return std::regex_search(out, m, re) ? m[2].str() : std::string();
}

/// Copies the tiny model into `dir` with config.json edited by `edit`.
void copy_tiny(const fs::path& dir, const std::function<void(json&)>& edit) {
  for (const auto& e : fs::directory_iterator(tiny())) fs::copy(e.path(), dir / e.path().filename());
  json c = json::parse(read_file(dir / "config.json"));
  edit(c);
  write_file(dir / "config.json", c.dump(2));
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), r;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) r += ',';
    r += s[i];
  }
  return r;
}

}  // namespace

TEST(Inspect, TinyQwen3Figures) {
  auto r = run_dflash({"inspect", tiny().string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string& o = r.out;
  EXPECT_EQ(field(o, "architecture"), "qwen3 [Qwen3ForCausalLM]");
  EXPECT_EQ(field(o, "layers"), "6");
  EXPECT_EQ(field(o, "hidden size"), "384");
  EXPECT_EQ(field(o, "intermediate size"), "1024");
  EXPECT_EQ(field(o, "attention heads"), "6");
  EXPECT_EQ(field(o, "kv heads"), "2");
  EXPECT_EQ(field(o, "head dim"), "64");
  EXPECT_EQ(field(o, "vocab size"), "8192");
  EXPECT_EQ(field(o, "tied embeddings"), "yes");
  EXPECT_EQ(field(o, "rope"), "default, theta 1000000");
  EXPECT_EQ(field(o, "parameters"), "12,588,672");
  EXPECT_EQ(field(o, "shards"), "4");
  EXPECT_EQ(field(o, "unexpected tensors"), "none");
  // Python: [6 // 2] and [round(1 + i * 2 / 4) for i in range(5)].
  EXPECT_EQ(field(o, "default taps \\(1 drafter layer\\)"), "[3]");
  EXPECT_EQ(field(o, "default taps \\(5 drafter layers\\)"), "[1, 2, 2, 2, 3]");

  // Independent figures: HF wrote total_parameters / total_size into the index.
  json idx = json::parse(read_file(tiny() / "model.safetensors.index.json"));
  EXPECT_EQ(field(o, "parameters"), with_commas(idx["metadata"]["total_parameters"].get<int64_t>()));
  EXPECT_EQ(field(o, "bytes by dtype"),
            "bf16 " + with_commas(idx["metadata"]["total_size"].get<int64_t>()));
  EXPECT_EQ(field(o, "tensors"), std::to_string(idx["weight_map"].size()));
}

fs::path fixture(const std::string& name) {
  return dflash::test::source_dir() / "tests" / "fixtures" / "models" / name;
}

TEST(Inspect, Qwen3MoeFigures) {
  auto r = run_dflash({"inspect", fixture("qwen3-moe").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string& o = r.out;
  EXPECT_EQ(field(o, "architecture"), "qwen3_moe [Qwen3MoeForCausalLM]");
  EXPECT_EQ(field(o, "experts"), "8 (top-2, router softmax_topk, norm_topk_prob yes)");
  EXPECT_EQ(field(o, "expert intermediate size"), "16");
  EXPECT_EQ(field(o, "moe layers"), "2 of 3 (dense: 2)");  // mlp_only_layers [2]
  EXPECT_EQ(field(o, "expert activation"), "swiglu");
  EXPECT_EQ(field(o, "attention sinks"), "no");
  EXPECT_EQ(field(o, "quantization"), "none");
  // Tied 512×64 embedding; per layer q/k/v/o (256, 128, 128, 256 rows of 64), q/k norms and two
  // norms; layers 0, 1: router 8×64 and 8 experts of 3×16×64; layer 2: dense 3×96×64.
  const int64_t attn = (256 + 128 + 128) * 64 + 64 * 256 + 2 * 64 + 2 * 64;
  const int64_t expert = 3 * 16 * 64;
  const int64_t total = 512 * 64 + 3 * attn + 2 * (8 * 64 + 8 * expert) + 3 * 96 * 64 + 64;
  EXPECT_EQ(field(o, "parameters"), with_commas(total));
  EXPECT_EQ(field(o, "active parameters"), with_commas(total - 2 * 6 * expert));
}

TEST(Inspect, GptOssMxfp4Figures) {
  auto r = run_dflash({"inspect", fixture("gpt-oss-mxfp4").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string& o = r.out;
  EXPECT_EQ(field(o, "architecture"), "gpt_oss [GptOssForCausalLM]");
  EXPECT_EQ(field(o, "experts"), "4 (top-2, router topk_softmax, router bias, expert biases)");
  EXPECT_EQ(field(o, "moe layers"), "2 of 2");
  EXPECT_EQ(field(o, "expert activation"), "clamped_swiglu (alpha 1.702, limit 7)");
  EXPECT_EQ(field(o, "attention sinks"), "yes");
  EXPECT_EQ(field(o, "attention bias"), "q, k, v, o");
  EXPECT_EQ(field(o, "sliding window"), "8 tokens on 1 of 2 layers");
  EXPECT_EQ(field(o, "quantization"), "mxfp4 experts (dequantised to bf16 at load)");
  EXPECT_EQ(field(o, "unexpected tensors"), "none");
  // Untied 512×64 tables; per layer q/k/v/o (256, 64, 64 rows of 64; o 64×256) with biases, 4
  // sinks, two norms, a biased 4×64 router and 4 experts (gate_up 128×64 + 128, down 64×64 + 64);
  // the experts' 2·4·(128 + 64)·64/2 MXFP4 bytes hold two parameters each.
  const int64_t attn = (256 + 64 + 64) * 64 + 64 * 256 + 256 + 64 + 64 + 64 + 4 + 2 * 64;
  const int64_t expert = 128 * 64 + 128 + 64 * 64 + 64, router = 4 * 64 + 4;
  const int64_t total = 2 * 512 * 64 + 2 * (attn + router + 4 * expert) + 64;
  EXPECT_EQ(field(o, "parameters"), with_commas(total));
  EXPECT_EQ(field(o, "active parameters"), with_commas(total - 2 * 2 * expert));
}

TEST(Inspect, ShapeContradictingConfigIsAClearError) {
  TempDir dir;
  copy_tiny(dir.path(), [](json& c) { c["intermediate_size"] = 1000; });
  auto r = run_dflash({"inspect", dir.path().string()});
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr("dflash: error:"));
  EXPECT_THAT(r.err, HasSubstr("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_THAT(r.err, HasSubstr("[1024, 384]"));  // found
  EXPECT_THAT(r.err, HasSubstr("[1000, 384]"));  // implied by config.json
  EXPECT_THAT(r.err, HasSubstr("config.json"));
}

TEST(Inspect, HeadCountContradictingWeightsIsAClearError) {
  TempDir dir;
  copy_tiny(dir.path(), [](json& c) {
    c["num_attention_heads"] = 3;  // q_proj would be [192, 384]
    c["num_key_value_heads"] = 1;
  });
  auto r = run_dflash({"inspect", dir.path().string()});
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_THAT(r.err, HasSubstr("[384, 384]"));
  EXPECT_THAT(r.err, HasSubstr("[192, 384]"));
}

TEST(Inspect, MissingTensorIsAClearError) {
  TempDir dir;
  copy_tiny(dir.path(), [](json& c) { c["tie_word_embeddings"] = false; });
  auto r = run_dflash({"inspect", dir.path().string()});
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr("missing tensor 'lm_head.weight'"));
  EXPECT_THAT(r.err, HasSubstr("[8192, 384]"));
}

TEST(Inspect, UnexpectedTensorsAreReportedNotIgnored) {
  TempDir dir;
  copy_tiny(dir.path(), [](json& c) {
    c["num_hidden_layers"] = 5;
    c["layer_types"].erase(5);
  });
  auto r = run_dflash({"inspect", dir.path().string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(field(r.out, "unexpected tensors"), HasSubstr("11 ("));
  EXPECT_THAT(field(r.out, "unexpected tensors"),
              HasSubstr("model.layers.5.self_attn.q_proj.weight"));
  EXPECT_THAT(r.err, HasSubstr("not used"));
  EXPECT_EQ(field(r.out, "parameters"), "12,588,672");  // everything in the files is counted
}

TEST(Inspect, CorruptShardAndMissingFolderAreClearErrors) {
  TempDir dir;
  copy_tiny(dir.path(), [](json&) {});
  auto shard = dir / "model-00003-of-00004.safetensors";
  std::string bytes = read_file(shard);
  write_file(shard, bytes.substr(0, bytes.size() - 1000));
  auto r = run_dflash({"inspect", dir.path().string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("model-00003-of-00004.safetensors"));
  EXPECT_THAT(r.err, HasSubstr("past the end"));

  r = run_dflash({"inspect", (dir / "nope").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("nope"));
}
