// dflash.cpp — the run directory of `dflash train`: lock, resolved config, log, metrics, status,
// checkpoints.
//
// Layout:  <dir>/.lock  config.resolved.yaml  log.txt  metrics.jsonl  status.json
//          <dir>/checkpoint-<STEP>/{config.json, model.safetensors, trainer_state/..., COMPLETE}
//          <dir>/rejected-checkpoint-<STEP>/   set aside by a resume (failed verification)
// Invariants: while a RunDir object lives, it holds an exclusive flock on <dir>/.lock (another
// process opening the same directory fails at once, naming the holder's pid); status.json is
// rewritten atomically; only checkpoint folders holding COMPLETE count.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace dflash {

/// An open, locked run directory.
class RunDir {
 public:
  /// Creates `dir` if needed and locks it. Throws dflash::Error "run directory X is in use by
  /// process PID" when another process holds the lock.
  explicit RunDir(std::filesystem::path dir);
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  const std::filesystem::path& path() const { return dir_; }
  /// <dir>/metrics.jsonl.
  std::filesystem::path metrics_path() const { return dir_ / "metrics.jsonl"; }
  /// Appends one JSON object as a line to metrics.jsonl (flushed).
  void append_metrics(const nlohmann::json& record);
  /// Rewrites status.json atomically.
  void write_status(const nlohmann::json& status);

  /// Folder name of the checkpoint of `step`: "checkpoint-<step>".
  static std::string checkpoint_name(int64_t step);
  /// Complete checkpoints (those holding COMPLETE), sorted by step ascending.
  static std::vector<std::pair<int64_t, std::filesystem::path>> complete_checkpoints(
      const std::filesystem::path& dir);
  /// Deletes complete checkpoints beyond the newest `keep`, and stale temporary folders.
  void prune_checkpoints(int keep);

 private:
  std::filesystem::path dir_;
  int lock_fd_ = -1;
};

/// Checks that `dir` can be named by `dflash train --resume`: it exists, is a folder, and is a run
/// directory (it holds config.resolved.yaml or a checkpoint-N folder). Throws dflash::Error saying
/// which of these fails, so that a wrong path is not reported as a missing config file.
void run_dir_check_resumable(const std::filesystem::path& dir);

/// Reads status.json of a run directory (for `dflash status`); throws naming the file.
nlohmann::json read_status(const std::filesystem::path& dir);

}  // namespace dflash
