// dflash.cpp — errors.
//
// Invariant: every failure the user can cause (bad file, bad key, bad shape, bad flag) is reported by
// throwing dflash::Error with a message that names the file, line, key or tensor involved. The CLI
// catches it at the top, prints "dflash: error: <message>" and exits non-zero. Errors are never
// swallowed and never turned into silent fallbacks.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dflash {

/// The one exception type of the project. `what()` is the full, user-facing message.
/// Context can be prepended while the error propagates (`with_context("file X")` gives
/// "file X: <message>").
class Error : public std::runtime_error {
 public:
  /// `internal`: the error reports a broken internal invariant (DFLASH_ASSERT), a bug, not a bad
  /// input.
  explicit Error(const std::string& msg, bool internal = false)
      : std::runtime_error(msg), internal_(internal) {}
  /// Returns a new error whose message is "<ctx>: <this message>" (internal() is kept).
  [[nodiscard]] Error with_context(const std::string& ctx) const {
    return Error(ctx + ": " + what(), internal_);
  }
  /// True when thrown by DFLASH_ASSERT (the fuzz harnesses count it as a finding).
  bool internal() const { return internal_; }

 private:
  bool internal_ = false;
};

/// Throws dflash::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace dflash

/// Checks a user-facing condition; on failure throws dflash::Error with the formatted message.
#define DFLASH_CHECK(cond, ...)                 \
  do {                                          \
    if (!(cond)) ::dflash::fail(__VA_ARGS__);   \
  } while (0)

/// Checks an internal invariant (a bug if it fails); the message carries file and line.
#define DFLASH_ASSERT(cond)                                                               \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw ::dflash::Error(fmt::format("internal error at {}:{}: assertion '{}' failed", \
                                        __FILE__, __LINE__, #cond),                       \
                            /*internal=*/true);                                           \
  } while (0)
