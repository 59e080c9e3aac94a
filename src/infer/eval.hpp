// dflash.cpp — evaluation of a drafter on a prompt set (`dflash eval`): every prompt is decoded
// speculatively and by the target alone; the report gives τ (mean acceptance length, bonus token
// included), its histogram over 1..K, τ per record `source`, tokens/s both ways, the speedup and,
// in greedy mode, whether each speculative output equalled the target-only output (`lossless`).
//
// Prompts come from conversation records (data/conversation.hpp, trailing user turn allowed): the
// optional system message and the first user turn, rendered with the chat template and the
// generation prompt (render_chat(..., add_generation_prompt = true)), then tokenized.
//
// Each mode is one call of a Decoder (infer/decoder.hpp) over all prompts with up to batch_size
// requests in flight.
//
// Invariants: τ of a group is the step-weighted mean (Σ acceptance lengths / Σ steps); the total
// tokens/s of a mode counts the generated tokens over the wall time of that mode's call (prefill
// and decode of every prompt); speedup = target-only wall time / speculative wall time over the
// same prompts and batch size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder.hpp"

namespace dflash {

/// One tokenized evaluation prompt.
struct EvalPrompt {
  std::string id;
  std::string source;           ///< the record's `source`, "" when absent
  std::vector<int32_t> tokens;  ///< rendered first user turn + generation prompt
};

/// Reads the records of a JSONL file (plain/xz/zstd) in file order, keeping at most
/// `per_source` of each `source` (0: no cap) and at most `limit` in all (0: all); keeps the system
/// message and first user turn of each, renders them with `tmpl` and the generation prompt and
/// tokenizes them. Throws dflash::Error (RecordError) naming `file:line` for a malformed record
/// (records skipped by a cap are still validated), and for a selection without any record.
std::vector<EvalPrompt> load_eval_prompts(const std::filesystem::path& file,
                                          const ChatTemplate& tmpl, const Tokenizer& tok,
                                          int64_t limit = 0, int64_t per_source = 0);

/// Per-prompt outcome of an evaluation.
struct EvalPromptResult {
  std::string id, source;
  int64_t prompt_tokens = 0;
  DecodeResult spec, target;  ///< speculative and target-only decoding
  bool lossless = false;      ///< spec.tokens == target.tokens (meaningful in greedy mode)
};

/// Outcome of run_eval: the prompts' results and the wall time of each decoding call.
struct EvalRun {
  std::vector<EvalPromptResult> results;  ///< in prompt order
  int batch_size = 1;                     ///< requests in flight per call
  double seconds_spec = 0;                ///< wall time of the speculative call
  double seconds_target = 0;              ///< wall time of the target-only call (0: no baseline)
};

/// Progress callbacks of run_eval (each may be empty).
struct EvalProgress {
  std::function<void(const char*)> phase_start;  ///< "speculative", then "target" (baseline)
  /// Request i of the current phase produced its last token, seen from the token stream (which
  /// ends with a stop token or at max_new_tokens).
  std::function<void(size_t)> request_done;
};

/// Decodes every prompt speculatively with `dec.generate` (one call, `batch_size` in flight; seed
/// opts.seed + prompt index), then, when `baseline`, by the target alone with
/// `dec.target_generate` (one call; lossless and speedup figures). Throws what the decoder throws
/// (dflash::Error naming the request index).
EvalRun run_eval(Decoder& dec, const std::vector<EvalPrompt>& prompts, const DecodeOptions& opts,
                 int batch_size, bool baseline = true, const EvalProgress& progress = {});

/// The JSON report of a run: {"settings": ..., "prompts": [{id, source, prompt_tokens,
/// new_tokens, steps, tau, accept_histogram [max_accept counts for lengths 1..max_accept],
/// stopped, seconds_spec, tokens_per_s_spec, and with a baseline target_new_tokens,
/// seconds_target, tokens_per_s_target, lossless (greedy)}], "total": {prompts, batch_size,
/// new_tokens, steps, tau, tau_prompt_mean, accept_histogram, seconds_spec, tokens_per_s_spec,
/// and with a baseline target_new_tokens, seconds_target, tokens_per_s_target, speedup, lossless and lossless_prompts (greedy)},
/// "per_source": {source: {prompts, new_tokens, steps, tau, tau_prompt_mean, accept_histogram}}}.
/// A prompt's seconds are its request's own wall time (decoder.hpp); the totals' seconds are the
/// calls' wall times, and their tokens/s and speedup are aggregates over those (with several
/// requests in flight the per-prompt seconds overlap and do not add up to the wall time).
/// `settings` is copied in as given. `max_accept` is the longest acceptance length, the number of
/// histogram bins: the block size K (DFlash), K + 1 for a DSpark drafter (K drafts).
nlohmann::json eval_report(const EvalRun& run, int max_accept, bool greedy, bool baseline,
                           const nlohmann::json& settings);

}  // namespace dflash
