// dflash.cpp — step buffers and FLOPs (see step_plan.hpp). The phase sets below follow the order
// of work in TargetCuda::forward_taps and DrafterCuda::forward_backward; a change there that moves
// a buffer's first write or last read must change its set here.
#include "model/step_plan.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/dflash2_head_cuda.hpp"
#include "model/dspark_head_cuda.hpp"
#include "ops/adamw.hpp"
#include "ops/attention.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/dflash2_conv.hpp"
#include "ops/moe.hpp"
#include "ops/rmsnorm.hpp"

namespace dflash {

namespace {
constexpr uint64_t kBf = 2, kF = 4;
uint64_t u(int64_t v) {
  return static_cast<uint64_t>(v);
}
// Layer l has a sparse MoE block (config.moe_layers; a config without the list is dense).
bool moe_layer(const ModelConfig& c, int64_t l) {
  const auto i = static_cast<size_t>(l);
  return i < c.moe_layers.size() && c.moe_layers[i];
}
}  // namespace

std::vector<std::string> step_phase_names() {
  return {"target",  "drafter ctx", "fwd attn", "fwd mlp",  "head",
          "bwd mlp", "bwd attn",    "bwd ctx",  "optimizer"};
}

PhaseMask step_phases(std::initializer_list<StepPhase> phases) {
  PhaseMask m = 0;
  for (StepPhase p : phases) m |= PhaseMask{1} << p;
  return m;
}

PhaseMask step_phase_range(StepPhase first, StepPhase last) {
  PhaseMask m = 0;
  for (int p = first; p <= last; ++p) m |= PhaseMask{1} << p;
  return m;
}

PhaseMask step_all_phases() {
  return step_phase_range(kPhaseTarget, kPhaseOptimizer);
}

std::vector<std::string> cuda_target_unsupported(const ModelConfig& c) {
  std::vector<std::string> out;
  if (c.head_dim != 64 && c.head_dim != 128) {
    out.push_back(fmt::format("the CUDA attention supports head_dim 64 or 128 ({}: head_dim {})",
                              c.source, c.head_dim));
  }
  if (c.is_moe()) {
    if (c.hidden_size % 8 != 0 || c.expert_width % 8 != 0) {
      out.push_back(fmt::format(
          "the CUDA expert GEMMs need hidden_size ({}) and the expert width ({}) to be multiples "
          "of 8 ({})",
          c.hidden_size, c.expert_width, c.source));
    }
    if (c.num_experts > 1024 || c.num_experts_per_tok > 32) {
      out.push_back(fmt::format(
          "the CUDA router supports up to 1024 experts and top-32 ({}: {} experts, top-{})",
          c.source, c.num_experts, c.num_experts_per_tok));
    }
  }
  return out;
}

std::vector<std::string> cuda_drafter_unsupported(const DrafterConfig& c) {
  std::vector<std::string> out;
  if (c.head_dim != 64 && c.head_dim != 128) {
    out.push_back(fmt::format("the CUDA drafter supports head_dim 64 or 128 (drafter head_dim {})",
                              c.head_dim));
  }
  for (std::string& d : dflash2_cuda_unsupported(c)) out.push_back(std::move(d));
  return out;
}

int64_t drafter_feature_cols(const DrafterConfig& c) {
  return (c.n_taps() + (c.dspark.enabled ? 1 : 0)) * c.hidden_size;
}

int64_t target_layers_for_drafter(const ModelConfig& target, const DrafterConfig& drafter) {
  const int64_t taps = target_layers_needed(target, drafter.target_layer_ids);
  return drafter.dspark.enabled ? target.num_hidden_layers : taps;
}

int64_t target_layers_needed(const ModelConfig& c, const std::vector<int>& taps) {
  DFLASH_CHECK(!taps.empty(), "no target tap layers");
  int64_t n = 0;
  for (int l : taps) {
    DFLASH_CHECK(l >= 0 && l < c.num_hidden_layers,
                 "tap layer {} is outside the target's layers [0, {})", l, c.num_hidden_layers);
    n = std::max<int64_t>(n, l + 1);
  }
  return n;
}

TargetLayerMix target_layer_mix(const ModelConfig& c, int64_t n_layers) {
  DFLASH_CHECK(n_layers >= 0 && n_layers <= c.num_hidden_layers,
               "target plan: {} layers of a target with {}", n_layers, c.num_hidden_layers);
  TargetLayerMix m;
  for (int64_t l = 0; l < n_layers; ++l) {
    const auto i = static_cast<size_t>(l);
    const bool moe = moe_layer(c, l);
    m.moe |= moe;
    m.dense |= !moe;
    m.sliding |= i < c.layer_types.size() && c.layer_types[i] == LayerType::sliding_attention;
  }
  return m;
}

uint64_t target_op_scratch_bytes(const ModelConfig& c, int64_t n_layers) {
  return target_layer_mix(c, n_layers).moe ? moe_dispatch_cuda_scratch_bytes(c.num_experts) : 0;
}

void plan_target_weights(ArenaPlanner& p, const ModelConfig& c, int64_t n_layers, PhaseMask live) {
  DFLASH_CHECK(n_layers >= 0 && n_layers <= c.num_hidden_layers,
               "target plan: {} layers of a target with {}", n_layers, c.num_hidden_layers);
  const uint64_t H = u(c.hidden_size), I = u(c.intermediate_size), D = u(c.head_dim);
  const uint64_t NH = u(c.num_attention_heads);
  const uint64_t QD = NH * D, KD = u(c.num_key_value_heads) * D;
  const uint64_t E = u(c.num_experts), EI = u(c.expert_width);
  const PhaseMask all = live;
  const char* g = kGroupTargetWeights;
  p.add("target.embed", g, u(c.vocab_size) * H * kBf, all);
  if (!c.tie_word_embeddings) p.add("target.lm_head", g, u(c.vocab_size) * H * kBf, all);
  p.add("target.inv_freq", g, D / 2 * kF, all);
  for (int64_t l = 0; l < n_layers; ++l) {
    const std::string n = fmt::format("target.layers.{}.", l);
    // [Wq; Wk; Wv] rows in one array (one q/k/v GEMM), laid out so at upload: no extra copy.
    p.add(n + "wqkv", g, (QD + 2 * KD) * H * kBf, all);
    p.add(n + "wo", g, H * QD * kBf, all);
    if (c.attention_bias) p.add(n + "bqkv", g, (QD + 2 * KD) * kF, all);
    if (c.o_proj_bias) p.add(n + "bo", g, H * kF, all);
    p.add(n + "in_norm", g, H * kF, all);
    p.add(n + "post_norm", g, H * kF, all);
    if (c.qk_norm) {
      p.add(n + "q_norm", g, D * kF, all);
      p.add(n + "k_norm", g, D * kF, all);
    }
    if (c.attention_sinks) p.add(n + "sinks", g, NH * kF, all);
    if (!moe_layer(c, l)) {
      p.add(n + "wgu", g, 2 * I * H * kBf, all);
      p.add(n + "wdown", g, H * I * kBf, all);
      if (c.mlp_bias) {
        p.add(n + "bgu", g, 2 * I * kF, all);
        p.add(n + "bdown", g, H * kF, all);
      }
      continue;
    }
    p.add(n + "moe.router", g, E * H * kBf, all);
    if (c.router_bias) p.add(n + "moe.router_bias", g, E * kF, all);
    p.add(n + "moe.wgu", g, E * 2 * EI * H * kBf, all);
    p.add(n + "moe.wdown", g, E * H * EI * kBf, all);
    p.add(n + "moe.gu_ptrs", g, E * sizeof(void*), all);
    p.add(n + "moe.down_ptrs", g, E * sizeof(void*), all);
    if (c.expert_bias) {
      p.add(n + "moe.gate_bias", g, E * EI * kF, all);
      p.add(n + "moe.up_bias", g, E * EI * kF, all);
      p.add(n + "moe.down_bias", g, E * H * kF, all);
    }
  }
}

void plan_target_activations(ArenaPlanner& p, const ModelConfig& c, int64_t n_layers,
                             int64_t max_tokens) {
  const TargetLayerMix mix = target_layer_mix(c, n_layers);
  const uint64_t T = u(max_tokens), H = u(c.hidden_size), I = u(c.intermediate_size);
  const uint64_t QD = u(c.num_attention_heads * c.head_dim);
  const uint64_t KD = u(c.num_key_value_heads * c.head_dim);
  const PhaseMask ph = step_phases({kPhaseTarget});
  const char* g = kGroupTargetActs;
  p.add("target.act.x", g, T * H * kF, ph);  // fp32 residual stream
  p.add("target.act.hn", g, T * H * kBf, ph);
  p.add("target.act.qkv", g, T * (QD + 2 * KD) * kBf, ph);  // the fused q/k/v GEMM's output
  p.add("target.act.q", g, T * QD * kBf, ph);
  p.add("target.act.k", g, T * KD * kBf, ph);
  p.add("target.act.v", g, T * KD * kBf, ph);
  p.add("target.act.o", g, T * QD * kBf, ph);
  if (mix.dense) {
    p.add("target.act.gu", g, T * 2 * I * kBf, ph);
    p.add("target.act.act", g, T * I * kBf, ph);
  }
  p.add("target.act.tap", g, T * H * kBf, ph);
  if (mix.sliding) p.add("target.act.win", g, T * sizeof(AttnRange), ph);
  if (mix.moe) {
    const uint64_t E = u(c.num_experts), EI = u(c.expert_width);
    const uint64_t R = T * u(c.num_experts_per_tok), i32 = sizeof(int32_t);
    p.add("target.act.moe.logits", g, T * E * kF, ph);
    p.add("target.act.moe.ids", g, R * i32, ph);
    p.add("target.act.moe.weights", g, R * kF, ph);
    p.add("target.act.moe.perm", g, R * i32, ph);
    p.add("target.act.moe.slot", g, R * i32, ph);
    p.add("target.act.moe.row_expert", g, R * i32, ph);
    p.add("target.act.moe.offsets", g, (E + 1) * i32, ph);
    p.add("target.act.moe.xs", g, R * H * kBf, ph);
    p.add("target.act.moe.gu", g, R * 2 * EI * kBf, ph);
    p.add("target.act.moe.act", g, R * EI * kBf, ph);
    p.add("target.act.moe.ys", g, R * H * kF, ph);
  }
}

const char* drafter_activations_name(DrafterActivations a) {
  return a == DrafterActivations::keep ? "keep" : "recompute";
}

namespace {

// DFlash2's convs around each sublayer (model/dflash2_conv.hpp, ops/dflash2_conv.hpp): per layer
// and sublayer δ [NK, 2·T·Gc] f32 and the sublayer output y [NK, H] f32 before the post-conv
// (saved); the sublayer input u [NK, H] bf16 before the pre-conv (saved with `keep`, else one per
// sublayer kind, recomputed by the norm in the backward); the backward's dy [NK, H] bf16 (the
// o_proj / down_proj GEMM input), dδ [NK, 2·T·Gc] bf16 (the kernel projection's GEMM input) and
// du [NK, H] f32.
void plan_dflash2_conv(ArenaPlanner& p, const DrafterConfig& c, const DrafterStepSizes& s) {
  const uint64_t NK = u(s.max_rows), H = u(c.hidden_size);
  const uint64_t W =
      u(2 * c.dflash2.conv_kernel_size * (c.hidden_size / c.dflash2.conv_group_size));
  const bool keep = s.activations == DrafterActivations::keep;
  const PhaseMask saved = step_phase_range(kPhaseFwdAttn, kPhaseBwdAttn);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (const char* sub : {"attn_conv", "mlp_conv"}) {
      const std::string n = fmt::format("drafter.layers.{}.{}.", l, sub);
      p.add(n + "delta", kGroupSaved, NK * W * kF, saved);
      p.add(n + "y", kGroupSaved, NK * H * kF, saved);
      if (keep) p.add(n + "u", kGroupSaved, NK * H * kBf, saved);
    }
  }
  if (!keep) {
    p.add("drafter.attn_conv.u", kGroupLayerScratch, NK * H * kBf,
          step_phases({kPhaseFwdAttn, kPhaseBwdAttn}));
    p.add("drafter.mlp_conv.u", kGroupLayerScratch, NK * H * kBf,
          step_phases({kPhaseFwdMlp, kPhaseBwdMlp}));
  }
  const PhaseMask bwd = step_phases({kPhaseBwdMlp, kPhaseBwdAttn});
  p.add("drafter.conv.dy", kGroupBackward, NK * H * kBf, bwd);
  p.add("drafter.conv.ddelta", kGroupBackward, NK * W * kBf, bwd);
  p.add("drafter.conv.du", kGroupBackward, NK * H * kF, bwd);
}

}  // namespace

