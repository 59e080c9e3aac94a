#include "model/drafter.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "model/dflash2_selector.hpp"
#include "model/domino_head.hpp"
#include "model/dspark_head.hpp"
#include "ops/attention.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/embedding.hpp"
#include "ops/linear.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

// ------------------------------------------------------------------------------------------ config

void DrafterConfig::validate() const {
  DFLASH_CHECK(hidden_size > 0, "drafter hidden_size must be > 0 (got {})", hidden_size);
  DFLASH_CHECK(intermediate_size > 0, "drafter intermediate_size must be > 0 (got {})",
               intermediate_size);
  DFLASH_CHECK(num_layers > 0, "drafter num_hidden_layers must be > 0 (got {})", num_layers);
  DFLASH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
               "drafter num_attention_heads ({}) must be a positive multiple of "
               "num_key_value_heads ({})", num_heads, num_kv_heads);
  DFLASH_CHECK(head_dim > 0 && head_dim % 2 == 0, "drafter head_dim must be even and > 0 (got {})",
               head_dim);
  DFLASH_CHECK(vocab_size > 0, "drafter vocab_size must be > 0 (got {})", vocab_size);
  DFLASH_CHECK(block_size >= 2, "block_size must be >= 2 (got {})", block_size);
  DFLASH_CHECK(num_target_layers > 0, "num_target_layers must be > 0 (got {})", num_target_layers);
  DFLASH_CHECK(!target_layer_ids.empty(), "target_layer_ids must not be empty");
  for (int id : target_layer_ids) {
    DFLASH_CHECK(id >= 0 && id < num_target_layers,
                 "target_layer_ids: layer {} is outside the target's layers [0, {})", id,
                 num_target_layers);
  }
  DFLASH_CHECK(mask_token_id >= 0 && mask_token_id < vocab_size,
               "mask_token_id {} is outside the target's embedding rows [0, {})", mask_token_id,
               vocab_size);
  const Dflash2Heads& d2 = dflash2;
  if (!d2.enabled) {
    DFLASH_CHECK(d2 == Dflash2Heads{},
                 "conv_kernel_size / selector keys set on a drafter whose "
                 "architecture is not DFlash2DraftModel");
  } else {
    DFLASH_CHECK(!dspark.enabled, "a drafter cannot be both DFlash2 and DSpark");
    DFLASH_CHECK(d2.conv_kernel_size >= 1 && d2.conv_kernel_size <= block_size,
                 "conv_kernel_size {} must be in [1, block_size {}]", d2.conv_kernel_size,
                 block_size);
    DFLASH_CHECK(d2.conv_group_size >= 1 && hidden_size % d2.conv_group_size == 0,
                 "conv_group_size {} must be >= 1 and divide hidden_size {}", d2.conv_group_size,
                 hidden_size);
    DFLASH_CHECK(d2.selector_rank >= 1, "selector_rank must be >= 1 (got {})", d2.selector_rank);
    DFLASH_CHECK(d2.selector_top_k >= 1 && d2.selector_top_k <= vocab_size,
                 "selector_top_k {} must be in [1, vocab_size {}]", d2.selector_top_k, vocab_size);
    DFLASH_CHECK(std::isfinite(d2.output_multiplier) && d2.output_multiplier > 0,
                 "output_multiplier must be a finite number > 0 (got {})", d2.output_multiplier);
    DFLASH_CHECK(std::isfinite(d2.final_logit_softcapping) && d2.final_logit_softcapping >= 0,
                 "final_logit_softcapping must be a finite number >= 0 (0: none; got {})",
                 d2.final_logit_softcapping);
  }
  const DominoHead& dm = domino;
  if (dm.enabled) {
    DFLASH_CHECK(!dspark.enabled, "a drafter cannot have both the DSpark and the Domino head "
                                  "(projector_type is dspark or domino)");
    DFLASH_CHECK(!dflash2.enabled, "a drafter cannot be both DFlash2 and Domino");
    DFLASH_CHECK(dm.emb_dim > 0, "domino emb_dim must be > 0 (got {})", dm.emb_dim);
    DFLASH_CHECK(dm.gru_hidden_dim > 0, "domino gru_hidden_dim must be > 0 (got {})",
                 dm.gru_hidden_dim);
    DFLASH_CHECK(dm.pure_draft_prefix_len >= 0 && dm.suffix_start() < block_size,
                 "domino pure_draft_prefix_len {} leaves no corrected slot in a block of {} "
                 "(must be in [0, {}])",
                 dm.pure_draft_prefix_len, block_size, block_size - (dm.shift_label ? 1 : 2));
  } else {
    DFLASH_CHECK(dm == DominoHead{}, "emb_dim / gru_hidden_dim / pure_draft_prefix_len / "
                                     "shift_label set on a drafter whose projector_type is not "
                                     "domino");
  }
  const DsparkHeads& ds = dspark;
  if (!ds.enabled) {
    DFLASH_CHECK(ds == DsparkHeads{},
                 "markov_rank / confidence head set on a drafter whose projector_type is not "
                 "dspark");
    return;
  }
  DFLASH_CHECK(ds.markov_rank >= 0, "markov_rank must be >= 0 (got {})", ds.markov_rank);
  DFLASH_CHECK(ds.markov_rank > 0 || ds.markov_type == MarkovHeadType::vanilla,
               "markov_head_type {} needs markov_rank > 0 (markov_rank 0 means no Markov head)",
               markov_head_type_name(ds.markov_type));
  DFLASH_CHECK(!ds.confidence_with_markov || (ds.confidence_head && ds.markov_rank > 0),
               "confidence_head_with_markov needs enable_confidence_head and markov_rank > 0 "
               "(got enable_confidence_head {}, markov_rank {})",
               ds.confidence_head, ds.markov_rank);
}

std::optional<MarkovHeadType> markov_head_type_parse(std::string_view name) {
  for (MarkovHeadType t : {MarkovHeadType::vanilla, MarkovHeadType::gated, MarkovHeadType::rnn}) {
    if (name == markov_head_type_name(t)) return t;
  }
  return std::nullopt;
}

const char* markov_head_type_name(MarkovHeadType t) {
  switch (t) {
    case MarkovHeadType::vanilla:
      return "vanilla";
    case MarkovHeadType::gated:
      return "gated";
    case MarkovHeadType::rnn:
      return "rnn";
  }
  fail("Markov head type {} is not a MarkovHeadType", static_cast<int>(t));
}

