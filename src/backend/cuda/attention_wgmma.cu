// dflash.cpp — the Hopper attention kernels (sm_90a): forward and backward on wgmma, one
// warpgroup per 64 query rows (forward, dq) or per 64 keys (dk/dv) (semantics in
// src/ops/attention.hpp; launchers declared in attention_wgmma.hpp).
// Version v6 (measurements in docs/perf.md, "Hopper attention"): dq overlapped (Q as register
// fragments, K in three stages), the dk/dv chunk loader finding its 4 items once per chunk, and
// dq's and dk/dv's dS parts chosen once per tile or chunk and warp as unmasked or masked. A CTA
// is one warpgroup (128 threads), the tiles are its own, and its threads issue the shared copies
// and meet at one CTA barrier per tile or chunk. (The earlier versions are in perf.md's history:
// v4, two warpgroups per CTA, was removed with v6; v3b, products one after the other, and v5,
// v6's values without the instruction cuts, were removed once v6 had measured faster.)
//
// Work split: exactly the tensor-core kernels' (attention_tc.cuh): a CTA of 4 warps holds 4
// consecutive items (16 query rows under one query head each, group-major, heads inside), so
// with GQA 4 (Qwen3-8B: 32 q / 8 kv heads) a CTA is one DFlash block of 16 queries under the 4
// query heads of one KV head: 64 rows with one key range, wgmma's M = 64. It visits the same key
// tiles (cta_tiles: the union of the rows' first ranges, then of their second ranges, 64 keys per
// tile from each interval's start), zero-fills keys no row of the CTA sees and never loads
// context a block does not see. Other GQA ratios and MHA work unchanged (a CTA's 4 items then
// span two token groups; the masks are per element).
// Forward, per key tile j (FlashAttention-3, Shah et al. 2024, §3.2 "intra-warpgroup
// overlapping"): S_j = Q·K_jᵀ (wgmma m64n64k16, Q and K from shared memory) is issued together
// with O += P_{j-1}·V_{j-1} (wgmma m64nDk16, P from registers, V from shared memory); the online
// softmax of S_j runs while the P·V product is still in flight; O is rescaled by
// exp2(m_{j-1} − m_j) once that product has landed. The softmax has a full and a masked version,
// chosen once per tile and warp (the masks are per element only on partial tiles).
// Loads: cp.async by all 128 threads, one group per tile {K_j, V_{j-1}}, issued two tiles ahead
// (K) and one tile ahead (V) into two-stage K and V rings, so every load has a whole tile of
// compute to land in. Each warp reads its 16 rows of the 64 × 64 score tile: the accumulator
// layout of m64nNk16 is, per warp, that of mma.sync m16n8 (PTX ISA "wgmma register fragments"),
// so the masks, the softmax and the P → A-fragment packing follow attention_tc.cuh.
// Backward (FlashAttention-2 Algorithm 2 with D_i = rowsum(dO ∘ O); v2's Δ and span pre-passes):
// dq per 64 query rows over the forward's key tiles (S and dP as SS products, dQ += dS·K as RS);
// dk/dv per 64-key tile of one KV head over chunks of 64 query rows of the tile's span, in
// FlashAttention-3's transposed form (Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q). Every
// output element is written once after a fixed-order loop: no atomics on outputs.
// Shared memory tiles (Q, dO, K, V: 64 rows × D bf16) are stored as D/64 column blocks of
// 64 rows × 128 bytes with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)),
// 1024-byte aligned: the canonical GMMA layouts "K-major SW128" (an operand whose rows are M or
// N) and "MN-major SW128" (an operand whose rows are the K index: V, K in dQ, dO and Q in dk/dv)
// (cute/atom/mma_traits_sm90_gmma.hpp, make_gmma_desc). The instructions are CuTe's SM90 GMMA
// atoms; the descriptors are built here from that layout (CuTe's layout algebra would only
// restate these fixed tiles).
// Numerics as attention_tc.cuh: fp32 accumulators and statistics, base-2 exponentials on scores
// pre-multiplied by scale·log2(e) (ex2.approx.ftz: results below 2^-126 are 0), P and dS
// rounded to bf16 as MMA inputs, lse stored in natural log, sinks folded in after the last tile.
// Bit-reproducible: fixed tile and chunk order, no atomics.
// Head dimensions 64 and 128; bf16 arrays 16-byte aligned (checked by the entry points).
#include <cutlass/arch/barrier.h>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#include "backend/cuda/attention_launch.hpp"
#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/attention_tc_launch.cuh"
#include "backend/cuda/attention_wgmma.hpp"

