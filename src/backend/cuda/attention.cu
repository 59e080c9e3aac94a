// dflash.cpp — CUDA attention over per-query key ranges (semantics: src/ops/attention.hpp).
//
// Tiled, never O(Tq·Tk) memory: a block takes 16 query rows of one head (forward, dq) or 32 keys of
// one KV head (dk, dv) and streams the other side through shared memory in tiles of 32 keys / 32
// query rows. The key tiles a query block visits are the union of its rows' first ranges and the
// union of their second ranges (merged when they touch); inside a tile each row masks the keys it
// does not see. Masked keys are never mixed into a result (selects, not multiplications by zero),
// so keys outside every row's ranges may hold anything, even NaN.
// Storage: q, k, v, o, dout, dq, dk, dv bf16; lse and Δ = rowsum(dO∘O) f32; all arithmetic fp32.
// Forward: online softmax (FlashAttention-2, Dao 2023, Algorithm 1). Backward: Algorithm 2 split
// into a dq pass over query blocks and a dk/dv pass over key blocks; each output element is
// owned by one thread and summed in a fixed order (rows ascending, heads ascending) — no atomics,
// so the results are bit-reproducible.
// Head dimensions 64 and 128 are instantiated (the entry point rejects others).
// Sinks (AttnParams::sinks, gpt-oss): the forward folds head h's sink logit into each row's online
// softmax after the last key tile (one more term of the denominator, no value row), so lse
// includes it and the backward needs no change.
#include <cmath>

#include "backend/cuda/attention_launch.hpp"
#include "backend/cuda/common.cuh"

