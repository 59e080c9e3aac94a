// dflash.cpp — `dflash regenerate`'s corpus pass: the resume scan of OUT, the validation pass of
// IN, then windows of records decoded turn by turn (see regenerate.hpp for the invariants).
#include "infer/regenerate.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/log.hpp"
#include "data/conversation.hpp"
#include "data/jsonl.hpp"

namespace dflash {

namespace {

using json = nlohmann::ordered_json;

// The ids of OUT's records; cuts off an unterminated last line (file comment of regenerate.hpp).
std::unordered_set<std::string> scan_output(const std::filesystem::path& out, bool& repaired) {
  std::unordered_set<std::string> ids;
  repaired = false;
  if (!std::filesystem::exists(out)) return ids;
  const std::string text = read_file_text(out);
  const std::string name = out.string();
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    if (end == std::string::npos) {  // a record cut by a crash while it was written
      spdlog::warn(
          "{}:{}: the last line is unterminated ({} bytes, a run stopped while writing "
          "it): cut off, its record is regenerated",
          name, line_no + 1, text.size() - pos);
      std::filesystem::resize_file(out, pos);
      repaired = true;
      break;
    }
    ++line_no;
    const std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    try {
      ids.insert(parse_conversation(line, name, line_no).id);
    } catch (const Error& e) {
      throw Error(
          fmt::format("{} (an output file holds only complete records written by dflash "
                      "regenerate; it is appended to, never rewritten)",
                      e.what()));
    }
  }
  return ids;
}

// One record of a window: where it came from, its conversation, its JSON, the answers so far.
struct WindowRecord {
  int64_t line = 0;
  Conversation conv;
  json raw;
  std::vector<std::string> answers;
  size_t user_turns = 0;
  bool dropped = false;
};

// The conversation before user turn r's answer: the system message, user turns 0..r and the
// answers to turns 0..r−1 (in place of the record's assistant turns).
Conversation prompt_for_turn(const WindowRecord& w, size_t r) {
  Conversation c;
  c.id = w.conv.id;
  c.source = w.conv.source;
  size_t users = 0;
  for (const Message& m : w.conv.messages) {
    if (m.role == Role::system) {
      c.messages.push_back(m);
    } else if (m.role == Role::user) {
      c.messages.push_back(m);
      if (users++ == r) break;
    } else {
      c.messages.push_back(Message{Role::assistant, w.answers[users - 1]});
    }
  }
  return c;
}

// The record's JSON with its assistant messages' text replaced by `answers`, in order, and one
// message added (in the list's form) when the record ended with a user turn.
json record_with_answers(json raw, const std::vector<std::string>& answers) {
  json& list = raw.contains("messages") ? raw["messages"] : raw["conversations"];
  const bool sharegpt = list.front().contains("from");
  size_t k = 0;
  for (json& m : list) {
    const bool assistant = sharegpt ? m["from"] == "gpt" : m["role"] == "assistant";
    if (assistant) m[sharegpt ? "value" : "content"] = answers[k++];
  }
  for (; k < answers.size(); ++k)
    list.push_back(sharegpt ? json{{"from", "gpt"}, {"value", answers[k]}}
                            : json{{"role", "assistant"}, {"content", answers[k]}});
  return raw;
}

// The state of one run: settings, the decoder, the output file and the counts.
class Regenerator {
 public:
  Regenerator(Decoder& dec, const Tokenizer& tok, const ChatTemplate& tmpl,
              const RegenerateOptions& opts, std::string in_name, std::FILE* out,
              RegenerateStats& stats)
      : dec_(dec),
        tok_(tok),
        tmpl_(tmpl),
        opts_(opts),
        in_name_(std::move(in_name)),
        out_(out),
        stats_(stats) {}

