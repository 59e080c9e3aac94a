#include "train/run_config.hpp"

#include <utf8proc.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "train/topology.hpp"

namespace dflash {

namespace {

// YAML conversions with messages that name the key and line.
template <typename T>
T as(const YAML::Node& n, const std::string& key, const std::string& source) {
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    std::string what;
    if constexpr (std::is_same_v<T, std::string>) what = "a string";
    else if constexpr (std::is_same_v<T, bool>) what = "true or false";
    else if constexpr (std::is_floating_point_v<T>) what = "a number";
    else what = "an integer";
    fail("{}:{}: {} must be {}, got '{}'", source, n.Mark().line + 1, key, what,
         YAML::Dump(n));
  }
}

// A string setting (a path, a name) is UTF-8 text without control characters: anything else
// (a stray carriage return, bytes of another encoding) cannot be written back to
// config.resolved.yaml and read again as the same value, so it is refused naming the key.
void check_text(const std::string& v, const YAML::Node& n, const std::string& key,
                const std::string& src) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(v.data());
  for (utf8proc_ssize_t i = 0, len = static_cast<utf8proc_ssize_t>(v.size()); i < len;) {
    utf8proc_int32_t c = 0;
    const utf8proc_ssize_t step = utf8proc_iterate(p + i, len - i, &c);
    DFLASH_CHECK(step > 0, "{}:{}: {} must be UTF-8 text, got an invalid byte 0x{:02x} at {}",
                 src, n.Mark().line + 1, key, static_cast<unsigned>(p[i]), i);
    DFLASH_CHECK(c >= 0x20 && c != 0x7f,
                 "{}:{}: {} must not contain control characters, got 0x{:02x} at {}", src,
                 n.Mark().line + 1, key, static_cast<unsigned>(c), i);
    i += step;
  }
}

template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};

template <typename T>
void read_into(T& dst, const YAML::Node& n, const std::string& key, const std::string& src) {
  if constexpr (is_optional<T>::value) {
    if (n.IsNull()) dst.reset();
    else dst = as<typename T::value_type>(n, key, src);
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    dst.clear();
    if (n.IsNull()) return;
    DFLASH_CHECK(n.IsSequence(), "{}:{}: {} must be a list of integers", src, n.Mark().line + 1,
                 key);
    for (const auto& e : n) dst.push_back(as<int>(e, key, src));
  } else if constexpr (std::is_same_v<T, std::string>) {
    dst = n.IsNull() ? std::string() : as<std::string>(n, key, src);
    check_text(dst, n, key, src);
  } else {
    dst = as<T>(n, key, src);
  }
}

template <typename T>
YAML::Node to_node(const T& v) {
  if constexpr (is_optional<T>::value) {
    return v ? YAML::Node(*v) : YAML::Node(YAML::NodeType::Null);
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    YAML::Node n(YAML::NodeType::Sequence);
    for (int x : v) n.push_back(x);
    n.SetStyle(YAML::EmitterStyle::Flow);
    return n;
  } else {
    return YAML::Node(v);
  }
}

// One key of the schema.
struct Field {
  std::string section, key;
  bool affects_model_or_data;
  std::function<void(RunConfig&, const YAML::Node&, const std::string&)> set;
  std::function<YAML::Node(const RunConfig&)> get;
  std::string path() const { return section.empty() ? key : section + "." + key; }
};

