// dflash.cpp — the tensor-core attention kernels (device code only; launchers in attention_tc.cu,
// semantics in src/ops/attention.hpp, the CUDA-core version in attention.cu). Also compiled on the
// CPU by tests/emu (a warp emulator), which is why this header names no CUDA runtime API and
// declares its shared memory through DFLASH_DYNAMIC_SMEM.
//
// Work items. Query rows are cut into groups of 16 consecutive tokens; an item is one group under
// one query head: a 16-row m16 MMA tile. The items of KV head g are listed group-major, heads
// inside (item i = group i / rep, head g·rep + i % rep, rep = NH / NKV), and a CTA of 4 warps
// takes 4 consecutive items, one per warp. So with GQA the 4 warps of a CTA usually hold the same
// 16 tokens under 4 query heads (the DFlash block of 16 under one KV head: 64 rows with exactly
// the same key ranges), and every K/V tile a CTA loads serves all 4 warps.
// Key tiles (forward, dq). A CTA visits the union of its rows' first ranges and the union of their
// second ranges (merged when they touch), in tiles of 64 keys that start at each interval's start;
// so a DFlash block streams its context [doc_start, anchor) and then its own 16 keys, and context
// a block does not see is never loaded. Keys that no row of the CTA sees are zero-filled instead
// of loaded (they may hold NaN); inside a tile a warp masks per element only when some of its rows
// do not see the whole tile (the anchor's tile, document edges).
// Backward. dq per item (same tiles as the forward, P and dP recomputed); dk/dv per tile of 64
// keys of one KV head, each warp owning 16 keys, iterating over the items of the query rows that
// can see the tile (the span of rows found by a min/max pre-pass; atomicMin/Max give the same
// result in any order). Every output element is written by one thread after a fixed-order loop:
// no atomics on outputs, bit-reproducible results.
// Numerics: bf16 q, k, v, o, dout, dq, dk, dv; fp32 accumulators and statistics; P and dS rounded
// to bf16 as MMA inputs (FlashAttention-2, Dao 2023: Algorithm 1 forward with the online softmax,
// Algorithm 2 backward with D_i = rowsum(dO ∘ O), split into a dq pass and a dk/dv pass).
// Exponentials in base 2 on scores pre-multiplied by scale·log2(e); lse is stored in natural log.
// Sinks (AttnParams::sinks): the forward folds head h's sink logit into each row's softmax after
// the last key tile (a denominator term without a value row), so lse includes it and the
// backward, which only reads lse, needs no change.
// Head dimensions 64 and 128; q, k, v, o, dout 16-byte aligned (checked by the entry points).
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"
#include "ops/attention.hpp"

