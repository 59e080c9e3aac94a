#include "model/config.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/log.hpp"

namespace dflash {

namespace fs = std::filesystem;
using nlohmann::json;

std::string_view arch_name(Arch a) {
  switch (a) {
    case Arch::qwen3: return "qwen3";
    case Arch::qwen2: return "qwen2";
    case Arch::llama: return "llama";
    case Arch::qwen3_moe: return "qwen3_moe";
    case Arch::gpt_oss: return "gpt_oss";
  }
  return "?";
}

std::string_view moe_routing_name(MoeRoutingMode m) {
  switch (m) {
    case MoeRoutingMode::softmax_topk: return "softmax_topk";
    case MoeRoutingMode::topk_softmax: return "topk_softmax";
  }
  return "?";
}

std::string_view moe_activation_name(MoeActivation a) {
  switch (a) {
    case MoeActivation::swiglu: return "swiglu";
    case MoeActivation::clamped_swiglu: return "clamped_swiglu";
  }
  return "?";
}

std::string_view rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::standard: return "default";
    case RopeType::linear: return "linear";
    case RopeType::llama3: return "llama3";
    case RopeType::yarn: return "yarn";
  }
  return "?";
}

int ModelConfig::num_sliding_layers() const {
  int n = 0;
  for (LayerType t : layer_types) n += t == LayerType::sliding_attention;
  return n;
}

int ModelConfig::num_moe_layers() const {
  int n = 0;
  for (bool m : moe_layers) n += m;
  return n;
}

namespace {

// Upper bounds of the sizes, far above any real model (widths reach 53,248, depths 126,
// vocabularies 262,144): they keep every product of sizes (parameter counts, tables) far from
// overflow.
constexpr int64_t kMaxWidth = int64_t{1} << 20;   // hidden, intermediate, heads, head_dim, experts
constexpr int64_t kMaxLayers = int64_t{1} << 16;  // num_hidden_layers
constexpr int64_t kMaxVocab = int64_t{1} << 24;   // vocab_size (as the tokenizer's token ids)

/// Typed access to one JSON object with errors "<source>: key '<prefix><key>' ...".
struct Reader {
  const json& j;
  const std::string& source;
  std::string prefix;  // "rope_scaling." for nested objects

  const json* find(const std::string& key) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }
  std::string name(const std::string& key) const { return prefix + key; }

  [[noreturn]] void missing(const std::string& key) const {
    fail("{}: missing required key '{}'", source, name(key));
  }
  int64_t integer(const std::string& key, const json& v) const {
    // Accept 4096 and 4096.0 (some exporters write floats), nothing fractional.
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      double d = v.get<double>();
      DFLASH_CHECK(std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15,
                   "{}: key '{}' must be an integer, got {}", source, name(key), v.dump());
      return static_cast<int64_t>(d);
    }
    fail("{}: key '{}' must be an integer, got a JSON {} ({})", source, name(key), json_type(v),
         v.dump());
  }
  int64_t req_int(const std::string& key, int64_t min_value = 1,
                  int64_t max_value = INT64_MAX) const {
    const json* v = find(key);
    if (!v) missing(key);
    int64_t x = integer(key, *v);
    DFLASH_CHECK(x >= min_value, "{}: key '{}' must be >= {}, got {}", source, name(key),
                 min_value, x);
    DFLASH_CHECK(x <= max_value, "{}: key '{}' must be <= {}, got {}", source, name(key), max_value,
                 x);
    return x;
  }
  int64_t opt_int(const std::string& key, int64_t dflt, int64_t min_value = 1) const {
    return has(key) ? req_int(key, min_value) : dflt;
  }
  double number(const std::string& key, const json& v) const {
    DFLASH_CHECK(v.is_number(), "{}: key '{}' must be a number, got a JSON {} ({})", source,
                 name(key), json_type(v), v.dump());
    double d = v.get<double>();
    DFLASH_CHECK(std::isfinite(d), "{}: key '{}' must be finite, got {}", source, name(key), d);
    return d;
  }
  double req_num(const std::string& key) const {
    const json* v = find(key);
    if (!v) missing(key);
    return number(key, *v);
  }
  double req_pos(const std::string& key) const {
    double d = req_num(key);
    DFLASH_CHECK(d > 0, "{}: key '{}' must be > 0, got {}", source, name(key), d);
    return d;
  }
  double opt_num(const std::string& key, double dflt) const {
    return has(key) ? req_num(key) : dflt;
  }
  bool opt_bool(const std::string& key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    DFLASH_CHECK(v->is_boolean(), "{}: key '{}' must be true or false, got {}", source, name(key),
                 v->dump());
    return v->get<bool>();
  }
  std::string opt_str(const std::string& key, const std::string& dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    DFLASH_CHECK(v->is_string(), "{}: key '{}' must be a string, got {}", source, name(key),
                 v->dump());
    return v->get<std::string>();
  }
};

