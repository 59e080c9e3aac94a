// dflash.cpp — the target model's CPU forward. See model/target.hpp for the model and invariants.
#include "model/target.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/log.hpp"
#include "model/safetensors.hpp"
#include "model/weights.hpp"
#include "ops/attention.hpp"
#include "ops/embedding.hpp"
#include "ops/linear.hpp"
#include "ops/moe.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

// ------------------------------------------------------------------------------------------ rope

RopeParams rope_params_from_config(const ModelConfig& c) {
  return rope_params_from_config(c.rope, c.source + " (" + c.model_type + ")");
}

// -------------------------------------------------------------------------------------- kv cache

TargetKvCache::TargetKvCache(const ModelConfig& c)
    : n_layers_(c.num_hidden_layers),
      kv_dim_(c.num_key_value_heads * c.head_dim),
      k_(static_cast<size_t>(c.num_hidden_layers)),
      v_(static_cast<size_t>(c.num_hidden_layers)) {}

void TargetKvCache::truncate(int64_t new_len) {
  DFLASH_CHECK(new_len >= 0 && new_len <= len_,
               "KV cache: cannot roll back to length {}: the cache holds {} tokens (valid lengths "
               "are 0..{})",
               new_len, len_, len_);
  len_ = new_len;
}

// ---------------------------------------------------------------------------------------- loading

namespace {

// A matrix as stored (bf16/f32 zero-copy view) or converted to an owning f32 tensor (other float
// dtypes, or bf16 when f32 weights are asked for). Each tensor's bytes are read once.
Tensor load_matrix(const SafetensorsCheckpoint& ck, const std::string& name, bool f32) {
  const DType dt = ck.info(name).dtype;
  Tensor t = (dt == DType::f32 || (dt == DType::bf16 && !f32)) ? ck.get(name)
                                                               : ck.get_as(name, DType::f32);
  DFLASH_ASSERT(t.is_contiguous());
  return t;
}

std::vector<float> load_vector(const SafetensorsCheckpoint& ck, const std::string& name) {
  return ck.get(name).to_f32_vector();
}

std::vector<float> load_opt_vector(const SafetensorsCheckpoint& ck, const std::string& name,
                                   bool present) {
  return present ? load_vector(ck, name) : std::vector<float>{};
}

// Qwen3-MoE experts: zero-copy views of the per-expert modules.
void load_qwen3_moe(TargetMoe& moe, const SafetensorsCheckpoint& ck, const ModelConfig& c,
                    const std::string& m, bool f32) {
  moe.router = load_matrix(ck, m + "gate.weight", f32);
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string x = m + "experts." + std::to_string(e) + ".";
    moe.gate.push_back(load_matrix(ck, x + "gate_proj.weight", f32));
    moe.up.push_back(load_matrix(ck, x + "up_proj.weight", f32));
    moe.down.push_back(load_matrix(ck, x + "down_proj.weight", f32));
  }
}

// dst [rows, cols] = src [cols, rows]ᵀ restricted to every `step`-th source column from `first`:
// dst[i][j] = src[j][first + step·i] (src row stride src_cols). Element type of both: S.
template <typename S>
void transpose_strided(S* dst, const S* src, int64_t rows, int64_t cols, int64_t src_cols,
                       int64_t first, int64_t step) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[i * cols + j] = src[j * src_cols + first + step * i];
}

// Every `step`-th row of src [.., cols] from `first`, copied: dst[i] = src[first + step·i].
template <typename S>
void rows_strided(S* dst, const S* src, int64_t rows, int64_t cols, int64_t first, int64_t step) {
  for (int64_t i = 0; i < rows; ++i)
    std::copy_n(src + (first + step * i) * cols, cols, dst + i * cols);
}

