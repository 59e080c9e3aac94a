// dflash.cpp — the in-process host collective (see collective.hpp).
//
// One all-reduce is two barriers: every rank posts its buffer and meets the others; rank r then
// sums the elements of its chunk [r·n/D, (r+1)·n/D) over all buffers in rank order and writes the
// sum into every buffer (chunks are disjoint, so no two ranks touch the same element); the second
// barrier keeps every buffer alive and unread until all chunks are written.
#include "train/collective.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dflash {

namespace {

class LocalMember final : public Collective {
 public:
  LocalMember(std::shared_ptr<LocalCollectiveGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void all_reduce_sum(float* data, int64_t n) override { group_->all_reduce(rank_, data, n); }
  void all_reduce_sum_host(std::span<double> values) override {
    group_->all_reduce(rank_, values.data(), static_cast<int64_t>(values.size()));
  }
  std::string describe() const override {
    return fmt::format("local ({} ranks, host memory)", group_->size());
  }

 private:
  std::shared_ptr<LocalCollectiveGroup> group_;
  int rank_;
};

}  // namespace

std::unique_ptr<Collective> CollectiveGroup::host_member(int) {
  fail("a {} collective cannot serve drafter replicas on the host (cpu backend)", kind());
}

std::shared_ptr<LocalCollectiveGroup> LocalCollectiveGroup::create(int size) {
  DFLASH_CHECK(size >= 1, "collective: a group needs at least one rank, got {}", size);
  return std::shared_ptr<LocalCollectiveGroup>(new LocalCollectiveGroup(size));
}

LocalCollectiveGroup::LocalCollectiveGroup(int size)
    : size_(size),
      handed_out_(static_cast<size_t>(size), false),
      buffers_(static_cast<size_t>(size), nullptr),
      sizes_(static_cast<size_t>(size), 0) {}

std::unique_ptr<Collective> LocalCollectiveGroup::member(int rank) {
  std::lock_guard<std::mutex> lk(mu_);
  DFLASH_CHECK(rank >= 0 && rank < size_, "collective: rank {} outside a group of {}", rank, size_);
  DFLASH_CHECK(!handed_out_[static_cast<size_t>(rank)], "collective: rank {} taken twice", rank);
  handed_out_[static_cast<size_t>(rank)] = true;
  return std::make_unique<LocalMember>(shared_from_this(), rank);
}

void LocalCollectiveGroup::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!aborted_) abort_reason_ = reason;
  aborted_ = true;
  cv_.notify_all();
}

void LocalCollectiveGroup::barrier() {
  std::unique_lock<std::mutex> lk(mu_);
  DFLASH_CHECK(!aborted_, "collective aborted: {}", abort_reason_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lk, [&] { return generation_ != gen || aborted_; });
  DFLASH_CHECK(generation_ != gen, "collective aborted: {}", abort_reason_);
}

template <typename T>
void LocalCollectiveGroup::all_reduce(int rank, T* data, int64_t n) {
  const auto r = static_cast<size_t>(rank);
  {
    std::lock_guard<std::mutex> lk(mu_);
    buffers_[r] = data;
    sizes_[r] = n;
  }
  barrier();
  for (int q = 1; q < size_; ++q) {
    DFLASH_CHECK(sizes_[static_cast<size_t>(q)] == sizes_[0],
                 "collective: rank {} reduces {} values, rank 0 {}", q,
                 sizes_[static_cast<size_t>(q)], sizes_[0]);
  }
  const int64_t begin = n * rank / size_, end = n * (rank + 1) / size_;
  for (int64_t i = begin; i < end; ++i) {
    T sum = static_cast<T*>(buffers_[0])[i];
    for (int q = 1; q < size_; ++q) sum += static_cast<T*>(buffers_[static_cast<size_t>(q)])[i];
    for (int q = 0; q < size_; ++q) static_cast<T*>(buffers_[static_cast<size_t>(q)])[i] = sum;
  }
  barrier();
}

template void LocalCollectiveGroup::all_reduce<float>(int, float*, int64_t);
template void LocalCollectiveGroup::all_reduce<double>(int, double*, int64_t);

}  // namespace dflash
