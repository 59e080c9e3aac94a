// dflash.cpp — the CUDA collectives of the drafter replicas (see collective.hpp):
//
// nccl: one NCCL communicator over the replicas, each rank on a GPU of its own (NCCL refuses two
//   ranks on one device). The unique id is made when the group is created (the coordinating
//   thread); each replica's thread joins with ncclCommInitRank, which returns once every rank has
//   joined. abort() calls ncclCommAbort on every communicator, which ends kernels waiting for a
//   peer that will not come.
// cuda-local: for replicas of one process of which some share a GPU. One all-reduce: each rank
//   records an event after its gradient on its stream and posts its buffer; after a host barrier
//   its stream waits for every rank's event, reduces its own chunk of all buffers in rank order
//   (launch::sum_ranks) and records a second event; after a second barrier its stream waits for
//   every rank's second event; a third barrier keeps any rank from recording the next call's
//   events before every rank has enqueued its waits. Buffers on other GPUs are reached through
//   peer access, enabled when the member is made.
//
// Invariants: a member is used by the thread that made it, with its device current and its
// stream; all device work is enqueued on that stream. abort() may come from any thread.
#include "core/error.hpp"
#include "train/collective.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <set>

#include "backend/cuda/check.hpp"
#include "backend/cuda/collective_launch.hpp"

namespace dflash {

namespace {

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

#define DFLASH_NCCL_CHECK(call, rank)                                                 \
  do {                                                                                \
    const ncclResult_t _r = (call);                                                   \
    if (_r != ncclSuccess) {                                                          \
      fail("NCCL error in {} (rank {}): {}; {}", #call, rank, ncclGetErrorString(_r), \
           ncclGetLastError(nullptr));                                                \
    }                                                                                 \
  } while (0)

// ------------------------------------------------------------------------------------- nccl

class NcclGroup final : public CollectiveGroup {
 public:
  // A communicator of `size` ranks of which this process holds `local`, global ranks
  // [first, first + local), joining with `id`.
  NcclGroup(int size, int local, int first, const ncclUniqueId& id)
      : size_(size), local_(local), first_(first), id_(id), comms_(static_cast<size_t>(local)) {}
  int size() const override { return size_; }
  int local_size() const override { return local_; }
  std::string kind() const override { return "nccl " + nccl_version(); }
  void abort(const std::string& reason) override {
    std::vector<ncclComm_t> comms;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) return;
      aborted_ = true;
      reason_ = reason;
      comms.swap(comms_);
    }
    for (ncclComm_t c : comms) {
      if (c) ncclCommAbort(c);
    }
  }
  // Joins local replica `rank` (global rank first + rank) on the calling thread's current
  // device (blocks until all ranks of every process join).
  ncclComm_t join(int rank) {
    check_alive();
    ncclComm_t c = nullptr;
    DFLASH_NCCL_CHECK(ncclCommInitRank(&c, size_, id_, first_ + rank), first_ + rank);
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_) {
      ncclCommAbort(c);
      fail("collective aborted: {}", reason_);
    }
    comms_[static_cast<size_t>(rank)] = c;
    return c;
  }
  // Destroys rank `rank`'s communicator unless abort() already freed it.
  void leave(int rank) {
    ncclComm_t c = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) return;
      std::swap(c, comms_[static_cast<size_t>(rank)]);
    }
    if (c) ncclCommDestroy(c);
  }
  void check_alive() {
    std::lock_guard<std::mutex> lk(mu_);
    DFLASH_CHECK(!aborted_, "collective aborted: {}", reason_);
  }

 private:
  int size_, local_, first_;
  ncclUniqueId id_{};
  std::mutex mu_;
  bool aborted_ = false;
  std::string reason_;
  std::vector<ncclComm_t> comms_;
};