DrafterLayout::DrafterLayout(const DrafterConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t QD = c.num_heads * D, KD = c.num_kv_heads * D;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool norm, bool bias = false,
                 ParamInit init = ParamInit::normal) {
    ParamInfo p;
    p.name = std::move(name);
    p.numel = 1;
    bool overflow = false;
    for (int64_t d : shape) overflow |= __builtin_mul_overflow(p.numel, d, &p.numel);
    overflow |= __builtin_add_overflow(total, p.numel, &total);
    DFLASH_CHECK(!overflow,
                 "drafter parameter count overflows 64 bits at '{}' (hidden_size {}, "
                 "{} layers): the config's sizes are corrupt",
                 p.name, H, c.num_layers);
    p.shape = std::move(shape);
    p.offset = total - p.numel;
    p.is_norm = norm;
    p.is_bias = bias;
    p.init = init;
    params.push_back(std::move(p));
  };
  add("fc.weight", {H, c.n_taps() * H}, false);
  add("hidden_norm.weight", {H}, true);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, true);
    add(p + "self_attn.q_proj.weight", {QD, H}, false);
    add(p + "self_attn.k_proj.weight", {KD, H}, false);
    add(p + "self_attn.v_proj.weight", {KD, H}, false);
    add(p + "self_attn.o_proj.weight", {H, QD}, false);
    add(p + "self_attn.q_norm.weight", {D}, true);
    add(p + "self_attn.k_norm.weight", {D}, true);
    add(p + "post_attention_layernorm.weight", {H}, true);
    add(p + "mlp.gate_proj.weight", {I, H}, false);
    add(p + "mlp.up_proj.weight", {I, H}, false);
    add(p + "mlp.down_proj.weight", {H, I}, false);
  }
  add("norm.weight", {H}, true);
  const DsparkHeads& ds = c.dspark;
  const int64_t r = ds.markov_rank;
  if (ds.enabled && r > 0) {
    add("markov_head.markov_w1.weight", {c.vocab_size, r}, false);
    add("markov_head.markov_w2.weight", {c.vocab_size, r}, false);
    if (ds.markov_type == MarkovHeadType::gated) {
      add("markov_head.gate_proj.weight", {r, H + r}, false);
      add("markov_head.gate_proj.bias", {r}, false, true);
    } else if (ds.markov_type == MarkovHeadType::rnn) {
      add("markov_head.joint_proj.weight", {3 * r, 2 * r + H}, false);
      add("markov_head.joint_proj.bias", {3 * r}, false, true);
    }
  }
  if (ds.enabled && ds.confidence_head) {
    add("confidence_head.proj.weight", {1, ds.confidence_in(H)}, false);
    add("confidence_head.proj.bias", {1}, false, true);
  }
  const Dflash2Heads& d2 = c.dflash2;
  if (d2.enabled) {
    const int64_t T = d2.conv_kernel_size, Gc = H / d2.conv_group_size, r = d2.selector_rank;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      for (const char* conv : {"attention_conv", "mlp_conv"}) {
        const std::string p = "layers." + std::to_string(l) + "." + conv + ".";
        add(p + "base_kernel", {2, T, H}, false, false, ParamInit::conv_identity);
        add(p + "kernel_projection.weight", {2 * T * Gc, H}, false, false, ParamInit::zero);
      }
    }
    add("candidate_selector.predecessor_codebook", {c.vocab_size, r}, false);
    add("candidate_selector.successor_codebook", {c.vocab_size, r}, false, false, ParamInit::zero);
    add("candidate_selector.hidden_projection.weight", {r, H}, false);
  }
  const DominoHead& dm = c.domino;
  if (dm.enabled) {
    const int64_t G = dm.gru_hidden_dim, E = dm.emb_dim;
    add("prefix_gru.weight_ih_l0", {3 * G, H}, false);
    add("prefix_gru.weight_hh_l0", {3 * G, G}, false);
    add("embed_proj.0.weight", {E, H + G}, false);
    add("embed_proj.2.weight", {c.vocab_size, E}, false);
  }
  auto offset_of = [&](const std::string& name) {
    for (const auto& p : params) {
      if (p.name == name) return p.offset;
    }
    return int64_t(-1);
  };
  if (d2.enabled) {
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      dflash2.attn_base.push_back(offset_of(p + "attention_conv.base_kernel"));
      dflash2.attn_kp.push_back(offset_of(p + "attention_conv.kernel_projection.weight"));
      dflash2.mlp_base.push_back(offset_of(p + "mlp_conv.base_kernel"));
      dflash2.mlp_kp.push_back(offset_of(p + "mlp_conv.kernel_projection.weight"));
    }
    dflash2.predecessor = offset_of("candidate_selector.predecessor_codebook");
    dflash2.successor = offset_of("candidate_selector.successor_codebook");
    dflash2.hidden_proj = offset_of("candidate_selector.hidden_projection.weight");
  }
  dspark.markov_w1 = offset_of("markov_head.markov_w1.weight");
  dspark.markov_w2 = offset_of("markov_head.markov_w2.weight");
  dspark.gate_w = offset_of("markov_head.gate_proj.weight");
  dspark.gate_b = offset_of("markov_head.gate_proj.bias");
  dspark.joint_w = offset_of("markov_head.joint_proj.weight");
  dspark.joint_b = offset_of("markov_head.joint_proj.bias");
  dspark.conf_w = offset_of("confidence_head.proj.weight");
  dspark.conf_b = offset_of("confidence_head.proj.bias");
  domino.gru_ih = offset_of("prefix_gru.weight_ih_l0");
  domino.gru_hh = offset_of("prefix_gru.weight_hh_l0");
  domino.proj1 = offset_of("embed_proj.0.weight");
  domino.proj2 = offset_of("embed_proj.2.weight");
  fc = find("fc.weight").offset;
  hidden_norm = find("hidden_norm.weight").offset;
  norm = find("norm.weight").offset;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    auto at = [&](const char* name) { return find(p + name).offset; };
    DrafterLayerOffsets o;
    o.input_layernorm = at("input_layernorm.weight");
    o.q_proj = at("self_attn.q_proj.weight");
    o.k_proj = at("self_attn.k_proj.weight");
    o.v_proj = at("self_attn.v_proj.weight");
    o.o_proj = at("self_attn.o_proj.weight");
    o.q_norm = at("self_attn.q_norm.weight");
    o.k_norm = at("self_attn.k_norm.weight");
    o.post_attention_layernorm = at("post_attention_layernorm.weight");
    o.gate_proj = at("mlp.gate_proj.weight");
    o.up_proj = at("mlp.up_proj.weight");
    o.down_proj = at("mlp.down_proj.weight");
    DFLASH_ASSERT(o.up_proj == o.gate_proj + I * H);
    layers.push_back(o);
  }
}

