// dflash.cpp — TargetCuda (see target_cuda.hpp): weight upload and the tap forward on the GPU.
#include "model/target_cuda.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "backend/cuda/check.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "model/step_plan.hpp"
#include "ops/cast.hpp"
#include "ops/embedding.hpp"
#include "ops/fill.hpp"
#include "ops/linear.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

// Enqueues dst = the bf16 bits of `t` (as stored when bf16, rounded to nearest even otherwise).
void upload_bf16(cuda::PinnedUploader& up, uint16_t* dst, const Tensor& t) {
  const auto n = static_cast<size_t>(t.numel());
  if (t.dtype() == DType::bf16 && t.is_contiguous()) {
    up.upload(dst, t.raw(), n * sizeof(uint16_t));
    return;
  }
  const std::vector<float> f = t.to_f32_vector();
  up.upload(dst, n * sizeof(uint16_t), [&f](void* out, size_t off, size_t bytes) {
    auto* o = static_cast<uint16_t*>(out);
    const size_t first = off / sizeof(uint16_t);
    for (size_t i = 0; i < bytes / sizeof(uint16_t); ++i) o[i] = f32_to_bf16_bits(f[first + i]);
  });
}

void upload_f32(cuda::PinnedUploader& up, float* dst, const std::vector<float>& v) {
  up.upload(dst, v.data(), v.size() * sizeof(float));
}

using Clock = std::chrono::steady_clock;

}  // namespace

TargetCuda::TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens,
                       int64_t n_layers, cuda::DeviceArena* arena)
    : ctx_(ctx),
      cfg_(model.config()),
      max_tokens_(max_tokens),
      rope_scaling_(model.rope_scaling()),
      tied_(cfg_.tie_word_embeddings) {
  cuda::DeviceArena& a = setup(n_layers, arena);
  take_weights(a);
  upload_weights(model);
  take_activations(a);
}

TargetCuda::TargetCuda(cuda::CudaContext& ctx, const ModelConfig& cfg, uint64_t seed,
                       int64_t max_tokens, int64_t n_layers, cuda::DeviceArena* arena)
    : ctx_(ctx),
      cfg_(cfg),
      max_tokens_(max_tokens),
      rope_scaling_(static_cast<float>(rope_attention_scaling(rope_params_from_config(cfg)))),
      tied_(cfg_.tie_word_embeddings) {
  cuda::DeviceArena& a = setup(n_layers, arena);
  take_weights(a);
  random_weights(seed);
  take_activations(a);
}

cuda::DeviceArena& TargetCuda::setup(int64_t n_layers, cuda::DeviceArena* arena) {
  const ModelConfig& c = cfg_;
  DFLASH_CHECK(max_tokens_ > 0, "TargetCuda: max_tokens must be > 0 (got {})", max_tokens_);
  DFLASH_CHECK(n_layers >= 0 && n_layers <= c.num_hidden_layers,
               "TargetCuda: {} layers requested of the target's {}", n_layers, c.num_hidden_layers);
  if (n_layers == 0) n_layers = c.num_hidden_layers;
  DFLASH_CHECK(!c.attention_bias && !c.o_proj_bias,
               "the CUDA target forward does not support projection biases yet "
               "(config: attention_bias / model_type {}); use runtime.backend=cpu",
               c.model_type);
  DFLASH_CHECK(c.num_sliding_layers() == 0,
               "the CUDA target forward does not support sliding-window layers yet ({} in "
               "layer_types); use runtime.backend=cpu", c.num_sliding_layers());
  DFLASH_CHECK(c.head_dim == 64 || c.head_dim == 128,
               "the CUDA attention supports head_dim 64 or 128 (config head_dim {})", c.head_dim);
  if (!arena) {
    ArenaPlanner p(step_phase_names());
    plan_target_weights(p, c, n_layers);
    plan_target_activations(p, c, max_tokens_);
    own_arena_ = std::make_unique<cuda::DeviceArena>(ctx_, p.finish());
    arena = own_arena_.get();
  }
  layers_.resize(static_cast<size_t>(n_layers));
  return *arena;
}

