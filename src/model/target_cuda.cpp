// dflash.cpp — TargetCuda (see target_cuda.hpp): weight upload and the tap forward on the GPU.
#include "model/target_cuda.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>

#include "backend/cuda/check.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "model/step_plan.hpp"
#include "ops/cast.hpp"
#include "ops/decode_fused.hpp"
#include "ops/embedding.hpp"
#include "ops/fill.hpp"
#include "ops/linear.hpp"
#include "ops/moe.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

// Enqueues dst[0, n) = the bf16 bits of `t` (as stored when bf16, rounded to nearest even
// otherwise). `n` is what the plan reserved at dst; a tensor of another size is an error naming it.
void upload_bf16(cuda::PinnedUploader& up, uint16_t* dst, int64_t n, const Tensor& t,
                 const std::string& name) {
  DFLASH_CHECK(t.numel() == n, "TargetCuda: weight '{}' has {} elements, the plan {}", name,
               t.numel(), n);
  const auto count = static_cast<size_t>(n);
  if (t.dtype() == DType::bf16 && t.is_contiguous()) {
    up.upload(dst, t.raw(), count * sizeof(uint16_t));
    return;
  }
  const std::vector<float> f = t.to_f32_vector();
  up.upload(dst, count * sizeof(uint16_t), [&f](void* out, size_t off, size_t bytes) {
    auto* o = static_cast<uint16_t*>(out);
    const size_t first = off / sizeof(uint16_t);
    for (size_t i = 0; i < bytes / sizeof(uint16_t); ++i) o[i] = f32_to_bf16_bits(f[first + i]);
  });
}

// Enqueues dst[0, n) = v (f32); a vector of another size is an error naming it.
void upload_f32(cuda::PinnedUploader& up, float* dst, int64_t n, const std::vector<float>& v,
                const std::string& name) {
  DFLASH_CHECK(static_cast<int64_t>(v.size()) == n,
               "TargetCuda: weight '{}' has {} elements, the plan {}", name, v.size(), n);
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
  check_all_taken();
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
  check_all_taken();
}

cuda::DeviceArena& TargetCuda::setup(int64_t n_layers, cuda::DeviceArena* arena) {
  const ModelConfig& c = cfg_;
  DFLASH_CHECK(max_tokens_ > 0, "TargetCuda: max_tokens must be > 0 (got {})", max_tokens_);
  DFLASH_CHECK(n_layers >= 0 && n_layers <= c.num_hidden_layers,
               "TargetCuda: {} layers requested of the target's {}", n_layers, c.num_hidden_layers);
  if (n_layers == 0) n_layers = c.num_hidden_layers;
  const std::vector<std::string> unsupported = cuda_target_unsupported(c);
  DFLASH_CHECK(unsupported.empty(), "{}", fmt::join(unsupported, "; "));
  DFLASH_CHECK(static_cast<int64_t>(c.moe_layers.size()) == c.num_hidden_layers &&
                   static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers,
               "TargetCuda: config {} lists {} moe_layers and {} layer_types for {} layers",
               c.source, c.moe_layers.size(), c.layer_types.size(), c.num_hidden_layers);
  if (!arena) {
    ArenaPlanner p(step_phase_names());
    plan_target_weights(p, c, n_layers);
    plan_target_activations(p, c, n_layers, max_tokens_);
    own_arena_ = std::make_unique<cuda::DeviceArena>(ctx_, p.finish());
    arena = own_arena_.get();
  }
  layers_.resize(static_cast<size_t>(n_layers));
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l].sliding = c.layer_types[l] == LayerType::sliding_attention;
    layers_[l].is_moe = c.moe_layers[l];
  }
  return *arena;
}