// Internal linkage: each including file (attention_tc.cu, the emulator test) gets its own copy.
namespace dflash::cuda::attn_tc {
namespace {

using mma::cp_async16;
using mma::ldsm_x4;
using mma::ldsm_x4_t;
using mma::mma_bf16;
using mma::pack_bf16;
using mma::swz;

constexpr int kWarps = 4;                 // warps per CTA
constexpr int kThreads = 32 * kWarps;     // threads per CTA
constexpr int kRows = 16;                 // query rows of one item (one m16 tile)
constexpr int kCtaRows = kWarps * kRows;  // item rows of a CTA
constexpr int kKeys = 64;                 // keys per tile; the dk/dv CTA owns one tile
constexpr int kNTiles = kKeys / 8;        // n8 score tiles per key tile
constexpr int kSub = 32;                  // keys per forward score sub-tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A row's key ranges, clamped to [0, Tk).
struct alignas(16) Rng {
  int lo1, hi1, lo2, hi2;
};
constexpr Rng kNoKeys{0, 0, 0, 0};

__device__ __forceinline__ Rng clamp_rng(const AttnRange& r, int Tk) {
  Rng c;
  c.lo1 = min(max(r.lo1, 0), Tk);
  c.hi1 = min(max(r.hi1, c.lo1), Tk);
  c.lo2 = min(max(r.lo2, 0), Tk);
  c.hi2 = min(max(r.hi2, c.lo2), Tk);
  return c;
}
__device__ __forceinline__ bool sees(const Rng& r, int key) {
  return (key >= r.lo1 && key < r.hi1) || (key >= r.lo2 && key < r.hi2);
}
// Every key of [a, b) (a < b) lies in one range of r.
__device__ __forceinline__ bool sees_all(const Rng& r, int a, int b) {
  return (r.lo1 <= a && b <= r.hi1) || (r.lo2 <= a && b <= r.hi2);
}
// Some key of [a, b) lies in a range of r.
__device__ __forceinline__ bool sees_any(const Rng& r, int a, int b) {
  return (r.lo1 < r.hi1 && r.lo1 < b && a < r.hi1) || (r.lo2 < r.hi2 && r.lo2 < b && a < r.hi2);
}

// One item: 16 query rows [t0, t0+16) under query head h; `valid` is false past the last item.
struct Item {
  int t0, h;
  bool valid;
};
__device__ __forceinline__ Item item_at(int idx, int n_items, int rep, int g) {
  return Item{(idx / rep) * kRows, g * rep + idx % rep, idx < n_items};
}

// Everything a kernel of this file reads (a plain parameter block, DESIGN.md §4).
struct Args {
  const uint16_t *q, *k, *v, *o, *dout;
  uint16_t *out, *dq, *dk, *dv;
  float* lse_out;
  const float *lse, *delta;
  const float* sinks;  // [NH] sink logits (natural log) or null (AttnParams::sinks)
  const AttnRange* ranges;
  const int* span;  // [2·ceil(Tk/kKeys)] query-row span of each key tile (dk/dv)
  int Tq, Tk, NH, NKV, rep, n_items;
  float scale, scale_log2;  // scale, scale·log2(e)
};

/// The kernels' arguments for one call (pointers left null; the launcher fills them).
inline Args make_args(const AttnParams& p, const AttnRange* ranges) {
  Args a{};
  a.ranges = ranges;
  a.sinks = p.sinks;
  a.Tq = static_cast<int>(p.Tq), a.Tk = static_cast<int>(p.Tk);
  a.NH = static_cast<int>(p.NH), a.NKV = static_cast<int>(p.NKV);
  a.rep = a.NH / a.NKV;
  a.n_items = static_cast<int>((p.Tq + kRows - 1) / kRows) * a.rep;
  a.scale = static_cast<float>(p.scale);
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  return a;
}
/// CTAs per KV head of the forward and dq kernels with `ipw` items per warp (grid: query_ctas ×
/// NKV).
inline int query_ctas(const Args& a, int ipw) {
  return (a.n_items + kWarps * ipw - 1) / (kWarps * ipw);
}
/// Key tiles of the dk/dv kernel and of the span pre-pass (dk/dv grid: key_tiles·NKV CTAs).
inline int key_tiles(const Args& a) {
  return (a.Tk + kKeys - 1) / kKeys;
}

/// Softmax statistics of query row t under item it's head, as the backward kernels read them:
/// lse2 = lse·log2(e) (+inf for a row with nothing visible, or past Tq / the last item: P = 0)
/// and dl = Δ_t (0 past the end).
__device__ __forceinline__ void row_stat(float& lse2, float& dl, const Args& a, const Item& it,
                                         int t) {
  const bool ok = it.valid && t < a.Tq;
  const int64_t at = static_cast<int64_t>(it.h) * a.Tq + t;
  const float lv = ok ? a.lse[at] : -INFINITY;
  lse2 = lv == -INFINITY ? INFINITY : lv * kLog2e;
  dl = ok ? a.delta[at] : 0.f;
}

// ---------------------------------------------------------------- key tiles of a query CTA

// The key tiles a CTA of query items visits: up to two intervals, tiles of kKeys keys from each
// interval's start; the last tile of an interval ends at the interval's end.
// Plain fields, no array: a run-time index would put the cursor in local memory.
struct TileCursor {
  int s0, e0, s1, e1;  // intervals [s0, e0) and [s1, e1), ascending
  int niv, cur, kb;    // interval count, current interval, current tile start
  __device__ bool done() const { return cur >= niv; }
  __device__ int kend() const { return min(kb + kKeys, cur == 0 ? e0 : e1); }
  __device__ void next() {
    kb += kKeys;
    if (kb >= (cur == 0 ? e0 : e1)) {
      ++cur;
      kb = s1;
    }
  }
};

// Reduces the ranges of the CTA's rows to its intervals (union of first ranges, union of second
// ranges; one interval when they overlap or touch; ascending). Row i of the CTA belongs to thread
// i, which passes its clamped range `r` (`mine`: the thread holds a row); the CTA has W warps and
// `red` is 4·W ints of shared memory. Every thread returns the same cursor. Contains
// __syncthreads.
template <int W = kWarps>
__device__ TileCursor cta_tiles(const Rng& r, bool mine, int* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool h1 = mine && r.lo1 < r.hi1, h2 = mine && r.lo2 < r.hi2;
  int a0 = __reduce_min_sync(0xffffffffu, h1 ? r.lo1 : INT_MAX);
  int a1 = __reduce_max_sync(0xffffffffu, h1 ? r.hi1 : INT_MIN);
  int b0 = __reduce_min_sync(0xffffffffu, h2 ? r.lo2 : INT_MAX);
  int b1 = __reduce_max_sync(0xffffffffu, h2 ? r.hi2 : INT_MIN);
  if (lane == 0) {
    red[4 * warp] = a0, red[4 * warp + 1] = a1, red[4 * warp + 2] = b0, red[4 * warp + 3] = b1;
  }
  __syncthreads();
  for (int w = 0; w < W; ++w) {
    a0 = min(a0, red[4 * w]), a1 = max(a1, red[4 * w + 1]);
    b0 = min(b0, red[4 * w + 2]), b1 = max(b1, red[4 * w + 3]);
  }
  TileCursor c{0, 0, 0, 0, 0, 0, 0};
  const bool ha = a0 < a1, hb = b0 < b1;
  if (ha && hb && a0 <= b1 && b0 <= a1) {
    c.s0 = min(a0, b0), c.e0 = max(a1, b1), c.niv = 1;
  } else if (ha && hb) {
    c.s0 = min(a0, b0), c.e0 = a0 < b0 ? a1 : b1;
    c.s1 = max(a0, b0), c.e1 = a0 < b0 ? b1 : a1, c.niv = 2;
  } else if (ha || hb) {
    c.s0 = ha ? a0 : b0, c.e0 = ha ? a1 : b1, c.niv = 1;
  }
  c.kb = c.s0;
  return c;
}

// Issues the cp.async copies of keys [kb, kend) of KV head g into the swizzled tiles ks, vs
// (kKeys rows). Rows past kend, and keys no row of the CTA sees, are zero-filled. `rs` holds the
// CTA's R row ranges.
template <int D, int R>
__device__ void load_kv_tile(uint16_t* ks, uint16_t* vs, const Args& a, int g, int kb, int kend,
                             const Rng* rs) {
  constexpr int C = D / 8;  // 16-byte chunks per row
  const int lane = threadIdx.x & 31;
  // Common case: one row of the CTA sees the whole tile, so every key of it is needed.
  bool one = false;
#pragma unroll
  for (int i = 0; i < R / 32; ++i) one = one || sees_all(rs[lane + 32 * i], kb, kend);
  const bool covered = __any_sync(0xffffffffu, one);
  for (int e = threadIdx.x; e < kKeys * C; e += kThreads) {
    const int j = e / C, c = e % C, key = kb + j;
    bool ok = key < kend;
    if (ok && !covered) {
      ok = false;
      for (int i = 0; i < R && !ok; ++i) ok = sees(rs[i], key);
    }
    const int64_t off = ok ? (static_cast<int64_t>(key) * a.NKV + g) * D + c * 8 : 0;
    cp_async16(reinterpret_cast<char*>(ks) + swz<D>(j, c), a.k + off, ok);
    cp_async16(reinterpret_cast<char*>(vs) + swz<D>(j, c), a.v + off, ok);
  }
}

// Issues the cp.async copies of one item's 16 rows of `src` ([Tq, NH, D]) into a swizzled tile.
template <int D>
__device__ void load_item_rows(uint16_t* dst, const uint16_t* src, const Item& it, int Tq, int NH,
                               int lane) {
  constexpr int C = D / 8;
  for (int e = lane; e < kRows * C; e += 32) {
    const int r = e / C, c = e % C, t = it.t0 + r;
    const bool ok = it.valid && t < Tq;
    const int64_t off = ok ? (static_cast<int64_t>(t) * NH + it.h) * D + c * 8 : 0;
    cp_async16(reinterpret_cast<char*>(dst) + swz<D>(r, c), src + off, ok);
  }
}

// A fragments (16 rows × 16 of D, k-step ks) of a swizzled 16-row tile.
template <int D>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const uint16_t* tile, int ks, int lane) {
  const int row = (lane & 7) + 8 * ((lane >> 3) & 1), chunk = 2 * ks + (lane >> 4);
  ldsm_x4(a, reinterpret_cast<const char*>(tile) + swz<D>(row, chunk));
}
// B fragments of n-tiles 2p and 2p+1 for a product with a tile whose rows are the N index and
// whose columns are the K index (S = Q·Kᵀ: rows = keys, columns = d; k-step ks). b[0..1] belong
// to n-tile 2p, b[2..3] to n-tile 2p+1.
template <int D>
__device__ __forceinline__ void ldsm_b_nk(uint32_t (&b)[4], const uint16_t* tile, int p, int ks,
                                          int lane) {
  const int row = 16 * p + (lane & 7) + 8 * (lane >> 4), chunk = 2 * ks + ((lane >> 3) & 1);
  ldsm_x4(b, reinterpret_cast<const char*>(tile) + swz<D>(row, chunk));
}
// B fragments of n-tiles 2dp and 2dp+1 (n = d) for a product with a tile whose rows are the K
// index (O = P·V: rows = keys; k-step kk of 16 rows).
template <int D>
__device__ __forceinline__ void ldsm_b_kn(uint32_t (&b)[4], const uint16_t* tile, int kk, int dp,
                                          int lane) {
  const int row = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1), chunk = 2 * dp + (lane >> 4);
  ldsm_x4_t(b, reinterpret_cast<const char*>(tile) + swz<D>(row, chunk));
}

