// dflash.cpp — device code of the fused decoding kernels (contracts: src/ops/decode_fused.hpp;
// launchers: decode_fused.cu). Kept in a header that names no CUDA runtime API so that tests/emu
// (a warp emulator) runs these functions on the CPU: CI checks their indexing without a GPU.
//
// Layout facts the kernels rely on (checked by the host entry points): D is 64 or 128, so a warp's
// lane holds E = D/32 values of a head; rows of q, k, v and the caches start 16-byte aligned.
//
// qkv_prepare: one CTA per token, kPrepLanes = 4 lanes per head of the fused projection row [q
// heads | k heads | v heads], each lane moving 16-byte vectors: lane u of a head holds vectors u +
// 4r (r < E), elements 32r + 8u + s (s < 8), which are the elements lanes 8u … 8u + 7 of a
// warp-per-head layout hold (lane j: j, j + 32, …, the order rmsnorm_fwd_cuda sums them in). So
// the norm's sum keeps rmsnorm_fwd_cuda's order (head_rstd), and RoPE pairs (i, i + D/2) are
// vectors r and r + E/2 of the same lane. The D/2 cos and sin of the token's position are computed
// once per CTA into shared memory (sincosf of the same argument: the same bits for every head).
//
// decode attention: split s of row t covers its visible keys [32·s, 32·s + 32) (ranges listed
// [lo1, hi1) then [lo2, hi2)); one warp per (row, query head, split), lane i scoring key 32·s + i
// (so a split is one warp-wide softmax, no running rescale), then the lanes' weights broadcast by
// shuffles while each lane accumulates its E contiguous output elements. The CTA holds the G query
// heads of one KV head for up to `rows_per_cta` rows, so their K/V reads hit the same L1 lines.
// The combine: one warp per (row, head), splits in ascending order.
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_fused_args.hpp"
#include "backend/cuda/mma.cuh"

namespace dflash::cuda::decode_fused {

// ---- qkv_prepare (one CTA per token; kPrepLanes lanes per head, see the file comment).

// The 8 bf16 values of a 16-byte vector, widened to fp32 in memory order.
__device__ __forceinline__ void unpack8(const uint4& v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  for (int m = 0; m < 4; ++m) {
    x[2 * m] = to_f32(static_cast<uint16_t>(w[m] & 0xffffu));
    x[2 * m + 1] = to_f32(static_cast<uint16_t>(w[m] >> 16));
  }
}
// 8 fp32 values rounded to bf16 (pack_bf16x2: the bits of from_f32<uint16_t>), in memory order.
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  uint32_t w[4];
  for (int m = 0; m < 4; ++m) w[m] = pack_bf16x2(x[2 * m], x[2 * m + 1]);
  return uint4{w[0], w[1], w[2], w[3]};
}

// 1/sqrt(mean x² + eps) of the head whose E·32 values the calling lane and the three other lanes
// of its group hold (lane u: x[r][s] = element 32r + 8u + s), in the summation order of
// row_rstd (common.cuh): warp-per-row lane j = 8u + s sums its elements j, j + 32, … in order,
// then the butterfly xor 16, 8 (here: shuffles xor 2, 1 between the group's lanes) and xor 4, 2,
// 1 (here: between s and s ^ 4, s ^ 2, s ^ 1 inside the lane). a + b = b + a bit for bit, so each
// step gives the butterfly's value. All 32 lanes of the warp must call it.
template <int E>
__device__ __forceinline__ float head_rstd(const float (&x)[E][8], int D, float eps) {
  float part[8];
  for (int s = 0; s < 8; ++s) {
    float ss = 0.f;
    for (int r = 0; r < E; ++r) ss += x[r][s] * x[r][s];
    part[s] = ss;
  }
  for (int s = 0; s < 8; ++s) part[s] += __shfl_xor_sync(0xffffffffu, part[s], 2);  // xor 16
  for (int s = 0; s < 8; ++s) part[s] += __shfl_xor_sync(0xffffffffu, part[s], 1);  // xor 8
  for (int s = 0; s < 4; ++s) part[s] += part[s + 4];                               // xor 4
  for (int s = 0; s < 2; ++s) part[s] += part[s + 2];                               // xor 2
  const float ss = part[0] + part[1];                                               // xor 1
  return 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
}

