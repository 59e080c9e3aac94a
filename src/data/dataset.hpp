// dflash.cpp — tokenized training data: conversations -> (tokens, loss mask) per document, cached
// in one binary file that is memory-mapped on load.
//
// Invariants:
// - Token i of a document is supervised (mask 1) iff its byte range [b, e) of the rendered text
//   lies inside one supervised span of the chat template (see chat_template.hpp); a token that
//   straddles a span boundary is not supervised.
// - Documents longer than `max_length` tokens are truncated to their first `max_length` tokens
//   and counted; nothing is dropped silently. Documents left with no supervised token are left out
//   and counted; a dataset with none left is an error.
// - A cache file is reused only when its key (hash of the data file's bytes, hash of
//   tokenizer.json, template fingerprint, max length, cache format) equals the requested one;
//   otherwise it is rebuilt and the reason is logged. Files are written to a temporary name,
//   fsynced and renamed, so a cache is either complete or absent.
// - A cache file's name is a function of the data file, the model folder, the template and the max
//   length (cache_path_in), the same for `dflash data prepare` and `dflash train`: the two share
//   one cache, and runs with other settings sharing a folder never overwrite each other's file.
// Cache layout (little-endian): "DFTOKv1\0", u64 n = JSON header length, n bytes of JSON (key,
// stats, counts, section offsets relative to the data start), zero padding to a multiple of 64,
// then the 64-byte aligned sections: tokens i32[n_tokens], loss_mask u8[n_tokens],
// doc_offsets i64[n_docs + 1] (token offsets), source_lines i64[n_docs] (JSONL line numbers).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/chat_template.hpp"

namespace dflash {

/// Text -> token ids, filling per-token byte ranges [begin, end) of the text (the signature of
/// Tokenizer::encode; a std::function so that the data code can be tested with any tokenizer).
using EncodeFn = std::function<std::vector<int32_t>(
    std::string_view text, std::vector<std::pair<size_t, size_t>>* offsets)>;

/// One tokenized document.
struct TokenizedDoc {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;  ///< 0/1 per token
};

/// Per-token loss mask from token byte ranges and supervised spans (sorted, disjoint): 1 iff the
/// token's range lies inside a span (an empty range counts as inside when its position is).
std::vector<uint8_t> loss_mask_from_spans(const std::vector<std::pair<size_t, size_t>>& offsets,
                                          const std::vector<ByteSpan>& spans);

/// Tokenizes a rendered chat and builds its loss mask (loss_mask_from_spans).
TokenizedDoc tokenize_rendered(const RenderedChat& chat, const EncodeFn& encode);

/// 64-bit FNV-1a of bytes (continuing from `h`), and of a whole file's bytes.
uint64_t hash_bytes(std::string_view bytes, uint64_t h = 0xcbf29ce484222325ull);
uint64_t hash_file(const std::filesystem::path& path);

/// What a cache was built from. Equal keys mean the cached data is what a rebuild would give.
struct CacheKey {
  std::string data_file;        ///< the data path (informative; not compared)
  uint64_t data_hash = 0;       ///< hash_file of the data file (compressed bytes)
  uint64_t tokenizer_hash = 0;  ///< hash_file of tokenizer.json
  std::string template_fingerprint;
  int64_t max_length = 0;
  int format = 1;

  /// True when every compared field is equal (all but data_file).
  bool matches(const CacheKey& o) const;
  /// Names of the fields that differ ("data file contents, max length 2048 -> 4096"), "" if none.
  std::string diff(const CacheKey& requested) const;
  nlohmann::json to_json() const;
  static CacheKey from_json(const nlohmann::json& j);
};

/// Figures of a prepared dataset.
struct DatasetStats {
  int64_t records = 0;           ///< non-blank JSONL lines read
  int64_t conversations = 0;     ///< documents kept
  int64_t skipped_invalid = 0;   ///< bad records skipped (--skip-invalid)
  int64_t zero_supervised = 0;   ///< documents left out: no supervised token (after truncation)
  int64_t truncated = 0;         ///< documents longer than max_length, truncated
  int64_t truncated_tokens = 0;  ///< tokens cut off by truncation
  int64_t tokens = 0;            ///< tokens kept (all documents)
  int64_t supervised_tokens = 0;
  int64_t min_length = 0, max_length = 0;
  std::map<std::string, int64_t> invalid_by_kind;     ///< RecordErrorKind name -> count
  std::vector<std::string> invalid_examples;          ///< the first few error messages
  std::vector<std::string> zero_supervised_examples;  ///< "file:line (id)" of the first few
  std::vector<int64_t> hist_upper;                    ///< length histogram: bin k holds lengths in
  std::vector<int64_t> hist_count;  ///< (hist_upper[k-1], hist_upper[k]] (kept documents)