namespace dflash::cuda {
namespace {

using namespace attn_tc;
namespace gmma = cute::SM90::GMMA;

constexpr int kBlockBytes = kCtaRows * 128;  // one 64-column block of a 64-row tile

/// Threads of a CTA: one warpgroup.
constexpr int kWgThreads = 128;
/// Shared-memory head of the forward and dq kernels: the row ranges of the CTA's 64 rows (1024
/// bytes) and the interval reduction (64 bytes), rounded up.
constexpr int kWgHeadBytes = 2048;

/// Bytes of one 64-row tile (Q, K or V) of head dimension D.
template <int D>
constexpr int tile_bytes() {
  return kCtaRows * D * 2;
}
/// Dynamic shared memory of the forward: head, alignment slack, the Q tile, two K and two V
/// tiles.
template <int D>
constexpr int wg_fwd_smem() {
  return kWgHeadBytes + 1024 + 5 * tile_bytes<D>();
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
/// `d` with its start address moved by `bytes` (a multiple of 16). The start-address field is the
/// descriptor's low 14 bits (address / 16) and shared addresses stay below 2^18, so the sum never
/// carries out of it: sw128_desc(a, l, s) + b / 16 == sw128_desc(a + b, l, s), bit for bit, with
/// one 64-bit add per wgmma instead of rebuilding the bit fields (~10 uniform instructions).
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, int bytes) {
  return d + static_cast<uint64_t>(bytes >> 4);
}
/// K-major operand (rows = M or N, columns = the K index d): the descriptor of the tile and the
/// byte offset of k-step ks of 16 columns.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile) {
  return sw128_desc(tile, 16, 1024);
}
__device__ __forceinline__ constexpr int kmajor_step(int ks) {
  return (ks >> 2) * kBlockBytes + (ks & 3) * 32;
}
/// MN-major operand (rows = the K index key, columns = N index d): the descriptor of the tile and
/// the byte offset of k-step kk of 16 rows; the next 64 columns of N lie one block further (LBO),
/// the next 8 rows 1024 bytes further (SBO).
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile) {
  return sw128_desc(tile, kBlockBytes, 1024);
}
__device__ __forceinline__ constexpr int mnmajor_step(int kk) {
  return kk * 2048;
}

// The atoms take their accumulators as separate references; these expand an array.
template <class Atom, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float* d, gmma::ScaleOut sc,
                                        std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., sc);
}
template <class Atom, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float* d,
                                        gmma::ScaleOut sc, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, d[I]..., sc);
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

/// s (64 × 64, 32 floats per thread) = A·Bᵀ over D for two K-major 64-row tiles (Q·Kᵀ, dO·Vᵀ,
/// K·Qᵀ, V·dOᵀ): D/16 k-steps, issued, not waited for.
template <int D>
__device__ __forceinline__ void issue_qk(float (&s)[32], uint32_t q_tile, uint32_t k_tile) {
  using Atom = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
  const uint64_t da = kmajor_desc(q_tile), db = kmajor_desc(k_tile);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    gmma_ss<Atom>(desc_plus(da, kmajor_step(ks)), desc_plus(db, kmajor_step(ks)), s,
                  ks == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One,
                  std::make_index_sequence<32>{});
}
/// o (64 × D, D/2 floats per thread) += P·B, P the A fragments of a 64 × 64 matrix (pack_p), B an
/// MN-major 64-row tile (P·V, dS·K, Pᵀ·dO, dSᵀ·Q): 4 k-steps of 16, issued, not waited for.
template <int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&p)[4][4],
                                         uint32_t v_tile) {
  using Atom =
      std::conditional_t<D == 128,
                         gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
                         gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>>;
  const uint64_t db = mnmajor_desc(v_tile);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    gmma_rs<Atom>(p[kk], desc_plus(db, mnmajor_step(kk)), o, gmma::ScaleOut::One,
                  std::make_index_sequence<D / 2>{});
}
/// s (64 × 64) = Q·Kᵀ over D with Q as register A fragments (qf[ks]: k-step ks of the warp's 16
/// rows, load_a_frags) and K a K-major 64-row tile: D/16 k-steps, issued, not waited for.
template <int D>
__device__ __forceinline__ void issue_qk_rs(float (&s)[32], const uint32_t (&qf)[D / 16][4],
                                            uint32_t k_tile) {
  using Atom = gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
  const uint64_t db = kmajor_desc(k_tile);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    gmma_rs<Atom>(qf[ks], desc_plus(db, kmajor_step(ks)), s,
                  ks == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One,
                  std::make_index_sequence<32>{});
}
/// The A fragments of the warp's 16 rows (rows 16·(warp % 4) ..) of a swizzled 64-row tile at
/// `tile` (generic address), all D/16 k-steps: per k-step, ldmatrix.x4 of (rows 0–7, columns
/// 0–7), (rows 8–15, 0–7), (rows 0–7, 8–15), (rows 8–15, 8–15), the register order of the
/// m64k16 A fragment (as mma.sync m16k16's).
template <int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&qf)[D / 16][4], const char* tile, int warp,
                                             int lane) {
  const int row = 16 * (warp & 3) + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) mma::ldsm_x4(qf[ks], tile + sw128(row, 2 * ks + (lane >> 4)));
}