// Shared memory of the forward and dq kernels (IPW items per warp, R = kCtaRows·IPW rows): the
// CTA's row ranges and its interval reduction (head_bytes), the item rows (forward: q; dq: q and
// dout), two stages of K and V tiles.
template <int IPW>
constexpr int head_bytes() {
  return kCtaRows * IPW * 16 + 128;
}
template <int D, int IPW>
constexpr int query_cta_smem(int row_tiles) {
  return head_bytes<IPW>() + row_tiles * kCtaRows * IPW * D * 2 + 4 * kKeys * D * 2;
}

// The prologue shared by the forward and dq kernels (and the Hopper kernels', attention_wgmma.cu,
// with W = 4 warps per warpgroup): for a CTA of W warps, the warp's IPW items (CTA items
// warp·IPW + j; the CTAs from the last rows, which see the most keys, first), the CTA's row
// ranges into `rs` (rows of item i of the CTA at 16·i; `red`: 4·W ints), the tile cursor over
// their union (cta_tiles). Contains __syncthreads.
template <int IPW>
struct QueryCta {
  Item it[IPW];
  int g;
  TileCursor tiles;
};
template <int IPW, int W = kWarps>
__device__ QueryCta<IPW> query_cta_begin(const Args& a, Rng* rs, int* red) {
  constexpr int R = kRows * W * IPW;
  QueryCta<IPW> c;
  c.g = blockIdx.y;
  const int first = (gridDim.x - 1 - blockIdx.x) * W * IPW;  // latest rows (most keys) first
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < IPW; ++j) c.it[j] = item_at(first + warp * IPW + j, a.n_items, a.rep, c.g);
  Rng mine = kNoKeys;
  const bool has_row = threadIdx.x < R;
  if (has_row) {
    const Item ri = item_at(first + threadIdx.x / kRows, a.n_items, a.rep, c.g);
    const int t = ri.t0 + threadIdx.x % kRows;
    if (ri.valid && t < a.Tq) mine = clamp_rng(a.ranges[t], a.Tk);
    rs[threadIdx.x] = mine;
  }
  c.tiles = cta_tiles<W>(mine, has_row, red);  // its __syncthreads also publishes rs
  return c;
}

