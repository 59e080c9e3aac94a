// dflash.cpp — fork-join helper on a persistent worker pool (see parallel.hpp for the invariants).
//
// The pool holds parallel_threads() − 1 threads, started on the first parallel call and restarted
// when the thread count changes. A job's chunks are claimed, not assigned: the caller and the pool
// threads take the next unclaimed chunk from one atomic word until none is left, so the caller
// never waits for a thread that has not started (on a loaded machine a sleeping or preempted
// thread simply gets no chunk) and only waits for chunks already running. Which thread runs a
// chunk never changes what the chunk computes. The claim word packs (job number, chunk count,
// next chunk), so a thread that wakes late cannot claim a chunk of a job it did not see
// published: its compare-and-swap fails once the job number moved on. Job parameters are
// written before the job is published and stay untouched until all its chunks are done.
// Waiting threads spin briefly (kSpin: the ops of a step follow each other within microseconds),
// then sleep in std::atomic::wait (a futex on Linux), so an idle process uses no CPU.
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

// The hardware concurrency capped at 16, read once: std::thread::hardware_concurrency() is glibc's
// get_nprocs(), which opens and reads /sys/devices/system/cpu/online on every call (three system
// calls per parallel_for, most of `dflash eval`'s system time before it was cached).
int default_threads() {
  static const int n = [] {
    const unsigned hc = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp(hc == 0 ? 1u : hc, 1u, 16u));
  }();
  return n;
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

// The claim word: job number (32 bits) | chunk count (16 bits) | next unclaimed chunk (16 bits).
constexpr uint64_t claim_word(uint32_t job, uint64_t chunks, uint64_t next) {
  return uint64_t(job) << 32 | chunks << 16 | next;
}
constexpr uint32_t claim_job(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
constexpr int64_t claim_chunks(uint64_t w) { return static_cast<int64_t>((w >> 16) & 0xffff); }
constexpr int64_t claim_next(uint64_t w) { return static_cast<int64_t>(w & 0xffff); }

class Pool {
 public:
  // Runs the `workers` chunks of [0, n) on the caller and the pool threads (whoever claims them
  // first). Returns false (nothing run) when another thread holds the pool.
  bool try_run(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t workers) {
    std::unique_lock lock(submit_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    const int want = parallel_threads();
    if (static_cast<int>(threads_.size()) + 1 != want) restart(want);
    fn_ = &fn;
    n_ = n;
    errors_.assign(static_cast<size_t>(workers), nullptr);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t job = ++job_;
    claim_.store(claim_word(job, static_cast<uint64_t>(workers), 0), std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);
    wake_.notify_all();
    t_inside_job = true;
    run_claimed(job);
    t_inside_job = false;
    for (uint32_t d = done_.load(std::memory_order_acquire); d != workers;
         d = done_.load(std::memory_order_acquire)) {
      wait_change(done_, d);
    }
    fn_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
    return true;
  }

 private:
  // Claims and runs chunks of job `job` until none is left (or the job is over).
  void run_claimed(uint32_t job) {
    uint64_t w = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (claim_job(w) != job || claim_next(w) >= claim_chunks(w)) return;
      if (!claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        continue;  // w now holds the current word
      }
      const int64_t chunk = claim_next(w), chunks = claim_chunks(w);
      try {
        run_chunk(*fn_, n_, chunks, chunk);
      } catch (...) {
        errors_[static_cast<size_t>(chunk)] = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) done_.notify_one();
      w = claim_.load(std::memory_order_acquire);
    }
  }

  // `seen`: the wake count before the thread was started (a job published while the thread
  // starts up must not be missed).
  void worker_loop(uint32_t seen) {
    t_inside_job = true;
    for (;;) {
      seen = wait_change(wake_, seen);
      if (stopping_.load(std::memory_order_acquire)) return;
      run_claimed(claim_job(claim_.load(std::memory_order_acquire)));
    }
  }

  void restart(int threads) {
    stop();
    stopping_.store(false, std::memory_order_relaxed);
    threads_.reserve(static_cast<size_t>(threads - 1));
    const uint32_t seen = wake_.load(std::memory_order_relaxed);
    for (int i = 1; i < threads; ++i) threads_.emplace_back([this, seen] { worker_loop(seen); });
  }

  void stop() {
    if (threads_.empty()) return;
    stopping_.store(true, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  std::mutex submit_;  // one job at a time
  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> errors_;  // per chunk
  uint32_t job_ = 0;                        // number of the last job published (caller only)
  std::atomic<uint64_t> claim_{0};          // claim_word(job, chunks, next)
  std::atomic<uint32_t> wake_{0};           // bumped once per job (and to stop); threads wait on it
  std::atomic<uint32_t> done_{0};           // chunks of the current job finished
  std::atomic<bool> stopping_{false};
  // The current job, written before it is published and untouched until all its chunks are done.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
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