void plan_drafter_step(ArenaPlanner& p, const DrafterConfig& c, const DrafterLayout& layout,
                       const DrafterStepSizes& s) {
  DFLASH_CHECK(
      s.max_ctx > 0 && s.max_rows > 0 && s.max_rows % c.block_size == 0 && s.ce_chunk_rows > 0,
      "drafter step plan: bad sizes ({} context rows, {} block rows, CE chunk {})", s.max_ctx,
      s.max_rows, s.ce_chunk_rows);
  const uint64_t P = u(layout.total), T = u(s.max_ctx), NK = u(s.max_rows), TK = T + NK;
  const uint64_t H = u(c.hidden_size), I = u(c.intermediate_size);
  const uint64_t F = u(drafter_feature_cols(c));  // the taps (and DSpark's teacher rows)
  const uint64_t QD = u(c.num_heads * c.head_dim), KD = u(c.num_kv_heads * c.head_dim);
  const uint64_t NH = u(c.num_heads);
  const PhaseMask all = step_all_phases();

  // State: every phase (the gradients from the first drafter phase on).
  p.add("drafter.params", kGroupDrafterState, P * kF, all);
  p.add("drafter.adam_m", kGroupDrafterState, P * kF, all);
  p.add("drafter.adam_v", kGroupDrafterState, P * kF, all);
  p.add("drafter.weights_bf16", kGroupDrafterState, P * kBf, all);
  p.add("drafter.segments", kGroupDrafterState, sizeof(AdamWSegment), all);
  p.add("drafter.inv_freq", kGroupDrafterState, u(c.head_dim / 2) * kF, all);
  // Results read by the host after the step (sums, squared norm, argmax) and the clip factor.
  p.add("drafter.sums", kGroupDrafterState, 2 * sizeof(double), all);
  p.add("drafter.sumsq", kGroupDrafterState, sizeof(double), all);
  p.add("drafter.clip", kGroupDrafterState, sizeof(float), all);
  p.add("drafter.argmax", kGroupDrafterState, NK * sizeof(int32_t), all);
  p.add("drafter.grads", kGroupDrafterGrads, P * kF,
        step_phase_range(kPhaseDrafterCtx, kPhaseOptimizer));

  // Step buffers.
  p.add("drafter.features", kGroupStep, T * F * kBf, step_phase_range(kPhaseTarget, kPhaseBwdCtx));
  p.add("drafter.ctx_pre", kGroupStep, T * H * kF,
        step_phase_range(kPhaseDrafterCtx, kPhaseBwdCtx));
  const bool keep = s.activations == DrafterActivations::keep;
  // [ctx ; norm(block)] rows of the k/v GEMMs: ctx rows once per step, block rows per layer (one
  // buffer for every layer, or with `keep` one per layer, its ctx rows copied from layer 0's).
  if (!keep) {
    p.add("drafter.kvin", kGroupStep, TK * H * kBf,
          step_phase_range(kPhaseDrafterCtx, kPhaseBwdAttn));
  }
  // Block embeddings (x_in of layer 0): written in ctx, read in layer 0's attention half, and
  // looked up again in its backward (kept until then with `keep`).
  p.add("drafter.h0", kGroupStep, NK * H * kF,
        keep ? step_phase_range(kPhaseDrafterCtx, kPhaseBwdAttn)
             : step_phases({kPhaseDrafterCtx, kPhaseFwdAttn, kPhaseBwdAttn}));

  const PhaseMask saved = step_phase_range(kPhaseFwdAttn, kPhaseBwdAttn);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string n = fmt::format("drafter.layers.{}.", l);
    p.add(n + "q_raw", kGroupSaved, NK * QD * kBf, saved);
    p.add(n + "k_raw", kGroupSaved, TK * KD * kBf, saved);
    p.add(n + "v", kGroupSaved, TK * KD * kBf, saved);
    p.add(n + "o", kGroupSaved, NK * QD * kBf, saved);
    p.add(n + "lse", kGroupSaved, NH * NK * kF, saved);
    p.add(n + "h_mid", kGroupSaved, NK * H * kF, saved);
    p.add(n + "gu", kGroupSaved, NK * 2 * I * kBf, saved);
    p.add(n + "h_out", kGroupSaved, NK * H * kF, saved);
    if (keep) {
      p.add(n + "kvin", kGroupSaved, TK * H * kBf,
            step_phase_range(kPhaseDrafterCtx, kPhaseBwdAttn));
      p.add(n + "q", kGroupSaved, NK * QD * kBf, saved);
      p.add(n + "k", kGroupSaved, TK * KD * kBf, saved);
      p.add(n + "hn2", kGroupSaved, NK * H * kBf, saved);
      p.add(n + "act", kGroupSaved, NK * I * kBf, saved);
    }
  }
  if (!keep) {
    // One set for all layers: written in a forward half, recomputed in the backward half.
    const PhaseMask attn = step_phases({kPhaseFwdAttn, kPhaseBwdAttn});
    const PhaseMask mlp = step_phases({kPhaseFwdMlp, kPhaseBwdMlp});
    p.add("drafter.q", kGroupLayerScratch, NK * QD * kBf, attn);
    p.add("drafter.k", kGroupLayerScratch, TK * KD * kBf, attn);
    p.add("drafter.hn2", kGroupLayerScratch, NK * H * kBf, mlp);
    p.add("drafter.act", kGroupLayerScratch, NK * I * kBf, mlp);
  }

  if (c.dflash2.enabled) plan_dflash2_conv(p, c, s);

  // Final norm and the fused CE.
  const PhaseMask head = step_phases({kPhaseHead});
  const FusedCeParams cp = drafter_ce_params(c, s.max_rows, s.ce_chunk_rows);
  p.add("drafter.hf", kGroupHead, NK * H * kBf, head);
  p.add("drafter.d_hf", kGroupHead, NK * H * kF, head);
  if (c.dspark.enabled) {
    p.add("drafter.dspark.workspace", kGroupHead,
          dspark_head_cuda_workspace_bytes(c, s.max_rows, s.ce_chunk_rows), head);
    p.add("drafter.dspark.rows", kGroupHead, dspark_head_cuda_rows_bytes(c, s.max_rows), head);
    p.add("drafter.dspark.sums", kGroupDrafterState, 6 * sizeof(double), all);
  } else if (c.domino.enabled) {
    p.add("drafter.domino.workspace", kGroupHead,
          domino_head_cuda_workspace_bytes(c, s.max_rows, s.ce_chunk_rows), head);
    p.add("drafter.domino.rows", kGroupHead, domino_head_cuda_rows_bytes(s.max_rows), head);
    p.add("drafter.domino.sums", kGroupDrafterState, 4 * sizeof(double), all);
  } else {
    p.add("drafter.ce_workspace", kGroupHead,
          cross_entropy_fused_cuda_workspace_bytes(cp, true, false), head);
  }
  if (c.dflash2.enabled) {  // the selector head (model/dflash2_head_cuda.hpp)
    p.add("drafter.dflash2.workspace", kGroupHead,
          dflash2_head_cuda_workspace_bytes(c, s.max_rows, s.ce_chunk_rows), head);
    p.add("drafter.dflash2.rows", kGroupHead, dflash2_head_cuda_rows_bytes(c, s.max_rows), head);
    p.add("drafter.dflash2.sums", kGroupDrafterState, 5 * sizeof(double), all);
  }
  // The D-PACE losses: each block row's CE, then its weight (ops/loss_weights.hpp).
  p.add("drafter.row_weights", kGroupHead, NK * kF, head);

  // Backward.
  const char* g = kGroupBackward;
  const PhaseMask bm = step_phases({kPhaseBwdMlp}), ba = step_phases({kPhaseBwdAttn});
  p.add("drafter.dh", g, NK * H * kF, step_phases({kPhaseHead, kPhaseBwdMlp, kPhaseBwdAttn}));
  // dh's bf16 copy, first written by the final norm's backward in the head phase.
  p.add("drafter.dh_bf", g, NK * H * kBf, step_phases({kPhaseHead, kPhaseBwdMlp, kPhaseBwdAttn}));
  p.add("drafter.d_act", g, NK * I * kBf, bm);
  p.add("drafter.d_gu", g, NK * 2 * I * kBf, bm);
  p.add("drafter.dhn2", g, NK * H * kF, bm);
  p.add("drafter.d_o", g, NK * QD * kBf, ba);
  p.add("drafter.dq", g, NK * QD * kBf, ba);
  p.add("drafter.dq_raw", g, NK * QD * kBf, ba);
  p.add("drafter.dk", g, TK * KD * kBf, ba);
  p.add("drafter.dk_raw", g, TK * KD * kBf, ba);
  p.add("drafter.dv", g, TK * KD * kBf, ba);
  p.add("drafter.dx", g, TK * H * kF, ba);
  p.add("drafter.dctx", g, T * H * kF, step_phase_range(kPhaseBwdMlp, kPhaseBwdCtx));
  p.add("drafter.dctx_pre", g, T * H * kF, step_phases({kPhaseBwdCtx}));
  p.add("drafter.dctx_bf", g, T * H * kBf, step_phases({kPhaseBwdCtx}));
}

