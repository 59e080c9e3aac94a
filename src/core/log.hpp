// dflash.cpp — logging and progress.
//
// Logging goes through spdlog's default logger (stderr, "[time] [level] message"); `log_init` sets
// the level once at start-up, before worker threads exist. A ProgressBar draws one updating line on a
// terminal. On a non-terminal (CI logs, files) it prints a plain line at most every
// ProgressOptions::plain_every_s and only when work was done since its last line, so a stalled
// operation adds nothing to a log file: the lines a bar prints are bounded by the work done.
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dflash {

/// Configures the default logger: level by name ("trace", "debug", "info", "warn", "error",
/// "off"); throws dflash::Error on an unknown name. Call once from the main thread.
void log_init(const std::string& level = "info");

/// Where a ProgressBar draws and what it prints when that stream is not a terminal.
struct ProgressOptions {
  std::FILE* out = stderr;  ///< the stream drawn on (a terminal: one updating line)
  /// Non-terminal: seconds at least between two plain lines; a line is printed only when work was
  /// done since the previous one (a stalled operation prints nothing).
  double plain_every_s = 10.0;
  /// Non-terminal: false prints only the final line (for callers that log their own progress,
  /// e.g. the trainer's line per log interval).
  bool plain_lines = true;
};

/// Progress of a long operation with a known (or unknown: total = 0) amount of work.
/// Not thread-safe: one owner updates it.
class ProgressBar {
 public:
  /// `label` prefixes the line, `total` is the amount of work in `unit`s (0 = unknown).
  ProgressBar(std::string label, int64_t total, std::string unit = "",
              ProgressOptions opts = ProgressOptions{});
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  /// Adds `n` units of work done; redraws at most ~10 times a second on a terminal, and on a
  /// non-terminal at most every plain_every_s when work was done since the last line.
  void advance(int64_t n = 1);
  /// Sets a free-text suffix shown after the counters (e.g. "loss 2.31 τ 3.4").
  void set_suffix(std::string s) { suffix_ = std::move(s); }
  /// Draws the final state and ends the line. Called by the destructor if not called before.
  void finish();

 private:
  void draw(bool final);
  std::string label_, unit_, suffix_;
  ProgressOptions opts_;
  int64_t total_, done_ = 0, drawn_done_ = 0;
  bool tty_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

/// "1.2 s", "3 min 4 s", "2 h 5 min".
std::string format_duration(double seconds);

/// An integer with thousands separators: 12588672 -> "12,588,672", -1234 -> "-1,234".
std::string format_thousands(int64_t n);

}  // namespace dflash
