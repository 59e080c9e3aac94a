// dflash.cpp — DrafterCuda (see drafter_cuda.hpp). The step mirrors drafter_train_step
// (src/model/drafter.cpp) op for op; the differences are the padding of the packed step to a
// fixed shape (inert rows) and that the k/v projections of the context and the block rows run as
// one GEMM over [ctx ; norm(block)] (rows kept contiguous in `kvin`).
#include "model/drafter_cuda.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>
#include <fmt/ranges.h>

#include <cmath>

#include "backend/cuda/check.hpp"
#include "core/error.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/dflash2_head_cuda.hpp"
#include "model/dspark_head_cuda.hpp"
#include "model/step_plan.hpp"
#include "ops/attention.hpp"
#include "ops/cast.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/dflash2_conv.hpp"
#include "ops/embedding.hpp"
#include "ops/fill.hpp"
#include "ops/linear.hpp"
#include "ops/loss_weights.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

constexpr size_t kF = 4;  // bytes of an fp32 value

}  // namespace

DrafterCuda::DrafterCuda(cuda::CudaContext& ctx, const DrafterConfig& cfg,
                         const DrafterLayout& layout, int64_t max_ctx, int64_t max_block_rows,
                         const uint16_t* embed, const uint16_t* lm_head, cuda::DeviceArena* arena,
                         int64_t ce_chunk_rows, DrafterActivations activations)
    : ctx_(ctx),
      cfg_(cfg),
      layout_(layout),
      max_ctx_(max_ctx),
      max_rows_(max_block_rows),
      ce_chunk_rows_(ce_chunk_rows),
      activations_(activations),
      embed_(embed),
      head_(lm_head),
      rope_scaling_(static_cast<float>(rope_attention_scaling(cfg.rope))) {
  cfg.validate();
  const std::vector<std::string> unsupported = cuda_drafter_unsupported(cfg);
  DFLASH_CHECK(unsupported.empty(), "{}", fmt::join(unsupported, "; "));
  DFLASH_CHECK(max_ctx > 0 && max_block_rows > 0 && max_block_rows % cfg.block_size == 0 &&
                   ce_chunk_rows > 0,
               "DrafterCuda: bad capacities ({} context rows, {} block rows, CE chunk {})", max_ctx,
               max_block_rows, ce_chunk_rows);
  DFLASH_CHECK(embed && lm_head, "DrafterCuda: null embedding or LM head");
  if (!arena) {
    ArenaPlanner p(step_phase_names());
    plan_drafter_step(p, cfg, layout,
                      DrafterStepSizes{max_ctx, max_block_rows, ce_chunk_rows, activations});
    own_arena_ = std::make_unique<cuda::DeviceArena>(ctx, p.finish());
    arena = own_arena_.get();
  }
  take_buffers(*arena);
  const AdamWSegment seg{params_, m_, v_, grads_, layout.total, wbf_};
  DFLASH_CUDA_CHECK(cudaMemcpy(segs_, &seg, sizeof seg, cudaMemcpyHostToDevice));
  const std::vector<double> f = rope_inv_freq(cfg.rope, cfg.head_dim);
  const std::vector<float> ff(f.begin(), f.end());
  DFLASH_CUDA_CHECK(cudaMemcpy(inv_freq_, ff.data(), ff.size() * kF, cudaMemcpyHostToDevice));
}

