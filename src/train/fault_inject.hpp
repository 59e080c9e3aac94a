// dflash.cpp — fault injection for the pipeline's failure tests (README, developer notes):
//
//   DFLASH_FAULT_INJECT=[rank<K>:]<target|drafter>:<worker>:<step>:<throw|hang|nan>
//
// (rank<K>: the fault fires on rank K of an MPI job, train/job.hpp; without it, on rank 0, the
// only rank of a one-process run)
// makes worker <worker> of that stage, at 1-based optimizer step <step>, throw an error (throw),
// stop making progress forever (hang: the thread sleeps and never returns, as a stuck device call
// would), or produce non-finite numbers (nan: a target worker's features, a drafter worker's loss)
// at that step and every later one (a streak). A target worker fires at the first batch of a step
// ≥ <step> that it computes (which target worker computes which batch depends on timing).
//
// Invariants: a FaultInjector belongs to one worker thread; without the variable nothing fires and
// nothing is checked per step but one optional.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "train/topology.hpp"

namespace dflash {

/// What an injected fault does.
enum class FaultKind { throw_error, hang, nan };

/// One parsed DFLASH_FAULT_INJECT value.
struct FaultSpec {
  int rank = 0;  ///< the MPI rank whose worker fails (0 in a one-process run)
  WorkerStage stage = WorkerStage::target;
  int worker = 0;
  int64_t step = 1;  ///< 1-based optimizer step
  FaultKind kind = FaultKind::throw_error;
  std::string text;  ///< the variable's value, for messages
};

/// Parses a DFLASH_FAULT_INJECT value; throws dflash::Error naming the variable and the bad field.
FaultSpec fault_spec_parse(const std::string& text);

/// The spec of the environment's DFLASH_FAULT_INJECT (nothing when unset or empty), checked
/// against `topology` and the job's `ranks`: throws dflash::Error when it names a worker or a
/// rank the run does not have. Nothing either when it names another rank than `rank`.
std::optional<FaultSpec> fault_spec_from_env(const PipelineTopology& topology, int rank = 0,
                                             int ranks = 1);

/// The faults of one worker.
class FaultInjector {
 public:
  FaultInjector(const std::optional<FaultSpec>& spec, WorkerStage stage, int worker);
  /// The fault to apply at 1-based `step`, if any: throw and hang fire once, at the first step
  /// ≥ spec.step; nan fires at every step ≥ spec.step.
  std::optional<FaultKind> at(int64_t step);
  /// Applies throw (throws dflash::Error naming the step and the variable) and hang (never
  /// returns); returns for nan (the caller poisons its output).
  void apply(FaultKind kind, int64_t step) const;

 private:
  std::optional<FaultSpec> spec_;
  bool fired_ = false;
};

}  // namespace dflash