/// cp.async copies, by the 128 threads of the CTA, of keys [kb, kend) of KV head g of `src`
/// ([Tk, NKV, D]) into a swizzled tile; rows past kend and keys no row of the CTA sees (`rs`,
/// 64 ranges) are zero-filled (they may hold NaN, and P = 0 times NaN would poison O). Thread
/// i always copies chunk i % (D/8) of rows i / (D/8) + P·k (P = 128 / (D/8) rows per pass, a
/// multiple of 8, so the swizzle term is fixed per thread): the addresses advance by a constant
/// per pass.
template <int D>
__device__ void load_keys(char* dst, const uint16_t* src, const Args& a, int g, int kb, int kend,
                          const Rng* rs) {
  constexpr int C = D / 8, P = kWgThreads / C, PASSES = kKeys / P, R = kCtaRows;
  static_assert(P % 8 == 0 && kKeys % P == 0, "rows per pass keep the swizzle phase");
  const int lane = threadIdx.x & 31;
  // Common case: one row of the CTA sees the whole tile, so every key of it is needed.
  bool one = false;
#pragma unroll
  for (int i = 0; i < R / 32; ++i) one = one || sees_all(rs[lane + 32 * i], kb, kend);
  const bool covered = __any_sync(0xffffffffu, one);  // each warp checks all R rows
  const int j0 = threadIdx.x / C, c = threadIdx.x % C;
  const int64_t pass_bytes = static_cast<int64_t>(P) * a.NKV * D * 2;
  const char* from =
      reinterpret_cast<const char*>(src + (static_cast<int64_t>(kb + j0) * a.NKV + g) * D + c * 8);
  char* to = dst + sw128(j0, c);
  if (covered) {  // the common case: each key of the tile up to kend is needed
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const bool ok = kb + j0 + pass * P < kend;
      cp_async16(to + pass * P * 128, ok ? from : reinterpret_cast<const char*>(src), ok);
      from += pass_bytes;
    }
    return;
  }
  for (int pass = 0; pass < PASSES; ++pass) {
    const int key = kb + j0 + pass * P;
    bool ok = false;
    for (int i = 0; i < R && key < kend && !ok; ++i) ok = sees(rs[i], key);
    cp_async16(to + pass * P * 128, ok ? from : reinterpret_cast<const char*>(src), ok);
    from += pass_bytes;
  }
}

/// cp.async copies of the warp's item rows of `src` ([Tq, NH, D]: q or dout) into rows
/// 16·warp .. +15 of a swizzled 64-row tile (`warp`: the warp's index in its warpgroup; rows past
/// Tq or of an invalid item: zeros).
template <int D>
__device__ void load_item_tile(char* dst, const uint16_t* src, const Args& a, const Item& it,
                               int warp, int lane) {
  constexpr int C = D / 8;
  for (int e = lane; e < kRows * C; e += 32) {
    const int r = e / C, c = e % C, t = it.t0 + r;
    const bool ok = it.valid && t < a.Tq;
    const int64_t off = ok ? (static_cast<int64_t>(t) * a.NH + it.h) * D + c * 8 : 0;
    cp_async16(dst + sw128(kRows * warp + r, c), src + off, ok);
  }
}

/// 2^x with denormal results flushed to zero (PTX ex2.approx.ftz.f32; exp2(-inf) = 0). CUDA's
/// exp2f without -ftz wraps the same instruction in a denormal-range fix-up (a compare and two
/// multiplies per element, a third of the softmax's instructions here), and neither CUDA nor
/// CUTLASS exposes the bare instruction as a function. P below 2^-126 is 0 either way once summed
/// against values near 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// Online softmax of one warp's 16 rows of S_j (keys [kb, kend)), in place: s becomes
/// P = exp2(S·scale·log2e − m_new); m, l updated; alpha = exp2(m_old − m_new) for O. m is kept
/// in the scaled (base-2) domain. kMasked: some element of the warp's rows is not visible
/// (rows `mine`, this thread's two rows gr and gr + 8, clamped); otherwise no mask at all.
template <bool kMasked>
__device__ __forceinline__ void softmax_tile(float (&s)[32], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], const Rng (&mine)[2],
                                             float scale_log2, int kb, int kend, int lane) {
  const int tq = lane & 3;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = (i >> 1) & 1;
    if constexpr (kMasked) {  // branch-free: the two ranges and the tile end
      const int key = kb + 8 * (i >> 2) + 2 * tq + (i & 1);
      const Rng& q = mine[r];
      const bool vis =
          key < kend && (((key >= q.lo1) & (key < q.hi1)) | ((key >= q.lo2) & (key < q.hi2)));
      s[i] = vis ? s[i] : -INFINITY;
    }
    mx[r] = fmaxf(mx[r], s[i]);
  }
  float mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r] * scale_log2);  // scale > 0: max commutes with it
    mu[r] = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet: exp2(-inf) = 0
    alpha[r] = exp2_ftz(m[r] - mu[r]);
    m[r] = mn;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = (i >> 1) & 1;
    s[i] = exp2_ftz(fmaf(s[i], scale_log2, -mu[r]));
    l[r] += s[i];
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