// Every pointer from the arena, by the names of plan_drafter_step, for the largest step.
void DrafterCuda::take_buffers(cuda::DeviceArena& a) {
  const DrafterConfig& c = cfg_;
  const int64_t P = layout_.total, T = max_ctx_, NK = max_rows_, TK = T + NK;
  const int64_t H = c.hidden_size, I = c.intermediate_size, F = drafter_feature_cols(c);
  const int64_t QD = c.num_heads * c.head_dim, KD = c.num_kv_heads * c.head_dim;
  params_ = a.get<float>("drafter.params", P);
  m_ = a.get<float>("drafter.adam_m", P);
  v_ = a.get<float>("drafter.adam_v", P);
  wbf_ = a.get<uint16_t>("drafter.weights_bf16", P);
  segs_ = a.get<AdamWSegment>("drafter.segments", 1);
  inv_freq_ = a.get<float>("drafter.inv_freq", c.head_dim / 2);
  sums_ = a.get<double>("drafter.sums", 2);
  sumsq_ = a.get<double>("drafter.sumsq", 1);
  clip_ = a.get<float>("drafter.clip", 1);
  argmax_ = a.get<int32_t>("drafter.argmax", NK);
  grads_ = a.get<float>("drafter.grads", P);
  features_ = a.get<uint16_t>("drafter.features", T * F);
  ctx_pre_ = a.get<float>("drafter.ctx_pre", T * H);
  h0_ = a.get<float>("drafter.h0", NK * H);
  const bool keep = activations_ == DrafterActivations::keep;
  LayerBuf shared{};
  if (!keep) {
    shared.kvin = a.get<uint16_t>("drafter.kvin", TK * H);
    shared.q = a.get<uint16_t>("drafter.q", NK * QD);
    shared.k = a.get<uint16_t>("drafter.k", TK * KD);
    shared.hn2 = a.get<uint16_t>("drafter.hn2", NK * H);
    shared.act = a.get<uint16_t>("drafter.act", NK * I);
  }
  layers_.clear();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string n = fmt::format("drafter.layers.{}.", l);
    LayerBuf b;
    b.q_raw = a.get<uint16_t>(n + "q_raw", NK * QD);
    b.k_raw = a.get<uint16_t>(n + "k_raw", TK * KD);
    b.v = a.get<uint16_t>(n + "v", TK * KD);
    b.o = a.get<uint16_t>(n + "o", NK * QD);
    b.lse = a.get<float>(n + "lse", c.num_heads * NK);
    b.h_mid = a.get<float>(n + "h_mid", NK * H);
    b.gu = a.get<uint16_t>(n + "gu", NK * 2 * I);
    b.h_out = a.get<float>(n + "h_out", NK * H);
    b.kvin = keep ? a.get<uint16_t>(n + "kvin", TK * H) : shared.kvin;
    b.q = keep ? a.get<uint16_t>(n + "q", NK * QD) : shared.q;
    b.k = keep ? a.get<uint16_t>(n + "k", TK * KD) : shared.k;
    b.hn2 = keep ? a.get<uint16_t>(n + "hn2", NK * H) : shared.hn2;
    b.act = keep ? a.get<uint16_t>(n + "act", NK * I) : shared.act;
    layers_.push_back(b);
  }
  hf_ = a.get<uint16_t>("drafter.hf", NK * H);
  d_hf_ = a.get<float>("drafter.d_hf", NK * H);
  if (c.dspark.enabled) {
    dspark_ws_bytes_ = dspark_head_cuda_workspace_bytes(c, NK, ce_chunk_rows_);
    dspark_ws_ = a.get_bytes("drafter.dspark.workspace", dspark_ws_bytes_);
    dspark_rows_bytes_ = dspark_head_cuda_rows_bytes(c, NK);
    dspark_rows_ = a.get_bytes("drafter.dspark.rows", dspark_rows_bytes_);
    dspark_sums_ = a.get<double>("drafter.dspark.sums", 6);
  } else if (c.domino.enabled) {
    domino_ws_bytes_ = domino_head_cuda_workspace_bytes(c, NK, ce_chunk_rows_);
    domino_ws_ = a.get_bytes("drafter.domino.workspace", domino_ws_bytes_);
    domino_rows_bytes_ = domino_head_cuda_rows_bytes(NK);
    domino_rows_ = a.get_bytes("drafter.domino.rows", domino_rows_bytes_);
    domino_sums_ = a.get<double>("drafter.domino.sums", 4);
  } else {
    const FusedCeParams cp = drafter_ce_params(c, NK, ce_chunk_rows_);
    ce_ws_bytes_ = cross_entropy_fused_cuda_workspace_bytes(cp, true, false);
    ce_ws_ = a.get_bytes("drafter.ce_workspace", ce_ws_bytes_);
  }
  if (c.dflash2.enabled) {
    dflash2_ws_bytes_ = dflash2_head_cuda_workspace_bytes(c, NK, ce_chunk_rows_);
    dflash2_ws_ = a.get_bytes("drafter.dflash2.workspace", dflash2_ws_bytes_);
    dflash2_rows_bytes_ = dflash2_head_cuda_rows_bytes(c, NK);
    dflash2_rows_ = a.get_bytes("drafter.dflash2.rows", dflash2_rows_bytes_);
    dflash2_sums_ = a.get<double>("drafter.dflash2.sums", 5);
  }
  row_w_ = a.get<float>("drafter.row_weights", NK);
  dh_ = a.get<float>("drafter.dh", NK * H);
  dh_bf_ = a.get<uint16_t>("drafter.dh_bf", NK * H);
  d_act_ = a.get<uint16_t>("drafter.d_act", NK * I);
  d_gu_ = a.get<uint16_t>("drafter.d_gu", NK * 2 * I);
  dhn2_ = a.get<float>("drafter.dhn2", NK * H);
  d_o_ = a.get<uint16_t>("drafter.d_o", NK * QD);
  dq_ = a.get<uint16_t>("drafter.dq", NK * QD);
  dq_raw_ = a.get<uint16_t>("drafter.dq_raw", NK * QD);
  dk_ = a.get<uint16_t>("drafter.dk", TK * KD);
  dk_raw_ = a.get<uint16_t>("drafter.dk_raw", TK * KD);
  dv_ = a.get<uint16_t>("drafter.dv", TK * KD);
  dx_ = a.get<float>("drafter.dx", TK * H);
  dctx_ = a.get<float>("drafter.dctx", T * H);
  dctx_pre_ = a.get<float>("drafter.dctx_pre", T * H);
  dctx_bf_ = a.get<uint16_t>("drafter.dctx_bf", T * H);
  if (c.dflash2.enabled) take_conv_buffers(a);
}