namespace dflash::cuda {
namespace {

constexpr int kBQ = 16;        // query rows per block (forward, dq): 4 warps × 4 rows
constexpr int kRowsPerWarp = 4;
constexpr int kBK = 32;        // keys per tile (one per lane)
constexpr int kKvWarps = 8;    // dk/dv block: 8 warps, one (row, head) item each per batch

struct Range {
  int lo1, hi1, lo2, hi2;
};

__device__ __forceinline__ Range clamp_range(const AttnRange& r, int Tk) {
  Range c;
  c.lo1 = min(max(r.lo1, 0), Tk);
  c.hi1 = min(max(r.hi1, c.lo1), Tk);
  c.lo2 = min(max(r.lo2, 0), Tk);
  c.hi2 = min(max(r.hi2, c.lo2), Tk);
  return c;
}
__device__ __forceinline__ bool visible(const Range& r, int j) {
  return (j >= r.lo1 && j < r.hi1) || (j >= r.lo2 && j < r.hi2);
}
__device__ __forceinline__ float bf(uint16_t b) { return to_f32(b); }

// Loads keys [kb, kb+kBK) of KV head g into padded shared tiles (row stride D+2 halves); keys at
// or past `kend` are zero.
template <int D>
__device__ __forceinline__ void load_kv_tile(uint16_t* ks, uint16_t* vs, const uint16_t* k,
                                             const uint16_t* v, int kb, int kend, int g, int NKV) {
  constexpr int W = D / 2;  // 32-bit words per row
  for (int e = threadIdx.x; e < kBK * W; e += blockDim.x) {
    const int j = e / W, w = e % W, key = kb + j;
    uint32_t kw = 0, vw = 0;
    if (key < kend) {
      const int64_t off = (static_cast<int64_t>(key) * NKV + g) * D / 2 + w;
      kw = reinterpret_cast<const uint32_t*>(k)[off];
      vw = reinterpret_cast<const uint32_t*>(v)[off];
    }
    reinterpret_cast<uint32_t*>(ks)[j * (W + 1) + w] = kw;
    reinterpret_cast<uint32_t*>(vs)[j * (W + 1) + w] = vw;
  }
}

// Dot of an f32 vector in shared memory with key row j of a padded bf16 tile.
template <int D>
__device__ __forceinline__ float dot_row(const float* a, const uint16_t* tile, int j) {
  constexpr int W = D / 2;
  const uint32_t* row = reinterpret_cast<const uint32_t*>(tile) + j * (W + 1);
  float s = 0.f;
#pragma unroll 8
  for (int w = 0; w < W; ++w) {
    const uint32_t u = row[w];
    s += a[2 * w] * __uint_as_float(u << 16) + a[2 * w + 1] * __uint_as_float(u & 0xffff0000u);
  }
  return s;
}
template <int D>
__device__ __forceinline__ float tile_at(const uint16_t* tile, int j, int d) {
  return bf(tile[j * (D + 2) + d]);
}

// The key intervals a block of rows visits: union of first ranges, union of second ranges,
// merged when they overlap or touch. Writes up to two intervals to iv[4]; returns their count.
__device__ int block_intervals(const Range* rs, int n, int* iv) {
  int a0 = INT_MAX, a1 = INT_MIN, b0 = INT_MAX, b1 = INT_MIN;
  for (int i = 0; i < n; ++i) {
    if (rs[i].lo1 < rs[i].hi1) a0 = min(a0, rs[i].lo1), a1 = max(a1, rs[i].hi1);
    if (rs[i].lo2 < rs[i].hi2) b0 = min(b0, rs[i].lo2), b1 = max(b1, rs[i].hi2);
  }
  int cnt = 0;
  const bool ha = a0 < a1, hb = b0 < b1;
  if (ha && hb && a0 <= b1 && b0 <= a1) {
    iv[0] = min(a0, b0), iv[1] = max(a1, b1);
    return 1;
  }
  if (ha && hb && b0 < a0) {  // ascending order
    iv[0] = b0, iv[1] = b1, iv[2] = a0, iv[3] = a1;
    return 2;
  }
  if (ha) iv[2 * cnt] = a0, iv[2 * cnt + 1] = a1, ++cnt;
  if (hb) iv[2 * cnt] = b0, iv[2 * cnt + 1] = b1, ++cnt;
  return cnt;
}

// ---------------------------------------------------------------- forward

template <int D>
__global__ void __launch_bounds__(128) attn_fwd_kernel(uint16_t* o, float* lse, const uint16_t* q,
                                                       const uint16_t* k, const uint16_t* v,
                                                       const AttnRange* ranges, const float* sinks,
                                                       int Tq, int Tk, int NH, int NKV,
                                                       float scale) {
  constexpr int PER = D / 32;
  __shared__ float qs[kBQ][D];
  __shared__ uint16_t ks[kBK * (D + 2)], vs[kBK * (D + 2)];
  __shared__ Range rs[kBQ];
  __shared__ int iv[4], niv;
  const int t0 = blockIdx.x * kBQ, h = blockIdx.y, g = h / (NH / NKV);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nrows = min(kBQ, Tq - t0);
  if (threadIdx.x < kBQ)
    rs[threadIdx.x] = threadIdx.x < nrows ? clamp_range(ranges[t0 + threadIdx.x], Tk)
                                          : Range{0, 0, 0, 0};
  for (int e = threadIdx.x; e < kBQ * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    qs[r][d] = r < nrows ? bf(q[(static_cast<int64_t>(t0 + r) * NH + h) * D + d]) : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) niv = block_intervals(rs, nrows, iv);
  __syncthreads();

  float acc[kRowsPerWarp][PER], m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < PER; ++c) acc[i][c] = 0.f;
  }
  for (int it = 0; it < niv; ++it) {
    const int kend = iv[2 * it + 1];
    for (int kb = iv[2 * it]; kb < kend; kb += kBK) {
      __syncthreads();
      load_kv_tile<D>(ks, vs, k, v, kb, kend, g, NKV);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = warp * kRowsPerWarp + i;
        if (r >= nrows) continue;
        const int key = kb + lane;
        const bool vis = key < kend && visible(rs[r], key);
        const float s = vis ? scale * dot_row<D>(qs[r], ks, lane) : -INFINITY;
        const float mt = warp_max(s);
        if (mt == -INFINITY) continue;
        const float mn = fmaxf(m[i], mt);
        const float alpha = expf(m[i] - mn);
        const float p = vis ? expf(s - mn) : 0.f;
        l[i] = l[i] * alpha + warp_sum(p);
        m[i] = mn;
#pragma unroll
        for (int c = 0; c < PER; ++c) acc[i][c] *= alpha;
        for (int jj = 0; jj < kBK; ++jj) {
          const float pj = __shfl_sync(0xffffffffu, p, jj);
          if (pj != 0.f) {
#pragma unroll
            for (int c = 0; c < PER; ++c) acc[i][c] += pj * tile_at<D>(vs, jj, lane + 32 * c);
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= nrows) continue;
    const int t = t0 + r;
    if (sinks) {  // one more logit in the softmax, without a value row
      const float sk = sinks[h], mn = fmaxf(m[i], sk), alpha = expf(m[i] - mn);
      l[i] = l[i] * alpha + expf(sk - mn);
#pragma unroll
      for (int c = 0; c < PER; ++c) acc[i][c] *= alpha;
      m[i] = mn;
    }
    const float inv = l[i] > 0.f ? 1.0f / l[i] : 0.f;
#pragma unroll
    for (int c = 0; c < PER; ++c)
      o[(static_cast<int64_t>(t) * NH + h) * D + lane + 32 * c] = f32_to_bf16(acc[i][c] * inv);
    if (lse && lane == 0)
      lse[static_cast<int64_t>(h) * Tq + t] = l[i] > 0.f ? m[i] + logf(l[i]) : -INFINITY;
  }
}

// ---------------------------------------------------------------- backward

// Δ[h, t] = Σ_d dO·O; one warp per (t, h).
template <int D>
__global__ void attn_delta_kernel(float* delta, const uint16_t* dout, const uint16_t* o, int Tq,
                                  int NH) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (item >= static_cast<int64_t>(Tq) * NH) return;
  const int lane = threadIdx.x & 31;
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += bf(dout[item * D + d]) * bf(o[item * D + d]);
  s = warp_sum(s);
  const int t = static_cast<int>(item / NH), h = static_cast<int>(item % NH);
  if (lane == 0) delta[static_cast<int64_t>(h) * Tq + t] = s;
}

template <int D>
__global__ void __launch_bounds__(128) attn_dq_kernel(uint16_t* dq, const uint16_t* dout,
                                                      const uint16_t* q, const uint16_t* k,
                                                      const uint16_t* v, const float* lse,
                                                      const float* delta,
                                                      const AttnRange* ranges, int Tq, int Tk,
                                                      int NH, int NKV, float scale) {
  constexpr int PER = D / 32;
  __shared__ float qs[kBQ][D], dos[kBQ][D];
  __shared__ uint16_t ks[kBK * (D + 2)], vs[kBK * (D + 2)];
  __shared__ Range rs[kBQ];
  __shared__ int iv[4], niv;
  const int t0 = blockIdx.x * kBQ, h = blockIdx.y, g = h / (NH / NKV);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nrows = min(kBQ, Tq - t0);
  if (threadIdx.x < kBQ)
    rs[threadIdx.x] = threadIdx.x < nrows ? clamp_range(ranges[t0 + threadIdx.x], Tk)
                                          : Range{0, 0, 0, 0};
  for (int e = threadIdx.x; e < kBQ * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    const int64_t off = (static_cast<int64_t>(t0 + r) * NH + h) * D + d;
    qs[r][d] = r < nrows ? bf(q[off]) : 0.f;
    dos[r][d] = r < nrows ? bf(dout[off]) : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) niv = block_intervals(rs, nrows, iv);
  __syncthreads();

  float acc[kRowsPerWarp][PER], lrow[kRowsPerWarp], drow[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    lrow[i] = r < nrows ? lse[static_cast<int64_t>(h) * Tq + t0 + r] : -INFINITY;
    drow[i] = r < nrows ? delta[static_cast<int64_t>(h) * Tq + t0 + r] : 0.f;
#pragma unroll
    for (int c = 0; c < PER; ++c) acc[i][c] = 0.f;
  }
  for (int it = 0; it < niv; ++it) {
    const int kend = iv[2 * it + 1];
    for (int kb = iv[2 * it]; kb < kend; kb += kBK) {
      __syncthreads();
      load_kv_tile<D>(ks, vs, k, v, kb, kend, g, NKV);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = warp * kRowsPerWarp + i;
        if (r >= nrows || lrow[i] == -INFINITY) continue;
        const int key = kb + lane;
        const bool vis = key < kend && visible(rs[r], key);
        float ds = 0.f;
        if (vis) {
          const float p = expf(scale * dot_row<D>(qs[r], ks, lane) - lrow[i]);
          ds = p * (dot_row<D>(dos[r], vs, lane) - drow[i]);
        }
        for (int jj = 0; jj < kBK; ++jj) {
          const float dj = __shfl_sync(0xffffffffu, ds, jj);
          if (dj != 0.f) {
#pragma unroll
            for (int c = 0; c < PER; ++c) acc[i][c] += dj * tile_at<D>(ks, jj, lane + 32 * c);
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= nrows) continue;
#pragma unroll
    for (int c = 0; c < PER; ++c)
      dq[(static_cast<int64_t>(t0 + r) * NH + h) * D + lane + 32 * c] =
          f32_to_bf16(scale * acc[i][c]);
  }
}

// Query span of every key tile: span[2·tile] = the smallest and span[2·tile+1] = the largest query
// row whose ranges touch a key of tile [32·tile, 32·tile+32). One thread per query row; atomicMin
// and atomicMax give the same result in any order, so the span (and everything after) is
// deterministic. The dk/dv pass then scans only those query rows instead of all Tq.
__global__ void attn_key_span_kernel(int* span, const AttnRange* ranges, int Tq, int Tk) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < Tq; t += gridDim.x * blockDim.x) {
  const Range r = clamp_range(ranges[t], Tk);
  if (r.lo1 < r.hi1) {
    for (int tile = r.lo1 / kBK; tile <= (r.hi1 - 1) / kBK; ++tile) {
      atomicMin(&span[2 * tile], t);
      atomicMax(&span[2 * tile + 1], t);
    }
  }
  if (r.lo2 < r.hi2) {
    for (int tile = r.lo2 / kBK; tile <= (r.hi2 - 1) / kBK; ++tile) {
      atomicMin(&span[2 * tile], t);
      atomicMax(&span[2 * tile + 1], t);
    }
  }
  }
}

__global__ void attn_span_init_kernel(int* span, int n_tiles) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_tiles; i += gridDim.x * blockDim.x) {
    span[2 * i] = INT_MAX;
    span[2 * i + 1] = -1;
  }
}

