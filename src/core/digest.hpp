// dflash.cpp — content digests of files (XXH3-64 from libxxhash), so that files written by one
// process can be checked by another (checkpoint markers).
//
// Invariant: a digest covers exactly the bytes read in one pass over the file; its size is the
// number of bytes hashed, not a separate stat, so size and hash always describe the same bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace dflash {

/// Size and XXH3 64-bit hash (seed 0; xxHash specification, XXH3_64bits) of a file's bytes.
struct FileDigest {
  int64_t bytes = 0;  ///< number of bytes hashed
  uint64_t xxh3 = 0;  ///< XXH3_64bits of those bytes
  bool operator==(const FileDigest&) const = default;
};

/// Reads `path` once, in chunks, and returns its size and hash. Throws dflash::Error naming the
/// path when it cannot be opened or read.
FileDigest file_digest(const std::filesystem::path& path);

/// A hash as 16 lowercase hex digits ("00ab..."), and back. digest_hex_parse throws dflash::Error
/// quoting `text` when it is not exactly 16 hex digits.
std::string digest_hex(uint64_t h);
uint64_t digest_hex_parse(std::string_view text);

}  // namespace dflash