const ParamInfo& DrafterLayout::find(const std::string& name) const {
  for (const auto& p : params) {
    if (p.name == name) return p;
  }
  fail("drafter has no parameter named '{}'", name);
}

void drafter_init(std::span<float> params, const DrafterLayout& layout, uint64_t seed) {
  DFLASH_CHECK(static_cast<int64_t>(params.size()) == layout.total,
               "drafter_init: {} values for a layout of {}", params.size(), layout.total);
  Rng rng(seed);
  for (const auto& p : layout.params) {
    float* w = params.data() + p.offset;
    if (p.init == ParamInit::zero) {
      std::fill(w, w + p.numel, 0.0f);
      continue;
    }
    if (p.init == ParamInit::conv_identity) {  // [2, T, H]: tap 0 of both sides is 1
      const int64_t T = p.shape[1], H = p.shape[2];
      std::fill(w, w + p.numel, 0.0f);
      for (int64_t side = 0; side < 2; ++side) std::fill_n(w + side * T * H, H, 1.0f);
      continue;
    }
    for (int64_t i = 0; i < p.numel; ++i) {
      if (p.is_bias) {
        w[i] = 0.0f;  // draws nothing: the following tensors' values do not depend on biases
      } else {
        w[i] = p.is_norm ? 1.0f : static_cast<float>(0.02 * rng.normal());
      }
    }
  }
}

void DrafterCache::truncate(int64_t new_len) {
  DFLASH_CHECK(new_len >= 0 && new_len <= len,
               "drafter cache rollback to {} outside [0, {}]", new_len, len);
  for (auto& x : k) x.resize(static_cast<size_t>(new_len) * (x.size() / std::max<int64_t>(len, 1)));
  for (auto& x : v) x.resize(static_cast<size_t>(new_len) * (x.size() / std::max<int64_t>(len, 1)));
  len = new_len;
}

// --------------------------------------------------------------------------------------- workspace


namespace {

template <typename S>
void fit(std::vector<S>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
}

// Pointers into the flat parameter (or gradient) array for one layer.
template <typename S>
struct LayerParams {
  S *in_norm, *wq, *wk, *wv, *wo, *q_norm, *k_norm, *post_norm, *wg, *wu, *wd;
};

template <typename S>
LayerParams<S> layer_params(S* base, const DrafterLayout& L, int64_t l) {
  const DrafterLayerOffsets& o = L.layers[static_cast<size_t>(l)];
  return {base + o.input_layernorm, base + o.q_proj,
          base + o.k_proj,          base + o.v_proj,
          base + o.o_proj,          base + o.q_norm,
          base + o.k_norm,          base + o.post_attention_layernorm,
          base + o.gate_proj,       base + o.up_proj,
          base + o.down_proj};
}

template <typename S>
struct Dims {
  int64_t H, I, NH, NKV, D, QD, KD, F, K, V;
  explicit Dims(const DrafterConfig& c)
      : H(c.hidden_size),
        I(c.intermediate_size),
        NH(c.num_heads),
        NKV(c.num_kv_heads),
        D(c.head_dim),
        QD(c.num_heads * c.head_dim),
        KD(c.num_kv_heads * c.head_dim),
        F(c.n_taps() * c.hidden_size),
        K(c.block_size),
        V(c.vocab_size) {}
};

// The shape of DFlash2's convs over NK block rows.
inline Dflash2ConvShape conv_shape(const DrafterConfig& c, int64_t NK) {
  return {NK, c.hidden_size, c.block_size, c.dflash2.conv_kernel_size, c.dflash2.conv_group_size};
}

template <typename S>
void rope_table(std::vector<S>& out, const DrafterConfig& c) {
  if (!out.empty()) return;
  std::vector<double> f = rope_inv_freq(c.rope, c.head_dim);
  out.assign(f.begin(), f.end());
}

// The forward of the block rows through all layers, given k/v rows of the context already in
// ws.layers[l].k / .v rows [0, Tc) (the block's own k/v are appended at rows [Tc, Tc+NK)).
// Saves activations for the backward when `save` is set. Leaves the final hidden state in ws.h.
template <typename S>
void block_forward(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                   const S* embed, DrafterWorkspace<S>& ws, int64_t Tc, int64_t NK,
                   const AttnRange* ranges) {
  const Dims<S> d(cfg);
  const S scaling = static_cast<S>(rope_attention_scaling(cfg.rope));
  fit(ws.h, NK * d.H);
  embedding_fwd_cpu(ws.h.data(), embed, ws.block_tokens.data(), NK, d.V, d.H);
  AttnParams ap{NK, Tc + NK, d.NH, d.NKV, d.D, 1.0 / std::sqrt(static_cast<double>(d.D))};
  const bool conv = cfg.dflash2.enabled;
  const Dflash2ConvShape cs = conv_shape(cfg, NK);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    auto P = layer_params(const_cast<S*>(params), layout, l);
    LayerActs<S>& a = ws.layers[static_cast<size_t>(l)];
    a.x_in = ws.h;
    fit(a.hn, NK * d.H);
    rmsnorm_fwd_cpu(a.hn.data(), nullptr, a.x_in.data(), P.in_norm, NK, d.H, cfg.rms_norm_eps);
    // DFlash2: the attention sees the pre-conv of its input (block rows only; ctx k/v unchanged).
    if (conv) {
      dflash2_conv_pre(a.hn.data(), a.attn_conv, params + layout.dflash2.attn_base[l],
                       params + layout.dflash2.attn_kp[l], cs);
    }
    // q: [NK, NH, D] -> per-head norm -> RoPE.
    fit(a.q_raw, NK * d.QD);
    linear_fwd_cpu(a.q_raw.data(), a.hn.data(), P.wq, nullptr, NK, d.H, d.QD);
    fit(ws.dbuf, NK * d.QD);
    rmsnorm_fwd_cpu(ws.dbuf.data(), nullptr, a.q_raw.data(), P.q_norm, NK * d.NH, d.D,
                    cfg.rms_norm_eps);
    fit(a.q, NK * d.QD);
    rope_fwd_cpu(a.q.data(), ws.dbuf.data(), ws.pos_q.data(), ws.inv_freq.data(), scaling, NK,
                 d.NH, d.D);
    // Block k/v rows appended after the Tc context rows.
    fit(a.k_raw, (Tc + NK) * d.KD);
    fit(a.k, (Tc + NK) * d.KD);
    fit(a.v, (Tc + NK) * d.KD);
    S* kr = a.k_raw.data() + Tc * d.KD;
    linear_fwd_cpu(kr, a.hn.data(), P.wk, nullptr, NK, d.H, d.KD);
    fit(ws.dbuf, NK * d.KD);
    rmsnorm_fwd_cpu(ws.dbuf.data(), nullptr, kr, P.k_norm, NK * d.NKV, d.D, cfg.rms_norm_eps);
    rope_fwd_cpu(a.k.data() + Tc * d.KD, ws.dbuf.data(), ws.pos_kv.data() + Tc,
                 ws.inv_freq.data(), scaling, NK, d.NKV, d.D);
    linear_fwd_cpu(a.v.data() + Tc * d.KD, a.hn.data(), P.wv, nullptr, NK, d.H, d.KD);
    // Attention.
    fit(a.o, NK * d.QD);
    fit(a.lse, d.NH * NK);
    attention_fwd_cpu(a.o.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), ranges, ap);
    fit(ws.dtmp, NK * d.H);
    linear_fwd_cpu(ws.dtmp.data(), a.o.data(), P.wo, nullptr, NK, d.QD, d.H);
    if (conv) {
      dflash2_conv_post(ws.dtmp.data(), a.attn_conv, params + layout.dflash2.attn_base[l], cs);
    }
    fit(a.h_mid, NK * d.H);
    residual_fwd_cpu(a.h_mid.data(), a.x_in.data(), ws.dtmp.data(), NK * d.H);
    // MLP.
    fit(a.hn2, NK * d.H);
    rmsnorm_fwd_cpu(a.hn2.data(), nullptr, a.h_mid.data(), P.post_norm, NK, d.H,
                    cfg.rms_norm_eps);
    if (conv) {
      dflash2_conv_pre(a.hn2.data(), a.mlp_conv, params + layout.dflash2.mlp_base[l],
                       params + layout.dflash2.mlp_kp[l], cs);
    }
    // gate and up are adjacent in the layout: one [2I, H] projection gives row t = [gate | up].
    fit(a.gate_up, NK * 2 * d.I);
    linear_fwd_cpu(a.gate_up.data(), a.hn2.data(), P.wg, nullptr, NK, d.H, 2 * d.I);
    fit(a.act, NK * d.I);
    swiglu_fwd_cpu(a.act.data(), a.gate_up.data(), a.gate_up.data() + d.I, NK, d.I, 2 * d.I);
    linear_fwd_cpu(ws.dtmp.data(), a.act.data(), P.wd, nullptr, NK, d.I, d.H);
    if (conv) {
      dflash2_conv_post(ws.dtmp.data(), a.mlp_conv, params + layout.dflash2.mlp_base[l], cs);
    }
    residual_fwd_cpu(ws.h.data(), a.h_mid.data(), ws.dtmp.data(), NK * d.H);
  }
}

