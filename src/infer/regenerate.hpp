// dflash.cpp — regeneration of a conversation corpus by the target (`dflash regenerate`): every
// record keeps its system message and user turns, and its assistant turns become the target's own
// answers, so that a drafter trains on what the target will serve (its temperature, its thinking
// mode).
//
// Per record, turn by turn: the answer to user turn r is generated from the conversation so far
// (system message, user turns 0..r, the target's answers 0..r−1), rendered with the target's chat
// template and the generation prompt (data/chat_template.hpp; qwen3: enable_thinking as asked),
// tokenized, and decoded by a Decoder until a stop token (dropped from the answer) or
// max_new_tokens (the answer is kept, cut; counted). A record that ends with a user turn gets one
// more assistant turn. Records are decoded in windows of consecutive input records, batch_size
// requests in flight.
//
// Output: one line per record, in input order: the input record's JSON with each assistant
// message's text replaced (its other fields and the record's other fields kept; an added turn
// takes the record's message form). A record whose answer is empty (or only whitespace) would be
// an invalid training record: it is not written, and counted.
//
// Invariants:
//   - determinism: the answer to user turn r of the record on input line ℓ is decoded with seed
//     `seed + r·2^32 + ℓ` (the requests of one decoder call are consecutive lines, so that request
//     i's seed opts.seed + i is that one), so OUT depends on the input, the models and the settings
//     only: not on batch_size, the window, nor on where an earlier run stopped;
//   - resume: OUT is only appended to. Records of OUT are skipped by id; OUT's lines are complete
//     records ending in a newline, and an unterminated last line (a crash while writing) is cut off
//     before appending, never taken for a record. Any other line of OUT that is not a valid record
//     is an error naming OUT:line.
//   - a bad input record (data/conversation.hpp's rules, a trailing user turn allowed; an id seen
//     on an earlier line) is an error naming IN:line before anything is decoded, unless
//     skip_invalid (then it is skipped and counted);
//   - prompt bound (a decoder planned ahead, the CUDA one): with max_prompt_tokens > 0, a turn
//     whose prompt is longer is an error naming IN:line before that turn is decoded, or, under
//     skip_invalid, its record is skipped and counted invalid; never cut. The bound is one number
//     for the whole input (regenerate_prompt_bound over every valid record of IN, or the user's),
//     so whether a record fits depends on neither batch_size nor resuming.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder.hpp"

namespace dflash {

/// Settings of a regeneration.
struct RegenerateOptions {
  DecodeOptions decode;           ///< decode.seed is the base seed (file comment)
  int batch_size = 1;             ///< requests in flight (≥ 1)
  bool speculative = false;       ///< Decoder::generate (needs a drafter) or target_generate
  bool skip_invalid = false;      ///< skip and count bad input records instead of stopping
  int64_t window = 256;           ///< input records decoded per window (≥ 1; memory, not results)
  int64_t max_prompt_tokens = 0;  ///< longest prompt the decoder was planned for (0: no bound)
};

/// Tokens of answer budgeted per earlier turn by regenerate_prompt_bound beyond max_new_tokens:
/// an answer re-enters later prompts as text, and its re-encoding need not be the generated
/// tokens (byte-level BPE merges differently at the seams with the template, a non-canonical
/// token sequence re-encodes otherwise), so each earlier answer is budgeted
/// max_new_tokens + max_new_tokens / 4 + kRegenerateTurnSlack tokens.
inline constexpr int64_t kRegenerateTurnSlack = 16;

/// A bound on the longest prompt a regeneration of `in` builds, for planning a decoder before
/// decoding (the CUDA decoder allocates its caches for it): over every record of IN that parses
/// (a trailing user turn allowed; others are left to regenerate's validation), the tokens of its
/// last user turn's prompt rendered with `tmpl` and empty earlier answers, plus (user turns − 1) ×
/// (max_new_tokens + max_new_tokens / 4 + kRegenerateTurnSlack). Prompts grow turn by turn, so the
/// last one is a record's longest. A heuristic, not a proof (see kRegenerateTurnSlack): regenerate
/// refuses a prompt over it by IN:line (RegenerateOptions::max_prompt_tokens). Returns ≥ 1. Throws
/// dflash::Error when IN cannot be read.
int64_t regenerate_prompt_bound(const Tokenizer& tok, const ChatTemplate& tmpl,
                                const std::filesystem::path& in, int64_t max_new_tokens);

/// Counts of a regeneration.
struct RegenerateStats {
  int64_t input_records = 0;   ///< non-blank lines of IN
  int64_t already_done = 0;    ///< skipped: their id is in OUT
  int64_t invalid = 0;         ///< skipped bad records (skip_invalid)
  int64_t written = 0;         ///< records appended to OUT by this run
  int64_t empty_answers = 0;   ///< records not written: an answer was empty
  int64_t cut_answers = 0;     ///< answers that reached max_new_tokens without a stop token
  int64_t new_tokens = 0;      ///< tokens generated
  bool repaired_tail = false;  ///< OUT ended in an unterminated line, which was cut off
  double seconds = 0;          ///< wall time of the decoding (windows), not of the scans
};

/// Regenerates the records of `in` (JSONL, plain/xz/zstd) into `out` (plain JSONL, appended;
/// created when absent) with `dec`, rendering with `tmpl` and tokenizing with `tok` (file comment).
/// `on_record` is called after each record is handled (progress; the argument is the count of
/// records handled so far this run, of `pending` = the records not already in OUT), and
/// `on_pending(pending)` once before decoding starts. Throws dflash::Error naming IN:line for a
/// bad record (unless opts.skip_invalid), OUT:line for a bad line of OUT, and what the decoder
/// throws.
RegenerateStats regenerate(Decoder& dec, const Tokenizer& tok, const ChatTemplate& tmpl,
                           const std::filesystem::path& in, const std::filesystem::path& out,
                           const RegenerateOptions& opts,
                           const std::function<void(int64_t)>& on_pending = {},
                           const std::function<void(int64_t)>& on_record = {});

}  // namespace dflash