// dk, dv for keys [j0, j0+32) of KV head g. Thread (j = tid/8, dg = tid%8) owns dims dg + 8c.
// Only the query rows of the tile's span (attn_key_span_kernel) are scanned.
template <int D>
__global__ void __launch_bounds__(256) attn_dkdv_kernel(uint16_t* dk, uint16_t* dv,
                                                        const uint16_t* dout, const uint16_t* q,
                                                        const uint16_t* k, const uint16_t* v,
                                                        const float* lse, const float* delta,
                                                        const AttnRange* ranges,
                                                        const int* span, int Tq, int Tk,
                                                        int NH, int NKV, float scale) {
  constexpr int PER = D / 8;
  __shared__ uint16_t ks[kBK * (D + 2)], vs[kBK * (D + 2)];
  __shared__ float qs[kKvWarps][D], dos[kKvWarps][D];
  __shared__ float ps[kKvWarps][kBK], dss[kKvWarps][kBK];
  __shared__ int rows[32];
  __shared__ int nrows_chunk;
  const int j0 = blockIdx.x * kBK, g = blockIdx.y, rep = NH / NKV;
  const int j1 = min(j0 + kBK, Tk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int jown = threadIdx.x / 8, dg = threadIdx.x % 8;
  load_kv_tile<D>(ks, vs, k, v, j0, j1, g, NKV);
  float dka[PER], dva[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) dka[c] = dva[c] = 0.f;

  const int q_first = span[2 * blockIdx.x], q_last = span[2 * blockIdx.x + 1];
  for (int c0 = q_first; c0 <= q_last; c0 += 32) {
    __syncthreads();
    if (warp == 0) {
      const int t = c0 + lane;
      bool hit = false;
      if (t < Tq) {
        const Range r = clamp_range(ranges[t], Tk);
        hit = (r.lo1 < j1 && r.hi1 > j0 && r.lo1 < r.hi1) ||
              (r.lo2 < j1 && r.hi2 > j0 && r.lo2 < r.hi2);
      }
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      if (hit) rows[__popc(mask & ((1u << lane) - 1u))] = t;
      if (lane == 0) nrows_chunk = __popc(mask);
    }
    __syncthreads();
    const int items = nrows_chunk * rep;
    for (int b0 = 0; b0 < items; b0 += kKvWarps) {
      const int it = b0 + warp;
      if (it < items) {
        const int t = rows[it / rep], h = g * rep + it % rep;
        const int64_t off = (static_cast<int64_t>(t) * NH + h) * D;
        for (int d = lane; d < D; d += 32) {
          qs[warp][d] = bf(q[off + d]);
          dos[warp][d] = bf(dout[off + d]);
        }
        __syncwarp();
        const float l = lse[static_cast<int64_t>(h) * Tq + t];
        const float dl = delta[static_cast<int64_t>(h) * Tq + t];
        const int key = j0 + lane;
        const bool vis = key < j1 && l != -INFINITY && visible(clamp_range(ranges[t], Tk), key);
        float p = 0.f, ds = 0.f;
        if (vis) {
          p = expf(scale * dot_row<D>(qs[warp], ks, lane) - l);
          ds = scale * p * (dot_row<D>(dos[warp], vs, lane) - dl);
        }
        ps[warp][lane] = p;
        dss[warp][lane] = ds;
      }
      __syncthreads();
      const int nvalid = min(kKvWarps, items - b0);
      for (int i = 0; i < nvalid; ++i) {
        const float p = ps[i][jown], ds = dss[i][jown];
        if (p != 0.f) {
#pragma unroll
          for (int c = 0; c < PER; ++c) dva[c] += p * dos[i][dg + 8 * c];
        }
        if (ds != 0.f) {
#pragma unroll
          for (int c = 0; c < PER; ++c) dka[c] += ds * qs[i][dg + 8 * c];
        }
      }
      __syncthreads();
    }
  }
  const int j = j0 + jown;
  if (j < j1) {
    const int64_t off = (static_cast<int64_t>(j) * NKV + g) * D;
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      if (dk) dk[off + dg + 8 * c] = f32_to_bf16(dka[c]);
      if (dv) dv[off + dg + 8 * c] = f32_to_bf16(dva[c]);
    }
  }
}

