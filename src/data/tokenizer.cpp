// dflash.cpp — HF `tokenizer.json` byte-level BPE tokenizer (see tokenizer.hpp).
//
// Invariants:
// - Everything after load() is immutable; per-thread scratch (PCRE2 match data and JIT stack, BPE
//   work arrays, the piece cache) lives in thread_local storage keyed by the tokenizer's unique id,
//   so encode/decode are safe to call from many threads at once.
// - The vocabulary is held as raw bytes: each byte-level token string (GPT-2 bytes_to_unicode
//   alphabet) is mapped back to the bytes it stands for, so BPE runs directly on the UTF-8 bytes of
//   a pre-token piece. The 256 single-byte tokens must all exist (checked at load).
// - Semantics follow HF tokenizers (0.2x): tokenizer/added_vocabulary.rs (find_matches,
//   extract_and_normalize), normalizer.rs (split behaviours), pre_tokenizers/byte_level.rs,
//   models/bpe/word.rs (merge_word: a min-heap on (rank, position) with stale-entry checks).
// - Offsets are byte ranges of the caller's text. A token covering part of a character gets the
//   whole character; a token coming from a normalised chunk (e.g. NFC composed a base + combining
//   marks) gets the chunk's original range; a token that is only the virtual prefix space gets the
//   range of the character it precedes (as HF).
#include "data/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.hpp"
#include "core/log.hpp"
#include "data/utf8.hpp"

namespace dflash {

namespace {

using json = nlohmann::json;
using Offsets = std::vector<std::pair<size_t, size_t>>;

// ------------------------------------------------------------------ byte-level alphabet (GPT-2)

/// GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to U+0100 + n.
struct ByteLevelAlphabet {
  char32_t byte_to_cp[256];
  std::unordered_map<char32_t, uint8_t> cp_to_byte;
  ByteLevelAlphabet() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      byte_to_cp[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      cp_to_byte[byte_to_cp[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet a;
  return a;
}

/// The bytes a byte-level token string stands for, or nullopt if a character is outside the
/// alphabet (then the HF ByteLevel decoder emits the token's own UTF-8 bytes).
std::optional<std::string> byte_level_to_bytes(std::string_view tok) {
  std::string out;
  size_t i = 0;
  while (i < tok.size()) {
    size_t len = 0;
    if (utf8::sequence_length(tok, i) == 0) return std::nullopt;
    const char32_t cp = utf8::decode(tok, i, &len);
    auto it = alphabet().cp_to_byte.find(cp);
    if (it == alphabet().cp_to_byte.end()) return std::nullopt;
    out += static_cast<char>(it->second);
    i += len;
  }
  return out;
}

// ------------------------------------------------------------------ Unicode helpers

/// Unicode White_Space (what Rust's char::is_whitespace, the regex crate's \s and Oniguruma's \s
/// match).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}
/// The White_Space set as the inside of a PCRE2 character class.
constexpr const char* kWhiteSpaceClass =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";
/// Word characters as the inside of a PCRE2 class (Oniguruma / regex crate Unicode \w, with
/// Alphabetic approximated by letters and letter numbers).
constexpr const char* kWordClass = "\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}";

/// Regex-crate \w, used by added tokens' single_word check (Alphabetic approximated as L + Nl).
bool is_word_char(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

/// Code point of the character ending at byte `end` (exclusive) of valid UTF-8 `s`.
char32_t last_char(std::string_view s, size_t end) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
  size_t len;
  return utf8::decode(s, b, &len);
}

bool is_ascii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ull) return false;
  }
  for (; i < s.size(); ++i)
    if (static_cast<uint8_t>(s[i]) & 0x80) return false;
  return true;
}

// ------------------------------------------------------------------ normalizer

/// One Unicode normalisation form (utf8proc options).
enum class NormForm { nfc, nfd, nfkc, nfkd };

int norm_options(NormForm f) {
  switch (f) {
    case NormForm::nfc:
      return UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    case NormForm::nfd:
      return UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
    case NormForm::nfkc:
      return UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    case NormForm::nfkd:
      return UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  }
  return 0;
}

/// Code points that can be the non-first element of a canonical decomposition (hence may compose
/// with what precedes them), plus the Hangul medial/final jamo. A chunk boundary is never placed
/// before such a character.
const std::vector<bool>& composition_seconds() {
  static const std::vector<bool> table = [] {
    std::vector<bool> t(0x110000, false);
    utf8proc_int32_t buf[32];
    for (utf8proc_int32_t cp = 0; cp < 0x110000; ++cp) {
      const utf8proc_property_t* p = utf8proc_get_property(cp);
      if (p->decomp_seqindex == UINT16_MAX || p->decomp_type != 0) continue;
      int last = 0;
      const utf8proc_ssize_t n = utf8proc_decompose_char(cp, buf, 32, UTF8PROC_DECOMPOSE, &last);
      for (utf8proc_ssize_t k = 1; k < n && k < 32; ++k) t[static_cast<size_t>(buf[k])] = true;
    }
    for (char32_t c = 0x1161; c <= 0x1175; ++c) t[c] = true;
    for (char32_t c = 0x11A8; c <= 0x11C2; ++c) t[c] = true;
    return t;
  }();
  return table;
}

/// A normalizer: a sequence of normalisation forms applied in order (empty = identity).
struct Normalizer {
  std::vector<NormForm> forms;
  bool compat = false;  // any K form

  bool empty() const { return forms.empty(); }

