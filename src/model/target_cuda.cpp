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
#include "ops/moe.hpp"
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

TargetCuda::Layer TargetCuda::upload_layer(const TargetLayer& L) {
  const ModelConfig& c = cfg_;
  auto opt_f32 = [&](const std::vector<float>& v) {
    return v.empty() ? cuda::DeviceBuffer() : upload_f32(ctx_, v);
  };
  Layer d;
  d.wq = upload_bf16(ctx_, L.wq);
  d.wk = upload_bf16(ctx_, L.wk);
  d.wv = upload_bf16(ctx_, L.wv);
  d.wo = upload_bf16(ctx_, L.wo);
  d.bq = opt_f32(L.bq);
  d.bk = opt_f32(L.bk);
  d.bv = opt_f32(L.bv);
  d.bo = opt_f32(L.bo);
  d.in_norm = upload_f32(ctx_, L.input_norm);
  d.post_norm = upload_f32(ctx_, L.post_norm);
  d.q_norm = opt_f32(L.q_norm);
  d.k_norm = opt_f32(L.k_norm);
  d.sinks = opt_f32(L.sinks);
  d.sliding = L.sliding;
  d.is_moe = L.is_moe;
  if (!L.is_moe) {
    std::vector<uint16_t> gu = bf16_of(L.wgate);
    const std::vector<uint16_t> up = bf16_of(L.wup);
    gu.insert(gu.end(), up.begin(), up.end());
    d.wgu = upload_bytes(ctx_, gu.data(), gu.size() * sizeof(uint16_t));
    d.wdown = upload_bf16(ctx_, L.wdown);
    if (!L.bgate.empty()) {
      std::vector<float> b = L.bgate;
      b.insert(b.end(), L.bup.begin(), L.bup.end());
      d.bgu = upload_f32(ctx_, b);
    }
    d.bdown = opt_f32(L.bdown);
    return d;
  }
  // Experts stacked: expert e's [gate; up] rows at e·2·EI·H, its down matrix at e·H·EI.
  const TargetMoe& m = L.moe;
  const int64_t E = c.num_experts, EI = c.expert_width, H = c.hidden_size;
  Moe& g = d.moe;
  g.router = upload_bf16(ctx_, m.router);
  g.router_bias = opt_f32(m.router_bias);
  std::vector<uint16_t> wgu, wdown;
  wgu.reserve(static_cast<size_t>(E * 2 * EI * H));
  wdown.reserve(static_cast<size_t>(E * H * EI));
  for (int64_t e = 0; e < E; ++e) {
    for (const Tensor* t : {&m.gate[static_cast<size_t>(e)], &m.up[static_cast<size_t>(e)]}) {
      const std::vector<uint16_t> b = bf16_of(*t);
      wgu.insert(wgu.end(), b.begin(), b.end());
    }
    const std::vector<uint16_t> b = bf16_of(m.down[static_cast<size_t>(e)]);
    wdown.insert(wdown.end(), b.begin(), b.end());
  }
  g.wgu = upload_bytes(ctx_, wgu.data(), wgu.size() * sizeof(uint16_t));
  g.wdown = upload_bytes(ctx_, wdown.data(), wdown.size() * sizeof(uint16_t));
  std::vector<const uint16_t*> gp, dp;
  for (int64_t e = 0; e < E; ++e) {
    gp.push_back(g.wgu.as<uint16_t>() + e * 2 * EI * H);
    dp.push_back(g.wdown.as<uint16_t>() + e * H * EI);
  }
  g.gu_ptrs = upload_bytes(ctx_, gp.data(), gp.size() * sizeof(gp[0]));
  g.down_ptrs = upload_bytes(ctx_, dp.data(), dp.size() * sizeof(dp[0]));
  g.gate_bias = opt_f32(m.gate_bias);
  g.up_bias = opt_f32(m.up_bias);
  g.down_bias = opt_f32(m.down_bias);
  return d;
}

TargetCuda::TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens)
    : ctx_(ctx),
      cfg_(model.config()),
      max_tokens_(max_tokens),
      rope_scaling_(model.rope_scaling()),
      tied_(cfg_.tie_word_embeddings) {
  const ModelConfig& c = cfg_;
  DFLASH_CHECK(max_tokens > 0, "TargetCuda: max_tokens must be > 0 (got {})", max_tokens);
  DFLASH_CHECK(c.head_dim == 64 || c.head_dim == 128,
               "the CUDA attention supports head_dim 64 or 128 ({}: head_dim {})", c.source,
               c.head_dim);
  if (c.is_moe()) {
    DFLASH_CHECK(c.hidden_size % 8 == 0 && c.expert_width % 8 == 0,
                 "the CUDA expert GEMMs need hidden_size ({}) and the expert width ({}) to be "
                 "multiples of 8 ({})",
                 c.hidden_size, c.expert_width, c.source);
    DFLASH_CHECK(c.num_experts <= 1024 && c.num_experts_per_tok <= 32,
                 "the CUDA router supports up to 1024 experts and top-32 ({}: {} experts, top-{})",
                 c.source, c.num_experts, c.num_experts_per_tok);
  }
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t QD = c.num_attention_heads * c.head_dim, KD = c.num_key_value_heads * c.head_dim;
  embed_ = upload_bf16(ctx, model.embed_tokens());
  if (!tied_) head_ = upload_bf16(ctx, model.lm_head());
  inv_freq_ = upload_f32(ctx, model.inv_freq());
  for (const TargetLayer& L : model.layers()) layers_.push_back(upload_layer(L));

  const auto T = static_cast<size_t>(max_tokens);
  x_ = ctx.scratch(T * H * sizeof(float));
  hn_ = ctx.scratch(T * H * 2);
  q_ = ctx.scratch(T * QD * 2);
  k_ = ctx.scratch(T * KD * 2);
  v_ = ctx.scratch(T * KD * 2);
  o_ = ctx.scratch(T * QD * 2);
  if (c.num_moe_layers() < c.num_hidden_layers) {  // some layer has a dense MLP
    gu_ = ctx.scratch(T * 2 * I * 2);
    act_ = ctx.scratch(T * I * 2);
  }
  tap_ = ctx.scratch(T * H * 2);
  if (c.num_sliding_layers() > 0) win_ = ctx.scratch(T * sizeof(AttnRange));
  if (c.is_moe()) {
    const auto E = static_cast<size_t>(c.num_experts), EI = static_cast<size_t>(c.expert_width);
    const size_t R = T * static_cast<size_t>(c.num_experts_per_tok);
    logits_ = ctx.scratch(T * E * sizeof(float));
    ids_ = ctx.scratch(R * sizeof(int32_t));
    weights_ = ctx.scratch(R * sizeof(float));
    perm_ = ctx.scratch(R * sizeof(int32_t));
    slot_ = ctx.scratch(R * sizeof(int32_t));
    rexp_ = ctx.scratch(R * sizeof(int32_t));
    offsets_ = ctx.scratch((E + 1) * sizeof(int32_t));
    xs_ = ctx.scratch(R * static_cast<size_t>(H) * 2);
    egu_ = ctx.scratch(R * 2 * EI * 2);
    eact_ = ctx.scratch(R * EI * 2);
    ys_ = ctx.scratch(R * static_cast<size_t>(H) * sizeof(float));
  }
}