/// o and lse of a CTA's 64 query rows (the file comment's forward): grid query_ctas(a, 1) × NKV,
/// 128 threads, wg_fwd_smem<D>() bytes of dynamic shared memory.
template <int D>
__global__ void __launch_bounds__(kWgThreads) attn_wg_fwd_kernel(const Args a) {
  DFLASH_DYNAMIC_SMEM(smem);
  Rng* rs = reinterpret_cast<Rng*>(smem);
  int* red = reinterpret_cast<int*>(smem + kCtaRows * 16);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t tiles_at = (base + kWgHeadBytes + 1023) & ~1023u;  // 1024-aligned (swizzle)
  char* tiles = smem + (tiles_at - base);
  constexpr int TB = tile_bytes<D>();
  // Q, then K stages 0 and 1, then V stages 0 and 1.
  auto k_stage = [&](int st) { return 1 + st; };
  auto v_stage = [&](int st) { return 3 + st; };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t q_at = tiles_at;

  QueryCta<1> c = query_cta_begin<1, kWarps>(a, rs, red);
  const Rng* wrs = rs + warp * kRows;
  const Rng mine[2] = {wrs[lane >> 2], wrs[(lane >> 2) + 8]};  // this thread's two rows
  // Group 0: Q and K_0. Group 1: K_1 and V_0. Group j+2 (end of iteration j): K_{j+2}, V_{j+1}.
  TileCursor kcur = c.tiles, vcur = c.tiles;
  load_item_tile<D>(tiles, a.q, a, c.it[0], warp, lane);
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
    mma::cp_async_wait<1>();                   // group j: K_j and V_{j-1}
    cutlass::arch::fence_view_async_shared();  // cp.async's writes, visible to wgmma's reads
    __syncthreads();
    fence_regs(s), fence_regs(o), fence_regs(p);
    cute::warpgroup_arrive();
    if constexpr (HS) issue_qk<D>(s, q_at, tiles_at + k_stage(st) * TB);
    cute::warpgroup_commit_batch();
    if constexpr (HP) issue_pv<D>(o, p, tiles_at + v_stage(st ^ 1) * TB);
    cute::warpgroup_commit_batch();
    float alpha[2] = {1.f, 1.f};
    if constexpr (HS) {
      cute::warpgroup_wait<1>();  // S_j has landed; P_{j-1}·V_{j-1} may still run
      fence_regs(s);
      const int kb = cur.kb, kend = cur.kend();
      const TileFacts f = tile_facts<1>(wrs, kb, kend, lane);
      if (!f.touch) {  // no row of this warp sees a key of the tile: P = 0, nothing changes
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
      } else if (f.full) {
        softmax_tile<false>(s, m, l, alpha, mine, a.scale_log2, kb, kend, lane);
      } else {
        softmax_tile<true>(s, m, l, alpha, mine, a.scale_log2, kb, kend, lane);
      }
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

// ---------------------------------------------------------------- backward

/// K stages of the dq kernel: three (K_{j−1} stays while dQ += dS_{j−1}·K_{j−1} runs beside tile
/// j's products and tile j+1 lands; Q is held as register A fragments and its shared tile serves
/// as the third K stage, so two CTAs still fit on an SM).
constexpr int kDqKStages = 3;
/// Dynamic shared memory of the dq kernel: head, slack, the Q and dO tiles, the K stages that do
/// not use Q's tile, two V tiles.
template <int D>
constexpr int wg_dq_smem() {
  return kWgHeadBytes + 1024 + (2 + (kDqKStages - 1) + 2) * tile_bytes<D>();
}

/// dS = P ∘ (dP − Δ) of the warp's 16 rows and a key tile [kb, kend) some row of the warp
/// touches, in place of s (S = Q·Kᵀ on entry), with P = exp2(S·scale·log2e − lse2) (rows `wrs`):
/// kMasked false when every row sees every key of the tile (TileFacts::full, known per tile and
/// warp: no test per element, no branch), true to test each element and select 0 where its row
/// does not see its key (unseen keys may hold NaN: selected away, never multiplied).
template <bool kMasked>
__device__ __forceinline__ void dq_tile_ds(float (&s)[32], const float (&dp)[32], const Rng* wrs,
                                           const float (&lse2)[2], const float (&dl)[2],
                                           float scale_log2, int kb, int kend, int lane) {
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = (i >> 1) & 1;
    const float p = exp2_ftz(fmaf(s[i], scale_log2, -lse2[r]));
    const float d = p * (dp[i] - dl[r]);
    if constexpr (kMasked) {
      const int key = kb + 8 * (i >> 2) + 2 * tq + (i & 1);
      s[i] = key < kend && sees(wrs[gr + 8 * r], key) ? d : 0.f;
    } else {
      s[i] = d;
    }
  }
}

/// dQ of a CTA's 64 query rows (FlashAttention-2 Algorithm 2's dq half): per key tile of the
/// forward's cursor, S = Q·Kᵀ and dP = dO·Vᵀ (wgmma SS, both operands K-major), then
/// dS = P ∘ (dP − Δ) with P = exp2(S·scale·log2e − lse2) (masked entries 0), then dQ += dS·K
/// (wgmma RS, K as the MN-major operand); dq = scale·dQ. Q is held as register fragments (S =
/// Q·Kᵀ an RS product): step j issues S_j, dP_j together with dQ += dS_{j−1}·K_{j−1} and
/// computes dS_j while that product runs (the forward's intra-warpgroup overlap), tile j+1
/// loading meanwhile; dS by dq_tile_ds, its masked or unmasked version chosen per tile and warp.
/// Grid query_ctas(a, 1) × NKV, 128 threads, wg_dq_smem<D>() bytes of shared memory.
template <int D>
__global__ void __launch_bounds__(kWgThreads) attn_wg_dq_kernel(const Args a) {
  DFLASH_DYNAMIC_SMEM(smem);
  Rng* rs = reinterpret_cast<Rng*>(smem);
  int* red = reinterpret_cast<int*>(smem + kCtaRows * 16);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t tiles_at = (base + kWgHeadBytes + 1023) & ~1023u;
  char* tiles = smem + (tiles_at - base);
  constexpr int TB = tile_bytes<D>(), KST = kDqKStages;
  // Q, dO, then the K stages (the last one is Q's tile once Q is in registers), then V stages 0
  // and 1.
  constexpr int K0 = 2, V0 = 2 + KST - 1;
  auto k_slot = [&](int st) { return st == KST - 1 ? 0 : K0 + st; };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t do_at = tiles_at + TB;
  QueryCta<1> c = query_cta_begin<1, kWarps>(a, rs, red);
  const Item it = c.it[0];
  const Rng* wrs = rs + warp * kRows;
  load_item_tile<D>(tiles, a.q, a, it, warp, lane);
  load_item_tile<D>(tiles + TB, a.dout, a, it, warp, lane);
  TileCursor nxt = c.tiles;
  if (!nxt.done()) {
    load_keys<D>(tiles + K0 * TB, a.k, a, c.g, nxt.kb, nxt.kend(), rs);
    load_keys<D>(tiles + V0 * TB, a.v, a, c.g, nxt.kb, nxt.kend(), rs);
    nxt.next();
  }
  mma::cp_async_commit();
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) row_stat(lse2[r], dl[r], a, it, it.t0 + (lane >> 2) + 8 * r);
  float acc[D / 2], s[32], dp[32];
  uint32_t ds[4][4] = {};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = dp[i] = 0.f;
  {
    // Step j: tile j (K stage j % 3, V stage j % 2) has landed; after the barrier the warpgroup
    // is done with tile j−2's K and tile j−1's V, whose stages take tile j+1 (tile 2 first takes
    // Q's tile: step 0 moved Q into registers before the barrier of step 1). HS: tile j exists
    // (S_j, dP_j); HP: a dS_{j−1} is pending (dQ += dS_{j−1}·K_{j−1}). A template per case keeps
    // each wgmma batch free of branches.
    uint32_t qf[D / 16][4];  // Q's A fragments
    auto step = [&]<bool HS, bool HP>(int j) {
      mma::cp_async_wait<0>();
      cutlass::arch::fence_view_async_shared();
      __syncthreads();
      if (!nxt.done()) {
        load_keys<D>(tiles + k_slot((j + 1) % KST) * TB, a.k, a, c.g, nxt.kb, nxt.kend(), rs);
        load_keys<D>(tiles + (V0 + ((j + 1) & 1)) * TB, a.v, a, c.g, nxt.kb, nxt.kend(), rs);
        nxt.next();
      }
      mma::cp_async_commit();
      if constexpr (HS && !HP) load_a_frags<D>(qf, tiles, warp, lane);  // step 0
      fence_regs(s), fence_regs(dp), fence_regs(acc), fence_regs(ds);
      cute::warpgroup_arrive();
      if constexpr (HS) {
        issue_qk_rs<D>(s, qf, tiles_at + k_slot(j % KST) * TB);
        issue_qk<D>(dp, do_at, tiles_at + (V0 + (j & 1)) * TB);
      }
      cute::warpgroup_commit_batch();
      if constexpr (HP) issue_pv<D>(acc, ds, tiles_at + k_slot((j + KST - 1) % KST) * TB);
      cute::warpgroup_commit_batch();
      if constexpr (HS) {
        cute::warpgroup_wait<1>();  // S_j and dP_j have landed; dQ += dS_{j−1}·K_{j−1} may run
        fence_regs(s), fence_regs(dp);
        const int kb = c.tiles.kb, kend = c.tiles.kend();
        const TileFacts f = tile_facts<1>(wrs, kb, kend, lane);
        if (!f.touch) {  // no row of this warp sees a key of the tile: dS = 0
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = 0.f;
        } else if (f.full) {
          dq_tile_ds<false>(s, dp, wrs, lse2, dl, a.scale_log2, kb, kend, lane);
        } else {
          dq_tile_ds<true>(s, dp, wrs, lse2, dl, a.scale_log2, kb, kend, lane);
        }
      }
      cute::warpgroup_wait<0>();
      fence_regs(acc), fence_regs(ds);
      if constexpr (HS) {
        pack_p(ds, s);
        c.tiles.next();
      }
    };
    if (!c.tiles.done()) {
      step.template operator()<true, false>(0);
      int j = 1;
      for (; !c.tiles.done(); ++j) step.template operator()<true, true>(j);
      step.template operator()<false, true>(j);
    }
  }
  mma::cp_async_wait<0>();
  if (!it.valid) return;
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = it.t0 + gr + 8 * r;
    if (t >= a.Tq) continue;
    uint16_t* row = a.dq + (static_cast<int64_t>(t) * a.NH + it.h) * D + 2 * tq;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const uint32_t lo = f32_to_bf16(a.scale * acc[4 * dt + 2 * r]);
      const uint32_t hi = f32_to_bf16(a.scale * acc[4 * dt + 2 * r + 1]);
      *reinterpret_cast<uint32_t*>(row + 8 * dt) = lo | (hi << 16);
    }
  }
}

