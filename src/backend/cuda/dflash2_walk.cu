// dflash.cpp — CUDA kernels of DFlash2's selector walk in the decoder (semantics:
// src/ops/dflash2_walk.hpp). Two launches: the rows kernel, one block per drafted row (ū in
// place, the top-K of backend/cuda/dflash2_topk.cuh, P_h·h by one warp per rank coordinate and the
// warp's fixed butterfly, the zeros of the q row); the walk kernel, one block per request, its
// slots in order (the scores in parallel, one thread per candidate with its rank sum in order;
// the choice, the softmax sum and the draw by thread 0 in a fixed order). Deterministic: no float
// atomics. No fmt in this file (nvcc).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/dflash2_topk.cuh"
#include "backend/cuda/dflash2_walk_launch.hpp"
#include "core/philox.hpp"

namespace dflash::cuda {
namespace {

constexpr int kThreads = kDflash2TopKThreads;

__device__ __forceinline__ float unary_of(float z, float m, float cap) {
  const float x = m * z;
  return cap > 0.f ? cap * tanhf(x / cap) : x;
}

// What dflash2_top_k needs (its Sh).
struct RowShared {
  uint32_t key[kDflash2WalkMaxTopK];
  int32_t id[kDflash2WalkMaxTopK];
  uint32_t hist[256];
  int32_t redi[kThreads / 32];
  uint32_t prefix, mask;
  int32_t remaining, count;
};

// One block per drafted row i = b·K + k, k ≥ 1.
__global__ void __launch_bounds__(kThreads) walk_rows_kernel(Dflash2WalkArgs a) {
  __shared__ RowShared sh;
  const int64_t b = blockIdx.x / (a.K - 1), k = blockIdx.x % (a.K - 1) + 1;
  const int64_t i = b * a.K + k, V = a.V, H = a.H, r = a.r;
  const int tid = threadIdx.x;
  float* u = a.logits + i * V;
  for (int64_t v = tid; v < V; v += kThreads) u[v] = unary_of(u[v], a.m, a.cap);
  if (a.q) {
    float* q = a.q + i * V;
    for (int64_t v = tid; v < V; v += kThreads) q[v] = 0.f;
  }
  __syncthreads();
  dflash2_top_k(u, V, a.top_k, sh);  // ends with a barrier: sh.id is complete
  for (int j = tid; j < a.top_k; j += kThreads) {
    a.cand[i * a.top_k + j] = sh.id[j];
    a.cand_u[i * a.top_k + j] = u[sh.id[j]];
  }
  const uint16_t* h = a.hf + i * H;
  const int lane = tid & 31, warp = tid >> 5;
  for (int64_t q = warp; q < r; q += kThreads / 32) {
    float acc = 0.f;
    for (int64_t c = lane; c < H; c += 32) acc += a.Ph[q * H + c] * to_f32(h[c]);
    acc = warp_sum(acc);
    if (lane == 0) a.proj[i * r + q] = acc;
  }
}

struct WalkShared {
  float e[kDflash2WalkMaxRank];  // A[prev] ⊙ P_h·h
  float s[kDflash2WalkMaxTopK];  // the scores, then (sampled) q of each candidate
  int32_t id[kDflash2WalkMaxTopK];
  float qs[kDflash2WalkMaxTopK];  // q sorted by id (with ids)
  int32_t ids[kDflash2WalkMaxTopK];
  int32_t prev;
};

// Sorts ids[0, n) ascending with their qs (bitonic over the next power of two; pads sort last).
__device__ void sort_by_id(WalkShared& sh, int n) {
  const int tid = threadIdx.x;
  int np = 1;
  while (np < n) np <<= 1;
  for (int j = n + tid; j < np; j += kThreads) sh.ids[j] = 0x7fffffff, sh.qs[j] = 0.f;
  __syncthreads();
  for (int k = 2; k <= np; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int x = tid; x < np; x += kThreads) {
        const int o = x ^ j;
        if (o <= x) continue;
        const bool up = (x & k) == 0;
        if (up ? sh.ids[o] < sh.ids[x] : sh.ids[x] < sh.ids[o]) {
          const int32_t ti = sh.ids[x];
          const float tq = sh.qs[x];
          sh.ids[x] = sh.ids[o], sh.qs[x] = sh.qs[o];
          sh.ids[o] = ti, sh.qs[o] = tq;
        }
      }
      __syncthreads();
    }
  }
}

