// dflash.cpp — checkpoints of `dflash train`: the export format of DESIGN.md §1 plus the trainer
// state that a resumed run needs to continue bit-identically (CPU backend).
//
// Layout of <run>/checkpoint-<STEP>/:
//   config.json, model.safetensors   the exported drafter (drafter_save, training.export_dtype)
//   trainer_state/optimizer.safetensors   f32 [P] master, adam_m, adam_v
//   trainer_state/state.json         format, step, skipped, consecutive_skips, data_cursor,
//                                    interval (IntervalMetrics), config (the resolved YAML)
//   COMPLETE                         written last: JSON {format, step, files: {relative path:
//                                    {bytes, xxh3}}} listing the four files above
// Invariants: a checkpoint is written to .tmp-checkpoint-<STEP>, fsynced, renamed, the run
// directory fsynced, and only then marked COMPLETE; a folder without COMPLETE is never read, and
// a resume reads only a checkpoint whose files have the sizes and XXH3 digests its marker lists
// (checkpoint_verify). The AdamW update count is not stored: every step applies one update or is
// skipped, so updates = step − skipped (checked when writing, restored when reading).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.hpp"
#include "data/batcher.hpp"
#include "model/drafter.hpp"
#include "train/run_dir.hpp"
#include "train/train_backend.hpp"
#include "train/train_report.hpp"

namespace dflash {

/// Everything a checkpoint restores besides the drafter's weights and moments.
struct TrainerState {
  int64_t step = 0;               ///< optimizer steps done (applied or skipped)
  int64_t skipped = 0;            ///< steps skipped in total
  int64_t consecutive_skips = 0;  ///< skipped steps since the last applied one
  DataCursor cursor;              ///< the batcher's position after `step`
  /// Processes (MPI ranks) of the job that trained it (train/job.hpp); state.json has the key
  /// "ranks" only when it is above 1.
  int64_t ranks = 1;
  IntervalMetrics interval;  ///< the log interval in progress
  std::string config_yaml;   ///< the resolved configuration of the run
};

/// Writes checkpoint `st.step` of `rd` (see the file comment), then keeps only the newest
/// `keep_last` complete checkpoints. Returns the checkpoint's folder. Throws dflash::Error when
/// `drafter` does not match `layout` or its update count is not st.step − st.skipped, or on I/O
/// errors (naming the file).
std::filesystem::path checkpoint_write(RunDir& rd, const DrafterConfig& cfg,
                                       const DrafterLayout& layout, const DrafterState& drafter,
                                       const TrainerState& st, DType export_dtype, int keep_last);

/// How checkpoint_verify judged a checkpoint.
enum class CheckpointCheck {
  verified,       ///< every file listed in the marker has the listed size and digest
  legacy_marker,  ///< its COMPLETE is the bare "step N" line of checkpoints written before
                  ///< markers listed files: nothing to check the files against
};

/// Checks the files of checkpoint folder `dir` against its COMPLETE marker: every file of the
/// layout above must be listed, exist and have the listed size and XXH3 digest, and the marker's
/// step must be the folder's. Reads every listed file once. Throws dflash::Error naming the file
/// that is missing, differs, or the marker when it is absent or malformed.
CheckpointCheck checkpoint_verify(const std::filesystem::path& dir);

/// A checkpoint passed over by checkpoint_select, and why.
struct CheckpointRejection {
  std::filesystem::path dir;
  std::string reason;  ///< checkpoint_verify's error
};

/// The checkpoint a resume continues from.
struct ResumePoint {
  std::filesystem::path dir;
  int64_t step = 0;
  CheckpointCheck check = CheckpointCheck::verified;
  std::vector<CheckpointRejection>
      rejected;  ///< newer complete checkpoints that failed, newest first
};

/// The newest complete checkpoint of `run_dir` that passes checkpoint_verify, with the newer
/// ones that failed. Throws dflash::Error when the directory has no complete checkpoint, or when
/// none verifies (listing each one's reason).
ResumePoint checkpoint_select(const std::filesystem::path& run_dir);

/// Moves a checkpoint that failed verification out of the way: renames <run>/checkpoint-STEP to
/// <run>/rejected-checkpoint-STEP (replacing an earlier folder of that name) and fsyncs the run
/// directory, so that it is neither resumed from nor counted or pruned as a checkpoint (nor
/// matched by a `checkpoint-*` glob), and is kept for inspection. Returns the new path. Throws
/// dflash::Error naming the folder when the rename fails.
std::filesystem::path checkpoint_set_aside(const std::filesystem::path& dir);

/// Parses the text of a checkpoint's trainer_state/state.json (format dflash-trainer-state-1):
/// step, skip counts (0 <= consecutive_skips <= skipped <= step), data cursor, the open log
/// interval's accumulators (K = the saved config's block size), resolved config (which must
/// parse as a run YAML). Strict JSON (no duplicate keys; no float where an integer belongs).
/// Throws dflash::Error naming `source` and the key at fault. Also the boundary of the
/// trainer_state fuzz harness (tests/fuzz).
TrainerState checkpoint_state_parse(std::string_view text, const std::string& source);

/// checkpoint_state_parse of `dir`/trainer_state/state.json; errors name that file.
TrainerState checkpoint_read_state(const std::filesystem::path& dir);

/// Reads the weights and AdamW moments of checkpoint `dir` into `drafter` (sized for `layout`;
/// updates = st.step − st.skipped, `st` being the checkpoint's state). Throws dflash::Error naming
/// the file and the tensor that is missing or has the wrong size.
void checkpoint_read_drafter(const std::filesystem::path& dir, const DrafterLayout& layout,
                             const TrainerState& st, DrafterState& drafter);

/// checkpoint_read_state, then checkpoint_read_drafter: the whole trainer state of the complete
/// checkpoint `dir` into `st` and `drafter`. Errors as those two.
void checkpoint_read(const std::filesystem::path& dir, const DrafterLayout& layout,
                     DrafterState& drafter, TrainerState& st);

}  // namespace dflash