/// One stage of the dk/dv kernel: a chunk of 64 query rows (4 items of the span's list): Q and
/// dO tiles, then lse in base 2 and Δ (64 floats each) and the rows' ranges (64 Rng), padded to
/// keep the next stage 1024-byte aligned.
template <int D>
constexpr int wg_chunk_bytes() {
  return 2 * tile_bytes<D>() + 2048;
}
/// Dynamic shared memory of the dk/dv kernel: slack, the K and V tiles, two chunk stages (chunk
/// c+1 loads while chunk c is computed).
template <int D>
constexpr int wg_dkdv_smem() {
  return 1024 + 2 * tile_bytes<D>() + 2 * wg_chunk_bytes<D>();
}

/// Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ − Δ) of the warp's 16 keys from kw and a chunk of 64 query rows
/// (stats lse2, dl and ranges rs of the chunk's rows), in place: s (Sᵀ on entry) becomes Pᵀ, dp
/// (dPᵀ on entry) dSᵀ; entries a row does not see are 0. Element i: key kw + gr + 8·((i/2) % 2),
/// query row 8·(i/4) + 2·tq + i%2 of the chunk. kMasked false when every row of the chunk sees
/// all 16 of the warp's keys (chosen once per chunk and warp: no test per element, no branch);
/// kMasked true tests each element and selects 0 where its row does not see its key (unseen keys
/// may hold NaN: selected away, never multiplied).
template <bool kMasked>
__device__ __forceinline__ void dkdv_chunk_ds(float (&s)[32], float (&dp)[32], const Rng* rs,
                                              const float* lse2, const float* dl, int kw, int Tk,
                                              float scale_log2, int lane) {
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int qi = 8 * (i >> 2) + 2 * tq + (i & 1);
    float p = exp2_ftz(fmaf(s[i], scale_log2, -lse2[qi]));
    float d = p * (dp[i] - dl[qi]);
    if constexpr (kMasked) {
      const int key = kw + gr + 8 * ((i >> 1) & 1);
      const bool vis = key < Tk && sees(rs[qi], key);
      p = vis ? p : 0.f;
      d = vis ? d : 0.f;
    }
    s[i] = p;
    dp[i] = d;
  }
}