  /// True if a chunk may start at `c`: it is a starter that composes with nothing before it and
  /// whose (compatibility) decomposition also begins with such a starter.
  bool starts_chunk(char32_t c) const {
    if (c < 0x300) return true;  // Latin-1 and Latin Extended-A/B: starters, never a second
    const auto cpi = static_cast<utf8proc_int32_t>(c);
    const utf8proc_property_t* p = utf8proc_get_property(cpi);
    if (p->combining_class != 0 || composition_seconds()[c]) return false;
    if (p->decomp_seqindex != UINT16_MAX) {
      utf8proc_int32_t buf[32];
      int last = 0;
      const auto opt =
          static_cast<utf8proc_option_t>(UTF8PROC_DECOMPOSE | (compat ? UTF8PROC_COMPAT : 0));
      const utf8proc_ssize_t n = utf8proc_decompose_char(cpi, buf, 32, opt, &last);
      if (n > 0) {
        const utf8proc_property_t* q = utf8proc_get_property(buf[0]);
        if (q->combining_class != 0 || composition_seconds()[static_cast<size_t>(buf[0])])
          return false;
      }
    }
    return true;
  }

  /// True if the single-character chunk `c` may change under the forms.
  bool may_change(char32_t c) const {
    if (c < 0x80) return false;
    const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(c));
    if (p->decomp_seqindex != UINT16_MAX) return true;
    return c >= 0xAC00 && c <= 0xD7A3;  // Hangul syllables decompose algorithmically
  }

  std::string apply(std::string_view chunk) const {
    std::string cur(chunk);
    for (NormForm f : forms) {
      utf8proc_uint8_t* dst = nullptr;
      const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                                              static_cast<utf8proc_ssize_t>(cur.size()), &dst,
                                              static_cast<utf8proc_option_t>(norm_options(f)));
      if (n < 0) fail("normalizer: utf8proc error: {}", utf8proc_errmsg(n));
      cur.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
      std::free(dst);
    }
    return cur;
  }

  /// Normalises valid UTF-8 `s`. Returns false (and leaves `out` alone) when the text is
  /// unchanged. Otherwise `out` receives the normalised text and, if `ostart`/`oend` are given,
  /// for each output byte the range [ostart, oend) of `s` (plus `base`) it came from.
  bool normalize(std::string_view s, size_t base, std::string& out, std::vector<size_t>* ostart,
                 std::vector<size_t>* oend) const {
    if (forms.empty() || is_ascii(s)) return false;
    // Split into chunks at characters that start a chunk; normalise changing chunks only.
    struct Chunk {
      size_t b, e;
      bool multi;
      bool change;
    };
    std::vector<Chunk> chunks;
    bool any = false;
    size_t i = 0;
    while (i < s.size()) {
      size_t len;
      const char32_t c = utf8::decode(s, i, &len);
      if (chunks.empty() || starts_chunk(c)) {
        chunks.push_back({i, i + len, false, may_change(c)});
      } else {
        Chunk& ch = chunks.back();
        ch.e = i + len;
        ch.multi = true;
        ch.change = true;  // a combining sequence may reorder or compose
      }
      any = any || chunks.back().change;
      i += len;
    }
    if (!any) return false;
    std::string res;
    res.reserve(s.size() + 16);
    if (ostart) {
      ostart->clear();
      oend->clear();
    }
    for (const Chunk& ch : chunks) {
      const std::string_view src = s.substr(ch.b, ch.e - ch.b);
      if (!ch.change) {
        res.append(src);
        if (ostart) {
          for (size_t k = 0; k < src.size(); ++k) {
            ostart->push_back(base + ch.b);
            oend->push_back(base + ch.e);
          }
        }
        continue;
      }
      const std::string n = apply(src);
      res += n;
      if (ostart && n == src) {  // unchanged chunk: per-character ranges
        for (size_t k = 0; k < src.size();) {
          size_t len = 0;
          utf8::decode(src, k, &len);
          for (size_t q = 0; q < len; ++q) {
            ostart->push_back(base + ch.b + k);
            oend->push_back(base + ch.b + k + len);
          }
          k += len;
        }
      } else if (ostart) {
        for (size_t k = 0; k < n.size(); ++k) {
          ostart->push_back(base + ch.b);
          oend->push_back(base + ch.e);
        }
      }
    }
    if (res == s) return false;
    out = std::move(res);
    return true;
  }
};

Normalizer parse_normalizer(const json& j, const std::string& where) {
  Normalizer n;
  if (j.is_null()) return n;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& sub : j.at("normalizers")) {
      Normalizer s = parse_normalizer(sub, where + ".normalizers[]");
      n.forms.insert(n.forms.end(), s.forms.begin(), s.forms.end());
    }
  } else if (type == "NFC") {
    n.forms.push_back(NormForm::nfc);
  } else if (type == "NFD") {
    n.forms.push_back(NormForm::nfd);
  } else if (type == "NFKC") {
    n.forms.push_back(NormForm::nfkc);
  } else if (type == "NFKD") {
    n.forms.push_back(NormForm::nfkd);
  } else {
    fail("{}: normalizer type '{}' is not supported (NFC, NFD, NFKC, NFKD, Sequence)", where, type);
  }
  for (NormForm f : n.forms) n.compat = n.compat || f == NormForm::nfkc || f == NormForm::nfkd;
  return n;
}

// ------------------------------------------------------------------ regex (PCRE2 + JIT)

/// Rewrites an Oniguruma pattern (HF tokenizers' regex engine, Ruby syntax) for PCRE2: \s, \S,
/// \w, \W become explicit classes with Oniguruma's Unicode meaning (PCRE2's UCP \s also matches
/// U+180E and its \w lacks marks).
std::string onig_to_pcre2(const std::string& pat, const std::string& where) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pat.size(); ++i) {
    const char c = pat[i];
    if (c == '\\' && i + 1 < pat.size()) {
      const char d = pat[++i];
      if (d == 's' || d == 'w') {
        const char* cls = d == 's' ? kWhiteSpaceClass : kWordClass;
        out += in_class ? std::string(cls) : "[" + std::string(cls) + "]";
      } else if (d == 'S' || d == 'W') {
        DFLASH_CHECK(!in_class, "{}: '\\{}' inside a character class is not supported: {}", where,
                     d, pat);
        out += std::string("[^") + (d == 'S' ? kWhiteSpaceClass : kWordClass) + "]";
      } else {
        out += '\\';
        out += d;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < pat.size() && pat[i + 1] == '^') out += pat[++i];
      if (i + 1 < pat.size() && pat[i + 1] == ']') out += pat[++i];
      continue;
    }
    if (in_class && c == '[') {
      fail("{}: nested character classes are not supported: {}", where, pat);
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

std::string regex_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::strchr("\\^$.|?*+()[]{}", c) && c != '\0') out += '\\';
    out += c;
  }
  return out;
}