// gpt-oss experts as [OUT, IN] matrices: gate/up from gate_up_proj [E, H, 2EI] (interleaved
// columns: gate = even, up = odd) or from MXFP4 [E, 2EI, H] (interleaved rows), down from
// down_proj [E, EI, H] or MXFP4 [E, H, EI]. Output dtype: bf16 when the source is bf16 or MXFP4
// (unless f32 weights are asked for), else f32.
void load_gpt_oss_moe(TargetMoe& moe, const SafetensorsCheckpoint& ck, const ModelConfig& c,
                      const std::string& m, bool f32) {
  const int64_t E = c.num_experts, H = c.hidden_size, EI = c.expert_width;
  moe.router = load_matrix(ck, m + "router.weight", f32);
  moe.router_bias = load_vector(ck, m + "router.bias");
  const std::string x = m + "experts.";
  const bool mxfp4 = c.quantization == "mxfp4";
  const DType src_dt = mxfp4 ? DType::bf16 : ck.info(x + "gate_up_proj").dtype;
  const DType dt = src_dt == DType::bf16 && !f32 ? DType::bf16 : DType::f32;
  auto expert_tensor = [&](int64_t out, int64_t in) { return Tensor::empty({out, in}, dt); };
  // One expert's source matrix as `dt` elements: [rows, cols] (copy or dequantised).
  auto source = [&](const std::string& name, int64_t e) -> Tensor {
    if (mxfp4) {
      const Tensor blocks = ck.get(name + "_blocks").select(0, e);  // [rows, G, 16]
      const Tensor scales = ck.get(name + "_scales").select(0, e);  // [rows, G]
      const int64_t rows = blocks.dim(0), G = blocks.dim(1);
      Tensor out = Tensor::empty({rows, G * 32}, DType::bf16);
      mxfp4_dequantize_cpu(out.data<uint16_t>(), blocks.contiguous().data<uint8_t>(),
                           scales.contiguous().data<uint8_t>(), rows, G);
      return dt == DType::bf16 ? out : out.to(DType::f32);
    }
    const Tensor t = ck.get(name).select(0, e);
    return t.dtype() == dt ? t.contiguous() : t.to(dt);
  };
  auto relayout = [&](Tensor& dst, const Tensor& src, bool transpose, int64_t first, int64_t step) {
    const int64_t rows = dst.dim(0), cols = dst.dim(1);
    if (dt == DType::bf16) {
      if (transpose)
        transpose_strided(dst.data<uint16_t>(), src.data<uint16_t>(), rows, cols, src.dim(1),
                          first, step);
      else
        rows_strided(dst.data<uint16_t>(), src.data<uint16_t>(), rows, cols, first, step);
    } else {
      if (transpose)
        transpose_strided(dst.data<float>(), src.data<float>(), rows, cols, src.dim(1), first,
                          step);
      else
        rows_strided(dst.data<float>(), src.data<float>(), rows, cols, first, step);
    }
  };
  for (int64_t e = 0; e < E; ++e) {
    const Tensor gu = source(x + "gate_up_proj", e);  // [H, 2EI], or [2EI, H] when mxfp4
    Tensor g = expert_tensor(EI, H), u = expert_tensor(EI, H);
    relayout(g, gu, !mxfp4, 0, 2);
    relayout(u, gu, !mxfp4, 1, 2);
    const Tensor dn = source(x + "down_proj", e);  // [EI, H], or [H, EI] when mxfp4
    Tensor d = expert_tensor(H, EI);
    relayout(d, dn, !mxfp4, 0, 1);
    moe.gate.push_back(std::move(g));
    moe.up.push_back(std::move(u));
    moe.down.push_back(std::move(d));
  }
  const std::vector<float> gub = load_vector(ck, x + "gate_up_proj_bias");  // [E, 2EI]
  moe.gate_bias.resize(static_cast<size_t>(E * EI));
  moe.up_bias.resize(static_cast<size_t>(E * EI));
  for (int64_t i = 0; i < E * EI; ++i) {
    moe.gate_bias[static_cast<size_t>(i)] = gub[static_cast<size_t>(2 * i)];
    moe.up_bias[static_cast<size_t>(i)] = gub[static_cast<size_t>(2 * i + 1)];
  }
  moe.down_bias = load_vector(ck, x + "down_proj_bias");
}

}  // namespace

