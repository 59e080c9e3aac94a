// `dflash status RUN_DIR`: is the run alive, where is it, how fast — from status.json and the lock,
// without reading logs.
#include <signal.h>
#include <sys/file.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
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

void run_status(const std::string& dir) {
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
}

}  // namespace

void add_status_command(CLI::App& app) {
  auto* sub = app.add_subcommand("status", "Show whether a training run is alive and how fast");
  auto dir = std::make_shared<std::string>();
  sub->add_option("run_dir", *dir, "The run directory (output_dir of the run)")->required();
  sub->callback([dir] { run_status(*dir); });
}

}  // namespace dflash::cli