// ctx rows [0, T) and their per-layer k/v.
template <typename S>
void context_forward(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                     const S* features, int64_t T, DrafterWorkspace<S>& ws) {
  const Dims<S> d(cfg);
  const S scaling = static_cast<S>(rope_attention_scaling(cfg.rope));
  fit(ws.ctx_pre, T * d.H);
  fit(ws.ctx, T * d.H);
  const S* fc = params + layout.fc;
  const S* hidden_norm = params + layout.hidden_norm;
  if (T > 0) {
    linear_fwd_cpu(ws.ctx_pre.data(), features, fc, nullptr, T, d.F, d.H);
    rmsnorm_fwd_cpu(ws.ctx.data(), nullptr, ws.ctx_pre.data(), hidden_norm, T, d.H,
                    cfg.rms_norm_eps);
  }
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    auto P = layer_params(const_cast<S*>(params), layout, l);
    LayerActs<S>& a = ws.layers[static_cast<size_t>(l)];
    fit(a.k_raw, T * d.KD);
    fit(a.k, T * d.KD);
    fit(a.v, T * d.KD);
    linear_fwd_cpu(a.k_raw.data(), ws.ctx.data(), P.wk, nullptr, T, d.H, d.KD);
    fit(ws.dbuf, T * d.KD);
    rmsnorm_fwd_cpu(ws.dbuf.data(), nullptr, a.k_raw.data(), P.k_norm, T * d.NKV, d.D,
                    cfg.rms_norm_eps);
    rope_fwd_cpu(a.k.data(), ws.dbuf.data(), ws.pos_kv.data(), ws.inv_freq.data(), scaling, T,
                 d.NKV, d.D);
    linear_fwd_cpu(a.v.data(), ws.ctx.data(), P.wv, nullptr, T, d.H, d.KD);
  }
}

// Positions, block tokens and key ranges of a training step (the rule of drafter_batch.hpp, block
// keys right after the T context keys).
template <typename S>
void plan_batch(const DrafterConfig& cfg, const DrafterBatch& b, const S* features,
                DrafterWorkspace<S>& ws) {
  DFLASH_CHECK(b.block_size == cfg.block_size,
               "drafter batch of block size {} for a drafter of block size {}", b.block_size,
               cfg.block_size);
  b.validate();
  DFLASH_CHECK(features != nullptr || b.T() == 0, "drafter step without target features");
  const int64_t T = b.T(), NK = b.N() * cfg.block_size;
  ws.pos_kv.resize(static_cast<size_t>(T + NK));
  ws.block_tokens.resize(static_cast<size_t>(NK));
  ws.ranges.resize(static_cast<size_t>(NK));
  std::span<int32_t> pos(ws.pos_kv);
  drafter_batch_context_positions(b, pos.first(static_cast<size_t>(T)));
  drafter_batch_block_rows(b, cfg.mask_token_id, T, ws.block_tokens,
                           pos.subspan(static_cast<size_t>(T)), ws.ranges);
  ws.pos_q.assign(ws.pos_kv.begin() + T, ws.pos_kv.end());
}