// DFlash2's conv buffers (plan_dflash2_conv in model/step_plan.cpp).
void DrafterCuda::take_conv_buffers(cuda::DeviceArena& a) {
  const int64_t NK = max_rows_, H = cfg_.hidden_size;
  const int64_t W = 2 * cfg_.dflash2.conv_kernel_size * (H / cfg_.dflash2.conv_group_size);
  const bool keep = activations_ == DrafterActivations::keep;
  uint16_t* shared_u[2] = {nullptr, nullptr};
  if (!keep) {
    shared_u[0] = a.get<uint16_t>("drafter.attn_conv.u", NK * H);
    shared_u[1] = a.get<uint16_t>("drafter.mlp_conv.u", NK * H);
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    ConvBuf* subs[2] = {&layers_[l].attn_conv, &layers_[l].mlp_conv};
    for (int k = 0; k < 2; ++k) {
      const std::string n =
          fmt::format("drafter.layers.{}.{}.", l, k == 0 ? "attn_conv" : "mlp_conv");
      subs[k]->delta = a.get<float>(n + "delta", NK * W);
      subs[k]->y = a.get<float>(n + "y", NK * H);
      subs[k]->u = keep ? a.get<uint16_t>(n + "u", NK * H) : shared_u[k];
    }
  }
  conv_dy_ = a.get<uint16_t>("drafter.conv.dy", NK * H);
  conv_ddelta_ = a.get<uint16_t>("drafter.conv.ddelta", NK * W);
  conv_du_ = a.get<float>("drafter.conv.du", NK * H);
}

