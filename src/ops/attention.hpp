// dflash.cpp — scaled dot-product attention with grouped-query heads (GQA) and per-query key
// ranges ("visibility by key range").
//
// Each query row t attends to the keys in [lo1, hi1) ∪ [lo2, hi2) of one shared K/V array
// (`AttnRange`). This single form covers:
//   * causal attention over packed documents (cu_seqlens / "varlen"): row t of the document
//     [s, e) sees [s, t+1) (`attention_causal_varlen_ranges`); nothing crosses documents;
//   * the DFlash drafter: a block's queries see context keys [doc_start, anchor) plus the keys of
//     their own block (a second range further down the same K/V array), DESIGN.md §1;
//   * block verification over a KV cache (one range);
//   * sliding windows (HF `sliding_window_overlay`: query q sees key k iff q − W < k ≤ q):
//     attention_window_ranges narrows the first range of each row to its last W keys.
// Shapes (row-major): q [Tq, NH, D], k and v [Tk, NKV, D], o [Tq, NH, D], lse [NH, Tq],
// ranges [Tq]. NH must be a multiple of NKV; query head h uses key/value head h / (NH/NKV)
// (HF `repeat_kv`). Scores are scale·q·k (scale usually 1/sqrt(D)); softmax statistics are kept
// as the natural-log logsumexp `lse` of the scaled scores, needed by the backward.
// A row with no visible key gets o = 0 and lse = -inf, and contributes no gradient.
// Attention sinks (gpt-oss, HF `GptOssAttention.sinks`): with `sinks` [NH] set, head h's softmax
// runs over its visible scores plus one extra logit sinks[h] that has no value row, so
// o = Σ_j e^{s_j}·v_j / (Σ_j e^{s_j} + e^{sinks[h]}) and lse includes the sink (a row with no
// visible key gets o = 0, lse = sinks[h]). The backward formulas below hold unchanged with that
// lse; no gradient flows to the sinks (they are frozen target weights).
// Memory never grows with Tq·Tk: each worker keeps one score buffer of at most Tk values.
// Keys outside a row's ranges are never read (they may hold anything, even NaN).
// Backward: dq, dk, dv are activation gradients and are OVERWRITTEN. Every sum runs in a fixed
// order (dq over keys ascending; dk, dv over query heads then queries ascending), so results are
// bit-identical for any thread count.
// Formulas: FlashAttention-2 (Dao 2023), Algorithm 2 backward with D_i = rowsum(dO ∘ O).
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena_plan.hpp"