class NcclMember final : public Collective {
 public:
  NcclMember(std::shared_ptr<NcclGroup> group, int rank, cudaStream_t stream)
      : group_(std::move(group)), rank_(rank), stream_(stream) {
    comm_ = group_->join(rank);
    DFLASH_CUDA_CHECK(cudaMalloc(&host_values_, kMaxHostValues * sizeof(double)));
  }
  ~NcclMember() override {
    if (host_values_) cudaFree(host_values_);
    group_->leave(rank_);
  }
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void all_reduce_sum(float* data, int64_t n) override {
    group_->check_alive();
    DFLASH_NCCL_CHECK(
        ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream_),
        rank_);
  }
  void all_reduce_sum_host(std::span<double> values) override {
    DFLASH_CHECK(values.size() <= kMaxHostValues, "collective: {} host values (at most {})",
                 values.size(), kMaxHostValues);
    group_->check_alive();
    const size_t bytes = values.size() * sizeof(double);
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(host_values_, values.data(), bytes, cudaMemcpyHostToDevice, stream_));
    DFLASH_NCCL_CHECK(ncclAllReduce(host_values_, host_values_, values.size(), ncclFloat64, ncclSum,
                                    comm_, stream_),
                      rank_);
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(values.data(), host_values_, bytes, cudaMemcpyDeviceToHost, stream_));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  std::string describe() const override {
    return fmt::format("nccl {} ({} ranks)", nccl_version(), group_->size());
  }

 private:
  static constexpr size_t kMaxHostValues = 64;
  std::shared_ptr<NcclGroup> group_;
  int rank_;
  cudaStream_t stream_;
  ncclComm_t comm_ = nullptr;
  double* host_values_ = nullptr;  // device buffer of the host values' all-reduce
};

// ------------------------------------------------------------------------------- cuda-local

class CudaLocalGroup final : public CollectiveGroup {
 public:
  explicit CudaLocalGroup(std::vector<int> devices)
      : devices_(std::move(devices)),
        host_(LocalCollectiveGroup::create(static_cast<int>(devices_.size()))),
        ready_(devices_.size(), nullptr),
        done_(devices_.size(), nullptr),
        buffers_(devices_.size(), nullptr),
        sizes_(devices_.size(), 0) {
    DFLASH_CHECK(devices_.size() <= static_cast<size_t>(cuda::kMaxLocalRanks),
                 "the in-process device collective serves at most {} replicas, got {}",
                 cuda::kMaxLocalRanks, devices_.size());
  }
  ~CudaLocalGroup() override {
    for (cudaEvent_t e : ready_) {
      if (e) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : done_) {
      if (e) cudaEventDestroy(e);
    }
  }
  int size() const override { return static_cast<int>(devices_.size()); }
  std::string kind() const override { return "cuda-local"; }
  void abort(const std::string& reason) override { host_->abort(reason); }

  // Rank `rank`'s setup on its thread: peer access to the other ranks' GPUs, its two events.
  std::unique_ptr<Collective> host_member(int rank) {
    const int mine = devices_[static_cast<size_t>(rank)];
    for (int d : std::set<int>(devices_.begin(), devices_.end())) {
      if (d == mine) continue;
      int can = 0;
      DFLASH_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, mine, d));
      DFLASH_CHECK(can,
                   "the in-process device collective needs peer access from GPU {} to GPU {} "
                   "(their drafter replicas share a collective)",
                   mine, d);
      const cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear it
      } else {
        DFLASH_CUDA_CHECK(e);
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    DFLASH_CUDA_CHECK(
        cudaEventCreateWithFlags(&ready_[static_cast<size_t>(rank)], cudaEventDisableTiming));
    DFLASH_CUDA_CHECK(
        cudaEventCreateWithFlags(&done_[static_cast<size_t>(rank)], cudaEventDisableTiming));
    return host_->member(rank);
  }

  void all_reduce(int rank, float* data, int64_t n, cudaStream_t s) {
    const auto r = static_cast<size_t>(rank);
    DFLASH_CUDA_CHECK(cudaEventRecord(ready_[r], s));
    {
      std::lock_guard<std::mutex> lk(mu_);
      buffers_[r] = data;
      sizes_[r] = n;
    }
    host_->barrier();
    cuda::RankBuffers bufs;
    bufs.n = size();
    for (size_t q = 0; q < devices_.size(); ++q) {
      DFLASH_CHECK(sizes_[q] == sizes_[0], "collective: rank {} reduces {} values, rank 0 {}", q,
                   sizes_[q], sizes_[0]);
      bufs.p[q] = buffers_[q];
      DFLASH_CUDA_CHECK(cudaStreamWaitEvent(s, ready_[q], 0));
    }
    const int D = size();
    cuda::launch::sum_ranks(bufs, n * rank / D, n * (rank + 1) / D, s);
    DFLASH_CUDA_CHECK(cudaEventRecord(done_[r], s));
    host_->barrier();
    for (size_t q = 0; q < devices_.size(); ++q) {
      DFLASH_CUDA_CHECK(cudaStreamWaitEvent(s, done_[q], 0));
    }
    host_->barrier();
  }

 private:
  std::vector<int> devices_;
  std::shared_ptr<LocalCollectiveGroup> host_;
  std::mutex mu_;
  std::vector<cudaEvent_t> ready_, done_;
  std::vector<float*> buffers_;
  std::vector<int64_t> sizes_;
};

