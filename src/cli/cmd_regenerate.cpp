// `dflash regenerate --target DIR --data IN.jsonl --out OUT.jsonl [--drafter DIR] [--temperature T]
// [--max-new-tokens N] [--thinking on|off] [--batch-size N] [--skip-invalid] [--seed S]
// [--backend cpu|cuda] [--max-context N]`: the
// target answers the corpus's user turns again (infer/regenerate.hpp: turn by turn, with its own
// chat template, resumable, deterministic for a seed). With --drafter the decoding is speculative
// (greedy: the same output, faster when the drafter is good), else target-only. Progress on
// stderr; the counts and rates on stdout, one figure per line (stable keys).
//
// --backend cuda: the CUDA decoder allocates its caches at construction, but a turn's prompt holds
// the earlier answers and exists only once they are decoded. The plan is made before decoding
// from the input alone: regenerate_prompt_bound (infer/regenerate.hpp: each record's rendered user
// turns plus a budget per earlier answer), or --max-context N (prompt + max_new_tokens + block
// size per request) when the user knows better. A pre-pass is chosen over a required flag
// because the bound is cheap (one render and encode per record) and the user cannot know the
// prompts' token counts; the flag remains for an input whose answers re-encode longer than
// budgeted. A prompt over the plan is an error naming IN:line (skipped under --skip-invalid),
// never cut.
#include <fmt/format.h>

#include <optional>

#include "cli/cli_util.hpp"
#include "cli/commands.hpp"
#include "cli/cuda_decoder.hpp"
#include "cli/decode_args.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "infer/decoder_cpu.hpp"
#include "infer/regenerate.hpp"