// Head `head` of token t: the lane's vectors in[r] (r < E) → its q, k or v output row. q/k:
// RMSNorm (when a.q_norm), RoPE from the token's table rot = [cos D/2 | sin D/2] (pair (i, i +
// D/2) = vectors r and r + E/2 of this lane). v heads and lanes with head ≥ nheads take part in
// the norm's shuffles only. All 32 lanes of the warp must call it.
template <int D>
__device__ __forceinline__ void qkv_prepare_head(const QkvPrepArgs& a, const float* rot,
                                                 const uint4 (&in)[D / 32], int head, int64_t qrow,
                                                 int64_t kvrow) {
  constexpr int E = D / 32, HALF = E / 2;
  const int u = static_cast<int>(threadIdx.x) % kPrepLanes, nheads = a.NH + 2 * a.NKV;
  const bool is_q = head < a.NH, is_v = head >= a.NH + a.NKV;
  const bool live = head < nheads;
  if (live && is_v) {  // a copy into its cache row
    uint4* dst = reinterpret_cast<uint4*>(a.v_out + (kvrow * a.NKV + (head - a.NH - a.NKV)) * D);
    for (int r = 0; r < E; ++r) dst[kPrepLanes * r + u] = in[r];
  }
  float x[E][8];
  for (int r = 0; r < E; ++r) unpack8(in[r], x[r]);
  const float* w = is_q ? a.q_norm : a.k_norm;
  float rs = 0.f;
  if (a.q_norm) rs = head_rstd<E>(x, D, a.eps);  // warp-uniform: both norms or neither
  if (!live || is_v) return;
  if (w)  // RMSNorm over the head, rounded to bf16 as rmsnorm_fwd_cuda stores it
    for (int r = 0; r < E; ++r) {
      const float4* wv = reinterpret_cast<const float4*>(w + 32 * r + 8 * u);
      const float4 w0 = wv[0], w1 = wv[1];
      const float ws[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      for (int s = 0; s < 8; s += 2) {
        const uint32_t b = pack_bf16x2(ws[s] * (x[r][s] * rs), ws[s + 1] * (x[r][s + 1] * rs));
        x[r][s] = to_f32(static_cast<uint16_t>(b & 0xffffu));
        x[r][s + 1] = to_f32(static_cast<uint16_t>(b >> 16));
      }
    }
  uint4* dst = reinterpret_cast<uint4*>(is_q ? a.q_out + (qrow * a.NH + head) * D
                                             : a.k_out + (kvrow * a.NKV + (head - a.NH)) * D);
  for (int r = 0; r < HALF; ++r) {  // RoPE, rotate_half pairs (i, i + D/2), as rope_fwd_cuda
    float lo[8], hi[8];
    for (int s = 0; s < 8; ++s) {
      const int i = 32 * r + 8 * u + s;
      rope_pair(x[r][s], x[r + HALF][s], rot[i], rot[D / 2 + i], lo[s], hi[s]);
    }
    dst[kPrepLanes * r + u] = pack8(lo);
    dst[kPrepLanes * (r + HALF) + u] = pack8(hi);
  }
}

// Token blockIdx.x (grid: T CTAs of qkv_prep_threads(NH + 2·NKV) threads, D floats of dynamic
// shared memory at `rot`). The first round's loads are issued before the cos/sin table is built.
template <int D>
__device__ __forceinline__ void qkv_prepare(const QkvPrepArgs& a, float* rot) {
  constexpr int E = D / 32;
  const int u = static_cast<int>(threadIdx.x) % kPrepLanes, nheads = a.NH + 2 * a.NKV;
  const int per_round = static_cast<int>(blockDim.x) / kPrepLanes;
  const int64_t t = blockIdx.x;
  const uint4* row = reinterpret_cast<const uint4*>(a.qkv + t * nheads * D);
  const int64_t qrow = a.q_rows ? a.q_rows[t] : t, kvrow = a.kv_rows ? a.kv_rows[t] : t;
  auto load = [&](uint4(&in)[E], int head) {
    for (int r = 0; r < E; ++r)
      in[r] = head < nheads ? row[head * (D / 8) + kPrepLanes * r + u] : uint4{0u, 0u, 0u, 0u};
  };
  uint4 in[E];
  int head = static_cast<int>(threadIdx.x) / kPrepLanes;
  load(in, head);
  const float p = static_cast<float>(a.pos[t]);
  for (int i = static_cast<int>(threadIdx.x); i < D / 2; i += static_cast<int>(blockDim.x)) {
    float sn, cs;
    sincosf(p * a.inv_freq[i], &sn, &cs);
    rot[i] = cs * a.rope_scaling;
    rot[D / 2 + i] = sn * a.rope_scaling;
  }
  __syncthreads();
  for (int base = 0; base < nheads; base += per_round, head += per_round) {  // warp-uniform
    if (base > 0) load(in, head);
    qkv_prepare_head<D>(a, rot, in, head, qrow, kvrow);
  }
}

// Visible keys of a row and the cache row of its j-th one.
struct RowKeys {
  int lo1, n1, lo2, n;
  __device__ __forceinline__ int key(int j) const { return j < n1 ? lo1 + j : lo2 + (j - n1); }
};
__device__ __forceinline__ RowKeys row_keys(const AttnRange& r) {
  const int n1 = r.hi1 - r.lo1;
  return RowKeys{r.lo1, n1, r.lo2, n1 + (r.hi2 - r.lo2)};
}

// Split blockIdx.x of KV head blockIdx.y for rows blockIdx.z·rows_per_cta + …; warp w takes query
// head blockIdx.y·G + w % G of row … + w / G.
template <int D>
__device__ __forceinline__ void decode_attn_split(const DecodeAttnArgs& a) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = a.NH / a.NKV;
  const int64_t t = static_cast<int64_t>(blockIdx.z) * a.rows_per_cta + warp / G;
  if (t >= a.T) return;
  const int g = blockIdx.y, h = g * G + warp % G, s = blockIdx.x;
  const RowKeys rk = row_keys(a.ranges[t]);
  const int j0 = s * kSplitKeys;
  if (j0 >= rk.n || s >= a.S) return;
  const int cnt = min(kSplitKeys, rk.n - j0);
  const int64_t kv_stride = static_cast<int64_t>(a.NKV) * D;
  // Score of this lane's key: scale · q·k in fp32 (q read by all lanes at once: a broadcast).
  float score = -INFINITY;
  const int key = lane < cnt ? rk.key(j0 + lane) : 0;
  if (lane < cnt) {
    const uint4* qv = reinterpret_cast<const uint4*>(a.q + (t * a.NH + h) * D);
    const uint4* kv = reinterpret_cast<const uint4*>(a.k + key * kv_stride + g * D);
    float dot = 0.f;
    for (int c = 0; c < D / 8; ++c) {
      const uint4 qc = qv[c], kc = kv[c];
      const uint32_t qw[4] = {qc.x, qc.y, qc.z, qc.w}, kw[4] = {kc.x, kc.y, kc.z, kc.w};
      for (int m = 0; m < 4; ++m) {
        dot += to_f32(static_cast<uint16_t>(qw[m] & 0xffffu)) *
               to_f32(static_cast<uint16_t>(kw[m] & 0xffffu));
        dot +=
            to_f32(static_cast<uint16_t>(qw[m] >> 16)) * to_f32(static_cast<uint16_t>(kw[m] >> 16));
      }
    }
    score = dot * a.scale;
  }
  const float mx = warp_max(score);
  const float pr = lane < cnt ? expf(score - mx) : 0.f;
  const float sum = warp_sum(pr);
  // Output elements [lane·E, lane·E + E) of Σ_i p_i·v_i, keys in split order.
  float acc[E];
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int i = 0; i < cnt; ++i) {
    const float pi = __shfl_sync(0xffffffffu, pr, i);
    const int ki = __shfl_sync(0xffffffffu, key, i);
    const uint16_t* vr = a.v + ki * kv_stride + g * D + lane * E;
    for (int e = 0; e < E; ++e) acc[e] += pi * to_f32(vr[e]);
  }
  const int64_t slot = (t * a.NH + h) * a.S + s;
  float* po = a.part_o + slot * D + lane * E;
  for (int e = 0; e < E; ++e) po[e] = acc[e];
  if (lane == 0) {
    a.part_ml[slot * 2] = mx;
    a.part_ml[slot * 2 + 1] = sum;
  }
}

