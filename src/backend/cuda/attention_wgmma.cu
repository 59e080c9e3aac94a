// dflash.cpp — the Hopper attention forward (sm_90a): wgmma on one warpgroup per 64 query rows
// (semantics in src/ops/attention.hpp; launcher declared in attention_wgmma.hpp).
//
// Work split: exactly the tensor-core forward's (attention_tc.cuh): a CTA of 4 warps holds 4
// consecutive items (16 query rows under one query head each, group-major, heads inside), so
// with GQA 4 (Qwen3-8B: 32 q / 8 kv heads) a CTA is one DFlash block of 16 queries under the 4
// query heads of one KV head: 64 rows with one key range, wgmma's M = 64. It visits the same key
// tiles (cta_tiles: the union of the rows' first ranges, then of their second ranges, 64 keys per
// tile from each interval's start), zero-fills keys no row of the CTA sees and never loads
// context a block does not see. Other GQA ratios and MHA work unchanged (a CTA's 4 items then
// span two token groups; the masks are per element).
// Per key tile j (FlashAttention-3, Shah et al. 2024, §3.2 "intra-warpgroup overlapping"):
//   S_j = Q·K_jᵀ (wgmma m64n64k16, Q and K from shared memory) is issued together with
//   O += P_{j-1}·V_{j-1} (wgmma m64nDk16, P from registers, V from shared memory); the online
//   softmax of S_j runs while the P·V product is still in flight; O is rescaled by
//   exp2(m_{j-1} − m_j) once that product has landed.
// Loads: cp.async by all 128 threads, one group per tile {K_j, V_{j-1}}, issued two tiles ahead
// (K) and one tile ahead (V) into two-stage K and V rings, so every load has a whole tile of
// compute to land in. Each warp reads its 16 rows of the 64 × 64 score tile: the accumulator
// layout of m64nNk16 is, per warp, that of mma.sync m16n8 (PTX ISA "wgmma register fragments"),
// so the masks, the softmax and the P → A-fragment packing are the ones of attention_tc.cuh.
// Shared memory tiles (Q, K, V: 64 rows × D bf16) are stored as D/64 column blocks of
// 64 rows × 128 bytes with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)),
// 1024-byte aligned: the canonical GMMA layouts "K-major SW128" for Q and K and "MN-major SW128"
// for V (cute/atom/mma_traits_sm90_gmma.hpp, make_gmma_desc). The instructions are CuTe's SM90
// GMMA atoms; the descriptors are built here from that layout.
// Numerics as attention_tc.cuh: fp32 accumulators and statistics, base-2 exponentials on scores
// pre-multiplied by scale·log2(e), P rounded to bf16, lse stored in natural log, sinks folded in
// after the last tile. Bit-reproducible: fixed tile order, no atomics.
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <utility>

#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/attention_wgmma.hpp"
#include "backend/cuda/launch.hpp"

namespace dflash::cuda {
namespace {

using namespace attn_tc;
namespace gmma = cute::SM90::GMMA;

constexpr int kBlockBytes = kCtaRows * 128;  // one 64-column block of a 64-row tile
constexpr int kHeadBytes = 2048;             // row ranges (1024 B), interval reduction (64 B)

/// Bytes of one 64-row tile (Q, K or V) of head dimension D.
template <int D>
constexpr int tile_bytes() {
  return kCtaRows * D * 2;
}
/// Dynamic shared memory of the forward: head, alignment slack, Q, two K and two V tiles.
template <int D>
constexpr int wg_fwd_smem() {
  return kHeadBytes + 1024 + 5 * tile_bytes<D>();
}

/// Byte offset of 16-byte chunk `c` (0 .. D/8−1) of row `r` (0..63) in a swizzled tile.
__device__ __forceinline__ int sw128(int r, int c) {
  return (c >> 3) * kBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

/// GMMA shared-memory descriptor, 128-byte swizzle; `addr` is a shared-space byte address,
/// lbo/sbo in bytes (their meaning per major mode: the file comment's layouts).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, int lbo, int sbo) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = static_cast<uint8_t>(gmma::LayoutType::B128);
  return d.desc_;
}
/// K-major operand (rows = M or N, columns = the K index d): k-step ks of 16 columns.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile, int ks) {
  return sw128_desc(tile + (ks >> 2) * kBlockBytes + (ks & 3) * 32, 16, 1024);
}
/// MN-major operand (rows = the K index key, columns = N index d): k-step kk of 16 rows; the
/// next 64 columns of N lie one block further (LBO), the next 8 rows 1024 bytes further (SBO).
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile, int kk) {
  return sw128_desc(tile + kk * 2048, kBlockBytes, 1024);
}

