#include "model/drafter_io.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_util.hpp"
#include "core/tensor.hpp"
#include "data/tokenizer.hpp"
#include "model/safetensors.hpp"

namespace dflash {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kArch = "DFlashDraftModel";
// SpecForge's DSpark export (configs/*-dspark.json, DSparkDraftModel in modeling/draft/dspark.py):
// the DFlash config plus dflash_config.projector_type "dspark" and the heads' keys.
constexpr const char* kDsparkArch = "DSparkDraftModel";
// DFlash2's export (OBJECTIVES.md §1.4; the architecture SGLang and vLLM serve): the DFlash config
// plus the conv and selector keys in dflash_config.
constexpr const char* kDflash2Arch = "DFlash2DraftModel";
// SpecForge's Domino export (configs/*-domino.json, DominoDraftModel in modeling/draft/domino.py):
// the DFlash config plus dflash_config.projector_type "domino" and the head's keys.
constexpr const char* kDominoArch = "DominoDraftModel";
constexpr const char* kConfigFile = "config.json";
constexpr const char* kWeightsFile = "model.safetensors";

/// HF `rope_scaling` dict of a non-standard RoPE (null for the standard one).
json rope_scaling_json(const RopeParams& r) {
  json s = json::object();
  switch (r.type) {
    case RopeType::standard:
      return nullptr;
    case RopeType::linear:
      s["rope_type"] = "linear";
      s["factor"] = r.factor;
      break;
    case RopeType::llama3:
      s["rope_type"] = "llama3";
      s["factor"] = r.factor;
      s["low_freq_factor"] = r.low_freq_factor;
      s["high_freq_factor"] = r.high_freq_factor;
      s["original_max_position_embeddings"] = r.original_max_position_embeddings;
      break;
    case RopeType::yarn:
      s["rope_type"] = "yarn";
      s["factor"] = r.factor;
      s["original_max_position_embeddings"] = r.original_max_position_embeddings;
      s["beta_fast"] = r.beta_fast;
      s["beta_slow"] = r.beta_slow;
      if (r.attention_factor) s["attention_factor"] = *r.attention_factor;
      if (r.mscale != 0.0) s["mscale"] = r.mscale;
      if (r.mscale_all_dim != 0.0) s["mscale_all_dim"] = r.mscale_all_dim;
      s["truncate"] = r.truncate;
      break;
  }
  return s;
}

/// A DFlash key that may sit at the top level or inside `dflash_config`. Returns the value (null
/// when in neither place); throws when both hold it with different values.
json dflash_key(const json& j, const std::string& key, const std::string& source) {
  const json* top = nullptr;
  const json* nested = nullptr;
  if (auto it = j.find(key); it != j.end() && !it->is_null()) top = &*it;
  if (auto d = j.find("dflash_config"); d != j.end() && !d->is_null()) {
    DFLASH_CHECK(d->is_object(), "{}: key 'dflash_config' must be an object, got {}", source,
                 d->dump());
    if (auto it = d->find(key); it != d->end() && !it->is_null()) nested = &*it;
  }
  if (top && nested) {
    DFLASH_CHECK(*top == *nested,
                 "{}: key '{}' ({}) and key 'dflash_config.{}' ({}) disagree; keep one of them",
                 source, key, top->dump(), key, nested->dump());
  }
  if (nested) return *nested;
  if (top) return *top;
  return nullptr;
}

/// Name of the place a DFlash key was read from, for messages.
std::string dflash_key_name(const json& j, const std::string& key) {
  auto d = j.find("dflash_config");
  if (d != j.end() && d->is_object() && d->contains(key)) return "dflash_config." + key;
  return key;
}

int required_int(const json& j, const std::string& key, const std::string& source, int64_t min_v,
                 int64_t max_v, const std::string& hint) {
  json v = dflash_key(j, key, source);
  if (v.is_null()) {
    fail("{}: missing required key 'dflash_config.{}' (or top-level '{}'){}", source, key, key,
         hint);
  }
  const std::string name = dflash_key_name(j, key);
  DFLASH_CHECK(v.is_number_integer(), "{}: key '{}' must be an integer, got {}", source, name,
               v.dump());
  const int64_t x = v.get<int64_t>();
  DFLASH_CHECK(x >= min_v && x <= max_v, "{}: key '{}' must be in [{}, {}], got {}", source, name,
               min_v, max_v, x);
  return static_cast<int>(x);
}

/// The DSpark heads a config declares (OBJECTIVES.md §1.3): enabled when `architectures` names
/// DSparkDraftModel or dflash_config.projector_type is "dspark"; markov_rank (default 0),
/// markov_head_type (vanilla), enable_confidence_head (default: confidence_head_alpha > 0, as
/// SpecForge), confidence_head_with_markov (false). Throws naming the key on a bad value.
DsparkHeads dspark_heads_from_json(const json& j, bool dspark_arch, const std::string& source) {
  const json proj = dflash_key(j, "projector_type", source);
  DFLASH_CHECK(proj.is_null() || proj.is_string(),
               "{}: key 'dflash_config.projector_type' must be a string, got {}", source,
               proj.dump());
  const bool dspark_proj = proj.is_string() && proj.get<std::string>() == "dspark";
  DFLASH_CHECK(!dspark_arch || proj.is_null() || dspark_proj,
               "{}: 'architectures' names {} but dflash_config.projector_type is {}", source,
               kDsparkArch, proj.dump());
  DsparkHeads h;
  if (!dspark_arch && !dspark_proj) {
    for (const char* key : {"markov_rank", "enable_confidence_head"}) {
      const json v = dflash_key(j, key, source);
      DFLASH_CHECK(v.is_null() || v == json(0) || v == json(false),
                   "{}: key 'dflash_config.{}' is set ({}) but the drafter is not DSpark "
                   "(projector_type is not dspark)",
                   source, key, v.dump());
    }
    return h;
  }
  h.enabled = true;
  auto get = [&](const char* key, const json& fallback) {
    const json v = dflash_key(j, key, source);
    return v.is_null() ? fallback : v;
  };
  const json rank = get("markov_rank", 0);
  DFLASH_CHECK(rank.is_number_integer() && rank.get<int64_t>() >= 0 &&
                   rank.get<int64_t>() <= (1 << 20),
               "{}: key 'dflash_config.markov_rank' must be an integer in [0, 2^20], got {}",
               source, rank.dump());
  h.markov_rank = rank.get<int>();
  const json type = get("markov_head_type", "vanilla");
  const std::optional<MarkovHeadType> t =
      type.is_string() ? markov_head_type_parse(type.get<std::string>()) : std::nullopt;
  DFLASH_CHECK(t.has_value(),
               "{}: key 'dflash_config.markov_head_type' must be vanilla, gated or rnn, got {}",
               source, type.dump());
  h.markov_type = *t;
  const json alpha = get("confidence_head_alpha", 0.0);
  DFLASH_CHECK(alpha.is_number(), "{}: key 'dflash_config.confidence_head_alpha' must be a number",
               source);
  const json conf = get("enable_confidence_head", alpha.get<double>() > 0);
  const json with_markov = get("confidence_head_with_markov", false);
  DFLASH_CHECK(conf.is_boolean() && with_markov.is_boolean(),
               "{}: keys 'dflash_config.enable_confidence_head' and "
               "'dflash_config.confidence_head_with_markov' must be true or false, got {} and {}",
               source, conf.dump(), with_markov.dump());
  h.confidence_head = conf.get<bool>();
  h.confidence_with_markov = with_markov.get<bool>();
  return h;
}

/// DFlash2's conv and selector a config declares (OBJECTIVES.md §1.4): enabled when
/// `architectures` names DFlash2DraftModel; conv_kernel_size, conv_group_size, selector_rank and
/// selector_top_k required, output_multiplier (default 1) and final_logit_softcapping (default
/// none: 0) optional, each in dflash_config or at the top level. Throws naming the key on a bad
/// value, and when a DFlash2 key is set on a drafter of another architecture.
Dflash2Heads dflash2_heads_from_json(const json& j, bool dflash2_arch, const std::string& source) {
  Dflash2Heads h;
  if (!dflash2_arch) {
    for (const char* key :
         {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}) {
      const json v = dflash_key(j, key, source);
      DFLASH_CHECK(v.is_null(), "{}: key '{}' is set ({}) but 'architectures' does not name {}",
                   source, dflash_key_name(j, key), v.dump(), kDflash2Arch);
    }
    return h;
  }
  h.enabled = true;
  const std::string hint = std::string(" (a ") + kDflash2Arch + " needs it)";
  h.conv_kernel_size = required_int(j, "conv_kernel_size", source, 1, 1 << 16, hint.c_str());
  h.conv_group_size = required_int(j, "conv_group_size", source, 1, 1 << 30, hint.c_str());
  h.selector_rank = required_int(j, "selector_rank", source, 1, 1 << 20, hint.c_str());
  h.selector_top_k = required_int(j, "selector_top_k", source, 1, 1 << 30, hint.c_str());
  auto number = [&](const char* key, double fallback) {
    const json v = dflash_key(j, key, source);
    if (v.is_null()) return fallback;
    DFLASH_CHECK(v.is_number(), "{}: key '{}' must be a number, got {}", source,
                 dflash_key_name(j, key), v.dump());
    return v.get<double>();
  };
  h.output_multiplier = number("output_multiplier", 1.0);
  h.final_logit_softcapping = number("final_logit_softcapping", 0.0);
  return h;
}

/// The Domino head a config declares (OBJECTIVES.md §1.2): enabled when `architectures` names
/// DominoDraftModel or dflash_config.projector_type is "domino"; emb_dim and gru_hidden_dim
/// required, pure_draft_prefix_len (default 0), shift_label (default false). Throws naming the key
/// on a missing or bad value, and on Domino keys of a drafter that is not Domino.
DominoHead domino_head_from_json(const json& j, bool domino_arch, const std::string& source) {
  const json proj = dflash_key(j, "projector_type", source);
  const bool domino_proj = proj.is_string() && proj.get<std::string>() == "domino";
  DFLASH_CHECK(!domino_arch || proj.is_null() || domino_proj,
               "{}: 'architectures' names {} but dflash_config.projector_type is {}", source,
               kDominoArch, proj.dump());
  DominoHead h;
  if (!domino_arch && !domino_proj) {
    for (const char* key : {"emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "shift_label"}) {
      const json v = dflash_key(j, key, source);
      DFLASH_CHECK(v.is_null(),
                   "{}: key 'dflash_config.{}' is set ({}) but the drafter is not Domino "
                   "(projector_type is not domino)",
                   source, key, v.dump());
    }
    return h;
  }
  h.enabled = true;
  auto positive = [&](const char* key) {
    const json v = dflash_key(j, key, source);
    DFLASH_CHECK(!v.is_null(), "{}: missing required key 'dflash_config.{}' of a Domino drafter",
                 source, key);
    DFLASH_CHECK(v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= (1 << 20),
                 "{}: key 'dflash_config.{}' must be an integer in [1, 2^20], got {}", source, key,
                 v.dump());
    return v.get<int64_t>();
  };
  h.emb_dim = positive("emb_dim");
  h.gru_hidden_dim = positive("gru_hidden_dim");
  const json p = dflash_key(j, "pure_draft_prefix_len", source);
  DFLASH_CHECK(p.is_null() || (p.is_number_integer() && p.get<int64_t>() >= 0 &&
                               p.get<int64_t>() < (1 << 16)),
               "{}: key 'dflash_config.pure_draft_prefix_len' must be an integer >= 0, got {}",
               source, p.dump());
  h.pure_draft_prefix_len = p.is_null() ? 0 : p.get<int>();
  const json shift = dflash_key(j, "shift_label", source);
  DFLASH_CHECK(shift.is_null() || shift.is_boolean(),
               "{}: key 'dflash_config.shift_label' must be true or false, got {}", source,
               shift.dump());
  h.shift_label = shift.is_null() ? false : shift.get<bool>();
  return h;
}

}  // namespace

json drafter_export_config(const DrafterConfig& cfg) {
  cfg.validate();
  json j = json::object();
  j["architectures"] = json::array({kArch});
  j["model_type"] = "qwen3";
  j["hidden_size"] = cfg.hidden_size;
  j["intermediate_size"] = cfg.intermediate_size;
  j["num_hidden_layers"] = cfg.num_layers;
  j["num_attention_heads"] = cfg.num_heads;
  j["num_key_value_heads"] = cfg.num_kv_heads;
  j["head_dim"] = cfg.head_dim;
  j["vocab_size"] = cfg.vocab_size;
  j["rms_norm_eps"] = cfg.rms_norm_eps;
  j["rope_theta"] = cfg.rope.theta;
  j["rope_scaling"] = rope_scaling_json(cfg.rope);
  j["max_position_embeddings"] = cfg.max_position_embeddings;
  j["tie_word_embeddings"] = false;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["hidden_act"] = "silu";
  j["initializer_range"] = 0.02;
  j["layer_types"] =
      std::vector<std::string>(static_cast<size_t>(cfg.num_layers), "full_attention");
  j["use_sliding_window"] = false;
  j["block_size"] = cfg.block_size;
  j["num_target_layers"] = cfg.num_target_layers;
  j["dflash_config"] = {{"mask_token_id", cfg.mask_token_id},
                        {"target_layer_ids", cfg.target_layer_ids}};
  if (cfg.dspark.enabled) {
    const DsparkHeads& h = cfg.dspark;
    j["architectures"] = json::array({kDsparkArch});
    json& d = j["dflash_config"];
    d["projector_type"] = "dspark";
    // SpecForge's DSparkDraftModel: gqa (its default) needs fewer KV heads than heads, mha equal.
    d["attention_mode"] = cfg.num_kv_heads < cfg.num_heads ? "gqa" : "mha";
    d["markov_rank"] = h.markov_rank;
    d["markov_head_type"] = markov_head_type_name(h.markov_type);
    d["enable_confidence_head"] = h.confidence_head;
    d["confidence_head_with_markov"] = h.confidence_with_markov;
  }
  if (cfg.dflash2.enabled) {
    const Dflash2Heads& h = cfg.dflash2;
    j["architectures"] = json::array({kDflash2Arch});
    json& d = j["dflash_config"];
    d["block_size"] = cfg.block_size;
    d["conv_kernel_size"] = h.conv_kernel_size;
    d["conv_group_size"] = h.conv_group_size;
    d["selector_rank"] = h.selector_rank;
    d["selector_top_k"] = h.selector_top_k;
    d["output_multiplier"] = h.output_multiplier;
    if (h.final_logit_softcapping > 0) d["final_logit_softcapping"] = h.final_logit_softcapping;
  }
  if (cfg.domino.enabled) {
    const DominoHead& h = cfg.domino;
    j["architectures"] = json::array({kDominoArch});
    json& d = j["dflash_config"];
    d["projector_type"] = "domino";
    d["emb_dim"] = h.emb_dim;
    d["gru_hidden_dim"] = h.gru_hidden_dim;
    d["pure_draft_prefix_len"] = h.pure_draft_prefix_len;
    d["shift_label"] = h.shift_label;
  }
  return j;
}

DrafterConfig drafter_config_from_json(const json& j_in, const std::string& source) {
  DFLASH_CHECK(j_in.is_object(), "{}: expected a JSON object, got a JSON {}", source,
               json_type(j_in));
  json j = j_in;
  bool is_dflash = false, is_dspark = false, is_dflash2 = false, is_domino = false;
  if (auto a = j.find("architectures"); a != j.end() && a->is_array()) {
    for (const json& s : *a) {
      is_dspark |= s.is_string() && s.get<std::string>() == kDsparkArch;
      is_dflash2 |= s.is_string() && s.get<std::string>() == kDflash2Arch;
      is_domino |= s.is_string() && s.get<std::string>() == kDominoArch;
      is_dflash |= s.is_string() && s.get<std::string>() == kArch;
    }
  }
  // DSpark, DFlash2 and Domino drafters are DFlash backbones
  is_dflash |= is_dspark || is_dflash2 || is_domino;
  if (!j.contains("model_type") || j["model_type"].is_null()) {
    // The reference trainer's config omits model_type; DFlashDraftModel is a Qwen3 decoder.
    DFLASH_CHECK(is_dflash,
                 "{}: missing required key 'model_type' (and 'architectures' does not name {})",
                 source, kArch);
    j["model_type"] = "qwen3";
  }
  ModelConfig m = model_config_from_json(j, source);
  DFLASH_CHECK(m.arch == Arch::qwen3 && m.model_type == "qwen3",
               "{}: key 'model_type' is '{}'; a DFlash drafter is a qwen3 decoder", source,
               m.model_type);
  DFLASH_CHECK(!m.attention_bias, "{}: key 'attention_bias' is true; the drafter has no biases",
               source);
  DFLASH_CHECK(m.num_sliding_layers() == 0,
               "{}: {} sliding-attention layers (layer_types / use_sliding_window); the drafter's "
               "attention is never windowed",
               source, m.num_sliding_layers());

  DrafterConfig c;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_layers = m.num_hidden_layers;
  c.num_heads = m.num_attention_heads;
  c.num_kv_heads = m.num_key_value_heads;
  c.head_dim = m.head_dim;
  c.vocab_size = m.vocab_size;
  c.rms_norm_eps = m.rms_norm_eps;
  c.rope = rope_params_from_config(m.rope, source);
  c.max_position_embeddings = m.max_position_embeddings;

  constexpr int64_t kIntMax = 2147483647;
  c.block_size = required_int(j, "block_size", source, 2, 1 << 16, "");
  c.num_target_layers = required_int(j, "num_target_layers", source, 1, 1 << 16,
                                     " (the number of decoder layers of the target)");
  c.mask_token_id = required_int(j, "mask_token_id", source, 0, kIntMax,
                                 " (the embedding row of the MASK token)");

  json ids = dflash_key(j, "target_layer_ids", source);
  if (ids.is_null()) {
    fail(
        "{}: missing required key 'dflash_config.target_layer_ids' (the target layers whose "
        "outputs the drafter was trained on; dflash never guesses them)",
        source);
  }
  const std::string ids_name = dflash_key_name(j, "target_layer_ids");
  DFLASH_CHECK(ids.is_array() && !ids.empty(),
               "{}: key '{}' must be a non-empty list of layer indices, got {}", source, ids_name,
               ids.dump());
  for (const json& v : ids) {
    DFLASH_CHECK(
        v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < c.num_target_layers,
        "{}: key '{}' holds {}, not a layer index in [0, num_target_layers = {})", source, ids_name,
        v.dump(), c.num_target_layers);
    c.target_layer_ids.push_back(v.get<int>());
  }
  c.dspark = dspark_heads_from_json(j, is_dspark, source);
  c.dflash2 = dflash2_heads_from_json(j, is_dflash2, source);
  c.domino = domino_head_from_json(j, is_domino, source);
  try {
    c.validate();
  } catch (const Error& e) {
    throw e.with_context(source);
  }
  return c;
}

void drafter_save(const fs::path& dir, const DrafterConfig& cfg, const DrafterLayout& layout,
                  std::span<const float> params, DType export_dtype) {
  DFLASH_CHECK(export_dtype == DType::bf16 || export_dtype == DType::f32,
               "drafter_save({}): export dtype must be bf16 or f32, got {}", dir.string(),
               dtype_name(export_dtype));
  DFLASH_CHECK(static_cast<int64_t>(params.size()) == layout.total,
               "drafter_save({}): {} parameters given, the layout has {}", dir.string(),
               params.size(), layout.total);
  json config = drafter_export_config(cfg);
  const char* dtype_str = export_dtype == DType::bf16 ? "bfloat16" : "float32";
  config["dtype"] = dtype_str;
  config["torch_dtype"] = dtype_str;

  std::error_code ec;
  fs::create_directories(dir, ec);
  DFLASH_CHECK(!ec && fs::is_directory(dir), "cannot create the drafter folder {}: {}",
               dir.string(), ec ? ec.message() : "not a folder");

  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.reserve(layout.params.size());
  for (const ParamInfo& p : layout.params) {
    Tensor t = Tensor::empty(p.shape, export_dtype);
    const float* src = params.data() + p.offset;
    if (export_dtype == DType::f32) {
      std::memcpy(t.raw(), src, static_cast<size_t>(p.numel) * sizeof(float));
    } else {
      convert_elements(t.raw(), DType::bf16, src, DType::f32, static_cast<size_t>(p.numel));
    }
    tensors.emplace_back(p.name, std::move(t));
  }
  safetensors_write(dir / kWeightsFile, tensors, {{"format", "pt"}});
  write_file_atomic(dir / kConfigFile, config.dump(2) + "\n");
}

void drafter_check_weights(const fs::path& dir, const DrafterConfig& cfg,
                           const SafetensorsCheckpoint& ckpt) {
  const DrafterLayout layout(cfg);
  std::vector<std::string> missing, wrong, unexpected;
  std::set<std::string> known;
  for (const ParamInfo& p : layout.params) {
    known.insert(p.name);
    if (!ckpt.contains(p.name)) {
      missing.push_back(p.name);
      continue;
    }
    const TensorInfo& info = ckpt.info(p.name);
    if (info.shape != p.shape) {
      wrong.push_back(fmt::format("{} has shape {}, config.json implies {}", p.name,
                                  shape_str(info.shape), shape_str(p.shape)));
    } else if (!dtype_is_float(info.dtype)) {
      wrong.push_back(
          fmt::format("{} has dtype {}, expected a float type", p.name, dtype_name(info.dtype)));
    }
  }
  for (const std::string& n : ckpt.names()) {
    if (!known.count(n)) unexpected.push_back(n);
  }
  DFLASH_CHECK(missing.empty(), "{}: missing drafter tensor(s) {} (config.json: {} layers)",
               dir.string(), fmt::join(missing, ", "), cfg.num_layers);
  DFLASH_CHECK(wrong.empty(), "{}: {}", dir.string(), fmt::join(wrong, "; "));
  DFLASH_CHECK(unexpected.empty(),
               "{}: unexpected tensor(s) {} (a drafter folder holds only the DFlash layers and "
               "the DSpark or Domino heads its config.json declares; no embedding or LM head)",
               dir.string(), fmt::join(unexpected, ", "));
}

LoadedDrafter drafter_load(const fs::path& dir) {
  const fs::path cfg_path = dir / kConfigFile;
  DrafterConfig cfg = drafter_config_from_json(json_load_file(cfg_path), cfg_path.string());
  DrafterLayout layout(cfg);
  SafetensorsCheckpoint ckpt(dir);
  drafter_check_weights(dir, cfg, ckpt);

  std::vector<float> params(static_cast<size_t>(layout.total));
  for (const ParamInfo& p : layout.params) {
    Tensor t = ckpt.get_as(p.name, DType::f32);
    std::vector<float> v = t.to_f32_vector();
    std::copy(v.begin(), v.end(), params.begin() + p.offset);
  }
  return LoadedDrafter{std::move(cfg), std::move(layout), std::move(params)};
}

void drafter_check_target(const DrafterConfig& cfg, const ModelConfig& target) {
  const std::string& t = target.source.empty() ? std::string("the target") : target.source;
  DFLASH_CHECK(cfg.hidden_size == target.hidden_size,
               "drafter hidden_size {} does not match the target's hidden_size {} ({})",
               cfg.hidden_size, target.hidden_size, t);
  DFLASH_CHECK(cfg.vocab_size == target.vocab_size,
               "drafter vocab_size {} does not match the target's vocab_size {} ({}); the drafter "
               "uses the target's embedding and LM head",
               cfg.vocab_size, target.vocab_size, t);
  DFLASH_CHECK(cfg.num_target_layers == target.num_hidden_layers,
               "drafter num_target_layers {} does not match the target's num_hidden_layers {} "
               "({}); the drafter was trained for another target",
               cfg.num_target_layers, target.num_hidden_layers, t);
  for (int id : cfg.target_layer_ids) {
    DFLASH_CHECK(id >= 0 && id < target.num_hidden_layers,
                 "drafter target_layer_ids holds layer {}, outside the target's {} layers ({})", id,
                 target.num_hidden_layers, t);
  }
  DFLASH_CHECK(cfg.mask_token_id >= 0 && cfg.mask_token_id < target.vocab_size,
               "drafter mask_token_id {} is outside the target's embedding rows [0, {}) ({})",
               cfg.mask_token_id, target.vocab_size, t);
}

void drafter_check_tokenizer(const DrafterConfig& cfg, const Tokenizer& tok,
                             const std::string& drafter) {
  const int32_t tv = tok.vocab_size();
  if (cfg.mask_token_id >= tv) return;
  std::string token = "an id without a token";
  try {
    token = fmt::format("token '{}'", tok.id_to_token(cfg.mask_token_id));
  } catch (const Error&) {
  }
  fail(
      "{}: mask_token_id {} ({}) lies inside the tokenizer's ids [0, {}): the drafter's MASK "
      "slots would read as a token the target produces. A drafter needs an embedding row the "
      "tokenizer never produces, in [{}, {}); this one was trained for another tokenizer or its "
      "config.json was edited",
      drafter, cfg.mask_token_id, token, tv, tv, cfg.vocab_size);
}

DrafterConfig drafter_config_for_target(const ModelConfig& target, int num_layers,
                                        const DrafterSizes& sizes, std::optional<int> mask_token_id,
                                        std::optional<std::vector<int>> target_layer_ids,
                                        const Tokenizer* tok) {
  const std::string& t = target.source.empty() ? std::string("the target") : target.source;
  DFLASH_CHECK(num_layers >= 1, "drafter num_layers must be >= 1, got {}", num_layers);
  DrafterConfig c;
  c.hidden_size = target.hidden_size;
  c.intermediate_size = sizes.intermediate_size.value_or(target.intermediate_size);
  c.num_layers = num_layers;
  c.num_heads = sizes.num_heads.value_or(target.num_attention_heads);
  c.num_kv_heads = sizes.num_kv_heads.value_or(target.num_key_value_heads);
  c.head_dim = sizes.head_dim.value_or(target.head_dim);
  c.vocab_size = target.vocab_size;
  c.rms_norm_eps = target.rms_norm_eps;
  c.rope = rope_params_from_config(target.rope, t);
  c.max_position_embeddings = target.max_position_embeddings;
  c.block_size = sizes.block_size.value_or(16);
  c.num_target_layers = static_cast<int>(target.num_hidden_layers);
  c.target_layer_ids = target_layer_ids ? *target_layer_ids
                                        : default_target_layer_ids(c.num_target_layers, num_layers);

  const int64_t V = target.vocab_size;
  if (mask_token_id) {
    c.mask_token_id = *mask_token_id;
    DFLASH_CHECK(c.mask_token_id >= 0 && c.mask_token_id < V,
                 "mask_token_id {} is outside the target's embedding rows [0, {}) ({}); set "
                 "mask_token_id to an embedding row the tokenizer never produces",
                 c.mask_token_id, V, t);
    if (tok) {
      const int32_t tv = tok->vocab_size();
      DFLASH_CHECK(c.mask_token_id >= tv,
                   "mask_token_id {} is a token the tokenizer produces (its vocabulary and added "
                   "tokens are ids [0, {})); set mask_token_id to an unused embedding row in "
                   "[{}, {})",
                   c.mask_token_id, tv, tv, V);
    }
  } else {
    DFLASH_CHECK(tok != nullptr,
                 "no mask_token_id given and no tokenizer to check one against ({}); set "
                 "mask_token_id to an embedding row the tokenizer never produces",
                 t);
    const int32_t tv = tok->vocab_size();
    const bool qwen_bpe = (target.arch == Arch::qwen3 || target.arch == Arch::qwen2 ||
                           target.arch == Arch::qwen3_moe) &&
                          tok->token_to_id("<|endoftext|>") == std::optional<int32_t>(151643);
    if (qwen_bpe && V > kQwenMaskTokenId && tv <= kQwenMaskTokenId) {
      c.mask_token_id = kQwenMaskTokenId;
    } else if (tv < V) {
      fail(
          "no mask_token_id given and {} is not a known family with a reserved mask id; set "
          "mask_token_id to an unused embedding row in [{}, {}) (the tokenizer's ids end at {})",
          t, tv, V, tv);
    } else {
      fail(
          "no mask_token_id possible for {}: the tokenizer uses every embedding row [0, {}) "
          "(vocab_size {}); a DFlash drafter needs a row the tokenizer never produces",
          t, tv, V);
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    throw e.with_context(fmt::format("drafter for {}", t));
  }
  return c;
}

}  // namespace dflash
