// dflash.cpp — line reader for JSONL corpora: plain text, xz (liblzma) or zstd (libzstd).
//
// Invariants: the compression is detected from the file's magic bytes (xz: FD 37 7A 58 5A 00,
// zstd: 28 B5 2F FD), never guessed from the name; concatenated xz/zstd streams are read whole.
// Lines are returned without their '\n' (and without a '\r' before it); line numbers are 1-based
// and count every line of the decompressed text, blank ones included, so that error messages can
// name `file:line`. A truncated or corrupt compressed stream is an error, never a silent EOF.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace dflash {

/// Sequential reader of the lines of a (possibly compressed) text file. Not thread-safe.
class LineReader {
 public:
  /// Opens `path`; throws dflash::Error naming the file when it cannot be opened.
  explicit LineReader(const std::filesystem::path& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  /// Reads the next line into `line` (without the line terminator). Returns false at the end of
  /// the file. Throws dflash::Error naming the file on a read or decompression error.
  bool next(std::string& line);
  /// 1-based number of the line last returned by next() (0 before the first call).
  int64_t line_number() const { return line_no_; }
  /// The file being read.
  const std::filesystem::path& path() const { return path_; }
  /// "plain", "xz" or "zstd".
  const char* compression() const;

  struct Source;  ///< A decompressing byte source (implementation detail).

 private:
  bool fill();  // reads more decompressed bytes into buf_; false at the end
  std::filesystem::path path_;
  std::unique_ptr<Source> src_;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
  int64_t line_no_ = 0;
};

}  // namespace dflash