// Buffer names and sizes as plan_target_weights (model/step_plan.cpp).
void TargetCuda::take_weights(cuda::DeviceArena& arena) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, QD = NH * D, KD = c.num_key_value_heads * D;
  const int64_t E = c.num_experts, EI = c.expert_width;
  embed_ = arena.get<uint16_t>("target.embed", V * H);
  if (!tied_) head_ = arena.get<uint16_t>("target.lm_head", V * H);
  inv_freq_ = arena.get<float>("target.inv_freq", D / 2);
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& d = layers_[l];
    const std::string n = fmt::format("target.layers.{}.", l);
    d.wqkv = arena.get<uint16_t>(n + "wqkv", (QD + 2 * KD) * H);
    d.wq = d.wqkv;
    d.wk = d.wq + QD * H;
    d.wv = d.wk + KD * H;
    d.wo = arena.get<uint16_t>(n + "wo", H * QD);
    if (c.attention_bias) {
      d.bqkv = arena.get<float>(n + "bqkv", QD + 2 * KD);
      d.bq = d.bqkv;
      d.bk = d.bq + QD;
      d.bv = d.bk + KD;
    }
    if (c.o_proj_bias) d.bo = arena.get<float>(n + "bo", H);
    d.in_norm = arena.get<float>(n + "in_norm", H);
    d.post_norm = arena.get<float>(n + "post_norm", H);
    if (c.qk_norm) {
      d.q_norm = arena.get<float>(n + "q_norm", D);
      d.k_norm = arena.get<float>(n + "k_norm", D);
    }
    if (c.attention_sinks) d.sinks = arena.get<float>(n + "sinks", NH);
    if (!d.is_moe) {
      d.wgu = arena.get<uint16_t>(n + "wgu", 2 * I * H);
      d.wdown = arena.get<uint16_t>(n + "wdown", H * I);
      if (c.mlp_bias) {
        d.bgu = arena.get<float>(n + "bgu", 2 * I);
        d.bdown = arena.get<float>(n + "bdown", H);
      }
      continue;
    }
    Moe& m = d.moe;
    m.router = arena.get<uint16_t>(n + "moe.router", E * H);
    if (c.router_bias) m.router_bias = arena.get<float>(n + "moe.router_bias", E);
    m.wgu = arena.get<uint16_t>(n + "moe.wgu", E * 2 * EI * H);
    m.wdown = arena.get<uint16_t>(n + "moe.wdown", E * H * EI);
    m.gu_ptrs = arena.get<const uint16_t*>(n + "moe.gu_ptrs", E);
    m.down_ptrs = arena.get<const uint16_t*>(n + "moe.down_ptrs", E);
    if (c.expert_bias) {
      m.gate_bias = arena.get<float>(n + "moe.gate_bias", E * EI);
      m.up_bias = arena.get<float>(n + "moe.up_bias", E * EI);
      m.down_bias = arena.get<float>(n + "moe.down_bias", E * H);
    }
  }
}

// Buffer names and sizes as plan_target_activations (model/step_plan.cpp).
void TargetCuda::take_activations(cuda::DeviceArena& arena) {
  const ModelConfig& c = cfg_;
  const int64_t T = max_tokens_, H = c.hidden_size, I = c.intermediate_size;
  const int64_t QD = c.num_attention_heads * c.head_dim, KD = c.num_key_value_heads * c.head_dim;
  const TargetLayerMix mix = target_layer_mix(c, num_layers());
  x_ = arena.get<float>("target.act.x", T * H);
  hn_ = arena.get<uint16_t>("target.act.hn", T * H);
  qkv_ = arena.get<uint16_t>("target.act.qkv", T * (QD + 2 * KD));
  q_ = arena.get<uint16_t>("target.act.q", T * QD);
  k_ = arena.get<uint16_t>("target.act.k", T * KD);
  v_ = arena.get<uint16_t>("target.act.v", T * KD);
  o_ = arena.get<uint16_t>("target.act.o", T * QD);
  if (mix.dense) {
    gu_ = arena.get<uint16_t>("target.act.gu", T * 2 * I);
    act_ = arena.get<uint16_t>("target.act.act", T * I);
  }
  tap_ = arena.get<uint16_t>("target.act.tap", T * H);
  if (mix.sliding) win_ = arena.get<AttnRange>("target.act.win", T);
  if (mix.moe) {
    const int64_t E = c.num_experts, EI = c.expert_width, R = T * c.num_experts_per_tok;
    mw_.logits = arena.get<float>("target.act.moe.logits", T * E);
    mw_.ids = arena.get<int32_t>("target.act.moe.ids", R);
    mw_.weights = arena.get<float>("target.act.moe.weights", R);
    mw_.perm = arena.get<int32_t>("target.act.moe.perm", R);
    mw_.slot = arena.get<int32_t>("target.act.moe.slot", R);
    mw_.row_expert = arena.get<int32_t>("target.act.moe.row_expert", R);
    mw_.offsets = arena.get<int32_t>("target.act.moe.offsets", E + 1);
    mw_.xs = arena.get<uint16_t>("target.act.moe.xs", R * H);
    mw_.gu = arena.get<uint16_t>("target.act.moe.gu", R * 2 * EI);
    mw_.act = arena.get<uint16_t>("target.act.moe.act", R * EI);
    mw_.ys = arena.get<float>("target.act.moe.ys", R * H);
  }
}

