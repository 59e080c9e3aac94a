// dflash.cpp — fused kernels of the target's cached forward on the GPU (TargetCuda::forward_cached,
// model/target_cuda.hpp): what the decoding step runs between its GEMMs, in fewer launches.
//
//   qkv_prepare_cuda:      the fused q/k/v projection's output row → q/k RMSNorm, RoPE, and the
//                          k/v rows written to their cache rows (one launch for six);
//   decode_attention_cuda: attention of a few query rows over KV caches with each row's keys split
//                          across CTAs (flash-decoding: partial max/sum/output per split, then a
//                          combine in a fixed order);
//   decode_linear_cuda:    the projections of a step (≤ 128 rows per weight pass) on tensor cores
//                          with a row order independent of the row count.
//
// Invariants: a row's results depend on that row's inputs only (its q/k/v values, position, key
// range and the cache rows in it), never on the number of rows or on which other rows share the
// launch: the split of a row's visible keys into chunks of kDecodeSplitKeys starts at its own
// first visible key, and the combine sums the chunks in ascending order. So batch N gives every
// request the bits of batch 1, and a verify row the bits of the same row in a one-token step.
// Nothing allocates; every launch is graph-capturable. Outputs are OVERWRITTEN. Sizes are checked
// on the host (dflash::Error naming the op); device pointers are the caller's.
#pragma once

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash {

/// Visible keys per split of decode_attention_cuda (a fixed constant: changing it changes bits).
constexpr int64_t kDecodeSplitKeys = 32;

/// Floats of decode_attention_cuda's workspace for `rows` query rows of `NH` heads of dimension
/// D whose rows see at most `max_keys` keys each: rows·NH·S·(D + 2), S = ⌈max_keys /
/// kDecodeSplitKeys⌉ (each split's unnormalised output, running max and sum).
inline int64_t decode_attention_work_floats(int64_t rows, int64_t NH, int64_t D, int64_t max_keys) {
  const int64_t splits = (max_keys + kDecodeSplitKeys - 1) / kDecodeSplitKeys;
  return rows * NH * splits * (D + 2);
}

#ifdef DFLASH_HAVE_CUDA

namespace cuda {
class CudaContext;
}

/// Sizes and per-layer weights of qkv_prepare_cuda.
struct QkvPrepare {
  int64_t T = 0;                    ///< tokens
  int64_t NH = 0, NKV = 0, D = 0;   ///< query heads, key/value heads, head_dim (64 or 128)
  const float* q_norm = nullptr;    ///< f32 [D] per-head RMSNorm weight of q, or null (no norm)
  const float* k_norm = nullptr;    ///< f32 [D] of k; null exactly when q_norm is
  double eps = 1e-6;                ///< RMSNorm epsilon
  const int32_t* pos = nullptr;     ///< [T] RoPE positions
  const float* inv_freq = nullptr;  ///< [D/2] RoPE inverse frequencies
  float rope_scaling = 1.0f;        ///< multiplies cos and sin (ops/rope.hpp)
};

/// For every token t < T, from its row of `qkv` bf16 [T, (NH + 2·NKV)·D] (the fused projection
/// x·[Wq; Wk; Wv]ᵀ: q heads, then k heads, then v heads):
///   q head h: y = RMSNorm(q_h; q_norm, eps) rounded to bf16 (skipped without q_norm), then
///             RoPE at pos[t] (rotate_half pairs (i, i + D/2), angle pos·inv_freq[i], cos and sin
///             times rope_scaling), rounded to bf16 → q_out[qrow(t)·NH·D + h·D + i];
///   k head g: the same with k_norm → k_out[kvrow(t)·NKV·D + g·D + i];
///   v head g: copied → v_out[kvrow(t)·NKV·D + g·D + i];
/// with qrow(t) = q_rows ? q_rows[t] : t and kvrow(t) = kv_rows ? kv_rows[t] : t (cache slots;
/// distinct rows, inside the outputs: the caller's plan). Arithmetic in fp32, the norm's sum of
/// squares in the order of rmsnorm_fwd_cuda (lane j sums j, j + 32, …, then a warp reduction):
/// the same bits as rmsnorm_fwd_cuda, rope_fwd_cuda and kv_scatter_cuda run one after the other
/// (formulas: ops/rmsnorm.hpp, ops/rope.hpp). One CTA per token, four lanes per head moving
/// 16-byte vectors (backend/cuda/decode_fused.cuh says how the sum keeps that order). Throws
/// dflash::Error for T < 0, D other than 64 or 128, NH or NKV < 1, one norm weight without the
/// other, a null pointer, or qkv, an output or a norm weight not 16-byte aligned.
void qkv_prepare_cuda(cuda::CudaContext& ctx, uint16_t* q_out, const int32_t* q_rows,
                      uint16_t* k_out, uint16_t* v_out, const int32_t* kv_rows, const uint16_t* qkv,
                      const QkvPrepare& p);

/// Attention of T query rows over one K/V array (the semantics of attention_fwd_cuda without lse,
/// ops/attention.hpp): o [T, NH, D] bf16 from q [T, NH, D], k, v [p.Tk, NKV, D] bf16 and each
/// row's visible keys ranges[t] = [lo1, hi1) ∪ [lo2, hi2), sinks as AttnParams::sinks. Row t's
/// visible keys, listed in that order, are cut into splits of kDecodeSplitKeys; one warp per (row,
/// query head, split) computes the split's running max m, sum l = Σ e^{s−m} and output Σ e^{s−m}·v
/// (s = scale·q·k, fp32) into `work`; a second kernel combines the splits of (row, head) in
/// ascending order: M = max(m_s, sink), o = Σ e^{m_s−M}·o_s / (Σ e^{m_s−M}·l_s + e^{sink−M}),
/// rounded to bf16 (o = 0 for a row without visible keys). Every row must see at most `max_keys`
/// keys and `work` hold decode_attention_work_floats(T, NH, D, max_keys) floats. Needs p.Tq == T,
/// NH a multiple of NKV with NH/NKV ≤ 32, D 64 or 128; throws dflash::Error otherwise or for a
/// null pointer. A row seeing more than max_keys keys gets only its first max_keys (the caller's
/// plan prevents it; not checked on the device).
void decode_attention_cuda(cuda::CudaContext& ctx, uint16_t* o, const uint16_t* q,
                           const uint16_t* k, const uint16_t* v, const AttnRange* ranges,
                           const AttnParams& p, float* work, int64_t max_keys);

/// y[M, OUT] = x[M, IN] · W[OUT, IN]ᵀ (`accumulate`: y += …, f32 only) for the few rows of a
/// decoding step: bf16 x and W, fp32 accumulation on tensor cores (mma m16n8k16), Y f32 or bf16
/// bits (rounded once). One pass over W per 128 rows: the weights stream at memory speed when
/// M is small, where cuBLASLt reads the skinny shapes slowly (docs/perf-runs-decoding.md). A
/// row's sum runs in an order fixed by IN alone (64-value chunks in four contiguous quarters, the
/// quarters added in order), so row r of y has the same bits for every M and every other row: a
/// verify of K rows and a one-token step agree, batch N agrees with batch 1. Needs IN a multiple of
/// 64, OUT a multiple of 8, x and W 16-byte aligned; throws dflash::Error otherwise, for a null
/// pointer, or for accumulate with a bf16 y.
template <typename Y>
void decode_linear_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w,
                        int64_t M, int64_t IN, int64_t OUT, bool accumulate);

#endif

}  // namespace dflash
