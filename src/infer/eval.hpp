// dflash.cpp — evaluation of a drafter on a prompt set (`dflash eval`): every prompt is decoded
// speculatively and by the target alone; the report gives τ (mean acceptance length, bonus token
// included), its histogram over 1..K, τ per record `source`, tokens/s both ways, the speedup and,
// in greedy mode, whether each speculative output equalled the target-only output (`lossless`).
//
// Prompts come from conversation records (data/conversation.hpp, trailing user turn allowed): the
// optional system message and the first user turn, rendered with the chat template and the
// generation prompt (render_chat(..., add_generation_prompt = true)), then tokenized.
//
// Invariants: τ of a group is the step-weighted mean (Σ acceptance lengths / Σ steps); tokens/s
// counts the generated tokens over the wall time of prefill + decode of that mode; speedup =
// target-only time / speculative time over the same prompts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/speculative.hpp"

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

/// Decodes every prompt both ways with `opts` (seed opts.seed + prompt index for sampling).
/// `on_prompt` is called after each prompt (progress). `baseline` false skips the target-only
/// decoding (no lossless / speedup figures then).
std::vector<EvalPromptResult> run_eval(
    const SpeculativeDecoder& dec, const std::vector<EvalPrompt>& prompts,
    const DecodeOptions& opts, bool baseline = true,
    const std::function<void(const EvalPromptResult&)>& on_prompt = {});

/// The JSON report of run_eval results: {"settings": ..., "prompts": [{id, source,
/// prompt_tokens, new_tokens, steps, tau, accept_histogram [K counts for lengths 1..K],
/// tokens_per_s_spec, tokens_per_s_target, lossless (greedy only), target_new_tokens}],
/// "total": {prompts, new_tokens, steps, tau, accept_histogram, tokens_per_s_spec,
/// tokens_per_s_target, speedup, lossless (greedy), lossless_prompts}, "per_source": {source:
/// {prompts, steps, tau, accept_histogram}}}. `settings` is copied in as given.
nlohmann::json eval_report(const std::vector<EvalPromptResult>& results, int block_size,
                           bool greedy, bool baseline, const nlohmann::json& settings);

}  // namespace dflash