void TargetCuda::check_all_taken() const {
  if (!own_arena_) return;  // a shared arena is checked by its owner once every class took its own
  const std::vector<std::string> unused = own_arena_->untaken();
  DFLASH_CHECK(unused.empty(),
               "TargetCuda: {} planned buffers are not used (e.g. '{}'): plan_target_* and "
               "TargetCuda disagree",
               unused.size(), unused.empty() ? "" : unused.front());
}

void TargetCuda::upload_expert_pointers(cuda::PinnedUploader& up) {
  const int64_t E = cfg_.num_experts, EI = cfg_.expert_width, H = cfg_.hidden_size;
  for (const Layer& d : layers_) {
    if (!d.is_moe) continue;
    std::vector<const uint16_t*> gp, dp;
    for (int64_t e = 0; e < E; ++e) {
      gp.push_back(d.moe.wgu + e * 2 * EI * H);
      dp.push_back(d.moe.wdown + e * H * EI);
    }
    // The uploader copies the host bytes into its staging buffers before it returns.
    up.upload(d.moe.gu_ptrs, gp.data(), gp.size() * sizeof(gp[0]));
    up.upload(d.moe.down_ptrs, dp.data(), dp.size() * sizeof(dp[0]));
  }
}

// The one place where checkpoint weights go to the device (into the pointers of take_weights).
void TargetCuda::upload_weights(const TargetModel& model) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, QD = NH * D, KD = c.num_key_value_heads * D;
  const int64_t E = c.num_experts, EI = c.expert_width;
  DFLASH_CHECK(static_cast<int64_t>(model.layers().size()) >= num_layers(),
               "TargetCuda: the model has {} layers, {} to upload", model.layers().size(),
               num_layers());
  const auto t0 = Clock::now();
  cuda::PinnedUploader up(ctx_);
  upload_bf16(up, embed_, V * H, model.embed_tokens(), "model.embed_tokens.weight");
  if (!tied_) upload_bf16(up, head_, V * H, model.lm_head(), "lm_head.weight");
  upload_f32(up, inv_freq_, D / 2, model.inv_freq(), "inv_freq");
  for (size_t l = 0; l < layers_.size(); ++l) {
    const TargetLayer& L = model.layers()[l];
    const Layer& d = layers_[l];
    DFLASH_CHECK(L.is_moe == d.is_moe && L.sliding == d.sliding,
                 "TargetCuda: layer {} of the model and of its config disagree on MoE/sliding", l);
    const std::string a = fmt::format("model.layers.{}.self_attn.", l);
    const std::string p = fmt::format("model.layers.{}.", l), f = p + "mlp.";
    upload_bf16(up, d.wq, QD * H, L.wq, a + "q_proj.weight");
    upload_bf16(up, d.wk, KD * H, L.wk, a + "k_proj.weight");
    upload_bf16(up, d.wv, KD * H, L.wv, a + "v_proj.weight");
    upload_bf16(up, d.wo, H * QD, L.wo, a + "o_proj.weight");
    if (d.bq) {
      upload_f32(up, d.bq, QD, L.bq, a + "q_proj.bias");
      upload_f32(up, d.bk, KD, L.bk, a + "k_proj.bias");
      upload_f32(up, d.bv, KD, L.bv, a + "v_proj.bias");
    }
    if (d.bo) upload_f32(up, d.bo, H, L.bo, a + "o_proj.bias");
    upload_f32(up, d.in_norm, H, L.input_norm, p + "input_layernorm.weight");
    upload_f32(up, d.post_norm, H, L.post_norm, p + "post_attention_layernorm.weight");
    if (d.q_norm) {
      upload_f32(up, d.q_norm, D, L.q_norm, a + "q_norm.weight");
      upload_f32(up, d.k_norm, D, L.k_norm, a + "k_norm.weight");
    }
    if (d.sinks) upload_f32(up, d.sinks, NH, L.sinks, a + "sinks");
    if (!d.is_moe) {
      // rows [0, I): gate; rows [I, 2I): up
      upload_bf16(up, d.wgu, I * H, L.wgate, f + "gate_proj.weight");
      upload_bf16(up, d.wgu + I * H, I * H, L.wup, f + "up_proj.weight");
      upload_bf16(up, d.wdown, H * I, L.wdown, f + "down_proj.weight");
      if (d.bgu) {
        upload_f32(up, d.bgu, I, L.bgate, f + "gate_proj.bias");
        upload_f32(up, d.bgu + I, I, L.bup, f + "up_proj.bias");
        upload_f32(up, d.bdown, H, L.bdown, f + "down_proj.bias");
      }
      continue;
    }
    // Experts stacked: expert e's [gate; up] rows at e·2·EI·H, its down matrix at e·H·EI.
    const TargetMoe& m = L.moe;
    const Moe& g = d.moe;
    DFLASH_CHECK(static_cast<int64_t>(m.gate.size()) == E &&
                     static_cast<int64_t>(m.up.size()) == E &&
                     static_cast<int64_t>(m.down.size()) == E,
                 "TargetCuda: layer {} holds {}/{}/{} expert gate/up/down matrices, the config {}",
                 l, m.gate.size(), m.up.size(), m.down.size(), E);
    // Checkpoint names: Qwen3-MoE per-expert modules, gpt-oss stacked tensors (expert e of them).
    const bool qwen = c.arch == Arch::qwen3_moe;
    auto expert = [&](int64_t e, const char* proj, const char* half) {
      return qwen ? fmt::format("{}experts.{}.{}_proj.weight", f, e, proj)
                  : fmt::format("{}experts.{}_proj[{}] ({})", f,
                                half[0] == 'd' ? "down" : "gate_up", e, half);
    };
    upload_bf16(up, g.router, E * H, m.router, f + (qwen ? "gate.weight" : "router.weight"));
    if (g.router_bias) upload_f32(up, g.router_bias, E, m.router_bias, f + "router.bias");
    for (int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<size_t>(e);
      upload_bf16(up, g.wgu + e * 2 * EI * H, EI * H, m.gate[i], expert(e, "gate", "gate"));
      upload_bf16(up, g.wgu + (e * 2 + 1) * EI * H, EI * H, m.up[i], expert(e, "up", "up"));
      upload_bf16(up, g.wdown + e * H * EI, H * EI, m.down[i], expert(e, "down", "down"));
    }
    if (g.gate_bias) {
      upload_f32(up, g.gate_bias, E * EI, m.gate_bias, f + "experts.gate_up_proj_bias (gate)");
      upload_f32(up, g.up_bias, E * EI, m.up_bias, f + "experts.gate_up_proj_bias (up)");
      upload_f32(up, g.down_bias, E * H, m.down_bias, f + "experts.down_proj_bias");
    }
  }
  upload_expert_pointers(up);
  up.finish();
  upload_bytes_ = up.bytes();
  upload_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
}