// The atoms take their accumulators as separate references; these expand an array.
template <class Atom, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float* d, gmma::ScaleOut sc,
                                        std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., sc);
}
template <class Atom, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float* d,
                                        std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, d[I]..., gmma::ScaleOut::One);
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}
__device__ __forceinline__ void fence_regs(uint32_t (&r)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) cute::warpgroup_fence_operand(r[i][j]);
}

/// S (64 × 64 keys, 32 floats per thread) = Q·Kᵀ over D: D/16 k-steps, issued, not waited for.
template <int D>
__device__ __forceinline__ void issue_qk(float (&s)[32], uint32_t q_tile, uint32_t k_tile) {
  using Atom = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    gmma_ss<Atom>(kmajor_desc(q_tile, ks), kmajor_desc(k_tile, ks), s,
                  ks == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One,
                  std::make_index_sequence<32>{});
}
/// O (64 × D, D/2 floats per thread) += P·V over the tile's 64 keys: 4 k-steps of 16 keys.
template <int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&p)[4][4],
                                         uint32_t v_tile) {
  using Atom = std::conditional_t<
      D == 128, gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
      gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>>;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    gmma_rs<Atom>(p[kk], mnmajor_desc(v_tile, kk), o, std::make_index_sequence<D / 2>{});
}

/// cp.async copies of keys [kb, kend) of KV head g of `src` ([Tk, NKV, D]) into a swizzled tile;
/// rows past kend and keys no row of the CTA sees (`rs`, 64 ranges) are zero-filled (they may
/// hold NaN, and P = 0 times NaN would poison O).
template <int D>
__device__ void load_keys(char* dst, const uint16_t* src, const Args& a, int g, int kb, int kend,
                          const Rng* rs) {
  constexpr int C = D / 8;
  const int lane = threadIdx.x & 31;
  const bool one = sees_all(rs[lane], kb, kend) || sees_all(rs[lane + 32], kb, kend);
  const bool covered = __any_sync(0xffffffffu, one);  // each warp checks all 64 rows
  for (int e = threadIdx.x; e < kKeys * C; e += kThreads) {
    const int j = e / C, c = e % C, key = kb + j;
    bool ok = key < kend;
    if (ok && !covered) {
      ok = false;
      for (int i = 0; i < kCtaRows && !ok; ++i) ok = sees(rs[i], key);
    }
    const int64_t off = ok ? (static_cast<int64_t>(key) * a.NKV + g) * D + c * 8 : 0;
    cp_async16(dst + sw128(j, c), src + off, ok);
  }
}

/// cp.async copies of the warp's item rows of q into rows 16·warp .. +15 of the Q tile.
template <int D>
__device__ void load_q_rows(char* dst, const Args& a, const Item& it, int warp, int lane) {
  constexpr int C = D / 8;
  for (int e = lane; e < kRows * C; e += 32) {
    const int r = e / C, c = e % C, t = it.t0 + r;
    const bool ok = it.valid && t < a.Tq;
    const int64_t off = ok ? (static_cast<int64_t>(t) * a.NH + it.h) * D + c * 8 : 0;
    cp_async16(dst + sw128(kRows * warp + r, c), a.q + off, ok);
  }
}

