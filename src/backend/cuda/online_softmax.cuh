// dflash.cpp — the online softmax state of one row's values, shared by the row kernels of the
// DSpark and Domino heads (dspark_head.cu, domino_head.cu): the running max m, Σ exp(x − m)
// rescaled when the max grows (Milakov & Gimelshein 2018, "Online normalizer calculation for
// softmax"), and the first index of the largest value (bv, bi: argmax with the lowest index on
// ties).
//
// Invariants: merging is order-dependent only in float rounding, and online_block merges the
// warps of a block in warp order, so a fixed launch gives the same bits every run; −∞ values add
// nothing to s.
#pragma once

#include <climits>
#include <cmath>

namespace dflash::cuda {

struct Online {
  float m, s, bv;
  int bi;
};
__device__ __forceinline__ Online online_empty() {
  return {-INFINITY, 0.f, -INFINITY, INT_MAX};
}
__device__ __forceinline__ void online_add(Online& a, float x, int v) {
  if (x > a.bv || (x == a.bv && v < a.bi)) a.bv = x, a.bi = v;
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;
    a.m = x;
  } else {
    a.s += x == -INFINITY ? 0.f : expf(x - a.m);
  }
}
__device__ __forceinline__ void online_merge(Online& a, const Online& b) {
  if (b.bv > a.bv || (b.bv == a.bv && b.bi < a.bi)) a.bv = b.bv, a.bi = b.bi;
  const float M = fmaxf(a.m, b.m);
  const float sa = a.m == M ? a.s : a.s * expf(a.m - M);
  const float sb = b.m == M ? b.s : b.s * expf(b.m - M);
  a.s = sa + sb;
  a.m = M;
}
// The block's merged state (warps in order); every thread gets it. `sh` holds 32 states.
__device__ __forceinline__ Online online_block(Online st, Online* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Online b;
    b.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    b.bv = __shfl_xor_sync(0xffffffffu, st.bv, o);
    b.bi = __shfl_xor_sync(0xffffffffu, st.bi, o);
    online_merge(st, b);
  }
  __syncthreads();
  if (lane == 0) sh[warp] = st;
  __syncthreads();
  st = sh[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) online_merge(st, sh[w]);
  return st;
}

}  // namespace dflash::cuda