// Warp blockIdx.x·kCombineWarps + w combines (row, head) = (id / NH, id % NH).
template <int D>
__device__ __forceinline__ void decode_attn_combine(const DecodeAttnArgs& a) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t id = static_cast<int64_t>(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (id >= a.T * a.NH) return;
  const int64_t t = id / a.NH;
  const int h = static_cast<int>(id % a.NH);
  const RowKeys rk = row_keys(a.ranges[t]);
  const int ns = min(a.S, (rk.n + kSplitKeys - 1) / kSplitKeys);
  const float* ml = a.part_ml + id * a.S * 2;
  float big = a.sinks ? a.sinks[h] : -INFINITY;
  for (int s = 0; s < ns; ++s) big = fmaxf(big, ml[2 * s]);
  float den = a.sinks ? expf(a.sinks[h] - big) : 0.f;
  float acc[E];
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int s = 0; s < ns; ++s) {
    const float w = expf(ml[2 * s] - big);
    den += w * ml[2 * s + 1];
    const float* po = a.part_o + (id * a.S + s) * D + lane * E;
    for (int e = 0; e < E; ++e) acc[e] += w * po[e];
  }
  uint16_t* out = a.o + id * D + lane * E;
  for (int e = 0; e < E; ++e) out[e] = from_f32<uint16_t>(ns > 0 ? acc[e] / den : 0.f);
}

}  // namespace dflash::cuda::decode_fused