/// cp.async copies, by the CTA's 128 threads, of chunk `chunk` of the list (Q, dO rows) and
/// plain loads of its rows' lse2, Δ and ranges into stage `st` (rows past the list: zero rows,
/// lse2 = +inf, no keys). Thread i copies 16-byte column c = i % C (C = D/8) of chunk rows
/// r0 + P·k, r0 = i / C, P = 128 / C
/// rows per pass (8 at D 128, 16 at D 64: a multiple of 8, so the swizzle term is fixed per
/// thread; a divisor of 16, so pass k stays inside item P·k / 16, at its token r0 + P·k % 16).
/// The chunk's 4 items (list entries 4·chunk .. 4·chunk+3, group-major as list_item) are found
/// once from the first (one division by the GQA ratio), each with its row-r0 offset and how many
/// of its rows from r0 on exist.
template <int D>
__device__ void load_wg_chunk(char* st, const Args& a, const ItemList& L, int chunk, int g) {
  constexpr int C = D / 8, P = kWgThreads / C, PASSES = kCtaRows / P, TB = tile_bytes<D>();
  static_assert(P % 8 == 0 && kRows % P == 0, "a pass keeps the swizzle phase and one item");
  const int r0 = threadIdx.x / C, c = threadIdx.x % C;
  const int first = chunk * kWarps;
  int group = first / a.rep, head = first - group * a.rep;
  int64_t off[kWarps];  // element offset of row r0 of item j (head's column c)
  int rows[kWarps];     // rows r0, r0+1, ... of item j that exist (0 past the list or Tq)
#pragma unroll
  for (int j = 0; j < kWarps; ++j) {
    const int t = (L.tg_lo + group) * kRows + r0;
    off[j] = (static_cast<int64_t>(t) * a.NH + g * a.rep + head) * D + c * 8;
    rows[j] = first + j < L.n ? a.Tq - t : 0;
    if (++head == a.rep) {
      head = 0;
      ++group;
    }
  }
  char* to = st + sw128(r0, c);
  const int64_t token_elems = static_cast<int64_t>(a.NH) * D;
#pragma unroll
  for (int k = 0; k < PASSES; ++k) {
    const int j = P * k / kRows, dt = P * k % kRows;  // item, token offset
    const bool ok = dt < rows[j];
    const int64_t o = ok ? off[j] + dt * token_elems : 0;
    cp_async16(to + P * k * 128, a.q + o, ok);
    cp_async16(to + TB + P * k * 128, a.dout + o, ok);
  }
  load_chunk_stats(reinterpret_cast<float*>(st + 2 * TB),
                   reinterpret_cast<float*>(st + 2 * TB) + kCtaRows,
                   reinterpret_cast<Rng*>(st + 2 * TB + 2 * kCtaRows * 4), a, L, chunk, g);
}

