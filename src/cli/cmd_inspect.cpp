// `dflash inspect MODEL_DIR`: reads config.json and the safetensors checkpoint of a HF model
// folder, checks that the weights match the config (missing tensors or wrong shapes are errors),
// and prints one "key: value" line per figure on stdout: the architecture, its sizes, attention
// features (biases, sliding window, sinks), the mixture of experts (experts, top-k, router, expert
// width, sparse layers, activation, quantization), parameters in the files and active per token.
// The keys and their order are stable (tests and scripts grep them); counts use thousands
// separators.
// With `--prompt TEXT` it also runs the model (CPU, fp32 compute): TEXT is tokenized as raw text
// (no chat template is applied: pass the rendered prompt), greedy decoding with the KV cache prints
// the continuation (special tokens included) after a line "continuation:", stopping after an
// end-of-sequence token (generation_config.json, else config.json) or --max-new-tokens.
// A DFlash drafter folder (`architectures: ["DFlashDraftModel"]`) is described as a drafter: its
// sizes, block size, mask id and target taps, with its weights checked against its config.
#include <fmt/format.h>

#include <map>

#include "cli/cli_util.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/log.hpp"
#include "data/tokenizer.hpp"
#include "model/config.hpp"
#include "model/drafter_io.hpp"
#include "model/safetensors.hpp"
#include "model/target.hpp"
#include "model/weights.hpp"