// Per-warp facts about one key tile over the warp's 16·IPW rows `wrs`: does any row see a key
// of it, do all of them see all kKeys keys (then no element needs a mask).
struct TileFacts {
  bool touch, full;
};
template <int IPW>
__device__ __forceinline__ TileFacts tile_facts(const Rng* wrs, int kb, int kend, int lane) {
  constexpr int WR = kRows * IPW;
  const Rng r = lane < WR ? wrs[lane] : kNoKeys;
  TileFacts f;
  f.touch = __any_sync(0xffffffffu, lane < WR && sees_any(r, kb, kend));
  f.full = kend - kb == kKeys && __all_sync(0xffffffffu, lane >= WR || sees_all(r, kb, kend));
  return f;
}

// ---------------------------------------------------------------- forward

// One forward step over keys [k0, k0 + kSub) (sub-tile h of the stage's K/V tiles kt, vt) for
// the warp's IPW items: S = Q·Kᵀ (each B fragment feeds every item), the online softmax update of
// m, l and o in base 2, then O += P·V with P as bf16 A fragments straight from the score
// registers. Rows gr (e = 0, 1) and gr + 8 (e = 2, 3) of each item; masks only when !full.
template <int D, int IPW>
__device__ __forceinline__ void fwd_subtile(float (&o)[IPW][D / 8][4], float (&m)[IPW][2],
                                            float (&l)[IPW][2], const uint16_t* wq,
                                            const uint16_t* kt, const uint16_t* vt, const Rng* wrs,
                                            const uint32_t (&qf)[IPW == 1 ? D / 16 : 1][4],
                                            float scale_log2, int k0, int kend, int h, bool full,
                                            int lane) {
  constexpr int KS = D / 16, DT = D / 8, NT = kSub / 8;
  const int gr = lane >> 2, tq = lane & 3;
  float s[IPW][NT][4];
#pragma unroll
  for (int j = 0; j < IPW; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[j][nt][0] = s[j][nt][1] = s[j][nt][2] = s[j][nt][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t qa[IPW][4];
#pragma unroll
    for (int j = 0; j < IPW; ++j) {
      if constexpr (IPW == 1) {
        qa[j][0] = qf[ks][0], qa[j][1] = qf[ks][1], qa[j][2] = qf[ks][2], qa[j][3] = qf[ks][3];
      } else {
        ldsm_a<D>(qa[j], wq + j * kRows * D, ks, lane);
      }
    }
#pragma unroll
    for (int p = 0; p < NT / 2; ++p) {
      uint32_t b[4];
      ldsm_b_nk<D>(b, kt, h * (NT / 2) + p, ks, lane);
#pragma unroll
      for (int j = 0; j < IPW; ++j) {
        mma_bf16(s[j][2 * p], qa[j], b[0], b[1]);
        mma_bf16(s[j][2 * p + 1], qa[j], b[2], b[3]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < IPW; ++j) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][nt][e] * scale_log2;
        if (!full) {
          const int key = k0 + 8 * nt + 2 * tq + (e & 1);
          if (key >= kend || !sees(wrs[j * kRows + gr + 8 * (e >> 1)], key)) x = -INFINITY;
        }
        s[j][nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float mu[2], alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      const float mn = fmaxf(m[j][i], mx[i]);
      mu[i] = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet: exp2(-inf) = 0
      alpha[i] = exp2f(m[j][i] - mu[i]);
      m[j][i] = mn;
      l[j][i] *= alpha[i];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][nt][e] = exp2f(s[j][nt][e] - mu[e >> 1]);
        l[j][e >> 1] += s[j][nt][e];
      }
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[j][dt][0] *= alpha[0], o[j][dt][1] *= alpha[0];
      o[j][dt][2] *= alpha[1], o[j][dt][3] *= alpha[1];
    }
  }
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t pa[IPW][4];
#pragma unroll
    for (int j = 0; j < IPW; ++j) {
      pa[j][0] = pack_bf16(s[j][2 * kk][0], s[j][2 * kk][1]);
      pa[j][1] = pack_bf16(s[j][2 * kk][2], s[j][2 * kk][3]);
      pa[j][2] = pack_bf16(s[j][2 * kk + 1][0], s[j][2 * kk + 1][1]);
      pa[j][3] = pack_bf16(s[j][2 * kk + 1][2], s[j][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      uint32_t b[4];
      ldsm_b_kn<D>(b, vt, h * (NT / 2) + kk, dp, lane);
#pragma unroll
      for (int j = 0; j < IPW; ++j) {
        mma_bf16(o[j][2 * dp], pa[j], b[0], b[1]);
        mma_bf16(o[j][2 * dp + 1], pa[j], b[2], b[3]);
      }
    }
  }
}

// IPW items per warp (1 or 2): with 2, each K/V fragment read from shared memory feeds both
// items' MMAs and a K/V tile serves 128 rows, at the cost of twice the accumulator registers;
// with 1, the warp's Q fragments stay in registers.
template <int D, int IPW>
__global__ void __launch_bounds__(kThreads) attn_tc_fwd_kernel(const Args a) {
  constexpr int KS = D / 16, DT = D / 8;  // k-steps over D, n8 tiles over D
  constexpr int R = kCtaRows * IPW, WR = kRows * IPW;
  DFLASH_DYNAMIC_SMEM(smem);
  Rng* rs = reinterpret_cast<Rng*>(smem);
  int* red = reinterpret_cast<int*>(smem + R * 16);
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + head_bytes<IPW>());
  uint16_t* kv = qs + R * D;  // K stage 0, K stage 1, V stage 0, V stage 1
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, tq = lane & 3;
  uint16_t* wq = qs + warp * WR * D;  // item j's 16 rows at wq + 16·j·D

  QueryCta<IPW> c = query_cta_begin<IPW>(a, rs, red);
#pragma unroll
  for (int j = 0; j < IPW; ++j)
    load_item_rows<D>(wq + j * kRows * D, a.q, c.it[j], a.Tq, a.NH, lane);
  if (!c.tiles.done())
    load_kv_tile<D, R>(kv, kv + 2 * kKeys * D, a, c.g, c.tiles.kb, c.tiles.kend(), rs);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[IPW == 1 ? KS : 1][4];  // IPW 1: the Q fragments, kept in registers
  if constexpr (IPW == 1) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldsm_a<D>(qf[ks], wq, ks, lane);
  }
  const Rng* wrs = rs + warp * WR;
  float o[IPW][DT][4], m[IPW][2], l[IPW][2];
