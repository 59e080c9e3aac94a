// dflash.cpp — the processes of one training job past one machine (issue 15):
// `mpirun -np N dflash train --config run.yaml` runs one process (an MPI rank) per node, each with
// its local pipeline (train/pipeline.hpp: its target and drafter workers). MPI launches the ranks
// and carries everything between them except the device all-reduce (NCCL, train/collective.hpp).
//
//   global drafter replica g = k·L + r  (rank k, local replica r, L replicas per rank, G = N·L)
//
// What travels between ranks (two communicators duplicated from MPI_COMM_WORLD):
//   data:    the CPU backend's all-reduce (Job::host_collective: a chain in global replica
//            order, then a broadcast; one thread per rank calls it at a time);
//   control: start-up and end-of-run agreement (gather to rank 0, broadcast from it), the NCCL
//            unique id, each step's per-replica metrics (rank k → rank 0), status snapshots
//            (rank k → rank 0), failure reports (rank k → rank 0), and the stop step after a
//            signal (rank 0 → every rank: signals on other ranks are ignored, rank 0 decides).
//
// Threading: MPI_Init_thread asks for MPI_THREAD_MULTIPLE (and refuses less): a replica thread
// drives the data communicator while the coordinating thread serves the control one. Funnelling
// both through one thread would add a hop to every all-reduce and a queue of its own.
//
// Failure: no call here blocks inside MPI; every wait polls its requests, and on rank 0 also the
// failure reports, so that a rank that fails is named on rank 0 at once (Job::fail_and_abort then
// ends the job with MPI_Abort). A rank that hangs is found by the stall watchdog of the others
// (runtime.stall_timeout_s: a replica waiting in the all-reduce is in a working phase; the
// per-step and end-of-run exchanges wait at most that long); a rank that dies is reported by
// mpirun, which then ends the others.
//
// Invariants: a Job exists only in a process launched by an MPI launcher with more than one
// rank (job_init returns null otherwise, and `dflash train` behaves as a one-process run); all
// ranks run the same resolved configuration (checked at start-up); rank 0 alone writes the run
// directory's log, metrics, status and checkpoints.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model/objective.hpp"
#include "train/collective.hpp"

namespace dflash {

/// The figures of one drafter replica's step that rank 0 needs from the other ranks (its merged
/// metrics, the skip decision and norm it must agree with, the tokens it counts).
struct ReplicaStepFigures {
  double grad_norm = 0;
  int skip = 0;  ///< StepSkip as an integer
  int64_t tokens = 0, supervised = 0;
  ObjectiveMetrics metrics;  ///< the replica's own blocks
};

class Job;

/// MPI_Init_thread (MPI_THREAD_MULTIPLE) when this process was started by an MPI launcher
/// (Open MPI, PMIx or PMI variables) and the build has MPI; null otherwise, and null for a job of
/// one rank (MPI is then finalized at exit). Throws dflash::Error when the MPI library gives less
/// than MPI_THREAD_MULTIPLE.
std::shared_ptr<Job> job_init();

/// One rank's view of the job (see the file comment). Methods are called from the thread that
/// made the job unless their comment says otherwise.
class Job {
 public:
  virtual ~Job() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// "rank1": this rank's name in messages and worker names.
  std::string name() const { return "rank" + std::to_string(rank()); }

  /// Rank 0 receives every rank's `mine` (index = rank); the others get an empty vector. Rank 0
  /// throws dflash::Error naming the rank when another rank reports a failure meanwhile, or when
  /// `timeout_s` > 0 passes.
  virtual std::vector<std::string> gather(const std::string& mine, double timeout_s) = 0;
  /// Rank 0's `text` on every rank.
  virtual std::string broadcast(const std::string& text) = 0;

  /// The collective of the job's G = size()·local drafter replicas on the CPU backend: local
  /// members 0..local−1 of this rank are global replicas rank()·local + r; sums in global
  /// replica order, bit-identical to one LocalCollectiveGroup of G ranks.
  virtual std::shared_ptr<CollectiveGroup> host_collective(int local) = 0;

  /// Ranks ≠ 0: sends the figures of step `step` (0-based) of each local replica to rank 0
  /// (does not wait for it). Coordinating thread.
  virtual void send_step(int64_t step, const std::vector<ReplicaStepFigures>& replicas) = 0;
  /// Rank 0: every other rank's figures of step `step`, in rank order (rank 1's replicas first).
  /// Throws dflash::Error naming the rank when one reports a failure, sends another step, or
  /// does not answer within timeout_s. Coordinating thread.
  virtual std::vector<ReplicaStepFigures> receive_step(int64_t step, int replicas_per_rank,
                                                       double timeout_s) = 0;
  /// Ranks ≠ 0: sends a status snapshot (JSON text) to rank 0 unless the previous one is still
  /// in flight. Coordinating thread.
  virtual void send_status(const std::string& json_text) = 0;
  /// Rank 0: the newest snapshot of every other rank received so far (index = rank; "" none).
  virtual std::vector<std::string> statuses() = 0;
  /// Rank 0: a failure reported by another rank (its rank and message), if one has arrived.
  virtual std::optional<std::pair<int, std::string>> peer_failure() = 0;
  /// Rank 0: tells every other rank to stop before 0-based step `stop_before` (a signal).
  virtual void announce_stop(int64_t stop_before) = 0;
  /// Ranks ≠ 0: the stop step rank 0 announced, once it has arrived.
  virtual std::optional<int64_t> stop_announced() = 0;
  /// Ranks ≠ 0: reports `message` to rank 0 (once; later calls do nothing). Any thread.
  virtual void report_failure(const std::string& message) = 0;
  /// Ends every rank of the job after a failure of this one: prints `message` with the rank to
  /// stderr; a rank ≠ 0 reports it to rank 0 and gives rank 0 up to `grace_s` to end the job
  /// itself (so that rank 0 can log it and checkpoint); then MPI_Abort with exit code 1.
  [[noreturn]] virtual void fail_and_abort(const std::string& message, double grace_s) = 0;
  /// MPI_Finalize after a successful run (every rank).
  virtual void finish() = 0;
};

}  // namespace dflash
