// dflash.cpp — the training pipeline (DESIGN.md §2): target workers compute features of the global
// batch sequence and feed data-parallel drafter workers through bounded queues; the calling thread
// coordinates (results in step order, checkpoints, status, the stall watchdog, stopping).
//
//   make_step(s) ─► target worker t (any free one): forward_taps ─► queue of replica r ─►
//   drafter worker r: step, update (all-reduce, AdamW), result ─► coordinator: on_step(s)
//
// What a step is (docs/design-notes.md): optimizer step s (0-based) consumes global batch s of
// D·R rows, replica r taking rows [r·R, (r+1)·R); the replicas' gradients are summed and the loss
// is normalised by the Σw of the whole batch, so one step with D replicas computes what one
// replica would compute on the global batch.
//
// Invariants:
// - Each worker is one thread that creates, drives and destroys its own stage (its device context,
//   stream, handles and graphs); what workers share is the batch source (under a lock), the
//   queues, the collective and the atomics of their status. The target model behind CPU stages is
//   read-only.
// - Results reach on_step in step order, once every replica has finished the step. Replica 0
//   attaches its state to step s when checkpoint_after(s + 1); all replicas hold the same state.
// - Any worker's error, an on_step error, or a worker in a working phase for stall_timeout_s stops
//   every worker: queues close, the collective aborts, target workers stop taking batches. Workers
//   that do not finish within stop_grace_s are left behind (detached) and named; run() returns.
// - A stop request (signal) lets every replica finish the step the furthest one has started, then
//   stops cleanly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/batcher.hpp"
#include "model/drafter_batch.hpp"
#include "train/collective.hpp"
#include "train/fault_inject.hpp"
#include "train/topology.hpp"
#include "train/train_backend.hpp"