template <typename S, typename T>
Field make_field(const char* section, const char* key, S RunConfig::*sec, T S::*mem, bool affects) {
  Field f;
  f.section = section;
  f.key = key;
  f.affects_model_or_data = affects;
  const std::string path = f.path();
  f.set = [sec, mem, path](RunConfig& c, const YAML::Node& n, const std::string& src) {
    read_into(c.*sec.*mem, n, path, src);
  };
  f.get = [sec, mem](const RunConfig& c) { return to_node(c.*sec.*mem); };
  return f;
}

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = [] {
    using R = RunConfig;
    std::vector<Field> f;
    auto M = &R::model;
    f.push_back(make_field("model", "target", M, &ModelSection::target, true));
    f.push_back(make_field("model", "drafter_layers", M, &ModelSection::drafter_layers, true));
    f.push_back(make_field("model", "intermediate_size", M, &ModelSection::intermediate_size, true));
    f.push_back(
        make_field("model", "num_attention_heads", M, &ModelSection::num_attention_heads, true));
    f.push_back(
        make_field("model", "num_key_value_heads", M, &ModelSection::num_key_value_heads, true));
    f.push_back(make_field("model", "head_dim", M, &ModelSection::head_dim, true));
    f.push_back(make_field("model", "mask_token_id", M, &ModelSection::mask_token_id, true));
    f.push_back(make_field("model", "target_layer_ids", M, &ModelSection::target_layer_ids, true));
    auto D = &R::data;
    f.push_back(make_field("data", "train_file", D, &DataSection::train_file, true));
    f.push_back(make_field("data", "template", D, &DataSection::template_name, true));
    f.push_back(make_field("data", "max_length", D, &DataSection::max_length, true));
    f.push_back(make_field("data", "token_budget", D, &DataSection::token_budget, true));
    f.push_back(make_field("data", "rows_per_step", D, &DataSection::rows_per_step, true));
    f.push_back(make_field("data", "block_budget", D, &DataSection::block_budget, true));
    f.push_back(make_field("data", "sort_by_length", D, &DataSection::sort_by_length, true));
    f.push_back(make_field("data", "cache_dir", D, &DataSection::cache_dir, false));
    f.push_back(make_field("data", "skip_invalid", D, &DataSection::skip_invalid, true));
    auto T = &R::training;
    f.push_back(make_field("training", "epochs", T, &TrainingSection::epochs, true));
    f.push_back(make_field("training", "max_steps", T, &TrainingSection::max_steps, true));
    f.push_back(make_field("training", "lr", T, &TrainingSection::lr, true));
    f.push_back(make_field("training", "warmup_ratio", T, &TrainingSection::warmup_ratio, true));
    f.push_back(make_field("training", "min_lr_ratio", T, &TrainingSection::min_lr_ratio, true));
    f.push_back(make_field("training", "weight_decay", T, &TrainingSection::weight_decay, true));
    f.push_back(make_field("training", "beta1", T, &TrainingSection::beta1, true));
    f.push_back(make_field("training", "beta2", T, &TrainingSection::beta2, true));
    f.push_back(make_field("training", "adam_eps", T, &TrainingSection::adam_eps, true));
    f.push_back(make_field("training", "clip_grad_norm", T, &TrainingSection::clip_grad_norm, true));
    f.push_back(make_field("training", "num_anchors", T, &TrainingSection::num_anchors, true));
    f.push_back(make_field("training", "block_size", T, &TrainingSection::block_size, true));
    f.push_back(make_field("training", "gamma", T, &TrainingSection::gamma, true));
    f.push_back(make_field("training", "loss_type", T, &TrainingSection::loss_type, true));
    f.push_back(make_field("training", "dpace_alpha", T, &TrainingSection::dpace_alpha, true));
    f.push_back(make_field("training", "objective", T, &TrainingSection::objective, true));
    f.push_back(make_field("training", "markov_rank", T, &TrainingSection::markov_rank, true));
    f.push_back(
        make_field("training", "markov_head_type", T, &TrainingSection::markov_head_type, true));
    f.push_back(make_field("training", "enable_confidence_head", T,
                           &TrainingSection::enable_confidence_head, true));
    f.push_back(make_field("training", "confidence_head_with_markov", T,
                           &TrainingSection::confidence_head_with_markov, true));
    f.push_back(make_field("training", "dspark_ce_loss_alpha", T,
                           &TrainingSection::dspark_ce_loss_alpha, true));
    f.push_back(make_field("training", "dspark_l1_loss_alpha", T,
                           &TrainingSection::dspark_l1_loss_alpha, true));
    f.push_back(make_field("training", "dspark_confidence_head_alpha", T,
                           &TrainingSection::dspark_confidence_head_alpha, true));
    f.push_back(
        make_field("training", "conv_kernel_size", T, &TrainingSection::conv_kernel_size, true));
    f.push_back(
        make_field("training", "conv_group_size", T, &TrainingSection::conv_group_size, true));
    f.push_back(make_field("training", "selector_rank", T, &TrainingSection::selector_rank, true));
    f.push_back(
        make_field("training", "selector_top_k", T, &TrainingSection::selector_top_k, true));
    f.push_back(
        make_field("training", "output_multiplier", T, &TrainingSection::output_multiplier, true));
    f.push_back(make_field("training", "final_logit_softcapping", T,
                           &TrainingSection::final_logit_softcapping, true));
    f.push_back(make_field("training", "dflash2_selector_loss_alpha", T,
                           &TrainingSection::dflash2_selector_loss_alpha, true));
    f.push_back(make_field("training", "dflash2_selector_warmup_ratio", T,
                           &TrainingSection::dflash2_selector_warmup_ratio, true));
    f.push_back(make_field("training", "dflash2_selector_ramp_ratio", T,
                           &TrainingSection::dflash2_selector_ramp_ratio, true));
    f.push_back(make_field("training", "dflash2_selector_stop_gradient", T,
                           &TrainingSection::dflash2_selector_stop_gradient, true));
    f.push_back(make_field("training", "emb_dim", T, &TrainingSection::emb_dim, true));
    f.push_back(make_field("training", "gru_hidden_dim", T, &TrainingSection::gru_hidden_dim, true));
    f.push_back(make_field("training", "pure_draft_prefix_len", T,
                           &TrainingSection::pure_draft_prefix_len, true));
    f.push_back(make_field("training", "shift_label", T, &TrainingSection::shift_label, true));
    f.push_back(make_field("training", "lambda_base_start", T, &TrainingSection::lambda_base_start,
                           true));
    f.push_back(make_field("training", "lambda_base_decay_ratio", T,
                           &TrainingSection::lambda_base_decay_ratio, true));
    f.push_back(make_field("training", "seed", T, &TrainingSection::seed, true));
    f.push_back(make_field("training", "save_interval", T, &TrainingSection::save_interval, false));
    f.push_back(make_field("training", "keep_last", T, &TrainingSection::keep_last, false));
    f.push_back(make_field("training", "log_interval", T, &TrainingSection::log_interval, false));
    f.push_back(make_field("training", "eval_interval", T, &TrainingSection::eval_interval, false));
    f.push_back(make_field("training", "max_consecutive_skips", T,
                           &TrainingSection::max_consecutive_skips, false));
    f.push_back(make_field("training", "export_dtype", T, &TrainingSection::export_dtype, false));
    f.push_back(make_field("training", "recompute", T, &TrainingSection::recompute, false));
    auto U = &R::runtime;
    f.push_back(make_field("runtime", "backend", U, &RuntimeSection::backend, false));
    f.push_back(make_field("runtime", "devices", U, &RuntimeSection::devices, false));
    f.push_back(make_field("runtime", "target_devices", U, &RuntimeSection::target_devices, false));
    f.push_back(
        make_field("runtime", "drafter_devices", U, &RuntimeSection::drafter_devices, false));
    f.push_back(make_field("runtime", "colocated", U, &RuntimeSection::colocated, false));
    f.push_back(make_field("runtime", "target_workers", U, &RuntimeSection::target_workers, false));
    f.push_back(
        make_field("runtime", "drafter_workers", U, &RuntimeSection::drafter_workers, false));
    f.push_back(make_field("runtime", "queue_depth", U, &RuntimeSection::queue_depth, false));
    f.push_back(
        make_field("runtime", "stall_timeout_s", U, &RuntimeSection::stall_timeout_s, false));
    f.push_back(make_field("runtime", "threads", U, &RuntimeSection::threads, false));
    f.push_back(make_field("runtime", "cuda_graphs", U, &RuntimeSection::cuda_graphs, false));
    f.push_back(make_field("runtime", "target_prefill", U, &RuntimeSection::target_prefill, false));
    f.push_back(
        make_field("runtime", "device_memory_gib", U, &RuntimeSection::device_memory_gib, false));
    // output_dir is top-level.
    Field od;
    od.key = "output_dir";
    od.affects_model_or_data = false;
    od.set = [](RunConfig& c, const YAML::Node& n, const std::string& src) {
      read_into(c.output_dir, n, "output_dir", src);
    };
    od.get = [](const RunConfig& c) { return YAML::Node(c.output_dir); };
    f.push_back(od);
    return f;
  }();
  return fields;
}