template <int D>
void fwd_d(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
           const AttnRange* ranges, const AttnParams& p, cudaStream_t s) {
  dim3 grid(static_cast<unsigned>((p.Tq + kBQ - 1) / kBQ), static_cast<unsigned>(p.NH));
  attn_fwd_kernel<D><<<grid, 128, 0, s>>>(o, lse, q, k, v, ranges, p.sinks,
                                          static_cast<int>(p.Tq), static_cast<int>(p.Tk),
                                          static_cast<int>(p.NH), static_cast<int>(p.NKV),
                                          static_cast<float>(p.scale));
  DFLASH_CUDA_LAUNCH_CHECK();
}

template <int D>
void bwd_d(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q,
           const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
           const AttnRange* ranges, const AttnParams& p, float* delta, int* span,
           cudaStream_t s) {
  const int Tq = static_cast<int>(p.Tq), Tk = static_cast<int>(p.Tk), NH = static_cast<int>(p.NH),
            NKV = static_cast<int>(p.NKV);
  const float scale = static_cast<float>(p.scale);
  const int64_t items = p.Tq * p.NH;
  attn_delta_kernel<D><<<grid_for(items * 32, 256), 256, 0, s>>>(delta, dout, o, Tq, NH);
  DFLASH_CUDA_LAUNCH_CHECK();
  if (dq) {
    dim3 grid(static_cast<unsigned>((p.Tq + kBQ - 1) / kBQ), static_cast<unsigned>(p.NH));
    attn_dq_kernel<D><<<grid, 128, 0, s>>>(dq, dout, q, k, v, lse, delta, ranges, Tq, Tk, NH, NKV,
                                           scale);
    DFLASH_CUDA_LAUNCH_CHECK();
  }
  if ((dk || dv) && p.Tk > 0) {
    const int n_tiles = static_cast<int>((p.Tk + kBK - 1) / kBK);
    attn_span_init_kernel<<<grid_for(n_tiles, 256), 256, 0, s>>>(span, n_tiles);
    DFLASH_CUDA_LAUNCH_CHECK();
    attn_key_span_kernel<<<grid_for(p.Tq, 256), 256, 0, s>>>(span, ranges, Tq, Tk);
    DFLASH_CUDA_LAUNCH_CHECK();
    dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(p.NKV));
    attn_dkdv_kernel<D><<<grid, 32 * kKvWarps, 0, s>>>(dk, dv, dout, q, k, v, lse, delta, ranges,
                                                       span, Tq, Tk, NH, NKV, scale);
    DFLASH_CUDA_LAUNCH_CHECK();
  }
}