/// Per-thread PCRE2 match data and JIT stack.
struct RegexScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* stack = nullptr;
  RegexScratch() {
    md = pcre2_match_data_create(4, nullptr);
    mc = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (!md || !mc || !stack) throw Error("PCRE2: out of memory");
    pcre2_jit_stack_assign(mc, nullptr, stack);
  }
  ~RegexScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
  }
};
RegexScratch& regex_scratch() {
  thread_local RegexScratch s;
  return s;
}

/// A compiled regex with find-all over a subject.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE erroff = 0;
    pcre2_compile_context* cc = pcre2_compile_context_create(nullptr);
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &erroff, cc);
    pcre2_compile_context_free(cc);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("{}: cannot compile regex at offset {}: {} (pattern {})", where, erroff,
           reinterpret_cast<const char*>(msg), pattern);
    }
    uint32_t have_jit = 0;
    pcre2_config(PCRE2_CONFIG_JIT, &have_jit);
    jit_ = have_jit && pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
    if (!jit_) log_warn_once();
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Calls f(begin, end) for each non-overlapping match in s (Oniguruma find_iter semantics: an
  /// empty match advances the search by one character).
  template <class F>
  void for_each_match(std::string_view s, F&& f) const {
    RegexScratch& rs = regex_scratch();
    size_t pos = 0;
    const auto* subj = reinterpret_cast<PCRE2_SPTR>(s.data());
    while (pos <= s.size()) {
      const int rc =
          jit_ ? pcre2_jit_match(code_, subj, s.size(), pos, 0, rs.md, rs.mc)
               : pcre2_match(code_, subj, s.size(), pos, PCRE2_NO_UTF_CHECK, rs.md, rs.mc);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        fail("regex match failed: {}", reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(rs.md);
      const size_t b = ov[0], e = ov[1];
      f(b, e);
      if (e > b) {
        pos = e;
      } else {
        if (e >= s.size()) return;
        size_t len = 1;
        while (e + len < s.size() && (static_cast<uint8_t>(s[e + len]) & 0xC0) == 0x80) ++len;
        pos = e + len;
      }
    }
  }

 private:
  static void log_warn_once() {
    static std::once_flag once;
    std::call_once(once, [] { spdlog::warn("PCRE2 JIT unavailable: tokenizer regex runs slow"); });
  }
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ------------------------------------------------------------------ pre-tokenizers

/// A piece of the normalised segment: bytes [b, e), optionally preceded by a virtual space.
struct Piece {
  uint32_t b, e;
  bool prefix_space;
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct PreTokenizer {
  enum Kind { split, byte_level } kind;
  std::shared_ptr<Regex> regex;  // split; byte_level with use_regex
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  bool add_prefix_space = false;
};

constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

SplitBehavior parse_behavior(const std::string& s, const std::string& where) {
  if (s == "Removed") return SplitBehavior::removed;
  if (s == "Isolated") return SplitBehavior::isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (s == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (s == "Contiguous") return SplitBehavior::contiguous;
  fail("{}: unknown split behavior '{}'", where, s);
}

void parse_pre_tokenizer(const json& j, const std::string& where, std::vector<PreTokenizer>& out) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& sub : j.at("pretokenizers")) parse_pre_tokenizer(sub, where + "[]", out);
    return;
  }
  PreTokenizer p;
  if (type == "Split") {
    p.kind = PreTokenizer::split;
    const json& pat = j.at("pattern");
    std::string re;
    if (pat.contains("Regex")) {
      re = onig_to_pcre2(pat.at("Regex").get<std::string>(), where + ".pattern.Regex");
    } else if (pat.contains("String")) {
      re = regex_escape(pat.at("String").get<std::string>());
    } else {
      fail("{}.pattern: expected 'Regex' or 'String'", where);
    }
    p.regex = std::make_shared<Regex>(re, where + ".pattern");
    p.behavior = parse_behavior(j.at("behavior").get<std::string>(), where + ".behavior");
    p.invert = j.value("invert", false);
  } else if (type == "ByteLevel") {
    p.kind = PreTokenizer::byte_level;
    p.add_prefix_space = j.value("add_prefix_space", false);
    if (j.value("use_regex", true))
      p.regex = std::make_shared<Regex>(onig_to_pcre2(kGpt2Pattern, where), where);
  } else {
    fail("{}: pre_tokenizer type '{}' is not supported (Split, ByteLevel, Sequence)", where, type);
  }
  out.push_back(std::move(p));
}

/// Splits piece `p` of `s` with `re` by `behavior` (HF NormalizedString::split), appending
/// non-empty results to `out`.
void split_piece(std::string_view s, const Piece& p, const PreTokenizer& pt,
                 std::vector<Piece>& out, std::vector<std::pair<Piece, bool>>& tmp) {
  tmp.clear();
  const std::string_view sub = s.substr(p.b, p.e - p.b);
  uint32_t prev = 0;
  pt.regex->for_each_match(sub, [&](size_t b, size_t e) {
    if (prev != b) tmp.push_back({{p.b + prev, p.b + static_cast<uint32_t>(b), false}, pt.invert});
    tmp.push_back(
        {{p.b + static_cast<uint32_t>(b), p.b + static_cast<uint32_t>(e), false}, !pt.invert});
    prev = static_cast<uint32_t>(e);
  });
  if (prev != sub.size()) tmp.push_back({{p.b + prev, p.e, false}, pt.invert});
  const size_t first = out.size();
  switch (pt.behavior) {
    case SplitBehavior::isolated:
      for (auto& [piece, m] : tmp) out.push_back(piece);
      break;
    case SplitBehavior::removed:
      for (auto& [piece, m] : tmp)
        if (!m) out.push_back(piece);
      break;
    case SplitBehavior::merged_with_previous: {
      bool prev_match = false;
      for (auto& [piece, m] : tmp) {
        if (m && !prev_match && out.size() > first)
          out.back().e = piece.e;
        else
          out.push_back(piece);
        prev_match = m;
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      bool prev_match = false;
      std::vector<Piece> rev;
      for (auto it = tmp.rbegin(); it != tmp.rend(); ++it) {
        if (it->second && !prev_match && !rev.empty())
          rev.back().b = it->first.b;
        else
          rev.push_back(it->first);
        prev_match = it->second;
      }
      out.insert(out.end(), rev.rbegin(), rev.rend());
      break;
    }
    case SplitBehavior::contiguous: {
      bool prev_match = false;
      for (auto& [piece, m] : tmp) {
        if (m == prev_match && out.size() > first)
          out.back().e = piece.e;
        else
          out.push_back(piece);
        prev_match = m;
      }
      break;
    }
  }
  // Drop empties; the first result inherits the parent's virtual prefix space.
  size_t w = first;
  for (size_t r = first; r < out.size(); ++r)
    if (out[r].e > out[r].b) out[w++] = out[r];
  out.resize(w);
  if (p.prefix_space && out.size() > first) out[first].prefix_space = true;
}

// ------------------------------------------------------------------ merges hash map

/// Open-addressing map (left id, right id) -> (rank, merged id).
class MergeMap {
 public:
  struct Value {
    int32_t rank;
    int32_t id;
  };
  void build(const std::vector<std::pair<uint64_t, Value>>& items) {
    size_t cap = 16;
    while (cap < items.size() * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, Value{0, 0});
    mask_ = cap - 1;
    for (const auto& [k, v] : items) {
      size_t h = hash(k);
      while (keys_[h] != kEmpty && keys_[h] != k) h = (h + 1) & mask_;
      if (keys_[h] == k) continue;  // duplicate merge: keep the first (lowest) rank
      keys_[h] = k;
      vals_[h] = v;
    }
  }
  const Value* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    size_t h = hash(k);
    while (true) {
      const uint64_t kk = keys_[h];
      if (kk == k) return &vals_[h];
      if (kk == kEmpty) return nullptr;
      h = (h + 1) & mask_;
    }
  }
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  size_t hash(uint64_t k) const { return (k * 0x9E3779B97F4A7C15ull >> 17) & mask_; }
  std::vector<uint64_t> keys_;
  std::vector<Value> vals_;
  size_t mask_ = 0;
};

// ------------------------------------------------------------------ added tokens

struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

/// Leftmost-longest matcher over a small set of literal patterns (HF builds an Aho-Corasick
/// automaton with MatchKind::LeftmostLongest; the sets here are tens of tokens).
class AddedMatcher {
 public:
  /// One split of a text: [b, e) and the added token's index, or -1 for plain text.
  struct Split {
    size_t b, e;
    int32_t token;
  };

  void build(const std::vector<AddedToken>& tokens, const std::vector<std::string>& contents,
             const std::vector<int32_t>& which) {
    for (int32_t t : which) {
      const std::string& c = contents[static_cast<size_t>(t)];
      if (c.empty()) continue;
      by_first_[static_cast<uint8_t>(c[0])].push_back({c, t});
      first_[static_cast<uint8_t>(c[0])] = true;
      any_ = true;
    }
    for (auto& v : by_first_)
      std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
        return a.first.size() > b.first.size();
      });
    tokens_ = &tokens;
  }
  bool empty() const { return !any_; }

  /// HF AddedVocabulary::find_matches over valid UTF-8 `s`.
  void find(std::string_view s, std::vector<Split>& out) const {
    out.clear();
    size_t start_offset = 0;
    size_t i = 0;
    const size_t n = s.size();
    while (i < n) {
      if (!first_[static_cast<uint8_t>(s[i])]) {
        ++i;
        continue;
      }
      int32_t tok = -1;
      size_t mlen = 0;
      for (const auto& [pat, t] : by_first_[static_cast<uint8_t>(s[i])]) {
        if (pat.size() <= n - i && std::memcmp(s.data() + i, pat.data(), pat.size()) == 0) {
          tok = t;
          mlen = pat.size();
          break;
        }
      }
      if (tok < 0) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + mlen;
      i = stop;  // the automaton resumes after the raw match, whatever happens to it below
      const AddedToken& at = (*tokens_)[static_cast<size_t>(tok)];
      if (at.single_word) {
        const bool start_space = start == 0 || !is_word_char(last_char(s, start));
        size_t l;
        const bool stop_space = stop == n || !is_word_char(utf8::decode(s, stop, &l));
        if (!start_space || !stop_space) continue;
      }
      if (at.lstrip) {
        size_t ns = start;
        while (ns > 0) {
          size_t b = ns - 1;
          while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
          size_t l;
          if (!is_white_space(utf8::decode(s, b, &l))) break;
          ns = b;
        }
        start = std::max(ns, start_offset);
      }
      if (at.rstrip) {
        while (stop < n) {
          size_t l;
          if (!is_white_space(utf8::decode(s, stop, &l))) break;
          stop += l;
        }
      }
      if (start_offset < start) out.push_back({start_offset, start, -1});
      out.push_back({start, stop, tok});
      start_offset = stop;
    }
    if (start_offset != n) out.push_back({start_offset, n, -1});
  }

 private:
  std::vector<std::pair<std::string, int32_t>> by_first_[256];
  bool first_[256] = {};
  bool any_ = false;
  const std::vector<AddedToken>* tokens_ = nullptr;
};