const Field* find_field(const std::string& section, const std::string& key) {
  for (const auto& f : schema()) {
    if (f.section == section && f.key == key) return &f;
  }
  return nullptr;
}

std::string known_keys(const std::string& section) {
  std::string s;
  for (const auto& f : schema()) {
    if (f.section != section) continue;
    if (!s.empty()) s += ", ";
    s += f.key;
  }
  return s;
}

void apply_node(RunConfig& c, const YAML::Node& root, const std::string& src) {
  if (!root || root.IsNull()) return;
  DFLASH_CHECK(root.IsMap(), "{}: the config must be a mapping of sections", src);
  static const std::set<std::string> sections = {"model", "data", "training", "runtime"};
  for (const auto& kv : root) {
    const int line = kv.first.Mark().line + 1;
    DFLASH_CHECK(kv.first.IsScalar(), "{}:{}: a section name must be a plain word, got '{}'", src,
                 line, YAML::Dump(kv.first));
    const std::string name = kv.first.as<std::string>();
    if (name == "output_dir") {
      find_field("", "output_dir")->set(c, kv.second, src);
      continue;
    }
    DFLASH_CHECK(sections.count(name), "{}:{}: unknown section '{}' (expected model, data, "
                 "training, runtime, output_dir)", src, line, name);
    if (kv.second.IsNull()) continue;
    DFLASH_CHECK(kv.second.IsMap(), "{}:{}: section '{}' must be a mapping", src, line, name);
    for (const auto& e : kv.second) {
      DFLASH_CHECK(e.first.IsScalar(),
                   "{}:{}: a key of section '{}' must be a plain word, got '{}'", src,
                   e.first.Mark().line + 1, name, YAML::Dump(e.first));
      const std::string key = e.first.as<std::string>();
      const Field* f = find_field(name, key);
      DFLASH_CHECK(f != nullptr, "{}:{}: unknown key '{}.{}' (known keys of '{}': {})", src,
                   e.first.Mark().line + 1, name, key, name, known_keys(name));
      f->set(c, e.second, src);
    }
  }
}

void apply_override(RunConfig& c, const std::string& ov) {
  const auto eq = ov.find('=');
  DFLASH_CHECK(eq != std::string::npos && eq > 0,
               "override '{}' must have the form section.key=value", ov);
  const std::string path = ov.substr(0, eq);
  const std::string value = ov.substr(eq + 1);
  std::string section, key;
  const auto dot = path.find('.');
  if (dot == std::string::npos) {
    key = path;
  } else {
    section = path.substr(0, dot);
    key = path.substr(dot + 1);
  }
  const Field* f = find_field(section, key);
  DFLASH_CHECK(f != nullptr, "override '{}': unknown key '{}'", ov, path);
  YAML::Node n;
  try {
    n = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    fail("override '{}': value is not valid YAML: {}", ov, e.msg);
  }
  f->set(c, n, "override '" + ov + "'");
}

}  // namespace