void TargetCuda::moe_forward(const Moe& m, float* x, const uint16_t* hn, int64_t T) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t EI = c.expert_width, R = T * K;
  float* logits = logits_.as<float>();
  int32_t *ids = ids_.as<int32_t>(), *perm = perm_.as<int32_t>(), *slot = slot_.as<int32_t>();
  int32_t *rexp = rexp_.as<int32_t>(), *offsets = offsets_.as<int32_t>();
  float* w = weights_.as<float>();
  uint16_t *xs = xs_.as<uint16_t>(), *gu = egu_.as<uint16_t>(), *act = eact_.as<uint16_t>();
  float* ys = ys_.as<float>();
  // Router logits in fp32 from the bf16 normed input (HF: F.linear(x, W, b)).
  linear_fwd_cuda(ctx_, logits, hn, m.router.as<uint16_t>(), m.router_bias.as<float>(), T, H, E);
  moe_route_cuda(ctx_, ids, w, logits, T, E, MoeRouting{c.routing, K, c.norm_topk_prob});
  moe_dispatch_cuda(ctx_, perm, slot, offsets, rexp, ids, T, K, E);
  moe_gather_cuda(ctx_, xs, hn, perm, R, K, H);
  const auto* gu_ptrs = m.gu_ptrs.as<const uint16_t*>();
  moe_grouped_linear_cuda(ctx_, gu, 2 * EI, xs, gu_ptrs, offsets, E, R, H, 2 * EI);
  const MoeGlu glu{c.expert_activation, static_cast<float>(c.swiglu_alpha),
                   static_cast<float>(c.swiglu_limit)};
  moe_glu_cuda(ctx_, act, gu, gu + EI, 2 * EI, m.gate_bias.as<float>(), m.up_bias.as<float>(),
               rexp, R, EI, glu);
  const auto* down_ptrs = m.down_ptrs.as<const uint16_t*>();
  moe_grouped_linear_cuda(ctx_, ys, H, act, down_ptrs, offsets, E, R, EI, H);
  moe_combine_cuda(ctx_, x, ys, m.down_bias.as<float>(), ids, w, slot, T, K, H);
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
  // Sliding layers see the last `sliding_window` keys of each causal range (HF
  // sliding_window_overlay), derived on the device once per forward.
  const AttnRange* win = nullptr;
  if (c.num_sliding_layers() > 0) {
    attention_window_ranges_cuda(ctx_, win_.as<AttnRange>(), ranges, T, c.sliding_window);
    win = win_.as<AttnRange>();
  }

  embedding_fwd_cuda(ctx_, x, embed(), tokens, T, c.vocab_size, H);
  for (int64_t l = 0; l < n_run; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.in_norm.as<float>(), T, H, eps);
    linear_fwd_cuda(ctx_, q, hn, L.wq.as<uint16_t>(), L.bq.as<float>(), T, H, QD);
    linear_fwd_cuda(ctx_, k, hn, L.wk.as<uint16_t>(), L.bk.as<float>(), T, H, KD);
    linear_fwd_cuda(ctx_, v, hn, L.wv.as<uint16_t>(), L.bv.as<float>(), T, H, KD);
    if (c.qk_norm) {
      rmsnorm_fwd_cuda(ctx_, q, static_cast<float*>(nullptr), q, L.q_norm.as<float>(), T * NH, D,
                       eps);
      rmsnorm_fwd_cuda(ctx_, k, static_cast<float*>(nullptr), k, L.k_norm.as<float>(), T * NKV, D,
                       eps);
    }
    rope_fwd_cuda(ctx_, q, q, pos, inv_freq, rope_scaling_, T, NH, D);
    rope_fwd_cuda(ctx_, k, k, pos, inv_freq, rope_scaling_, T, NKV, D);
    ap.sinks = L.sinks.as<float>();  // null unless gpt-oss
    attention_fwd_cuda(ctx_, o, nullptr, q, k, v, L.sliding ? win : ranges, ap);
    // x += o · Woᵀ (+ bo) (the GEMM accumulates into the fp32 residual stream).
    cuda::gemm_bf16(ctx_, x, DType::f32, H, o, QD, false, L.wo.as<uint16_t>(), QD, true, T, H, QD,
                    1.0f, 1.0f);
    if (L.bo.data()) bias_add_cuda(ctx_, x, L.bo.as<float>(), T, H);
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.post_norm.as<float>(), T, H,
                     eps);
    if (L.is_moe) {
      moe_forward(L.moe, x, hn, T);
    } else {
      // row t: [gate | up] (+ [bgate | bup])
      linear_fwd_cuda(ctx_, gu, hn, L.wgu.as<uint16_t>(), L.bgu.as<float>(), T, H, 2 * I);
      swiglu_fwd_cuda(ctx_, act, gu, gu + I, T, I, 2 * I);
      cuda::gemm_bf16(ctx_, x, DType::f32, H, act, I, false, L.wdown.as<uint16_t>(), I, true, T,
                      H, I, 1.0f, 1.0f);
      if (L.bdown.data()) bias_add_cuda(ctx_, x, L.bdown.as<float>(), T, H);
    }
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