// D-PACE (OBJECTIVES.md §1.1) after a CE pass that gave every supervised row weight 1: row j's
// loss ws.ce_loss[j] is CE_j and its hidden gradient ws.ce_grad row j is grad_scale·∂CE_j/∂h. Each
// block's weights follow from its CE values (dpace_row_weights: constants of the step). A row's
// gradient is linear in its weight, so scaling row j's gradient by w_j gives the gradient of
// grad_scale·Σ w·CE with w frozen, from one LM-head pass. Returns {Σ w·CE, Σ w} over the rows,
// summed in row order in double. ws.ce_rows are ascending, so a block's rows are consecutive.
template <typename S>
CrossEntropyStats dpace_reweight(DrafterWorkspace<S>& ws, const DrafterBatch& batch, int64_t H,
                                 bool grads) {
  const auto R = ws.ce_rows.size();
  ws.dpace_ce.resize(R);
  ws.dpace_w.resize(R);
  for (size_t j = 0; j < R; ++j) ws.dpace_ce[j] = static_cast<double>(ws.ce_loss[j]);
  dpace_row_weights(ws.dpace_w, ws.ce_rows, ws.dpace_ce, batch.targets.counted, batch.block_size,
                    batch.objective);
  CrossEntropyStats st;
  for (size_t j = 0; j < R; ++j) {
    const double w = ws.dpace_w[j];
    st.loss_sum += w * ws.dpace_ce[j];
    st.weight_sum += w;
    if (!grads) continue;
    S* g = ws.ce_grad.data() + static_cast<int64_t>(j) * H;
    for (int64_t h = 0; h < H; ++h) g[h] *= static_cast<S>(w);
  }
  return st;
}

template <typename S>
void drafter_backward(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                      S* grads, const S* features, int64_t T, int64_t NK,
                      DrafterWorkspace<S>& ws);

}  // namespace

// ------------------------------------------------------------------------------------ train step

template <typename S>
DrafterTrainResult drafter_train_step(const DrafterConfig& cfg, const DrafterLayout& layout,
                                      const S* params, S* grads, const DrafterTables<S>& tables,
                                      const DrafterBatch& batch, const S* features,
                                      double grad_scale, DrafterWorkspace<S>& ws,
                                      const S* target_final) {
  const Dims<S> d(cfg);
  const int64_t T = batch.T(), N = batch.N(), NK = N * d.K;
  DFLASH_CHECK(cfg.dspark.enabled == batch.objective.dspark(),
               "drafter step: a batch of the {} objective for a drafter {}",
               objective_kind_name(batch.objective.kind),
               cfg.dspark.enabled ? "with DSpark heads" : "without DSpark heads");
  DFLASH_CHECK(cfg.dflash2.enabled == batch.objective.dflash2(),
               "drafter step: a batch of the {} objective for a drafter {}",
               objective_kind_name(batch.objective.kind),
               cfg.dflash2.enabled ? "with DFlash2's conv and selector" : "without DFlash2's");
  DFLASH_CHECK(cfg.domino.enabled == batch.objective.domino() &&
                   (!cfg.domino.enabled ||
                    cfg.domino.shift_label == batch.objective.domino_shift_label),
               "drafter step: a batch of the {} objective (shift_label {}) for a drafter {}",
               objective_kind_name(batch.objective.kind), batch.objective.domino_shift_label,
               cfg.domino.enabled ? (cfg.domino.shift_label ? "with the Domino head, shift_label"
                                                            : "with the Domino head")
                                  : "without the Domino head");
  plan_batch(cfg, batch, features, ws);
  DrafterTrainResult res;
  res.argmax.assign(static_cast<size_t>(NK), -1);
  if (N == 0) return res;
  rope_table(ws.inv_freq, cfg);
  ws.layers.resize(static_cast<size_t>(cfg.num_layers));
  context_forward(cfg, layout, params, features, T, ws);
  block_forward(cfg, layout, params, tables.embed, ws, T, NK, ws.ranges.data());

  // Final norm + fused LM head cross-entropy.
  const S* norm_w = params + layout.norm;
  fit(ws.hf, NK * d.H);
  rmsnorm_fwd_cpu(ws.hf.data(), nullptr, ws.h.data(), norm_w, NK, d.H, cfg.rms_norm_eps);
  if (cfg.dspark.enabled || cfg.dflash2.enabled || cfg.domino.enabled) {
    // An objective with its own head computes its loss on every block row and dh = ∂/∂hf of the
    // scaled loss; the backbone's backward is the same for all.
    fit(ws.dh, NK * d.H);
    if (cfg.dspark.enabled) {
      const DsparkSums ds = dspark_head_step(cfg, layout, params, grads, tables.lm_head, batch,
                                             ws.hf.data(), target_final, grad_scale, ws.dh.data(),
                                             res.argmax.data(), batch.objective, ws.dspark);
      res.loss_sum = ds.loss_sum;
      res.weight_sum = ds.weight_sum;
      res.dspark_ce_sum = ds.ce_sum;
      res.dspark_l1_sum = ds.l1_sum;
      res.dspark_bce_sum = ds.bce_sum;
      res.dspark_acc_sum = ds.acc_sum;
      res.dspark_conf = ds.conf;
      res.dspark_acc = ds.acc;
    } else if (cfg.dflash2.enabled) {  // the base loss on the unary logits and the selector's CE
      const Dflash2Sums s2 =
          dflash2_head_step(cfg, layout, params, grads, tables.lm_head, batch, ws.hf.data(),
                            grad_scale, ws.dh.data(), res.argmax.data(), ws.dflash2);
      res.loss_sum = s2.loss_sum;
      res.weight_sum = s2.weight_sum;
      res.dflash2_base_sum = s2.base_sum;
      res.dflash2_selector_sum = s2.selector_sum;
      res.dflash2_in_topk_weight = s2.in_topk_weight;
    } else {  // Domino: the GRU head and the blended loss
      const DominoSums dm =
          domino_head_step(cfg, layout, params, grads, tables, batch, ws.hf.data(), grad_scale,
                           ws.dh.data(), res.argmax.data(), ws.domino);
      res.loss_sum = dm.loss_sum;
      res.weight_sum = dm.weight_sum;
      res.domino_final_ce_sum = dm.final_ce_sum;
      res.domino_base_ce_sum = dm.base_ce_sum;
    }
    if (grads) drafter_backward(cfg, layout, params, grads, features, T, NK, ws);
    return res;
  }
  // Only the supervised rows go through the LM head (about 2/3 of them on short documents): a
  // row of weight 0 (slot 0, past the document end, outside the loss mask) adds nothing to the
  // loss or to any gradient, and its argmax is not reported (-1). The selected rows are packed.
  ws.ce_rows.clear();
  for (int64_t i = 0; i < NK; ++i) {
    if (batch.targets.weights[i] != 0.0f || batch.targets.counted[i]) {
      ws.ce_rows.push_back(static_cast<int32_t>(i));
    }
  }
  const int64_t R = static_cast<int64_t>(ws.ce_rows.size());
  ws.labels.resize(static_cast<size_t>(R));
  ws.ce_argmax.resize(static_cast<size_t>(R));
  fit(ws.weights, R);
  fit(ws.ce_in, R * d.H);
  const bool dpace = batch.objective.dpace();  // CE with weight m_k, D-PACE's weights afterwards
  for (int64_t j = 0; j < R; ++j) {
    const int64_t i = ws.ce_rows[j];
    ws.labels[j] = std::max(batch.targets.labels[i], 0);
    ws.weights[j] =
        dpace ? S(batch.targets.counted[i] ? 1 : 0) : static_cast<S>(batch.targets.weights[i]);
    std::copy_n(ws.hf.data() + i * d.H, d.H, ws.ce_in.data() + j * d.H);
  }
  FusedCeParams cp;
  cp.R = R;
  cp.H = d.H;
  cp.V = d.V;
  // Chunks of about 16 MiB of logits (at least 64 rows): few chunks, so that the LM head is
  // packed for the GEMMs a few times per row instead of once per 64 rows.
  cp.chunk_rows = std::max<int64_t>(64, (int64_t(1) << 22) / d.V);
  cp.grad_scale = grad_scale;
  fit(ws.ce_grad, R * d.H);
  fit(ws.lse_out, R);
  fit(ws.ce_loss, R);
  CrossEntropyStats st = cross_entropy_fused_cpu(
      grads ? ws.ce_grad.data() : nullptr, ws.lse_out.data(), ws.ce_argmax.data(),
      dpace ? ws.ce_loss.data() : nullptr, ws.ce_in.data(), tables.lm_head, ws.labels.data(),
      ws.weights.data(), cp);
  if (dpace) st = dpace_reweight(ws, batch, d.H, grads != nullptr);
  for (int64_t j = 0; j < R; ++j) res.argmax[ws.ce_rows[j]] = ws.ce_argmax[j];
  res.loss_sum = st.loss_sum;
  res.weight_sum = st.weight_sum;
  if (!grads) return res;
  fit(ws.dh, NK * d.H);
  std::fill(ws.dh.begin(), ws.dh.end(), S(0));
  for (int64_t j = 0; j < R; ++j) {
    std::copy_n(ws.ce_grad.data() + j * d.H, d.H, ws.dh.data() + ws.ce_rows[j] * d.H);
  }
  drafter_backward(cfg, layout, params, grads, features, T, NK, ws);
  return res;
}