RunConfig RunConfig::from_yaml(const std::string& text, const std::string& source,
                               const std::vector<std::string>& overrides) {
  RunConfig c;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    fail("{}:{}: YAML syntax error: {}", source, e.mark.line + 1, e.msg);
  }
  apply_node(c, root, source);
  for (const auto& ov : overrides) apply_override(c, ov);
  c.validate();
  if (!c.data.block_budget) c.data.block_budget = static_cast<int>(c.block_budget());
  return c;
}

RunConfig RunConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream f(path);
  DFLASH_CHECK(f.good(), "cannot read config file '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return from_yaml(ss.str(), path, overrides);
}

RunConfig RunConfig::embedded_default(const std::string& assets_dir) {
  RunConfig c;
  c.model.target = assets_dir + "/tiny-qwen3";
  c.model.drafter_layers = 1;
  c.model.mask_token_id = 8000;
  c.data.train_file = assets_dir + "/data/train.jsonl.xz";
  c.data.template_name = "chatml";
  c.data.max_length = 512;
  c.data.token_budget = 1024;
  c.training.max_steps = 900;
  c.training.lr = 1e-3;
  c.training.warmup_ratio = 0.04;
  c.training.num_anchors = 4;
  c.training.block_size = 16;
  c.training.log_interval = 10;
  c.training.save_interval = 0;
  // Conversations of ~58 tokens with 4 anchors each: a row holds ~18 of them (~70 blocks), far
  // below any memory concern on the CPU backend, so the block budget is the token budget (never
  // binds) rather than the default 4 · 1024 / 512 = 8, which would leave 2 conversations per row.
  c.data.block_budget = c.data.token_budget;
  c.output_dir = "runs/default";
  c.validate();
  return c;
}

void RunConfig::validate() const {
  auto positive = [](const char* key, double v) {
    DFLASH_CHECK(v > 0, "{} must be > 0, got {}", key, v);
  };
  auto non_negative = [](const char* key, double v) {
    DFLASH_CHECK(v >= 0, "{} must be >= 0, got {}", key, v);
  };
  DFLASH_CHECK(!model.target.empty(), "model.target must name the target model folder");
  positive("model.drafter_layers", model.drafter_layers);
  if (model.intermediate_size) positive("model.intermediate_size", *model.intermediate_size);
  if (model.num_attention_heads) positive("model.num_attention_heads", *model.num_attention_heads);
  if (model.num_key_value_heads) positive("model.num_key_value_heads", *model.num_key_value_heads);
  if (model.head_dim) positive("model.head_dim", *model.head_dim);
  if (model.mask_token_id) non_negative("model.mask_token_id", *model.mask_token_id);
  for (int id : model.target_layer_ids) non_negative("model.target_layer_ids[]", id);
  DFLASH_CHECK(!data.train_file.empty(), "data.train_file must name a .jsonl file");
  positive("data.max_length", data.max_length);
  positive("data.token_budget", data.token_budget);
  positive("data.rows_per_step", data.rows_per_step);
  DFLASH_CHECK(data.max_length <= data.token_budget,
               "data.max_length ({}) must not exceed data.token_budget ({}): a conversation must "
               "fit in one row", data.max_length, data.token_budget);
  if (data.block_budget) {
    DFLASH_CHECK(*data.block_budget >= training.num_anchors,
                 "data.block_budget ({}) must be at least training.num_anchors ({}): one document "
                 "may yield num_anchors blocks",
                 *data.block_budget, training.num_anchors);
  }
  DFLASH_CHECK(training.max_steps > 0 || training.epochs > 0,
               "training.epochs or training.max_steps must be > 0");
  non_negative("training.max_steps", static_cast<double>(training.max_steps));
  non_negative("training.epochs", training.epochs);
  positive("training.lr", training.lr);
  DFLASH_CHECK(training.warmup_ratio >= 0 && training.warmup_ratio < 1,
               "training.warmup_ratio must be in [0, 1), got {}", training.warmup_ratio);
  DFLASH_CHECK(training.min_lr_ratio >= 0 && training.min_lr_ratio <= 1,
               "training.min_lr_ratio must be in [0, 1], got {}", training.min_lr_ratio);
  non_negative("training.weight_decay", training.weight_decay);
  DFLASH_CHECK(training.beta1 >= 0 && training.beta1 < 1, "training.beta1 must be in [0, 1)");
  DFLASH_CHECK(training.beta2 >= 0 && training.beta2 < 1, "training.beta2 must be in [0, 1)");
  positive("training.adam_eps", training.adam_eps);
  non_negative("training.clip_grad_norm", training.clip_grad_norm);
  positive("training.num_anchors", training.num_anchors);
  DFLASH_CHECK(training.block_size >= 2 && training.block_size <= 64,
               "training.block_size must be in [2, 64], got {}", training.block_size);
  non_negative("training.save_interval", static_cast<double>(training.save_interval));
  positive("training.keep_last", training.keep_last);
  positive("training.log_interval", static_cast<double>(training.log_interval));
  non_negative("training.eval_interval", static_cast<double>(training.eval_interval));
  positive("training.max_consecutive_skips", training.max_consecutive_skips);
  DFLASH_CHECK(training.export_dtype == "bf16" || training.export_dtype == "f32",
               "training.export_dtype must be bf16 or f32, got '{}'", training.export_dtype);
  DFLASH_CHECK(training.recompute == "auto" || training.recompute == "always" ||
                   training.recompute == "never",
               "training.recompute must be auto, always or never, got '{}'", training.recompute);
  objective_of(training);  // names training.loss_type / training.objective when unknown
  DFLASH_CHECK(training.dpace_alpha >= 0 && training.dpace_alpha <= 1,
               "training.dpace_alpha must be in [0, 1], got {}", training.dpace_alpha);
  dspark_heads_of(training);   // or that no DSpark key is set for dflash
  dflash2_heads_of(training);  // the DFlash2 keys, or that none is set for another objective
  domino_head_of(training);  // the Domino keys, or that none is set for another objective
  DFLASH_CHECK(runtime.backend == "cpu" || runtime.backend == "cuda",
               "runtime.backend must be cpu or cuda, got '{}'", runtime.backend);
  DFLASH_CHECK(!runtime.devices.empty(), "runtime.devices must list at least one device");
  for (int d : runtime.devices) non_negative("runtime.devices[]", d);
  for (int d : runtime.target_devices) non_negative("runtime.target_devices[]", d);
  for (int d : runtime.drafter_devices) non_negative("runtime.drafter_devices[]", d);
  positive("runtime.target_workers", runtime.target_workers);
  positive("runtime.drafter_workers", runtime.drafter_workers);
  positive("runtime.queue_depth", runtime.queue_depth);
  positive("runtime.stall_timeout_s", runtime.stall_timeout_s);
  topology_check_keys(runtime);
  non_negative("runtime.threads", runtime.threads);
  target_prefill_of(runtime.target_prefill);
  positive("runtime.device_memory_gib", runtime.device_memory_gib);
  DFLASH_CHECK(!output_dir.empty(), "output_dir must name the run directory");
}