std::atomic<uint64_t> g_next_uid{1};

// ------------------------------------------------------------------ per-thread BPE scratch

struct Sym {
  int32_t id, prev, next, len;
};
struct HeapItem {
  int32_t rank, pos, id;
};
/// Min-heap order on (rank, pos), as HF's Merge Ord (BinaryHeap is a max-heap of reversed order).
struct HeapCmp {
  bool operator()(const HeapItem& a, const HeapItem& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

/// Hash for heterogeneous string lookup in the piece cache.
struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

struct ThreadScratch {
  uint64_t owner = 0;
  std::vector<Sym> syms;
  std::vector<HeapItem> heap;
  std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> cache;
  std::string key;
  std::vector<Piece> pieces, pieces2;
  std::vector<std::pair<Piece, bool>> split_tmp;
  std::vector<AddedMatcher::Split> splits, nsplits;
  std::vector<size_t> ostart, oend;
  std::string normalized;
};

constexpr size_t kCacheMaxEntries = 1 << 17;
constexpr size_t kCacheMaxPiece = 256;

}  // namespace

// ------------------------------------------------------------------ Impl

struct Tokenizer::Impl {
  uint64_t uid = g_next_uid.fetch_add(1);
  std::string source;  // file name, for messages
  Normalizer normalizer;
  std::vector<PreTokenizer> pre;
  // Model.
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> vocab;  // token string -> id
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> bytes_to_id;
  std::vector<std::string> id_str;    // token string per id ("" if unused)
  std::vector<std::string> id_bytes;  // decoded bytes per id
  std::vector<uint8_t> id_special;    // 1 if special added token
  std::vector<uint8_t> id_used;
  int32_t byte_id[256];
  MergeMap merges;
  bool ignore_merges = false;
  // Added tokens.
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> added_by_content;
  AddedMatcher raw_matcher, norm_matcher;
  int32_t n_ids = 0;