void DrafterCuda::upload_state(std::span<const float> params, std::span<const float> m,
                               std::span<const float> v) {
  const auto P = static_cast<size_t>(layout_.total);
  DFLASH_CHECK(params.size() == P && m.size() == P && v.size() == P,
               "DrafterCuda::upload_state: {} / {} / {} values for {} parameters", params.size(),
               m.size(), v.size(), P);
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(params_, params.data(), P * kF, cudaMemcpyHostToDevice, ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(m_, m.data(), P * kF, cudaMemcpyHostToDevice, ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(v_, v.data(), P * kF, cudaMemcpyHostToDevice, ctx_.stream()));
  cast_cuda(ctx_, wbf_, params_, layout_.total);
  ctx_.synchronize();
}

void DrafterCuda::download_state(std::span<float> params, std::span<float> m, std::span<float> v) {
  const auto P = static_cast<size_t>(layout_.total);
  DFLASH_CHECK(params.size() == P && m.size() == P && v.size() == P,
               "DrafterCuda::download_state: {} / {} / {} values for {} parameters", params.size(),
               m.size(), v.size(), P);
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(params.data(), params_, P * kF, cudaMemcpyDeviceToHost, ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(m.data(), m_, P * kF, cudaMemcpyDeviceToHost, ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(v.data(), v_, P * kF, cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
}

void DrafterCuda::randomize_state(uint64_t seed) {
  const float bound = 0.02f * std::sqrt(3.0f);  // standard deviation 0.02
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const ParamInfo& p = layout_.params[i];
    fill_uniform_cuda(ctx_, params_ + p.offset, p.numel, p.is_norm ? 1.0f : 0.0f,
                      p.is_norm ? 0.0f : bound, seed + i);
  }
  const size_t bytes = static_cast<size_t>(layout_.total) * kF;
  DFLASH_CUDA_CHECK(cudaMemsetAsync(m_, 0, bytes, ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(v_, 0, bytes, ctx_.stream()));
  cast_cuda(ctx_, wbf_, params_, layout_.total);
  ctx_.synchronize();
}

void DrafterCuda::download_grads(std::span<float> grads) {
  const auto P = static_cast<size_t>(layout_.total);
  DFLASH_CHECK(grads.size() == P, "DrafterCuda::download_grads: {} values for {} parameters",
               grads.size(), P);
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(grads.data(), grads_, P * kF, cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
}

void DrafterCuda::forward_backward(const DrafterCudaInputs& in, double grad_scale) {
  const DrafterConfig& c = cfg_;
  const int64_t T = in.T, NK = in.NK, TK = T + NK;
  DFLASH_CHECK(T > 0 && T <= max_ctx_ && NK > 0 && NK <= max_rows_ && NK % c.block_size == 0,
               "DrafterCuda::forward_backward: {} context rows and {} block rows for a workspace "
               "of {} and {} (block rows must be a multiple of {})", T, NK, max_ctx_, max_rows_,
               c.block_size);
  DFLASH_CHECK(in.features && in.pos && in.block_tokens && in.ranges && in.labels && in.weights,
               "DrafterCuda::forward_backward: null input");
  DFLASH_CHECK(in.objective.dspark() == c.dspark.enabled,
               "DrafterCuda::forward_backward: the {} objective for a drafter {} DSpark heads",
               objective_kind_name(in.objective.kind), c.dspark.enabled ? "with" : "without");
  DFLASH_CHECK(in.objective.dflash2() == c.dflash2.enabled,
               "DrafterCuda::forward_backward: the {} objective for a drafter {} DFlash2's conv",
               objective_kind_name(in.objective.kind), c.dflash2.enabled ? "with" : "without");
  DFLASH_CHECK(!c.dflash2.enabled || (in.dflash2_prev && in.dflash2_alpha),
               "DrafterCuda::forward_backward: a DFlash2 step without its predecessor tokens or "
               "its α_sel");
  DFLASH_CHECK(!c.dspark.enabled || (in.dspark_prev && in.dspark_teacher_pos &&
                                     in.dspark_w1_order && in.dspark_w1_seg),
               "DrafterCuda::forward_backward: a DSpark step without its row index");
  DFLASH_CHECK(in.objective.domino() == c.domino.enabled,
               "DrafterCuda::forward_backward: the {} objective for a drafter {} the Domino head",
               objective_kind_name(in.objective.kind), c.domino.enabled ? "with" : "without");
  DFLASH_CHECK(!c.domino.enabled || (in.domino_gru_tok && in.domino_lambda),
               "DrafterCuda::forward_backward: a Domino step without its row index");
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, NH = c.num_heads;
  const int64_t NKV = c.num_kv_heads, QD = NH * D, KD = NKV * D, F = c.n_taps() * H;
  const double eps = c.rms_norm_eps;
  // A parameter's master weight, gradient and bf16 copy, by its layout offset.
  auto pf = [&](int64_t offset) { return params_ + offset; };
  auto gf = [&](int64_t offset) { return grads_ + offset; };
  auto wb = [&](int64_t offset) { return static_cast<const uint16_t*>(wbf_) + offset; };
  auto layer = [&](int64_t l) -> const DrafterLayerOffsets& {
    return layout_.layers[static_cast<size_t>(l)];
  };
  const float* inv_freq = inv_freq_;
  const int32_t* pos_q = in.pos + T;
  float* nullf = nullptr;
  const AttnParams ap{NK, TK, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  cudaStream_t s = ctx_.stream();
  // DFlash2: with ū = U the fused CE computes the base CE (plain DFlash's bits) and the selector
  // head adds its term; otherwise the head computes both.
  const bool d2_base_in_head = c.dflash2.base_in_head();
  // A layer's kvin holds [ctx rows T ; block rows NK] of its k/v projections; its block rows are
  // hn = norm(x_in), the input of q_proj.
  auto hn_of = [&](const LayerBuf& a) { return a.kvin + T * H; };
  // Activations the backward reads that the forward computes from what it saves: by the same
  // kernels on the same inputs in the forward and, when recomputed, again in the backward.
  const bool recompute = activations_ == DrafterActivations::recompute;
  auto norm_rope_q = [&](const LayerBuf& a, int64_t l) {
    rmsnorm_rope_fwd_cuda(ctx_, a.q, a.q_raw, pf(layer(l).q_norm), pos_q, inv_freq, rope_scaling_,
                          NK, NH, D, eps);
  };
  auto norm_rope_k = [&](const LayerBuf& a, int64_t l) {
    rmsnorm_rope_fwd_cuda(ctx_, a.k, a.k_raw, pf(layer(l).k_norm), in.pos, inv_freq, rope_scaling_,
                          TK, NKV, D, eps);
  };
  auto swiglu = [&](const LayerBuf& a) {
    swiglu_fwd_cuda(ctx_, a.act, a.gu, a.gu + I, NK, I, 2 * I);
  };
  // DFlash2 (model/dflash2_conv.hpp): the norms write the sublayer input u, and the pre-conv
  // of u (with δ = u·W_kpᵀ, computed once in the forward and kept) is the sublayer's input ũ.
  const bool conv = c.dflash2.enabled;
  const Dflash2ConvShape cs{NK, H, c.block_size, c.dflash2.conv_kernel_size,
                            c.dflash2.conv_group_size};
  const Dflash2Offsets& o2 = layout_.dflash2;
  const int64_t TH = cs.taps * H;  // β_post = base_kernel + T·H
  auto conv_pre = [&](const ConvBuf& cb, uint16_t* ut, int64_t base) {
    dflash2_conv_fwd_cuda(ctx_, ut, nullf, cb.u, pf(base), cb.delta, 0, cs);
  };
  auto input_norm = [&](const LayerBuf& a, const float* x_in, int64_t l) {
    rmsnorm_fwd_cuda(ctx_, conv ? a.attn_conv.u : hn_of(a), nullf, x_in,
                     pf(layer(l).input_layernorm), NK, H, eps);
    if (conv) conv_pre(a.attn_conv, hn_of(a), o2.attn_base[static_cast<size_t>(l)]);
  };
  auto post_norm = [&](const LayerBuf& a, int64_t l) {
    rmsnorm_fwd_cuda(ctx_, conv ? a.mlp_conv.u : a.hn2, nullf, a.h_mid,
                     pf(layer(l).post_attention_layernorm), NK, H, eps);
    if (conv) conv_pre(a.mlp_conv, a.hn2, o2.mlp_base[static_cast<size_t>(l)]);
  };
  // δ = u·W_kpᵀ of a sublayer (forward only; the backward reads the kept δ).
  auto conv_delta = [&](const ConvBuf& cb, int64_t kp) {
    linear_fwd_cuda(ctx_, cb.delta, cb.u, wb(kp), NK, H, cs.delta_width());
  };
  // out = res + post_conv(x·Wᵀ): y = 0 + x·Wᵀ by the same GEMM as linear_fwd_res_cuda's (beta 1),
  // so that at the identity conv out has the bits of plain DFlash's res + x·Wᵀ.
  auto proj_post_conv = [&](float* out, const float* res, const ConvBuf& cb, const uint16_t* x,
                            int64_t w, int64_t IN, int64_t base) {
    DFLASH_CUDA_CHECK(cudaMemsetAsync(cb.y, 0, static_cast<size_t>(NK * H) * kF, s));
    linear_fwd_acc_cuda(ctx_, cb.y, x, wb(w), NK, IN, H);
    dflash2_conv_fwd_cuda(ctx_, out, res, cb.y, pf(base) + TH, cb.delta, 1, cs);
  };
  // Backward of the post-conv for dout f32: conv_dy_ = bf16(∂/∂y) (the projection's backward GEMM
  // input), the δ¹ half of conv_ddelta_, dβ¹ += .
  auto post_conv_bwd = [&](const ConvBuf& cb, const float* dout, int64_t base) {
    dflash2_conv_bwd_dx_cuda(ctx_, conv_dy_, false, dout, pf(base) + TH, cb.delta, 1, cs);
    dflash2_conv_bwd_ddelta_cuda(ctx_, conv_ddelta_, dout, static_cast<const float*>(cb.y), 1, cs);
    dflash2_conv_bwd_dbase_cuda(ctx_, gf(base) + TH, dout, static_cast<const float*>(cb.y), cs);
  };
  // Backward of the pre-conv for dũ f32: conv_du_ = ∂/∂u through δ (dδ·W_kp, both halves of
  // conv_ddelta_) and through the taps; dβ⁰ +=, dW_kp += dδᵀ·u.
  auto pre_conv_bwd = [&](const ConvBuf& cb, const float* dut, int64_t base, int64_t kp) {
    dflash2_conv_bwd_ddelta_cuda(ctx_, conv_ddelta_, dut, static_cast<const uint16_t*>(cb.u), 0,
                                 cs);
    dflash2_conv_bwd_dbase_cuda(ctx_, gf(base), dut, static_cast<const uint16_t*>(cb.u), cs);
    linear_bwd_cuda(ctx_, conv_du_, gf(kp), conv_ddelta_, cb.u, wb(kp), NK, H, cs.delta_width());
    dflash2_conv_bwd_dx_cuda(ctx_, conv_du_, true, dut, pf(base), cb.delta, 0, cs);
  };
  auto embed_blocks = [&] {
    embedding_fwd_cuda(ctx_, h0_, embed_, in.block_tokens, NK, c.vocab_size, H);
  };

  // ---- phase drafter ctx
  DFLASH_CUDA_CHECK(cudaMemsetAsync(grads_, 0, static_cast<size_t>(layout_.total) * kF, s));
  // ctx = hidden_norm(fc(features)): the first T rows of layer 0's kvin, copied into the other
  // layers' kvin when each layer has its own.
  linear_fwd_cuda(ctx_, ctx_pre_, in.features, wb(layout_.fc), T, F, H);  // the taps [T, F]
  uint16_t* kvin0 = layers_.front().kvin;
  rmsnorm_fwd_cuda(ctx_, kvin0, nullf, ctx_pre_, pf(layout_.hidden_norm), T, H, eps);
  for (const LayerBuf& a : layers_) {
    if (a.kvin == kvin0) continue;
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(a.kvin, kvin0, static_cast<size_t>(T * H) * sizeof(uint16_t),
                                      cudaMemcpyDeviceToDevice, s));
  }
  embed_blocks();

  // ---- forward, layer by layer (phases fwd attn, fwd mlp)
  const float* h = h0_;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerBuf& a = layers_[static_cast<size_t>(l)];
    const DrafterLayerOffsets& L = layer(l);
    if (conv) {  // u, δ, then ũ into kvin's block rows
      rmsnorm_fwd_cuda(ctx_, a.attn_conv.u, nullf, h, pf(L.input_layernorm), NK, H, eps);
      conv_delta(a.attn_conv, o2.attn_kp[static_cast<size_t>(l)]);
      conv_pre(a.attn_conv, hn_of(a), o2.attn_base[static_cast<size_t>(l)]);
    } else {
      input_norm(a, h, l);
    }
    linear_fwd_cuda(ctx_, a.q_raw, hn_of(a), wb(L.q_proj), NK, H, QD);
    norm_rope_q(a, l);
    linear_fwd_cuda(ctx_, a.k_raw, a.kvin, wb(L.k_proj), TK, H, KD);
    norm_rope_k(a, l);
    linear_fwd_cuda(ctx_, a.v, a.kvin, wb(L.v_proj), TK, H, KD);
    attention_fwd_cuda(ctx_, a.o, a.lse, a.q, a.k, a.v, in.ranges, ap);
    if (conv) {  // h_mid = h + post_conv(o_proj)
      proj_post_conv(a.h_mid, h, a.attn_conv, a.o, L.o_proj, QD,
                     o2.attn_base[static_cast<size_t>(l)]);
      rmsnorm_fwd_cuda(ctx_, a.mlp_conv.u, nullf, a.h_mid, pf(L.post_attention_layernorm), NK, H,
                       eps);
      conv_delta(a.mlp_conv, o2.mlp_kp[static_cast<size_t>(l)]);
      conv_pre(a.mlp_conv, a.hn2, o2.mlp_base[static_cast<size_t>(l)]);
    } else {
      linear_fwd_res_cuda(ctx_, a.h_mid, h, a.o, wb(L.o_proj), NK, QD, H);  // h_mid = h + o_proj
      post_norm(a, l);
    }
    linear_fwd_cuda(ctx_, a.gu, a.hn2, wb(L.gate_proj), NK, H, 2 * I);  // [gate | up]
    swiglu(a);
    if (conv) {
      proj_post_conv(a.h_out, a.h_mid, a.mlp_conv, a.act, L.down_proj, I,
                     o2.mlp_base[static_cast<size_t>(l)]);
    } else {
      linear_fwd_res_cuda(ctx_, a.h_out, a.h_mid, a.act, wb(L.down_proj), NK, I, H);
    }
    h = a.h_out;
  }

  if (phase_events_.after_forward) {
    DFLASH_CUDA_CHECK(cudaEventRecord(phase_events_.after_forward, s));
  }

  // ---- phase head: final norm, the fused LM-head CE (d_hf = grad_scale·d(Σ w·CE)/d hf) and the
  // final norm's backward.
  const int64_t norm_i = layout_.norm;
  rmsnorm_fwd_cuda(ctx_, hf_, nullf, h, pf(norm_i), NK, H, eps);
  const bool dpace = in.objective.dpace();
  if (c.dspark.enabled) {
    DsparkCudaArgs da;
    da.R = NK;
    da.params = params_;
    da.weights_bf16 = wbf_;
    da.grads = grads_;
    da.lm_head = head_;
    da.hf = hf_;
    da.target_final = in.features + T * F;  // after the taps (drafter_feature_cols)
    da.labels = in.labels;
    da.weights = in.weights;
    da.prev = in.dspark_prev;
    da.teacher_pos = in.dspark_teacher_pos;
    da.w1_order = in.dspark_w1_order;
    da.w1_seg = in.dspark_w1_seg;
    da.dhf = d_hf_;
    da.argmax = argmax_;
    da.sums = dspark_sums_;
    da.workspace = dspark_ws_;
    da.workspace_bytes = dspark_ws_bytes_;
    da.rows = dspark_rows_;
    da.rows_bytes = dspark_rows_bytes_;
    da.grad_scale = grad_scale;
    da.chunk_rows = ce_chunk_rows_;
    dspark_head_cuda(ctx_, c, layout_, in.objective, da);
    // {Σ w·loss, Σ w} where fetch_results reads the other objectives' sums.
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(sums_, dspark_sums_, 2 * sizeof(double), cudaMemcpyDeviceToDevice, s));
  } else if (c.domino.enabled) {
    DominoCudaArgs da;
    da.R = NK;
    da.weights_bf16 = wbf_;
    da.grads = grads_;
    da.embed = embed_;
    da.lm_head = head_;
    da.hf = hf_;
    da.labels = in.labels;
    da.weights = in.weights;
    da.gru_tok = in.domino_gru_tok;
    da.lambda = in.domino_lambda;
    da.dhf = d_hf_;
    da.argmax = argmax_;
    da.sums = domino_sums_;
    da.workspace = domino_ws_;
    da.workspace_bytes = domino_ws_bytes_;
    da.rows = domino_rows_;
    da.rows_bytes = domino_rows_bytes_;
    da.grad_scale = grad_scale;
    da.chunk_rows = ce_chunk_rows_;
    domino_head_cuda(ctx_, c, layout_, in.objective, da);
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(sums_, domino_sums_, 2 * sizeof(double), cudaMemcpyDeviceToDevice, s));
  } else if (!d2_base_in_head) {
    // Without an objective head the anchor slots never enter the LM head (drafter_ce_params):
    // their weight is 0 by block_targets, which the objective's first supervised slot says.
    FusedCeParams cp = drafter_ce_params(c, NK, ce_chunk_rows_);
    DFLASH_CHECK(cp.skip_first_of == 0 || in.objective.first_slot() == 1,
                 "DrafterCuda::forward_backward: the {} objective supervises slot 0, which the "
                 "fused CE of this drafter skips",
                 objective_kind_name(in.objective.kind));
    cp.grad_scale = grad_scale;
    cross_entropy_fused_cuda(ctx_, d_hf_, nullptr, argmax_, dpace ? row_w_ : nullptr, sums_, hf_,
                             head_, in.labels, in.weights, cp, ce_ws_, ce_ws_bytes_);
  }
  if (c.dflash2.enabled) {  // the selector (and, unless ū = U, the base CE): d_hf +=
    Dflash2CudaArgs a2;
    a2.R = NK;
    a2.params = params_;
    a2.grads = grads_;
    a2.lm_head = head_;
    a2.hf = hf_;
    a2.labels = in.labels;
    a2.weights = in.weights;
    a2.prev = in.dflash2_prev;
    a2.alpha = in.dflash2_alpha;
    a2.dhf = d_hf_;
    a2.base_in_head = d2_base_in_head;
    a2.argmax = d2_base_in_head ? argmax_ : nullptr;  // else the fused CE's
    a2.sums = dflash2_sums_;
    a2.workspace = dflash2_ws_;
    a2.workspace_bytes = dflash2_ws_bytes_;
    a2.rows = dflash2_rows_;
    a2.rows_bytes = dflash2_rows_bytes_;
    a2.grad_scale = grad_scale;
    a2.chunk_rows = ce_chunk_rows_;
    // D-PACE: the fused CE's per-row CE in, each row's weight out; the base's {Σ w·CE, Σ w}
    // where fetch_results reads them. The head scales d_hf by the weights itself.
    a2.dpace_w = dpace ? row_w_ : nullptr;
    a2.dpace_sums = dpace ? sums_ : nullptr;
    dflash2_head_cuda(ctx_, c, layout_, in.objective, a2);
    dflash2_alpha_ = in.dflash2_alpha;
    if (d2_base_in_head && !dpace) {  // {Σ w·base, Σ w} where fetch_results reads the base
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(sums_, dflash2_sums_, 2 * sizeof(double),
                                        cudaMemcpyDeviceToDevice, s));
    }
  }
  if (dpace && !c.dflash2.enabled) {  // CE → D-PACE weights (and the sums), then d_hf row r ·= w_r
    dpace_weights_cuda(ctx_, row_w_, sums_, in.weights, NK / c.block_size, c.block_size,
                       in.objective);
    rows_scale_cuda(ctx_, d_hf_, row_w_, NK, H);
  }
  // dh = d(h) and its bf16 copy, the input of the last layer's down_proj backward.
  rmsnorm_bwd_res_cuda(ctx_, dh_, dh_bf_, false, gf(norm_i), d_hf_, h, pf(norm_i), NK, H, eps);
  if (phase_events_.after_head) DFLASH_CUDA_CHECK(cudaEventRecord(phase_events_.after_head, s));

  // ---- backward, layer by layer (phases bwd mlp, bwd attn)
  for (int64_t l = c.num_layers - 1; l >= 0; --l) {
    LayerBuf& a = layers_[static_cast<size_t>(l)];
    const DrafterLayerOffsets& L = layer(l);
    // MLP: h_out = h_mid + down(SwiGLU(gu)), gu = norm(h_mid)·Wguᵀ. dh_bf = bf16(dh) on entry.
    const size_t lz = static_cast<size_t>(l);
    if (conv) post_conv_bwd(a.mlp_conv, dh_, o2.mlp_base[lz]);  // conv_dy_ = bf16(d down)
    if (recompute) swiglu(a);
    linear_bwd_cuda(ctx_, d_act_, gf(L.down_proj), conv ? conv_dy_ : dh_bf_, a.act, wb(L.down_proj),
                    NK, I, H);
    swiglu_bwd_cuda(ctx_, d_gu_, d_gu_ + I, d_act_, a.gu, a.gu + I, NK, I, 2 * I);
    if (recompute) post_norm(a, l);
    // gate and up are adjacent in the layout: one [2I, H] linear.
    linear_bwd_cuda(ctx_, dhn2_, gf(L.gate_proj), d_gu_, a.hn2, wb(L.gate_proj), NK, H, 2 * I);
    // DFlash2: dhn2 = ∂/∂ũ → conv_du_ = ∂/∂u.
    if (conv) pre_conv_bwd(a.mlp_conv, dhn2_, o2.mlp_base[lz], o2.mlp_kp[lz]);
    // dh = d(h_mid) = dh + norm's dx, and dh_bf = bf16(dh).
    rmsnorm_bwd_res_cuda(ctx_, dh_, dh_bf_, true, gf(L.post_attention_layernorm),
                         conv ? conv_du_ : dhn2_, a.h_mid, pf(L.post_attention_layernorm), NK, H,
                         eps);
    // Attention: h_mid = x_in + o_proj(o) (DFlash2: x_in + post_conv(o_proj(o))).
    if (conv) post_conv_bwd(a.attn_conv, dh_, o2.attn_base[lz]);
    linear_bwd_cuda(ctx_, d_o_, gf(L.o_proj), conv ? conv_dy_ : dh_bf_, a.o, wb(L.o_proj), NK, QD,
                    H);
    const float* x_in = l == 0 ? h0_ : layers_[static_cast<size_t>(l - 1)].h_out;
    if (recompute) {
      if (l == 0) embed_blocks();
      input_norm(a, x_in, l);
      norm_rope_q(a, l);
      norm_rope_k(a, l);
    }
    attention_bwd_cuda(ctx_, dq_, dk_, dv_, d_o_, a.q, a.k, a.v, a.o, a.lse, in.ranges, ap);
    // q path: rope -> q_norm -> q_proj.
    rope_bwd_cuda(ctx_, dq_, dq_, pos_q, inv_freq, rope_scaling_, NK, NH, D);
    rmsnorm_bwd_cuda(ctx_, dq_raw_, gf(L.q_norm), dq_, a.q_raw, pf(L.q_norm), NK * NH, D, eps);
    // k path over all rows [ctx ; block].
    rope_bwd_cuda(ctx_, dk_, dk_, in.pos, inv_freq, rope_scaling_, TK, NKV, D);
    rmsnorm_bwd_cuda(ctx_, dk_raw_, gf(L.k_norm), dk_, a.k_raw, pf(L.k_norm), TK * NKV, D, eps);
    // dX[TK, H] = dk_raw·Wk + dv·Wv, then rows [T, TK) += dq_raw·Wq; weight gradients.
    linear_bwd_cuda(ctx_, dx_, nullf, dk_raw_, nullptr, wb(L.k_proj), TK, H, KD);
    linear_bwd_dx_acc_cuda(ctx_, dx_, dv_, wb(L.v_proj), TK, H, KD);
    linear_bwd_dx_acc_cuda(ctx_, dx_ + T * H, dq_raw_, wb(L.q_proj), NK, H, QD);
    linear_bwd_cuda(ctx_, nullf, gf(L.k_proj), dk_raw_, a.kvin, wb(L.k_proj), TK, H, KD);
    linear_bwd_cuda(ctx_, nullf, gf(L.v_proj), dv_, a.kvin, wb(L.v_proj), TK, H, KD);
    linear_bwd_cuda(ctx_, nullf, gf(L.q_proj), dq_raw_, hn_of(a), wb(L.q_proj), NK, H, QD);
    // DFlash2: the block rows of dx = ∂/∂ũ → conv_du_ = ∂/∂u.
    if (conv) pre_conv_bwd(a.attn_conv, dx_ + T * H, o2.attn_base[lz], o2.attn_kp[lz]);
    // input_layernorm of the block rows; ctx rows enter every layer unnormed. dh = d(x_in) and
    // its bf16 copy for the layer below; layer 0's x_in is the frozen block embedding: only dw.
    const bool below = l > 0;
    rmsnorm_bwd_res_cuda(ctx_, below ? dh_ : nullf, below ? dh_bf_ : nullptr, true,
                         gf(L.input_layernorm), conv ? conv_du_ : dx_ + T * H, x_in,
                         pf(L.input_layernorm), NK, H, eps);
    if (l == c.num_layers - 1) {
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(dctx_, dx_, static_cast<size_t>(T * H) * kF,
                                        cudaMemcpyDeviceToDevice, s));
    } else {
      residual_accumulate_cuda(ctx_, dctx_, dx_, T * H);
    }
  }

  // ---- phase bwd ctx: ctx = hidden_norm(fc(features)); the features are frozen.
  rmsnorm_bwd_res_cuda(ctx_, dctx_pre_, dctx_bf_, false, gf(layout_.hidden_norm), dctx_, ctx_pre_,
                       pf(layout_.hidden_norm), T, H, eps);
  linear_bwd_cuda(ctx_, nullf, gf(layout_.fc), dctx_bf_, in.features, wb(layout_.fc), T, F, H);

  grad_sumsq_cuda(ctx_, sumsq_, segs_, 1);
}