// One block per request b: slots 1..K−1 in order.
__global__ void __launch_bounds__(kThreads) walk_kernel(Dflash2WalkArgs a) {
  __shared__ WalkShared sh;
  const int64_t b = blockIdx.x, r = a.r;
  const int Kc = a.top_k, tid = threadIdx.x;
  const bool sampled = a.q != nullptr;
  if (tid == 0) sh.prev = a.block[b * a.K];  // prev₁: the anchor
  __syncthreads();
  for (int64_t k = 1; k < a.K; ++k) {
    const int64_t i = b * a.K + k;
    const float* A = a.A + static_cast<int64_t>(sh.prev) * r;
    for (int64_t q = tid; q < r; q += kThreads) sh.e[q] = A[q] * a.proj[i * r + q];
    __syncthreads();
    for (int j = tid; j < Kc; j += kThreads) {
      const int32_t c = a.cand[i * Kc + j];
      const float* bs = a.Bs + static_cast<int64_t>(c) * r;
      float dot = 0.f;
      for (int64_t q = 0; q < r; ++q) dot += sh.e[q] * bs[q];
      sh.s[j] = a.cand_u[i * Kc + j] + dot;
      sh.id[j] = c;
    }
    __syncthreads();
    if (!sampled) {
      if (tid == 0) {
        int best = 0;
        for (int j = 1; j < Kc; ++j)
          if (sh.s[j] > sh.s[best]) best = j;
        a.block[i] = sh.id[best];
        sh.prev = sh.id[best];
      }
      __syncthreads();
      continue;
    }
    // Sampled: q on C (thread 0, candidates in C's order, as the CPU's dflash2_sampling_probs).
    if (tid == 0) {
      const float tau = a.params->inv_temperature;
      float mx = -INFINITY;
      bool nan = false;
      for (int j = 0; j < Kc; ++j) {
        nan = nan || isnan(sh.s[j]);
        mx = fmaxf(mx, sh.s[j]);
      }
      mx *= tau;
      float z = 0.f;
      for (int j = 0; j < Kc; ++j) z += expf(sh.s[j] * tau - mx);
      for (int j = 0; j < Kc; ++j) {
        sh.qs[j] = expf(sh.s[j] * tau - mx) / z;
        sh.ids[j] = sh.id[j];
      }
      if (nan) {
        a.status[b] = kSampleStatusNan;
      } else if (!isfinite(mx)) {
        a.status[b] = kSampleStatusNoFinite;
      }
    }
    __syncthreads();
    for (int j = tid; j < Kc; j += kThreads) a.q[i * a.V + sh.ids[j]] = sh.qs[j];
    sort_by_id(sh, Kc);
    if (tid == 0) {
      // ops/sample.hpp's draw over the candidates by id (the other entries of the row are 0).
      double total = 0;
      for (int j = 0; j < Kc; ++j)
        if (sh.qs[j] > 0.f) total += sh.qs[j];
      const double u = philox_uniform(a.seeds[b], static_cast<uint32_t>(a.steps[b]),
                                      static_cast<uint32_t>(k), PhiloxPurpose::draft);
      const double target = u * total;
      int32_t pick = -1, last = -1;
      double acc = 0;
      for (int j = 0; j < Kc && pick < 0; ++j) {
        if (!(sh.qs[j] > 0.f)) continue;
        acc += sh.qs[j];
        last = sh.ids[j];
        if (target < acc) pick = sh.ids[j];
      }
      if (pick < 0) pick = last;      // past the end by rounding: the last of weight > 0
      if (pick < 0) pick = sh.id[0];  // no weight at all: the status is set
      a.block[i] = pick;
      sh.prev = pick;
    }
    __syncthreads();
  }
}

}  // namespace

namespace launch {

void dflash2_walk_rows(const Dflash2WalkArgs& a, cudaStream_t s) {
  walk_rows_kernel<<<static_cast<unsigned>(a.B * (a.K - 1)), kThreads, 0, s>>>(a);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_walk(const Dflash2WalkArgs& a, cudaStream_t s) {
  walk_kernel<<<static_cast<unsigned>(a.B), kThreads, 0, s>>>(a);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