  ThreadScratch& scratch() const {
    thread_local ThreadScratch ts;
    if (ts.owner != uid) {
      ts.cache.clear();
      ts.owner = uid;
    }
    return ts;
  }

  /// BPE of `bytes` (optionally preceded by a space), appending ids (HF models/bpe word.rs).
  void bpe(std::string_view bytes, bool prefix_space, std::vector<int32_t>& out,
           ThreadScratch& ts) const {
    std::string_view key = bytes;
    if (prefix_space) {
      ts.key.assign(1, ' ');
      ts.key.append(bytes);
      key = ts.key;
    }
    if (ignore_merges) {
      auto it = bytes_to_id.find(key);
      if (it != bytes_to_id.end()) {
        out.push_back(it->second);
        return;
      }
    }
    const bool cacheable = key.size() <= kCacheMaxPiece;
    if (cacheable) {
      auto it = ts.cache.find(key);
      if (it != ts.cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t n = key.size();
    auto& syms = ts.syms;
    auto& heap = ts.heap;
    syms.resize(n);
    heap.clear();
    for (size_t i = 0; i < n; ++i) {
      syms[i] = {byte_id[static_cast<uint8_t>(key[i])], static_cast<int32_t>(i) - 1,
                 i + 1 < n ? static_cast<int32_t>(i + 1) : -1, 1};
    }
    for (size_t i = 0; i + 1 < n; ++i) {
      if (const auto* m = merges.find(syms[i].id, syms[i + 1].id))
        heap.push_back({m->rank, static_cast<int32_t>(i), m->id});
    }
    std::make_heap(heap.begin(), heap.end(), HeapCmp{});
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), HeapCmp{});
      const HeapItem top = heap.back();
      heap.pop_back();
      Sym& s = syms[static_cast<size_t>(top.pos)];
      if (s.len == 0 || s.next < 0) continue;
      Sym& right = syms[static_cast<size_t>(s.next)];
      const auto* m = merges.find(s.id, right.id);
      if (!m || m->id != top.id) continue;
      s.id = top.id;
      s.len += right.len;
      right.len = 0;
      s.next = right.next;
      if (s.next >= 0) syms[static_cast<size_t>(s.next)].prev = top.pos;
      if (s.prev >= 0) {
        const Sym& l = syms[static_cast<size_t>(s.prev)];
        if (const auto* mm = merges.find(l.id, s.id)) {
          heap.push_back({mm->rank, s.prev, mm->id});
          std::push_heap(heap.begin(), heap.end(), HeapCmp{});
        }
      }
      if (s.next >= 0) {
        const Sym& r = syms[static_cast<size_t>(s.next)];
        if (const auto* mm = merges.find(s.id, r.id)) {
          heap.push_back({mm->rank, top.pos, mm->id});
          std::push_heap(heap.begin(), heap.end(), HeapCmp{});
        }
      }
    }
    const size_t first = out.size();
    for (int32_t i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next)
      out.push_back(syms[static_cast<size_t>(i)].id);
    if (cacheable) {
      if (ts.cache.size() >= kCacheMaxEntries) ts.cache.clear();
      ts.cache.emplace(std::string(key),
                       std::vector<int32_t>(out.begin() + static_cast<long>(first), out.end()));
    }
  }