DrafterCuda::Results DrafterCuda::fetch_results(int64_t NK) {
  DFLASH_CHECK(NK >= 0 && NK <= max_rows_, "DrafterCuda::fetch_results: {} rows", NK);
  Results r;
  double sums[2] = {0, 0}, sumsq = 0;
  r.argmax.resize(static_cast<size_t>(NK));
  cudaStream_t s = ctx_.stream();
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(sums, sums_, sizeof sums, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(&sumsq, sumsq_, sizeof sumsq, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(r.argmax.data(), argmax_,
                                    static_cast<size_t>(NK) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, s));
  double d[6] = {0, 0, 0, 0, 0, 0};  // DSpark's sums (dspark_head_cuda)
  if (cfg_.dspark.enabled) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(d, dspark_sums_, sizeof d, cudaMemcpyDeviceToHost, s));
  }
  double dm[4] = {0, 0, 0, 0};  // Domino's sums (domino_head_cuda)
  if (cfg_.domino.enabled) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dm, domino_sums_, sizeof dm, cudaMemcpyDeviceToHost, s));
  }
  double d2[5] = {0, 0, 0, 0, 0};  // DFlash2's sums (dflash2_head_cuda)
  double alpha = 0;                // DFlash2's α_sel, as the step read it
  if (cfg_.dflash2.enabled) {
    DFLASH_CHECK(dflash2_alpha_, "DrafterCuda::fetch_results: no DFlash2 step was enqueued");
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(d2, dflash2_sums_, sizeof d2, cudaMemcpyDeviceToHost, s));
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(&alpha, dflash2_alpha_, sizeof alpha, cudaMemcpyDeviceToHost, s));
  }
  ctx_.synchronize();
  r.loss_sum = sums[0];
  r.weight_sum = sums[1];
  r.grad_norm = std::sqrt(sumsq);
  if (cfg_.dspark.enabled) {
    r.dspark_ce_sum = d[2];
    r.dspark_l1_sum = d[3];
    r.dspark_bce_sum = d[4];
    r.dspark_acc_sum = d[5];
  }
  r.domino_final_ce_sum = dm[2];
  r.domino_base_ce_sum = dm[3];
  if (cfg_.dflash2.enabled) {  // sums: {Σ w·base, Σ w} (the fused CE's or the head's)
    r.dflash2_base_sum = sums[0];
    r.dflash2_selector_sum = d2[2];
    r.dflash2_in_topk_weight = d2[3];
    r.loss_sum = sums[0] + alpha * d2[2];
  }
  return r;
}

double DrafterCuda::grad_norm() {
  grad_sumsq_cuda(ctx_, sumsq_, segs_, 1);
  double sumsq = 0;
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(&sumsq, sumsq_, sizeof sumsq, cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
  return std::sqrt(sumsq);
}

void DrafterCuda::adamw(const AdamWConfig& cfg, double lr, int64_t step, double grad_scale) {
  const float gs = static_cast<float>(grad_scale);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(clip_, &gs, sizeof gs, cudaMemcpyHostToDevice, ctx_.stream()));
  adamw_step_cuda(ctx_, segs_, 1, layout_.total, cfg, lr, step, clip_, nullptr);  // and wbf_
  // `gs` lives on this stack frame: the copy must finish before returning.
  ctx_.synchronize();
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
