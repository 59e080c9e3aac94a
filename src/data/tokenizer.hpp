// dflash.cpp — HF `tokenizer.json` BPE tokenizer with byte-level pre-tokenization
// (Qwen2/Qwen3, Llama 3, GPT-2 family).
//
// Pipeline (HF tokenizers semantics): added tokens are matched first on the raw text (longest
// first, honouring lstrip/rstrip/single_word/normalized); the remaining segments go through the
// normalizer (NFC, Sequence), the pre-tokenizer (Sequence of Split regexes via PCRE2-JIT and
// ByteLevel), then BPE merges by rank (ignore_merges honoured). decode() maps ids back through the
// ByteLevel decoder. Thread safety: a loaded Tokenizer is immutable; encode/decode may be called from
// many threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash {

/// What to do with invalid UTF-8 in encode() input.
enum class InvalidUtf8 { error, replace };

/// A loaded tokenizer. Construct with Tokenizer::load.
class Tokenizer {
 public:
  /// Loads `path` (a tokenizer.json file, or a folder holding one). Throws dflash::Error naming the
  /// file and the JSON key for anything unsupported or malformed.
  static Tokenizer load(const std::filesystem::path& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// Token ids of `text`. No BOS/EOS or template is added (callers render templates themselves).
  /// If `offsets` is given it receives, per token, the byte range [begin, end) of `text` the token
  /// came from (for byte-level BPE a multi-byte character split over tokens gives each of them the
  /// character's range). Invalid UTF-8: throws dflash::Error (mode error) naming the byte offset,
  /// or replaces each bad sequence with U+FFFD (mode replace).
  std::vector<int32_t> encode(std::string_view text,
                              std::vector<std::pair<size_t, size_t>>* offsets = nullptr,
                              InvalidUtf8 mode = InvalidUtf8::error) const;

  /// Text of `ids` (ByteLevel decoder; special tokens included verbatim unless
  /// `skip_special`). Bytes that do not form valid UTF-8 become U+FFFD. Throws dflash::Error on an
  /// id outside the vocabulary.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  /// The token string of `id` (as in the vocabulary, byte-level encoded), or throws.
  std::string id_to_token(int32_t id) const;
  /// The id of a vocabulary or added token string, if present.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  /// Vocabulary size including added tokens (max id + 1).
  int32_t vocab_size() const;
  /// True if `id` is an added token marked special.
  bool is_special(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash
