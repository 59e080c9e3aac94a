// dflash.cpp — DrafterCuda (see drafter_cuda.hpp). The step mirrors drafter_train_step
// (src/model/drafter.cpp) op for op; the differences are the padding of the packed step to a
// fixed shape (inert rows) and that the k/v projections of the context and the block rows run as
// one GEMM over [ctx ; norm(block)] (rows kept contiguous in `kvin`).
#include "model/drafter_cuda.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <cmath>

#include "backend/cuda/check.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/error.hpp"
#include "ops/attention.hpp"
#include "ops/cast.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/embedding.hpp"
#include "ops/linear.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

constexpr size_t kBf = 2, kF = 4;

// y[M,N] (+)= x[M,K] · W[N,K]ᵀ with bf16 x and W; y f32 or bf16.
void mm_xwt(cuda::CudaContext& ctx, void* y, DType yt, const uint16_t* x, const uint16_t* w,
            int64_t M, int64_t N, int64_t K, float beta) {
  cuda::gemm_bf16(ctx, y, yt, N, x, K, false, w, K, true, M, N, K, 1.0f, beta);
}
// dx[M,K] (+)= dy[M,N] · W[N,K].
void mm_dyw(cuda::CudaContext& ctx, void* dx, DType dt, const uint16_t* dy, const uint16_t* w,
            int64_t M, int64_t N, int64_t K, float beta) {
  cuda::gemm_bf16(ctx, dx, dt, K, dy, N, false, w, K, false, M, K, N, 1.0f, beta);
}
// dW[N,K] f32 += dy[M,N]ᵀ · x[M,K].
void mm_dw(cuda::CudaContext& ctx, float* dw, const uint16_t* dy, const uint16_t* x, int64_t M,
           int64_t N, int64_t K) {
  cuda::gemm_bf16(ctx, dw, DType::f32, K, dy, N, true, x, K, false, N, K, M, 1.0f, 1.0f);
}

}  // namespace

DrafterCuda::DrafterCuda(cuda::CudaContext& ctx, const DrafterConfig& cfg,
                         const DrafterLayout& layout, int64_t max_ctx, int64_t max_block_rows,
                         const uint16_t* embed, const uint16_t* lm_head)
    : ctx_(ctx),
      cfg_(cfg),
      layout_(layout),
      max_ctx_(max_ctx),
      max_rows_(max_block_rows),
      embed_(embed),
      head_(lm_head),
      rope_scaling_(static_cast<float>(rope_attention_scaling(cfg.rope))) {
  cfg.validate();
  DFLASH_CHECK(cfg.head_dim == 64 || cfg.head_dim == 128,
               "the CUDA drafter supports head_dim 64 or 128 (got {})", cfg.head_dim);
  DFLASH_CHECK(max_ctx > 0 && max_block_rows > 0 && max_block_rows % cfg.block_size == 0,
               "DrafterCuda: bad capacities ({} context rows, {} block rows)", max_ctx,
               max_block_rows);
  DFLASH_CHECK(embed && lm_head, "DrafterCuda: null embedding or LM head");
  const auto P = static_cast<size_t>(layout.total);
  const auto H = static_cast<size_t>(cfg.hidden_size), I = static_cast<size_t>(cfg.intermediate_size);
  const auto QD = static_cast<size_t>(cfg.num_heads * cfg.head_dim);
  const auto KD = static_cast<size_t>(cfg.num_kv_heads * cfg.head_dim);
  const auto F = static_cast<size_t>(cfg.n_taps() * cfg.hidden_size);
  const auto Tc = static_cast<size_t>(max_ctx), Nc = static_cast<size_t>(max_block_rows);
  const auto NH = static_cast<size_t>(cfg.num_heads);
  params_ = ctx.scratch(P * kF);
  grads_ = ctx.scratch(P * kF);
  m_ = ctx.scratch(P * kF);
  v_ = ctx.scratch(P * kF);
  wbf_ = ctx.scratch(P * kBf);
  AdamWSegment seg{params_.as<float>(), m_.as<float>(), v_.as<float>(), grads_.as<float>(),
                   layout.total};
  segs_ = ctx.scratch(sizeof(AdamWSegment));
  DFLASH_CUDA_CHECK(cudaMemcpy(segs_.data(), &seg, sizeof seg, cudaMemcpyHostToDevice));
  const std::vector<double> f = rope_inv_freq(cfg.rope, cfg.head_dim);
  const std::vector<float> ff(f.begin(), f.end());
  inv_freq_ = ctx.scratch(ff.size() * kF);
  DFLASH_CUDA_CHECK(
      cudaMemcpy(inv_freq_.data(), ff.data(), ff.size() * kF, cudaMemcpyHostToDevice));
  sumsq_ = ctx.scratch(sizeof(double));
  sums_ = ctx.scratch(2 * sizeof(double));
  clip_ = ctx.scratch(sizeof(float));
  features_ = ctx.scratch(Tc * F * kBf);
  ctx_pre_ = ctx.scratch(Tc * H * kF);
  dctx_ = ctx.scratch(Tc * H * kF);
  dctx_pre_ = ctx.scratch(Tc * H * kF);
  dctx_bf_ = ctx.scratch(Tc * H * kBf);
  h0_ = ctx.scratch(Nc * H * kF);
  hf_ = ctx.scratch(Nc * H * kBf);
  d_hf_ = ctx.scratch(Nc * H * kF);
  lse_ce_ = ctx.scratch(Nc * kF);
  argmax_ = ctx.scratch(Nc * sizeof(int32_t));
  dh_ = ctx.scratch(Nc * H * kF);
  dh_bf_ = ctx.scratch(Nc * H * kBf);
  dtmp_ = ctx.scratch(Nc * H * kF);
  d_act_ = ctx.scratch(Nc * I * kBf);
  d_gu_ = ctx.scratch(Nc * 2 * I * kBf);
  dhn2_ = ctx.scratch(Nc * H * kF);
  d_o_ = ctx.scratch(Nc * QD * kBf);
  dq_ = ctx.scratch(Nc * QD * kBf);
  dq_raw_ = ctx.scratch(Nc * QD * kBf);
  dk_ = ctx.scratch((Tc + Nc) * KD * kBf);
  dk_raw_ = ctx.scratch((Tc + Nc) * KD * kBf);
  dv_ = ctx.scratch((Tc + Nc) * KD * kBf);
  dx_ = ctx.scratch((Tc + Nc) * H * kF);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    LayerBuf b;
    b.kvin = ctx.scratch((Tc + Nc) * H * kBf);
    b.q_raw = ctx.scratch(Nc * QD * kBf);
    b.q = ctx.scratch(Nc * QD * kBf);
    b.k_raw = ctx.scratch((Tc + Nc) * KD * kBf);
    b.k = ctx.scratch((Tc + Nc) * KD * kBf);
    b.v = ctx.scratch((Tc + Nc) * KD * kBf);
    b.o = ctx.scratch(Nc * QD * kBf);
    b.lse = ctx.scratch(NH * Nc * kF);
    b.h_mid = ctx.scratch(Nc * H * kF);
    b.hn2 = ctx.scratch(Nc * H * kBf);
    b.gu = ctx.scratch(Nc * 2 * I * kBf);
    b.act = ctx.scratch(Nc * I * kBf);
    b.h_out = ctx.scratch(Nc * H * kF);
    layers_.push_back(std::move(b));
  }
}

void DrafterCuda::upload_state(std::span<const float> params, std::span<const float> m,
                               std::span<const float> v) {
  const auto P = static_cast<size_t>(layout_.total);
  DFLASH_CHECK(params.size() == P && m.size() == P && v.size() == P,
               "DrafterCuda::upload_state: {} / {} / {} values for {} parameters", params.size(),
               m.size(), v.size(), P);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(params_.data(), params.data(), P * kF, cudaMemcpyHostToDevice,
                                    ctx_.stream()));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(m_.data(), m.data(), P * kF, cudaMemcpyHostToDevice, ctx_.stream()));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(v_.data(), v.data(), P * kF, cudaMemcpyHostToDevice, ctx_.stream()));
  cast_cuda(ctx_, wbf_.as<uint16_t>(), params_.as<float>(), layout_.total);
  ctx_.synchronize();
}

void DrafterCuda::download_state(std::span<float> params, std::span<float> m, std::span<float> v) {
  const auto P = static_cast<size_t>(layout_.total);
  DFLASH_CHECK(params.size() == P && m.size() == P && v.size() == P,
               "DrafterCuda::download_state: {} / {} / {} values for {} parameters",
               params.size(), m.size(), v.size(), P);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(params.data(), params_.data(), P * kF, cudaMemcpyDeviceToHost,
                                    ctx_.stream()));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(m.data(), m_.data(), P * kF, cudaMemcpyDeviceToHost, ctx_.stream()));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(v.data(), v_.data(), P * kF, cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
}

