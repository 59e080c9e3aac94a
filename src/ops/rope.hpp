// dflash.cpp — rotary position embedding (RoPE) with the HF scaling variants.
//
// Frequencies follow HF transformers `modeling_rope_utils.py` (`_compute_default_rope_parameters`,
// `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
// `_compute_yarn_parameters`); they are computed here in float64 (HF computes them in float32, so
// the two agree to a few float32 ulps). The rotation uses HF's "rotate_half" layout
// (`apply_rotary_pos_emb` of modeling_llama/qwen3): the pairs are (i, i + D/2), i < D/2, with angle
// pos·inv_freq[i]; cos and sin are multiplied by the attention scaling (YaRN's mscale, 1 otherwise).
// Like HF, the float path forms the angle as float(pos)·inv_freq in fp32.
// Invariants: x, y [T, NH, D] row-major, D even; positions int32 [T], one per token (packed documents
// restart at 0). Backward = rotation by −angle (times the same scaling); dx is OVERWRITTEN. y may
// alias x, dx may alias dy (in place).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dflash {

/// Which HF `rope_type` to use.
enum class RopeType { standard, linear, llama3, yarn };

/// The RoPE settings of a HF config (`rope_theta` and the `rope_scaling`/`rope_parameters` dict).
/// Fields not used by `type` are ignored. The config loader fills them from the HF keys of the same
/// name; a missing required key is its error, never a default guessed here.
struct RopeParams {
  RopeType type = RopeType::standard;
  double theta = 10000.0;  ///< rope_theta (the base)
  double factor = 1.0;     ///< linear, llama3, yarn: the scaling factor (> 0)
  double low_freq_factor = 1.0;   ///< llama3
  double high_freq_factor = 4.0;  ///< llama3 (must differ from low_freq_factor)
  /// llama3, yarn: the pre-training context length. HF's yarn uses this key, and falls back to
  /// `max_position_embeddings` when a config lacks it (the loader must do that fallback).
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;  ///< yarn (HF: `or 32`, so 0 means 32)
  double beta_slow = 1.0;   ///< yarn (HF: `or 1`, so 0 means 1)
  /// yarn: cos/sin multiplier. When absent HF uses get_mscale(factor) = 0.1·ln(factor) + 1
  /// (1 for factor ≤ 1), or get_mscale(factor, mscale)/get_mscale(factor, mscale_all_dim) when
  /// both of those are non-zero.
  std::optional<double> attention_factor;
  double mscale = 0.0;          ///< yarn (DeepSeek-style); 0 = absent
  double mscale_all_dim = 0.0;  ///< yarn (DeepSeek-style); 0 = absent
  bool truncate = true;         ///< yarn: floor/ceil the correction range (HF default true)
};

/// The D/2 inverse frequencies of `params` for rotary dimension D (= head_dim; D even, > 0), in
/// float64. Throws dflash::Error for invalid settings (D odd, theta ≤ 0, factor ≤ 0, llama3 with
/// low == high freq factor or no original_max_position_embeddings, yarn without it).
std::vector<double> rope_inv_freq(const RopeParams& params, int64_t D);
/// The scaling applied to cos and sin ("attention_factor" in HF): 1 except for yarn.
double rope_attention_scaling(const RopeParams& params);

/// y = rotate(x) by angle pos[t]·inv_freq[i] on pairs (i, i+D/2) of each head, cos and sin times
/// `scaling`: y_i = x_i·c − x_{i+D/2}·s, y_{i+D/2} = x_{i+D/2}·c + x_i·s. inv_freq [D/2].
void rope_fwd_cpu(float* y, const float* x, const int32_t* pos, const float* inv_freq,
                  float scaling, int64_t T, int64_t NH, int64_t D);
void rope_fwd_cpu(double* y, const double* x, const int32_t* pos, const double* inv_freq,
                  double scaling, int64_t T, int64_t NH, int64_t D);

/// Backward: dx = rotation of dy by −angle, times `scaling` (the transpose of the forward map).
void rope_bwd_cpu(float* dx, const float* dy, const int32_t* pos, const float* inv_freq,
                  float scaling, int64_t T, int64_t NH, int64_t D);
void rope_bwd_cpu(double* dx, const double* dy, const int32_t* pos, const double* inv_freq,
                  double scaling, int64_t T, int64_t NH, int64_t D);


#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA rotation, T ∈ {float, uint16_t (bf16 bits)}; `inv_freq` [D/2] f32 is a DEVICE array (upload
/// rope_inv_freq once); pos int32 [T] on the device. Angle float(pos)·inv_freq in fp32, sincosf.
/// In place allowed (y == x).
template <typename T>
void rope_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* x, const int32_t* pos,
                   const float* inv_freq, float scaling, int64_t Tn, int64_t NH, int64_t D);
/// CUDA backward (rotation by −angle); dx overwritten, may alias dy.
template <typename T>
void rope_bwd_cuda(cuda::CudaContext& ctx, T* dx, const T* dy, const int32_t* pos,
                   const float* inv_freq, float scaling, int64_t Tn, int64_t NH, int64_t D);
/// CUDA per-head RMSNorm then RoPE in one pass (the q/k path of Qwen3 attention: q_norm/k_norm,
/// then apply_rotary_pos_emb): for each token t < Tn and head h < NH, with x_h = x[t, h, :] and
/// r = 1/sqrt(mean_j x_h[j]² + eps),
///   n = Y(w ⊙ x_h · r)                   (rmsnorm_fwd_cuda's formula and rounding to Y),
///   y[t, h, :] = rotate(n) by pos[t]·inv_freq, cos and sin times `scaling` (rope_fwd_cuda's).
/// x, y [Tn, NH, D] (Y, X ∈ {float, bf16 bits}), w [D] f32, pos int32 [Tn], inv_freq [D/2] f32, all
/// on the device; D even. y is OVERWRITTEN and may alias x (when Y == X). The same bits as
/// rmsnorm_fwd_cuda(y, x, w, Tn·NH, D) then rope_fwd_cuda(y, y): the normed rows are neither
/// stored nor reloaded (one read of x and one write of y instead of two of each).
template <typename Y, typename X>
void rmsnorm_rope_fwd_cuda(cuda::CudaContext& ctx, Y* y, const X* x, const float* w,
                           const int32_t* pos, const float* inv_freq, float scaling, int64_t Tn,
                           int64_t NH, int64_t D, double eps);
#endif

}  // namespace dflash
