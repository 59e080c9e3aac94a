// dflash.cpp — `dflash train`: the training loop of a DFlash drafter against a frozen target.
//
// One step: the next batch of packed rows → its DrafterBatch (anchors sampled per document, seed,
// epoch, batch, row; model/drafter_batch.hpp) → the backend's target stage (features) → its
// drafter stage: forward/backward of the whole step, gradient norm, non-finite skip, clip, AdamW
// (train/train_backend.hpp) → metrics. train() is setup (target, drafter config, backend, data,
// state), the step loop, checkpoint I/O (train/checkpoint.hpp) and reporting (log, metrics,
// status; train/train_report.hpp); it never names a backend. Checkpoints hold the export format
// plus the trainer state (master weights, AdamW moments, step, data cursor, metric accumulators,
// config), so that a resumed run on the CPU backend continues bit-identically.
//
// Invariants: anchors are a pure function of (seed, epoch, batch index, row), so no RNG state needs
// saving; a checkpoint is written to a temporary folder, fsynced, renamed and only then marked
// COMPLETE; any error stops the run with a message and a non-zero exit; SIGINT/SIGTERM finish the
// current step, write a checkpoint and exit 0; a resume continues from the newest checkpoint whose
// files match its marker (checkpoint_select), sets newer ones that do not aside and says why.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/drafter.hpp"
#include "train/run_config.hpp"

namespace dflash {

class Tokenizer;
class Job;

/// How `dflash train` was asked to start.
struct TrainOptions {
  RunConfig config;          ///< resolved configuration (fresh run), see resume
  std::string resume_dir;    ///< non-empty: continue the run in this directory
  bool force = false;        ///< resume even when model/data-changing keys differ
  int64_t halt_at_step = 0;  ///< test hook: behave as if signalled after this step (0 = off)
  /// The MPI job this process is a rank of (train/job.hpp; null: a one-process run). Rank 0 owns
  /// the run directory; rank k > 0 keeps only its own log in <output_dir>/rank<k>/.
  std::shared_ptr<Job> job;
};

/// Summary of a finished (or interrupted) run.
struct TrainResult {
  int64_t steps_done = 0;           ///< optimizer steps completed in total (including resumed ones)
  int64_t skipped_steps = 0;        ///< non-finite steps skipped
  bool interrupted = false;         ///< stopped by a signal (or halt_at_step) after a checkpoint
  std::string last_checkpoint;      ///< path of the newest complete checkpoint
  /// The last metrics.jsonl record (train_report.hpp: interval_record), of this process or, after
  /// a resume, the newest one kept; null when no log interval has completed. It has no loss or τ
  /// when every step of its interval was skipped.
  nlohmann::json last_metrics;
};

/// Runs training as configured. Throws dflash::Error on any failure (after recording it in
/// status.json when the run directory is already open).
TrainResult train(const TrainOptions& opts);

/// The drafter of a run: `cfg`'s model section over `target` (DESIGN.md §1 defaults for what it
/// leaves out; drafter_config_for_target). `tok` (may be null) lets the mask id be checked against
/// the tokenizer. Throws dflash::Error naming the key for an inconsistent model section.
DrafterConfig drafter_config_for_run(const RunConfig& cfg, const ModelConfig& target,
                                     const Tokenizer* tok);

/// `dflash train --plan`: prints the device memory plan of `cfg`'s training step on the cuda
/// backend, the arena of each pipeline worker and each GPU's total (plan_pipeline_memory; reading
/// only the target's config.json and tokenizer, no weights). Returns "" when every GPU fits
/// runtime.device_memory_gib, else the message naming each GPU's shortfall and the largest token
/// budget that fits; first, what the CUDA kernels cannot run (cuda_unsupported_message), if any.
std::string print_train_memory_plan(const RunConfig& cfg);

/// Installs SIGINT/SIGTERM handlers that ask a running train() to checkpoint and stop.
void install_train_signal_handlers();

}  // namespace dflash