void TargetCuda::random_weights(uint64_t seed) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, QD = NH * D, KD = c.num_key_value_heads * D;
  const int64_t E = c.num_experts, EI = c.expert_width;
  const float bound = 0.02f * std::sqrt(3.0f);  // standard deviation 0.02
  uint64_t stream = seed;
  uint64_t filled = 0;  // bytes filled on the device
  auto matrix = [&](uint16_t* w, int64_t n) {
    fill_uniform_cuda(ctx_, w, n, 0.0f, bound, ++stream);
    filled += static_cast<uint64_t>(n) * 2;
  };
  auto constant = [&](float* w, int64_t n, float v) {
    if (!w) return;  // a tensor the architecture lacks (checked against the plan below)
    fill_uniform_cuda(ctx_, w, n, v, 0.0f, ++stream);
    filled += static_cast<uint64_t>(n) * 4;
  };
  matrix(embed_, V * H);
  if (!tied_) matrix(head_, V * H);
  const std::vector<double> f = rope_inv_freq(rope_params_from_config(c), D);
  const std::vector<float> ff(f.begin(), f.end());
  cuda::PinnedUploader up(ctx_);
  up.upload(inv_freq_, ff.data(), ff.size() * sizeof(float));
  for (const Layer& d : layers_) {
    matrix(d.wq, QD * H);
    matrix(d.wk, KD * H);
    matrix(d.wv, KD * H);
    matrix(d.wo, H * QD);
    constant(d.bq, QD, 0.0f);
    constant(d.bk, KD, 0.0f);
    constant(d.bv, KD, 0.0f);
    constant(d.bo, H, 0.0f);
    constant(d.in_norm, H, 1.0f);
    constant(d.post_norm, H, 1.0f);
    constant(d.q_norm, D, 1.0f);
    constant(d.k_norm, D, 1.0f);
    constant(d.sinks, NH, 0.0f);
    if (!d.is_moe) {
      matrix(d.wgu, 2 * I * H);
      matrix(d.wdown, H * I);
      constant(d.bgu, 2 * I, 0.0f);
      constant(d.bdown, H, 0.0f);
      continue;
    }
    const Moe& m = d.moe;
    matrix(m.router, E * H);
    constant(m.router_bias, E, 0.0f);
    matrix(m.wgu, E * 2 * EI * H);
    matrix(m.wdown, E * H * EI);
    constant(m.gate_bias, E * EI, 0.0f);
    constant(m.up_bias, E * EI, 0.0f);
    constant(m.down_bias, E * H, 0.0f);
  }
  upload_expert_pointers(up);
  up.finish();
  // Every planned weight byte was written (inv_freq and the expert pointers by the uploader): a
  // tensor of the plan left out above would keep whatever the arena held.
  ArenaPlanner plan(step_phase_names());
  plan_target_weights(plan, c, num_layers());
  uint64_t planned = 0;
  for (const PlanBuffer& b : plan.finish().buffers) planned += b.bytes;
  DFLASH_CHECK(filled + up.bytes() == planned,
               "TargetCuda: the random weights of {} ({} layers) fill {} bytes of the {} planned "
               "(a planned tensor has no random fill)",
               c.source, num_layers(), filled + up.bytes(), planned);
}