TargetModel TargetModel::load(const std::filesystem::path& dir, const TargetLoadOptions& opts) {
  TargetModel m;
  m.cfg_ = model_config_load(dir);
  const ModelConfig& c = m.cfg_;
  m.rope_ = rope_params_from_config(c);
  {
    const std::vector<double> f = rope_inv_freq(m.rope_, c.head_dim);
    m.inv_freq_.assign(f.begin(), f.end());
    m.rope_scaling_ = static_cast<float>(rope_attention_scaling(m.rope_));
  }
  const SafetensorsCheckpoint ck(dir);
  check_weights(c, ck);  // every tensor present with its shape, or an error listing them

  const bool f32 = opts.f32_weights;
  m.embed_ = load_matrix(ck, "model.embed_tokens.weight", f32);
  m.lm_head_ = c.tie_word_embeddings ? m.embed_ : load_matrix(ck, "lm_head.weight", f32);
  m.final_norm_ = load_vector(ck, "model.norm.weight");
  m.layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    TargetLayer& L = m.layers_[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string a = p + "self_attn.", f = p + "mlp.";
    L.wq = load_matrix(ck, a + "q_proj.weight", f32);
    L.wk = load_matrix(ck, a + "k_proj.weight", f32);
    L.wv = load_matrix(ck, a + "v_proj.weight", f32);
    L.wo = load_matrix(ck, a + "o_proj.weight", f32);
    L.bq = load_opt_vector(ck, a + "q_proj.bias", c.attention_bias);
    L.bk = load_opt_vector(ck, a + "k_proj.bias", c.attention_bias);
    L.bv = load_opt_vector(ck, a + "v_proj.bias", c.attention_bias);
    L.bo = load_opt_vector(ck, a + "o_proj.bias", c.o_proj_bias);
    L.q_norm = load_opt_vector(ck, a + "q_norm.weight", c.qk_norm);
    L.k_norm = load_opt_vector(ck, a + "k_norm.weight", c.qk_norm);
    L.sinks = load_opt_vector(ck, a + "sinks", c.attention_sinks);
    L.is_moe = c.moe_layers[static_cast<size_t>(l)];
    if (L.is_moe && c.arch == Arch::qwen3_moe) {
      load_qwen3_moe(L.moe, ck, c, f, f32);
    } else if (L.is_moe) {
      load_gpt_oss_moe(L.moe, ck, c, f, f32);
    } else {
      L.wgate = load_matrix(ck, f + "gate_proj.weight", f32);
      L.wup = load_matrix(ck, f + "up_proj.weight", f32);
      L.wdown = load_matrix(ck, f + "down_proj.weight", f32);
      L.bgate = load_opt_vector(ck, f + "gate_proj.bias", c.mlp_bias);
      L.bup = load_opt_vector(ck, f + "up_proj.bias", c.mlp_bias);
      L.bdown = load_opt_vector(ck, f + "down_proj.bias", c.mlp_bias);
    }
    L.input_norm = load_vector(ck, p + "input_layernorm.weight");
    L.post_norm = load_vector(ck, p + "post_attention_layernorm.weight");
    L.sliding = c.layer_types[static_cast<size_t>(l)] == LayerType::sliding_attention;
  }
  return m;
}

// ---------------------------------------------------------------------------------------- forward

/// Positions of the new rows and their key ranges into the layer's K/V array (Tk rows: the cache,
/// then the new rows).
struct TargetModel::Rows {
  std::vector<int32_t> pos;
  std::vector<AttnRange> full, sliding;  // sliding empty when no layer slides
  int64_t Tk = 0;
};