/// Online softmax of one warp's 16 rows of S_j (keys [kb, kend)), in place: s becomes
/// P = exp2(S·scale·log2e − m_new); m, l updated; alpha = exp2(m_old − m_new) for O.
__device__ __forceinline__ void softmax_tile(float (&s)[32], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], const Rng* wrs, float scale_log2,
                                             int kb, int kend, const TileFacts& f, int lane) {
  const int gr = lane >> 2, tq = lane & 3;
  if (!f.touch) {  // no row of this warp sees a key of the tile: P = 0, nothing changes
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    alpha[0] = alpha[1] = 1.f;
    return;
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    float x = s[i] * scale_log2;
    if (!f.full) {
      const int key = kb + 8 * (i >> 2) + 2 * tq + (i & 1);
      if (key >= kend || !sees(wrs[gr + 8 * ((i >> 1) & 1)], key)) x = -INFINITY;
    }
    s[i] = x;
    mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], x);
  }
  float mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r]);
    mu[r] = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet: exp2(-inf) = 0
    alpha[r] = exp2f(m[r] - mu[r]);
    m[r] = mn;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    s[i] = exp2f(s[i] - mu[(i >> 1) & 1]);
    l[(i >> 1) & 1] += s[i];
  }
}

/// P (fp32 score registers) as the bf16 A fragments of the 4 k-steps of 16 keys.
__device__ __forceinline__ void pack_p(uint32_t (&p)[4][4], const float (&s)[32]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    p[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
    p[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
    p[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
    p[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

/// Writes the warp's 16 rows of o (normalized by l) and lse, after folding in the head's sink.
template <int D>
__device__ void store_rows(const Args& a, const Item& it, float (&o)[D / 2], float (&m)[2],
                           float (&l)[2], int lane) {
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  if (a.sinks) {  // one more logit in the softmax (base 2 here), without a value row
    const float sk = a.sinks[it.h] * kLog2e;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float mn = fmaxf(m[r], sk), alpha = exp2f(m[r] - mn);
      l[r] = l[r] * alpha + exp2f(sk - mn);
      m[r] = mn;
#pragma unroll
      for (int i = 0; i < D / 2; ++i)
        if (((i >> 1) & 1) == r) o[i] *= alpha;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = it.t0 + gr + 8 * r;
    if (t >= a.Tq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    uint16_t* orow = a.out + (static_cast<int64_t>(t) * a.NH + it.h) * D + 2 * tq;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const uint32_t lo = f32_to_bf16(o[4 * dt + 2 * r] * inv);
      const uint32_t hi = f32_to_bf16(o[4 * dt + 2 * r + 1] * inv);
      *reinterpret_cast<uint32_t*>(orow + 8 * dt) = lo | (hi << 16);
    }
    if (a.lse_out && tq == 0)
      a.lse_out[static_cast<int64_t>(it.h) * a.Tq + t] =
          l[r] > 0.f ? m[r] * kLn2 + logf(l[r]) : -INFINITY;
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) attn_wg_fwd_kernel(const Args a) {
  DFLASH_DYNAMIC_SMEM(smem);
  Rng* rs = reinterpret_cast<Rng*>(smem);
  int* red = reinterpret_cast<int*>(smem + kCtaRows * 16);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t tiles_at = (base + kHeadBytes + 1023) & ~1023u;  // 1024-aligned (swizzle)
  char* tiles = smem + (tiles_at - base);
  constexpr int TB = tile_bytes<D>();
  // Q, then K stages 0 and 1, then V stages 0 and 1.
  auto k_stage = [&](int st) { return 1 + st; };
  auto v_stage = [&](int st) { return 3 + st; };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  QueryCta<1> c = query_cta_begin<1>(a, rs, red);
  const Rng* wrs = rs + warp * kRows;
  // Group 0: Q and K_0. Group 1: K_1 and V_0. Group j+2 (end of iteration j): K_{j+2}, V_{j+1}.
  TileCursor kcur = c.tiles, vcur = c.tiles;
  load_q_rows<D>(tiles, a, c.it[0], warp, lane);
  if (!kcur.done()) {
    load_keys<D>(tiles + k_stage(0) * TB, a.k, a, c.g, kcur.kb, kcur.kend(), rs);
    kcur.next();
  }
  mma::cp_async_commit();
  if (!kcur.done()) {
    load_keys<D>(tiles + k_stage(1) * TB, a.k, a, c.g, kcur.kb, kcur.kend(), rs);
    kcur.next();
  }
  if (!vcur.done()) {
    load_keys<D>(tiles + v_stage(0) * TB, a.v, a, c.g, vcur.kb, vcur.kend(), rs);
    vcur.next();
  }
  mma::cp_async_commit();

  float o[D / 2], s[32], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t p[4][4] = {};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  TileCursor cur = c.tiles;
  // One step j: S_j = Q·K_jᵀ (HS) and O += P_{j-1}·V_{j-1} (HP). The first step has no P, the
  // last no S; a template per case keeps every wgmma batch free of branches (a conditional wgmma
  // inside a batch makes ptxas serialize the pipeline).
  auto step = [&]<bool HS, bool HP>(int j) {
    const int st = j & 1;
    mma::cp_async_wait<1>();  // group j: K_j and V_{j-1}
    cutlass::arch::fence_view_async_shared();  // cp.async's writes, visible to wgmma's reads
    __syncthreads();
    fence_regs(s), fence_regs(o), fence_regs(p);
    cute::warpgroup_arrive();
    if constexpr (HS) issue_qk<D>(s, tiles_at, tiles_at + k_stage(st) * TB);
    cute::warpgroup_commit_batch();
    if constexpr (HP) issue_pv<D>(o, p, tiles_at + v_stage(st ^ 1) * TB);
    cute::warpgroup_commit_batch();
    float alpha[2] = {1.f, 1.f};
    if constexpr (HS) {
      cute::warpgroup_wait<1>();  // S_j has landed; P_{j-1}·V_{j-1} may still run
      fence_regs(s);
      const int kb = cur.kb, kend = cur.kend();
      const TileFacts f = tile_facts<1>(wrs, kb, kend, lane);
      softmax_tile(s, m, l, alpha, wrs, a.scale_log2, kb, kend, f, lane);
    }
    cute::warpgroup_wait<0>();
    fence_regs(o), fence_regs(p);
    if constexpr (HS) {
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
      pack_p(p, s);
      cur.next();
    }
    __syncthreads();  // K stage st and V stage st^1 are free
    if (!kcur.done()) {
      load_keys<D>(tiles + k_stage(st) * TB, a.k, a, c.g, kcur.kb, kcur.kend(), rs);
      kcur.next();
    }
    if (!vcur.done()) {
      load_keys<D>(tiles + v_stage(st ^ 1) * TB, a.v, a, c.g, vcur.kb, vcur.kend(), rs);
      vcur.next();
    }
    mma::cp_async_commit();
  };
  if (!cur.done()) {
    step.template operator()<true, false>(0);
    int j = 1;
    for (; !cur.done(); ++j) step.template operator()<true, true>(j);
    step.template operator()<false, true>(j);
  }
  mma::cp_async_wait<0>();
  if (c.it[0].valid) store_rows<D>(a, c.it[0], o, m, l, lane);
}

template <int D>
void fwd_d(const Args& a, cudaStream_t s) {
  constexpr int smem = wg_fwd_smem<D>();
  // A per-device attribute of the function, not a stream operation (allowed during capture).
  DFLASH_CUDA_CHECK(
      cudaFuncSetAttribute(attn_wg_fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(query_ctas(a, 1)), static_cast<unsigned>(a.NKV));
  attn_wg_fwd_kernel<D><<<grid, kThreads, smem, s>>>(a);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace launch {

void attention_wgmma_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                         const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                         cudaStream_t s) {
  if (p.Tq == 0) return;
  Args a = make_args(p, ranges);
  a.q = q, a.k = k, a.v = v, a.out = o, a.lse_out = lse;
  if (p.D == 64)
    fwd_d<64>(a, s);
  else
    fwd_d<128>(a, s);
}

}  // namespace launch
}  // namespace dflash::cuda