TargetPrefill target_prefill_of(const std::string& name) {
  if (name == "cudnn") return TargetPrefill::cudnn;
  if (name == "kernels") return TargetPrefill::kernels;
  fail("runtime.target_prefill must be cudnn or kernels, got '{}'", name);
}

const char* target_prefill_name(TargetPrefill p) {
  return p == TargetPrefill::cudnn ? "cudnn" : "kernels";
}

std::string RunConfig::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string current;
  bool open = false;
  for (const auto& f : schema()) {
    if (f.section.empty()) continue;
    if (f.section != current) {
      if (open) out << YAML::EndMap;
      out << YAML::Key << f.section << YAML::Value << YAML::BeginMap;
      current = f.section;
      open = true;
    }
    out << YAML::Key << f.key << YAML::Value << f.get(*this);
  }
  if (open) out << YAML::EndMap;
  out << YAML::Key << "output_dir" << YAML::Value << output_dir;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

Objective objective_of(const TrainingSection& t) {
  const std::optional<LossType> loss = loss_type_parse(t.loss_type);
  DFLASH_CHECK(loss.has_value(),
               "training.loss_type must be dflash, dpace, dpace-cumulative-confidence-only or "
               "dpace-continuation-value-only, got '{}'",
               t.loss_type);
  const std::optional<ObjectiveKind> kind = objective_kind_parse(t.objective);
  DFLASH_CHECK(kind.has_value(),
               "training.objective must be dflash, dspark, dflash2 or domino, got '{}'",
               t.objective);
  Objective o;
  o.loss = *loss;
  o.dpace_alpha = t.dpace_alpha;
  o.kind = *kind;
  if (o.kind == ObjectiveKind::dflash) return o;
  if (o.kind == ObjectiveKind::dflash2) {
    // The base loss is loss_type's on the unary logits: dflash's, or plain D-PACE's (its weights
    // of the base CE, its denominator); the selector's CE takes the same per-slot weights.
    // dflash2_selector_alpha holds the step's α_sel: the trainer sets it per step.
    o.dflash2_stop_gradient = t.dflash2_selector_stop_gradient;
    return o;
  }
  if (o.kind == ObjectiveKind::domino) {
    // SpecForge's OnlineDominoModel fixes loss_type to dflash: its two CE terms carry DFlash's
    // static weights, and no D-PACE variant of them exists to follow.
    DFLASH_CHECK(o.loss == LossType::dflash,
                 "training.loss_type {} is a loss of the dflash objective; training.objective "
                 "domino blends its own two CE terms (training.lambda_base_*): set "
                 "training.loss_type: dflash",
                 t.loss_type);
    o.domino_shift_label = t.shift_label;
    return o;
  }
  // D-PACE weighs slots by the drafter's own CE; DSpark's loss is a sum of three terms with its
  // own weights and denominator (SpecForge's OnlineDSparkModel fixes loss_type to dflash).
  DFLASH_CHECK(o.loss == LossType::dflash,
               "training.loss_type {} is a loss of the dflash objective; training.objective "
               "dspark has its own loss (training.dspark_*_alpha): set training.loss_type: dflash",
               t.loss_type);
  o.dspark_ce_alpha = t.dspark_ce_loss_alpha;
  o.dspark_l1_alpha = t.dspark_l1_loss_alpha;
  o.dspark_conf_alpha = t.dspark_confidence_head_alpha;
  for (auto [key, v] : {std::pair{"dspark_ce_loss_alpha", o.dspark_ce_alpha},
                        std::pair{"dspark_l1_loss_alpha", o.dspark_l1_alpha},
                        std::pair{"dspark_confidence_head_alpha", o.dspark_conf_alpha}}) {
    DFLASH_CHECK(std::isfinite(v) && v >= 0, "training.{} must be a number >= 0, got {}", key, v);
  }
  DFLASH_CHECK(o.dspark_ce_alpha + o.dspark_l1_alpha + o.dspark_conf_alpha > 0,
               "training.dspark_ce_loss_alpha, dspark_l1_loss_alpha and "
               "dspark_confidence_head_alpha are all 0: the DSpark loss would be 0");
  return o;
}