namespace dflash::cli {

namespace {

std::string rope_str(const RopeConfig& r) {
  std::string s = fmt::format("{}, theta {}", rope_type_name(r.type), r.theta);
  switch (r.type) {
    case RopeType::standard: break;
    case RopeType::linear: s += fmt::format(", factor {}", r.factor); break;
    case RopeType::llama3:
      s += fmt::format(", factor {}, low_freq_factor {}, high_freq_factor {}, "
                       "original_max_position_embeddings {}",
                       r.factor, r.low_freq_factor, r.high_freq_factor,
                       r.original_max_position_embeddings);
      break;
    case RopeType::yarn:
      s += fmt::format(", factor {}, original_max_position_embeddings {}, beta_fast {}, "
                       "beta_slow {}, attention_factor {:.6g}{}",
                       r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow,
                       r.attention_factor, r.truncate ? "" : ", truncate false");
      break;
  }
  if (r.partial_rotary_factor != 1.0) s += fmt::format(", partial_rotary_factor {}", r.partial_rotary_factor);
  return s;
}

void print_line(const std::string& key, const std::string& value) {
  fmt::print("{:<34}{}\n", key + ":", value);
}

// "128 (top-8, softmax_topk, norm_topk_prob no)" or "none".
std::string experts_str(const ModelConfig& c) {
  if (!c.is_moe()) return "none";
  std::string s = fmt::format("{} (top-{}, router {}", c.num_experts, c.num_experts_per_tok,
                              moe_routing_name(c.routing));
  if (c.routing == MoeRoutingMode::softmax_topk)
    s += fmt::format(", norm_topk_prob {}", c.norm_topk_prob ? "yes" : "no");
  if (c.router_bias) s += ", router bias";
  if (c.expert_bias) s += ", expert biases";
  return s + ")";
}

// "48 of 48" or "46 of 48 (dense: 0, 47)".
std::string moe_layers_str(const ModelConfig& c) {
  if (!c.is_moe()) return "none";
  std::vector<int64_t> dense;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (!c.moe_layers[static_cast<size_t>(l)]) dense.push_back(l);
  std::string s = fmt::format("{} of {}", c.num_moe_layers(), c.num_hidden_layers);
  if (!dense.empty()) s += fmt::format(" (dense: {})", fmt::join(dense, ", "));
  return s;
}

std::string activation_str(const ModelConfig& c) {
  if (!c.is_moe()) return "none";
  if (c.expert_activation == MoeActivation::clamped_swiglu)
    return fmt::format("clamped_swiglu (alpha {}, limit {})", c.swiglu_alpha, c.swiglu_limit);
  return std::string(moe_activation_name(c.expert_activation));
}

/// True when `dir`'s config.json names DFlashDraftModel in `architectures` (a DFlash drafter, not
/// a model of its own: it borrows its target's embedding and LM head).
bool is_drafter_folder(const std::string& dir) {
  const auto cfg = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::is_regular_file(cfg)) return false;
  const nlohmann::json j = json_load_file(cfg);
  const auto a = j.is_object() ? j.find("architectures") : j.end();
  if (a == j.end() || !a->is_array()) return false;
  for (const auto& name : *a) {
    if (name.is_string() && name.get<std::string>() == "DFlashDraftModel") return true;
  }
  return false;
}

/// Byte counts per dtype and the parameter count of every tensor of `ckpt`.
std::pair<int64_t, std::string> sizes_of(const SafetensorsCheckpoint& ckpt) {
  int64_t params = 0;
  std::map<std::string, int64_t> bytes_by_dtype;
  for (const std::string& n : ckpt.names()) {
    const TensorInfo& ti = ckpt.info(n);
    params += ti.numel();
    bytes_by_dtype[std::string(dtype_name(ti.dtype))] += static_cast<int64_t>(ti.nbytes());
  }
  std::string bytes;
  for (const auto& [dt, b] : bytes_by_dtype) {
    bytes += fmt::format("{}{} {}", bytes.empty() ? "" : ", ", dt, format_thousands(b));
  }
  return {params, bytes};
}

// A DFlash drafter folder: its config (drafter_config_from_json) and weights
// (drafter_check_weights), described as such.
void run_inspect_drafter(const std::string& dir) {
  const auto cfg_path = std::filesystem::path(dir) / "config.json";
  const DrafterConfig c = drafter_config_from_json(json_load_file(cfg_path), cfg_path.string());
  const SafetensorsCheckpoint ckpt(dir);
  drafter_check_weights(dir, c, ckpt);
  const auto [params, bytes] = sizes_of(ckpt);
  print_line("model", dir);
  print_line("architecture",
             "DFlash drafter [DFlashDraftModel] (qwen3 layers; uses its target's "
             "embedding and LM head)");
  print_line("drafter layers", std::to_string(c.num_layers));
  print_line("hidden size", std::to_string(c.hidden_size));
  print_line("intermediate size", std::to_string(c.intermediate_size));
  print_line("attention heads", std::to_string(c.num_heads));
  print_line("kv heads", std::to_string(c.num_kv_heads));
  print_line("head dim", std::to_string(c.head_dim));
  print_line("vocab size", fmt::format("{} (the target's)", c.vocab_size));
  print_line("block size", std::to_string(c.block_size));
  print_line("mask token id", std::to_string(c.mask_token_id));
  print_line("target layers", std::to_string(c.num_target_layers));
  print_line("target layer ids", fmt::format("[{}]", fmt::join(c.target_layer_ids, ", ")));
  print_line("parameters", format_thousands(params));
  print_line("bytes by dtype", bytes);
  print_line("shards", std::to_string(ckpt.num_shards()));
  print_line("tensors", std::to_string(ckpt.size()));
  print_line("use", "dflash generate/eval --target TARGET_DIR --drafter " + dir);
}

void run_inspect(const std::string& dir) {
  const ModelConfig c = model_config_load(dir);
  const SafetensorsCheckpoint ckpt(dir);
  const WeightReport rep = check_weights(c, ckpt);

  // Everything in the files counts (unexpected tensors too); MXFP4 blocks hold 2 parameters per
  // byte and their scales none.
  auto [params, bytes] = sizes_of(ckpt);
  for (const WeightSpec& s : expected_weights(c))
    if (s.format != WeightFormat::float_any) params += s.parameters() - shape_numel(s.shape);
  std::string arch = std::string(arch_name(c.arch));
  if (c.model_type != arch) arch += fmt::format(" (model_type {})", c.model_type);
  if (!c.architectures.empty()) arch += fmt::format(" [{}]", fmt::join(c.architectures, ", "));

  print_line("model", dir);
  print_line("architecture", arch);
  print_line("layers", std::to_string(c.num_hidden_layers));
  print_line("hidden size", std::to_string(c.hidden_size));
  print_line("intermediate size", std::to_string(c.intermediate_size));
  print_line("attention heads", std::to_string(c.num_attention_heads));
  print_line("kv heads", std::to_string(c.num_key_value_heads));
  print_line("head dim", std::to_string(c.head_dim));
  print_line("vocab size", std::to_string(c.vocab_size));
  print_line("tied embeddings", c.tie_word_embeddings ? "yes" : "no");
  print_line("qk norm", c.qk_norm ? "yes" : "no");
  print_line("attention bias", c.attention_bias ? (c.o_proj_bias ? "q, k, v, o" : "q, k, v") : "no");
  print_line("rms norm eps", fmt::format("{}", c.rms_norm_eps));
  print_line("max position embeddings", std::to_string(c.max_position_embeddings));
  print_line("rope", rope_str(c.rope));
  print_line("sliding window",
             c.sliding_window > 0 ? fmt::format("{} tokens on {} of {} layers", c.sliding_window,
                                                c.num_sliding_layers(), c.num_hidden_layers)
                                  : std::string("none"));
  print_line("attention sinks", c.attention_sinks ? "yes" : "no");
  print_line("experts", experts_str(c));
  print_line("expert intermediate size", c.is_moe() ? std::to_string(c.expert_width) : "none");
  print_line("moe layers", moe_layers_str(c));
  print_line("expert activation", activation_str(c));
  print_line("quantization",
             c.quantization.empty() ? std::string("none")
                                    : fmt::format("{} experts (dequantised to bf16 at load)",
                                                  c.quantization));
  print_line("eos token ids",
             c.eos_token_ids.empty() ? std::string("none") : fmt::format("{}", fmt::join(c.eos_token_ids, ", ")));
  print_line("parameters", format_thousands(params));
  print_line("active parameters", format_thousands(active_parameters(c)));
  print_line("bytes by dtype", bytes);
  print_line("shards", std::to_string(ckpt.num_shards()));
  print_line("tensors", std::to_string(ckpt.size()));
  print_line("unexpected tensors",
             rep.unexpected.empty() ? std::string("none")
                                    : fmt::format("{} ({})", rep.unexpected.size(),
                                                  fmt::join(rep.unexpected, ", ")));
  const int n_layers = static_cast<int>(c.num_hidden_layers);
  print_line("default taps (1 drafter layer)",
             fmt::format("[{}]", fmt::join(default_target_layer_ids(n_layers, 1), ", ")));
  std::string taps5;
  try {
    taps5 = fmt::format("[{}]", fmt::join(default_target_layer_ids(n_layers, 5), ", "));
  } catch (const Error& e) {
    taps5 = fmt::format("none ({})", e.what());
  }
  print_line("default taps (5 drafter layers)", taps5);
}

// Greedy continuation of raw `prompt` text.
void run_prompt(const std::string& dir, const std::string& prompt, int64_t max_new_tokens) {
  const Tokenizer tok = Tokenizer::load(dir);
  const std::vector<int32_t> ids = tok.encode(prompt);
  DFLASH_CHECK(!ids.empty(), "--prompt: the prompt is empty (it encodes to no token)");
  const TargetModel model = TargetModel::load(dir);
  const std::vector<int64_t> eos = generation_eos_ids(dir, model.config());
  const std::vector<int32_t> out = greedy_generate(model, ids, max_new_tokens, eos, true);
  print_line("prompt tokens", std::to_string(ids.size()));
  print_line("generated tokens", std::to_string(out.size()));
  fmt::print("continuation:\n{}\n", tok.decode(out));
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "inspect", "Describe a HF model folder or a DFlash drafter (config.json + safetensors)");
  auto dir = std::make_shared<std::string>();
  sub->add_option("model_dir", *dir, "Folder with config.json and safetensors")->required();
  auto prompt = std::make_shared<std::string>();
  auto has_prompt = std::make_shared<bool>(false);
  auto max_new = std::make_shared<int64_t>(48);
  sub->add_option_function<std::string>(
      "--prompt",
      [prompt, has_prompt](const std::string& p) {
        *prompt = p;
        *has_prompt = true;
      },
      "Also print the model's greedy continuation of TEXT (raw text: no chat template is "
      "applied, pass the rendered prompt)");
  sub->add_option("--max-new-tokens", *max_new, "Most tokens generated for --prompt")
      ->check(at_least(1));
  sub->callback([dir, prompt, has_prompt, max_new] {
    if (is_drafter_folder(*dir)) {
      DFLASH_CHECK(!*has_prompt,
                   "--prompt: {} is a DFlash drafter, which drafts for a target and does not "
                   "generate on its own; use dflash generate --target TARGET_DIR --drafter {} "
                   "--prompt TEXT",
                   *dir, *dir);
      run_inspect_drafter(*dir);
      return;
    }
    run_inspect(*dir);
    if (*has_prompt) run_prompt(*dir, *prompt, *max_new);
  });
}

}  // namespace dflash::cli
