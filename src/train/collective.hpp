// dflash.cpp — collectives of the drafter replicas: the gradient all-reduce of data-parallel
// training (DESIGN.md §3, "Multi-GPU": drafter replicas are data-parallel with an all-reduce).
//
// A CollectiveGroup is created once per run for the D drafter replicas; each replica's drafter
// stage holds its member, a Collective of rank r in [0, D). Implementations:
//   - local (this file): in-process, host memory; the cpu backend.
//   - nccl (train/collective_cuda.cpp, CUDA builds): one NCCL communicator, one rank per replica,
//     each on its own GPU; device memory, enqueued on the member's stream.
//   - cuda-local (same file): in-process, device memory, for replicas that share a GPU (NCCL
//     refuses two ranks on one device).
//
// Invariants:
// - Every rank calls the same collectives in the same order with the same sizes; a call returns
//   on every rank with identical bits in every element (all replicas then apply the same update,
//   so they stay bit-identical).
// - local and cuda-local sum element i as ((x_0[i] + x_1[i]) + x_2[i]) + … in rank order, in the
//   element type: the result is a pure function of the inputs, whatever the thread timing. nccl
//   sums in NCCL's order (identical on every rank, not necessarily rank order).
// - abort() (any thread) makes every blocked and every later call throw dflash::Error naming the
//   reason, so that a failed replica cannot leave the others waiting forever.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace dflash {

/// One rank's handle on its group (owned by that replica's drafter stage, used by its thread).
class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// In place: data[i] ← Σ over ranks of data[i], for i in [0, n). `data` is host memory for the
  /// local implementation and device memory of the member's GPU for the CUDA ones (enqueued on the
  /// member's stream: complete once that stream reaches it). Throws dflash::Error when the ranks
  /// disagree on n or the group was aborted.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  /// The same for a few host values (e.g. a step's loss sum), blocking until the result is here.
  virtual void all_reduce_sum_host(std::span<double> values) = 0;
  /// "local (2 ranks)", "nccl 2.28.9 (3 ranks)", ...
  virtual std::string describe() const = 0;
};

/// The shared side of a collective: what any thread may call while members are blocked.
class CollectiveGroup {
 public:
  virtual ~CollectiveGroup() = default;
  virtual int size() const = 0;
  /// The members in this process: size() for in-process groups; of a group spanning the ranks of
  /// an MPI job (train/job.hpp), this rank's replicas.
  virtual int local_size() const { return size(); }
  /// The member of local replica `local` for a replica on the host (the cpu backend). Throws
  /// dflash::Error for a group that does not serve host memory, for a replica outside
  /// [0, local_size()) or one already handed out.
  virtual std::unique_ptr<Collective> host_member(int local);
  /// Wakes every member blocked in a collective and fails every later call with `reason`.
  /// Idempotent; callable from any thread.
  virtual void abort(const std::string& reason) = 0;
  /// "local", "nccl", "cuda-local".
  virtual std::string kind() const = 0;
};

/// The in-process host collective (see the file comment).
class LocalCollectiveGroup final : public CollectiveGroup,
                                   public std::enable_shared_from_this<LocalCollectiveGroup> {
 public:
  /// A group of `size` ≥ 1 ranks. Throws dflash::Error for size < 1.
  static std::shared_ptr<LocalCollectiveGroup> create(int size);
  /// The member of rank `rank` (each rank once; it keeps the group alive). Throws dflash::Error
  /// for a rank outside [0, size) or one already handed out.
  std::unique_ptr<Collective> member(int rank);
  int size() const override { return size_; }
  std::unique_ptr<Collective> host_member(int local) override { return member(local); }
  void abort(const std::string& reason) override;
  std::string kind() const override { return "local"; }

  /// All ranks meet; every element of every rank's buffer becomes the rank-order sum. Internal to
  /// the members (public for them only).
  template <typename T>
  void all_reduce(int rank, T* data, int64_t n);
  /// Waits until every rank has called it (the building block of the collectives, also of the
  /// in-process device group). Throws dflash::Error when the group is or gets aborted.
  void barrier();

 private:
  explicit LocalCollectiveGroup(int size);

  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<bool> handed_out_;
  std::vector<void*> buffers_;  // per rank, during an all_reduce
  std::vector<int64_t> sizes_;
};

/// The group of CUDA replicas on `devices` (one entry per rank): NCCL when every rank has a GPU of
/// its own, else the in-process device group (src/train/collective_cuda.cpp). The members are made
/// on the replicas' threads with cuda_collective_member. Throws dflash::Error in a build without
/// CUDA, or when NCCL cannot create its unique id.
std::shared_ptr<CollectiveGroup> cuda_collective_group_create(const std::vector<int>& devices);

/// NCCL's unique id of a new communicator (ncclGetUniqueId) as bytes: an MPI job's rank 0 makes
/// it and broadcasts it (train/job.hpp). Throws dflash::Error in a build without CUDA.
std::string nccl_unique_id();

/// The NCCL group of this process's drafter replicas (`devices`, one GPU each) in a communicator
/// of `global_size` ranks over an MPI job: local replica r joins as rank first_rank + r with `id`
/// (rank 0's nccl_unique_id). Throws dflash::Error when two local replicas share a GPU, when the
/// id is malformed, or in a build without CUDA.
std::shared_ptr<CollectiveGroup> nccl_collective_group_create(const std::vector<int>& devices,
                                                              int global_size, int first_rank,
                                                              const std::string& id);

/// The member `rank` of a CUDA group for the calling thread, whose current device must be the
/// rank's; its device collectives are enqueued on `stream` (a cudaStream_t). For NCCL this joins
/// the communicator and returns when every rank has joined. Throws dflash::Error naming the rank
/// and the NCCL error, or when the group is not a CUDA group.
std::unique_ptr<Collective> cuda_collective_member(const std::shared_ptr<CollectiveGroup>& group,
                                                   int rank, void* stream);

}  // namespace dflash