void plan_op_scratch(ArenaPlanner& p, const ModelConfig& target, int64_t target_layers,
                     const DrafterConfig& c, const DrafterStepSizes& s) {
  const int64_t T = s.max_ctx, NK = s.max_rows, TK = T + NK, H = c.hidden_size, D = c.head_dim;
  uint64_t most =
      std::max(target_op_scratch_bytes(target, target_layers), grad_sumsq_cuda_scratch_bytes(1));
  // rmsnorm_bwd with a weight gradient: block-row norms (NK × H), q_norm (NK·NH × D), k_norm
  // (TK·NKV × D), hidden_norm (T × H).
  for (auto [R, W] : {std::pair{NK, H}, std::pair{NK * c.num_heads, D},
                      std::pair{TK * c.num_kv_heads, D}, std::pair{T, H}}) {
    most = std::max(most, rmsnorm_bwd_cuda_scratch_bytes(R, W, true));
  }
  const AttnParams ap{NK, TK, c.num_heads, c.num_kv_heads, D, 1.0};
  most = std::max(most, attention_bwd_cuda_scratch_bytes(ap));
  if (c.dflash2.enabled) {  // dβ's partial sums
    const Dflash2ConvShape cs{NK, c.hidden_size, c.block_size, c.dflash2.conv_kernel_size,
                              c.dflash2.conv_group_size};
    most = std::max(most, dflash2_conv_bwd_cuda_scratch_bytes(cs));
  }
  p.add("workspace.op_scratch", kGroupOpScratch, most, step_all_phases());
}