void TargetCuda::moe_forward(const Moe& m, float* x, const uint16_t* hn, int64_t T) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t EI = c.expert_width, R = T * K;
  // Router logits in fp32 from the bf16 normed input (HF: F.linear(x, W, b)).
  linear_fwd_cuda(ctx_, mw_.logits, hn, m.router, m.router_bias, T, H, E);
  moe_route_cuda(ctx_, mw_.ids, mw_.weights, mw_.logits, T, E,
                 MoeRouting{c.routing, K, c.norm_topk_prob});
  moe_dispatch_cuda(ctx_, mw_.perm, mw_.slot, mw_.offsets, mw_.row_expert, mw_.ids, T, K, E);
  moe_gather_cuda(ctx_, mw_.xs, hn, mw_.perm, R, K, H);
  uint16_t* gu = mw_.gu;
  moe_grouped_linear_cuda(ctx_, gu, 2 * EI, mw_.xs, m.gu_ptrs, mw_.offsets, E, R, H, 2 * EI);
  const MoeGlu glu{c.expert_activation, static_cast<float>(c.swiglu_alpha),
                   static_cast<float>(c.swiglu_limit)};
  moe_glu_cuda(ctx_, mw_.act, gu, gu + EI, 2 * EI, m.gate_bias, m.up_bias, mw_.row_expert, R, EI,
               glu);
  moe_grouped_linear_cuda(ctx_, mw_.ys, H, mw_.act, m.down_ptrs, mw_.offsets, E, R, EI, H);
  moe_combine_cuda(ctx_, x, mw_.ys, m.down_bias, mw_.ids, mw_.weights, mw_.slot, T, K, H);
}

