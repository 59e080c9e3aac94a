#include "model/dspark_head.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "ops/linear.hpp"

namespace dflash {

namespace {

template <typename S>
void fit(std::vector<S>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
}

template <typename S>
S sigmoid(S x) {
  return S(1) / (S(1) + std::exp(-x));
}

// The rows of one chunk of blocks: rows [r0, r0 + M), whole blocks.
struct Chunk {
  int64_t r0 = 0, M = 0;
};

// Previous tokens p_k = x[a+k] of the chunk's rows (teacher forcing; 0 past the document end).
template <typename S>
void chunk_prev(const DrafterBatch& b, Chunk c, DsparkWorkspace<S>& ws) {
  const int64_t K = b.block_size;
  ws.prev.resize(static_cast<size_t>(c.M));
  for (int64_t i = 0; i < c.M; ++i) {
    const int64_t row = c.r0 + i, block = row / K, k = row % K;
    const Anchor& a = b.anchors[static_cast<size_t>(block)];
    const int64_t pos = a.pos + k;
    ws.prev[i] = pos < b.doc_offsets[static_cast<size_t>(a.doc) + 1] ? b.tokens[pos] : 0;
  }
}

// Markov bias latent z [M, r] of the chunk (vanilla: e; gated: σ(Wg[h; e] + bg)⊙e; rnn: tanh o),
// keeping what the backward needs; then logits += z·W2ᵀ.
template <typename S>
void markov_forward(const DrafterConfig& cfg, const DrafterLayout& L, const S* params, const S* hf,
                    int64_t M, S* logits, DsparkWorkspace<S>& ws) {
  const int64_t r = cfg.dspark.markov_rank, H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t K = cfg.block_size;
  fit(ws.emb, M * r);
  const S* w1 = params + L.dspark.markov_w1;
  for (int64_t i = 0; i < M; ++i) std::copy_n(w1 + ws.prev[i] * r, r, ws.emb.data() + i * r);
  fit(ws.z, M * r);
  switch (cfg.dspark.markov_type) {
    case MarkovHeadType::vanilla:
      std::copy(ws.emb.begin(), ws.emb.end(), ws.z.begin());
      break;
    case MarkovHeadType::gated: {
      const int64_t G = H + r;
      fit(ws.gate_in, M * G);
      for (int64_t i = 0; i < M; ++i) {
        std::copy_n(hf + i * H, H, ws.gate_in.data() + i * G);
        std::copy_n(ws.emb.data() + i * r, r, ws.gate_in.data() + i * G + H);
      }
      fit(ws.gate_pre, M * r);
      linear_fwd_cpu(ws.gate_pre.data(), ws.gate_in.data(), params + L.dspark.gate_w,
                     params + L.dspark.gate_b, M, G, r);
      for (int64_t j = 0; j < M * r; ++j) ws.z[j] = sigmoid(ws.gate_pre[j]) * ws.emb[j];
      break;
    }
    case MarkovHeadType::rnn: {
      // Row i = slot k of its block reads [s_{k−1}; e_k; h_k]; s_{−1} = 0.
      const int64_t J = 2 * r + H;
      fit(ws.rnn_in, M * J);
      fit(ws.rnn_u, M * 3 * r);
      fit(ws.rnn_s, M * r);
      for (int64_t i = 0; i < M; ++i) {
        S* in = ws.rnn_in.data() + i * J;
        if (i % K == 0) {
          std::fill_n(in, r, S(0));
        } else {
          std::copy_n(ws.rnn_s.data() + (i - 1) * r, r, in);
        }
        std::copy_n(ws.emb.data() + i * r, r, in + r);
        std::copy_n(hf + i * H, H, in + 2 * r);
        S* u = ws.rnn_u.data() + i * 3 * r;
        linear_fwd_cpu(u, in, params + L.dspark.joint_w, params + L.dspark.joint_b, 1, J, 3 * r);
        for (int64_t j = 0; j < r; ++j) {
          const S g = sigmoid(u[j]);
          ws.rnn_s[i * r + j] = g * in[j] + (S(1) - g) * std::tanh(u[r + j]);
          ws.z[i * r + j] = std::tanh(u[2 * r + j]);
        }
      }
      break;
    }
  }
  fit(ws.dz, M * V);  // the bias, added to the logits
  linear_fwd_cpu(ws.dz.data(), ws.z.data(), params + L.dspark.markov_w2, nullptr, M, r, V);
  for (int64_t j = 0; j < M * V; ++j) logits[j] += ws.dz[j];
}

// Backward of markov_forward from dD [M, V]: dW2, the head's parameters, dW1 rows and dhf += .
template <typename S>
void markov_backward(const DrafterConfig& cfg, const DrafterLayout& L, const S* params, S* grads,
                     const S* dD, int64_t M, S* dhf, DsparkWorkspace<S>& ws) {
  const int64_t r = cfg.dspark.markov_rank, H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t K = cfg.block_size;
  fit(ws.dz, M * r);
  linear_bwd_cpu(ws.dz.data(), grads + L.dspark.markov_w2, static_cast<S*>(nullptr), dD,
                 ws.z.data(), params + L.dspark.markov_w2, M, r, V);
  // ws.demb already holds the confidence head's part (or 0).
  switch (cfg.dspark.markov_type) {
    case MarkovHeadType::vanilla:
      for (int64_t j = 0; j < M * r; ++j) ws.demb[j] += ws.dz[j];
      break;
    case MarkovHeadType::gated: {
      const int64_t G = H + r;
      fit(ws.dgate_pre, M * r);
      for (int64_t j = 0; j < M * r; ++j) {
        const S g = sigmoid(ws.gate_pre[j]);
        ws.demb[j] += ws.dz[j] * g;
        ws.dgate_pre[j] = ws.dz[j] * ws.emb[j] * g * (S(1) - g);
      }
      fit(ws.dgate_in, M * G);
      linear_bwd_cpu(ws.dgate_in.data(), grads + L.dspark.gate_w, grads + L.dspark.gate_b,
                     ws.dgate_pre.data(), ws.gate_in.data(), params + L.dspark.gate_w, M, G, r);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t h = 0; h < H; ++h) dhf[i * H + h] += ws.dgate_in[i * G + h];
        for (int64_t j = 0; j < r; ++j) ws.demb[i * r + j] += ws.dgate_in[i * G + H + j];
      }
      break;
    }
    case MarkovHeadType::rnn: {
      // Backwards through each block's slots; ds carries ∂/∂s_k from the slots after k.
      const int64_t J = 2 * r + H;
      fit(ws.du, M * 3 * r);
      fit(ws.din, J);
      std::vector<S> ds(static_cast<size_t>(r));
      for (int64_t b0 = 0; b0 < M; b0 += K) {
        std::fill(ds.begin(), ds.end(), S(0));
        for (int64_t i = b0 + K - 1; i >= b0; --i) {
          const S* in = ws.rnn_in.data() + i * J;
          const S* u = ws.rnn_u.data() + i * 3 * r;
          S* du = ws.du.data() + i * 3 * r;
          for (int64_t j = 0; j < r; ++j) {
            const S g = sigmoid(u[j]), c = std::tanh(u[r + j]), o = std::tanh(u[2 * r + j]);
            du[j] = ds[j] * (in[j] - c) * g * (S(1) - g);
            du[r + j] = ds[j] * (S(1) - g) * (S(1) - c * c);
            du[2 * r + j] = ws.dz[i * r + j] * (S(1) - o * o);
            ds[j] *= g;  // s_k = g⊙s_{k−1} + …: the direct path to s_{k−1}
          }
          linear_bwd_cpu(ws.din.data(), static_cast<S*>(nullptr), static_cast<S*>(nullptr), du, in,
                         params + L.dspark.joint_w, 1, J, 3 * r);
          for (int64_t j = 0; j < r; ++j) {
            ds[j] += ws.din[j];
            ws.demb[i * r + j] += ws.din[r + j];
          }
          for (int64_t h = 0; h < H; ++h) dhf[i * H + h] += ws.din[2 * r + h];
        }
      }
      linear_bwd_cpu(static_cast<S*>(nullptr), grads + L.dspark.joint_w, grads + L.dspark.joint_b,
                     ws.du.data(), ws.rnn_in.data(), params + L.dspark.joint_w, M, J, 3 * r);
      break;
    }
  }
  S* gw1 = grads + L.dspark.markov_w1;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < r; ++j) gw1[ws.prev[i] * r + j] += ws.demb[i * r + j];
  }
}