namespace dflash::cli {

namespace {

struct RegenerateArgs {
  DecodeArgs d;  // target, drafter (optional here), sampling, seed, stop ids, template
  std::string data, out, thinking;
  int64_t max_context = 0;  // --max-context (cuda; 0: planned from the input)
  bool skip_invalid = false;
};

// The chat template with the thinking mode asked for: --thinking is required when the template
// has a thinking mode (qwen3: the answers differ completely), refused when it has none.
ChatTemplate template_for(const RegenerateArgs& a) {
  ChatTemplate t = resolve_chat_template(a.d.target, a.d.chat_template);
  if (t.family == TemplateFamily::qwen3) {
    DFLASH_CHECK(!a.thinking.empty(),
                 "--thinking on|off is required: the {} template of {} has a thinking mode (the "
                 "answers the target gives depend on it)",
                 t.name(), a.d.target);
  } else {
    DFLASH_CHECK(a.thinking != "on", "--thinking on: the {} template of {} has no thinking mode",
                 t.name(), a.d.target);
  }
  t.enable_thinking = a.thinking == "on";
  return t;
}

void run_regenerate(const RegenerateArgs& a) {
  // Every argument is checked before the target's weights are loaded.
  const bool cuda = a.d.backend == "cuda";
  DFLASH_CHECK(cuda || a.max_context == 0,
               "--max-context plans the cuda backend's memory; the cpu backend has no plan (drop "
               "it or use --backend cuda)");
  if (cuda) {
    check_cuda_backend();
  }
  const ModelConfig target_cfg = model_config_load(a.d.target);
  const DecodeOptions opts = decode_options_from(a.d, target_cfg);
  const Tokenizer tok = Tokenizer::load(a.d.target);
  const ChatTemplate tmpl = template_for(a);
  std::optional<LoadedDrafter> drafter;
  if (!a.d.drafter.empty()) {
    drafter = drafter_load(a.d.drafter);
    check_decoding_inputs(a.d, target_cfg, drafter->config, tok, &tmpl);
  } else {
    DFLASH_CHECK(a.d.block_size == 0, "--block-size {} needs a --drafter", a.d.block_size);
    check_template_tokens(
        tmpl,
        [&tok](std::string_view text, std::vector<std::pair<size_t, size_t>>* offsets) {
          return tok.encode(text, offsets);
        },
        (std::filesystem::path(a.d.target) / "tokenizer.json").string());
  }
  RegenerateOptions ro;
  if (cuda) {
    // The plan's block size is the trained one (any --block-size is at most that), 1 without.
    const int64_t K = drafter ? drafter->config.block_size : 1;
    if (a.max_context > 0) {
      ro.max_prompt_tokens = a.max_context - opts.max_new_tokens - K;
      DFLASH_CHECK(ro.max_prompt_tokens >= 1,
                   "--max-context {} leaves no prompt token after --max-new-tokens {} and the "
                   "block size {}",
                   a.max_context, opts.max_new_tokens, K);
    } else {
      ro.max_prompt_tokens = regenerate_prompt_bound(tok, tmpl, a.data, opts.max_new_tokens);
    }
    spdlog::info("regenerate: cuda plan: prompts of up to {} tokens ({}), context {}",
                 ro.max_prompt_tokens, a.max_context > 0 ? "--max-context" : "bound of the input",
                 ro.max_prompt_tokens + opts.max_new_tokens + K);
  }
  const TargetModel target = TargetModel::load(a.d.target, target_load_options());
  std::optional<DecoderCpu> cpu_dec;
  std::unique_ptr<Decoder> cuda_dec;
  if (cuda)
    cuda_dec = make_cuda_decoder(target, drafter ? &*drafter : nullptr, ro.max_prompt_tokens,
                                 opts.max_new_tokens, a.d.batch_size);
  else
    cpu_dec.emplace(target, drafter ? &*drafter : nullptr);
  Decoder& dec = cuda ? *cuda_dec : static_cast<Decoder&>(*cpu_dec);

  ro.decode = opts;
  ro.batch_size = a.d.batch_size;
  ro.speculative = drafter.has_value();
  ro.skip_invalid = a.skip_invalid;
  spdlog::info(
      "regenerate: {} -> {}, {} decoding on {}, template {}{}, max {} new tokens, batch size "
      "{}, {}",
      a.data, a.out, ro.speculative ? "speculative" : "target-only", dec.backend(), tmpl.name(),
      tmpl.family == TemplateFamily::qwen3
          ? (tmpl.enable_thinking ? " (thinking)" : " (no thinking)")
          : "",
      opts.max_new_tokens, ro.batch_size,
      opts.sampling.greedy()
          ? std::string("greedy")
          : fmt::format("temperature {}, top-k {}, top-p {}, seed {}", opts.sampling.temperature,
                        opts.sampling.top_k, opts.sampling.top_p, opts.seed));
  std::optional<ProgressBar> bar;
  const RegenerateStats st = regenerate(
      dec, tok, tmpl, a.data, a.out, ro,
      [&](int64_t pending) { bar.emplace("regenerate", pending, "records"); },
      [&](int64_t) { bar->advance(); });
  if (bar) bar->finish();

  fmt::print("input records: {}\n", st.input_records);
  fmt::print("already in output: {}\n", st.already_done);
  fmt::print("invalid skipped: {}\n", st.invalid);
  fmt::print("written: {}\n", st.written);
  fmt::print("empty answers (not written): {}\n", st.empty_answers);
  fmt::print("answers cut at --max-new-tokens: {}\n", st.cut_answers);
  fmt::print("new tokens: {}\n", st.new_tokens);
  if (st.seconds > 0) {
    const int64_t handled = st.written + st.empty_answers;
    fmt::print("records/s: {:.2f} ({:.1f} s)\n", static_cast<double>(handled) / st.seconds,
               st.seconds);
    fmt::print("tokens/s: {:.1f}\n", static_cast<double>(st.new_tokens) / st.seconds);
  }
  std::fflush(stdout);
}

}  // namespace

void add_regenerate_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "regenerate",
      "Replace a corpus's assistant turns with the target's own answers (resumable, batched)");
  auto a = std::make_shared<RegenerateArgs>();
  a->d.max_new_tokens = 512;
  sub->add_option("--target", a->d.target, "Target model folder (HF config.json + safetensors)")
      ->required();
  sub->add_option("--data", a->data, "Input records (JSONL, plain/xz/zstd)")->required();
  sub->add_option("--out", a->out,
                  "Output JSONL (appended; records already in it are skipped by id)")
      ->required();
  sub->add_option("--drafter", a->d.drafter,
                  "Drafter folder: decode speculatively (greedy output unchanged)");
  sub->add_option("--max-new-tokens", a->d.max_new_tokens, "Most tokens of one answer")
      ->check(at_least(1))
      ->capture_default_str();
  sub->add_option("--thinking", a->thinking,
                  "Thinking mode of a template that has one (qwen3; required there)")
      ->check(CLI::IsMember({"on", "off"}));
  sub->add_option("--batch-size", a->d.batch_size, "Requests decoded at once")
      ->capture_default_str()
      ->check(at_least(1));
  sub->add_option("--block-size", a->d.block_size,
                  "Block size at run time, in [2, trained block_size] (0: the trained one)")
      ->capture_default_str()
      ->check(at_least(0));
  sub->add_option("--temperature", a->d.temperature, "0: greedy; > 0: sampling")
      ->capture_default_str();
  sub->add_option("--top-k", a->d.top_k, "Keep the k most likely tokens (0: off)")
      ->capture_default_str()
      ->check(at_least(0));
  sub->add_option("--top-p", a->d.top_p, "Nucleus sampling mass in (0, 1] (1: off)")
      ->capture_default_str();
  sub->add_option("--seed", a->d.seed,
                  "Base seed (user turn r of input line L is sampled with seed + r*2^32 + L)")
      ->capture_default_str();
  sub->add_option("--template", a->d.chat_template,
                  "Chat template (chatml, qwen3, llama3); default: detected from the target");
  sub->add_option("--backend", a->d.backend, "Where to decode: cpu, or cuda (GPU 0)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--max-context", a->max_context,
                  "cuda: tokens of context per request to plan for (prompt + max new tokens + "
                  "block size); default: a bound computed from the input")
      ->check(at_least(1));
  sub->add_flag("--skip-invalid", a->skip_invalid,
                "Skip (and count) bad input records instead of stopping at the first");
  sub->callback([a] { run_regenerate(*a); });
}

}  // namespace dflash::cli
