// dflash.cpp — what a training run reports: log.txt, metrics.jsonl (one record per log interval),
// status.json (what `dflash status` reads), and the interval accumulators behind them.
//
// Invariants: every line of log.txt is also logged through spdlog and flushed at once; status.json
// is rewritten atomically from one TrainStatus, whose unknown fields are left out (never written
// as 0); a metrics record covers the steps since the previous record (the accumulator is saved in
// checkpoints, so an interval cut by a resume continues where it stopped); skipped steps add to
// the step, token and time counters and to the skip count of their reason, but not to the loss,
// accuracy, τ or gradient-norm sums, and a record without an applied step carries no loss,
// accuracy, τ or gradient norm (never 0); metrics.jsonl holds one record per step at most, in
// increasing step order, none past the step the run continues from (metrics_resume_at,
// metrics_restart).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "data/dataset.hpp"
#include "model/objective.hpp"
#include "train/run_dir.hpp"
#include "train/train_backend.hpp"

namespace dflash {

/// Host seconds of one step's stages as the trainer measured them.
struct StepTimes {
  double data = 0;     ///< next batch and its DrafterBatch (anchors, targets)
  double target = 0;   ///< target stage (its device time when the backend measured it)
  double drafter = 0;  ///< drafter stage: step, update and result
  double total = 0;    ///< the whole step, checkpoint state excluded
  double checkpoint = 0;  ///< handing the drafter state out for a checkpoint (device → host)
};

/// Accumulated figures of one log interval (saved in checkpoints as JSON).
struct IntervalMetrics {
  ObjectiveMetrics obj;                ///< merged over the interval's applied (not skipped) steps
  double grad_norm_sum = 0;            ///< Σ gradient norm over the applied steps
  int64_t steps = 0;                   ///< steps of the interval, skipped ones included
  int64_t skipped_non_finite = 0;      ///< of which skipped: loss or gradient norm not finite
  int64_t skipped_no_supervised = 0;   ///< of which skipped: no supervised block slot
  int64_t tokens = 0, supervised = 0;  ///< context tokens and loss-mask tokens
  double t_data = 0, t_target = 0, t_drafter = 0, t_total = 0;  ///< Σ StepTimes
  double t_gpu_drafter = 0;    ///< Σ device time of the drafter step (0: never measured)
  double t_gpu_optimizer = 0;  ///< Σ device time of the optimizer update (0: never measured)
  double t_host_wait = 0;      ///< Σ host time blocked on the device (0: never measured)
  double t_checkpoint = 0;     ///< Σ StepTimes::checkpoint (0: no checkpoint in the interval)