void parse_rope(const json& j, const std::string& source, ModelConfig& c) {
  Reader top{j, source, ""};
  const json* params = top.find("rope_parameters");
  const json* scaling = top.find("rope_scaling");
  const json* rp = nullptr;
  std::string key;
  if (params) {
    DFLASH_CHECK(params->is_object(), "{}: key 'rope_parameters' must be an object, got {}", source,
                 params->dump());
    bool per_layer = !params->contains("rope_type") && !params->contains("type") &&
                     !params->empty() && params->begin()->is_object();
    DFLASH_CHECK(!per_layer,
                 "{}: per-layer-type 'rope_parameters' (keys {}) are not supported; dflash reads "
                 "one RoPE setting for all layers",
                 source, params->dump());
    rp = params;
    key = "rope_parameters";
  }
  auto type_of = [&](const json& o, const std::string& k) -> std::string {
    Reader r{o, source, k + "."};
    if (r.has("rope_type")) return r.opt_str("rope_type", "default");
    return r.opt_str("type", "default");
  };
  if (scaling) {
    DFLASH_CHECK(scaling->is_object(), "{}: key 'rope_scaling' must be an object or null, got {}",
                 source, scaling->dump());
    if (rp) {
      DFLASH_CHECK(type_of(*scaling, "rope_scaling") == type_of(*rp, key),
                   "{}: 'rope_scaling' (type '{}') and 'rope_parameters' (type '{}') disagree",
                   source, type_of(*scaling, "rope_scaling"), type_of(*rp, key));
    } else {
      rp = scaling;
      key = "rope_scaling";
    }
  }

  // GptOssConfig.__post_init__: without rope_parameters, yarn as the released models use it.
  static const json kGptOssRope = json::parse(
      R"({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
          "truncate": false, "original_max_position_embeddings": 4096})");
  if (!rp && c.arch == Arch::gpt_oss) {
    rp = &kGptOssRope;
    key = "rope_parameters (GptOssConfig default)";
  }

  RopeConfig& r = c.rope;
  static const json kEmpty = json::object();
  Reader p{rp ? *rp : kEmpty, source, rp ? key + "." : ""};
  // HF's class default: 150000 for gpt_oss (GptOssConfig.default_theta), else 10000.
  const double default_theta = c.arch == Arch::gpt_oss ? 150000.0 : 10000.0;
  if (p.has("rope_theta")) {
    r.theta = p.req_num("rope_theta");
  } else if (top.has("rope_theta")) {
    r.theta = top.req_num("rope_theta");
  } else {
    r.theta = default_theta;
    spdlog::warn("{}: no rope_theta; using HF's default {}", source, default_theta);
  }
  DFLASH_CHECK(r.theta > 1.0, "{}: rope_theta must be > 1, got {}", source, r.theta);
  r.partial_rotary_factor = p.has("partial_rotary_factor") ? p.req_pos("partial_rotary_factor")
                                                           : top.opt_num("partial_rotary_factor", 1.0);
  DFLASH_CHECK(r.partial_rotary_factor > 0 && r.partial_rotary_factor <= 1.0,
               "{}: partial_rotary_factor must be in (0, 1], got {}", source,
               r.partial_rotary_factor);

  const std::string type = rp ? type_of(*rp, key) : "default";
  if (type == "default") {
    r.type = RopeType::standard;
  } else if (type == "linear") {
    r.type = RopeType::linear;
    r.factor = p.req_pos("factor");
  } else if (type == "llama3") {
    r.type = RopeType::llama3;
    r.factor = p.req_pos("factor");
    r.low_freq_factor = p.req_pos("low_freq_factor");
    r.high_freq_factor = p.req_pos("high_freq_factor");
    r.original_max_position_embeddings = p.req_int("original_max_position_embeddings");
    DFLASH_CHECK(r.high_freq_factor > r.low_freq_factor,
                 "{}: {}high_freq_factor ({}) must be larger than low_freq_factor ({})", source,
                 p.prefix, r.high_freq_factor, r.low_freq_factor);
  } else if (type == "yarn") {
    r.type = RopeType::yarn;
    r.original_max_position_embeddings =
        p.opt_int("original_max_position_embeddings", c.max_position_embeddings);
    if (p.has("factor")) {
      r.factor = p.req_pos("factor");
    } else {
      // transformers 5: a missing factor is max_position_embeddings / original (DeepSeek-V3 style).
      DFLASH_CHECK(p.has("original_max_position_embeddings"),
                   "{}: missing required key '{}factor' (yarn needs factor or "
                   "original_max_position_embeddings)",
                   source, p.prefix);
      r.factor = static_cast<double>(c.max_position_embeddings) /
                 static_cast<double>(r.original_max_position_embeddings);
    }
    // Python `x.get(k) or default`: absent, null and 0 all give the default.
    r.beta_fast = p.opt_num("beta_fast", 0.0);
    if (r.beta_fast == 0.0) r.beta_fast = 32.0;
    r.beta_slow = p.opt_num("beta_slow", 0.0);
    if (r.beta_slow == 0.0) r.beta_slow = 1.0;
    r.mscale = p.opt_num("mscale", 0.0);
    r.mscale_all_dim = p.opt_num("mscale_all_dim", 0.0);
    r.truncate = p.opt_bool("truncate", true);
    auto get_mscale = [](double s, double m) { return s <= 1.0 ? 1.0 : 0.1 * m * std::log(s) + 1.0; };
    if (p.has("attention_factor")) {
      r.attention_factor = p.req_pos("attention_factor");
    } else if (r.mscale != 0.0 && r.mscale_all_dim != 0.0) {
      r.attention_factor = get_mscale(r.factor, r.mscale) / get_mscale(r.factor, r.mscale_all_dim);
    } else {
      r.attention_factor = get_mscale(r.factor, 1.0);
    }
  } else {
    fail("{}: unsupported RoPE type '{}' in '{}' (supported: default, linear, llama3, yarn)", source,
         type, key);
  }
}

