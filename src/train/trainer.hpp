// dflash.cpp — `dflash train`: the training loop of a DFlash drafter against a frozen target.
//
// One step: the next batch of packed rows → target features of every row (forward_taps) →
// anchors sampled per document (seed, epoch, batch, row) → drafter forward/backward over every row
// (gradients summed, scaled by 1/Σw of the whole step) → global grad norm, non-finite check, clip →
// AdamW on fp32 master weights → metrics. Checkpoints hold the export format plus the trainer state
// (master weights, AdamW moments, step, data cursor, metric accumulators, config), so that a resumed
// run on the CPU backend continues bit-identically.
//
// Invariants: anchors are a pure function of (seed, epoch, batch index, row), so no RNG state needs
// saving; a checkpoint is written to a temporary folder, fsynced, renamed and only then marked
// COMPLETE; any error stops the run with a message and a non-zero exit; SIGINT/SIGTERM finish the
// current step, write a checkpoint and exit 0.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "train/run_config.hpp"

namespace dflash {

/// How `dflash train` was asked to start.
struct TrainOptions {
  RunConfig config;                 ///< resolved configuration (fresh run), see resume
  std::string resume_dir;           ///< non-empty: continue the run in this directory
  bool force = false;               ///< resume even when model/data-changing keys differ
  int64_t halt_at_step = 0;         ///< test hook: behave as if signalled after this step (0 = off)
};

/// Summary of a finished (or interrupted) run.
struct TrainResult {
  int64_t steps_done = 0;           ///< optimizer steps completed in total (including resumed ones)
  int64_t skipped_steps = 0;        ///< non-finite steps skipped
  bool interrupted = false;         ///< stopped by a signal (or halt_at_step) after a checkpoint
  std::string last_checkpoint;      ///< path of the newest complete checkpoint
  double final_loss = 0, final_tau = 0;  ///< metrics of the last log interval
};

/// Runs training as configured. Throws dflash::Error on any failure (after recording it in
/// status.json when the run directory is already open).
TrainResult train(const TrainOptions& opts);

/// Parses and checks the text of a checkpoint's `trainer_state/state.json` (format
/// dflash-trainer-state-1: step, skip counts, data cursor, the open log interval's metric
/// accumulators, resolved config) exactly as `--resume` reads it. Throws dflash::Error naming
/// `source` and the key at fault. The boundary of the trainer_state fuzz harness (tests/fuzz).
void trainer_state_check(std::string_view text, const std::string& source);

/// Installs SIGINT/SIGTERM handlers that ask a running train() to checkpoint and stop.
void install_train_signal_handlers();

}  // namespace dflash