/// dK, dV of one tile of 64 keys of KV head g (FlashAttention-2 Algorithm 2's dk/dv half, in
/// FlashAttention-3's transposed form): per chunk of 64 query rows of the tile's span, Sᵀ = K·Qᵀ
/// and dPᵀ = V·dOᵀ (wgmma SS, 64 keys × 64 rows), Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ − Δ), then dV += Pᵀ·dO
/// and dK += dSᵀ·Q (wgmma RS, dO and Q as MN-major operands); warp i owns keys 16i .. 16i+15 of
/// the tile. Chunk c+1 loads while chunk c is computed (load_wg_chunk); dS by dkdv_chunk_ds.
/// Grid key_tiles(a)·NKV, 128 threads, wg_dkdv_smem<D>() bytes of shared memory. Fixed chunk
/// order, one writer per element: bit-reproducible.
template <int D>
__global__ void __launch_bounds__(kWgThreads) attn_wg_dkdv_kernel(const Args a) {
  constexpr int C = D / 8, TB = tile_bytes<D>();
  DFLASH_DYNAMIC_SMEM(smem);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t kv_at = (base + 1023) & ~1023u;  // K, V, then the chunk stages
  char* kv = smem + (kv_at - base);
  char* stages = kv + 2 * TB;
  const uint32_t stages_at = kv_at + 2 * TB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gr = lane >> 2, tq = lane & 3;
  const uint32_t kt = kv_at, vt = kt + TB;
  // 1-D grid, the KV heads of one key tile adjacent (as attn_tc_dkdv_kernel).
  const int tile = blockIdx.x / a.NKV, g = blockIdx.x % a.NKV;
  const int j0 = tile * kKeys;
  const int kw = j0 + warp * kRows;  // this warp's keys [kw, kw_end)
  const int kw_end = min(kw + kRows, a.Tk);
  for (int e = threadIdx.x; e < kKeys * C; e += kWgThreads) {
    const int j = e / C, cc = e % C, key = j0 + j;
    const bool ok = key < a.Tk;
    const int64_t off = ok ? (static_cast<int64_t>(key) * a.NKV + g) * D + cc * 8 : 0;
    cp_async16(kv + sw128(j, cc), a.k + off, ok);
    cp_async16(kv + TB + sw128(j, cc), a.v + off, ok);
  }
  // The tile's span (INT_MAX / −1 for a tile no row touches).
  const int q_first = a.span[2 * tile], q_last = a.span[2 * tile + 1];
  ItemList L{0, 0};
  if (q_first <= q_last) {
    L.tg_lo = q_first / kRows;
    L.n = (q_last / kRows - L.tg_lo + 1) * a.rep;
  }
  auto load_chunk = [&](char* st, int chunk) { load_wg_chunk<D>(st, a, L, chunk, g); };
  const int n_chunks = (L.n + kWarps - 1) / kWarps;
  if (n_chunks > 0) load_chunk(stages, 0);
  mma::cp_async_commit();

  float dk[D / 2], dv[D / 2];
  uint32_t pa[4][4] = {}, da[4][4] = {};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  for (int ch = 0; ch < n_chunks; ++ch) {
    const int stg = ch & 1;
    if (ch + 1 < n_chunks) load_chunk(stages + (stg ^ 1) * wg_chunk_bytes<D>(), ch + 1);
    mma::cp_async_commit();
    mma::cp_async_wait<1>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    const uint32_t qt = stages_at + stg * wg_chunk_bytes<D>(), dot = qt + TB;
    const float* lse2 = reinterpret_cast<const float*>(stages + stg * wg_chunk_bytes<D>() + 2 * TB);
    const float* dl = lse2 + kCtaRows;
    const Rng* crs = reinterpret_cast<const Rng*>(lse2 + 2 * kCtaRows);
    // Fresh accumulators (ScaleOut::Zero also ignores them): not live across chunks.
    float s[32], dp[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = dp[i] = 0.f;
    cute::warpgroup_arrive();
    issue_qk<D>(s, kt, qt);    // Sᵀ = K·Qᵀ
    issue_qk<D>(dp, vt, dot);  // dPᵀ = V·dOᵀ
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_regs(s), fence_regs(dp);
    // Every row of the chunk sees all 16 of this warp's keys: no mask (one vote per chunk).
    const bool full =
        kw_end - kw == kRows && __all_sync(0xffffffffu, sees_all(crs[lane], kw, kw_end) &&
                                                            sees_all(crs[lane + 32], kw, kw_end));
    if (full)
      dkdv_chunk_ds<false>(s, dp, crs, lse2, dl, kw, a.Tk, a.scale_log2, lane);
    else
      dkdv_chunk_ds<true>(s, dp, crs, lse2, dl, kw, a.Tk, a.scale_log2, lane);
    pack_p(pa, s);
    pack_p(da, dp);
    fence_regs(dv), fence_regs(dk), fence_regs(pa), fence_regs(da);
    cute::warpgroup_arrive();
    issue_pv<D>(dv, pa, dot);  // dV += Pᵀ·dO
    issue_pv<D>(dk, da, qt);   // dK += dSᵀ·Q
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_regs(dv), fence_regs(dk), fence_regs(pa), fence_regs(da);
    __syncthreads();  // stage stg is refilled next
  }
  mma::cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = kw + gr + 8 * r;
    if (key >= a.Tk) continue;
    const int64_t off = (static_cast<int64_t>(key) * a.NKV + g) * D + 2 * tq;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      if (a.dk) {
        const uint32_t lo = f32_to_bf16(a.scale * dk[4 * dt + 2 * r]);
        const uint32_t hi = f32_to_bf16(a.scale * dk[4 * dt + 2 * r + 1]);
        *reinterpret_cast<uint32_t*>(a.dk + off + 8 * dt) = lo | (hi << 16);
      }
      if (a.dv) {
        const uint32_t lo = f32_to_bf16(dv[4 * dt + 2 * r]),
                       hi = f32_to_bf16(dv[4 * dt + 2 * r + 1]);
        *reinterpret_cast<uint32_t*>(a.dv + off + 8 * dt) = lo | (hi << 16);
      }
    }
  }
}