namespace dflash {

/// Keys visible to one query row: [lo1, hi1) ∪ [lo2, hi2), indices into the K/V array.
/// Requirements: 0 ≤ lo ≤ hi ≤ Tk for both ranges, and the ranges do not overlap. An empty range
/// is lo == hi (e.g. {0, 0}).
struct AttnRange {
  int32_t lo1 = 0, hi1 = 0, lo2 = 0, hi2 = 0;
};

/// Which CUDA kernels attention_fwd_cuda / attention_bwd_cuda run (the CPU ops ignore it). All
/// compute the same function within the tolerance of the op tests; none falls back to another
/// on an error.
enum class AttnCudaKernels {
  automatic,    ///< the default: kAttnHopperKernels on an sm_90 device (Hopper; docs/perf.md,
                ///< "Hopper attention"), tensor_core on any other
  tensor_core,  ///< bf16 mma.sync tiles (src/backend/cuda/attention_tc.cu), any sm_80+ device
  ffma,         ///< the first CUDA-core version (src/backend/cuda/attention.cu), kept as a
                ///< cross-check of the tensor-core kernels
  wgmma,        ///< Hopper kernels (src/backend/cuda/attention_wgmma.cu: wgmma, sm_90 only; an
                ///< error on any other device), v6: one warpgroup per CTA, dq overlapped, the
                ///< backward's loops cut to fewer instructions; the default on sm_90
                ///< (kAttnHopperKernels). Its earlier versions v3b, v4 and v5 were removed
                ///< once v6 measured faster (docs/perf.md keeps their history)
};

/// Sizes and softmax scale of one attention call.
struct AttnParams {
  int64_t Tq = 0;   ///< query rows
  int64_t Tk = 0;   ///< key/value rows
  int64_t NH = 0;   ///< query heads
  int64_t NKV = 0;  ///< key/value heads (NH % NKV == 0)
  int64_t D = 0;    ///< head dimension
  double scale = 0; ///< multiplies q·k (usually 1/sqrt(D))
  /// Per-head sink logits [NH] (f32; host memory for the CPU entry points, device memory for the
  /// CUDA ones), or null for none. Not scaled by `scale`.
  const float* sinks = nullptr;
  AttnCudaKernels kernels = AttnCudaKernels::automatic;  ///< CUDA only
};

/// Fills `ranges` [T] for causal attention over packed documents: `doc_offsets` [n_docs+1]
/// (cu_seqlens: doc_offsets[0] = 0, non-decreasing, doc_offsets[n_docs] = T); row t of document
/// [s, e) gets {s, t+1, 0, 0}. Throws dflash::Error on malformed offsets.
void attention_causal_varlen_ranges(AttnRange* ranges, const int32_t* doc_offsets,
                                    int64_t n_docs, int64_t T);
/// Same, returning a vector.
std::vector<AttnRange> attention_causal_varlen_ranges(const int32_t* doc_offsets, int64_t n_docs,
                                                      int64_t T);

/// The document offsets (cu_seqlens, [n_docs+1], from 0 to T) that `ranges` [T] of
/// the causal varlen form describe (the inverse of attention_causal_varlen_ranges). Throws
/// dflash::Error naming the first row whose range is not {doc_start, t+1, 0, 0}.
std::vector<int32_t> attention_causal_varlen_docs(const AttnRange* ranges, int64_t T);

/// Sliding-window visibility: out[t] = in[t] with its first range narrowed to its last `window`
/// keys, lo1 = max(lo1, hi1 − window) (the second range is kept). For causal rows ({s, t+1}) this
/// is HF's sliding window: row t sees [max(s, t+1−W), t+1). `out` may alias `in`. Throws
/// dflash::Error when window < 1.
void attention_window_ranges(AttnRange* out, const AttnRange* in, int64_t T, int64_t window);

/// o = softmax(scale·q·kᵀ restricted to the row's ranges)·v per head; lse [NH, Tq] (may be null
/// when no backward follows). Throws dflash::Error on bad sizes or ranges (naming the row).
void attention_fwd_cpu(float* o, float* lse, const float* q, const float* k, const float* v,
                       const AttnRange* ranges, const AttnParams& p);
void attention_fwd_cpu(double* o, double* lse, const double* q, const double* k, const double* v,
                       const AttnRange* ranges, const AttnParams& p);

/// Backward of attention_fwd_cpu given dout [Tq, NH, D], the forward's o and lse. dq [Tq, NH, D],
/// dk and dv [Tk, NKV, D] are overwritten (any may be null to skip it).
void attention_bwd_cpu(float* dq, float* dk, float* dv, const float* dout, const float* q,
                       const float* k, const float* v, const float* o, const float* lse,
                       const AttnRange* ranges, const AttnParams& p);
void attention_bwd_cpu(double* dq, double* dk, double* dv, const double* dout, const double* q,
                       const double* k, const double* v, const double* o, const double* lse,
                       const AttnRange* ranges, const AttnParams& p);

/// Key-tile width of the CUDA attention kernels' span scratch (the FFMA kernels' dk/dv tile; the
/// tensor-core kernels' tiles are 64 keys, so their spans fit in the same scratch).
inline constexpr int kAttnCudaKeyTile = 32;
/// Device scratch attention_bwd_cuda takes from its context, in bytes: Δ [NH, Tq] f32 and the
/// query span of each key tile (2 int32 per tile of kAttnCudaKeyTile keys, at least one tile);
/// each block rounded to kArenaAlign. The same for both kernel families.
constexpr uint64_t attention_bwd_cuda_scratch_bytes(const AttnParams& p) {
  const int64_t tiles = (p.Tk + kAttnCudaKeyTile - 1) / kAttnCudaKeyTile;
  return arena_round(static_cast<uint64_t>(p.NH * p.Tq) * 4) +
         arena_round(static_cast<uint64_t>(tiles < 1 ? 1 : tiles) * 2 * 4);
}

/// The family AttnCudaKernels::automatic runs on an sm_90 device: the fastest wgmma version
/// measured at the reference batch that has passed the CUDA tests on the device (docs/perf.md,
/// "Hopper attention"): v6 (`wgmma`; backward 5.70 ms against v5's 9.17 at the reference batch,
/// the same bits as v5, lead's call Q of session 6).
inline constexpr AttnCudaKernels kAttnHopperKernels = AttnCudaKernels::wgmma;

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA attention_window_ranges over DEVICE arrays (graph-capturable; out may alias in).
void attention_window_ranges_cuda(cuda::CudaContext& ctx, AttnRange* out, const AttnRange* in,
                                  int64_t T, int64_t window);

/// True when ctx's device can run the wgmma kernels (AttnCudaKernels::wgmma): an sm_90 GPU.
bool attention_wgmma_available_cuda(cuda::CudaContext& ctx);
/// The family `k` names on ctx's device: automatic → kAttnHopperKernels or tensor_core (see
/// AttnCudaKernels), any other value itself.
AttnCudaKernels attention_kernels_cuda(cuda::CudaContext& ctx, AttnCudaKernels k);

/// CUDA forward: q, k, v, o bf16 (raw bits), lse f32 [NH, Tq] (may be null), `ranges` [Tq] a
/// DEVICE array. D must be 64 or 128. p.kernels picks the kernels: automatic (the default),
/// wgmma (src/backend/cuda/attention_wgmma.cu, sm_90 only) or tensor_core
/// (src/backend/cuda/attention_tc.cu), all with q, k, v, o 16-byte aligned, or ffma
/// (src/backend/cuda/attention.cu; q, k, v 4-byte aligned). Ranges are clamped to [0, Tk) on the
/// device (validate them on the host with the CPU rules when made). Tiled: memory independent of
/// Tq·Tk. fp32 softmax statistics. Throws dflash::Error on bad sizes, pointers or alignment.
void attention_fwd_cuda(cuda::CudaContext& ctx, uint16_t* o, float* lse, const uint16_t* q,
                        const uint16_t* k, const uint16_t* v, const AttnRange* ranges,
                        const AttnParams& p);
/// CUDA backward: dq [Tq,NH,D], dk, dv [Tk,NKV,D] bf16, OVERWRITTEN (each may be null); needs the
/// forward's o and lse. No atomics on outputs: dq per query tile, dk/dv per key tile, fixed
/// summation order, bit-reproducible. Scratch (attention_bwd_cuda_scratch_bytes) from
/// ctx.scratch(). p.kernels and alignment as attention_fwd_cuda (every family but ffma: dq, dk,
/// dv, dout, o 16-byte aligned too).
void attention_bwd_cuda(cuda::CudaContext& ctx, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                        const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, const uint16_t* o, const float* lse,
                        const AttnRange* ranges, const AttnParams& p);
#endif

}  // namespace dflash