#pragma unroll
  for (int j = 0; j < IPW; ++j) {
    m[j][0] = m[j][1] = -INFINITY;
    l[j][0] = l[j][1] = 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[j][dt][0] = o[j][dt][1] = o[j][dt][2] = o[j][dt][3] = 0.f;
  }

  int stage = 0;
  while (!c.tiles.done()) {
    const int kb = c.tiles.kb, kend = c.tiles.kend();
    TileCursor nxt = c.tiles;
    nxt.next();
    if (!nxt.done())
      load_kv_tile<D, R>(kv + (stage ^ 1) * kKeys * D, kv + (2 + (stage ^ 1)) * kKeys * D, a, c.g,
                         nxt.kb, nxt.kend(), rs);
    mma::cp_async_commit();
    mma::cp_async_wait<1>();
    __syncthreads();
    const uint16_t* kt = kv + stage * kKeys * D;
    const uint16_t* vt = kv + (2 + stage) * kKeys * D;
    const TileFacts f = tile_facts<IPW>(wrs, kb, kend, lane);
    if (f.touch) {  // rows of invalid items see nothing
      // The tile in two halves of kSub keys (fewer score registers); a half past kend is skipped.
#pragma unroll
      for (int h = 0; h < kKeys / kSub; ++h) {
        if (h * kSub >= kend - kb) break;  // warp-uniform
        fwd_subtile<D, IPW>(o, m, l, wq, kt, vt, wrs, qf, a.scale_log2, kb + h * kSub, kend, h,
                            f.full, lane);
      }
    }
    __syncthreads();  // the stage just read is refilled in the next iteration
    stage ^= 1;
    c.tiles = nxt;
  }

#pragma unroll
  for (int j = 0; j < IPW; ++j) {
    if (!c.it[j].valid) continue;  // warp-uniform
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[j][i] += __shfl_xor_sync(0xffffffffu, l[j][i], 1);
      l[j][i] += __shfl_xor_sync(0xffffffffu, l[j][i], 2);
    }
    if (a.sinks) {  // one more logit in the softmax (base 2 here), without a value row
      const float sk = a.sinks[c.it[j].h] * kLog2e;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float mn = fmaxf(m[j][i], sk), alpha = exp2f(m[j][i] - mn);
        l[j][i] = l[j][i] * alpha + exp2f(sk - mn);
        m[j][i] = mn;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[j][dt][2 * i] *= alpha, o[j][dt][2 * i + 1] *= alpha;
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = c.it[j].t0 + gr + 8 * i;
      if (t >= a.Tq) continue;
      const float inv = l[j][i] > 0.f ? 1.f / l[j][i] : 0.f;
      uint16_t* orow = a.out + (static_cast<int64_t>(t) * a.NH + c.it[j].h) * D + 2 * tq;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const uint32_t lo = f32_to_bf16(o[j][dt][2 * i] * inv);
        const uint32_t hi = f32_to_bf16(o[j][dt][2 * i + 1] * inv);
        *reinterpret_cast<uint32_t*>(orow + 8 * dt) = lo | (hi << 16);
      }
      if (a.lse_out && tq == 0)
        a.lse_out[static_cast<int64_t>(c.it[j].h) * a.Tq + t] =
            l[j][i] > 0.f ? m[j][i] * kLn2 + logf(l[j][i]) : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------- backward: Δ, spans

// Δ[h, t] = Σ_d dO·O in fp32; 8 lanes per (t, h) row (4 rows per warp), fixed order.
template <int D>
__global__ void attn_tc_delta_kernel(float* delta, const uint16_t* dout, const uint16_t* o, int Tq,
                                     int NH) {
  constexpr int C = D / 8;
  const int64_t rows = static_cast<int64_t>(Tq) * NH;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int sub = threadIdx.x & 7;
  for (int64_t r0 = 4 * warp; r0 < rows; r0 += 4 * n_warps) {  // 4 rows per warp, warp-uniform
    const int64_t row = r0 + (threadIdx.x & 31) / 8;
    const bool ok = row < rows;
    float s = 0.f;
    if (ok) {
      for (int c = sub; c < C; c += 8) {
        const uint4 x = reinterpret_cast<const uint4*>(dout + row * D)[c];
        const uint4 y = reinterpret_cast<const uint4*>(o + row * D)[c];
        const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          s += __uint_as_float(xs[w] << 16) * __uint_as_float(ys[w] << 16);
          s += __uint_as_float(xs[w] & 0xffff0000u) * __uint_as_float(ys[w] & 0xffff0000u);
        }
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    if (ok && sub == 0) {
      const int t = static_cast<int>(row / NH), h = static_cast<int>(row % NH);
      delta[static_cast<int64_t>(h) * Tq + t] = s;
    }
  }
}

__global__ void attn_tc_span_init_kernel(int* span, int n_tiles) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_tiles; i += gridDim.x * blockDim.x) {
    span[2 * i] = INT_MAX;
    span[2 * i + 1] = -1;
  }
}