void parse_layer_types(const json& j, const std::string& source, ModelConfig& c) {
  Reader r{j, source, ""};
  const int64_t n = c.num_hidden_layers;
  // The window, as HF sets config.sliding_window.
  int64_t window = 0;
  const bool mistral = c.model_type == "mistral";
  if (mistral) {
    // MistralConfig: sliding_window defaults to 4096 when the key is absent; null disables it.
    if (!j.contains("sliding_window")) window = 4096;
    else window = r.opt_int("sliding_window", 0);
  } else if (c.arch == Arch::qwen3_moe) {
    // Qwen3MoeConfig: sliding_window (default 4096) if use_sliding_window else None.
    if (r.opt_bool("use_sliding_window", false))
      window = j.contains("sliding_window") ? r.opt_int("sliding_window", 0) : 4096;
  } else if (c.arch == Arch::gpt_oss) {
    // GptOssConfig: sliding_window defaults to 128; null disables it.
    window = j.contains("sliding_window") ? r.opt_int("sliding_window", 0) : 128;
  } else if (c.arch == Arch::qwen2 || c.arch == Arch::qwen3) {
    // Qwen2/Qwen3Config: sliding_window = sliding_window if use_sliding_window else None.
    if (r.opt_bool("use_sliding_window", false)) window = r.opt_int("sliding_window", 0);
  }

  // What HF derives when config.json has no layer_types (Qwen3MoeModel has no per-layer types:
  // every layer slides when the window is set).
  std::vector<LayerType> derived;
  int64_t first_sliding = n;  // no sliding layer
  if (window > 0) {
    if (mistral || c.arch == Arch::qwen3_moe) first_sliding = 0;
    else if (c.arch == Arch::qwen2 || c.arch == Arch::qwen3)
      first_sliding = r.opt_int("max_window_layers", 28, 0);
  }
  for (int64_t i = 0; i < n; ++i) {
    const bool sliding = c.arch == Arch::gpt_oss ? i % 2 == 0 : i >= first_sliding;
    derived.push_back(sliding ? LayerType::sliding_attention : LayerType::full_attention);
  }

  if (const json* lt = r.find("layer_types")) {
    DFLASH_CHECK(lt->is_array(), "{}: key 'layer_types' must be a list, got {}", source,
                 lt->dump());
    DFLASH_CHECK(static_cast<int64_t>(lt->size()) == n,
                 "{}: key 'layer_types' has {} entries but num_hidden_layers is {}", source,
                 lt->size(), n);
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& v = (*lt)[i];
      std::string s = v.is_string() ? v.get<std::string>() : v.dump();
      if (s == "full_attention") c.layer_types.push_back(LayerType::full_attention);
      else if (s == "sliding_attention") c.layer_types.push_back(LayerType::sliding_attention);
      else
        fail("{}: layer_types[{}] is '{}' (supported: full_attention, sliding_attention)", source,
             i, s);
    }
    // HF's Qwen3MoeModel ignores layer_types; a list that says otherwise is a contradiction.
    DFLASH_CHECK(c.arch != Arch::qwen3_moe || c.layer_types == derived,
                 "{}: key 'layer_types' disagrees with use_sliding_window/sliding_window, which "
                 "alone decide the attention of every qwen3_moe layer in HF",
                 source);
  } else {
    c.layer_types = derived;
  }
  if (c.num_sliding_layers() > 0) {
    DFLASH_CHECK(window > 0,
                 "{}: layer_types has sliding_attention layers but the sliding window is "
                 "disabled or unset (sliding_window / use_sliding_window)",
                 source);
    c.sliding_window = window;
  } else {
    c.sliding_window = 0;
  }
}