DsparkHeads dspark_heads_of(const TrainingSection& t) {
  const Objective o = objective_of(t);
  const TrainingSection defaults;
  if (!o.dspark()) {
    // A DSpark key given to a dflash run would be ignored: refuse it by name.
    const std::pair<const char*, bool> unused[] = {
        {"markov_rank", t.markov_rank != defaults.markov_rank},
        {"markov_head_type", t.markov_head_type != defaults.markov_head_type},
        {"enable_confidence_head", t.enable_confidence_head.has_value()},
        {"confidence_head_with_markov", t.confidence_head_with_markov},
        {"dspark_ce_loss_alpha", t.dspark_ce_loss_alpha != defaults.dspark_ce_loss_alpha},
        {"dspark_l1_loss_alpha", t.dspark_l1_loss_alpha != defaults.dspark_l1_loss_alpha},
        {"dspark_confidence_head_alpha",
         t.dspark_confidence_head_alpha != defaults.dspark_confidence_head_alpha}};
    for (const auto& [key, set] : unused) {
      DFLASH_CHECK(!set, "training.{} applies only to training.objective: dspark (the objective "
                   "is {})", key, t.objective);
    }
    return {};
  }
  DsparkHeads h;
  h.enabled = true;
  DFLASH_CHECK(t.markov_rank >= 0, "training.markov_rank must be >= 0 (0: no Markov head), got {}",
               t.markov_rank);
  h.markov_rank = t.markov_rank;
  const std::optional<MarkovHeadType> type = markov_head_type_parse(t.markov_head_type);
  DFLASH_CHECK(type.has_value(), "training.markov_head_type must be vanilla, gated or rnn, got '{}'",
               t.markov_head_type);
  h.markov_type = *type;
  DFLASH_CHECK(h.markov_rank > 0 || h.markov_type == MarkovHeadType::vanilla,
               "training.markov_head_type {} needs training.markov_rank > 0 (0: no Markov head)",
               t.markov_head_type);
  h.confidence_head = t.enable_confidence_head.value_or(o.dspark_conf_alpha > 0);
  h.confidence_with_markov = t.confidence_head_with_markov;
  DFLASH_CHECK(!h.confidence_with_markov || h.markov_rank > 0,
               "training.confidence_head_with_markov needs training.markov_rank > 0");
  DFLASH_CHECK(!h.confidence_with_markov || h.confidence_head,
               "training.confidence_head_with_markov needs the confidence head "
               "(training.enable_confidence_head)");
  return h;
}