namespace {

// The backward of the drafter from ws.dh = ∂loss/∂(final-norm rows) [NK, H]: through the final
// norm, the layers and the context projection, accumulating into `grads`.
template <typename S>
void drafter_backward(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                      S* grads, const S* features, int64_t T, int64_t NK,
                      DrafterWorkspace<S>& ws) {
  const Dims<S> d(cfg);
  const S* norm_w = params + layout.norm;
  S* g_norm = grads + layout.norm;
  fit(ws.dtmp, NK * d.H);
  rmsnorm_bwd_cpu(ws.dtmp.data(), g_norm, ws.dh.data(), ws.h.data(), norm_w, NK, d.H,
                  cfg.rms_norm_eps);
  std::swap(ws.dh, ws.dtmp);  // dh = d(final hidden)
  fit(ws.dctx, T * d.H);
  std::fill(ws.dctx.begin(), ws.dctx.end(), S(0));
  const S scaling = static_cast<S>(rope_attention_scaling(cfg.rope));
  AttnParams ap{NK, T + NK, d.NH, d.NKV, d.D, 1.0 / std::sqrt(static_cast<double>(d.D))};
  const bool conv = cfg.dflash2.enabled;
  const Dflash2ConvShape cs = conv_shape(cfg, NK);
  const Dflash2Offsets& o2 = layout.dflash2;
  if (conv) fit(ws.conv_dy, NK * d.H);
  for (int64_t l = cfg.num_layers - 1; l >= 0; --l) {
    auto P = layer_params(const_cast<S*>(params), layout, l);
    auto G = layer_params(grads, layout, l);
    LayerActs<S>& a = ws.layers[static_cast<size_t>(l)];
    // MLP: h = h_mid + down(act) (DFlash2: h_mid + post_conv(down(act))).
    if (conv) {
      dflash2_conv_post_bwd(ws.conv_dy.data(), grads + o2.mlp_base[l], ws.conv_ddelta, ws.dh.data(),
                            a.mlp_conv, params + o2.mlp_base[l], cs);
    }
    const S* d_mlp_out = conv ? ws.conv_dy.data() : ws.dh.data();
    fit(ws.d_act, NK * d.I);
    linear_bwd_cpu(ws.d_act.data(), G.wd, nullptr, d_mlp_out, a.act.data(), P.wd, NK, d.I, d.H);
    fit(ws.d_gate_up, NK * 2 * d.I);
    swiglu_bwd_cpu(ws.d_gate_up.data(), ws.d_gate_up.data() + d.I, ws.d_act.data(),
                   a.gate_up.data(), a.gate_up.data() + d.I, NK, d.I, 2 * d.I);
    // The [2I, H] gate|up projection: dhn2 = d[gate|up]·W, d(W_gate|W_up) += d[gate|up]ᵀ·hn2.
    fit(ws.dhn2, NK * d.H);
    fit(ws.dhn, NK * d.H);
    linear_bwd_cpu(ws.dhn2.data(), G.wg, nullptr, ws.d_gate_up.data(), a.hn2.data(), P.wg, NK, d.H,
                   2 * d.I);
    if (conv) {  // dhn2 = ∂/∂ũ → ∂/∂u (the taps and the kernel projection)
      dflash2_conv_pre_bwd(ws.dhn.data(), grads + o2.mlp_base[l], grads + o2.mlp_kp[l],
                           ws.conv_ddelta, ws.conv_dtmp, ws.dhn2.data(), a.mlp_conv,
                           params + o2.mlp_base[l], params + o2.mlp_kp[l], cs);
      std::swap(ws.dhn, ws.dhn2);
    }
    rmsnorm_bwd_cpu(ws.dtmp.data(), G.post_norm, ws.dhn2.data(), a.h_mid.data(), P.post_norm, NK,
                    d.H, cfg.rms_norm_eps);
    residual_accumulate_cpu(ws.dh.data(), ws.dtmp.data(), NK * d.H);  // dh = d(h_mid)
    // Attention: h_mid = x_in + o_proj(o).
    if (conv) {
      dflash2_conv_post_bwd(ws.conv_dy.data(), grads + o2.attn_base[l], ws.conv_ddelta,
                            ws.dh.data(), a.attn_conv, params + o2.attn_base[l], cs);
    }
    const S* d_attn_out = conv ? ws.conv_dy.data() : ws.dh.data();
    fit(ws.d_o, NK * d.QD);
    linear_bwd_cpu(ws.d_o.data(), G.wo, nullptr, d_attn_out, a.o.data(), P.wo, NK, d.QD, d.H);
    fit(ws.dq, NK * d.QD);
    fit(ws.dk, (T + NK) * d.KD);
    fit(ws.dv, (T + NK) * d.KD);
    attention_bwd_cpu(ws.dq.data(), ws.dk.data(), ws.dv.data(), ws.d_o.data(), a.q.data(),
                      a.k.data(), a.v.data(), a.o.data(), a.lse.data(), ws.ranges.data(), ap);
    // q path: rope -> q_norm -> q_proj.
    fit(ws.dq_n, NK * d.QD);
    rope_bwd_cpu(ws.dq_n.data(), ws.dq.data(), ws.pos_q.data(), ws.inv_freq.data(), scaling, NK,
                 d.NH, d.D);
    fit(ws.dq_raw, NK * d.QD);
    rmsnorm_bwd_cpu(ws.dq_raw.data(), G.q_norm, ws.dq_n.data(), a.q_raw.data(), P.q_norm,
                    NK * d.NH, d.D, cfg.rms_norm_eps);
    linear_bwd_cpu(ws.dhn.data(), G.wq, nullptr, ws.dq_raw.data(), a.hn.data(), P.wq, NK, d.H,
                   d.QD);
    // k path over all rows [ctx ; block]: rope -> k_norm -> k_proj.
    fit(ws.dk_n, (T + NK) * d.KD);
    rope_bwd_cpu(ws.dk_n.data(), ws.dk.data(), ws.pos_kv.data(), ws.inv_freq.data(), scaling,
                 T + NK, d.NKV, d.D);
    fit(ws.dk_raw, (T + NK) * d.KD);
    rmsnorm_bwd_cpu(ws.dk_raw.data(), G.k_norm, ws.dk_n.data(), a.k_raw.data(), P.k_norm,
                    (T + NK) * d.NKV, d.D, cfg.rms_norm_eps);
    // Block rows: dhn += dk_raw[T:]·Wk + dv[T:]·Wv.
    fit(ws.dtmp, std::max(T, NK) * d.H);
    linear_bwd_cpu(ws.dtmp.data(), G.wk, nullptr, ws.dk_raw.data() + T * d.KD, a.hn.data(), P.wk,
                   NK, d.H, d.KD);
    residual_accumulate_cpu(ws.dhn.data(), ws.dtmp.data(), NK * d.H);
    linear_bwd_cpu(ws.dtmp.data(), G.wv, nullptr, ws.dv.data() + T * d.KD, a.hn.data(), P.wv, NK,
                   d.H, d.KD);
    residual_accumulate_cpu(ws.dhn.data(), ws.dtmp.data(), NK * d.H);
    // Context rows: dctx += dk_raw[:T]·Wk + dv[:T]·Wv (ctx enters every layer unnormed).
    linear_bwd_cpu(ws.dtmp.data(), G.wk, nullptr, ws.dk_raw.data(), ws.ctx.data(), P.wk, T, d.H,
                   d.KD);
    residual_accumulate_cpu(ws.dctx.data(), ws.dtmp.data(), T * d.H);
    linear_bwd_cpu(ws.dtmp.data(), G.wv, nullptr, ws.dv.data(), ws.ctx.data(), P.wv, T, d.H,
                   d.KD);
    residual_accumulate_cpu(ws.dctx.data(), ws.dtmp.data(), T * d.H);
    if (conv) {  // dhn = ∂/∂ũ → ∂/∂u
      dflash2_conv_pre_bwd(ws.dhn2.data(), grads + o2.attn_base[l], grads + o2.attn_kp[l],
                           ws.conv_ddelta, ws.conv_dtmp, ws.dhn.data(), a.attn_conv,
                           params + o2.attn_base[l], params + o2.attn_kp[l], cs);
      std::swap(ws.dhn, ws.dhn2);
    }
    // input_layernorm: hn = norm(x_in); dh(x_in) = dh(h_mid) + norm_bwd(dhn).
    rmsnorm_bwd_cpu(ws.dtmp.data(), G.in_norm, ws.dhn.data(), a.x_in.data(), P.in_norm, NK, d.H,
                    cfg.rms_norm_eps);
    residual_accumulate_cpu(ws.dh.data(), ws.dtmp.data(), NK * d.H);
  }
  // ctx = hidden_norm(fc(features)); features are frozen (no input gradient).
  const S* hidden_norm = params + layout.hidden_norm;
  S* g_fc = grads + layout.fc;
  S* g_hn = grads + layout.hidden_norm;
  if (T > 0) {
    fit(ws.dctx_pre, T * d.H);
    rmsnorm_bwd_cpu(ws.dctx_pre.data(), g_hn, ws.dctx.data(), ws.ctx_pre.data(), hidden_norm, T,
                    d.H, cfg.rms_norm_eps);
    linear_bwd_cpu(static_cast<S*>(nullptr), g_fc, nullptr, ws.dctx_pre.data(), features,
                   params + layout.fc, T, d.F, d.H);
  }
}

}  // namespace

