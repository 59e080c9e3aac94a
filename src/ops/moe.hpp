// dflash.cpp — mixture-of-experts ops: top-k routing, expert-sorted dispatch, grouped expert GEMMs,
// the experts' gated activations and the weighted combine (HF `Qwen3MoeSparseMoeBlock`,
// `GptOssMLP`).
//
// One sparse block over T tokens, E experts, top-k K, hidden H, expert width I:
//   logits [T, E]    = x·Wrᵀ (+ br)                      router: a plain linear (ops/linear.hpp)
//   ids, w [T, K]    = moe_route(logits)                 the K experts of each token, their weights
//   perm, slot, offsets, row_expert = moe_dispatch(ids)  R = T·K rows sorted by expert
//   xs [R, H]        = x[perm[r] / K]                    moe_gather
//   gate/up [R, I]   = xs·W_gateᵀ, xs·W_upᵀ per expert   moe_grouped_linear over `offsets`
//   a [R, I]         = act(gate + bg, up + bu)           moe_glu (biases per expert, may be null)
//   ys [R, H]        = a·W_downᵀ per expert              moe_grouped_linear
//   y[t]            += Σ_k w[t,k]·(ys[slot[t·K+k]] + bd[ids[t,k]])   moe_combine (ACCUMULATES)
// Dispatch layout: sorted row r holds the pair (t, k) = (perm[r] / K, perm[r] % K); the rows of
// expert e are [offsets[e], offsets[e+1]) in increasing (t, k) order (a stable sort, so the layout
// is a pure function of ids); slot is the inverse permutation (slot[perm[r]] = r) and
// row_expert[r] the expert of row r. Every output element is produced by one thread (CUDA) or
// one loop (CPU) with a fixed summation order (the combine sums k = 0..K-1), so both backends are
// deterministic for any thread count. No op here loops over tokens on the host.
// The CPU entry points are the reference of the CUDA ones (same arguments, fp32 compute).
#pragma once

#include <cstdint>

#include "core/arena_plan.hpp"

