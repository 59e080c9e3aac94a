// `dflash status RUN_DIR [--watch]`: is the run alive, where is it, how fast, and one row per
// pipeline worker — from status.json and the lock, without reading logs. `--watch` redraws a
// terminal; to a non-terminal it appends a snapshot only when the run or a worker moved on.
#include <signal.h>
#include <sys/file.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <fmt/format.h>

#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/log.hpp"
#include "train/run_dir.hpp"
#include "train/train_report.hpp"

namespace dflash::cli {

namespace {

// PID written in the lock file and whether that process still holds the lock.
std::pair<std::string, bool> lock_holder(const std::filesystem::path& dir) {
  const auto lock = dir / ".lock";
  if (!std::filesystem::exists(lock)) return {"", false};
  std::string pid = read_file_text(lock);
  while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
  int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {pid, false};
  bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0;  // cannot share it: someone holds it exclusively
  ::close(fd);
  return {pid, held};
}

// "30.1/139.8 GiB", or "-" when not measured.
std::string memory_cell(const nlohmann::json& w) {
  if (!w.contains("memory_used_bytes")) return "-";
  const double gib = 1024.0 * 1024.0 * 1024.0;
  return fmt::format("{:.1f}/{:.1f} GiB", w["memory_used_bytes"].get<double>() / gib,
                     w["memory_total_bytes"].get<double>() / gib);
}

// One row per pipeline worker: phase (and for how long), step, tokens/s, input queue, busy
// fraction since the start, device memory. Figures that were not measured print as "-".
void print_workers(const nlohmann::json& workers) {
  fmt::print("{:<9} {:<7} {:<40} {:>6} {:>9} {:>6} {:>5}  {}\n", "worker", "device", "phase",
             "step", "tokens/s", "queue", "busy", "memory");
  for (const auto& w : workers) {
    const std::string phase =
        fmt::format("{} ({})", w.value("phase", "?"), format_duration(w.value("phase_s", 0.0)));
    const std::string tps =
        w.contains("tokens_per_s") ? fmt::format("{:.0f}", w["tokens_per_s"].get<double>()) : "-";
    const std::string queue =
        w.contains("queue_depth")
            ? fmt::format("{}/{}", w["queue_depth"].get<int>(), w["queue_capacity"].get<int>())
            : "-";
    fmt::print("{:<9} {:<7} {:<40} {:>6} {:>9} {:>6} {:>4.0f}%  {}\n", w.value("name", "?"),
               w.value("device", "?"), phase, w.value("step", int64_t{0}), tps, queue,
               100.0 * w.value("busy", 0.0), memory_cell(w));
  }
}

// Prints the status once; returns whether the run is still running.
bool run_status(const std::string& dir) {
  nlohmann::json st = read_status(dir);
  auto [pid, held] = lock_holder(dir);
  const auto mtime = std::filesystem::last_write_time(std::filesystem::path(dir) / "status.json");
  const double age = std::chrono::duration<double>(std::filesystem::file_time_type::clock::now() -
                                                   mtime).count();
  const std::string phase = st.value("phase", "?");
  std::string state;
  if (held) state = fmt::format("running (pid {}), status updated {} ago", pid, format_duration(age));
  else if (phase == "done") state = "finished";
  else state = fmt::format("not running (last status {} ago, phase '{}')", format_duration(age), phase);
  fmt::print("run       {}\n", dir);
  fmt::print("state     {}\n", state);
  fmt::print("phase     {}\n", phase);
  if (st.contains("step")) {
    const std::string total =
        st.contains("total_steps") ? fmt::format("/{}", st["total_steps"].get<int64_t>()) : "";
    fmt::print("step      {}{}\n", st["step"].get<int64_t>(), total);
  }
  if (st.contains("eta_s")) fmt::print("ETA       {}\n", format_duration(st["eta_s"].get<double>()));
  if (st.contains("last")) {
    const auto& m = st["last"];
    fmt::print("last      {}\n", record_summary(m));
    if (m.contains("tokens_per_s")) {
      fmt::print("tokens/s  {:.0f}\n", m["tokens_per_s"].get<double>());
    }
  }
  if (st.contains("data")) {
    const auto& d = st["data"];
    fmt::print("data      {} conversations; {} invalid records skipped, {} truncated, {} without "
               "a supervised token\n",
               d.at("conversations").get<int64_t>(), d.at("skipped_invalid").get<int64_t>(),
               d.at("truncated").get<int64_t>(), d.at("zero_supervised").get<int64_t>());
  }
  if (st.contains("checkpoint")) fmt::print("checkpoint {}\n", st["checkpoint"].get<std::string>());
  if (st.contains("error")) fmt::print("error     {}\n", st["error"].get<std::string>());
  if (st.contains("topology")) fmt::print("topology  {}\n", st["topology"].get<std::string>());
  if (st.contains("workers")) {
    fmt::print("\n");
    print_workers(st["workers"]);
  }
  return held;
}

// What a non-terminal --watch prints a new snapshot for: the run's phase and step, whether it is
// alive, and each worker's phase and step (not the seconds in a phase, which grow while stalled).
std::string watch_key(const std::string& dir) {
  const nlohmann::json st = read_status(dir);
  std::string key = fmt::format("{} {} {}", st.value("phase", "?"), st.value("step", int64_t{0}),
                                lock_holder(dir).second);
  if (st.contains("workers")) {
    for (const auto& w : st["workers"]) {
      key += fmt::format(" {}:{}", w.value("phase", "?"), w.value("step", int64_t{0}));
    }
  }
  return key;
}

// Refreshes every `every_s` until the run ends. On a terminal the screen is redrawn; to a
// non-terminal (a log file) a snapshot is appended only when watch_key changed, so a stalled run
// adds nothing.
void watch_status(const std::string& dir, double every_s) {
  DFLASH_CHECK(every_s > 0, "--every must be > 0 seconds, got {}", every_s);
  const bool tty = isatty(fileno(stdout)) != 0;
  std::string last_key;
  for (;;) {
    bool running = true;
    const std::string key = tty ? std::string() : watch_key(dir);
    if (tty || key != last_key) {
      if (tty) fmt::print("\033[H\033[2J");  // home, clear screen
      else if (!last_key.empty()) fmt::print("\n");
      running = run_status(dir);
      std::fflush(stdout);
      last_key = key;
    } else {
      running = lock_holder(dir).second;
    }
    if (!running) return;
    std::this_thread::sleep_for(std::chrono::duration<double>(every_s));
  }
}

}  // namespace

void add_status_command(CLI::App& app) {
  auto* sub = app.add_subcommand("status", "Show whether a training run is alive and how fast");
  auto dir = std::make_shared<std::string>();
  auto watch = std::make_shared<bool>(false);
  auto every = std::make_shared<double>(2.0);
  sub->add_option("run_dir", *dir, "The run directory (output_dir of the run)")->required();
  sub->add_flag("--watch", *watch, "Refresh until the run ends (Ctrl-C to leave)");
  sub->add_option("--every", *every, "Seconds between refreshes with --watch (default 2)");
  sub->callback([dir, watch, every] {
    if (*watch) {
      watch_status(*dir, *every);
    } else {
      run_status(*dir);
    }
  });
}

}  // namespace dflash::cli
