// dflash.cpp — a tiny fork-join helper for the CPU backend.
//
// Invariants: `parallel_for` splits [0, n) into contiguous chunks, one per worker, and returns when
// all chunks are done. Each index is processed by exactly one worker, so an op whose per-index work
// writes only its own outputs gives bit-identical results for any thread count. Ops must never
// reduce floats across workers (no shared accumulators); reductions over a parallel axis are done
// serially afterwards, in index order. Exceptions thrown by a worker are rethrown in the caller
// (the first one, by chunk order).
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

/// Runs `fn(begin, end)` on contiguous chunks that cover [0, n). Chunks have at least `min_chunk`
/// indices (so tiny loops run inline on the calling thread). The calling thread runs the first
/// chunk itself.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                  int64_t min_chunk = 1);

}  // namespace dflash