  // Decodes every turn of the window's records, then appends them to OUT in order.
  void run_window(std::vector<WindowRecord>& window, const std::function<void()>& on_record) {
    size_t turns = 0;
    for (const WindowRecord& w : window) turns = std::max(turns, w.user_turns);
    for (size_t r = 0; r < turns; ++r) {
      std::vector<WindowRecord*> reqs;
      std::vector<std::vector<int32_t>> prompts;
      for (WindowRecord& w : window) {
        if (w.dropped || w.user_turns <= r) continue;
        std::vector<int32_t> ids = prompt_tokens(w, r);
        if (ids.empty()) continue;  // over the prompt bound, skipped (skip_invalid)
        reqs.push_back(&w);
        prompts.push_back(std::move(ids));
      }
      // Calls over runs of consecutive lines: request i's seed opts.seed + i is then its own.
      for (size_t b = 0; b < reqs.size();) {
        size_t e = b + 1;
        while (e < reqs.size() && reqs[e]->line == reqs[e - 1]->line + 1) ++e;
        decode_turn(std::span<WindowRecord*>(reqs).subspan(b, e - b),
                    std::span<const std::vector<int32_t>>(prompts).subspan(b, e - b), r);
        b = e;
      }
    }
    for (WindowRecord& w : window) {
      if (!w.dropped) {
        const std::string line = record_with_answers(std::move(w.raw), w.answers)
                                     .dump(-1, ' ', false, json::error_handler_t::replace) +
                                 "\n";
        DFLASH_CHECK(std::fwrite(line.data(), 1, line.size(), out_) == line.size(),
                     "writing the regenerated records failed (disk full?)");
        ++stats_.written;
      }
      if (on_record) on_record();
    }
    DFLASH_CHECK(std::fflush(out_) == 0 && ::fsync(fileno(out_)) == 0,
                 "writing the regenerated records failed (disk full?)");
  }

 private:
  // The tokens of user turn r's prompt of `w`. Over opts_.max_prompt_tokens: an error naming
  // IN:line, or (skip_invalid) the record is dropped, counted invalid, and no token is returned.
  std::vector<int32_t> prompt_tokens(WindowRecord& w, size_t r) {
    const RenderedChat rc = render_chat(tmpl_, prompt_for_turn(w, r), true);
    std::vector<int32_t> ids = tok_.encode(rc.text);
    DFLASH_CHECK(!ids.empty(), "record {} (line {}): the prompt encodes to no token", w.conv.id,
                 w.line);
    const auto n = static_cast<int64_t>(ids.size());
    if (opts_.max_prompt_tokens <= 0 || n <= opts_.max_prompt_tokens) return ids;
    const std::string msg = fmt::format(
        "{}:{}: record {}: the prompt of user turn {} is {} tokens, over the {} the decoder was "
        "planned for (--max-context, or the input's bound when an answer re-encodes to more "
        "tokens than budgeted: a larger --max-context plans for it)",
        in_name_, w.line, w.conv.id, r + 1, n, opts_.max_prompt_tokens);
    DFLASH_CHECK(opts_.skip_invalid, "{}", msg);
    spdlog::warn("skipped: {}", msg);
    w.dropped = true;
    ++stats_.invalid;
    return {};
  }

  // The answers to user turn r of `reqs` (consecutive input lines) to `prompts`, in one call.
  void decode_turn(std::span<WindowRecord*> reqs, std::span<const std::vector<int32_t>> prompts,
                   size_t r) {
    DecodeOptions o = opts_.decode;
    o.seed = opts_.decode.seed + (static_cast<uint64_t>(r) << 32) +
             static_cast<uint64_t>(reqs.front()->line);
    const std::vector<DecodeResult> res = opts_.speculative
                                              ? dec_.generate(prompts, o, opts_.batch_size)
                                              : dec_.target_generate(prompts, o, opts_.batch_size);
    for (size_t i = 0; i < reqs.size(); ++i) {
      std::vector<int32_t> toks = res[i].tokens;
      stats_.new_tokens += static_cast<int64_t>(toks.size());
      if (res[i].stopped)
        toks.pop_back();  // the stop token ends the turn; not part of the text
      else
        ++stats_.cut_answers;
      std::string text = tok_.decode(toks);
      if (python_strip(text).empty()) {
        reqs[i]->dropped = true;
        ++stats_.empty_answers;
        spdlog::warn(
            "record {} (line {}): the answer to user turn {} is empty; the record is not "
            "written",
            reqs[i]->conv.id, reqs[i]->line, r + 1);
        continue;
      }
      reqs[i]->answers.push_back(std::move(text));
    }
  }

  Decoder& dec_;
  const Tokenizer& tok_;
  const ChatTemplate& tmpl_;
  const RegenerateOptions& opts_;
  std::string in_name_;
  std::FILE* out_;
  RegenerateStats& stats_;
};

// A parsed input record: its user turn count.
size_t count_user_turns(const Conversation& c) {
  size_t n = 0;
  for (const Message& m : c.messages) n += m.role == Role::user;
  return n;
}

}  // namespace