void DrafterCuda::download_grads(std::span<float> grads) {
  const auto P = static_cast<size_t>(layout_.total);
  DFLASH_CHECK(grads.size() == P, "DrafterCuda::download_grads: {} values for {} parameters",
               grads.size(), P);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(grads.data(), grads_.data(), P * kF, cudaMemcpyDeviceToHost,
                                    ctx_.stream()));
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
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, NH = c.num_heads;
  const int64_t NKV = c.num_kv_heads, QD = NH * D, KD = NKV * D, F = c.n_taps() * H;
  const double eps = c.rms_norm_eps;
  float* P = params_.as<float>();
  float* G = grads_.as<float>();
  const uint16_t* W = wbf_.as<uint16_t>();
  // A parameter's master weight, gradient and bf16 copy, by its layout offset.
  auto pf = [&](int64_t offset) { return P + offset; };
  auto gf = [&](int64_t offset) { return G + offset; };
  auto wb = [&](int64_t offset) { return W + offset; };
  const float* inv_freq = inv_freq_.as<float>();
  const int32_t* pos_q = in.pos + T;
  float* nullf = nullptr;
  const AttnParams ap{NK, TK, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  cudaStream_t s = ctx_.stream();

  DFLASH_CUDA_CHECK(
      cudaMemsetAsync(grads_.data(), 0, static_cast<size_t>(layout_.total) * kF, s));

  // ---- forward
  // ctx = hidden_norm(fc(features)), written into the first T rows of every layer's kvin.
  float* ctx_pre = ctx_pre_.as<float>();
  mm_xwt(ctx_, ctx_pre, DType::f32, in.features, wb(layout_.fc), T, H, F, 0.0f);
  uint16_t* ctx0 = layers_[0].kvin.as<uint16_t>();
  rmsnorm_fwd_cuda(ctx_, ctx0, nullf, ctx_pre, pf(layout_.hidden_norm), T, H, eps);
  for (size_t l = 1; l < layers_.size(); ++l) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(layers_[l].kvin.data(), ctx0,
                                      static_cast<size_t>(T * H) * kBf, cudaMemcpyDeviceToDevice,
                                      s));
  }
  float* h = h0_.as<float>();
  embedding_fwd_cuda(ctx_, h, embed_, in.block_tokens, NK, c.vocab_size, H);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerBuf& a = layers_[static_cast<size_t>(l)];
    const DrafterLayerOffsets& L = layout_.layers[static_cast<size_t>(l)];
    uint16_t* kvin = a.kvin.as<uint16_t>();
    uint16_t* hn = kvin + T * H;
    rmsnorm_fwd_cuda(ctx_, hn, nullf, h, pf(L.input_layernorm), NK, H, eps);
    uint16_t *q_raw = a.q_raw.as<uint16_t>(), *q = a.q.as<uint16_t>();
    mm_xwt(ctx_, q_raw, DType::bf16, hn, wb(L.q_proj), NK, QD, H, 0.0f);
    rmsnorm_fwd_cuda(ctx_, q, nullf, q_raw, pf(L.q_norm), NK * NH, D, eps);
    rope_fwd_cuda(ctx_, q, q, pos_q, inv_freq, rope_scaling_, NK, NH, D);
    uint16_t *k_raw = a.k_raw.as<uint16_t>(), *k = a.k.as<uint16_t>(), *v = a.v.as<uint16_t>();
    mm_xwt(ctx_, k_raw, DType::bf16, kvin, wb(L.k_proj), TK, KD, H, 0.0f);
    rmsnorm_fwd_cuda(ctx_, k, nullf, k_raw, pf(L.k_norm), TK * NKV, D, eps);
    rope_fwd_cuda(ctx_, k, k, in.pos, inv_freq, rope_scaling_, TK, NKV, D);
    mm_xwt(ctx_, v, DType::bf16, kvin, wb(L.v_proj), TK, KD, H, 0.0f);
    uint16_t* o = a.o.as<uint16_t>();
    attention_fwd_cuda(ctx_, o, a.lse.as<float>(), q, k, v, in.ranges, ap);
    float* h_mid = a.h_mid.as<float>();
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_mid, h, static_cast<size_t>(NK * H) * kF,
                                      cudaMemcpyDeviceToDevice, s));
    mm_xwt(ctx_, h_mid, DType::f32, o, wb(L.o_proj), NK, H, QD, 1.0f);
    uint16_t* hn2 = a.hn2.as<uint16_t>();
    rmsnorm_fwd_cuda(ctx_, hn2, nullf, h_mid, pf(L.post_attention_layernorm), NK, H, eps);
    uint16_t *gu = a.gu.as<uint16_t>(), *act = a.act.as<uint16_t>();
    mm_xwt(ctx_, gu, DType::bf16, hn2, wb(L.gate_proj), NK, 2 * I, H, 0.0f);  // [gate | up]
    swiglu_fwd_cuda(ctx_, act, gu, gu + I, NK, I, 2 * I);
    float* h_out = a.h_out.as<float>();
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_out, h_mid, static_cast<size_t>(NK * H) * kF,
                                      cudaMemcpyDeviceToDevice, s));
    mm_xwt(ctx_, h_out, DType::f32, act, wb(L.down_proj), NK, H, I, 1.0f);
    h = h_out;
  }
  // Final norm and the fused LM-head cross-entropy (d_hf = grad_scale·d(Σ w·CE)/d hf).
  uint16_t* hf = hf_.as<uint16_t>();
  rmsnorm_fwd_cuda(ctx_, hf, nullf, h, pf(layout_.norm), NK, H, eps);
  FusedCeParams cp;
  cp.R = NK;
  cp.H = H;
  cp.V = c.vocab_size;
  cp.chunk_rows = 8192;
  cp.grad_scale = grad_scale;
  float* d_hf = d_hf_.as<float>();
  cross_entropy_fused_cuda(ctx_, d_hf, lse_ce_.as<float>(), argmax_.as<int32_t>(), nullptr,
                           sums_.as<double>(), hf, head_, in.labels, in.weights, cp);

  // ---- backward
  float* dh = dh_.as<float>();
  float* dtmp = dtmp_.as<float>();
  uint16_t* dh_bf = dh_bf_.as<uint16_t>();
  rmsnorm_bwd_cuda(ctx_, dh, gf(layout_.norm), d_hf, h, pf(layout_.norm), NK, H, eps);
  float* dctx = dctx_.as<float>();
  float* dx = dx_.as<float>();
  for (int64_t l = c.num_layers - 1; l >= 0; --l) {
    LayerBuf& a = layers_[static_cast<size_t>(l)];
    const DrafterLayerOffsets& L = layout_.layers[static_cast<size_t>(l)];
    const float* x_in = l == 0 ? h0_.as<float>() : layers_[static_cast<size_t>(l - 1)].h_out.as<float>();
    uint16_t* kvin = a.kvin.as<uint16_t>();
    const uint16_t* hn = kvin + T * H;
    // MLP: h_out = h_mid + down(act).
    cast_cuda(ctx_, dh_bf, dh, NK * H);
    uint16_t* d_act = d_act_.as<uint16_t>();
    linear_bwd_cuda(ctx_, d_act, gf(L.down_proj), dh_bf, a.act.as<uint16_t>(), wb(L.down_proj), NK,
                    I, H);
    uint16_t* d_gu = d_gu_.as<uint16_t>();
    const uint16_t* gu = a.gu.as<uint16_t>();
    swiglu_bwd_cuda(ctx_, d_gu, d_gu + I, d_act, gu, gu + I, NK, I, 2 * I);
    float* dhn2 = dhn2_.as<float>();
    // gate and up are adjacent in the layout: one [2I, H] linear.
    linear_bwd_cuda(ctx_, dhn2, gf(L.gate_proj), d_gu, a.hn2.as<uint16_t>(), wb(L.gate_proj), NK, H,
                    2 * I);
    rmsnorm_bwd_cuda(ctx_, dtmp, gf(L.post_attention_layernorm), dhn2, a.h_mid.as<float>(),
                     pf(L.post_attention_layernorm), NK, H, eps);
    residual_accumulate_cuda(ctx_, dh, dtmp, NK * H);  // dh = d(h_mid)
    // Attention: h_mid = x_in + o_proj(o).
    cast_cuda(ctx_, dh_bf, dh, NK * H);
    uint16_t* d_o = d_o_.as<uint16_t>();
    linear_bwd_cuda(ctx_, d_o, gf(L.o_proj), dh_bf, a.o.as<uint16_t>(), wb(L.o_proj), NK, QD, H);
    uint16_t *dq = dq_.as<uint16_t>(), *dk = dk_.as<uint16_t>(), *dv = dv_.as<uint16_t>();
    attention_bwd_cuda(ctx_, dq, dk, dv, d_o, a.q.as<uint16_t>(), a.k.as<uint16_t>(),
                       a.v.as<uint16_t>(), a.o.as<uint16_t>(), a.lse.as<float>(), in.ranges, ap);
    // q path: rope -> q_norm -> q_proj.
    rope_bwd_cuda(ctx_, dq, dq, pos_q, inv_freq, rope_scaling_, NK, NH, D);
    uint16_t* dq_raw = dq_raw_.as<uint16_t>();
    rmsnorm_bwd_cuda(ctx_, dq_raw, gf(L.q_norm), dq, a.q_raw.as<uint16_t>(), pf(L.q_norm), NK * NH,
                     D, eps);
    // k path over all rows [ctx ; block].
    rope_bwd_cuda(ctx_, dk, dk, in.pos, inv_freq, rope_scaling_, TK, NKV, D);
    uint16_t* dk_raw = dk_raw_.as<uint16_t>();
    rmsnorm_bwd_cuda(ctx_, dk_raw, gf(L.k_norm), dk, a.k_raw.as<uint16_t>(), pf(L.k_norm), TK * NKV,
                     D, eps);
    // dX[TK, H] = dk_raw·Wk + dv·Wv, then rows [T, TK) += dq_raw·Wq; weight gradients.
    mm_dyw(ctx_, dx, DType::f32, dk_raw, wb(L.k_proj), TK, KD, H, 0.0f);
    mm_dyw(ctx_, dx, DType::f32, dv, wb(L.v_proj), TK, KD, H, 1.0f);
    mm_dyw(ctx_, dx + T * H, DType::f32, dq_raw, wb(L.q_proj), NK, QD, H, 1.0f);
    mm_dw(ctx_, gf(L.k_proj), dk_raw, kvin, TK, KD, H);
    mm_dw(ctx_, gf(L.v_proj), dv, kvin, TK, KD, H);
    mm_dw(ctx_, gf(L.q_proj), dq_raw, hn, NK, QD, H);
    // input_layernorm of the block rows; ctx rows enter every layer unnormed.
    rmsnorm_bwd_cuda(ctx_, dtmp, gf(L.input_layernorm), dx + T * H, x_in, pf(L.input_layernorm), NK,
                     H, eps);
    residual_accumulate_cuda(ctx_, dh, dtmp, NK * H);  // dh = d(x_in)
    if (l == c.num_layers - 1) {
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(dctx, dx, static_cast<size_t>(T * H) * kF,
                                        cudaMemcpyDeviceToDevice, s));
    } else {
      residual_accumulate_cuda(ctx_, dctx, dx, T * H);
    }
  }
  // ctx = hidden_norm(fc(features)); the features are frozen.
  float* dctx_pre = dctx_pre_.as<float>();
  rmsnorm_bwd_cuda(ctx_, dctx_pre, gf(layout_.hidden_norm), dctx, ctx_pre, pf(layout_.hidden_norm),
                   T, H, eps);
  uint16_t* dctx_bf = dctx_bf_.as<uint16_t>();
  cast_cuda(ctx_, dctx_bf, dctx_pre, T * H);
  mm_dw(ctx_, gf(layout_.fc), dctx_bf, in.features, T, H, F);

  grad_sumsq_cuda(ctx_, sumsq_.as<double>(), segs_.as<AdamWSegment>(), 1);
}

