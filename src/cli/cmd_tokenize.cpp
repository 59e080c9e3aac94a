// `dflash tokenize --model DIR`: encode (or, with --decode, decode) one input per stdin line and
// print one JSON line per input. A debugging tool for chat templates, and the tests' way to drive
// the tokenizer from Python.
//
// Input per line: plain text (the line without its '\n'), or with --jsonl a JSON object with a
// `text` field (--decode: `ids`). With --decode and no --jsonl a line is a JSON array of ids or
// whitespace-separated ids. Output per line: {"ids": [...]} (+ "tokens" with --verbose, "offsets"
// as byte ranges with --offsets, "id" copied from a --jsonl record), or {"text": "..."}.
// Errors name the input line and, for --jsonl, the record's `id`.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/commands.hpp"
#include "core/error.hpp"
#include "data/tokenizer.hpp"
#include "data/utf8.hpp"

namespace dflash::cli {

namespace {

struct TokenizeOptions {
  std::string model;
  bool jsonl = false;
  bool verbose = false;
  bool decode = false;
  bool offsets = false;
  bool replace_invalid = false;
  bool skip_special = false;
};

std::vector<int32_t> parse_ids(const nlohmann::json& j, const std::string& where) {
  DFLASH_CHECK(j.is_array(), "{}: expected an array of token ids", where);
  std::vector<int32_t> ids;
  for (const auto& v : j) {
    DFLASH_CHECK(v.is_number_integer(), "{}: token id {} is not an integer", where, v.dump());
    ids.push_back(v.get<int32_t>());
  }
  return ids;
}

void run_tokenize(const TokenizeOptions& o) {
  const Tokenizer tok = Tokenizer::load(o.model);
  const InvalidUtf8 mode = o.replace_invalid ? InvalidUtf8::replace : InvalidUtf8::error;
  std::string line;
  size_t line_no = 0;
  std::vector<std::pair<size_t, size_t>> offs;
  while (std::getline(std::cin, line)) {
    ++line_no;
    std::string where = fmt::format("stdin line {}", line_no);
    nlohmann::json out = nlohmann::json::object();
    nlohmann::json rec;
    if (o.jsonl) {
      if (line.empty()) continue;
      // nlohmann rejects invalid UTF-8; repair first when asked to.
      std::string src = line;
      if (o.replace_invalid) src = utf8::make_valid(src);
      try {
        rec = nlohmann::json::parse(src);
      } catch (const nlohmann::json::exception& e) {
        const size_t bad = utf8::find_invalid(line);
        if (bad != std::string::npos)
          fail("{}: invalid UTF-8 at byte offset {} of the line (use --replace-invalid)", where,
               bad);
        fail("{}: invalid JSON: {}", where, e.what());
      }
      DFLASH_CHECK(rec.is_object(), "{}: expected a JSON object", where);
      if (rec.contains("id")) {
        out["id"] = rec["id"];
        where += fmt::format(" (id {})", rec["id"].dump());
      }
    }
    try {
      if (o.decode) {
        std::vector<int32_t> ids;
        if (o.jsonl) {
          DFLASH_CHECK(rec.contains("ids"), "record has no 'ids' field");
          ids = parse_ids(rec["ids"], "ids");
        } else if (!line.empty() && line[0] == '[') {
          ids = parse_ids(nlohmann::json::parse(line), "ids");
        } else {
          std::istringstream ss(line);
          std::string w;
          while (ss >> w) {
            size_t used = 0;
            long v = 0;
            try {
              v = std::stol(w, &used);
            } catch (const std::exception&) {
              used = 0;
            }
            DFLASH_CHECK(used == w.size(), "'{}' is not a token id", w);
            ids.push_back(static_cast<int32_t>(v));
          }
        }
        out["text"] = tok.decode(ids, o.skip_special);
      } else {
        std::string text;
        if (o.jsonl) {
          DFLASH_CHECK(rec.contains("text") && rec["text"].is_string(),
                       "record has no string 'text' field");
          text = rec["text"].get<std::string>();
        } else {
          text = line;
        }
        const auto ids = tok.encode(text, o.offsets ? &offs : nullptr, mode);
        out["ids"] = ids;
        if (o.verbose) {
          nlohmann::json toks = nlohmann::json::array();
          for (int32_t id : ids) toks.push_back(tok.id_to_token(id));
          out["tokens"] = toks;
        }
        if (o.offsets) {
          nlohmann::json oj = nlohmann::json::array();
          for (const auto& [b, e] : offs) oj.push_back({b, e});
          out["offsets"] = oj;
        }
      }
    } catch (const Error& e) {
      throw e.with_context(where);
    } catch (const nlohmann::json::exception& e) {
      fail("{}: {}", where, e.what());
    }
    std::string s = out.dump();
    s += '\n';
    std::fwrite(s.data(), 1, s.size(), stdout);
  }
  std::fflush(stdout);
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "tokenize", "Encode stdin lines to token ids (or decode ids to text), one JSON line each");
  auto o = std::make_shared<TokenizeOptions>();
  sub->add_option("--model", o->model, "Folder holding tokenizer.json (or the file itself)")
      ->required();
  sub->add_flag("--jsonl", o->jsonl,
                "Input lines are JSON records with a 'text' field ('ids' with --decode)");
  sub->add_flag("--verbose", o->verbose, "Also print the token strings");
  sub->add_flag("--offsets", o->offsets, "Also print each token's byte range [begin, end)");
  sub->add_flag("--decode", o->decode, "Decode token ids to text instead");
  sub->add_flag("--skip-special", o->skip_special, "With --decode: drop special tokens");
  sub->add_flag("--replace-invalid", o->replace_invalid,
                "Replace invalid UTF-8 with U+FFFD instead of failing");
  sub->callback([o] { run_tokenize(*o); });
}

}  // namespace dflash::cli