template <typename S>
std::vector<S> drafter_block_logits(const DrafterConfig& cfg, const DrafterLayout& layout,
                                    const S* params, const DrafterTables<S>& tables,
                                    const DrafterBatch& batch, const S* features,
                                    DrafterWorkspace<S>& ws) {
  const Dims<S> d(cfg);
  const int64_t T = batch.T(), NK = batch.N() * d.K;
  plan_batch(cfg, batch, features, ws);
  rope_table(ws.inv_freq, cfg);
  ws.layers.resize(static_cast<size_t>(cfg.num_layers));
  context_forward(cfg, layout, params, features, T, ws);
  block_forward(cfg, layout, params, tables.embed, ws, T, NK, ws.ranges.data());
  fit(ws.hf, NK * d.H);
  rmsnorm_fwd_cpu(ws.hf.data(), nullptr, ws.h.data(), params + layout.norm, NK, d.H,
                  cfg.rms_norm_eps);
  if (cfg.dspark.enabled) {
    return dspark_block_logits(cfg, layout, params, tables.lm_head, batch, ws.hf.data(),
                               ws.dspark);
  }
  if (cfg.dflash2.enabled) return dflash2_unary_logits(cfg, tables.lm_head, ws.hf.data(), NK);
  if (cfg.domino.enabled) {
    return domino_block_logits(cfg, layout, params, tables, batch, ws.hf.data(), ws.domino);
  }
  std::vector<S> logits(static_cast<size_t>(NK * d.V));
  linear_fwd_cpu(logits.data(), ws.hf.data(), tables.lm_head, nullptr, NK, d.H, d.V);
  return logits;
}

