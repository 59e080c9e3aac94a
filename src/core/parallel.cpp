// dflash.cpp — fork-join helper on a persistent worker pool (see parallel.hpp for the invariants).
//
// The pool holds parallel_threads() − 1 threads, started on the first parallel call and restarted
// when the thread count changes. A job is published by bumping `generation_`; every pool thread
// acknowledges every job (those without a chunk just count down), so no thread can mistake one
// job's parameters for another's. Waiting threads spin briefly (kSpin: ops of a step follow each
// other within microseconds), then sleep in std::atomic::wait (a futex on Linux), so an idle
// process uses no CPU.
#include "core/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dflash {

namespace {

int default_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hc == 0 ? 1u : hc, 1u, 16u));
}
std::atomic<int> g_threads{0};

// Set on pool threads, and on a caller while its job runs: a parallel_for from inside a job runs
// its chunks inline instead of waiting for threads that are busy with the outer job.
thread_local bool t_inside_job = false;

// How long a waiting thread polls before it sleeps.
constexpr std::chrono::microseconds kSpin{50};

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Waits until `a` differs from `old`: polls for kSpin, then sleeps on the atomic.
uint32_t wait_change(const std::atomic<uint32_t>& a, uint32_t old) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    const uint32_t v = a.load(std::memory_order_acquire);
    if (v != old) return v;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() - t0 > kSpin) break;
  }
  for (;;) {
    a.wait(old, std::memory_order_acquire);
    const uint32_t v = a.load(std::memory_order_acquire);
    if (v != old) return v;
  }
}

// Runs chunk `w` of `workers` over [0, n): indices [n·w/workers, n·(w+1)/workers).
void run_chunk(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t workers,
               int64_t w) {
  const int64_t begin = n * w / workers, end = n * (w + 1) / workers;
  if (begin < end) fn(begin, end);
}

// Runs every chunk on the calling thread, in order (the same chunks the pool would run, so the
// same results), rethrowing the first chunk's exception.
void run_inline(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t workers) {
  for (int64_t w = 0; w < workers; ++w) run_chunk(fn, n, workers, w);
}

class Pool {
 public:
  ~Pool() { stop(); }

  // Runs the `workers` chunks of [0, n): chunk 0 on the caller, chunk w on pool thread w − 1.
  // Returns false (nothing run) when another thread holds the pool.
  bool try_run(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t workers) {
    std::unique_lock lock(submit_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    const int want = parallel_threads();
    if (static_cast<int>(threads_.size()) + 1 != want) restart(want);
    if (workers > static_cast<int64_t>(threads_.size()) + 1)
      return run_locked_inline(fn, n, workers);
    fn_ = &fn;
    n_ = n;
    workers_ = workers;
    for (auto& e : errors_) e = nullptr;
    pending_.store(static_cast<uint32_t>(threads_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    t_inside_job = true;
    try {
      run_chunk(fn, n, workers, 0);
    } catch (...) {
      errors_[0] = std::current_exception();
    }
    t_inside_job = false;
    for (uint32_t left = pending_.load(std::memory_order_acquire); left != 0;
         left = pending_.load(std::memory_order_acquire)) {
      wait_change(pending_, left);
    }
    fn_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
    return true;
  }

 private:
  bool run_locked_inline(const std::function<void(int64_t, int64_t)>& fn, int64_t n,
                         int64_t workers) {
    t_inside_job = true;
    try {
      run_inline(fn, n, workers);
    } catch (...) {
      t_inside_job = false;
      throw;
    }
    t_inside_job = false;
    return true;
  }

  // `seen`: the generation before the thread was started (a job published while the thread
  // starts up must not be missed).
  void worker_loop(int64_t index, uint32_t seen) {
    t_inside_job = true;
    for (;;) {
      seen = wait_change(generation_, seen);
      if (stopping_.load(std::memory_order_acquire)) return;
      if (index < workers_) {
        try {
          run_chunk(*fn_, n_, workers_, index);
        } catch (...) {
          errors_[static_cast<size_t>(index)] = std::current_exception();
        }
      }
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
    }
  }

  void restart(int threads) {
    stop();
    stopping_.store(false, std::memory_order_relaxed);
    errors_.assign(static_cast<size_t>(threads), nullptr);
    threads_.reserve(static_cast<size_t>(threads - 1));
    const uint32_t seen = generation_.load(std::memory_order_relaxed);
    for (int64_t i = 1; i < threads; ++i) {
      threads_.emplace_back([this, i, seen] { worker_loop(i, seen); });
    }
  }

  void stop() {
    if (threads_.empty()) return;
    stopping_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  std::mutex submit_;  // one job at a time
  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> errors_;  // per chunk
  std::atomic<uint32_t> generation_{0};     // bumped once per job (and to stop)
  std::atomic<uint32_t> pending_{0};        // pool threads yet to finish the current job
  std::atomic<bool> stopping_{false};
  // The current job, written before generation_ is bumped (read by workers after they see it).
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, workers_ = 0;
};

Pool& pool() {
  // Never destroyed: pool threads may outlive static destructors of other translation units
  // that still run parallel code; the process exit ends them.
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

int parallel_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : default_threads();
}

void set_parallel_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(min_chunk, 1);
  const int64_t workers = std::min<int64_t>(parallel_threads(), (n + min_chunk - 1) / min_chunk);
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  if (t_inside_job || !pool().try_run(fn, n, workers)) run_inline(fn, n, workers);
}

}  // namespace dflash