namespace {

// y = x·Wᵀ (+ b) with W as stored.
void linear(float* y, const float* x, const Tensor& w, const std::vector<float>& b, int64_t T,
            int64_t in, int64_t out) {
  const float* bias = b.empty() ? nullptr : b.data();
  if (w.dtype() == DType::bf16) {
    linear_fwd_cpu(y, x, w.data<uint16_t>(), bias, T, in, out);
  } else {
    DFLASH_ASSERT(w.dtype() == DType::f32);
    linear_fwd_cpu(y, x, w.data<float>(), bias, T, in, out);
  }
}

void embed(float* y, const Tensor& table, const int32_t* ids, int64_t T, int64_t V, int64_t H) {
  if (table.dtype() == DType::bf16) {
    embedding_fwd_cpu(y, table.data<uint16_t>(), ids, T, V, H);
  } else {
    DFLASH_ASSERT(table.dtype() == DType::f32);
    embedding_fwd_cpu(y, table.data<float>(), ids, T, V, H);
  }
}

void fit(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// y[R, 0:OUT] (row stride ldy) = x[R, IN]·W_eᵀ per expert, weights `w` of one dtype.
void grouped_linear(float* y, int64_t ldy, const float* x, const std::vector<Tensor>& w,
                    const int32_t* offsets, int64_t R, int64_t IN, int64_t OUT) {
  const int64_t E = static_cast<int64_t>(w.size());
  if (w.front().dtype() == DType::bf16) {
    std::vector<const uint16_t*> p;
    for (const Tensor& t : w) p.push_back(t.data<uint16_t>());
    moe_grouped_linear_cpu(y, ldy, x, p.data(), offsets, E, R, IN, OUT);
  } else {
    std::vector<const float*> p;
    for (const Tensor& t : w) p.push_back(t.data<float>());
    moe_grouped_linear_cpu(y, ldy, x, p.data(), offsets, E, R, IN, OUT);
  }
}

const float* opt(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// x[T, H] += the sparse MoE block of `m` applied to hn [T, H] (ops/moe.hpp pipeline).
void moe_block(float* x, const float* hn, const TargetMoe& m, const ModelConfig& c, int64_t T) {
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t EI = c.expert_width, R = T * K;
  std::vector<float> logits(static_cast<size_t>(T * E)), w(static_cast<size_t>(R));
  std::vector<int32_t> ids(static_cast<size_t>(R)), perm(ids.size()), slot(ids.size());
  std::vector<int32_t> row_expert(ids.size()), offsets(static_cast<size_t>(E + 1));
  linear(logits.data(), hn, m.router, m.router_bias, T, H, E);
  moe_route_cpu(ids.data(), w.data(), logits.data(), T, E,
                MoeRouting{c.routing, K, c.norm_topk_prob});
  moe_dispatch_cpu(perm.data(), slot.data(), offsets.data(), row_expert.data(), ids.data(), T, K,
                   E);
  std::vector<float> xs(static_cast<size_t>(R * H)), gu(static_cast<size_t>(R * 2 * EI));
  moe_gather_cpu(xs.data(), hn, perm.data(), R, K, H);
  grouped_linear(gu.data(), 2 * EI, xs.data(), m.gate, offsets.data(), R, H, EI);
  grouped_linear(gu.data() + EI, 2 * EI, xs.data(), m.up, offsets.data(), R, H, EI);
  const MoeGlu glu{c.expert_activation, static_cast<float>(c.swiglu_alpha),
                   static_cast<float>(c.swiglu_limit)};
  std::vector<float> act(static_cast<size_t>(R * EI));
  moe_glu_cpu(act.data(), gu.data(), gu.data() + EI, 2 * EI, opt(m.gate_bias), opt(m.up_bias),
              row_expert.data(), R, EI, glu);
  grouped_linear(xs.data(), H, act.data(), m.down, offsets.data(), R, EI, H);  // ys reuses xs
  moe_combine_cpu(x, xs.data(), opt(m.down_bias), ids.data(), w.data(), slot.data(), T, K, H);
}

// Activations of one forward: residual stream, normed input, q, attention output, k/v of a
// forward without cache, MLP gate and up.
struct ForwardScratch {
  std::vector<float> x, hn, q, o, k, v, gate, up;
};

}  // namespace

int32_t argmax_row(const float* row, int64_t n) {
  DFLASH_CHECK(n > 0, "argmax of an empty row");
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return static_cast<int32_t>(best);
}

void TargetModel::check_request(std::span<const int32_t> tokens, const ForwardOptions& opts) const {
  DFLASH_CHECK(!tokens.empty(), "target forward: empty input (no tokens)");
  const int64_t V = cfg_.vocab_size;
  for (size_t t = 0; t < tokens.size(); ++t) {
    DFLASH_CHECK(tokens[t] >= 0 && tokens[t] < V,
                 "target forward: token id {} at position {} is outside the vocabulary [0, {}) of "
                 "{}",
                 tokens[t], t, V, cfg_.source);
  }
  const int64_t N = cfg_.num_hidden_layers;
  for (int l : opts.tap_layers) {
    DFLASH_CHECK(l >= 0 && l < N,
                 "target forward: tap layer {} is out of range: valid layers are 0..{} ({} has {} "
                 "decoder layers)",
                 l, N - 1, cfg_.source, N);
  }
}

ForwardResult TargetModel::forward(std::span<const int32_t> tokens,
                                   std::span<const int32_t> doc_offsets,
                                   const ForwardOptions& opts) const {
  check_request(tokens, opts);
  const int64_t T = static_cast<int64_t>(tokens.size());
  DFLASH_CHECK(doc_offsets.size() >= 2,
               "target forward: doc_offsets needs at least 2 entries [0, ..., T={}], got {}", T,
               doc_offsets.size());
  const int64_t n_docs = static_cast<int64_t>(doc_offsets.size()) - 1;
  DFLASH_CHECK(doc_offsets.front() == 0 && doc_offsets.back() == T,
               "target forward: document offsets must cover the tokens: they run from {} to {}, "
               "expected 0 to T={}",
               doc_offsets.front(), doc_offsets.back(), T);
  Rows rows;
  rows.Tk = T;
  rows.full = attention_causal_varlen_ranges(doc_offsets.data(), n_docs, T);  // validates order
  rows.pos.resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    rows.pos[static_cast<size_t>(t)] =
        static_cast<int32_t>(t - rows.full[static_cast<size_t>(t)].lo1);
  if (cfg_.num_sliding_layers() > 0) {
    // HF sliding_window_overlay: key k is visible from query q when q - W < k <= q.
    rows.sliding.resize(rows.full.size());
    attention_window_ranges(rows.sliding.data(), rows.full.data(), T, cfg_.sliding_window);
  }
  return run(tokens.data(), T, rows, nullptr, opts);
}

Tensor TargetModel::forward_taps(std::span<const int32_t> tokens,
                                 std::span<const int32_t> doc_offsets,
                                 std::span<const int> layer_ids) const {
  DFLASH_CHECK(!layer_ids.empty(),
               "target forward_taps: no layers requested (valid layers are "
               "0..{})",
               cfg_.num_hidden_layers - 1);
  ForwardOptions o;
  o.tap_layers.assign(layer_ids.begin(), layer_ids.end());
  o.logits = LogitsRows::none;
  return forward(tokens, doc_offsets, o).taps;
}

Tensor TargetModel::forward_logits(std::span<const int32_t> tokens,
                                   std::span<const int32_t> doc_offsets) const {
  return forward(tokens, doc_offsets, ForwardOptions{{}, LogitsRows::all, false}).logits;
}

ForwardResult TargetModel::append(TargetKvCache& cache, std::span<const int32_t> tokens,
                                  const ForwardOptions& opts) const {
  check_request(tokens, opts);
  DFLASH_CHECK(cache.n_layers_ == cfg_.num_hidden_layers &&
                   cache.kv_dim_ == cfg_.num_key_value_heads * cfg_.head_dim,
               "KV cache was built for another model ({} layers, kv width {}; {} has {} and {})",
               cache.n_layers_, cache.kv_dim_, cfg_.source, cfg_.num_hidden_layers,
               cfg_.num_key_value_heads * cfg_.head_dim);
  const int64_t K = static_cast<int64_t>(tokens.size());
  const int64_t past = cache.len_;
  Rows rows;
  rows.Tk = past + K;
  DFLASH_CHECK(rows.Tk <= INT32_MAX, "KV cache: {} tokens exceed the int32 position range",
               rows.Tk);
  rows.pos.resize(static_cast<size_t>(K));
  rows.full.resize(static_cast<size_t>(K));
  for (int64_t j = 0; j < K; ++j) {
    const int64_t p = past + j;
    rows.pos[static_cast<size_t>(j)] = static_cast<int32_t>(p);
    rows.full[static_cast<size_t>(j)] = AttnRange{0, static_cast<int32_t>(p + 1), 0, 0};
  }
  if (cfg_.num_sliding_layers() > 0) {
    rows.sliding.resize(rows.full.size());
    attention_window_ranges(rows.sliding.data(), rows.full.data(), K, cfg_.sliding_window);
  }
  try {
    ForwardResult r = run(tokens.data(), K, rows, &cache, opts);
    cache.len_ = past + K;
    return r;
  } catch (...) {
    cache.len_ = past;  // rows past `past` may hold partial data; they are not part of the cache
    throw;
  }
}

ForwardResult TargetModel::prefill(TargetKvCache& cache, std::span<const int32_t> tokens,
                                   const ForwardOptions& opts) const {
  DFLASH_CHECK(cache.length() == 0,
               "prefill needs an empty KV cache, this one holds {} tokens (truncate(0) first)",
               cache.length());
  return append(cache, tokens, opts);
}

ForwardResult TargetModel::run(const int32_t* tokens, int64_t T, const Rows& rows,
                               TargetKvCache* cache, const ForwardOptions& opts) const {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, D = c.head_dim, NH = c.num_attention_heads;
  const int64_t NKV = c.num_key_value_heads, QD = NH * D, KD = NKV * D;
  const int64_t I = c.intermediate_size, V = c.vocab_size;
  const double eps = c.rms_norm_eps;
  const bool need_top = opts.logits != LogitsRows::none || opts.final_norm;

  // Layers to run: all with a cache (it needs every layer's k/v) or when the top is asked for;
  // otherwise up to the deepest tap.
  int64_t n_run = c.num_hidden_layers;
  if (!cache && !need_top) {
    n_run = 0;
    for (int l : opts.tap_layers) n_run = std::max<int64_t>(n_run, l + 1);
  }

  ForwardResult res;
  const int64_t n_taps = static_cast<int64_t>(opts.tap_layers.size());
  float* taps = nullptr;
  if (n_taps > 0) {
    res.taps = Tensor::empty({T, n_taps * H}, DType::f32);
    taps = res.taps.data<float>();
  }

  // Activations live in the calling thread's scratch, kept between calls: a training step or a
  // decoding step then allocates (and page-faults) nothing but its outputs. Buffers only grow.
  thread_local ForwardScratch scratch;
  std::vector<float>&x = scratch.x, &hn = scratch.hn, &q = scratch.q, &o = scratch.o;
  std::vector<float>&kloc = scratch.k, &vloc = scratch.v, &gate = scratch.gate, &up = scratch.up;
  fit(x, T * H);
  fit(hn, T * H);
  fit(q, T * QD);
  fit(o, T * QD);
  fit(gate, T * I);
  fit(up, T * I);
  if (!cache) {
    fit(kloc, T * KD);
    fit(vloc, T * KD);
  }
  embed(x.data(), embed_, tokens, T, V, H);

  AttnParams ap;
  ap.Tq = T;
  ap.Tk = rows.Tk;
  ap.NH = NH;
  ap.NKV = NKV;
  ap.D = D;
  ap.scale = 1.0 / std::sqrt(static_cast<double>(D));  // HF: self.scaling = head_dim**-0.5
  const int64_t past = rows.Tk - T;

  for (int64_t l = 0; l < n_run; ++l) {
    const TargetLayer& L = layers_[static_cast<size_t>(l)];
    float *kall, *vall;  // K/V arrays of Tk rows; the new rows start at row `past`
    if (cache) {
      std::vector<float>& kc = cache->k_[static_cast<size_t>(l)];
      std::vector<float>& vc = cache->v_[static_cast<size_t>(l)];
      fit(kc, rows.Tk * KD);
      fit(vc, rows.Tk * KD);
      kall = kc.data();
      vall = vc.data();
    } else {
      kall = kloc.data();
      vall = vloc.data();
    }
    float* knew = kall + past * KD;
    float* vnew = vall + past * KD;

    // Attention block (HF *Attention.forward).
    rmsnorm_fwd_cpu(hn.data(), nullptr, x.data(), L.input_norm.data(), T, H, eps);
    linear(q.data(), hn.data(), L.wq, L.bq, T, H, QD);
    linear(knew, hn.data(), L.wk, L.bk, T, H, KD);
    linear(vnew, hn.data(), L.wv, L.bv, T, H, KD);
    if (c.qk_norm) {  // Qwen3: RMSNorm over each head's D values, before RoPE
      rmsnorm_fwd_cpu(q.data(), nullptr, q.data(), L.q_norm.data(), T * NH, D, eps);
      rmsnorm_fwd_cpu(knew, nullptr, knew, L.k_norm.data(), T * NKV, D, eps);
    }
    rope_fwd_cpu(q.data(), q.data(), rows.pos.data(), inv_freq_.data(), rope_scaling_, T, NH, D);
    rope_fwd_cpu(knew, knew, rows.pos.data(), inv_freq_.data(), rope_scaling_, T, NKV, D);
    const std::vector<AttnRange>& ranges = L.sliding ? rows.sliding : rows.full;
    ap.sinks = opt(L.sinks);
    attention_fwd_cpu(o.data(), nullptr, q.data(), kall, vall, ranges.data(), ap);
    linear(hn.data(), o.data(), L.wo, L.bo, T, QD, H);
    residual_accumulate_cpu(x.data(), hn.data(), T * H);

    // MLP block (HF *MLP.forward: down(act(gate(x)) * up(x))), or the sparse MoE block.
    rmsnorm_fwd_cpu(hn.data(), nullptr, x.data(), L.post_norm.data(), T, H, eps);
    if (L.is_moe) {
      moe_block(x.data(), hn.data(), L.moe, c, T);
    } else {
      linear(gate.data(), hn.data(), L.wgate, L.bgate, T, H, I);
      linear(up.data(), hn.data(), L.wup, L.bup, T, H, I);
      swiglu_fwd_cpu(gate.data(), gate.data(), up.data(), T, I, I);
      linear(hn.data(), gate.data(), L.wdown, L.bdown, T, I, H);
      residual_accumulate_cpu(x.data(), hn.data(), T * H);
    }

    for (int64_t i = 0; i < n_taps; ++i) {
      if (opts.tap_layers[static_cast<size_t>(i)] != l) continue;
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(taps + t * n_taps * H + i * H, x.data() + t * H,
                    static_cast<size_t>(H) * sizeof(float));
    }
  }
  if (!need_top) return res;

  // Final norm and LM head.
  const int64_t R = opts.logits == LogitsRows::last && !opts.final_norm ? 1 : T;
  const float* xin = x.data() + (T - R) * H;
  rmsnorm_fwd_cpu(hn.data(), nullptr, xin, final_norm_.data(), R, H, eps);
  if (opts.final_norm) {
    res.final_norm = Tensor::empty({T, H}, DType::f32);
    std::memcpy(res.final_norm.data<float>(), hn.data(),
                static_cast<size_t>(T * H) * sizeof(float));
  }
  if (opts.logits == LogitsRows::all) {
    res.logits = Tensor::empty({T, V}, DType::f32);
    linear(res.logits.data<float>(), hn.data(), lm_head_, {}, T, H, V);
  } else if (opts.logits == LogitsRows::last) {
    res.logits = Tensor::empty({1, V}, DType::f32);
    linear(res.logits.data<float>(), hn.data() + (R - 1) * H, lm_head_, {}, 1, H, V);
  }
  return res;
}

void TargetModel::lm_head_rows(float* logits, const float* normed, int64_t rows) const {
  DFLASH_CHECK(rows >= 0, "target lm_head_rows: negative row count {}", rows);
  if (rows > 0) linear(logits, normed, lm_head_, {}, rows, cfg_.hidden_size, cfg_.vocab_size);
}

// ------------------------------------------------------------------------------------- generation

std::vector<int32_t> greedy_generate(const TargetModel& model, std::span<const int32_t> prompt,
                                     int64_t max_new_tokens, std::span<const int64_t> eos_ids,
                                     bool use_cache) {
  DFLASH_CHECK(!prompt.empty(), "greedy generation: empty prompt");
  DFLASH_CHECK(max_new_tokens >= 0, "greedy generation: max_new_tokens must be >= 0, got {}",
               max_new_tokens);
  const int64_t V = model.vocab_size();
  auto is_eos = [&](int32_t t) {
    return std::find(eos_ids.begin(), eos_ids.end(), static_cast<int64_t>(t)) != eos_ids.end();
  };
  std::vector<int32_t> out;
  if (max_new_tokens == 0) return out;
  const ForwardOptions last{{}, LogitsRows::last, false};
  if (use_cache) {
    TargetKvCache cache = model.new_cache();
    ForwardResult r = model.prefill(cache, prompt, last);
    for (;;) {
      const int32_t t = argmax_row(r.logits.data<float>(), V);
      out.push_back(t);
      if (is_eos(t) || static_cast<int64_t>(out.size()) >= max_new_tokens) break;
      r = model.append(cache, std::span<const int32_t>(&out.back(), 1), last);
    }
  } else {
    std::vector<int32_t> seq(prompt.begin(), prompt.end());
    for (;;) {
      const int32_t offs[2] = {0, static_cast<int32_t>(seq.size())};
      const ForwardResult r = model.forward(seq, offs, last);
      const int32_t t = argmax_row(r.logits.data<float>(), V);
      out.push_back(t);
      seq.push_back(t);
      if (is_eos(t) || static_cast<int64_t>(out.size()) >= max_new_tokens) break;
    }
  }
  return out;
}

std::vector<int64_t> generation_eos_ids(const std::filesystem::path& dir, const ModelConfig& c) {
  const std::filesystem::path gen = dir / "generation_config.json";
  if (!std::filesystem::exists(gen)) return c.eos_token_ids;
  const nlohmann::json j = json_load_file(gen);
  const std::string src = gen.string();
  DFLASH_CHECK(j.is_object(), "{}: expected a JSON object, got {}", src, json_type(j));
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return c.eos_token_ids;
  const nlohmann::json& e = j["eos_token_id"];
  std::vector<int64_t> ids;
  auto add = [&](const nlohmann::json& v) {
    DFLASH_CHECK(v.is_number_integer(),
                 "{}: 'eos_token_id' must be an integer or a list of "
                 "integers, got {}",
                 src, v.dump());
    DFLASH_CHECK(v.get<int64_t>() >= 0 && v.get<int64_t>() < c.vocab_size,
                 "{}: 'eos_token_id' holds {}, which is not a token of the model's vocabulary "
                 "[0, {})",
                 src, v.dump(), c.vocab_size);
    ids.push_back(v.get<int64_t>());
  };
  if (e.is_array()) {
    for (const auto& v : e) add(v);
  } else {
    add(e);
  }
  return ids;
}

}  // namespace dflash