// Base logits U = hf·LMᵀ of the chunk, plus the Markov bias: D [M, V] in ws.logits.
template <typename S>
void chunk_logits(const DrafterConfig& cfg, const DrafterLayout& L, const S* params,
                  const S* lm_head, const S* hf, int64_t M, DsparkWorkspace<S>& ws) {
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  fit(ws.logits, M * V);
  linear_fwd_cpu(ws.logits.data(), hf, lm_head, nullptr, M, H, V);
  if (cfg.dspark.markov_rank > 0) markov_forward(cfg, L, params, hf, M, ws.logits.data(), ws);
}

// One supervised row: CE, L1 and the unit-weight loss gradient ∂(αce·CE + αl1·L1)/∂D written
// over the logits row `d` (in: D; out: the gradient). `t` [V] holds the teacher's logits.
struct RowStats {
  double ce = 0, l1 = 0;
  int32_t argmax = 0;
};

template <typename S>
RowStats row_loss(S* d, const S* t, int32_t y, int64_t V, double a_ce, double a_l1) {
  RowStats st;
  S md = d[0], mt = t[0];
  for (int64_t v = 1; v < V; ++v) {
    if (d[v] > md) {
      md = d[v];
      st.argmax = static_cast<int32_t>(v);
    }
    mt = std::max(mt, t[v]);
  }
  double sd = 0, stt = 0;
  for (int64_t v = 0; v < V; ++v) {
    sd += std::exp(static_cast<double>(d[v] - md));
    stt += std::exp(static_cast<double>(t[v] - mt));
  }
  const double lse = static_cast<double>(md) + std::log(sd);
  const double lst = static_cast<double>(mt) + std::log(stt);
  st.ce = lse - static_cast<double>(d[y]);
  double sp = 0;  // Σ_v P_v·sign(P_v − T_v)
  for (int64_t v = 0; v < V; ++v) {
    const double p = std::exp(static_cast<double>(d[v]) - lse);
    const double q = std::exp(static_cast<double>(t[v]) - lst);
    st.l1 += std::abs(p - q);
    sp += p * static_cast<double>((p > q) - (p < q));
  }
  for (int64_t v = 0; v < V; ++v) {
    const double p = std::exp(static_cast<double>(d[v]) - lse);
    const double q = std::exp(static_cast<double>(t[v]) - lst);
    const double sign = static_cast<double>((p > q) - (p < q));
    d[v] = static_cast<S>(a_ce * (p - (v == y ? 1.0 : 0.0)) + a_l1 * p * (sign - sp));
  }
  return st;
}

