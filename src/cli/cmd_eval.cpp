// `dflash eval --target DIR --drafter DIR --prompts FILE.jsonl [--max-new-tokens N] [--limit N]
// [--output FILE] [--batch-size N]`: speculative decoding of every prompt of a record file, and
// target-only decoding of the same prompts (infer/eval.hpp), N requests in flight. Prints τ (mean
// acceptance length, bonus token included), its histogram over 1..K, τ per `source`, the batch
// size, tokens/s both ways over each mode's wall time and the speedup; writes
// the JSON report to --output. In greedy mode every prompt's speculative output must equal the
// target-only output: otherwise the command fails (after writing the report) naming the count.
#include <fmt/format.h>

#include <memory>
#include <optional>

#include "cli/cli_util.hpp"
#include "cli/cuda_decoder.hpp"
#include "cli/commands.hpp"
#include "cli/decode_args.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/log.hpp"
#include "infer/decoder_cpu.hpp"
#include "infer/eval.hpp"
#include "model/drafter_io.hpp"

namespace dflash::cli {

namespace {

struct EvalArgs {
  DecodeArgs d;
  std::string prompts, output;
  int64_t limit = 0, per_source = 0;
  bool no_baseline = false;
};

std::string hist_str(const nlohmann::json& h) {
  std::string s;
  for (size_t i = 0; i < h.size(); ++i)
    s += fmt::format("{}{}:{}", i ? " " : "", i + 1, h[i].get<int64_t>());
  return s;
}

void run_eval_command(const EvalArgs& a) {
  // Every argument is checked before the target's weights are loaded and a prompt is decoded.
  if (!a.output.empty()) check_file_writable(a.output, "--output");
  if (a.d.backend == "cuda") check_cuda_backend();
  const ModelConfig target_cfg = model_config_load(a.d.target);
  const DecodeOptions opts = decode_options_from(a.d, target_cfg);
  const LoadedDrafter drafter = drafter_load(a.d.drafter);
  const Tokenizer tok = Tokenizer::load(a.d.target);
  const ChatTemplate tmpl = resolve_chat_template(a.d.target, a.d.chat_template);
  check_decoding_inputs(a.d, target_cfg, drafter.config, tok, &tmpl);
  const std::vector<EvalPrompt> prompts =
      load_eval_prompts(a.prompts, tmpl, tok, a.limit, a.per_source);
  const TargetModel target = TargetModel::load(a.d.target, target_load_options());
  // The CPU decoder, or the CUDA one planned for these prompts and the batch size.
  std::optional<DecoderCpu> cpu;
  std::unique_ptr<Decoder> cuda;
  if (a.d.backend == "cuda") {
    std::vector<std::vector<int32_t>> ids;
    ids.reserve(prompts.size());
    for (const EvalPrompt& p : prompts) ids.push_back(p.tokens);
    cuda = make_cuda_decoder(target, drafter, ids, opts.max_new_tokens, a.d.batch_size);
  } else {
    cpu.emplace(target, &drafter);
  }
  Decoder& dec = cuda ? *cuda : static_cast<Decoder&>(*cpu);
  // The run-time block size (checked against the trained one by check_decoding_inputs).
  const int K = opts.block_size > 0 ? opts.block_size : drafter.config.block_size;
  const bool greedy = opts.sampling.greedy(), baseline = !a.no_baseline;
  spdlog::info("eval: {} prompts, block size {}, max {} new tokens, batch size {}, {} backend, {}",
               prompts.size(), K, opts.max_new_tokens, a.d.batch_size, dec.backend(),
               greedy ? std::string("greedy")
                      : fmt::format("temperature {}, top-k {}, top-p {}", opts.sampling.temperature,
                                    opts.sampling.top_k, opts.sampling.top_p));

  // One bar per decoding mode (each is one batched call over all prompts).
  std::optional<ProgressBar> bar;
  EvalProgress progress;
  progress.phase_start = [&](const char* phase) {
    if (bar) bar->finish();
    bar.emplace(fmt::format("eval ({})", phase), static_cast<int64_t>(prompts.size()), "prompts");
  };
  progress.request_done = [&](size_t) { bar->advance(); };
  const EvalRun run = run_eval(dec, prompts, opts, a.d.batch_size, baseline, progress);
  if (bar) bar->finish();
  int64_t bad = 0;
  for (const EvalPromptResult& r : run.results) {
    if (baseline && greedy && !r.lossless) {
      ++bad;
      spdlog::error("prompt {}: speculative output differs from the target-only output", r.id);
    }
  }

  nlohmann::json settings = {{"target", a.d.target},
                             {"drafter", a.d.drafter},
                             {"prompts_file", a.prompts},
                             {"limit", a.limit},
                             {"per_source", a.per_source},
                             {"block_size", K},
                             {"batch_size", a.d.batch_size},
                             {"backend", dec.backend()},
                             {"max_new_tokens", opts.max_new_tokens},
                             {"temperature", opts.sampling.temperature},
                             {"top_k", opts.sampling.top_k},
                             {"top_p", opts.sampling.top_p},
                             {"seed", opts.seed},
                             {"stop_ids", opts.stop_ids},
                             {"template", tmpl.name()},
                             {"greedy", greedy},
                             {"baseline", baseline}};
  // A DSpark drafter drafts K tokens: acceptance lengths reach K + 1 (the histogram's bins).
  const int max_accept = drafter.config.dspark.enabled ? K + 1 : K;
  const nlohmann::json rep = eval_report(run, max_accept, greedy, baseline, settings);
  if (!a.output.empty()) write_file_atomic(a.output, rep.dump(2) + "\n");

  const auto& t = rep["total"];
  fmt::print("prompts: {}\n", t["prompts"].get<int64_t>());
  fmt::print("new tokens: {}\n", t["new_tokens"].get<int64_t>());
  fmt::print("steps: {}\n", t["steps"].get<int64_t>());
  fmt::print("tau: {:.3f} (over steps); {:.3f} (mean over prompts)\n", t["tau"].get<double>(),
             t["tau_prompt_mean"].get<double>());
  fmt::print("accept histogram: {}\n", hist_str(t["accept_histogram"]));
  for (const auto& [src, s] : rep["per_source"].items())
    fmt::print("tau[{}]: {:.3f}; {:.3f} mean over prompts ({} prompts, {} steps)\n", src,
               s["tau"].get<double>(), s["tau_prompt_mean"].get<double>(),
               s["prompts"].get<int64_t>(), s["steps"].get<int64_t>());
  fmt::print("batch size: {}\n", t["batch_size"].get<int>());
  fmt::print("tokens/s speculative: {:.1f} ({:.2f} s wall)\n", t["tokens_per_s_spec"].get<double>(),
             t["seconds_spec"].get<double>());
  if (baseline) {
    fmt::print("tokens/s target: {:.1f} ({:.2f} s wall)\n", t["tokens_per_s_target"].get<double>(),
               t["seconds_target"].get<double>());
    fmt::print("speedup: {:.3f}\n", t["speedup"].get<double>());
    if (greedy)
      fmt::print("lossless: {} ({}/{} prompts)\n", t["lossless"].get<bool>() ? "true" : "false",
                 t["lossless_prompts"].get<int64_t>(), t["prompts"].get<int64_t>());
  }
  if (!a.output.empty()) fmt::print("report: {}\n", a.output);
  std::fflush(stdout);
  DFLASH_CHECK(bad == 0,
               "eval: the speculative output differed from the target-only output on {} of {} "
               "prompts (greedy decoding must be lossless; see the report)",
               bad, prompts.size());
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "eval",
      "Evaluate a drafter: τ, acceptance histogram, τ per source, tokens/s, speedup, "
      "losslessness");
  auto a = std::make_shared<EvalArgs>();
  add_decode_args(sub, a->d);
  sub->add_option("--prompts", a->prompts,
                  "Prompt records (JSONL, plain/xz/zstd; the first user turn of each is used)")
      ->required();
  sub->add_option("--limit", a->limit, "Use the first N records only (0: all)")
      ->capture_default_str()
      ->check(at_least(0));
  sub->add_option("--per-source", a->per_source,
                  "Use at most N records of each `source` (file order; 0: no cap), before --limit")
      ->capture_default_str()
      ->check(at_least(0));
  sub->add_option("--output", a->output, "Write the JSON report to FILE");
  sub->add_flag("--no-baseline", a->no_baseline,
                "Skip the target-only decoding (no speedup or lossless figures)");
  sub->callback([a] { run_eval_command(*a); });
}

}  // namespace dflash::cli