Dflash2Heads dflash2_heads_of(const TrainingSection& t) {
  const Objective o = objective_of(t);
  const TrainingSection defaults;
  const std::pair<const char*, bool> keys[] = {
      {"conv_kernel_size", t.conv_kernel_size != defaults.conv_kernel_size},
      {"conv_group_size", t.conv_group_size != defaults.conv_group_size},
      {"selector_rank", t.selector_rank != defaults.selector_rank},
      {"selector_top_k", t.selector_top_k != defaults.selector_top_k},
      {"output_multiplier", t.output_multiplier != defaults.output_multiplier},
      {"final_logit_softcapping", t.final_logit_softcapping != defaults.final_logit_softcapping},
      {"dflash2_selector_loss_alpha",
       t.dflash2_selector_loss_alpha != defaults.dflash2_selector_loss_alpha},
      {"dflash2_selector_warmup_ratio",
       t.dflash2_selector_warmup_ratio != defaults.dflash2_selector_warmup_ratio},
      {"dflash2_selector_ramp_ratio",
       t.dflash2_selector_ramp_ratio != defaults.dflash2_selector_ramp_ratio},
      {"dflash2_selector_stop_gradient",
       t.dflash2_selector_stop_gradient != defaults.dflash2_selector_stop_gradient}};
  if (!o.dflash2()) {
    // A DFlash2 key given to a run of another objective would be ignored: refuse it by name.
    for (const auto& [key, set] : keys) {
      DFLASH_CHECK(!set,
                   "training.{} applies only to training.objective: dflash2 (the objective "
                   "is {})",
                   key, t.objective);
    }
    return {};
  }
  for (auto [key, v] : {std::pair{"conv_kernel_size", t.conv_kernel_size},
                        std::pair{"conv_group_size", t.conv_group_size},
                        std::pair{"selector_rank", t.selector_rank},
                        std::pair{"selector_top_k", t.selector_top_k}}) {
    DFLASH_CHECK(v >= 1,
                 "training.{} must be set to an integer >= 1 for training.objective "
                 "dflash2 (got {}; the public recipes use conv_kernel_size 2, conv_group_size 16, "
                 "selector_rank 256, selector_top_k 16)",
                 key, v);
  }
  DFLASH_CHECK(t.conv_kernel_size <= t.block_size,
               "training.conv_kernel_size {} must be <= training.block_size {}", t.conv_kernel_size,
               t.block_size);
  DFLASH_CHECK(std::isfinite(t.output_multiplier) && t.output_multiplier > 0,
               "training.output_multiplier must be a finite number > 0, got {}",
               t.output_multiplier);
  DFLASH_CHECK(std::isfinite(t.final_logit_softcapping) && t.final_logit_softcapping >= 0,
               "training.final_logit_softcapping must be a finite number >= 0 (0: none), got {}",
               t.final_logit_softcapping);
  DFLASH_CHECK(std::isfinite(t.dflash2_selector_loss_alpha) && t.dflash2_selector_loss_alpha >= 0,
               "training.dflash2_selector_loss_alpha must be a finite number >= 0, got {}",
               t.dflash2_selector_loss_alpha);
  for (auto [key, v] : {std::pair{"dflash2_selector_warmup_ratio", t.dflash2_selector_warmup_ratio},
                        std::pair{"dflash2_selector_ramp_ratio", t.dflash2_selector_ramp_ratio}}) {
    DFLASH_CHECK(v >= 0 && v <= 1, "training.{} must be in [0, 1], got {}", key, v);
  }
  Dflash2Heads h;
  h.enabled = true;
  h.conv_kernel_size = t.conv_kernel_size;
  h.conv_group_size = t.conv_group_size;
  h.selector_rank = t.selector_rank;
  h.selector_top_k = t.selector_top_k;
  h.output_multiplier = t.output_multiplier;
  h.final_logit_softcapping = t.final_logit_softcapping;
  return h;
}

DominoHead domino_head_of(const TrainingSection& t) {
  const Objective o = objective_of(t);
  const TrainingSection defaults;
  if (!o.domino()) {
    // A Domino key given to another objective would be ignored: refuse it by name.
    const std::pair<const char*, bool> unused[] = {
        {"emb_dim", t.emb_dim.has_value()},
        {"gru_hidden_dim", t.gru_hidden_dim.has_value()},
        {"pure_draft_prefix_len", t.pure_draft_prefix_len != defaults.pure_draft_prefix_len},
        {"shift_label", t.shift_label != defaults.shift_label},
        {"lambda_base_start", t.lambda_base_start != defaults.lambda_base_start},
        {"lambda_base_decay_ratio", t.lambda_base_decay_ratio != defaults.lambda_base_decay_ratio}};
    for (const auto& [key, set] : unused) {
      DFLASH_CHECK(!set, "training.{} applies only to training.objective: domino (the objective "
                   "is {})", key, t.objective);
    }
    return {};
  }
  DFLASH_CHECK(t.emb_dim.has_value(),
               "training.emb_dim is required by training.objective domino (the width of "
               "embed_proj; SpecForge's example configs use 256)");
  DFLASH_CHECK(t.gru_hidden_dim.has_value(),
               "training.gru_hidden_dim is required by training.objective domino (the GRU's "
               "state width; SpecForge's example configs use 1024)");
  DFLASH_CHECK(*t.emb_dim > 0, "training.emb_dim must be > 0, got {}", *t.emb_dim);
  DFLASH_CHECK(*t.gru_hidden_dim > 0, "training.gru_hidden_dim must be > 0, got {}",
               *t.gru_hidden_dim);
  DominoHead h;
  h.enabled = true;
  h.emb_dim = *t.emb_dim;
  h.gru_hidden_dim = *t.gru_hidden_dim;
  h.pure_draft_prefix_len = t.pure_draft_prefix_len;
  h.shift_label = t.shift_label;
  DFLASH_CHECK(t.pure_draft_prefix_len >= 0 && h.suffix_start() < t.block_size,
               "training.pure_draft_prefix_len must be in [0, {}] (block_size {}, shift_label {}: "
               "at least one slot corrected), got {}",
               t.block_size - (t.shift_label ? 1 : 2), t.block_size, t.shift_label,
               t.pure_draft_prefix_len);
  DFLASH_CHECK(std::isfinite(t.lambda_base_start) && t.lambda_base_start >= 0 &&
                   t.lambda_base_start <= 1,
               "training.lambda_base_start must be in [0, 1], got {}", t.lambda_base_start);
  DFLASH_CHECK(std::isfinite(t.lambda_base_decay_ratio) && t.lambda_base_decay_ratio > 0 &&
                   t.lambda_base_decay_ratio <= 1,
               "training.lambda_base_decay_ratio must be in (0, 1], got {}",
               t.lambda_base_decay_ratio);
  return h;
}