template <typename S>
void check_dspark(const DrafterConfig& cfg, const DrafterLayout& layout, const DrafterBatch& b) {
  DFLASH_CHECK(cfg.dspark.enabled, "DSpark head step for a drafter without DSpark heads");
  DFLASH_CHECK(b.objective.dspark() && b.targets.first_slot == 0,
               "DSpark head step given a batch of the {} objective",
               objective_kind_name(b.objective.kind));
  DFLASH_CHECK(b.block_size == cfg.block_size,
               "DSpark head step: a batch of block size {} for a drafter of block size {}",
               b.block_size, cfg.block_size);
  DFLASH_CHECK(cfg.dspark.markov_rank == 0 || layout.dspark.markov_w1 >= 0,
               "DSpark head step: the layout has no Markov head for markov_rank {}",
               cfg.dspark.markov_rank);
}

// Rows per chunk: whole blocks, about 2^21 logits per [M, V] buffer.
int64_t chunk_rows(int64_t K, int64_t V) {
  return std::max<int64_t>(1, (int64_t(1) << 21) / (V * K)) * K;
}

}  // namespace

template <typename S>
DsparkSums dspark_head_step(const DrafterConfig& cfg, const DrafterLayout& layout, const S* params,
                            S* grads, const S* lm_head, const DrafterBatch& batch, const S* hf,
                            const S* target_final, double grad_scale, S* dhf, int32_t* argmax,
                            const Objective& obj, DsparkWorkspace<S>& ws) {
  check_dspark<S>(cfg, layout, batch);
  DFLASH_CHECK(target_final != nullptr || batch.T() == 0,
               "DSpark head step without the target's final hidden states (the teacher)");
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, K = cfg.block_size;
  const int64_t NK = batch.N() * K, r = cfg.dspark.markov_rank;
  const bool conf = cfg.dspark.confidence_head;
  const int64_t Hc = cfg.dspark.confidence_in(H);
  const double a_conf = conf ? obj.dspark_conf_alpha : 0.0;
  DsparkSums sums;
  sums.conf.assign(static_cast<size_t>(NK), std::numeric_limits<double>::quiet_NaN());
  sums.acc.assign(static_cast<size_t>(NK), std::numeric_limits<double>::quiet_NaN());
  const int64_t CM = chunk_rows(K, V);
  for (int64_t r0 = 0; r0 < NK; r0 += CM) {
    const Chunk c{r0, std::min(CM, NK - r0)};
    const S* hfc = hf + c.r0 * H;
    chunk_prev(batch, c, ws);
    chunk_logits(cfg, layout, params, lm_head, hfc, c.M, ws);
    // Teacher logits LMhead(Hl[a+k]) of the supervised rows (0 elsewhere, never read).
    fit(ws.teacher, c.M * H);
    for (int64_t i = 0; i < c.M; ++i) {
      const int64_t row = c.r0 + i;
      S* t = ws.teacher.data() + i * H;
      if (batch.targets.weights[row] == 0.0f) {
        std::fill_n(t, H, S(0));
        continue;
      }
      const int64_t pos = batch.anchors[static_cast<size_t>(row / K)].pos + row % K;
      std::copy_n(target_final + pos * H, H, t);
    }
    std::vector<S>& tl = ws.tlogits;
    fit(tl, c.M * V);
    linear_fwd_cpu(tl.data(), ws.teacher.data(), lm_head, nullptr, c.M, H, V);
    // Confidence head c = wc·x + bc.
    if (conf) {
      fit(ws.conf_in, c.M * Hc);
      for (int64_t i = 0; i < c.M; ++i) {
        std::copy_n(hfc + i * H, H, ws.conf_in.data() + i * Hc);
        if (Hc > H) std::copy_n(ws.emb.data() + i * r, r, ws.conf_in.data() + i * Hc + H);
      }
      fit(ws.conf, c.M);
      linear_fwd_cpu(ws.conf.data(), ws.conf_in.data(), params + layout.dspark.conf_w,
                     params + layout.dspark.conf_b, c.M, Hc, 1);
    }
    fit(ws.dconf, c.M);
    for (int64_t i = 0; i < c.M; ++i) {
      const int64_t row = c.r0 + i;
      const double w = batch.targets.weights[row];
      S* d = ws.logits.data() + i * V;
      ws.dconf[i] = S(0);
      if (w == 0.0) {
        argmax[row] = -1;
        std::fill_n(d, V, S(0));
        continue;
      }
      const int32_t y = batch.targets.labels[row];
      DFLASH_CHECK(y >= 0 && y < V, "DSpark block row {}: label {} outside [0, {})", row, y, V);
      const RowStats st =
          row_loss(d, tl.data() + i * V, y, V, obj.dspark_ce_alpha, obj.dspark_l1_alpha);
      argmax[row] = st.argmax;
      const double acc = std::clamp(1.0 - st.l1 / 2.0, 0.0, 1.0);
      double bce = 0;
      sums.acc[row] = acc;
      if (conf) {
        const double z = static_cast<double>(ws.conf[i]);
        sums.conf[row] = z;
        bce = std::max(z, 0.0) - z * acc + std::log1p(std::exp(-std::abs(z)));
        ws.dconf[i] = static_cast<S>(grad_scale * w * a_conf * (1.0 / (1.0 + std::exp(-z)) - acc));
      }
      for (int64_t v = 0; v < V; ++v) d[v] = static_cast<S>(grad_scale * w * d[v]);
      sums.weight_sum += w;
      sums.ce_sum += w * st.ce;
      sums.l1_sum += w * st.l1;
      sums.bce_sum += w * bce;
      sums.acc_sum += w * acc;
      sums.loss_sum +=
          w * (obj.dspark_ce_alpha * st.ce + obj.dspark_l1_alpha * st.l1 + a_conf * bce);
    }
    if (!grads) continue;
    // ws.logits now holds dD. dhf = dD·LM (+ the heads' parts).
    S* dhfc = dhf + c.r0 * H;
    linear_bwd_cpu(dhfc, static_cast<S*>(nullptr), static_cast<S*>(nullptr), ws.logits.data(), hfc,
                   lm_head, c.M, H, V);
    fit(ws.demb, c.M * r);
    std::fill(ws.demb.begin(), ws.demb.end(), S(0));
    if (conf) {
      fit(ws.dconf_in, c.M * Hc);
      linear_bwd_cpu(ws.dconf_in.data(), grads + layout.dspark.conf_w, grads + layout.dspark.conf_b,
                     ws.dconf.data(), ws.conf_in.data(), params + layout.dspark.conf_w, c.M, Hc, 1);
      for (int64_t i = 0; i < c.M; ++i) {
        for (int64_t h = 0; h < H; ++h) dhfc[i * H + h] += ws.dconf_in[i * Hc + h];
        for (int64_t j = 0; j < Hc - H; ++j) ws.demb[i * r + j] += ws.dconf_in[i * Hc + H + j];
      }
    }
    if (r > 0) markov_backward(cfg, layout, params, grads, ws.logits.data(), c.M, dhfc, ws);
  }
  return sums;
}