// span[2·tile] / span[2·tile+1] = the first / last query row whose ranges touch key tile
// [64·tile, 64·tile+64). Rows in a run of identical ranges touch the same tiles, so only the first
// row of a run takes part in the minimum and only the last in the maximum.
__global__ void attn_tc_span_kernel(int* span, const AttnRange* ranges, int Tq, int Tk) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < Tq; t += gridDim.x * blockDim.x) {
    const Rng r = clamp_rng(ranges[t], Tk);
    auto same = [&](int u) {
      const Rng x = clamp_rng(ranges[u], Tk);
      return x.lo1 == r.lo1 && x.hi1 == r.hi1 && x.lo2 == r.lo2 && x.hi2 == r.hi2;
    };
    const bool first = t == 0 || !same(t - 1), last = t == Tq - 1 || !same(t + 1);
    if (!first && !last) continue;
    const int lo[2] = {r.lo1, r.lo2}, hi[2] = {r.hi1, r.hi2};
    for (int i = 0; i < 2; ++i) {
      if (lo[i] >= hi[i]) continue;
      for (int tile = lo[i] / kKeys; tile <= (hi[i] - 1) / kKeys; ++tile) {
        if (first) atomicMin(&span[2 * tile], t);
        if (last) atomicMax(&span[2 * tile + 1], t);
      }
    }
  }
}

// ---------------------------------------------------------------- backward: dq

template <int D>
__global__ void __launch_bounds__(kThreads) attn_tc_dq_kernel(const Args a) {
  constexpr int KS = D / 16, DT = D / 8;
  DFLASH_DYNAMIC_SMEM(smem);
  Rng* rs = reinterpret_cast<Rng*>(smem);
  int* red = reinterpret_cast<int*>(smem + kCtaRows * 16);
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + head_bytes<1>());
  uint16_t* dos = qs + kCtaRows * D;
  uint16_t* kv = dos + kCtaRows * D;  // K stage 0, K stage 1, V stage 0, V stage 1
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, tq = lane & 3;
  uint16_t* wq = qs + warp * kRows * D;
  uint16_t* wdo = dos + warp * kRows * D;

  QueryCta<1> c = query_cta_begin<1>(a, rs, red);
  const Item it = c.it[0];
  load_item_rows<D>(wq, a.q, it, a.Tq, a.NH, lane);
  load_item_rows<D>(wdo, a.dout, it, a.Tq, a.NH, lane);
  if (!c.tiles.done())
    load_kv_tile<D, kCtaRows>(kv, kv + 2 * kKeys * D, a, c.g, c.tiles.kb, c.tiles.kend(), rs);
  mma::cp_async_commit();

  const Rng* wrs = rs + warp * kRows;
  const Rng r_lo = wrs[gr], r_hi = wrs[gr + 8];
  // Per row (gr, gr + 8): lse in base 2 (+inf for a row with nothing visible: P = 0) and Δ.
  float lse2[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) row_stat(lse2[i], dl[i], a, it, it.t0 + gr + 8 * i);
  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;

  int stage = 0;
  while (!c.tiles.done()) {
    const int kb = c.tiles.kb, kend = c.tiles.kend();
    TileCursor nxt = c.tiles;
    nxt.next();
    if (!nxt.done())
      load_kv_tile<D, kCtaRows>(kv + (stage ^ 1) * kKeys * D, kv + (2 + (stage ^ 1)) * kKeys * D, a,
                                c.g, nxt.kb, nxt.kend(), rs);
    mma::cp_async_commit();
    mma::cp_async_wait<1>();
    __syncthreads();
    const uint16_t* kt = kv + stage * kKeys * D;
    const uint16_t* vt = kv + (2 + stage) * kKeys * D;
    const TileFacts f = tile_facts<1>(wrs, kb, kend, lane);
    if (it.valid && f.touch) {
      // S = Q·Kᵀ and dP = dO·Vᵀ, 16 rows × 64 keys each.
      float s[kNTiles][4], dp[kNTiles][4];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t qa[4], da[4];
        ldsm_a<D>(qa, wq, ks, lane);
        ldsm_a<D>(da, wdo, ks, lane);
#pragma unroll
        for (int p = 0; p < kNTiles / 2; ++p) {
          uint32_t b[4];
          ldsm_b_nk<D>(b, kt, p, ks, lane);
          mma_bf16(s[2 * p], qa, b[0], b[1]);
          mma_bf16(s[2 * p + 1], qa, b[2], b[3]);
          ldsm_b_nk<D>(b, vt, p, ks, lane);
          mma_bf16(dp[2 * p], da, b[0], b[1]);
          mma_bf16(dp[2 * p + 1], da, b[2], b[3]);
        }
      }
      // dS = P ∘ (dP − Δ), P = exp2(S·scale·log2e − lse2); masked entries are selected to 0.
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          bool vis = true;
          if (!f.full) {
            const int key = kb + 8 * nt + 2 * tq + (e & 1);
            vis = key < kend && sees(e < 2 ? r_lo : r_hi, key);
          }
          const float p = exp2f(s[nt][e] * a.scale_log2 - lse2[e >> 1]);
          s[nt][e] = vis ? p * (dp[nt][e] - dl[e >> 1]) : 0.f;
        }
      }
      // dQ += dS·K.