template <int D>
void fwd_d(const Args& a, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(query_ctas(a, 1)), static_cast<unsigned>(a.NKV));
  launch_attn_kernel(attn_wg_fwd_kernel<D>, grid, kWgThreads, wg_fwd_smem<D>(), a, s);
}

/// The backward: Δ, dq, then dk/dv (spans first).
template <int D>
void bwd_d(const Args& a, float* delta, int* span, cudaStream_t s) {
  launch_attn_delta<D>(a, delta, s);
  if (a.dq) {
    const dim3 grid(static_cast<unsigned>(query_ctas(a, 1)), static_cast<unsigned>(a.NKV));
    launch_attn_kernel(attn_wg_dq_kernel<D>, grid, kWgThreads, wg_dq_smem<D>(), a, s);
  }
  if ((a.dk || a.dv) && a.Tk > 0) {
    launch_attn_spans(a, span, s);
    launch_attn_kernel(attn_wg_dkdv_kernel<D>, dim3(static_cast<unsigned>(key_tiles(a) * a.NKV)),
                       kWgThreads, wg_dkdv_smem<D>(), a, s);
  }
}

}  // namespace

namespace launch {

void attention_wgmma_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                         const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                         cudaStream_t s) {
  if (p.Tq == 0) return;
  const Args a = attn_fwd_args(o, lse, q, k, v, ranges, p);
  if (p.D == 64)
    fwd_d<64>(a, s);
  else
    fwd_d<128>(a, s);
}

void attention_wgmma_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                         const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                         const float* lse, const AttnRange* ranges, const AttnParams& p,
                         float* delta_ws, int* span_ws, cudaStream_t s) {
  if (attn_bwd_without_rows(dk, dv, p, s)) return;
  const Args a = attn_bwd_args(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta_ws, span_ws);
  if (p.D == 64)
    bwd_d<64>(a, delta_ws, span_ws, s);
  else
    bwd_d<128>(a, delta_ws, span_ws, s);
}

}  // namespace launch
}  // namespace dflash::cuda