FusedCeParams drafter_ce_params(const DrafterConfig& c, int64_t rows, int64_t ce_chunk_rows) {
  FusedCeParams cp;
  cp.R = rows;
  cp.H = c.hidden_size;
  cp.V = c.vocab_size;
  cp.chunk_rows = ce_chunk_rows;
  const bool head = c.dspark.enabled || c.domino.enabled;
  cp.skip_first_of = head ? 0 : c.block_size;
  return cp;
}

DrafterFlops drafter_step_flops(const DrafterConfig& c, int64_t T, int64_t NK,
                                double visible_keys) {
  const double t = static_cast<double>(T), nk = static_cast<double>(NK), tk = t + nk;
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double F = static_cast<double>(c.n_taps()) * H, V = static_cast<double>(c.vocab_size);
  const double QD = static_cast<double>(c.num_heads * c.head_dim);
  const double KD = static_cast<double>(c.num_kv_heads * c.head_dim);
  const double layer =
      2.0 * (nk * H * QD + 2.0 * tk * H * KD + nk * QD * H + nk * H * 2.0 * I + nk * I * H);
  const double layers = layer * static_cast<double>(c.num_layers);
  const double fc = 2.0 * t * F * H;
  DrafterFlops f;
  f.fwd_gemm = fc + layers;
  // The fused CE's two GEMMs over its head rows; none where DFlash2's head computes the base.
  const auto head_rows = static_cast<double>(fused_ce_head_rows(drafter_ce_params(c, NK, 1)));
  f.head = c.dflash2.base_in_head() ? 0.0 : 2.0 * (2.0 * head_rows * H * V);
  f.bwd_gemm = fc + 2.0 * layers;  // fc: weight gradient only (the features are frozen)
  f.attn_fwd = 4.0 * static_cast<double>(c.head_dim) * static_cast<double>(c.num_heads) *
               visible_keys * static_cast<double>(c.num_layers);
  f.attn_bwd = 2.5 * f.attn_fwd;
  return f;
}

double target_forward_flops(const ModelConfig& c, int64_t n_layers, int64_t T,
                            double visible_keys) {
  DFLASH_CHECK(n_layers >= 0 && n_layers <= c.num_hidden_layers,
               "target FLOPs: {} layers of a target with {}", n_layers, c.num_hidden_layers);
  const double t = static_cast<double>(T), H = static_cast<double>(c.hidden_size);
  const double I = static_cast<double>(c.intermediate_size);
  const double QD = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double KD = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double E = static_cast<double>(c.num_experts),
               K = static_cast<double>(c.num_experts_per_tok);
  const double EI = static_cast<double>(c.expert_width);
  const double attn_gemm = 2.0 * t * (H * QD + 2.0 * H * KD + QD * H);
  const double dense_mlp = 2.0 * t * (H * 2.0 * I + I * H);
  const double moe_mlp = 2.0 * t * (H * E + K * (H * 2.0 * EI + EI * H));
  const double attn = 4.0 * static_cast<double>(c.head_dim) *
                      static_cast<double>(c.num_attention_heads) * visible_keys;
  double f = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    f += attn_gemm + attn + (moe_layer(c, l) ? moe_mlp : dense_mlp);
  }
  return f;
}

}  // namespace dflash
