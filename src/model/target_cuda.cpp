// dflash.cpp — TargetCuda (see target_cuda.hpp): weight upload and the tap forward on the GPU.
#include "model/target_cuda.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/check.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/cast.hpp"
#include "ops/embedding.hpp"
#include "ops/linear.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

cuda::DeviceBuffer upload_bytes(cuda::CudaContext& ctx, const void* src, size_t bytes) {
  cuda::DeviceBuffer b = ctx.scratch(bytes);
  DFLASH_CUDA_CHECK(cudaMemcpy(b.data(), src, bytes, cudaMemcpyHostToDevice));
  return b;
}

// bf16 bits of a float weight tensor (as stored when bf16, rounded to nearest even otherwise).
std::vector<uint16_t> bf16_of(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::bf16) {
    std::copy_n(t.data<uint16_t>(), out.size(), out.begin());
  } else {
    const std::vector<float> f = t.to_f32_vector();
    for (size_t i = 0; i < f.size(); ++i) out[i] = f32_to_bf16_bits(f[i]);
  }
  return out;
}

cuda::DeviceBuffer upload_bf16(cuda::CudaContext& ctx, const Tensor& t) {
  const std::vector<uint16_t> b = bf16_of(t);
  return upload_bytes(ctx, b.data(), b.size() * sizeof(uint16_t));
}

cuda::DeviceBuffer upload_f32(cuda::CudaContext& ctx, const std::vector<float>& v) {
  return upload_bytes(ctx, v.data(), v.size() * sizeof(float));
}

}  // namespace

TargetCuda::TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens)
    : ctx_(ctx),
      cfg_(model.config()),
      max_tokens_(max_tokens),
      rope_scaling_(model.rope_scaling()),
      tied_(cfg_.tie_word_embeddings) {
  const ModelConfig& c = cfg_;
  DFLASH_CHECK(max_tokens > 0, "TargetCuda: max_tokens must be > 0 (got {})", max_tokens);
  DFLASH_CHECK(!c.attention_bias && !c.o_proj_bias,
               "the CUDA target forward does not support projection biases yet "
               "(config: attention_bias / model_type {}); use runtime.backend=cpu",
               c.model_type);
  DFLASH_CHECK(c.num_sliding_layers() == 0,
               "the CUDA target forward does not support sliding-window layers yet ({} in "
               "layer_types); use runtime.backend=cpu", c.num_sliding_layers());
  DFLASH_CHECK(c.head_dim == 64 || c.head_dim == 128,
               "the CUDA attention supports head_dim 64 or 128 (config head_dim {})", c.head_dim);
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t QD = c.num_attention_heads * c.head_dim, KD = c.num_key_value_heads * c.head_dim;
  embed_ = upload_bf16(ctx, model.embed_tokens());
  if (!tied_) head_ = upload_bf16(ctx, model.lm_head());
  inv_freq_ = upload_f32(ctx, model.inv_freq());
  for (const TargetLayer& L : model.layers()) {
    Layer d;
    d.wq = upload_bf16(ctx, L.wq);
    d.wk = upload_bf16(ctx, L.wk);
    d.wv = upload_bf16(ctx, L.wv);
    d.wo = upload_bf16(ctx, L.wo);
    std::vector<uint16_t> gu = bf16_of(L.wgate);
    const std::vector<uint16_t> up = bf16_of(L.wup);
    gu.insert(gu.end(), up.begin(), up.end());
    d.wgu = upload_bytes(ctx, gu.data(), gu.size() * sizeof(uint16_t));
    d.wdown = upload_bf16(ctx, L.wdown);
    d.in_norm = upload_f32(ctx, L.input_norm);
    d.post_norm = upload_f32(ctx, L.post_norm);
    if (c.qk_norm) {
      d.q_norm = upload_f32(ctx, L.q_norm);
      d.k_norm = upload_f32(ctx, L.k_norm);
    }
    layers_.push_back(std::move(d));
  }
  const auto T = static_cast<size_t>(max_tokens);
  x_ = ctx.scratch(T * H * sizeof(float));
  hn_ = ctx.scratch(T * H * 2);
  q_ = ctx.scratch(T * QD * 2);
  k_ = ctx.scratch(T * KD * 2);
  v_ = ctx.scratch(T * KD * 2);
  o_ = ctx.scratch(T * QD * 2);
  gu_ = ctx.scratch(T * 2 * I * 2);
  act_ = ctx.scratch(T * I * 2);
  tap_ = ctx.scratch(T * H * 2);
}