class CudaLocalMember final : public Collective {
 public:
  CudaLocalMember(std::shared_ptr<CudaLocalGroup> group, int rank, cudaStream_t stream)
      : group_(std::move(group)), rank_(rank), stream_(stream), host_(group_->host_member(rank)) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void all_reduce_sum(float* data, int64_t n) override {
    group_->all_reduce(rank_, data, n, stream_);
  }
  void all_reduce_sum_host(std::span<double> values) override {
    host_->all_reduce_sum_host(values);
  }
  std::string describe() const override {
    return fmt::format("cuda-local ({} ranks, device memory)", group_->size());
  }

 private:
  std::shared_ptr<CudaLocalGroup> group_;
  int rank_;
  cudaStream_t stream_;
  std::unique_ptr<Collective> host_;
};

}  // namespace

std::shared_ptr<CollectiveGroup> cuda_collective_group_create(const std::vector<int>& devices) {
  DFLASH_CHECK(!devices.empty(), "collective: no replicas");
  const std::set<int> distinct(devices.begin(), devices.end());
  if (distinct.size() == devices.size()) {
    ncclUniqueId id{};
    DFLASH_NCCL_CHECK(ncclGetUniqueId(&id), -1);
    const int n = static_cast<int>(devices.size());
    return std::make_shared<NcclGroup>(n, n, 0, id);
  }
  return std::make_shared<CudaLocalGroup>(devices);
}

std::string nccl_unique_id() {
  ncclUniqueId id{};
  DFLASH_NCCL_CHECK(ncclGetUniqueId(&id), -1);
  return std::string(id.internal, sizeof id.internal);
}

std::shared_ptr<CollectiveGroup> nccl_collective_group_create(const std::vector<int>& devices,
                                                              int global_size, int first_rank,
                                                              const std::string& id) {
  const std::set<int> distinct(devices.begin(), devices.end());
  DFLASH_CHECK(distinct.size() == devices.size(),
               "NCCL across ranks needs one GPU per drafter replica: this rank's replicas share "
               "a GPU (runtime.drafter_devices)");
  ncclUniqueId uid{};
  DFLASH_CHECK(id.size() == sizeof uid.internal,
               "NCCL unique id: {} bytes received, {} expected (rank 0 runs another NCCL?)",
               id.size(), sizeof uid.internal);
  std::memcpy(uid.internal, id.data(), id.size());
  const int local = static_cast<int>(devices.size());
  DFLASH_CHECK(first_rank >= 0 && first_rank + local <= global_size,
               "NCCL: ranks [{}, {}) outside a communicator of {}", first_rank, first_rank + local,
               global_size);
  return std::make_shared<NcclGroup>(global_size, local, first_rank, uid);
}

std::unique_ptr<Collective> cuda_collective_member(const std::shared_ptr<CollectiveGroup>& group,
                                                   int rank, void* stream) {
  DFLASH_CHECK(group != nullptr, "collective: no group");
  DFLASH_CHECK(rank >= 0 && rank < group->local_size(),
               "collective: local rank {} outside a group of {} in this process", rank,
               group->local_size());
  auto s = static_cast<cudaStream_t>(stream);
  if (auto n = std::dynamic_pointer_cast<NcclGroup>(group)) {
    return std::make_unique<NcclMember>(std::move(n), rank, s);
  }
  if (auto l = std::dynamic_pointer_cast<CudaLocalGroup>(group)) {
    return std::make_unique<CudaLocalMember>(std::move(l), rank, s);
  }
  fail("collective: a {} group has no CUDA members", group->kind());
}

}  // namespace dflash

#else  // no CUDA

namespace dflash {

std::shared_ptr<CollectiveGroup> cuda_collective_group_create(const std::vector<int>&) {
  fail("the CUDA collectives are not in this build (configure with -DDFLASH_CUDA=ON)");
}

std::unique_ptr<Collective> cuda_collective_member(const std::shared_ptr<CollectiveGroup>&, int,
                                                   void*) {
  fail("the CUDA collectives are not in this build (configure with -DDFLASH_CUDA=ON)");
}

std::string nccl_unique_id() {
  fail("NCCL is not in this build (configure with -DDFLASH_CUDA=ON)");
}

std::shared_ptr<CollectiveGroup> nccl_collective_group_create(const std::vector<int>&, int, int,
                                                              const std::string&) {
  fail("NCCL is not in this build (configure with -DDFLASH_CUDA=ON)");
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