void TargetCuda::forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                              const AttnRange* ranges, int64_t T, std::span<const int> layer_ids) {
  DFLASH_CHECK(T > 0 && T <= max_tokens_,
               "TargetCuda::forward_taps: {} tokens for a workspace of {}", T, max_tokens_);
  DFLASH_CHECK(!layer_ids.empty(), "TargetCuda::forward_taps: no tap layers");
  int64_t n_run = 0;
  for (int l : layer_ids) {
    DFLASH_CHECK(l >= 0 && l < num_layers(),
                 "tap layer {} is outside the uploaded target layers [0, {})", l, num_layers());
    n_run = std::max<int64_t>(n_run, l + 1);
  }
  run_layers(taps, tokens, pos, ranges, T, T, layer_ids, n_run, nullptr, nullptr, nullptr);
}

void TargetCuda::forward_taps_final(uint16_t* taps, uint16_t* final_out, const float* final_norm,
                                    const int32_t* tokens, const int32_t* pos,
                                    const AttnRange* ranges, int64_t T,
                                    std::span<const int> layer_ids) {
  DFLASH_CHECK(T > 0 && T <= max_tokens_,
               "TargetCuda::forward_taps_final: {} tokens for a workspace of {}", T, max_tokens_);
  DFLASH_CHECK(!layer_ids.empty(), "TargetCuda::forward_taps_final: no tap layers");
  DFLASH_CHECK(num_layers() == cfg_.num_hidden_layers,
               "TargetCuda::forward_taps_final: {} of the target's {} layers were uploaded (the "
               "final norm needs all)",
               num_layers(), cfg_.num_hidden_layers);
  DFLASH_CHECK(taps && final_out && final_norm, "TargetCuda::forward_taps_final: null pointer");
  for (int l : layer_ids) {
    DFLASH_CHECK(l >= 0 && l < num_layers(),
                 "tap layer {} is outside the uploaded target layers [0, {})", l, num_layers());
  }
  run_layers(taps, tokens, pos, ranges, T, T, layer_ids, num_layers(), nullptr, nullptr, nullptr);
  rmsnorm_fwd_cuda(ctx_, final_out, static_cast<float*>(nullptr), x_, final_norm, T,
                   cfg_.hidden_size, cfg_.rms_norm_eps);
}

void TargetCuda::forward_cached(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                                const int32_t* slots, const AttnRange* ranges, int64_t T,
                                int64_t gemm_rows, std::span<const int> layer_ids,
                                const TargetCacheCuda& cache, const DecodeStepWork* split) {
  DFLASH_CHECK(T > 0 && T <= gemm_rows && gemm_rows <= max_tokens_,
               "TargetCuda::forward_cached: {} tokens ({} GEMM rows) for a workspace of {}", T,
               gemm_rows, max_tokens_);
  DFLASH_CHECK(num_layers() == cfg_.num_hidden_layers,
               "TargetCuda::forward_cached: {} of the target's {} layers were uploaded (decoding "
               "runs them all)",
               num_layers(), cfg_.num_hidden_layers);
  DFLASH_CHECK(static_cast<int64_t>(cache.k.size()) == num_layers() &&
                   static_cast<int64_t>(cache.v.size()) == num_layers() && cache.rows > 0,
               "TargetCuda::forward_cached: a cache of {}/{} layers and {} rows for {} layers",
               cache.k.size(), cache.v.size(), cache.rows, num_layers());
  DFLASH_CHECK(slots, "TargetCuda::forward_cached: null slots");
  for (int l : layer_ids)
    DFLASH_CHECK(l >= 0 && l < num_layers(), "tap layer {} is outside the target layers [0, {})", l,
                 num_layers());
  DFLASH_CHECK(layer_ids.empty() || taps, "TargetCuda::forward_cached: taps asked, no buffer");
  DFLASH_CHECK(!split || (split->attn_part && split->rows >= T && split->max_keys >= 1),
               "TargetCuda::forward_cached: a split-attention workspace of {} rows for {} tokens",
               split ? split->rows : 0, T);
  run_layers(taps, tokens, pos, ranges, T, gemm_rows, layer_ids, num_layers(), &cache, slots,
             split);
}