  /// Encodes one segment `seg` (no raw added token inside) starting at byte `base` of the valid
  /// text. Offsets (if wanted) are in the valid text's coordinates.
  void encode_segment(std::string_view text, size_t base, size_t len, std::vector<int32_t>& ids,
                      Offsets* offs, ThreadScratch& ts) const {
    const std::string_view seg = text.substr(base, len);
    std::string_view ns = seg;
    bool mapped = false;
    if (!normalizer.empty()) {
      mapped = normalizer.normalize(seg, base, ts.normalized, offs ? &ts.ostart : nullptr,
                                    offs ? &ts.oend : nullptr);
      if (mapped) ns = ts.normalized;
    }
    // Maps a non-empty byte range of ns to text offsets.
    auto map_range = [&](size_t b, size_t e) -> std::pair<size_t, size_t> {
      if (mapped) return {ts.ostart[b], ts.oend[e - 1]};
      while (b > 0 && (static_cast<uint8_t>(ns[b]) & 0xC0) == 0x80) --b;
      while (e < ns.size() && (static_cast<uint8_t>(ns[e]) & 0xC0) == 0x80) ++e;
      return {base + b, base + e};
    };
    auto& nsplits = ts.nsplits;
    if (norm_matcher.empty()) {
      nsplits.assign(1, {0, ns.size(), -1});
    } else {
      norm_matcher.find(ns, nsplits);
    }
    for (const auto& sp : nsplits) {
      if (sp.e == sp.b) continue;
      if (sp.token >= 0) {
        ids.push_back(added[static_cast<size_t>(sp.token)].id);
        if (offs) offs->push_back(map_range(sp.b, sp.e));
        continue;
      }
      // Pre-tokenize.
      auto& pieces = ts.pieces;
      auto& next = ts.pieces2;
      pieces.assign(1, {static_cast<uint32_t>(sp.b), static_cast<uint32_t>(sp.e), false});
      for (const PreTokenizer& pt : pre) {
        const bool prefix = pt.kind == PreTokenizer::byte_level && pt.add_prefix_space;
        if (!pt.regex) {
          if (prefix)
            for (Piece& p : pieces) p.prefix_space = ns[p.b] != ' ';
          continue;
        }
        next.clear();
        for (const Piece& p : pieces) {
          if (!prefix || ns[p.b] == ' ') {
            split_piece(ns, p, pt, next, ts.split_tmp);
            continue;
          }
          // HF prepends the space before splitting: run the regex on " " + piece and shift back;
          // a result starting at 0 carries the virtual space.
          ts.key.assign(1, ' ');
          ts.key.append(ns.substr(p.b, p.e - p.b));
          const size_t from = next.size();
          split_piece(ts.key, {0, static_cast<uint32_t>(ts.key.size()), false}, pt, next,
                      ts.split_tmp);
          for (size_t k = from; k < next.size(); ++k) {
            Piece& r = next[k];
            const bool virt = r.b == 0;
            r = {virt ? p.b : p.b + r.b - 1, p.b + r.e - 1, virt};
          }
        }
        std::swap(pieces, next);
      }
      for (const Piece& p : pieces) {
        const size_t first = ids.size();
        bpe(ns.substr(p.b, p.e - p.b), p.prefix_space, ids, ts);
        if (!offs) continue;
        // Token byte ranges within the piece; position 0 is the virtual space if any.
        size_t pos = p.b;
        bool virt = p.prefix_space;
        for (size_t k = first; k < ids.size(); ++k) {
          size_t tl = id_bytes[static_cast<size_t>(ids[k])].size();
          if (virt) {
            virt = false;
            --tl;
            if (tl == 0) {  // the virtual space alone: HF gives it the next character's range
              offs->push_back(map_range(pos, pos + 1));
              continue;
            }
          }
          offs->push_back(map_range(pos, pos + tl));
          pos += tl;
        }
      }
    }
  }
};

// ------------------------------------------------------------------ loading