// `quantization_config`: only gpt_oss's mxfp4 experts are read.
void parse_quantization(const json& j, const std::string& source, ModelConfig& c) {
  Reader r{j, source, ""};
  if (const json* q = r.find("quantization_config")) {
    DFLASH_CHECK(q->is_object(), "{}: key 'quantization_config' must be an object, got {}", source,
                 q->dump());
    Reader qr{*q, source, "quantization_config."};
    const std::string method = qr.opt_str("quant_method", "");
    DFLASH_CHECK(c.arch == Arch::gpt_oss && method == "mxfp4",
                 "{}: quantization_config.quant_method '{}' is not supported for {} (dflash reads "
                 "bf16/f32/f16 weights, and gpt_oss experts in mxfp4)",
                 source, method, c.model_type);
    c.quantization = method;
  }
}

// Mixture-of-experts keys of qwen3_moe and gpt_oss (see model_config_from_json).
void parse_moe(const json& j, const std::string& source, ModelConfig& c) {
  Reader r{j, source, ""};
  const int64_t n = c.num_hidden_layers;
  c.moe_layers.assign(static_cast<size_t>(n), false);
  if (c.arch != Arch::qwen3_moe && c.arch != Arch::gpt_oss) return;
  // HF attribute_map: num_experts <-> num_local_experts (transformers 5 writes the latter).
  const bool has_e = r.has("num_experts"), has_le = r.has("num_local_experts");
  DFLASH_CHECK(has_e || has_le, "{}: missing required key 'num_experts' (or 'num_local_experts')",
               source);
  c.num_experts = has_le ? r.req_int("num_local_experts", 1, kMaxWidth)
                         : r.req_int("num_experts", 1, kMaxWidth);
  if (has_e && has_le)
    DFLASH_CHECK(r.req_int("num_experts") == c.num_experts,
                 "{}: keys 'num_experts' ({}) and 'num_local_experts' ({}) disagree", source,
                 r.req_int("num_experts"), c.num_experts);
  c.num_experts_per_tok = r.req_int("num_experts_per_tok");
  DFLASH_CHECK(c.num_experts_per_tok <= c.num_experts,
               "{}: num_experts_per_tok ({}) exceeds the number of experts ({})", source,
               c.num_experts_per_tok, c.num_experts);
  if (c.arch == Arch::qwen3_moe) {
    c.expert_width = r.req_int("moe_intermediate_size", 1, kMaxWidth);
    c.norm_topk_prob = r.opt_bool("norm_topk_prob", false);
    c.decoder_sparse_step = r.opt_int("decoder_sparse_step", 1);
    if (const json* m = r.find("mlp_only_layers")) {
      DFLASH_CHECK(m->is_array(), "{}: key 'mlp_only_layers' must be a list of layer indices, got "
                   "{}", source, m->dump());
      for (const json& v : *m) {
        DFLASH_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < n,
                     "{}: key 'mlp_only_layers' holds {}, not a layer index in [0, {})", source,
                     v.dump(), n);
        c.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
    c.routing = MoeRoutingMode::softmax_topk;
    c.expert_activation = MoeActivation::swiglu;
    // Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers or off the sparse step.
    for (int64_t l = 0; l < n; ++l) {
      const bool only = std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), l) !=
                        c.mlp_only_layers.end();
      c.moe_layers[static_cast<size_t>(l)] = !only && (l + 1) % c.decoder_sparse_step == 0;
    }
  } else {
    c.expert_width = c.intermediate_size;  // GptOssExperts: config.intermediate_size
    c.routing = MoeRoutingMode::topk_softmax;
    c.router_bias = c.expert_bias = true;
    c.expert_activation = MoeActivation::clamped_swiglu;
    c.swiglu_limit = r.has("swiglu_limit") ? r.req_pos("swiglu_limit") : 7.0;
    c.moe_layers.assign(static_cast<size_t>(n), true);
  }
}

}  // namespace

