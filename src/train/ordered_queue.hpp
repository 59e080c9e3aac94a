// dflash.cpp — the bounded queue between target workers and one drafter worker.
//
// Items carry sequence numbers first, first+1, … (a drafter replica's steps); several producers
// put them in any order, the one consumer takes them in sequence order.
//
// Invariants: item `seq` is accepted only when next ≤ seq < next + capacity (next = the sequence
// number the consumer takes next), so at most `capacity` items are held and a producer that runs
// ahead waits; the item the consumer needs is always admissible, so producers that each put their
// own items in increasing order never deadlock. close() (any thread) wakes every waiter; put()
// then drops its item and returns false, take() returns nothing. Everything is under one mutex.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "core/error.hpp"

namespace dflash {

/// See the file comment.
template <typename T>
class OrderedQueue {
 public:
  /// A queue whose first item is `first`, holding at most `capacity` ≥ 1 items.
  OrderedQueue(int64_t first, int capacity) : next_(first), slots_(static_cast<size_t>(capacity)) {
    DFLASH_CHECK(capacity >= 1, "queue capacity must be at least 1, got {}", capacity);
  }

  /// Puts item `seq`, waiting while it is too far ahead of the consumer. Returns false (and drops
  /// the item) when the queue was closed. Throws dflash::Error for a sequence number already
  /// taken or put.
  bool put(int64_t seq, T item) {
    std::unique_lock<std::mutex> lk(mu_);
    DFLASH_CHECK(seq >= next_, "queue: item {} put after item {} was taken", seq, next_ - 1);
    cv_.wait(lk, [&] { return closed_ || seq < next_ + capacity(); });
    if (closed_) return false;
    auto& slot = slots_[index(seq)];
    DFLASH_CHECK(!slot.has_value(), "queue: item {} put twice", seq);
    slot.emplace(std::move(item));
    ++held_;
    cv_.notify_all();
    return true;
  }

  /// Takes the next item in sequence order, waiting until it is there. Returns nothing when the
  /// queue was closed.
  std::optional<T> take() {
    std::unique_lock<std::mutex> lk(mu_);
    auto& slot = slots_[index(next_)];
    cv_.wait(lk, [&] { return closed_ || slot.has_value(); });
    if (closed_) return std::nullopt;
    std::optional<T> out = std::move(slot);
    slot.reset();
    --held_;
    ++next_;
    cv_.notify_all();
    return out;
  }

  /// Wakes every waiter; later put()/take() calls fail at once. Held items are destroyed with the
  /// queue.
  void close() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    cv_.notify_all();
  }

  /// Destroys every held item (on the calling thread); call after close().
  void clear() {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& slot : slots_) slot.reset();
    held_ = 0;
  }

  /// Items held now (put and not yet taken).
  int held() const {
    std::lock_guard<std::mutex> lk(mu_);
    return held_;
  }
  int capacity() const { return static_cast<int>(slots_.size()); }

 private:
  size_t index(int64_t seq) const {
    return static_cast<size_t>(seq % static_cast<int64_t>(slots_.size()));
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_;
  std::vector<std::optional<T>> slots_;
  int held_ = 0;
  bool closed_ = false;
};

}  // namespace dflash
