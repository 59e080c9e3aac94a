// dflash.cpp — a CPU emulator of the CUDA execution model, just wide enough to run the tensor-core
// attention kernels (src/backend/cuda/attention_tc.cuh) in tests without a GPU.
//
// Model. A launch runs its CTAs one after the other; the threads of a CTA are fibers
// (makecontext/swapcontext) on the calling thread, switched only at barriers, so a run is
// deterministic. __syncthreads() waits for every thread of the CTA that has not exited; a warp
// collective (shuffle, vote, reduce, ldmatrix, mma) waits for the 32 lanes of the warp, which
// must all call the same collective (the kernels' control flow around collectives is
// warp-uniform). A barrier no thread can pass (divergent collectives, a __syncthreads some
// thread skips) aborts with a message. cp.async copies are queued per thread and land at the
// cp.async.wait_group that covers them, so reading a tile before its wait sees stale data.
// Instruction semantics follow the PTX ISA: mma.m16n8k16 (bf16 in, fp32 accumulation in k order),
// ldmatrix .x4 with and without .trans, cp.async with zero fill.
// Not modelled: timing, memory races between fibers of one CTA (racecheck on the GPU covers
// those), more than one CTA in flight.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>

namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

/// The running thread's indices and the launch's sizes (valid inside a kernel).
const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& grid_dim();
const Dim3& block_dim();
/// The running CTA's dynamic shared memory (128-byte aligned, poisoned with 0xA5 per CTA).
char* dynamic_smem();

/// Runs `kernel` on every CTA of `grid` with `block` threads each and `smem_bytes` of dynamic
/// shared memory. Aborts (with a message) on a deadlock.
void launch(Dim3 grid, Dim3 block, int smem_bytes, const std::function<void()>& kernel);

// ---- block and warp collectives
void syncthreads();
/// Every lane's n bytes of `mine`, in lane order, into `all` (a warp barrier); n ≤ 64.
void warp_exchange(const void* mine, int n, void* all /* 32·n bytes */);

// ---- cp.async
void cp_async16(void* smem, const void* src, bool pred);
void cp_async_commit();
void cp_async_wait(int pending);

}  // namespace emu
