#include "core/log.hpp"

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <unistd.h>

#include <cstdio>

#include "core/error.hpp"

namespace dflash {

void log_init(const std::string& level) {
  auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    fail("unknown log level '{}' (expected trace, debug, info, warn, error or off)", level);
  }
  auto logger = spdlog::stderr_color_mt("dflash");
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  logger->set_level(lvl);
  spdlog::set_default_logger(logger);
}

std::string format_duration(double s) {
  if (s < 0) s = 0;
  if (s < 60) return fmt::format("{:.1f} s", s);
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t < 3600) return fmt::format("{} min {} s", t / 60, t % 60);
  return fmt::format("{} h {} min", t / 3600, (t % 3600) / 60);
}

ProgressBar::ProgressBar(std::string label, int64_t total, std::string unit, ProgressOptions opts)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      opts_(opts),
      total_(total),
      tty_(isatty(fileno(opts.out)) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

ProgressBar::~ProgressBar() {
  if (!finished_) finish();
}

void ProgressBar::advance(int64_t n) {
  done_ += n;
  auto now = std::chrono::steady_clock::now();
  double since = std::chrono::duration<double>(now - last_draw_).count();
  if (tty_) {
    if (since >= 0.1) draw(false);
  } else if (opts_.plain_lines && done_ != drawn_done_ && since >= opts_.plain_every_s) {
    draw(false);
  }
}

void ProgressBar::finish() {
  if (finished_) return;
  draw(true);
  finished_ = true;
}

void ProgressBar::draw(bool final) {
  last_draw_ = std::chrono::steady_clock::now();
  drawn_done_ = done_;
  double el = std::chrono::duration<double>(last_draw_ - start_).count();
  double rate = el > 0 ? static_cast<double>(done_) / el : 0.0;
  std::string line;
  if (total_ > 0) {
    double frac = std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_));
    int filled = static_cast<int>(frac * 24);
    std::string bar(filled, '#');
    bar.resize(24, '.');
    std::string eta = (rate > 0 && done_ < total_)
                          ? format_duration(static_cast<double>(total_ - done_) / rate)
                          : std::string("-");
    line = fmt::format("{} [{}] {}/{}{}{} {:.1f}/s, {} elapsed, ETA {}", label_, bar, done_, total_,
                       unit_.empty() ? "" : " ", unit_, rate, format_duration(el), eta);
  } else {
    line = fmt::format("{} {}{}{} {:.1f}/s, {} elapsed", label_, done_, unit_.empty() ? "" : " ",
                       unit_, rate, format_duration(el));
  }
  if (!suffix_.empty()) line += "  " + suffix_;
  if (tty_) {
    std::fprintf(opts_.out, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(opts_.out, "%s\n", line.c_str());
  }
  std::fflush(opts_.out);
}

std::string format_thousands(int64_t n) {
  // Work on the magnitude as unsigned so INT64_MIN is fine.
  uint64_t m = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  std::string digits = std::to_string(m), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace dflash
