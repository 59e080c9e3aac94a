// dflash.cpp — the topology of the training pipeline: how many target workers and drafter workers
// (replicas) run, and where (DESIGN.md §2: target workers feed data-parallel drafter workers
// through bounded queues).
//
// Keys (the `runtime` section, train/run_config.hpp):
//   cpu:  target_workers, drafter_workers (threads; default 1 each)
//   cuda: target_devices, drafter_devices (one entry per worker, its GPU), or `devices` (one GPU
//         holding one target and one drafter worker); a GPU in both lists needs colocated: true
//   both: queue_depth (per drafter worker), stall_timeout_s
//
// Invariants: a PipelineTopology comes from a validated RuntimeSection, so it has at least one
// worker of each stage, every device index is ≥ 0 on cuda and −1 (no device) on cpu, and a GPU
// shared by both stages was allowed by `colocated`. Only the number of drafter replicas changes
// what training computes (a step's global batch has rows_per_step rows per replica); the target
// worker count, the devices and the queue depth change only speed.
#pragma once

#include <string>
#include <vector>

#include "train/run_config.hpp"

namespace dflash {

/// The two kinds of worker of the pipeline.
enum class WorkerStage { target, drafter };

/// Where the workers of a run are and how they are connected.
struct PipelineTopology {
  std::string backend = "cpu";       ///< runtime.backend
  std::vector<int> target_devices;   ///< per target worker: its CUDA device, −1 on cpu
  std::vector<int> drafter_devices;  ///< per drafter worker (replica): its CUDA device, −1 on cpu
  int queue_depth = 2;               ///< feature batches a drafter worker's input queue holds
  double stall_timeout_s = 300;      ///< seconds without progress before a worker counts as stuck
  /// The key the device lists came from ("runtime.devices" for the one-GPU shorthand, else
  /// "runtime.target_devices" / "runtime.drafter_devices"), for messages.
  std::string target_key = "runtime.target_workers", drafter_key = "runtime.drafter_workers";
  /// Prefix of every worker's name: "" in a one-process run, "rank1/" on rank 1 of an MPI job
  /// (train/job.hpp), so that messages and status.json name the rank too.
  std::string name_prefix;

  int targets() const { return static_cast<int>(target_devices.size()); }
  int drafters() const { return static_cast<int>(drafter_devices.size()); }
  int workers(WorkerStage s) const { return s == WorkerStage::target ? targets() : drafters(); }
  /// "target0", "drafter2": the worker's name in logs, errors and status.json.
  static std::string worker_name(WorkerStage stage, int index);
  /// name_prefix + worker_name: "rank1/drafter0".
  std::string qualified_name(WorkerStage stage, int index) const {
    return name_prefix + worker_name(stage, index);
  }
  /// "cpu" or "cuda:N" for a worker.
  std::string device_name(WorkerStage stage, int index) const;
  /// True when some GPU holds more than one drafter replica (NCCL cannot serve such a group).
  bool drafters_share_a_device() const;
  /// True when the drafter replicas all-reduce through NCCL: the cuda backend, more than one
  /// replica, each on a GPU of its own (cuda_collective_group_create's choice).
  bool uses_nccl() const { return backend == "cuda" && drafters() > 1 && !drafters_share_a_device(); }
  /// One line for the log: "cpu: 2 target workers, 2 drafter workers, queue depth 2" or
  /// "cuda: target workers on GPUs [0], drafter workers on GPUs [0, 0] (colocated), queue depth 2".
  std::string describe() const;
};

/// Checks the topology keys of `rt` without touching a device; throws dflash::Error naming the key:
/// device lists on the cpu backend, worker counts other than 1 on cuda, only one of
/// target_devices / drafter_devices given, both those lists and a non-default `devices`, a GPU in
/// both lists without colocated: true, colocated: true with no GPU shared.
void topology_check_keys(const RuntimeSection& rt);

/// The topology of a validated `rt` (see the file comment).
PipelineTopology topology_of(const RuntimeSection& rt);

/// Checks that every GPU of `t` exists (`visible` devices); throws dflash::Error naming the key
/// and the device otherwise. Nothing to check on cpu.
void topology_check_devices(const PipelineTopology& t, int visible);

}  // namespace dflash