template <typename S>
std::vector<S> dspark_block_logits(const DrafterConfig& cfg, const DrafterLayout& layout,
                                   const S* params, const S* lm_head, const DrafterBatch& batch,
                                   const S* hf, DsparkWorkspace<S>& ws) {
  check_dspark<S>(cfg, layout, batch);
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, K = cfg.block_size;
  const int64_t NK = batch.N() * K;
  std::vector<S> out(static_cast<size_t>(NK * V));
  const int64_t CM = chunk_rows(K, V);
  for (int64_t r0 = 0; r0 < NK; r0 += CM) {
    const Chunk c{r0, std::min(CM, NK - r0)};
    chunk_prev(batch, c, ws);
    chunk_logits(cfg, layout, params, lm_head, hf + c.r0 * H, c.M, ws);
    std::copy_n(ws.logits.data(), c.M * V, out.data() + c.r0 * V);
  }
  return out;
}

void dspark_slot_logits(const DrafterConfig& cfg, const DrafterLayout& layout, const float* params,
                        float* logits, const float* h, int32_t prev, int k, DsparkSlotState& st) {
  const int64_t r = cfg.dspark.markov_rank, H = cfg.hidden_size, V = cfg.vocab_size;
  DFLASH_CHECK(cfg.dspark.enabled, "DSpark slot logits for a drafter without DSpark heads");
  DFLASH_CHECK(k == 0 || k == st.next, "DSpark slot {} drafted after slot {}", k, st.next - 1);
  DFLASH_CHECK(prev >= 0 && prev < V, "DSpark slot {}: previous token {} outside [0, {})", k, prev,
               V);
  st.next = k + 1;
  if (r == 0) return;
  st.e.assign(params + layout.dspark.markov_w1 + prev * r,
              params + layout.dspark.markov_w1 + (prev + 1) * r);
  st.z.resize(static_cast<size_t>(r));
  switch (cfg.dspark.markov_type) {
    case MarkovHeadType::vanilla:
      st.z = st.e;
      break;
    case MarkovHeadType::gated: {
      st.in.assign(h, h + H);
      st.in.insert(st.in.end(), st.e.begin(), st.e.end());
      st.u.resize(static_cast<size_t>(r));
      linear_fwd_cpu(st.u.data(), st.in.data(), params + layout.dspark.gate_w,
                     params + layout.dspark.gate_b, 1, H + r, r);
      for (int64_t j = 0; j < r; ++j) st.z[j] = sigmoid(st.u[j]) * st.e[j];
      break;
    }
    case MarkovHeadType::rnn: {
      if (k == 0) st.s.assign(static_cast<size_t>(r), 0.0f);
      st.in = st.s;
      st.in.insert(st.in.end(), st.e.begin(), st.e.end());
      st.in.insert(st.in.end(), h, h + H);
      st.u.resize(static_cast<size_t>(3 * r));
      linear_fwd_cpu(st.u.data(), st.in.data(), params + layout.dspark.joint_w,
                     params + layout.dspark.joint_b, 1, 2 * r + H, 3 * r);
      for (int64_t j = 0; j < r; ++j) {
        const float g = sigmoid(st.u[j]);
        st.s[j] = g * st.s[j] + (1.0f - g) * std::tanh(st.u[r + j]);
        st.z[j] = std::tanh(st.u[2 * r + j]);
      }
      break;
    }
  }
  const float* w2 = params + layout.dspark.markov_w2;
  for (int64_t v = 0; v < V; ++v) {
    float acc = 0.0f;
    for (int64_t j = 0; j < r; ++j) acc += w2[v * r + j] * st.z[j];
    logits[v] += acc;
  }
}

#define DFLASH_DSPARK_INSTANTIATE(S)                                                           \
  template DsparkSums dspark_head_step<S>(                                                     \
      const DrafterConfig&, const DrafterLayout&, const S*, S*, const S*, const DrafterBatch&, \
      const S*, const S*, double, S*, int32_t*, const Objective&, DsparkWorkspace<S>&);        \
  template std::vector<S> dspark_block_logits<S>(const DrafterConfig&, const DrafterLayout&,   \
                                                 const S*, const S*, const DrafterBatch&,      \
                                                 const S*, DsparkWorkspace<S>&);
DFLASH_DSPARK_INSTANTIATE(float)
DFLASH_DSPARK_INSTANTIATE(double)

}  // namespace dflash