void TargetCuda::take_weights(cuda::DeviceArena& arena) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t QD = c.num_attention_heads * D, KD = c.num_key_value_heads * D;
  embed_ = arena.get<uint16_t>("target.embed", V * H);
  if (!tied_) head_ = arena.get<uint16_t>("target.lm_head", V * H);
  inv_freq_ = arena.get<float>("target.inv_freq", D / 2);
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& d = layers_[l];
    const std::string n = fmt::format("target.layers.{}.", l);
    d.wq = arena.get<uint16_t>(n + "wq", QD * H);
    d.wk = arena.get<uint16_t>(n + "wk", KD * H);
    d.wv = arena.get<uint16_t>(n + "wv", KD * H);
    d.wo = arena.get<uint16_t>(n + "wo", H * QD);
    d.wgu = arena.get<uint16_t>(n + "wgu", 2 * I * H);
    d.wdown = arena.get<uint16_t>(n + "wdown", H * I);
    d.in_norm = arena.get<float>(n + "in_norm", H);
    d.post_norm = arena.get<float>(n + "post_norm", H);
    d.q_norm = c.qk_norm ? arena.get<float>(n + "q_norm", D) : nullptr;
    d.k_norm = c.qk_norm ? arena.get<float>(n + "k_norm", D) : nullptr;
  }
}

void TargetCuda::take_activations(cuda::DeviceArena& arena) {
  const ModelConfig& c = cfg_;
  const int64_t T = max_tokens_, H = c.hidden_size, I = c.intermediate_size;
  const int64_t QD = c.num_attention_heads * c.head_dim, KD = c.num_key_value_heads * c.head_dim;
  x_ = arena.get<float>("target.act.x", T * H);
  hn_ = arena.get<uint16_t>("target.act.hn", T * H);
  q_ = arena.get<uint16_t>("target.act.q", T * QD);
  k_ = arena.get<uint16_t>("target.act.k", T * KD);
  v_ = arena.get<uint16_t>("target.act.v", T * KD);
  o_ = arena.get<uint16_t>("target.act.o", T * QD);
  gu_ = arena.get<uint16_t>("target.act.gu", T * 2 * I);
  act_ = arena.get<uint16_t>("target.act.act", T * I);
  tap_ = arena.get<uint16_t>("target.act.tap", T * H);
}

// The one place where checkpoint weights go to the device (into the pointers of take_weights).
void TargetCuda::upload_weights(const TargetModel& model) {
  const int64_t H = cfg_.hidden_size, I = cfg_.intermediate_size;
  const auto t0 = Clock::now();
  cuda::PinnedUploader up(ctx_);
  upload_bf16(up, embed_, model.embed_tokens());
  if (!tied_) upload_bf16(up, head_, model.lm_head());
  upload_f32(up, inv_freq_, model.inv_freq());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const TargetLayer& L = model.layers()[l];
    const Layer& d = layers_[l];
    upload_bf16(up, d.wq, L.wq);
    upload_bf16(up, d.wk, L.wk);
    upload_bf16(up, d.wv, L.wv);
    upload_bf16(up, d.wo, L.wo);
    upload_bf16(up, d.wgu, L.wgate);  // rows [0, I): gate; rows [I, 2I): up
    upload_bf16(up, d.wgu + I * H, L.wup);
    upload_bf16(up, d.wdown, L.wdown);
    upload_f32(up, d.in_norm, L.input_norm);
    upload_f32(up, d.post_norm, L.post_norm);
    if (cfg_.qk_norm) {
      upload_f32(up, d.q_norm, L.q_norm);
      upload_f32(up, d.k_norm, L.k_norm);
    }
  }
  up.finish();
  upload_bytes_ = up.bytes();
  upload_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
}

