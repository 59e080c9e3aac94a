// dflash.cpp — helpers of the `dflash` command line (internal to src/cli): integer flags checked
// with short messages, and the message for a command word that names no command.
//
// Invariant: a flag or command word the user got wrong is answered with its own name and the
// accepted values, never with CLI11's generic text (a 300-digit range, "A subcommand is required").
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dflash::cli {

/// A CLI11 validator accepting an integer >= `min`: "--max-new-tokens: must be an integer >= 1,
/// got 0". (CLI::PositiveNumber prints its bounds as doubles, a 300-digit range.)
CLI::Validator at_least(int64_t min);

/// Optimal string alignment distance between two words: insertions, deletions, substitutions and
/// swaps of adjacent characters each count 1 ("trian" -> "train" is 1).
size_t edit_distance(std::string_view a, std::string_view b);

/// After a parse error of `app`: when the innermost command given (`dflash`, `dflash data`) has
/// subcommands and the parse stopped at a word naming none of them, the message
/// "unknown command 'trian' (did you mean 'train'?); the commands of dflash are: ..." — the
/// suggestion when a command is within edit distance 2 (1 for words of up to 3 letters).
/// std::nullopt otherwise.
std::optional<std::string> unknown_command_message(const CLI::App& app);

}  // namespace dflash::cli