namespace dflash::cuda::decode_fused {

// ---- decode_linear: the projections of a decoding step, y = x·Wᵀ for M ≤ 128 rows.
//
// CTA blockIdx.x owns output columns [8·bx, 8·bx + 8) (one mma n-tile) for all rows; its
// kGemmWarps warps take contiguous quarters of K's 64-value chunks, and the CTA sums the warps'
// partial tiles in warp order through shared memory. Within a chunk the 64 k values are
// permuted (the sum is the same, its order is fixed): lane (g, t) = (lane / 4, lane % 4) reads
// 32 contiguous bytes, k = 16t … 16t + 15 of the chunk, of weight row n = 8·bx + g and of x's
// rows g and g + 8 of each 16-row tile; its u32 i (k pair 16t + 2i) is B register i % 2 and A
// register column-half i % 2 of mma k-step i / 2. So mma k-step s of lane group t covers
// chunk positions 16t + 4s … 16t + 4s + 3 for every t: all 64. A row's sums (chunk order, warp
// order, the mma's own order inside a k-step) never depend on the other rows or on M.
template <int MT, typename Y, bool ACC>
__device__ __forceinline__ void decode_linear(const DecodeLinearArgs& a, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * 8;
  const int64_t chunks = a.K / kGemmChunk;
  const int64_t c0 = chunks * warp / kGemmWarps, c1 = chunks * (warp + 1) / kGemmWarps;
  float acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int e = 0; e < 4; ++e) acc[m][e] = 0.f;
  const uint16_t* wrow = a.w + (n0 + g) * a.K + 16 * t;
  // kGemmUnroll chunks of weights are loaded before any is used (the bytes in flight that keep
  // the weight stream at bandwidth); x's rows are small and hit L1/L2.
  for (int64_t c = c0; c < c1; c += kGemmUnroll) {
    uint4 wv[kGemmUnroll][2];
    for (int u = 0; u < kGemmUnroll; ++u) {
      if (c + u >= c1) continue;
      const uint4* wp = reinterpret_cast<const uint4*>(wrow + (c + u) * kGemmChunk);
      wv[u][0] = wp[0];
      wv[u][1] = wp[1];
    }
    for (int u = 0; u < kGemmUnroll; ++u) {
      if (c + u >= c1) continue;
      const int64_t k0 = (c + u) * kGemmChunk + 16 * t;
      const uint32_t b[8] = {wv[u][0].x, wv[u][0].y, wv[u][0].z, wv[u][0].w,
                             wv[u][1].x, wv[u][1].y, wv[u][1].z, wv[u][1].w};
      for (int m = 0; m < MT; ++m) {
        uint32_t lo[8], hi[8];  // x rows 16m + g and 16m + g + 8 (zeros past M)
        const int64_t r0 = 16 * m + g, r1 = r0 + 8;
        for (int h = 0; h < 2; ++h) {
          const uint4 z{0u, 0u, 0u, 0u};
          const uint4 x0 = r0 < a.M ? reinterpret_cast<const uint4*>(a.x + r0 * a.K + k0)[h] : z;
          const uint4 x1 = r1 < a.M ? reinterpret_cast<const uint4*>(a.x + r1 * a.K + k0)[h] : z;
          lo[4 * h] = x0.x, lo[4 * h + 1] = x0.y, lo[4 * h + 2] = x0.z, lo[4 * h + 3] = x0.w;
          hi[4 * h] = x1.x, hi[4 * h + 1] = x1.y, hi[4 * h + 2] = x1.z, hi[4 * h + 3] = x1.w;
        }
        for (int s = 0; s < 4; ++s) {
          const uint32_t af[4] = {lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]};
          mma::mma_bf16(acc[m], af, b[2 * s], b[2 * s + 1]);
        }
      }
    }
  }
  // Partial tiles of warps 1.. to shared memory; warp 0 adds them in warp order and stores.
  if (warp > 0)
    for (int m = 0; m < MT; ++m)
      for (int e = 0; e < 4; ++e) smem[((warp - 1) * MT + m) * 128 + e * 32 + lane] = acc[m][e];
  __syncthreads();
  if (warp != 0) return;
  Y* y = static_cast<Y*>(a.y);
  for (int m = 0; m < MT; ++m)
    for (int e = 0; e < 4; ++e) {
      float v = acc[m][e];
      for (int w = 1; w < kGemmWarps; ++w) v += smem[((w - 1) * MT + m) * 128 + e * 32 + lane];
      const int64_t r = 16 * m + g + (e >= 2 ? 8 : 0), n = n0 + 2 * t + (e & 1);
      if (r >= a.M) continue;
      if constexpr (ACC)
        y[r * a.N + n] = from_f32<Y>(to_f32(y[r * a.N + n]) + v);
      else
        y[r * a.N + n] = from_f32<Y>(v);
    }
}

}  // namespace dflash::cuda::decode_fused