void TargetCuda::random_weights(uint64_t seed) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t QD = c.num_attention_heads * D, KD = c.num_key_value_heads * D;
  const float bound = 0.02f * std::sqrt(3.0f);  // standard deviation 0.02
  uint64_t stream = seed;
  auto matrix = [&](uint16_t* w, int64_t n) {
    fill_uniform_cuda(ctx_, w, n, 0.0f, bound, ++stream);
  };
  auto ones = [&](float* w, int64_t n) { fill_uniform_cuda(ctx_, w, n, 1.0f, 0.0f, ++stream); };
  matrix(embed_, V * H);
  if (!tied_) matrix(head_, V * H);
  const std::vector<double> f = rope_inv_freq(rope_params_from_config(c), D);
  const std::vector<float> ff(f.begin(), f.end());
  DFLASH_CUDA_CHECK(
      cudaMemcpy(inv_freq_, ff.data(), ff.size() * sizeof(float), cudaMemcpyHostToDevice));
  for (const Layer& d : layers_) {
    matrix(d.wq, QD * H);
    matrix(d.wk, KD * H);
    matrix(d.wv, KD * H);
    matrix(d.wo, H * QD);
    matrix(d.wgu, 2 * I * H);
    matrix(d.wdown, H * I);
    ones(d.in_norm, H);
    ones(d.post_norm, H);
    if (c.qk_norm) {
      ones(d.q_norm, D);
      ones(d.k_norm, D);
    }
  }
  ctx_.synchronize();
}

void TargetCuda::forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                              const AttnRange* ranges, int64_t T, std::span<const int> layer_ids) {
  const ModelConfig& c = cfg_;
  DFLASH_CHECK(T > 0 && T <= max_tokens_, "TargetCuda::forward_taps: {} tokens for a workspace "
               "of {}", T, max_tokens_);
  DFLASH_CHECK(!layer_ids.empty(), "TargetCuda::forward_taps: no tap layers");
  int64_t n_run = 0;
  for (int l : layer_ids) {
    DFLASH_CHECK(l >= 0 && l < num_layers(),
                 "tap layer {} is outside the uploaded target layers [0, {})", l, num_layers());
    n_run = std::max<int64_t>(n_run, l + 1);
  }
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  const int64_t QD = NH * D, KD = NKV * D, n_taps = static_cast<int64_t>(layer_ids.size());
  const double eps = c.rms_norm_eps;
  float* x = x_;
  uint16_t *hn = hn_, *q = q_, *k = k_, *v = v_, *o = o_, *gu = gu_, *act = act_, *tap = tap_;
  const float* inv_freq = inv_freq_;
  AttnParams ap{T, T, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};

  embedding_fwd_cuda(ctx_, x, embed(), tokens, T, c.vocab_size, H);
  for (int64_t l = 0; l < n_run; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.in_norm, T, H, eps);
    linear_fwd_cuda(ctx_, q, hn, L.wq, T, H, QD);
    linear_fwd_cuda(ctx_, k, hn, L.wk, T, H, KD);
    linear_fwd_cuda(ctx_, v, hn, L.wv, T, H, KD);
    if (c.qk_norm) {
      rmsnorm_fwd_cuda(ctx_, q, static_cast<float*>(nullptr), q, L.q_norm, T * NH, D, eps);
      rmsnorm_fwd_cuda(ctx_, k, static_cast<float*>(nullptr), k, L.k_norm, T * NKV, D, eps);
    }
    rope_fwd_cuda(ctx_, q, q, pos, inv_freq, rope_scaling_, T, NH, D);
    rope_fwd_cuda(ctx_, k, k, pos, inv_freq, rope_scaling_, T, NKV, D);
    attention_fwd_cuda(ctx_, o, nullptr, q, k, v, ranges, ap);
    // x += o · Woᵀ (the GEMM accumulates into the fp32 residual stream).
    cuda::gemm_bf16(ctx_, x, DType::f32, H, o, QD, false, L.wo, QD, true, T, H, QD, 1.0f, 1.0f);
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.post_norm, T, H, eps);
    linear_fwd_cuda(ctx_, gu, hn, L.wgu, T, H, 2 * I);  // row t: [gate | up]
    swiglu_fwd_cuda(ctx_, act, gu, gu + I, T, I, 2 * I);
    cuda::gemm_bf16(ctx_, x, DType::f32, H, act, I, false, L.wdown, I, true, T, H, I, 1.0f, 1.0f);
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