namespace dflash {

/// The inputs of one optimizer step.
struct StepInput {
  /// One batch per drafter replica (batch r for replica r), each with step_weight_sum = the Σw of
  /// all of them.
  std::vector<DrafterBatch> batches;
  DataCursor cursor;  ///< the data position after the step's last batch
  double data_s = 0;  ///< host seconds spent making them
};

/// A finished optimizer step, as on_step receives it.
struct PipelineStep {
  int64_t steps_done = 0;  ///< 1-based: the number of steps done with this one
  /// Per replica: its result (metrics of its own batch; grad norm and skip of the whole step).
  std::vector<DrafterStepResult> results;
  std::vector<int64_t> tokens;              ///< per replica: context tokens of its batch
  std::vector<int64_t> supervised;          ///< per replica: loss-mask tokens of its batch
  std::vector<std::string> feature_source;  ///< per replica: the target worker of its features
  DataCursor cursor;                        ///< data position after the step
  double data_s = 0;                        ///< host seconds making the step's batches
  double target_s = 0;   ///< target-worker seconds of the step's D forwards (summed)
  double drafter_s = 0;  ///< seconds of the slowest replica's step + update
  double wall_s = 0;     ///< seconds since the previous step finished (or the first step began)
  /// Of wall_s: seconds replica 0 spent handing out its state for a checkpoint (device → host).
  double save_s = 0;
  /// Device seconds of the step's D target forwards (summed), when every target stage measured
  /// them; absent otherwise.
  std::optional<double> target_device_s;
  double target_busy_s = 0, drafter_busy_s = 0;  ///< worker-seconds busy since the previous step
  std::vector<int> queue_held;                   ///< per replica: feature batches queued now
  std::optional<DrafterState> state;             ///< replica 0's state, when checkpoint_after
};

/// One worker as status.json and `dflash status` show it.
struct WorkerInfo {
  std::string name;                    ///< "target0", "drafter1"
  std::string stage;                   ///< "target" or "drafter"
  std::string device;                  ///< "cpu" or "cuda:N"
  std::string phase;                   ///< e.g. "target forward", "waiting for features"
  double phase_s = 0;                  ///< seconds in the current phase
  int64_t step = 0;                    ///< 1-based step of the work in hand (or last done)
  /// Context tokens per second since the previous report; absent for the first report and for a
  /// finished, stopped or failed worker.
  std::optional<double> tokens_per_s;
  double busy = 0;                     ///< fraction of time in working phases since start
  std::optional<int> queue_held;       ///< drafters: feature batches waiting in the input queue
  int queue_capacity = 0;
  std::optional<DeviceMemory> memory;  ///< CUDA: the worker's GPU
};

/// How a run of the pipeline ended.
struct PipelineOutcome {
  enum class End { completed, stopped, failed };
  End end = End::completed;
  int64_t steps_done = 0;     ///< steps handed to on_step (1-based count)
  std::string failed_worker;  ///< failed: "drafter1", "target0", "trainer" (on_step) or "watchdog"
  std::string error;          ///< failed: the message (naming the worker and step)
  /// The state after steps_done when the last step did not carry one and a replica could give it
  /// (stopped, or failed with a replica intact); nothing otherwise. After a failure it may come
  /// from a replica that finished later steps: it is the state of steps_done only if its update
  /// count is that of steps_done (skipped steps change nothing), which the caller must check.
  std::optional<DrafterState> final_state;
  /// completed and stopped: a hash of each replica's final state (all equal, else the run failed).
  std::vector<uint64_t> replica_hashes;
  /// Workers that did not stop within the grace period (left running, detached).
  std::vector<std::string> abandoned;
  /// "drafter0: <its stage's summary()>" for each drafter whose stage had something to say.
  std::vector<std::string> summaries;
};

/// What poll_job brings from the other ranks of an MPI job.
struct JobNews {
  int failed_rank = -1;  ///< ≥ 0: that rank failed with `failure` (its message)
  std::string failure;
  std::optional<int64_t> stop_before;  ///< rank 0 stops the job before this 0-based step
};

/// What the pipeline calls. make_target/make_drafter run on the worker's own thread, make_step on
/// whichever target worker needs the next step (under the pipeline's lock), lr and
/// checkpoint_after on drafter threads (they must be pure), on_step, on_tick and stop_requested on
/// the coordinating thread. on_step may throw: the run then fails with that error.
struct PipelineHooks {
  std::function<StepInput(int64_t step)> make_step;  ///< 0-based step
  std::function<std::unique_ptr<TargetStage>(int worker)> make_target;
  std::function<std::unique_ptr<DrafterStage>(int replica)> make_drafter;
  std::function<double(int64_t step)> lr;                    ///< of 0-based step
  std::function<bool(int64_t steps_done)> checkpoint_after;  ///< attach the state after it
  std::function<void(PipelineStep&)> on_step;
  std::function<void(const std::vector<WorkerInfo>&)> on_tick;  ///< about every tick_s
  std::function<bool()> stop_requested;                         ///< a signal arrived
  /// MPI jobs (train/job.hpp; optional): called on the coordinating thread about every 50 ms.
  /// A failure of another rank fails the run naming that rank; a stop step stops the run
  /// before that 0-based step, as a signal would (rank 0 decided it for every rank).
  std::function<std::optional<JobNews>()> poll_job;
  /// MPI jobs (optional): a signal stops the run before step stop_step(furthest) instead of
  /// furthest + 1 (rank 0 picks a step that no rank has passed and tells the others).
  std::function<int64_t(int64_t furthest_started)> stop_step;
  /// MPI jobs' ranks ≠ 0: a replica starts step s only after the coordinator has accounted step
  /// s − 1 and polled the job's news since, so a stop step rank 0 announced before its part of
  /// step s − 1's all-reduce is seen before any replica here can pass it (the poll otherwise runs
  /// only every 50 ms, longer than a small step).
  bool begin_after_poll = false;
  /// Called once, on the coordinating thread, when the run fails, with the error (an MPI job's
  /// rank ≠ 0 reports it to rank 0 at once).
  std::function<void(const std::string& error)> on_failure;
};

/// Options of one run.
struct PipelineOptions {
  PipelineTopology topology;
  int64_t first_step = 0;  ///< 0-based step to start at (the steps done so far)
  int64_t end_step = 0;    ///< run steps [first_step, end_step)
  const DrafterState* initial_state = nullptr;  ///< loaded into every replica (must outlive run)
  std::optional<FaultSpec> fault;               ///< DFLASH_FAULT_INJECT
  std::shared_ptr<CollectiveGroup> collective;  ///< the replicas' group (null: one replica)
  double tick_s = 1.0;                          ///< on_tick period
  double stop_grace_s = 8.0;  ///< how long stopping workers get before they are left behind
};

/// Runs the pipeline (see the file comment) on the calling thread until end_step, a stop request
/// or a failure. Errors of workers and hooks are reported in the outcome, not thrown; throws
/// dflash::Error only for invalid options (naming them).
PipelineOutcome pipeline_run(const PipelineOptions& opts, const PipelineHooks& hooks);

/// FNV-1a hash of a drafter state's bytes (weights, moments, update count): replicas compare it.
uint64_t drafter_state_hash(const DrafterState& s);

}  // namespace dflash