ModelConfig model_config_from_json(const json& j, const std::string& source) {
  DFLASH_CHECK(j.is_object(), "{}: expected a JSON object, got a JSON {}", source, json_type(j));
  Reader r{j, source, ""};
  ModelConfig c;
  c.source = source;

  if (!r.has("model_type")) r.missing("model_type");
  c.model_type = r.opt_str("model_type", "");
  if (c.model_type == "qwen3") c.arch = Arch::qwen3;
  else if (c.model_type == "qwen2") c.arch = Arch::qwen2;
  else if (c.model_type == "llama" || c.model_type == "mistral") c.arch = Arch::llama;
  else if (c.model_type == "qwen3_moe") c.arch = Arch::qwen3_moe;
  else if (c.model_type == "gpt_oss") c.arch = Arch::gpt_oss;
  else
    fail("{}: unsupported model_type '{}' (supported: qwen3, qwen2, llama, mistral, qwen3_moe, "
         "gpt_oss)",
         source, c.model_type);

  if (const json* a = r.find("architectures")) {
    DFLASH_CHECK(a->is_array(), "{}: key 'architectures' must be a list, got {}", source,
                 a->dump());
    for (const json& s : *a) {
      DFLASH_CHECK(s.is_string(), "{}: key 'architectures' must list strings, got {}", source,
                   a->dump());
      c.architectures.push_back(s.get<std::string>());
    }
  }

  c.hidden_size = r.req_int("hidden_size", 1, kMaxWidth);
  c.intermediate_size = r.req_int("intermediate_size", 1, kMaxWidth);
  c.num_attention_heads = r.req_int("num_attention_heads", 1, kMaxWidth);
  c.num_hidden_layers = r.req_int("num_hidden_layers", 1, kMaxLayers);
  c.vocab_size = r.req_int("vocab_size", 1, kMaxVocab);
  c.max_position_embeddings = r.req_int("max_position_embeddings", 1, INT32_MAX);
  c.rms_norm_eps = r.req_num("rms_norm_eps");
  DFLASH_CHECK(c.rms_norm_eps > 0 && c.rms_norm_eps < 1, "{}: key 'rms_norm_eps' must be in (0, 1), got {}",
               source, c.rms_norm_eps);
  c.num_key_value_heads = r.has("num_key_value_heads")
                              ? r.req_int("num_key_value_heads", 1, kMaxWidth)
                              : c.num_attention_heads;
  DFLASH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
               "{}: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})", source,
               c.num_attention_heads, c.num_key_value_heads);
  if (r.has("head_dim")) {
    c.head_dim = r.req_int("head_dim", 1, kMaxWidth);
  } else if (c.arch == Arch::gpt_oss) {
    c.head_dim = 64;  // GptOssConfig's class default, not hidden_size / num_attention_heads
  } else {
    DFLASH_CHECK(c.arch != Arch::qwen3 && c.arch != Arch::qwen3_moe,
                 "{}: missing required key 'head_dim' ({}'s HF default is 128, not "
                 "hidden_size / num_attention_heads; write it explicitly)",
                 source, c.model_type);
    DFLASH_CHECK(c.hidden_size % c.num_attention_heads == 0,
                 "{}: no 'head_dim' and hidden_size ({}) is not a multiple of num_attention_heads "
                 "({})",
                 source, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  DFLASH_CHECK(c.head_dim % 2 == 0, "{}: head_dim must be even for RoPE, got {}", source,
               c.head_dim);

  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings", false);
  c.qk_norm = c.arch == Arch::qwen3 || c.arch == Arch::qwen3_moe;
  c.attention_sinks = c.arch == Arch::gpt_oss;
  if (c.arch == Arch::qwen2) {
    c.attention_bias = true;  // Qwen2Attention: q/k/v with bias, o_proj without
    c.o_proj_bias = false;
  } else if (c.arch == Arch::gpt_oss) {
    c.attention_bias = c.o_proj_bias = r.opt_bool("attention_bias", true);  // GptOssConfig
  } else if (c.model_type == "mistral") {
    c.attention_bias = c.o_proj_bias = false;  // MistralAttention has no biases
  } else {
    c.attention_bias = c.o_proj_bias = r.opt_bool("attention_bias", false);
  }
  c.mlp_bias = c.model_type == "llama" && r.opt_bool("mlp_bias", false);

  if (const json* e = r.find("eos_token_id")) {
    auto add = [&](const json& v) {
      // An unsigned value above INT64_MAX reads as negative here and is refused.
      DFLASH_CHECK(
          v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < c.vocab_size,
          "{}: key 'eos_token_id' must be a token id in [0, vocab_size = {}) or a list "
          "of them, got {}",
          source, c.vocab_size, e->dump());
      c.eos_token_ids.push_back(v.get<int64_t>());
    };
    if (e->is_array()) {
      for (const json& v : *e) add(v);
    } else {
      add(*e);
    }
  }
  if (r.has("dtype")) c.dtype = r.opt_str("dtype", "");
  else c.dtype = r.opt_str("torch_dtype", "");

  parse_rope(j, source, c);
  parse_layer_types(j, source, c);
  parse_quantization(j, source, c);
  parse_moe(j, source, c);
  return c;
}

ModelConfig model_config_load(const fs::path& path) {
  std::error_code ec;
  DFLASH_CHECK(fs::exists(path, ec), "{}: no such model folder or config.json file", path.string());
  fs::path file = fs::is_directory(path, ec) ? path / "config.json" : path;
  return model_config_from_json(json_load_file(file), file.string());
}

std::vector<int> default_target_layer_ids(int num_target_layers, int num_draft_layers) {
  const int N = num_target_layers, n = num_draft_layers;
  DFLASH_CHECK(N >= 1, "default_target_layer_ids: the target needs at least 1 layer, got {}", N);
  DFLASH_CHECK(n >= 1, "default_target_layer_ids: the drafter needs at least 1 layer, got {}", n);
  std::vector<int> ids;
  if (n == 1) {
    ids.push_back(N / 2);
  } else {
    // value = 1 + i*(N-4)/(n-1) = num/den exactly; round half to even in integers.
    const int64_t den = n - 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t num = den + i * (N - 4);
      int64_t q = num / den, rem = num % den;
      if (rem < 0) {  // floor division
        rem += den;
        q -= 1;
      }
      if (2 * rem > den || (2 * rem == den && (q % 2 != 0))) q += 1;
      ids.push_back(static_cast<int>(q));
    }
  }
  for (int id : ids) {
    DFLASH_CHECK(id >= 0 && id < N,
                 "default_target_layer_ids: layer {} is outside a target of {} layers (a drafter "
                 "of {} layers needs a deeper target)",
                 id, N, n);
  }
  return ids;
}

}  // namespace dflash

namespace dflash {

RopeParams rope_params_from_config(const RopeConfig& r, const std::string& context) {
  DFLASH_CHECK(r.partial_rotary_factor == 1.0,
               "{}: partial_rotary_factor {} is not supported (RoPE rotates the whole head)",
               context, r.partial_rotary_factor);
  RopeParams p;
  p.type = r.type;
  p.theta = r.theta;
  p.factor = r.factor;
  if (r.type == RopeType::llama3) {
    p.low_freq_factor = r.low_freq_factor;
    p.high_freq_factor = r.high_freq_factor;
  }
  p.original_max_position_embeddings = r.original_max_position_embeddings;
  p.beta_fast = r.beta_fast;
  p.beta_slow = r.beta_slow;
  p.mscale = r.mscale;
  p.mscale_all_dim = r.mscale_all_dim;
  p.truncate = r.truncate;
  if (r.type == RopeType::yarn) p.attention_factor = r.attention_factor;
  return p;
}

}  // namespace dflash