void TargetCuda::use_cudnn_prefill() {
  const ModelConfig& c = cfg_;
  for (const Layer& L : layers_)
    DFLASH_CHECK(!L.sinks,
                 "TargetCuda::use_cudnn_prefill: the target has attention sinks "
                 "(attention_sinks); the cuDNN causal graph has none");
  for (const Layer& L : layers_)
    DFLASH_CHECK(!L.sliding,
                 "TargetCuda::use_cudnn_prefill: the target has sliding-window layers "
                 "(layer_types, sliding_window {}); the cuDNN causal graph has no window",
                 c.sliding_window);
  if (!cudnn_handle_) cudnn_handle_ = std::make_shared<CudnnHandle>(ctx_);
}

void TargetCuda::use_cudnn_prefill(int64_t max_docs, int64_t max_doc_len) {
  use_cudnn_prefill();
  cudnn_prefill_select(max_docs, max_doc_len);
}

int64_t TargetCuda::cudnn_prefill_bucket(int64_t n_docs) {
  DFLASH_CHECK(n_docs >= 1, "TargetCuda::cudnn_prefill_bucket: {} documents", n_docs);
  return static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(n_docs)));
}

void TargetCuda::cudnn_prefill_select(int64_t slots, int64_t max_doc_len) {
  DFLASH_CHECK(cudnn_handle_,
               "TargetCuda::cudnn_prefill_select: the cuDNN prefill is off (use_cudnn_prefill)");
  std::unique_ptr<CudnnCausalPrefill>& g = cudnn_graphs_[{slots, max_doc_len}];
  if (!g) {
    const ModelConfig& c = cfg_;
    try {
      g = std::make_unique<CudnnCausalPrefill>(
          ctx_,
          CudnnPrefillShape{slots, max_doc_len, c.num_attention_heads, c.num_key_value_heads,
                            c.head_dim, 1.0 / std::sqrt(static_cast<double>(c.head_dim))},
          cudnn_handle_);
    } catch (...) {
      cudnn_graphs_.erase({slots, max_doc_len});
      throw;
    }
  }
  cudnn_ = g.get();
}

int64_t TargetCuda::cudnn_prefill_bytes() const {
  int64_t bytes = 0;
  for (const auto& [shape, g] : cudnn_graphs_) bytes += g->workspace_bytes() + g->index_bytes();
  return bytes;
}

