// dflash.cpp — file-system helpers: atomic file writes, fsync of folders, whole-file reads.
//
// Invariant: a file written with write_file_atomic is either the old version or the complete new
// one, never a torn mix (temporary file in the same folder, fsync, rename, fsync of the folder).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace dflash {

/// Replaces `path` atomically with `bytes`. Throws dflash::Error naming the path on any failure.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

/// fsyncs a file or folder (so that a rename or new entry is durable). Throws on failure.
void fsync_path(const std::filesystem::path& path);

/// Checks, before any work that would end in writing `path` with write_file_atomic, that it can be
/// written: `path` is not a folder and a temporary file can be created (then removed) in its
/// folder. Throws dflash::Error naming `what` (the flag or key, "--output") and the path, with the
/// system's reason.
void check_file_writable(const std::filesystem::path& path, std::string_view what);

/// Reads a whole file; throws dflash::Error naming the path when it cannot be read.
std::string read_file_text(const std::filesystem::path& path);

}  // namespace dflash
