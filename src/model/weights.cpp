#include "model/weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "core/error.hpp"
#include "core/log.hpp"

namespace dflash {

std::vector<WeightSpec> expected_weights(const ModelConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim, NH = c.num_attention_heads,
                NKV = c.num_key_value_heads, I = c.intermediate_size, V = c.vocab_size;
  std::vector<WeightSpec> w;
  w.push_back({"model.embed_tokens.weight", {V, H}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string a = fmt::format("model.layers.{}.self_attn.", i);
    const std::string m = fmt::format("model.layers.{}.mlp.", i);
    const std::string l = fmt::format("model.layers.{}.", i);
    w.push_back({a + "q_proj.weight", {NH * D, H}});
    w.push_back({a + "k_proj.weight", {NKV * D, H}});
    w.push_back({a + "v_proj.weight", {NKV * D, H}});
    w.push_back({a + "o_proj.weight", {H, NH * D}});
    if (c.attention_bias) {
      w.push_back({a + "q_proj.bias", {NH * D}});
      w.push_back({a + "k_proj.bias", {NKV * D}});
      w.push_back({a + "v_proj.bias", {NKV * D}});
    }
    if (c.o_proj_bias) w.push_back({a + "o_proj.bias", {H}});
    if (c.qk_norm) {
      w.push_back({a + "q_norm.weight", {D}});
      w.push_back({a + "k_norm.weight", {D}});
    }
    w.push_back({m + "gate_proj.weight", {I, H}});
    w.push_back({m + "up_proj.weight", {I, H}});
    w.push_back({m + "down_proj.weight", {H, I}});
    if (c.mlp_bias) {
      w.push_back({m + "gate_proj.bias", {I}});
      w.push_back({m + "up_proj.bias", {I}});
      w.push_back({m + "down_proj.bias", {H}});
    }
    w.push_back({l + "input_layernorm.weight", {H}});
    w.push_back({l + "post_attention_layernorm.weight", {H}});
  }
  w.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) w.push_back({"lm_head.weight", {V, H}});
  return w;
}

WeightReport check_weights(const ModelConfig& c, const SafetensorsCheckpoint& ckpt) {
  WeightReport rep;
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const WeightSpec& s : expected_weights(c)) {
    expected.insert(s.name);
    rep.expected_parameters += shape_numel(s.shape);
    if (!ckpt.contains(s.name)) {
      problems.push_back(fmt::format("missing tensor '{}' (expected {})", s.name, shape_str(s.shape)));
      continue;
    }
    const TensorInfo& ti = ckpt.info(s.name);
    if (ti.shape != s.shape) {
      problems.push_back(fmt::format("tensor '{}' has shape {} but config.json implies {}", s.name,
                                     shape_str(ti.shape), shape_str(s.shape)));
    } else if (!dtype_is_float(ti.dtype)) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected a float type", s.name,
                                     dtype_name(ti.dtype)));
    }
  }
  for (const std::string& n : ckpt.names()) {
    if (!expected.count(n)) rep.unexpected.push_back(n);
  }
  if (!problems.empty()) {
    std::string msg;
    const size_t shown = std::min<size_t>(problems.size(), 20);
    for (size_t i = 0; i < shown; ++i) msg += "\n  " + problems[i];
    if (shown < problems.size()) msg += fmt::format("\n  … and {} more", problems.size() - shown);
    fail("checkpoint {} does not match {} ({} {} model: hidden {}, {} layers, {}/{} heads, "
         "head_dim {}, intermediate {}, vocab {}): {} problem(s):{}",
         ckpt.dir().string(), c.source, c.model_type, c.tie_word_embeddings ? "tied" : "untied",
         c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
         c.head_dim, c.intermediate_size, c.vocab_size, problems.size(), msg);
  }
  if (!rep.unexpected.empty()) {
    std::string list;
    const size_t shown = std::min<size_t>(rep.unexpected.size(), 10);
    for (size_t i = 0; i < shown; ++i) list += (i ? ", " : "") + rep.unexpected[i];
    if (shown < rep.unexpected.size()) list += fmt::format(", … ({} in all)", rep.unexpected.size());
    spdlog::warn("checkpoint {}: {} tensor(s) not used by the {} architecture: {}",
                 ckpt.dir().string(), rep.unexpected.size(), arch_name(c.arch), list);
  }
  return rep;
}

}  // namespace dflash