DrafterCuda::Results DrafterCuda::fetch_results(int64_t NK) {
  DFLASH_CHECK(NK >= 0 && NK <= max_rows_, "DrafterCuda::fetch_results: {} rows", NK);
  Results r;
  double sums[2] = {0, 0}, sumsq = 0;
  r.argmax.resize(static_cast<size_t>(NK));
  cudaStream_t s = ctx_.stream();
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(sums, sums_.data(), sizeof sums, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(&sumsq, sumsq_.data(), sizeof sumsq, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(r.argmax.data(), argmax_.data(),
                                    static_cast<size_t>(NK) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, s));
  ctx_.synchronize();
  r.loss_sum = sums[0];
  r.weight_sum = sums[1];
  r.grad_norm = std::sqrt(sumsq);
  return r;
}

double DrafterCuda::grad_norm() {
  grad_sumsq_cuda(ctx_, sumsq_.as<double>(), segs_.as<AdamWSegment>(), 1);
  double sumsq = 0;
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(&sumsq, sumsq_.data(), sizeof sumsq, cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
  return std::sqrt(sumsq);
}

void DrafterCuda::adamw(const AdamWConfig& cfg, double lr, int64_t step, double grad_scale) {
  const float gs = static_cast<float>(grad_scale);
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(clip_.data(), &gs, sizeof gs, cudaMemcpyHostToDevice, ctx_.stream()));
  adamw_step_cuda(ctx_, segs_.as<AdamWSegment>(), 1, layout_.total, cfg, lr, step,
                  clip_.as<float>(), nullptr);
  cast_cuda(ctx_, wbf_.as<uint16_t>(), params_.as<float>(), layout_.total);
  // `gs` lives on this stack frame: the copy must finish before returning.
  ctx_.synchronize();
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