#pragma unroll
      for (int kk = 0; kk < kNTiles / 2; ++kk) {
        const uint32_t da[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                                pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dq2 = 0; dq2 < DT / 2; ++dq2) {
          uint32_t b[4];
          ldsm_b_kn<D>(b, kt, kk, dq2, lane);
          mma_bf16(acc[2 * dq2], da, b[0], b[1]);
          mma_bf16(acc[2 * dq2 + 1], da, b[2], b[3]);
        }
      }
    }
    __syncthreads();
    stage ^= 1;
    c.tiles = nxt;
  }

  if (!it.valid) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = it.t0 + gr + 8 * i;
    if (t >= a.Tq) continue;
    uint16_t* row = a.dq + (static_cast<int64_t>(t) * a.NH + it.h) * D + 2 * tq;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const uint32_t lo = f32_to_bf16(a.scale * acc[dt][2 * i]);
      const uint32_t hi = f32_to_bf16(a.scale * acc[dt][2 * i + 1]);
      *reinterpret_cast<uint32_t*>(row + 8 * dt) = lo | (hi << 16);
    }
  }
}

// ---------------------------------------------------------------- backward: dk, dv

// Shared memory of the dk/dv kernel: the key tile's K and V, then two stages of one chunk of
// kWarps items: q rows, dout rows, lse (base 2), Δ and the row ranges.
template <int D>
constexpr int dkdv_stage_bytes() {
  return 2 * kCtaRows * D * 2 + kCtaRows * (4 + 4 + 16);
}
template <int D>
constexpr int dkdv_smem() {
  return 2 * kKeys * D * 2 + 2 * dkdv_stage_bytes<D>();
}

// The items of a dk/dv CTA: every (token group, head of KV head g) whose group lies in the span of
// rows that touch the tile, group-major; chunk c holds list entries [c·kWarps, c·kWarps + kWarps).
struct ItemList {
  int tg_lo, n;
};
__device__ __forceinline__ Item list_item(const ItemList& L, int idx, int rep, int g) {
  return Item{(L.tg_lo + idx / rep) * kRows, g * rep + idx % rep, idx < L.n};
}

// Plain loads, by threads 0 .. 63, of the statistics of chunk `chunk`'s 64 rows: lse2 (base 2),
// Δ and the clamped ranges (rows past the list: lse2 = +inf, Δ = 0, no keys).
__device__ __forceinline__ void load_chunk_stats(float* lse2, float* dl, Rng* rs, const Args& a,
                                                 const ItemList& L, int chunk, int g) {
  if (threadIdx.x >= kCtaRows) return;
  const int i = threadIdx.x;
  const Item it = list_item(L, chunk * kWarps + i / kRows, a.rep, g);
  const int t = it.t0 + i % kRows;
  row_stat(lse2[i], dl[i], a, it, t);
  rs[i] = it.valid && t < a.Tq ? clamp_rng(a.ranges[t], a.Tk) : kNoKeys;
}

template <int D>
__device__ void load_chunk(char* st, const Args& a, const ItemList& L, int chunk, int g) {
  constexpr int C = D / 8;
  uint16_t* qs = reinterpret_cast<uint16_t*>(st);
  uint16_t* dos = qs + kCtaRows * D;
  float* lse2 = reinterpret_cast<float*>(dos + kCtaRows * D);
  float* dl = lse2 + kCtaRows;
  Rng* rs = reinterpret_cast<Rng*>(dl + kCtaRows);
  for (int e = threadIdx.x; e < kCtaRows * C; e += kThreads) {
    const int i = e / C, cc = e % C;
    const Item it = list_item(L, chunk * kWarps + i / kRows, a.rep, g);
    const int t = it.t0 + i % kRows;
    const bool ok = it.valid && t < a.Tq;
    const int64_t off = ok ? (static_cast<int64_t>(t) * a.NH + it.h) * D + cc * 8 : 0;
    cp_async16(reinterpret_cast<char*>(qs) + swz<D>(i, cc), a.q + off, ok);
    cp_async16(reinterpret_cast<char*>(dos) + swz<D>(i, cc), a.dout + off, ok);
  }
  load_chunk_stats(lse2, dl, rs, a, L, chunk, g);
}