void TargetCuda::forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                              const AttnRange* ranges, int64_t T, std::span<const int> layer_ids) {
  const ModelConfig& c = cfg_;
  DFLASH_CHECK(T > 0 && T <= max_tokens_, "TargetCuda::forward_taps: {} tokens for a workspace "
               "of {}", T, max_tokens_);
  DFLASH_CHECK(!layer_ids.empty(), "TargetCuda::forward_taps: no tap layers");
  int64_t n_run = 0;
  for (int l : layer_ids) {
    DFLASH_CHECK(l >= 0 && l < c.num_hidden_layers,
                 "tap layer {} is outside the target's layers [0, {})", l, c.num_hidden_layers);
    n_run = std::max<int64_t>(n_run, l + 1);
  }
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  const int64_t QD = NH * D, KD = NKV * D, n_taps = static_cast<int64_t>(layer_ids.size());
  const double eps = c.rms_norm_eps;
  float* x = x_.as<float>();
  uint16_t *hn = hn_.as<uint16_t>(), *q = q_.as<uint16_t>(), *k = k_.as<uint16_t>();
  uint16_t *v = v_.as<uint16_t>(), *o = o_.as<uint16_t>(), *gu = gu_.as<uint16_t>();
  uint16_t *act = act_.as<uint16_t>(), *tap = tap_.as<uint16_t>();
  const float* inv_freq = inv_freq_.as<float>();
  AttnParams ap{T, T, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};

  embedding_fwd_cuda(ctx_, x, embed(), tokens, T, c.vocab_size, H);
  for (int64_t l = 0; l < n_run; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.in_norm.as<float>(), T, H, eps);
    linear_fwd_cuda(ctx_, q, hn, L.wq.as<uint16_t>(), T, H, QD);
    linear_fwd_cuda(ctx_, k, hn, L.wk.as<uint16_t>(), T, H, KD);
    linear_fwd_cuda(ctx_, v, hn, L.wv.as<uint16_t>(), T, H, KD);
    if (c.qk_norm) {
      rmsnorm_fwd_cuda(ctx_, q, static_cast<float*>(nullptr), q, L.q_norm.as<float>(), T * NH, D,
                       eps);
      rmsnorm_fwd_cuda(ctx_, k, static_cast<float*>(nullptr), k, L.k_norm.as<float>(), T * NKV, D,
                       eps);
    }
    rope_fwd_cuda(ctx_, q, q, pos, inv_freq, rope_scaling_, T, NH, D);
    rope_fwd_cuda(ctx_, k, k, pos, inv_freq, rope_scaling_, T, NKV, D);
    attention_fwd_cuda(ctx_, o, nullptr, q, k, v, ranges, ap);
    // x += o · Woᵀ (the GEMM accumulates into the fp32 residual stream).
    cuda::gemm_bf16(ctx_, x, DType::f32, H, o, QD, false, L.wo.as<uint16_t>(), QD, true, T, H, QD,
                    1.0f, 1.0f);
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.post_norm.as<float>(), T, H,
                     eps);
    linear_fwd_cuda(ctx_, gu, hn, L.wgu.as<uint16_t>(), T, H, 2 * I);  // row t: [gate | up]
    swiglu_fwd_cuda(ctx_, act, gu, gu + I, T, I, 2 * I);
    cuda::gemm_bf16(ctx_, x, DType::f32, H, act, I, false, L.wdown.as<uint16_t>(), I, true, T, H,
                    I, 1.0f, 1.0f);
    bool converted = false;
    for (int64_t i = 0; i < n_taps; ++i) {
      if (layer_ids[static_cast<size_t>(i)] != l) continue;
      if (!converted) cast_cuda(ctx_, tap, x, T * H);
      converted = true;
      DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(taps + i * H, n_taps * H * 2, tap, H * 2, H * 2,
                                          static_cast<size_t>(T), cudaMemcpyDeviceToDevice,
                                          ctx_.stream()));
    }
  }
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
