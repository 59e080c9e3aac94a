// dflash.cpp — command-line options shared by `dflash generate` and `dflash eval` (internal to
// src/cli): model folders, block size, batch size, sampling, stop tokens, seed, backend.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/cli_util.hpp"
#include "core/error.hpp"
#include "core/json_util.hpp"
#include "data/chat_template.hpp"
#include "data/dataset.hpp"
#include "data/tokenizer.hpp"
#include "infer/speculative.hpp"
#include "model/drafter_io.hpp"
#include "model/target.hpp"

namespace dflash::cli {

/// Raw values of the shared decoding flags.
struct DecodeArgs {
  std::string target, drafter, chat_template;
  std::string backend = "cpu";  ///< "cpu" or "cuda" (cli/cuda_decoder.hpp)
  int64_t max_new_tokens = 128;
  int block_size = 0;
  int batch_size = 1;
  double temperature = 0.0, top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;
  bool no_default_stop = false;
};

/// How the decoding commands load the target: the weights as stored (bf16 views of the
/// checkpoint). Decoding's forwards of at most 16 rows read bf16 weights directly (the few-rows
/// kernel of ops/linear.hpp: half the bytes of f32 copies, the same bits, since bf16 → f32 is
/// exact); the prompt's prefill converts them tile by tile.
inline TargetLoadOptions target_load_options() {
  return TargetLoadOptions{};
}

/// Registers the shared flags on `sub`, writing into `a` (which must outlive the app).
inline void add_decode_args(CLI::App* sub, DecodeArgs& a) {
  sub->add_option("--target", a.target, "Target model folder (HF config.json + safetensors)")
      ->required();
  sub->add_option("--drafter", a.drafter,
                  "Drafter folder (DFlash export: config.json + "
                  "model.safetensors)")
      ->required();
  sub->add_option("--max-new-tokens", a.max_new_tokens, "Most tokens generated per prompt")
      ->check(at_least(1))
      ->capture_default_str();
  sub->add_option("--block-size", a.block_size,
                  "Block size at run time, in [2, trained block_size] (0: the trained one)")
      ->capture_default_str()
      ->check(at_least(0));
  sub->add_option("--batch-size", a.batch_size,
                  "Requests decoded at once (each with its own acceptance; outputs do not depend "
                  "on it)")
      ->capture_default_str()
      ->check(at_least(1));
  sub->add_option("--temperature", a.temperature,
                  "0: greedy (lossless, compared token for "
                  "token); > 0: speculative sampling")
      ->capture_default_str();
  sub->add_option("--top-k", a.top_k, "Keep the k most likely tokens (0: off)")
      ->capture_default_str()
      ->check(at_least(0));
  sub->add_option("--top-p", a.top_p, "Nucleus sampling mass in (0, 1] (1: off)")
      ->capture_default_str();
  sub->add_option("--seed", a.seed, "Seed of the sampling RNG")->capture_default_str();
  sub->add_option("--stop-id", a.stop_ids,
                  "Extra stop token id (repeatable); added to generation_config.json's "
                  "eos_token_id (else config.json's); an id of the target's vocabulary")
      ->check(at_least(0));
  sub->add_flag("--no-default-stop", a.no_default_stop,
                "Do not stop on the model's eos_token_id (only on --stop-id)");
  sub->add_option("--backend", a.backend,
                  "Where to decode: cpu, or cuda (GPU 0)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--template", a.chat_template,
                  "Chat template (chatml, qwen3, llama3); default: detected from the target "
                  "folder");
}

/// The DecodeOptions of the parsed flags; the stop ids are the target's generation eos ids
/// (generation_eos_ids) unless --no-default-stop, plus --stop-id, without duplicates. Throws
/// dflash::Error for a --stop-id outside the target's vocabulary or invalid sampling flags.
inline DecodeOptions decode_options_from(const DecodeArgs& a, const ModelConfig& target_cfg) {
  for (int64_t id : a.stop_ids) {
    DFLASH_CHECK(id >= 0 && id < target_cfg.vocab_size,
                 "--stop-id {} is not a token of the target's vocabulary [0, {}) ({})", id,
                 target_cfg.vocab_size, a.target);
  }
  DecodeOptions o;
  o.max_new_tokens = a.max_new_tokens;
  o.block_size = a.block_size;
  o.sampling.temperature = a.temperature;
  o.sampling.top_k = a.top_k;
  o.sampling.top_p = a.top_p;
  o.seed = a.seed;
  if (!a.no_default_stop) o.stop_ids = generation_eos_ids(a.target, target_cfg);
  for (int64_t id : a.stop_ids)
    if (std::find(o.stop_ids.begin(), o.stop_ids.end(), id) == o.stop_ids.end())
      o.stop_ids.push_back(id);
  o.sampling.validate();
  return o;
}

/// The checks of the decoding commands that need the drafter and the tokenizer but not the
/// target's weights, made before those are loaded: the drafter fits the target's config,
/// --block-size is in [2, trained block size] (or 0), the drafter's mask id is no token of the
/// tokenizer, and a chat template (when one is used) finds its special tokens in the tokenizer.
inline void check_decoding_inputs(const DecodeArgs& a, const ModelConfig& target_cfg,
                                  const DrafterConfig& drafter, const Tokenizer& tok,
                                  const ChatTemplate* tmpl) {
  drafter_check_target(drafter, target_cfg);
  DFLASH_CHECK(a.block_size == 0 || (a.block_size >= 2 && a.block_size <= drafter.block_size),
               "block size {} (--block-size) is outside [2, {}] (the drafter was trained with "
               "block_size {})",
               a.block_size, drafter.block_size, drafter.block_size);
  drafter_check_tokenizer(drafter, tok, a.drafter);
  if (tmpl) {
    check_template_tokens(
        *tmpl,
        [&tok](std::string_view text, std::vector<std::pair<size_t, size_t>>* offsets) {
          return tok.encode(text, offsets);
        },
        (std::filesystem::path(a.target) / "tokenizer.json").string());
  }
}

}  // namespace dflash::cli