  explicit IntervalMetrics(int K = 0) : obj(K) {}
  /// Steps of the interval whose update was applied.
  int64_t applied() const { return steps - skipped_non_finite - skipped_no_supervised; }
  /// Adds one step: its result (merged into obj and grad_norm_sum unless skipped, else counted
  /// by its reason), its batch's token counts and its times.
  void add_step(const DrafterStepResult& r, int64_t step_tokens, int64_t step_supervised,
                const StepTimes& t);
  nlohmann::json to_json() const;
  /// Reads back to_json(). `src` names the file in errors; K must be `block_size` (the run's)
  /// and the per-slot counts have K entries each, correct <= count. Throws dflash::Error naming
  /// `src` and the missing, mistyped or out-of-range key.
  static IntervalMetrics from_json(const nlohmann::json& j, const std::string& src, int block_size);
};

/// The metrics.jsonl record of a finished interval: step, epoch, lr; over the applied steps (left
/// out when the interval has none): loss, accuracy, per-slot accuracy (slots 1..K−1; null for a
/// slot never supervised), τ, mean gradient norm; the interval's steps, its skipped steps and
/// (when any) their count per reason ("non_finite", "no_supervised_slot"), skipped steps of the
/// run so far; tokens/s, supervised tokens/s, seconds per step (total, data, target, drafter, and
/// when the backend measured them: the drafter's and the optimizer's device time, s_device =
/// target + drafter + optimizer device time, and s_host_wait, the host's time blocked on the
/// device), resident memory.
nlohmann::json interval_record(const IntervalMetrics& iv, int64_t step, int64_t epoch, double lr,
                               int64_t skipped_total);

/// One line about a metrics record for summaries: "loss L, simulated τ T (interval ending at step
/// S)", followed by "; skipped K of N steps (reasons)" when the interval skipped any, or, when it
/// skipped all of them, "no loss or τ: all steps of the interval ending at step S were skipped
/// (reasons)". Throws nlohmann::json errors on a record without a step, or without the interval
/// fields its loss or skip count calls for.
std::string record_summary(const nlohmann::json& record);

/// The training data's counts that status.json reports under "data" (DatasetStats of the token
/// cache): records read, conversations kept, their tokens and supervised tokens, invalid records
/// skipped (data.skip_invalid) in total and by kind, documents truncated to data.max_length and
/// the tokens cut, documents left out for want of a supervised token.
nlohmann::json data_counts_json(const DatasetStats& st);
/// The same counts as one log line ("data: ..."); `max_length` is the truncation length.
std::string data_counts_line(const DatasetStats& st, int64_t max_length);

/// What status.json holds; fields that are not known are left out of the file.
struct TrainStatus {
  std::string phase;            ///< loading, tokenizing, training, checkpointing, done, ...
  std::optional<int64_t> step;  ///< optimizer steps done
  std::optional<int64_t> total_steps;
  std::optional<double> eta_s;
  nlohmann::json last;             ///< the last metrics record (null: none yet)
  nlohmann::json data;             ///< training data counts, data_counts_json (null: not read yet)
  std::string checkpoint;          ///< the newest complete checkpoint ("" none)
  std::string error;               ///< failure message ("" none)
  std::string topology;            ///< the pipeline's workers (PipelineTopology::describe)
  /// One entry per pipeline worker: name, stage, device, phase, phase_s, step, busy, and when
  /// known tokens_per_s, queue_depth/queue_capacity, memory_used_bytes/memory_total_bytes (null:
  /// not running yet).
  nlohmann::json workers;
  nlohmann::json to_json() const;  ///< adds "pid"
};

/// The reporting side of one run: log.txt, metrics.jsonl and status.json of a RunDir.
class TrainReport {
 public:
  /// Opens `rd`'s log.txt for appending and writes status {phase: "loading"}. `rd` must outlive
  /// the report.
  explicit TrainReport(RunDir& rd);
  /// Logs `msg` (spdlog info) and appends it to log.txt.
  void log(const std::string& msg);
  /// Appends "error: msg" to log.txt only (the CLI prints the error itself).
  void log_error(const std::string& msg);
  /// The status; change it, then write_status().
  TrainStatus& status() { return status_; }
  /// Rewrites status.json from status().
  void write_status();
  /// A finished interval: appends `record` to metrics.jsonl, logs its line (loss, accuracy, τ,
  /// lr, grad norm, tokens/s; skipped steps with their reasons) and sets the status to training at
  /// record["step"] of `total_steps` with `eta_s`.
  void interval(const nlohmann::json& record, int64_t total_steps, double eta_s);
  /// A fresh run: removes the metrics.jsonl of an earlier attempt in this directory (one that
  /// stopped before its first checkpoint), logging how many records it held.
  void metrics_restart();
  /// A run continuing after `step`: rewrites metrics.jsonl atomically with the records of steps
  /// ≤ `step` only, keeping the newest attempt's record where an earlier attempt logged the same
  /// steps, and drops a torn last line (an append cut by a kill); logs what it dropped. Sets
  /// status().last to the last record kept and returns it (null when none). Throws
  /// dflash::Error naming the file and line of any other line that is not a record with a step.
  nlohmann::json metrics_resume_at(int64_t step);

 private:
  RunDir& rd_;
  std::ofstream log_;
  TrainStatus status_;
};

/// Resident set size of this process in bytes (Linux /proc/self/statm); 0 when unreadable.
int64_t rss_bytes();

}  // namespace dflash