int64_t regenerate_prompt_bound(const Tokenizer& tok, const ChatTemplate& tmpl,
                                const std::filesystem::path& in, int64_t max_new_tokens) {
  DFLASH_CHECK(std::filesystem::is_regular_file(in), "{}: no such file (the input records)",
               in.string());
  const ParseOptions parse{.allow_trailing_user = true};
  const std::string name = in.string();
  const int64_t per_answer = max_new_tokens + max_new_tokens / 4 + kRegenerateTurnSlack;
  int64_t bound = 1;
  LineReader reader(in);
  std::string line;
  while (reader.next(line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    WindowRecord w;
    try {
      w.conv = parse_conversation(line, name, reader.line_number(), parse);
    } catch (const RecordError&) {
      continue;  // regenerate's validation pass reports it (or skips it)
    }
    w.user_turns = count_user_turns(w.conv);
    if (w.user_turns == 0) continue;  // nothing to answer (the validation pass decides)
    w.answers.assign(w.user_turns, std::string());
    const RenderedChat rc = render_chat(tmpl, prompt_for_turn(w, w.user_turns - 1), true);
    const auto rendered = static_cast<int64_t>(tok.encode(rc.text).size());
    bound = std::max(bound, rendered + static_cast<int64_t>(w.user_turns - 1) * per_answer);
  }
  return bound;
}

RegenerateStats regenerate(Decoder& dec, const Tokenizer& tok, const ChatTemplate& tmpl,
                           const std::filesystem::path& in, const std::filesystem::path& out,
                           const RegenerateOptions& opts,
                           const std::function<void(int64_t)>& on_pending,
                           const std::function<void(int64_t)>& on_record) {
  DFLASH_CHECK(opts.batch_size >= 1, "batch size must be >= 1 (got {})", opts.batch_size);
  DFLASH_CHECK(opts.window >= 1, "regenerate window must be >= 1 (got {})", opts.window);
  DFLASH_CHECK(std::filesystem::is_regular_file(in), "{}: no such file (the input records)",
               in.string());
  DFLASH_CHECK(!(std::filesystem::exists(out) && std::filesystem::equivalent(in, out)),
               "the output file {} is the input file", out.string());
  RegenerateStats stats;
  const std::unordered_set<std::string> done = scan_output(out, stats.repaired_tail);

  // Validation pass: every record is checked (and ids are unique) before anything is decoded.
  const ParseOptions parse{.allow_trailing_user = true};
  const std::string name = in.string();
  std::vector<int64_t> pending;  // input lines to decode
  {
    LineReader reader(in);
    std::unordered_map<std::string, int64_t> seen;
    std::string line;
    while (reader.next(line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      ++stats.input_records;
      const int64_t n = reader.line_number();
      try {
        const Conversation c = parse_conversation(line, name, n, parse);
        const auto [it, fresh] = seen.emplace(c.id, n);
        if (!fresh)
          throw RecordError(RecordErrorKind::invalid_field,
                            fmt::format("{}:{}: id: '{}' is the id of the record on line {} too",
                                        name, n, c.id, it->second));
        if (done.count(c.id)) {
          ++stats.already_done;
          continue;
        }
        pending.push_back(n);
      } catch (const RecordError& e) {
        if (!opts.skip_invalid) throw;
        ++stats.invalid;
        spdlog::warn("skipped: {}", e.what());
      }
    }
  }
  if (on_pending) on_pending(static_cast<int64_t>(pending.size()));

  std::FILE* f = std::fopen(out.c_str(), "ab");
  DFLASH_CHECK(f != nullptr, "cannot open {} for appending: {}", out.string(),
               std::strerror(errno));
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(f, &std::fclose);
  Regenerator regen(dec, tok, tmpl, opts, name, f, stats);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t handled = 0;
  const std::function<void()> count = [&] {
    ++handled;
    if (on_record) on_record(handled);
  };
  LineReader reader(in);
  std::string line;
  std::vector<WindowRecord> window;
  size_t next = 0;
  while (next < pending.size() && reader.next(line)) {
    if (reader.line_number() != pending[next]) continue;
    ++next;
    WindowRecord w;
    w.line = reader.line_number();
    w.conv = parse_conversation(line, name, w.line, parse);
    w.raw = json::parse(line);
    w.user_turns = count_user_turns(w.conv);
    window.push_back(std::move(w));
    if (static_cast<int64_t>(window.size()) == opts.window || next == pending.size()) {
      regen.run_window(window, count);
      window.clear();
    }
  }
  DFLASH_CHECK(next == pending.size(), "{} changed while it was read ({} of {} records found)",
               name, next, pending.size());
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace dflash
