// dflash.cpp — prompt loading, the two decodings per prompt and the JSON report of `dflash eval`.
#include "infer/eval.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>

#include "core/error.hpp"
#include "data/conversation.hpp"
#include "data/jsonl.hpp"

namespace dflash {

namespace {

// Counts of acceptance lengths 1..K.
struct Tally {
  int64_t prompts = 0, steps = 0, accepted = 0, new_tokens = 0;
  double prompt_tau_sum = 0;  // Σ over prompts of the prompt's own τ (prompts with ≥ 1 step)
  int64_t prompts_with_steps = 0;
  std::vector<int64_t> hist;
  explicit Tally(int K = 0) : hist(static_cast<size_t>(K), 0) {}
  void add(const DecodeResult& r) {
    ++prompts;
    if (!r.accept_lengths.empty()) {
      int64_t acc = 0;
      for (int a : r.accept_lengths) acc += a;
      prompt_tau_sum += static_cast<double>(acc) / static_cast<double>(r.accept_lengths.size());
      ++prompts_with_steps;
    }
    new_tokens += static_cast<int64_t>(r.tokens.size());
    for (int a : r.accept_lengths) {
      ++steps;
      accepted += a;
      if (a >= 1 && static_cast<size_t>(a) <= hist.size()) ++hist[static_cast<size_t>(a - 1)];
    }
  }
  double tau() const { return steps ? static_cast<double>(accepted) / steps : 0.0; }
  /// Mean over prompts of each prompt's τ (the public DFlash benchmark's average).
  double tau_prompt_mean() const {
    return prompts_with_steps ? prompt_tau_sum / static_cast<double>(prompts_with_steps) : 0.0;
  }
};

double rate(int64_t tokens, double seconds) {
  return seconds > 0 ? tokens / seconds : 0.0;
}

}  // namespace

std::vector<EvalPrompt> load_eval_prompts(const std::filesystem::path& file,
                                          const ChatTemplate& tmpl, const Tokenizer& tok,
                                          int64_t limit, int64_t per_source) {
  LineReader reader(file);
  std::vector<EvalPrompt> out;
  std::map<std::string, int64_t> taken;
  std::string line;
  const std::string name = file.string();
  while ((limit <= 0 || static_cast<int64_t>(out.size()) < limit) && reader.next(line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Conversation conv = parse_conversation(line, name, reader.line_number(),
                                           ParseOptions{.allow_trailing_user = true});
    // The optional system message and the first user turn (a valid record starts that way).
    size_t keep = 0;
    while (keep < conv.messages.size() && conv.messages[keep].role != Role::user) ++keep;
    DFLASH_CHECK(keep < conv.messages.size(), "{}:{}: the record has no user turn", name,
                 reader.line_number());
    if (per_source > 0 && taken[conv.source] >= per_source) continue;
    ++taken[conv.source];
    conv.messages.resize(keep + 1);
    const RenderedChat rc = render_chat(tmpl, conv, /*add_generation_prompt=*/true);
    EvalPrompt p;
    p.id = conv.id;
    p.source = conv.source;
    p.tokens = tok.encode(rc.text);
    DFLASH_CHECK(!p.tokens.empty(), "{}:{}: the prompt encodes to no token", name,
                 reader.line_number());
    out.push_back(std::move(p));
  }
  DFLASH_CHECK(!out.empty(), "{}: no prompt record", name);
  return out;
}

EvalRun run_eval(Decoder& dec, const std::vector<EvalPrompt>& prompts, const DecodeOptions& opts,
                 int batch_size, bool baseline, const EvalProgress& progress) {
  std::vector<std::vector<int32_t>> tokens;
  tokens.reserve(prompts.size());
  for (const EvalPrompt& p : prompts) tokens.push_back(p.tokens);
  // Starts a phase; its token callback sees a request end at max_new_tokens or a stop token.
  auto phase = [&](const char* name) -> BatchTokenCallback {
    if (progress.phase_start) progress.phase_start(name);
    if (!progress.request_done) return {};
    auto counts = std::make_shared<std::vector<int64_t>>(prompts.size(), 0);
    return [&progress, &opts, counts](size_t i, std::span<const int32_t> t) {
      (*counts)[i] += static_cast<int64_t>(t.size());
      const bool stop = std::find(opts.stop_ids.begin(), opts.stop_ids.end(),
                                  static_cast<int64_t>(t.back())) != opts.stop_ids.end();
      if (stop || (*counts)[i] >= opts.max_new_tokens) progress.request_done(i);
    };
  };
  using Clock = std::chrono::steady_clock;
  EvalRun run;
  run.batch_size = batch_size;
  const BatchTokenCallback spec_cb = phase("speculative");
  auto t0 = Clock::now();
  std::vector<DecodeResult> spec = dec.generate(tokens, opts, batch_size, spec_cb);
  run.seconds_spec = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<DecodeResult> target;
  if (baseline) {
    const BatchTokenCallback target_cb = phase("target");
    t0 = Clock::now();
    target = dec.target_generate(tokens, opts, batch_size, target_cb);
    run.seconds_target = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  run.results.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EvalPromptResult& r = run.results[i];
    r.id = prompts[i].id;
    r.source = prompts[i].source;
    r.prompt_tokens = static_cast<int64_t>(prompts[i].tokens.size());
    r.spec = std::move(spec[i]);
    if (baseline) {
      r.target = std::move(target[i]);
      r.lossless = r.spec.tokens == r.target.tokens;
    }
  }
  return run;
}

nlohmann::json eval_report(const EvalRun& run, int max_accept, bool greedy, bool baseline,
                           const nlohmann::json& settings) {
  using nlohmann::json;
  const std::vector<EvalPromptResult>& results = run.results;
  json rows = json::array();
  Tally total(max_accept);
  std::map<std::string, Tally> by_source;
  int64_t target_tokens = 0, lossless_n = 0;
  for (const EvalPromptResult& r : results) {
    Tally t(max_accept);
    t.add(r.spec);
    total.add(r.spec);
    auto it = by_source.try_emplace(r.source, max_accept).first;
    it->second.add(r.spec);
    const double ss = r.spec.prefill_seconds + r.spec.decode_seconds;
    const double ts = r.target.prefill_seconds + r.target.decode_seconds;
    target_tokens += static_cast<int64_t>(r.target.tokens.size());
    json row = {{"id", r.id},
                {"source", r.source},
                {"prompt_tokens", r.prompt_tokens},
                {"new_tokens", r.spec.tokens.size()},
                {"steps", t.steps},
                {"tau", t.tau()},
                {"accept_histogram", t.hist},
                {"stopped", r.spec.stopped},
                {"seconds_spec", ss},
                {"tokens_per_s_spec", rate(t.new_tokens, ss)}};
    if (baseline) {
      row["target_new_tokens"] = r.target.tokens.size();
      row["seconds_target"] = ts;
      row["tokens_per_s_target"] = rate(static_cast<int64_t>(r.target.tokens.size()), ts);
      if (greedy) row["lossless"] = r.lossless;
    }
    if (baseline && greedy && r.lossless) ++lossless_n;
    rows.push_back(std::move(row));
  }
  const double spec_s = run.seconds_spec, target_s = run.seconds_target;
  json tot = {{"prompts", total.prompts},
              {"batch_size", run.batch_size},
              {"new_tokens", total.new_tokens},
              {"steps", total.steps},
              {"tau", total.tau()},
              {"tau_prompt_mean", total.tau_prompt_mean()},
              {"accept_histogram", total.hist},
              {"seconds_spec", spec_s},
              {"tokens_per_s_spec", rate(total.new_tokens, spec_s)}};
  if (baseline) {
    tot["target_new_tokens"] = target_tokens;
    tot["seconds_target"] = target_s;
    tot["tokens_per_s_target"] = rate(target_tokens, target_s);
    tot["speedup"] = spec_s > 0 ? target_s / spec_s : 0.0;
    if (greedy) {
      tot["lossless"] = lossless_n == static_cast<int64_t>(results.size());
      tot["lossless_prompts"] = lossless_n;
    }
  }
  json per_source = json::object();
  for (const auto& [src, t] : by_source) {
    per_source[src.empty() ? "(none)" : src] = {{"prompts", t.prompts},
                                                {"new_tokens", t.new_tokens},
                                                {"steps", t.steps},
                                                {"tau", t.tau()},
                                                {"tau_prompt_mean", t.tau_prompt_mean()},
                                                {"accept_histogram", t.hist}};
  }
  return json{
      {"settings", settings}, {"prompts", rows}, {"total", tot}, {"per_source", per_source}};
}

}  // namespace dflash
