// dflash.cpp — command-line helpers (see cli_util.hpp).
#include "cli/cli_util.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <vector>

namespace dflash::cli {

CLI::Validator at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& s) -> std::string {
        int64_t v = 0;
        const char* end = s.data() + s.size();
        const auto [ptr, ec] = std::from_chars(s.data(), end, v);
        if (ec != std::errc() || ptr != end || v < min) {
          return fmt::format("must be an integer >= {}, got '{}'", min, s);
        }
        return std::string();
      },
      fmt::format("INT>={}", min));
}

size_t edit_distance(std::string_view a, std::string_view b) {
  // d[i][j]: distance between the first i characters of a and the first j of b.
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::optional<std::string> unknown_command_message(const CLI::App& app) {
  // The innermost command the user gave.
  const CLI::App* cur = &app;
  for (;;) {
    const auto given = cur->get_subcommands();
    if (given.empty()) break;
    cur = given.front();
  }
  const auto all = cur->get_subcommands([](const CLI::App*) { return true; });
  if (all.empty()) return std::nullopt;
  const std::vector<std::string> rest = cur->remaining();
  if (rest.empty() || rest.front().empty() || rest.front().front() == '-') return std::nullopt;
  const std::string& word = rest.front();
  std::vector<std::string> names;
  std::string best;
  size_t best_d = word.size() <= 3 ? 2 : 3;  // suggest only within distance 1 or 2
  for (const CLI::App* sub : all) {
    names.push_back(sub->get_name());
    const size_t dist = edit_distance(word, sub->get_name());
    if (dist < best_d) {
      best_d = dist;
      best = sub->get_name();
    }
  }
  const std::string where = cur == &app ? std::string("dflash") : "dflash " + cur->get_name();
  return fmt::format("unknown command '{}'{}; the commands of {} are: {}", word,
                     best.empty() ? std::string() : fmt::format(" (did you mean '{}'?)", best),
                     where, fmt::join(names, ", "));
}

}  // namespace dflash::cli
