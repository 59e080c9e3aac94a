// dflash.cpp — fork-join helper (see parallel.hpp for the invariants).
#include "core/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

namespace dflash {

namespace {
int default_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hc == 0 ? 1u : hc, 1u, 16u));
}
std::atomic<int> g_threads{0};
}  // namespace

int parallel_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : default_threads();
}

void set_parallel_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(min_chunk, 1);
  int64_t workers = std::min<int64_t>(parallel_threads(), (n + min_chunk - 1) / min_chunk);
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  auto run = [&](int64_t w) {
    int64_t begin = n * w / workers, end = n * (w + 1) / workers;
    try {
      if (begin < end) fn(begin, end);
    } catch (...) {
      errors[static_cast<size_t>(w)] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(run, w);
  run(0);
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace dflash