namespace dflash {

/// How a MoE router turns its logits [E] into the top-k experts and their weights.
enum class MoeRoutingMode {
  /// Qwen3MoeTopKRouter: p = softmax(logits) over all E experts, the K largest p (largest first),
  /// divided by their sum when `norm_topk_prob`.
  softmax_topk,
  /// GptOssTopKRouter: the K largest logits (largest first), then softmax over those K.
  topk_softmax,
};

/// The expert MLP's gated activation of (gate, up).
enum class MoeActivation {
  /// silu(gate)·up (HF ACT2FN["silu"], Qwen3MoeExperts).
  swiglu,
  /// GptOssExperts._apply_gate: g = min(gate, limit), u = clamp(up, −limit, limit),
  /// result (u + 1)·g·sigmoid(alpha·g).
  clamped_swiglu,
};

/// Router settings of one sparse block.
struct MoeRouting {
  MoeRoutingMode mode = MoeRoutingMode::softmax_topk;
  int64_t K = 1;                ///< experts per token, 1 ≤ K ≤ E
  bool norm_topk_prob = false;  ///< softmax_topk only
};

/// Activation settings of the experts.
struct MoeGlu {
  MoeActivation act = MoeActivation::swiglu;
  float alpha = 1.702f;  ///< clamped_swiglu
  float limit = 7.0f;    ///< clamped_swiglu
};

/// ids [T, K] int32 and weights [T, K] f32 from router logits [T, E] f32, per `r` (see
/// MoeRoutingMode). Selection order: larger score first; equal scores take the lower expert index
/// first. Softmax statistics in fp32 (max-subtracted). Throws dflash::Error for K outside [1, E].
void moe_route_cpu(int32_t* ids, float* weights, const float* logits, int64_t T, int64_t E,
                   const MoeRouting& r);

/// Expert-sorted layout of ids [T, K] (each in [0, E)): perm [R], slot [R], row_expert [R] and
/// offsets [E+1] (offsets[0] = 0, offsets[E] = R = T·K), as in the file comment. All overwritten.
/// Throws dflash::Error naming the token and slot of an id outside [0, E).
void moe_dispatch_cpu(int32_t* perm, int32_t* slot, int32_t* offsets, int32_t* row_expert,
                      const int32_t* ids, int64_t T, int64_t K, int64_t E);

/// xs[r, :] = x[perm[r] / K, :] for r in [0, R); x [T, H], xs [R, H] (overwritten).
void moe_gather_cpu(float* xs, const float* x, const int32_t* perm, int64_t R, int64_t K,
                    int64_t H);

/// Grouped linear: for each expert e and row r in [offsets[e], offsets[e+1]):
/// y[r, 0:OUT] = x[r, 0:IN]·W_eᵀ with W_e = w[e] [OUT, IN] row-major (the HF layout). y has row
/// stride ldy ≥ OUT (so two calls can fill the halves of one [R, 2I] buffer) and is overwritten in
/// columns [0, OUT); x [R, IN] contiguous. `w` is an array of E pointers (raw bf16 bits or f32).
/// offsets [E+1] must run from 0 to R, non-decreasing (checked). fp32 accumulate.
void moe_grouped_linear_cpu(float* y, int64_t ldy, const float* x, const uint16_t* const* w,
                            const int32_t* offsets, int64_t E, int64_t R, int64_t IN, int64_t OUT);
void moe_grouped_linear_cpu(float* y, int64_t ldy, const float* x, const float* const* w,
                            const int32_t* offsets, int64_t E, int64_t R, int64_t IN, int64_t OUT);

/// y[r, i] = act(gate[r, i] + gate_bias[e, i], up[r, i] + up_bias[e, i]) with e = row_expert[r]
/// (biases [E, I], each may be null for none); gate and up have row stride ld_in ≥ I (two halves
/// of one [R, 2I] buffer, or separate arrays), y [R, I] contiguous (overwritten; may alias gate
/// when ld_in == I).
void moe_glu_cpu(float* y, const float* gate, const float* up, int64_t ld_in,
                 const float* gate_bias, const float* up_bias, const int32_t* row_expert, int64_t R,
                 int64_t I, const MoeGlu& glu);

/// y[t, :] += Σ_{k=0..K-1} weights[t, k]·(ys[slot[t·K+k], :] + down_bias[ids[t, k], :]) with
/// down_bias [E, H] (may be null). y [T, H] ACCUMULATES (it is the residual stream); ys [T·K, H].
void moe_combine_cpu(float* y, const float* ys, const float* down_bias, const int32_t* ids,
                     const float* weights, const int32_t* slot, int64_t T, int64_t K, int64_t H);

/// MXFP4 → bf16 (OCP Microscaling FP4 E2M1, as the released gpt-oss checkpoints store experts;
/// HF `integrations/mxfp4.py` `_convert_moe_packed_tensors`): blocks [rows, G, 16] u8, scales
/// [rows, G] u8 → out [rows, G·32] bf16 bits. Byte j of block g holds elements 2j (low nibble) and
/// 2j + 1 (high nibble) of columns [32g, 32g + 32); nibble n decodes to
/// {0, .5, 1, 1.5, 2, 3, 4, 6}[n & 7] with sign bit n & 8, times 2^(scale − 127), formed exactly
/// in fp32 and rounded to bf16 (exact except below 2^-133, where it rounds as PyTorch's bf16
/// ldexp does). Scale 255 is E8M0's NaN: its 32 values become NaN.
void mxfp4_dequantize_cpu(uint16_t* out, const uint8_t* blocks, const uint8_t* scales, int64_t rows,
                          int64_t G);

/// Device scratch moe_dispatch_cuda takes from its context, in bytes: the per-expert counts
/// [E] int32, rounded to kArenaAlign (what a memory plan reserves for it). The other MoE ops take
/// none.
constexpr uint64_t moe_dispatch_cuda_scratch_bytes(int64_t E) {
  return arena_round(static_cast<uint64_t>(E < 1 ? 1 : E) * 4);
}

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA moe_route (src/backend/cuda/moe.cu): logits f32, ids/weights on the device; one warp per
/// token. E ≤ 1024, K ≤ 32.
void moe_route_cuda(cuda::CudaContext& ctx, int32_t* ids, float* weights, const float* logits,
                    int64_t T, int64_t E, const MoeRouting& r);

/// CUDA moe_dispatch: a deterministic counting sort (per-expert counts, one scan, a stable
/// per-expert scatter; scratch: moe_dispatch_cuda_scratch_bytes from ctx.scratch()). Ids outside
/// [0, E) are not reported (they live on the device): such pairs are left out of every expert
/// (offsets[E] < R), so validate ids where they are made.
void moe_dispatch_cuda(cuda::CudaContext& ctx, int32_t* perm, int32_t* slot, int32_t* offsets,
                       int32_t* row_expert, const int32_t* ids, int64_t T, int64_t K, int64_t E);

/// CUDA moe_gather, bf16 rows (raw bits).
void moe_gather_cuda(cuda::CudaContext& ctx, uint16_t* xs, const uint16_t* x, const int32_t* perm,
                     int64_t R, int64_t K, int64_t H);

/// CUDA grouped linear: x bf16 [R, IN], `w` a DEVICE array of E device pointers to bf16 [OUT, IN],
/// offsets on the device; Y ∈ {float, uint16_t (bf16 bits)}. Tensor cores (bf16 in, fp32
/// accumulate), tiles of 64 rows × 128 columns scheduled per expert from the device offsets (no
/// host synchronisation, graph-capturable). IN must be a multiple of 8 and x, every w[e] 16-byte
/// aligned (checked for x; w[e] are the caller's contract).
template <typename Y>
void moe_grouped_linear_cuda(cuda::CudaContext& ctx, Y* y, int64_t ldy, const uint16_t* x,
                             const uint16_t* const* w, const int32_t* offsets, int64_t E, int64_t R,
                             int64_t IN, int64_t OUT);

/// CUDA moe_glu: gate/up T ∈ {float, uint16_t}, biases f32 [E, I] (may be null), y bf16.
template <typename T>
void moe_glu_cuda(cuda::CudaContext& ctx, uint16_t* y, const T* gate, const T* up, int64_t ld_in,
                  const float* gate_bias, const float* up_bias, const int32_t* row_expert,
                  int64_t R, int64_t I, const MoeGlu& glu);

/// CUDA moe_combine: y f32 [T, H] ACCUMULATES, ys f32 [T·K, H], down_bias f32 [E, H] or null.
void moe_combine_cuda(cuda::CudaContext& ctx, float* y, const float* ys, const float* down_bias,
                      const int32_t* ids, const float* weights, const int32_t* slot, int64_t T,
                      int64_t K, int64_t H);
#endif

}  // namespace dflash