template <int D>
__global__ void __launch_bounds__(kThreads) attn_tc_dkdv_kernel(const Args a) {
  constexpr int KS = D / 16, DT = D / 8, C = D / 8;
  DFLASH_DYNAMIC_SMEM(smem);
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem);
  uint16_t* vs = ks + kKeys * D;
  char* stages = smem + 2 * kKeys * D * 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, tq = lane & 3;
  // 1-D grid, the KV heads of one key tile adjacent: the CTAs in flight together cover few
  // documents, so the q/dout rows they stream stay in L2.
  const int tile = blockIdx.x / a.NKV, g = blockIdx.x % a.NKV;
  const int j0 = tile * kKeys;
  const int kw = j0 + warp * kRows;  // this warp's 16 keys [kw, kw + 16)
  const int kw_end = min(kw + kRows, a.Tk);

  for (int e = threadIdx.x; e < kKeys * C; e += kThreads) {
    const int j = e / C, cc = e % C, key = j0 + j;
    const bool ok = key < a.Tk;
    const int64_t off = ok ? (static_cast<int64_t>(key) * a.NKV + g) * D + cc * 8 : 0;
    cp_async16(reinterpret_cast<char*>(ks) + swz<D>(j, cc), a.k + off, ok);
    cp_async16(reinterpret_cast<char*>(vs) + swz<D>(j, cc), a.v + off, ok);
  }
  const int q_first = a.span[2 * tile], q_last = a.span[2 * tile + 1];
  ItemList L{0, 0};
  if (q_first <= q_last) {
    L.tg_lo = q_first / kRows;
    L.n = (q_last / kRows - L.tg_lo + 1) * a.rep;
  }
  const int n_chunks = (L.n + kWarps - 1) / kWarps;
  if (n_chunks > 0) load_chunk<D>(stages, a, L, 0, g);
  mma::cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int stage = ch & 1;
    if (ch + 1 < n_chunks)
      load_chunk<D>(stages + (stage ^ 1) * dkdv_stage_bytes<D>(), a, L, ch + 1, g);
    mma::cp_async_commit();
    mma::cp_async_wait<1>();
    __syncthreads();
    const char* st = stages + stage * dkdv_stage_bytes<D>();
    const uint16_t* qs = reinterpret_cast<const uint16_t*>(st);
    const uint16_t* dos = qs + kCtaRows * D;
    const float* lse2 = reinterpret_cast<const float*>(dos + kCtaRows * D);
    const float* dl = lse2 + kCtaRows;
    const Rng* rs = reinterpret_cast<const Rng*>(dl + kCtaRows);
    // The chunk's items two at a time (32 query rows): 8 independent accumulators per k-step
    // instead of 4, and each K_w / V_w fragment feeds both items.
    for (int w = 0; w < kWarps; w += 2) {
      const Rng lr = rs[w * kRows + lane];  // lane = row of the pair
      const bool touch = __any_sync(0xffffffffu, sees_any(lr, kw, kw_end));
      if (!touch) continue;
      const bool full = kw_end - kw == kRows && __all_sync(0xffffffffu, sees_all(lr, kw, kw_end));
      const uint16_t* pq = qs + w * kRows * D;  // 32 rows: item w, then item w + 1
      const uint16_t* pdo = dos + w * kRows * D;
      // Sᵀ = K_w·Qᵀ and dPᵀ = V_w·dOᵀ: 16 keys × 32 query rows each (n-tile nt: rows 8nt..).
      float s[4][4] = {}, dp[4][4] = {};
#pragma unroll
      for (int k2 = 0; k2 < KS; ++k2) {
        uint32_t ka[4], va[4], b[4];
        ldsm_a<D>(ka, ks + warp * kRows * D, k2, lane);
        ldsm_a<D>(va, vs + warp * kRows * D, k2, lane);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          ldsm_b_nk<D>(b, pq + j * kRows * D, 0, k2, lane);
          mma_bf16(s[2 * j], ka, b[0], b[1]);
          mma_bf16(s[2 * j + 1], ka, b[2], b[3]);
          ldsm_b_nk<D>(b, pdo + j * kRows * D, 0, k2, lane);
          mma_bf16(dp[2 * j], va, b[0], b[1]);
          mma_bf16(dp[2 * j + 1], va, b[2], b[3]);
        }
      }
      // Pᵀ and dSᵀ; element (key kw + gr + 8·(e/2), query row 8·nt + 2·tq + e%2 of the pair).
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = w * kRows + 8 * nt + 2 * tq + (e & 1);
          const bool vis = full || sees(rs[qi], kw + gr + 8 * (e >> 1));
          const float p = vis ? exp2f(s[nt][e] * a.scale_log2 - lse2[qi]) : 0.f;
          dp[nt][e] = vis ? p * (dp[nt][e] - dl[qi]) : 0.f;
          s[nt][e] = p;
        }
      }
      // dV += Pᵀ·dO and dK += dSᵀ·Q; k-step j = the 16 query rows of item w + j.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t pa[4] = {pack_bf16(s[2 * j][0], s[2 * j][1]),
                                pack_bf16(s[2 * j][2], s[2 * j][3]),
                                pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]),
                                pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3])};
        const uint32_t da[4] = {pack_bf16(dp[2 * j][0], dp[2 * j][1]),
                                pack_bf16(dp[2 * j][2], dp[2 * j][3]),
                                pack_bf16(dp[2 * j + 1][0], dp[2 * j + 1][1]),
                                pack_bf16(dp[2 * j + 1][2], dp[2 * j + 1][3])};
#pragma unroll
        for (int d2 = 0; d2 < DT / 2; ++d2) {
          uint32_t b[4];
          ldsm_b_kn<D>(b, pdo + j * kRows * D, 0, d2, lane);
          mma_bf16(dv[2 * d2], pa, b[0], b[1]);
          mma_bf16(dv[2 * d2 + 1], pa, b[2], b[3]);
          ldsm_b_kn<D>(b, pq + j * kRows * D, 0, d2, lane);
          mma_bf16(dk[2 * d2], da, b[0], b[1]);
          mma_bf16(dk[2 * d2 + 1], da, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  mma::cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = kw + gr + 8 * i;
    if (key >= a.Tk) continue;
    const int64_t off = (static_cast<int64_t>(key) * a.NKV + g) * D + 2 * tq;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      if (a.dk) {
        const uint32_t lo = f32_to_bf16(a.scale * dk[dt][2 * i]);
        const uint32_t hi = f32_to_bf16(a.scale * dk[dt][2 * i + 1]);
        *reinterpret_cast<uint32_t*>(a.dk + off + 8 * dt) = lo | (hi << 16);
      }
      if (a.dv) {
        const uint32_t lo = f32_to_bf16(dv[dt][2 * i]), hi = f32_to_bf16(dv[dt][2 * i + 1]);
        *reinterpret_cast<uint32_t*>(a.dv + off + 8 * dt) = lo | (hi << 16);
      }
    }
  }
}

}  // namespace
}  // namespace dflash::cuda::attn_tc
