#include "model/weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "core/error.hpp"
#include "core/log.hpp"

namespace dflash {

int64_t WeightSpec::parameters() const {
  switch (format) {
    case WeightFormat::float_any: return shape_numel(shape);
    case WeightFormat::mxfp4_blocks: return 2 * shape_numel(shape);
    case WeightFormat::mxfp4_scales: return 0;
  }
  return 0;
}

namespace {

// The sparse MLP of MoE layer `m` ("model.layers.{l}.mlp.").
void moe_weights(std::vector<WeightSpec>& w, const ModelConfig& c, const std::string& m) {
  const int64_t H = c.hidden_size, E = c.num_experts, EI = c.expert_width;
  if (c.arch == Arch::qwen3_moe) {
    w.push_back({m + "gate.weight", {E, H}});
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = fmt::format("{}experts.{}.", m, e);
      w.push_back({x + "gate_proj.weight", {EI, H}});
      w.push_back({x + "up_proj.weight", {EI, H}});
      w.push_back({x + "down_proj.weight", {H, EI}});
    }
    return;
  }
  DFLASH_ASSERT(c.arch == Arch::gpt_oss);
  w.push_back({m + "router.weight", {E, H}});
  w.push_back({m + "router.bias", {E}});
  const std::string x = m + "experts.";
  if (c.quantization == "mxfp4") {
    DFLASH_CHECK(H % 32 == 0 && EI % 32 == 0,
                 "{}: mxfp4 experts need hidden_size ({}) and intermediate_size ({}) to be "
                 "multiples of 32",
                 c.source, H, EI);
    using F = WeightFormat;
    w.push_back({x + "gate_up_proj_blocks", {E, 2 * EI, H / 32, 16}, F::mxfp4_blocks});
    w.push_back({x + "gate_up_proj_scales", {E, 2 * EI, H / 32}, F::mxfp4_scales});
    w.push_back({x + "down_proj_blocks", {E, H, EI / 32, 16}, F::mxfp4_blocks});
    w.push_back({x + "down_proj_scales", {E, H, EI / 32}, F::mxfp4_scales});
  } else {
    w.push_back({x + "gate_up_proj", {E, H, 2 * EI}});
    w.push_back({x + "down_proj", {E, EI, H}});
  }
  w.push_back({x + "gate_up_proj_bias", {E, 2 * EI}});
  w.push_back({x + "down_proj_bias", {E, H}});
}

}  // namespace

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
    if (c.attention_sinks) w.push_back({a + "sinks", {NH}});
    if (c.moe_layers[static_cast<size_t>(i)]) {
      moe_weights(w, c, m);
    } else {
      w.push_back({m + "gate_proj.weight", {I, H}});
      w.push_back({m + "up_proj.weight", {I, H}});
      w.push_back({m + "down_proj.weight", {H, I}});
      if (c.mlp_bias) {
        w.push_back({m + "gate_proj.bias", {I}});
        w.push_back({m + "up_proj.bias", {I}});
        w.push_back({m + "down_proj.bias", {H}});
      }
    }
    w.push_back({l + "input_layernorm.weight", {H}});
    w.push_back({l + "post_attention_layernorm.weight", {H}});
  }
  w.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) w.push_back({"lm_head.weight", {V, H}});
  return w;
}

int64_t active_parameters(const ModelConfig& c) {
  int64_t total = 0;
  for (const WeightSpec& s : expected_weights(c)) total += s.parameters();
  if (!c.is_moe()) return total;
  // One expert: gate, up [EI, H] and down [H, EI], plus its biases (gate/up [EI] each, down [H]).
  const int64_t H = c.hidden_size, EI = c.expert_width;
  const int64_t per_expert = 3 * H * EI + (c.expert_bias ? 2 * EI + H : 0);
  return total - c.num_moe_layers() * (c.num_experts - c.num_experts_per_tok) * per_expert;
}

WeightReport check_weights(const ModelConfig& c, const SafetensorsCheckpoint& ckpt) {
  WeightReport rep;
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const WeightSpec& s : expected_weights(c)) {
    expected.insert(s.name);
    rep.expected_parameters += s.parameters();
    if (!ckpt.contains(s.name)) {
      problems.push_back(fmt::format("missing tensor '{}' (expected {})", s.name, shape_str(s.shape)));
      continue;
    }
    const TensorInfo& ti = ckpt.info(s.name);
    if (ti.shape != s.shape) {
      problems.push_back(fmt::format("tensor '{}' has shape {} but config.json implies {}", s.name,
                                     shape_str(ti.shape), shape_str(s.shape)));
    } else if (s.format == WeightFormat::float_any && !dtype_is_float(ti.dtype)) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected a float type", s.name,
                                     dtype_name(ti.dtype)));
    } else if (s.format != WeightFormat::float_any && ti.dtype != DType::u8) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected u8 (mxfp4 {})", s.name,
                                     dtype_name(ti.dtype),
                                     s.format == WeightFormat::mxfp4_blocks ? "blocks" : "scales"));
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
