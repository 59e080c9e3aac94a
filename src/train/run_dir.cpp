#include "train/run_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>

#include "core/error.hpp"
#include "core/fs.hpp"

namespace dflash {

namespace fs = std::filesystem;

RunDir::RunDir(fs::path dir) : dir_(std::move(dir)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  DFLASH_CHECK(!ec, "cannot create run directory '{}': {}", dir_.string(), ec.message());
  const fs::path lock = dir_ / ".lock";
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  DFLASH_CHECK(lock_fd_ >= 0, "cannot open '{}': {}", lock.string(), std::strerror(errno));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {0};
    ssize_t n = ::pread(lock_fd_, buf, sizeof(buf) - 1, 0);
    ::close(lock_fd_);
    lock_fd_ = -1;
    std::string pid = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    fail("run directory '{}' is in use by process {} (lock {})", dir_.string(), pid,
         lock.string());
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, me.data(), me.size(), 0) < 0) {
    fail("cannot write the lock file '{}': {}", lock.string(), std::strerror(errno));
  }
}

RunDir::~RunDir() {
  if (lock_fd_ >= 0) {
    ::flock(lock_fd_, LOCK_UN);
    ::close(lock_fd_);
  }
}

void RunDir::append_metrics(const nlohmann::json& record) {
  std::ofstream f(metrics_path(), std::ios::app);
  f << record.dump() << "\n";
  f.flush();
  DFLASH_CHECK(f.good(), "cannot append to '{}'", metrics_path().string());
}

void RunDir::write_status(const nlohmann::json& status) {
  write_file_atomic(dir_ / "status.json", status.dump(2) + "\n");
}

std::string RunDir::checkpoint_name(int64_t step) { return "checkpoint-" + std::to_string(step); }

std::vector<std::pair<int64_t, fs::path>> RunDir::complete_checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("checkpoint-", 0) != 0) continue;
    const std::string num = name.substr(11);
    int64_t step = 0;
    const auto [end, err] = std::from_chars(num.data(), num.data() + num.size(), step);
    // Only checkpoint-<decimal step> names count (a step too large for int64 is no checkpoint).
    if (num.empty() || err != std::errc() || end != num.data() + num.size() || step < 0) continue;
    if (!fs::exists(e.path() / "COMPLETE")) continue;
    out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void run_dir_check_resumable(const fs::path& dir) {
  std::error_code ec;
  DFLASH_CHECK(fs::exists(dir, ec), "--resume {}: no such directory", dir.string());
  DFLASH_CHECK(fs::is_directory(dir, ec), "--resume {}: not a directory", dir.string());
  bool has_checkpoint = false;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    has_checkpoint |= e.is_directory() && e.path().filename().string().rfind("checkpoint-", 0) == 0;
  }
  DFLASH_CHECK(has_checkpoint || fs::exists(dir / "config.resolved.yaml", ec),
               "--resume {}: not a dflash run directory (it holds neither config.resolved.yaml nor "
               "a checkpoint-N folder); a run starts with `dflash train --config FILE`, into the "
               "config's output_dir",
               dir.string());
}

void RunDir::prune_checkpoints(int keep) {
  auto cps = complete_checkpoints(dir_);
  for (size_t i = 0; i + static_cast<size_t>(keep) < cps.size(); ++i) {
    fs::remove_all(cps[i].second);
  }
  for (const auto& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind(".tmp-checkpoint-", 0) == 0) fs::remove_all(e.path());
  }
}

nlohmann::json read_status(const fs::path& dir) {
  const fs::path p = dir / "status.json";
  DFLASH_CHECK(fs::exists(p), "'{}' has no status.json (not a run directory, or the run has not "
               "started)", dir.string());
  try {
    return nlohmann::json::parse(read_file_text(p));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", p.string(), e.what());
  }
}

}  // namespace dflash