__global__ void attn_window_kernel(AttnRange* out, const AttnRange* in, int64_t T,
                                   int64_t window) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < T;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    AttnRange r = in[t];
    r.lo1 = static_cast<int32_t>(max(static_cast<int64_t>(r.lo1), r.hi1 - window));
    out[t] = r;
  }
}

}  // namespace

namespace launch {

void attention_window_ranges(AttnRange* out, const AttnRange* in, int64_t T, int64_t window,
                             cudaStream_t s) {
  if (T == 0) return;
  attn_window_kernel<<<grid_for(T, 256), 256, 0, s>>>(out, in, T, window);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void attention_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                   const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                   cudaStream_t s) {
  if (p.Tq == 0) return;
  if (p.D == 64)
    fwd_d<64>(o, lse, q, k, v, ranges, p, s);
  else
    fwd_d<128>(o, lse, q, k, v, ranges, p, s);
}

void attention_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                   const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                   const float* lse, const AttnRange* ranges, const AttnParams& p,
                   float* delta_ws, int* span_ws, cudaStream_t s) {
  if (p.Tq == 0) {
    const size_t bytes = static_cast<size_t>(p.Tk * p.NKV * p.D) * 2;
    if (dk && bytes) DFLASH_CUDA_CHECK(cudaMemsetAsync(dk, 0, bytes, s));
    if (dv && bytes) DFLASH_CUDA_CHECK(cudaMemsetAsync(dv, 0, bytes, s));
    return;
  }
  if (p.D == 64)
    bwd_d<64>(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta_ws, span_ws, s);
  else
    bwd_d<128>(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta_ws, span_ws, s);
}

}  // namespace launch
}  // namespace dflash::cuda
