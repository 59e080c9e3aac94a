// dflash.cpp — the top-K candidates of DFlash2's selector on the device, shared by the training
// row kernel (dflash2_selector.cu) and the decoder's walk (dflash2_walk.cu): a radix select over
// order-preserving keys (4 passes of 8 bits; histogram counts are integers, so the order of their
// atomic adds changes nothing), the candidates above the threshold, then those equal to it in
// index order (a block scan), a bitonic sort by (ū descending, id ascending) — the order of the
// CPU's dflash2_topk (model/dflash2_selector.hpp).
//
// Invariants: one block of kDflash2TopKThreads threads per row; the result depends on the row's
// values only (no float atomics). No fmt in this header (nvcc).
#pragma once

#include <cstdint>

namespace dflash::cuda {

/// Threads of a block that calls dflash2_top_k (one histogram bin each).
constexpr int kDflash2TopKThreads = 256;

// Larger float ↔ larger key (−0 counts as +0, as the CPU's comparisons do).
__device__ __forceinline__ uint32_t dflash2_order_key(float f) {
  const uint32_t b = __float_as_uint(f == 0.f ? 0.f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Whether candidate a comes before b: larger key, then lower id.
__device__ __forceinline__ bool dflash2_before(uint32_t ka, int32_t ia, uint32_t kb, int32_t ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// The top-K of ū (row u [V]) into sh.key/sh.id [K], sorted (dflash2_before). All
// kDflash2TopKThreads threads of the block call it. Sh: shared memory with uint32_t key[≥ Kp],
// int32_t id[≥ Kp] (Kp = K rounded up to a power of two), uint32_t hist[256],
// int32_t redi[kDflash2TopKThreads / 32], uint32_t prefix, mask, int32_t remaining, count.
template <typename Sh>
__device__ void dflash2_top_k(const float* u, int64_t V, int K, Sh& sh) {
  const int tid = threadIdx.x;
  if (tid == 0) sh.prefix = 0, sh.mask = 0, sh.remaining = K;
  for (int shift = 24; shift >= 0; shift -= 8) {
    sh.hist[tid] = 0;  // kDflash2TopKThreads == 256 bins
    __syncthreads();
    const uint32_t prefix = sh.prefix, mask = sh.mask;
    for (int64_t v = tid; v < V; v += kDflash2TopKThreads) {
      const uint32_t k = dflash2_order_key(u[v]);
      if ((k & mask) == prefix) atomicAdd(&sh.hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {  // the bin holding the remaining-th largest, from the top
      uint32_t above = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (above + sh.hist[b] >= static_cast<uint32_t>(sh.remaining)) break;
        above += sh.hist[b];
      }
      sh.remaining -= static_cast<int32_t>(above);
      sh.prefix |= static_cast<uint32_t>(b) << shift;
      sh.mask |= 255u << shift;
    }
    __syncthreads();
  }
  const uint32_t thr = sh.prefix;
  const int take_equal = sh.remaining;  // keys == thr to take, the lowest ids first
  if (tid == 0) sh.count = 0;
  __syncthreads();
  for (int64_t v = tid; v < V; v += kDflash2TopKThreads) {
    const uint32_t k = dflash2_order_key(u[v]);
    if (k > thr) {
      const int p = atomicAdd(&sh.count, 1);
      sh.key[p] = k;
      sh.id[p] = static_cast<int32_t>(v);
    }
  }
  __syncthreads();
  const int first_equal = sh.count;  // K − take_equal
  int taken = 0;
  const int lane = tid & 31, warp = tid >> 5;
  for (int64_t tile = 0; tile < V && taken < take_equal; tile += kDflash2TopKThreads) {
    const int64_t v = tile + tid;
    const bool eq = v < V && dflash2_order_key(u[v]) == thr;
    const unsigned ballot = __ballot_sync(0xffffffffu, eq);
    if (lane == 0) sh.redi[warp] = __popc(ballot);
    __syncthreads();
    int before_me = __popc(ballot & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < kDflash2TopKThreads / 32; ++w) {
      if (w < warp) before_me += sh.redi[w];
      total += sh.redi[w];
    }
    if (eq && taken + before_me < take_equal) {
      sh.key[first_equal + taken + before_me] = thr;
      sh.id[first_equal + taken + before_me] = static_cast<int32_t>(v);
    }
    taken += total;
    __syncthreads();
  }
  // Bitonic sort of the next power of two, padded with entries that sort last.
  int Kp = 1;
  while (Kp < K) Kp <<= 1;
  for (int i = K + tid; i < Kp; i += kDflash2TopKThreads) sh.key[i] = 0, sh.id[i] = 0x7fffffff;
  __syncthreads();
  for (int k = 2; k <= Kp; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < Kp; i += kDflash2TopKThreads) {
        const int o = i ^ j;
        if (o <= i) continue;
        const bool up = (i & k) == 0;
        const bool swap = up ? dflash2_before(sh.key[o], sh.id[o], sh.key[i], sh.id[i])
                             : dflash2_before(sh.key[i], sh.id[i], sh.key[o], sh.id[o]);
        if (swap) {
          const uint32_t tk = sh.key[i];
          const int32_t ti = sh.id[i];
          sh.key[i] = sh.key[o], sh.id[i] = sh.id[o];
          sh.key[o] = tk, sh.id[o] = ti;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace dflash::cuda