int64_t RunConfig::block_budget() const {
  if (data.block_budget) return *data.block_budget;
  const int64_t a = training.num_anchors, t = data.token_budget, m = data.max_length;
  return (a * t + m - 1) / m;
}

std::vector<std::string> RunConfig::shape_changes(const RunConfig& other) const {
  static const std::set<std::string> size_keys = {"drafter_layers", "intermediate_size",
                                                  "num_attention_heads", "num_key_value_heads",
                                                  "head_dim"};
  // Taps: an empty list means one per drafter layer (default_target_layer_ids).
  auto n_taps = [](const RunConfig& c) {
    return c.model.target_layer_ids.empty() ? static_cast<size_t>(c.model.drafter_layers)
                                            : c.model.target_layer_ids.size();
  };
  std::vector<std::string> diffs;
  // The DSpark heads add tensors: the objective, markov_rank, markov_head_type and the confidence
  // head's keys change the parameter shapes.
  if (dspark_heads_of(training) != dspark_heads_of(other.training)) {
    for (const char* key : {"objective", "markov_rank", "markov_head_type",
                            "enable_confidence_head", "confidence_head_with_markov",
                            "dspark_confidence_head_alpha"}) {
      const Field* f = find_field("training", key);
      const std::string a = YAML::Dump(f->get(*this)), b = YAML::Dump(f->get(other));
      if (a != b) diffs.push_back(f->path() + ": " + a + " -> " + b);
    }
  }
  // DFlash2's conv and selector add tensors whose shapes follow these keys.
  if (dflash2_heads_of(training) != dflash2_heads_of(other.training)) {
    for (const char* key : {"objective", "conv_kernel_size", "conv_group_size", "selector_rank"}) {
      const Field* f = find_field("training", key);
      const std::string a = YAML::Dump(f->get(*this)), b = YAML::Dump(f->get(other));
      const std::string d = f->path() + ": " + a + " -> " + b;
      if (a != b && std::find(diffs.begin(), diffs.end(), d) == diffs.end()) diffs.push_back(d);
    }
  }
  // The Domino head adds tensors: the objective, emb_dim and gru_hidden_dim change the shapes.
  const DominoHead da = domino_head_of(training), db = domino_head_of(other.training);
  if (da.enabled != db.enabled || da.emb_dim != db.emb_dim ||
      da.gru_hidden_dim != db.gru_hidden_dim) {
    for (const char* key : {"objective", "emb_dim", "gru_hidden_dim"}) {
      const Field* f = find_field("training", key);
      const std::string a = YAML::Dump(f->get(*this)), b = YAML::Dump(f->get(other));
      const bool listed = std::find(diffs.begin(), diffs.end(), f->path() + ": " + a + " -> " + b) !=
                          diffs.end();
      if (a != b && !listed) diffs.push_back(f->path() + ": " + a + " -> " + b);
    }
  }
  for (const auto& f : schema()) {
    const bool taps = f.section == "model" && f.key == "target_layer_ids";
    if (f.section != "model" || (!size_keys.count(f.key) && !taps)) continue;
    if (taps && n_taps(*this) == n_taps(other)) continue;
    const std::string a = YAML::Dump(f.get(*this)), b = YAML::Dump(f.get(other));
    if (a != b) diffs.push_back(f.path() + ": " + a + " -> " + b);
  }
  return diffs;
}

std::vector<std::string> resume_check(const RunConfig& saved, const RunConfig& requested,
                                      bool force, const std::string& dir) {
  auto listed = [](const std::vector<std::string>& keys) {
    std::string list;
    for (const auto& d : keys) list += "\n  " + d;
    return list;
  };
  const std::vector<std::string> shapes = saved.shape_changes(requested);
  DFLASH_CHECK(shapes.empty(),
               "--resume {}: the configuration changes the drafter's parameter shapes, which the "
               "checkpoint's tensors cannot take (not even with --force); start a new run in "
               "another output_dir to train another drafter size:{}",
               dir, listed(shapes));
  std::vector<std::string> diffs = saved.resume_incompatibilities(requested);
  DFLASH_CHECK(diffs.empty() || force,
               "--resume {}: the configuration differs from the checkpoint's in keys that change "
               "the model or the data order (use --force to resume anyway):{}",
               dir, listed(diffs));
  return diffs;
}

std::vector<std::string> RunConfig::resume_incompatibilities(const RunConfig& other) const {
  std::vector<std::string> diffs;
  for (const auto& f : schema()) {
    if (!f.affects_model_or_data) continue;
    const std::string a = YAML::Dump(f.get(*this)), b = YAML::Dump(f.get(other));
    if (a != b) diffs.push_back(f.path() + ": " + a + " -> " + b);
  }
  return diffs;
}

}  // namespace dflash