namespace {

std::string read_text_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  DFLASH_CHECK(f, "cannot open tokenizer file {}", p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool is_empty_string_or_null(const json& j, const char* key) {
  if (!j.contains(key) || j.at(key).is_null()) return true;
  return j.at(key).is_string() && j.at(key).get<std::string>().empty();
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {

/// Token ids must lie below this: far above any real vocabulary (the largest hold about 262k
/// tokens), low enough that the tables indexed by id (sized by the largest id) stay small.
constexpr int64_t kMaxTokenIds = int64_t{1} << 24;

/// The token id `v` (a JSON integer in [0, kMaxTokenIds)); `what` names it in the error.
int32_t token_id_of(const json& v, const std::string& where, const std::string& what) {
  DFLASH_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < kMaxTokenIds,
               "{}: {} must be a token id in [0, {}), got {}", where, what, kMaxTokenIds, v.dump());
  return static_cast<int32_t>(v.get<int64_t>());
}

}  // namespace

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(file)) file /= "tokenizer.json";
  DFLASH_CHECK(std::filesystem::exists(file), "tokenizer file {} does not exist", file.string());
  const std::string where = file.string();
  json j;
  try {
    j = json::parse(read_text_file(file));
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", where, e.what());
  }
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.source = where;
  try {
    // Model.
    const json& m = j.at("model");
    const std::string type = m.value("type", m.contains("merges") ? "BPE" : "");
    DFLASH_CHECK(type == "BPE", "{}: model.type '{}' is not supported (only BPE)", where, type);
    DFLASH_CHECK(m.value("dropout", json()).is_null() || m.at("dropout").get<double>() == 0.0,
                 "{}: model.dropout is not supported (encoding must be deterministic)", where);
    DFLASH_CHECK(is_empty_string_or_null(m, "continuing_subword_prefix"),
                 "{}: model.continuing_subword_prefix is not supported", where);
    DFLASH_CHECK(is_empty_string_or_null(m, "end_of_word_suffix"),
                 "{}: model.end_of_word_suffix is not supported", where);
    t.ignore_merges = m.value("ignore_merges", false);
    const json& vocab = m.at("vocab");
    DFLASH_CHECK(vocab.is_object(), "{}: model.vocab must be an object", where);
    int32_t max_id = -1;
    for (const auto& [tok, idj] : vocab.items()) {
      max_id = std::max(max_id, token_id_of(idj, where, "model.vocab['" + tok + "']"));
    }
    const json& added_j = j.value("added_tokens", json::array());
    // Ids of added tokens as HF AddedVocabulary::add_tokens assigns them while deserializing (in
    // file order): a content already known keeps its id; a new one gets the model's vocabulary
    // size, or max assigned id + 1 once that is past it. The file's "id" is only checked.
    std::vector<int32_t> added_ids;
    {
      const auto model_size = static_cast<int32_t>(vocab.size());
      std::unordered_map<std::string, int32_t> assigned;
      int32_t max_assigned = -1;
      for (const auto& a : added_j) {
        const std::string content = a.at("content").get<std::string>();
        int32_t id;
        if (auto it = assigned.find(content); it != assigned.end()) {
          id = it->second;
        } else if (vocab.contains(content)) {
          id = token_id_of(vocab.at(content), where, "model.vocab['" + content + "']");
        } else {
          id = max_assigned < 0                                  ? model_size
               : (max_assigned >= model_size || model_size == 0) ? max_assigned + 1
                                                                 : model_size;
        }
        const int32_t file_id = token_id_of(a.at("id"), where, "added_tokens[].id");
        if (id != file_id)
          spdlog::warn(
              "{}: added token '{}' has id {} in the file but HF tokenizers assigns {}; "
              "using {}",
              where, content, file_id, id, id);
        assigned[content] = id;
        max_assigned = std::max(max_assigned, id);
        added_ids.push_back(id);
        max_id = std::max(max_id, id);
      }
    }
    DFLASH_CHECK(max_id >= 0, "{}: empty vocabulary", where);
    t.n_ids = max_id + 1;
    t.id_str.assign(static_cast<size_t>(t.n_ids), "");
    t.id_bytes.assign(static_cast<size_t>(t.n_ids), "");
    t.id_special.assign(static_cast<size_t>(t.n_ids), 0);
    t.id_used.assign(static_cast<size_t>(t.n_ids), 0);
    t.vocab.reserve(vocab.size());
    for (const auto& [tok, idj] : vocab.items()) {
      const int32_t id = token_id_of(idj, where, "model.vocab['" + tok + "']");
      // One string per id: ids are decoded (and offsets measured) through it.
      DFLASH_CHECK(!t.id_used[static_cast<size_t>(id)],
                   "{}: model.vocab gives id {} to both '{}' and '{}'", where, id,
                   t.id_str[static_cast<size_t>(id)], tok);
      t.vocab.emplace(tok, id);
      t.id_str[static_cast<size_t>(id)] = tok;
      t.id_used[static_cast<size_t>(id)] = 1;
      if (auto b = byte_level_to_bytes(tok)) {
        t.bytes_to_id.emplace(*b, id);
        t.id_bytes[static_cast<size_t>(id)] = std::move(*b);
      } else {
        t.id_bytes[static_cast<size_t>(id)] = tok;
      }
    }
    for (int b = 0; b < 256; ++b) {
      auto it = t.bytes_to_id.find(std::string(1, static_cast<char>(b)));
      DFLASH_CHECK(it != t.bytes_to_id.end(),
                   "{}: model.vocab lacks the byte-level token for byte 0x{:02X} (a byte-level "
                   "BPE vocabulary must hold all 256)",
                   where, b);
      t.byte_id[b] = it->second;
    }
    // Merges: ["a b", ...] (old) or [["a", "b"], ...] (new); rank = position.
    const json& merges = m.at("merges");
    std::vector<std::pair<uint64_t, MergeMap::Value>> items;
    items.reserve(merges.size());
    int32_t rank = 0;
    for (const auto& mj : merges) {
      std::string a, b;
      if (mj.is_string()) {
        const std::string s = mj.get<std::string>();
        const size_t sp = s.find(' ');
        DFLASH_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                     "{}: model.merges[{}] '{}' is not 'a b'", where, rank, s);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        DFLASH_CHECK(mj.is_array() && mj.size() == 2, "{}: model.merges[{}] is not a pair", where,
                     rank);
        a = mj[0].get<std::string>();
        b = mj[1].get<std::string>();
      }
      auto ia = t.vocab.find(a), ib = t.vocab.find(b), iab = t.vocab.find(a + b);
      DFLASH_CHECK(ia != t.vocab.end() && ib != t.vocab.end() && iab != t.vocab.end(),
                   "{}: model.merges[{}] ('{}', '{}') uses a token missing from model.vocab", where,
                   rank, a, b);
      items.push_back({MergeMap::key(ia->second, ib->second), {rank, iab->second}});
      ++rank;
    }
    t.merges.build(items);

    // Normalizer and pre-tokenizer.
    t.normalizer = parse_normalizer(j.value("normalizer", json()), where + ": normalizer");
    parse_pre_tokenizer(j.value("pre_tokenizer", json()), where + ": pre_tokenizer", t.pre);
    bool has_byte_level = false;
    for (size_t i = 0; i < t.pre.size(); ++i) {
      if (t.pre[i].kind != PreTokenizer::byte_level) continue;
      has_byte_level = true;
      DFLASH_CHECK(!t.pre[i].add_prefix_space || i + 1 == t.pre.size(),
                   "{}: pre_tokenizer: ByteLevel with add_prefix_space must come last", where);
    }
    DFLASH_CHECK(has_byte_level,
                 "{}: pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)",
                 where);
    // Decoder: ByteLevel (possibly alone in a Sequence).
    const json dec = j.value("decoder", json());
    std::string dec_type = dec.is_null() ? "null" : dec.value("type", "");
    if (dec_type == "Sequence") {
      const json& ds = dec.at("decoders");
      dec_type = ds.size() == 1 ? ds[0].value("type", "") : "Sequence of several";
    }
    DFLASH_CHECK(dec_type == "ByteLevel", "{}: decoder '{}' is not supported (only ByteLevel)",
                 where, dec_type);

