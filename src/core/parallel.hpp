// dflash.cpp — a tiny fork-join helper for the CPU backend, on a persistent thread pool.
//
// Invariants: `parallel_for` splits [0, n) into contiguous chunks, one per worker, and returns when
// all chunks are done. The chunks depend only on n, min_chunk and parallel_threads(); each is
// run by whichever thread claims it first, the caller or a pool thread (pool threads live for the
// whole process: no thread is created per call; idle threads sleep), so a chunk computes the same
// whatever thread runs it and the caller never waits for a thread that has not started. A
// parallel_for issued from inside a chunk, or while another thread's job holds the pool, runs
// the same chunks one after another on its calling thread. Each index is processed by exactly
// one chunk, so an op whose per-index work writes only its own outputs gives bit-identical
// results for any thread count. Ops must never reduce floats across chunks (no shared
// accumulators); reductions over a parallel axis are done serially afterwards, in index order.
// Exceptions thrown by a chunk are rethrown in the caller (the first one, by chunk order) after
// all chunks ran.
#pragma once

#include <cstdint>
#include <functional>

namespace dflash {

/// Number of worker threads `parallel_for` uses (≥ 1). Default: the hardware concurrency capped
/// at 16; can be changed with `set_parallel_threads` (e.g. by tests checking determinism).
int parallel_threads();
/// Sets the worker count for later `parallel_for` calls; `n ≤ 0` restores the default.
/// Not thread-safe against concurrent `parallel_for` calls: call it at start-up or in tests.
void set_parallel_threads(int n);

/// Runs `fn(begin, end)` on contiguous chunks that cover [0, n): W = min(parallel_threads(),
/// ceil(n / min_chunk)) chunks of near-equal size (chunk w is [n·w/W, n·(w+1)/W)), so a loop of
/// fewer than 2·min_chunk indices runs inline on the calling thread. The calling thread takes
/// chunks too (the first, typically).
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                  int64_t min_chunk = 1);

}  // namespace dflash