// -------------------------------------------------------------------------------------- inference

void drafter_cache_append(DrafterCache& cache, const DrafterConfig& cfg,
                          const DrafterLayout& layout, const float* params, const float* features,
                          int64_t n, DrafterWorkspace<float>& ws) {
  DFLASH_CHECK(n >= 0, "drafter_cache_append: negative row count {}", n);
  cache.k.resize(static_cast<size_t>(cfg.num_layers));
  cache.v.resize(static_cast<size_t>(cfg.num_layers));
  if (n == 0) return;
  rope_table(ws.inv_freq, cfg);
  ws.layers.resize(static_cast<size_t>(cfg.num_layers));
  ws.pos_kv.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ws.pos_kv[i] = static_cast<int32_t>(cache.len + i);
  context_forward(cfg, layout, params, features, n, ws);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    auto& a = ws.layers[static_cast<size_t>(l)];
    cache.k[l].insert(cache.k[l].end(), a.k.begin(), a.k.end());
    cache.v[l].insert(cache.v[l].end(), a.v.begin(), a.v.end());
  }
  cache.len += n;
}

namespace {

// Lends the cache's k/v buffers to the workspace layers for one block forward (the context rows
// become rows [0, len) of each layer's k/v) and hands them back, cut to len rows, on scope exit.
class CacheLoan {
 public:
  CacheLoan(DrafterCache& cache, DrafterWorkspace<float>& ws, int64_t kv_dim)
      : cache_(cache), ws_(ws), rows_(cache.len * kv_dim) {
    for (size_t l = 0; l < cache_.k.size(); ++l) swap(l);
  }
  ~CacheLoan() {
    for (size_t l = 0; l < cache_.k.size(); ++l) {
      ws_.layers[l].k.resize(static_cast<size_t>(rows_));
      ws_.layers[l].v.resize(static_cast<size_t>(rows_));
      swap(l);
    }
  }
  CacheLoan(const CacheLoan&) = delete;
  CacheLoan& operator=(const CacheLoan&) = delete;

 private:
  void swap(size_t l) {
    ws_.layers[l].k.swap(cache_.k[l]);
    ws_.layers[l].v.swap(cache_.v[l]);
  }
  DrafterCache& cache_;
  DrafterWorkspace<float>& ws_;
  int64_t rows_;
};

}  // namespace

std::span<const float> drafter_draft_block(DrafterCache& cache, const DrafterConfig& cfg,
                                           const DrafterLayout& layout, const float* params,
                                           const DrafterTables<float>& tables, int32_t anchor_token,
                                           DrafterWorkspace<float>& ws) {
  const Dims<float> d(cfg);
  const int64_t Tc = cache.len, K = d.K;
  DFLASH_CHECK(static_cast<int64_t>(cache.k.size()) == cfg.num_layers &&
                   static_cast<int64_t>(cache.v.size()) == cfg.num_layers,
               "drafter cache holds {} layers, the drafter has {}", cache.k.size(), cfg.num_layers);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    DFLASH_CHECK(static_cast<int64_t>(cache.k[l].size()) == Tc * d.KD &&
                     static_cast<int64_t>(cache.v[l].size()) == Tc * d.KD,
                 "drafter cache layer {} holds {} k and {} v values, expected {}", l,
                 cache.k[l].size(), cache.v[l].size(), Tc * d.KD);
  }
  rope_table(ws.inv_freq, cfg);
  ws.layers.resize(static_cast<size_t>(cfg.num_layers));
  ws.pos_kv.resize(static_cast<size_t>(Tc + K));
  ws.pos_q.resize(static_cast<size_t>(K));
  ws.block_tokens.resize(static_cast<size_t>(K));
  ws.ranges.resize(static_cast<size_t>(K));
  for (int64_t j = 0; j < K; ++j) {
    ws.pos_q[j] = static_cast<int32_t>(Tc + j);
    ws.pos_kv[Tc + j] = ws.pos_q[j];
    ws.block_tokens[j] = j == 0 ? anchor_token : cfg.mask_token_id;
    ws.ranges[j] = AttnRange{0, static_cast<int32_t>(Tc), static_cast<int32_t>(Tc),
                             static_cast<int32_t>(Tc + K)};
  }
  {
    const CacheLoan loan(cache, ws, d.KD);
    block_forward(cfg, layout, params, tables.embed, ws, Tc, K, ws.ranges.data());
  }
  fit(ws.hf, K * d.H);
  rmsnorm_fwd_cpu(ws.hf.data(), nullptr, ws.h.data(), params + layout.norm, K, d.H,
                  cfg.rms_norm_eps);
  fit(ws.logits, K * d.V);
  linear_fwd_cpu(ws.logits.data(), ws.hf.data(), tables.lm_head, nullptr, K, d.H, d.V);
  return {ws.logits.data(), static_cast<size_t>(K * d.V)};
}

#define DFLASH_DRAFTER_INSTANTIATE(S)                                                    \
  template DrafterTrainResult drafter_train_step<S>(                                     \
      const DrafterConfig&, const DrafterLayout&, const S*, S*, const DrafterTables<S>&, \
      const DrafterBatch&, const S*, double, DrafterWorkspace<S>&, const S*);            \
  template std::vector<S> drafter_block_logits<S>(                                       \
      const DrafterConfig&, const DrafterLayout&, const S*, const DrafterTables<S>&,     \
      const DrafterBatch&, const S*, DrafterWorkspace<S>&);
DFLASH_DRAFTER_INSTANTIATE(float)
DFLASH_DRAFTER_INSTANTIATE(double)

}  // namespace dflash