  nlohmann::json to_json() const;
  static DatasetStats from_json(const nlohmann::json& j);
  /// A multi-line human-readable report (counts, supervised share, histogram).
  std::string report() const;
};

/// Read-only tokenized documents, either memory-mapped from a cache file or held in memory.
/// Cheap to copy (shares the data). Thread-safe for reading.
class TokenDataset {
 public:
  TokenDataset() = default;
  /// Memory-maps a cache file; throws dflash::Error naming the file when it is not a complete,
  /// consistent cache of this format: every header value typed and in range, every section inside
  /// the file, document offsets increasing from 0 to the token count, token ids >= 0 and loss mask
  /// values 0 or 1 (all tokens are read once to check the last two).
  static TokenDataset open(const std::filesystem::path& path);
  /// An in-memory dataset of `docs` (for tests and small tools); the key's data_hash is a hash of
  /// the contents.
  static TokenDataset from_docs(const std::vector<TokenizedDoc>& docs);

  int64_t num_docs() const;
  int64_t num_tokens() const;
  int64_t doc_length(int64_t i) const;
  std::span<const int32_t> doc_tokens(int64_t i) const;
  std::span<const uint8_t> doc_loss_mask(int64_t i) const;
  /// JSONL line of document i (0 for in-memory datasets).
  int64_t doc_source_line(int64_t i) const;
  const DatasetStats& stats() const;
  const CacheKey& key() const;
  /// A hash identifying this dataset's contents (from the key), stored in data cursors.
  uint64_t fingerprint() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

/// Refuses a template whose special tokens the tokenizer lacks: throws dflash::Error naming the
/// template, `tokenizer` (the tokenizer's file, for the message) and every marker of
/// chat_template_markers(t) that `encode` does not map to exactly one token, with the number of
/// tokens it became instead.
void check_template_tokens(const ChatTemplate& t, const EncodeFn& encode,
                           const std::string& tokenizer);

/// Options of prepare_dataset().
struct PrepareOptions {
  std::filesystem::path data;   ///< .jsonl, .jsonl.xz or .jsonl.zst
  std::filesystem::path cache;  ///< cache file to reuse or (re)write
  ChatTemplate chat_template;
  int64_t max_length = 2048;  ///< tokens per document (longer ones are truncated)
  bool skip_invalid = false;  ///< count and skip bad records instead of stopping
  /// How the caller's user turns skip_invalid on ("pass --skip-invalid"), quoted in the error of
  /// a bad record ("...; to skip and count bad records, <hint>"); "" quotes nothing.
  std::string skip_invalid_hint;
  int threads = 0;              ///< tokenizer threads; 0 = all cores
  bool force = false;           ///< rebuild even when the cache matches
  EncodeFn encode;              ///< the target's tokenizer
  uint64_t tokenizer_hash = 0;  ///< hash_file of the tokenizer's tokenizer.json
  std::string tokenizer_file;   ///< the tokenizer's file, named in messages
};

/// Result of prepare_dataset().
struct PrepareResult {
  TokenDataset dataset;
  bool reused = false;
  std::string reason;  ///< why the cache was (re)built, or "" when reused
};

/// Returns the cached dataset for `opts` when the cache file's key matches, else reads the data
/// file, validates, renders, tokenizes (in parallel) and writes the cache, then maps it.
/// Errors: a template whose markers the tokenizer lacks (check_template_tokens); the first bad
/// record (file:line, field) unless skip_invalid; no document with a supervised token left; I/O
/// errors naming the file.
PrepareResult prepare_dataset(const PrepareOptions& opts);

/// The cache file of `data` tokenized for the model in `model_dir` with template `t` and
/// `max_length`, inside folder `dir`: `<data file name>-<16 hex digits>.dftok`, the digits a
/// 64-bit FNV-1a hash of the absolute data path, the absolute model folder, the template
/// fingerprint and the max length. `dflash data prepare` and `dflash train` name their caches with
/// it (through run_cache_path when a run config is given), so a prepared cache is the file training
/// reuses, and runs with other settings that share a folder get files of their own. A file whose
/// contents no longer match (the data or tokenizer changed) is rebuilt in place (CacheKey).
std::filesystem::path cache_path_in(const std::filesystem::path& dir,
                                    const std::filesystem::path& data,
                                    const std::filesystem::path& model_dir, const ChatTemplate& t,
                                    int64_t max_length);
/// cache_path_in in the user's cache folder: `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`,
/// else `$HOME/.cache/dflash`. Throws dflash::Error when none of the variables is set.
std::filesystem::path default_cache_path(const std::filesystem::path& data,
                                         const std::filesystem::path& model_dir,
                                         const ChatTemplate& t, int64_t max_length);
/// The token cache of a training run (the one cache key of `dflash train` and
/// `dflash data prepare --config`): cache_path_in of folder `cache_dir` (the run config's
/// `data.cache_dir`) when not empty, else of `<output_dir>/cache`.
std::filesystem::path run_cache_path(const std::string& cache_dir,
                                     const std::filesystem::path& output_dir,
                                     const std::filesystem::path& data,
                                     const std::filesystem::path& model_dir, const ChatTemplate& t,
                                     int64_t max_length);

/// The key stored in a cache file, or std::nullopt when the file is missing or not a cache.
std::optional<CacheKey> read_cache_key(const std::filesystem::path& path);

}  // namespace dflash