void TargetCuda::run_layers(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                            const AttnRange* ranges, int64_t T, int64_t Tg,
                            std::span<const int> layer_ids, int64_t n_run,
                            const TargetCacheCuda* cache, const int32_t* slots,
                            const DecodeStepWork* split) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  const int64_t QD = NH * D, KD = NKV * D, n_taps = static_cast<int64_t>(layer_ids.size());
  const double eps = c.rms_norm_eps;
  float* x = x_;
  uint16_t *hn = hn_, *qkv = qkv_, *q = q_, *k = k_, *v = v_, *o = o_, *gu = gu_, *act = act_;
  uint16_t* tap = tap_;
  AttnParams ap{T, T, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  // Sliding layers see the last `sliding_window` keys of each causal range (HF
  // sliding_window_overlay), derived on the device once per forward.
  if (win_) attention_window_ranges_cuda(ctx_, win_, ranges, T, c.sliding_window);
  // The prefill on cuDNN (use_cudnn_prefill): the documents of `ranges`, once per forward.
  const bool on_cudnn = cudnn_prefill() && !cache;
  DFLASH_CHECK(!on_cudnn || cudnn_,
               "TargetCuda: the cuDNN prefill is on but no graph was selected "
               "(cudnn_prefill_select)");
  if (on_cudnn) cudnn_->set_documents(ranges, T);
  QkvPrepare prep{T, NH, NKV, D, nullptr, nullptr, eps, pos, inv_freq_, rope_scaling_};
  // The projections: decode_linear_cuda on the T rows of a decoding step (row bits independent
  // of T), else cuBLASLt on Tg ≥ T rows (rows [T, Tg) compute garbage from whatever the
  // workspace held and are never read for rows < T: a GEMM row depends on its own input row).
  const bool row_gemm =
      split && split->row_gemm && H % 64 == 0 && QD % 64 == 0 && (I == 0 || I % 64 == 0);
  auto project = [&](uint16_t* y, const uint16_t* in, const uint16_t* w, const float* bias,
                     int64_t IN, int64_t OUT) {
    if (!row_gemm) return linear_fwd_cuda(ctx_, y, in, w, bias, Tg, IN, OUT);
    decode_linear_cuda(ctx_, y, in, w, T, IN, OUT, false);
    if (bias) bias_add_cuda(ctx_, y, bias, T, OUT);
  };
  auto project_into_x = [&](const uint16_t* in, const uint16_t* w, const float* bias, int64_t IN) {
    if (row_gemm)
      decode_linear_cuda(ctx_, x, in, w, T, IN, H, true);
    else
      linear_fwd_acc_cuda(ctx_, x, in, w, Tg, IN, H);
    if (bias) bias_add_cuda(ctx_, x, bias, T, H);
  };

  embedding_fwd_cuda(ctx_, x, embed(), tokens, T, c.vocab_size, H);
  for (int64_t l = 0; l < n_run; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const auto li = static_cast<size_t>(l);
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.in_norm, T, H, eps);
    // qkv [Tg, QD + 2·KD] = hn · [Wq; Wk; Wv]ᵀ (+ [bq; bk; bv]): one GEMM for the three.
    project(qkv, hn, L.wqkv, L.bqkv, H, QD + 2 * KD);
    // Per head: q/k RMSNorm (Qwen3), RoPE; k and v rows into the cache (decoding) or into k, v.
    prep.q_norm = L.q_norm;
    prep.k_norm = L.k_norm;
    ap.sinks = L.sinks;  // null unless gpt-oss
    const AttnRange* visible = L.sliding ? win_ : ranges;
    if (cache) {  // decoding: the rows join the cache first, then attend to it
      qkv_prepare_cuda(ctx_, q, nullptr, cache->k[li], cache->v[li], slots, qkv, prep);
      ap.Tk = cache->rows;
      if (split) {
        decode_attention_cuda(ctx_, o, q, cache->k[li], cache->v[li], visible, ap, split->attn_part,
                              split->max_keys);
      } else {
        attention_fwd_cuda(ctx_, o, nullptr, q, cache->k[li], cache->v[li], visible, ap);
      }
    } else {
      qkv_prepare_cuda(ctx_, q, nullptr, k, v, nullptr, qkv, prep);
      if (on_cudnn)
        cudnn_->forward(o, q, k, v);
      else
        attention_fwd_cuda(ctx_, o, nullptr, q, k, v, visible, ap);
    }
    // x += o · Woᵀ (+ bo) (the GEMM accumulates into the fp32 residual stream).
    project_into_x(o, L.wo, L.bo, QD);
    rmsnorm_fwd_cuda(ctx_, hn, static_cast<float*>(nullptr), x, L.post_norm, T, H, eps);
    if (L.is_moe) {
      moe_forward(L.moe, x, hn, T);
    } else {
      // row t: [gate | up] (+ [bgate | bup])
      project(gu, hn, L.wgu, L.bgu, H, 2 * I);
      swiglu_fwd_cuda(ctx_, act, gu, gu + I, T, I, 2 * I);
      project_into_x(act, L.wdown, L.bdown, I);
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