    // Added tokens.
    for (size_t ai = 0; ai < added_j.size(); ++ai) {
      const json& a = added_j[ai];
      AddedToken at{added_ids[ai],
                    a.at("content").get<std::string>(),
                    a.value("single_word", false),
                    a.value("lstrip", false),
                    a.value("rstrip", false),
                    a.value("normalized", false),
                    a.value("special", false)};
      if (at.content.empty()) continue;  // HF ignores empty added tokens
      if (auto it = t.added_by_content.find(at.content); it != t.added_by_content.end()) {
        // Same content again: the later entry's flags replace the earlier ones.
        for (auto& old : t.added)
          if (old.content == at.content) old = at;
        t.id_special[static_cast<size_t>(at.id)] = at.special ? 1 : 0;
        continue;
      }
      const auto idx = static_cast<size_t>(at.id);
      // HF reports (and decodes) a normalized added token by its normalized content.
      std::string shown = at.content;
      if (at.normalized) {
        std::string n;
        if (t.normalizer.normalize(at.content, 0, n, nullptr, nullptr)) shown = n;
      }
      t.id_used[idx] = 1;
      t.id_special[idx] = at.special ? 1 : 0;
      // The ByteLevel decoder maps the token's characters back to bytes when it can.
      if (auto b = byte_level_to_bytes(shown))
        t.id_bytes[idx] = *b;
      else
        t.id_bytes[idx] = shown;
      t.id_str[idx] = std::move(shown);
      t.added_by_content[at.content] = at.id;
      t.added.push_back(std::move(at));
    }
    std::vector<std::string> raw_contents, norm_contents;
    std::vector<int32_t> raw_idx, norm_idx;
    for (size_t i = 0; i < t.added.size(); ++i) {
      const AddedToken& at = t.added[i];
      raw_contents.push_back(at.content);
      if (at.normalized) {
        std::string n;
        norm_contents.push_back(
            t.normalizer.normalize(at.content, 0, n, nullptr, nullptr) ? n : at.content);
        norm_idx.push_back(static_cast<int32_t>(i));
      } else {
        norm_contents.push_back(at.content);
        raw_idx.push_back(static_cast<int32_t>(i));
      }
    }
    t.raw_matcher.build(t.added, raw_contents, raw_idx);
    t.norm_matcher.build(t.added, norm_contents, norm_idx);
  } catch (const json::exception& e) {
    fail("{}: unexpected structure: {}", where, e.what());
  }
  return Tokenizer(std::move(impl));
}

// ------------------------------------------------------------------ encode / decode

std::vector<int32_t> Tokenizer::encode(std::string_view text, Offsets* offsets,
                                       InvalidUtf8 mode) const {
  const Impl& t = *impl_;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (offsets) offsets->clear();

  // Invalid UTF-8: fail, or work on a repaired copy and map offsets back.
  std::string repaired;
  std::vector<size_t> rstart, rend;  // per repaired byte: range of `text`
  std::string_view src = text;
  const size_t bad = utf8::find_invalid(text);
  if (bad != std::string_view::npos) {
    if (mode == InvalidUtf8::error) {
      fail("invalid UTF-8 at byte offset {} (byte 0x{:02X})", bad, static_cast<uint8_t>(text[bad]));
    }
    size_t i = 0;
    while (i < text.size()) {
      size_t bl = 0;
      const size_t len = utf8::sequence_length(text, i, &bl);
      const size_t take = len ? len : bl;
      const size_t outn = len ? len : 3;
      if (len)
        repaired.append(text.data() + i, len);
      else
        repaired += "\xEF\xBF\xBD";
      if (offsets) {
        for (size_t k = 0; k < outn; ++k) {
          rstart.push_back(i);
          rend.push_back(i + take);
        }
      }
      i += take;
    }
    src = repaired;
  }

  ThreadScratch& ts = t.scratch();
  std::vector<AddedMatcher::Split>& splits = ts.splits;
  splits.clear();
  if (t.raw_matcher.empty())
    splits.push_back({0, src.size(), -1});
  else
    t.raw_matcher.find(src, splits);
  for (const auto& sp : splits) {
    if (sp.e == sp.b) continue;
    if (sp.token >= 0) {
      ids.push_back(t.added[static_cast<size_t>(sp.token)].id);
      if (offsets) offsets->push_back({sp.b, sp.e});
      continue;
    }
    t.encode_segment(src, sp.b, sp.e - sp.b, ids, offsets, ts);
  }
  if (offsets && !repaired.empty()) {
    for (auto& [b, e] : *offsets) {
      if (e > b) {
        const size_t nb = rstart[b], ne = rend[e - 1];
        b = nb;
        e = ne;
      } else {
        b = e = b < rstart.size() ? rstart[b] : text.size();
      }
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& t = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    DFLASH_CHECK(id >= 0 && id < t.n_ids && t.id_used[static_cast<size_t>(id)],
                 "decode: token id {} is outside the vocabulary of {} (size {})", id, t.source,
                 t.n_ids);
    if (skip_special && t.id_special[static_cast<size_t>(id)]) continue;
    bytes += t.id_bytes[static_cast<size_t>(id)];
  }
  if (utf8::find_invalid(bytes) == std::string::npos) return bytes;
  return utf8::make_valid(bytes);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const Impl& t = *impl_;
  DFLASH_CHECK(id >= 0 && id < t.n_ids && t.id_used[static_cast<size_t>(id)],
               "token id {} is outside the vocabulary of {} (size {})", id, t.source, t.n_ids);
  return t.id_str[static_cast<size_t>(id)];
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const Impl& t = *impl_;
  if (auto it = t.added_by_content.find(token); it != t.added_by_content.end()) return it->second;
  if (auto it = t.vocab.find(token); it != t.vocab.end()) return it->second;
  return std::nullopt;
}

int32_t Tokenizer::vocab_size() const {
  return impl_->n_ids;
}

bool Tokenizer::is_special(int32_t id) const {
  const Impl& t = *impl_;
  return id >= 0 && id < t.n_ids && t.id_special[static_cast<size_t>(id)];
}

}  // namespace dflash
