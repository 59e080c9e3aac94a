#include "model/domino_head.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "ops/linear.hpp"

namespace dflash {

double domino_lambda(int64_t step, int64_t total_steps, double start, double decay_ratio) {
  if (total_steps <= 0) return 0.0;  // no horizon: the final loss only
  const auto horizon = std::max<int64_t>(
      1, static_cast<int64_t>(std::floor(static_cast<double>(total_steps) * decay_ratio)));
  const double progress = std::min(static_cast<double>(step) / static_cast<double>(horizon), 1.0);
  return std::clamp(start * (1.0 - progress), 0.0, 1.0);
}

namespace {

template <typename S>
void fit(std::vector<S>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
}

template <typename S>
S sigmoid(S x) {
  return S(1) / (S(1) + std::exp(-x));
}

// Sizes of the head.
struct HeadDims {
  int64_t H, G, E, V, K;
  explicit HeadDims(const DrafterConfig& c)
      : H(c.hidden_size),
        G(c.domino.gru_hidden_dim),
        E(c.domino.emb_dim),
        V(c.vocab_size),
        K(c.block_size) {}
};

// One GRU step (PyTorch nn.GRU without bias, gate rows r, z, n): g_out [G] from the input e [H]
// and the previous state g_in [G]; gates [4G] keeps r, z, n and W_hn·g_in for the backward.
// g_out must not alias g_in.
template <typename S>
void gru_step(const DrafterLayout& L, const S* params, const HeadDims& d, const S* e, const S* g_in,
              S* g_out, S* gates, DominoWorkspace<S>& ws) {
  const int64_t G = d.G;
  fit(ws.xi, 3 * G);
  fit(ws.hh, 3 * G);
  linear_fwd_cpu(ws.xi.data(), e, params + L.domino.gru_ih, nullptr, 1, d.H, 3 * G);
  linear_fwd_cpu(ws.hh.data(), g_in, params + L.domino.gru_hh, nullptr, 1, G, 3 * G);
  for (int64_t j = 0; j < G; ++j) {
    const S r = sigmoid(ws.xi[j] + ws.hh[j]);
    const S z = sigmoid(ws.xi[G + j] + ws.hh[G + j]);
    const S n = std::tanh(ws.xi[2 * G + j] + r * ws.hh[2 * G + j]);
    g_out[j] = (S(1) - z) * n + z * g_in[j];
    gates[j] = r;
    gates[G + j] = z;
    gates[2 * G + j] = n;
    gates[3 * G + j] = ws.hh[2 * G + j];
  }
}

// One row's correction: logits [V] += W2·SiLU(W1·[h; g]); in [H+G], a [E] and s [E] are kept.
template <typename S>
void head_correct(const DrafterLayout& L, const S* params, const HeadDims& d, const S* h,
                  const S* g, S* logits, S* in, S* a, S* s, DominoWorkspace<S>& ws) {
  std::copy_n(h, d.H, in);
  std::copy_n(g, d.G, in + d.H);
  linear_fwd_cpu(a, in, params + L.domino.proj1, nullptr, 1, d.H + d.G, d.E);
  for (int64_t j = 0; j < d.E; ++j) s[j] = a[j] * sigmoid(a[j]);
  fit(ws.head_delta, d.V);
  linear_fwd_cpu(ws.head_delta.data(), s, params + L.domino.proj2, nullptr, 1, d.E, d.V);
  for (int64_t v = 0; v < d.V; ++v) logits[v] += ws.head_delta[v];
}

// Softmax CE of one logits row z [V] at label y, in double; p [V] (may be null) receives
// softmax(z).
struct RowCe {
  double ce = 0;
  int32_t argmax = 0;
};

template <typename S>
RowCe row_ce(const S* z, int32_t y, int64_t V, S* p) {
  RowCe r;
  S m = z[0];
  for (int64_t v = 1; v < V; ++v) {
    if (z[v] > m) {
      m = z[v];
      r.argmax = static_cast<int32_t>(v);
    }
  }
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v] - m));
  const double lse = static_cast<double>(m) + std::log(sum);
  r.ce = lse - static_cast<double>(z[y]);
  if (p) {
    for (int64_t v = 0; v < V; ++v)
      p[v] = static_cast<S>(std::exp(static_cast<double>(z[v]) - lse));
  }
  return r;
}

// Token x[a+j] of the block's GRU input j (token 0 past the document end: no supervised row
// reads such a state).
int32_t block_token(const DrafterBatch& b, const Anchor& a, int64_t j) {
  const int64_t pos = a.pos + j;
  return pos < b.doc_offsets[static_cast<size_t>(a.doc) + 1] ? b.tokens[static_cast<size_t>(pos)]
                                                             : 0;
}

// The block's GRU forward with teacher forcing: ws.emb [steps, H], ws.states [steps, G] and
// ws.gates [steps, 4G].
template <typename S>
void block_gru(const DrafterConfig& cfg, const DrafterLayout& L, const S* params, const S* embed,
               const DrafterBatch& b, const Anchor& a, DominoWorkspace<S>& ws) {
  const HeadDims d(cfg);
  const int64_t steps = cfg.domino.gru_steps(cfg.block_size);
  fit(ws.emb, steps * d.H);
  fit(ws.states, steps * d.G);
  fit(ws.gates, steps * 4 * d.G);
  fit(ws.dg, d.G);  // the zero state g_{−1}
  std::fill(ws.dg.begin(), ws.dg.end(), S(0));
  for (int64_t j = 0; j < steps; ++j) {
    const int32_t tok = block_token(b, a, j);
    DFLASH_CHECK(tok >= 0 && tok < d.V, "domino head: token {} at position {} outside [0, {})", tok,
                 a.pos + j, d.V);
    std::copy_n(embed + static_cast<int64_t>(tok) * d.H, d.H, ws.emb.data() + j * d.H);
    const S* g_in = j == 0 ? ws.dg.data() : ws.states.data() + (j - 1) * d.G;
    gru_step(L, params, d, ws.emb.data() + j * d.H, g_in, ws.states.data() + j * d.G,
             ws.gates.data() + j * 4 * d.G, ws);
  }
}

// Backward of block_gru from ws.dstates [steps, G] (∂loss/∂g_j from the head): parameter
// gradients of W_ih and W_hh +=.
template <typename S>
void block_gru_backward(const DrafterConfig& cfg, const DrafterLayout& L, const S* params, S* grads,
                        DominoWorkspace<S>& ws) {
  const HeadDims d(cfg);
  const int64_t G = d.G, steps = cfg.domino.gru_steps(cfg.block_size);
  fit(ws.dxi, steps * 3 * G);
  fit(ws.dhh, steps * 3 * G);
  std::vector<S> carry(static_cast<size_t>(G), S(0)), dprev(static_cast<size_t>(G));
  std::vector<S> zero(static_cast<size_t>(G), S(0));
  for (int64_t j = steps - 1; j >= 0; --j) {
    const S* gt = ws.gates.data() + j * 4 * G;
    const S* gp = j == 0 ? zero.data() : ws.states.data() + (j - 1) * G;
    S* dxi = ws.dxi.data() + j * 3 * G;
    S* dhh = ws.dhh.data() + j * 3 * G;
    for (int64_t i = 0; i < G; ++i) {
      const S r = gt[i], z = gt[G + i], n = gt[2 * G + i], hn = gt[3 * G + i];
      const S dg = ws.dstates[j * G + i] + carry[i];
      const S dn = dg * (S(1) - z) * (S(1) - n * n);  // through tanh
      const S dz = dg * (gp[i] - n) * z * (S(1) - z);
      const S dr = dn * hn * r * (S(1) - r);
      dxi[i] = dr;
      dxi[G + i] = dz;
      dxi[2 * G + i] = dn;
      dhh[i] = dr;
      dhh[G + i] = dz;
      dhh[2 * G + i] = dn * r;
      carry[i] = dg * z;  // the direct path g_j = … + z ⊙ g_{j−1}
    }
    linear_bwd_cpu(dprev.data(), static_cast<S*>(nullptr), static_cast<S*>(nullptr), dhh, gp,
                   params + L.domino.gru_hh, 1, G, 3 * G);
    for (int64_t i = 0; i < G; ++i) carry[i] += dprev[i];
  }
  // W_ih += Σ_j dxi_jᵀ·e_j; W_hh += Σ_j dhh_jᵀ·g_{j−1} (g_{−1} = 0 adds nothing).
  linear_bwd_cpu(static_cast<S*>(nullptr), grads + L.domino.gru_ih, static_cast<S*>(nullptr),
                 ws.dxi.data(), ws.emb.data(), params + L.domino.gru_ih, steps, d.H, 3 * G);
  if (steps > 1) {
    linear_bwd_cpu(static_cast<S*>(nullptr), grads + L.domino.gru_hh, static_cast<S*>(nullptr),
                   ws.dhh.data() + 3 * G, ws.states.data(), params + L.domino.gru_hh, steps - 1, G,
                   3 * G);
  }
}

void check_head(const DrafterConfig& cfg, const DrafterLayout& L, const char* what) {
  DFLASH_CHECK(cfg.domino.enabled && L.domino.proj2 >= 0,
               "{}: the drafter has no Domino head (dflash_config.projector_type domino)", what);
}

// Backward of one supervised corrected row k of the current block: from dF [V] (ws.dfin row k),
// W2's and W1's gradients +=, dhf row += ∂/∂h, ws.dstates[s(k)] += ∂/∂g.
template <typename S>
void head_row_backward(const DrafterConfig& cfg, const DrafterLayout& L, const S* params, S* grads,
                       int64_t k, S* dhf_row, DominoWorkspace<S>& ws) {
  const HeadDims d(cfg);
  const int64_t HG = d.H + d.G;
  const S* a = ws.head_a.data() + k * d.E;
  const S* s = ws.head_s.data() + k * d.E;
  fit(ws.dhead_s, d.E);
  fit(ws.dhead_a, d.E);
  fit(ws.dhead_in, HG);
  linear_bwd_cpu(ws.dhead_s.data(), grads + L.domino.proj2, static_cast<S*>(nullptr),
                 ws.dfin.data() + k * d.V, s, params + L.domino.proj2, 1, d.E, d.V);
  for (int64_t j = 0; j < d.E; ++j) {
    const S sg = sigmoid(a[j]);
    ws.dhead_a[j] = ws.dhead_s[j] * sg * (S(1) + a[j] * (S(1) - sg));  // SiLU′
  }
  linear_bwd_cpu(ws.dhead_in.data(), grads + L.domino.proj1, static_cast<S*>(nullptr),
                 ws.dhead_a.data(), ws.head_in.data() + k * HG, params + L.domino.proj1, 1, HG,
                 d.E);
  for (int64_t h = 0; h < d.H; ++h) dhf_row[h] += ws.dhead_in[h];
  S* dg = ws.dstates.data() + cfg.domino.state_of_slot(static_cast<int>(k)) * d.G;
  for (int64_t i = 0; i < d.G; ++i) dg[i] += ws.dhead_in[d.H + i];
}

}  // namespace

template <typename S>
DominoSums domino_head_step(const DrafterConfig& cfg, const DrafterLayout& L, const S* params,
                            S* grads, const DrafterTables<S>& tables, const DrafterBatch& batch,
                            const S* hf, double grad_scale, S* dhf, int32_t* argmax,
                            DominoWorkspace<S>& ws) {
  check_head(cfg, L, "domino_head_step");
  const Objective& obj = batch.objective;
  DFLASH_CHECK(obj.domino(), "domino_head_step: a batch of the {} objective",
               objective_kind_name(obj.kind));
  const double lambda = obj.domino_lambda;
  DFLASH_CHECK(lambda >= 0 && lambda <= 1, "domino_head_step: lambda {} outside [0, 1]", lambda);
  const HeadDims d(cfg);
  const int64_t K = d.K, HG = d.H + d.G, N = batch.N();
  const int s0 = cfg.domino.suffix_start();
  DominoSums sums;
  if (grads) std::fill_n(dhf, N * K * d.H, S(0));
  fit(ws.base, K * d.V);
  fit(ws.fin, K * d.V);
  fit(ws.dbase, K * d.V);
  fit(ws.dfin, K * d.V);
  fit(ws.head_in, K * HG);
  fit(ws.head_a, K * d.E);
  fit(ws.head_s, K * d.E);
  for (int64_t b = 0; b < N; ++b) {
    const int64_t r0 = b * K;
    bool any = false;
    for (int64_t k = 0; k < K; ++k) any |= batch.targets.weights[r0 + k] != 0.0f;
    for (int64_t k = 0; k < K; ++k) argmax[r0 + k] = -1;
    if (!any) continue;
    block_gru(cfg, L, params, tables.embed, batch, batch.anchors[b], ws);
    linear_fwd_cpu(ws.base.data(), hf + r0 * d.H, tables.lm_head, nullptr, K, d.H, d.V);
    std::fill(ws.dbase.begin(), ws.dbase.end(), S(0));
    fit(ws.dstates, cfg.domino.gru_steps(static_cast<int>(K)) * d.G);
    std::fill(ws.dstates.begin(), ws.dstates.end(), S(0));
    for (int64_t k = 0; k < K; ++k) {
      const double w = batch.targets.weights[r0 + k];
      if (w == 0.0) continue;
      const int32_t y = batch.targets.labels[r0 + k];
      DFLASH_CHECK(y >= 0 && y < d.V, "domino head: label {} of block {} slot {} outside [0, {})",
                   y, b, k, d.V);
      S* u = ws.base.data() + k * d.V;
      S* f = ws.fin.data() + k * d.V;
      S* pu = ws.dbase.data() + k * d.V;
      S* pf = ws.dfin.data() + k * d.V;
      const bool corrected = k >= s0;
      std::copy_n(u, d.V, f);
      if (corrected) {
        const S* g = ws.states.data() + cfg.domino.state_of_slot(static_cast<int>(k)) * d.G;
        head_correct(L, params, d, hf + (r0 + k) * d.H, g, f, ws.head_in.data() + k * HG,
                     ws.head_a.data() + k * d.E, ws.head_s.data() + k * d.E, ws);
      }
      const RowCe cu = row_ce(u, y, d.V, grads ? pu : static_cast<S*>(nullptr));
      const RowCe cf = corrected ? row_ce(f, y, d.V, grads ? pf : static_cast<S*>(nullptr)) : cu;
      argmax[r0 + k] = cf.argmax;
      sums.weight_sum += w;
      sums.final_ce_sum += w * cf.ce;
      sums.base_ce_sum += w * cu.ce;
      sums.loss_sum += w * ((1.0 - lambda) * cf.ce + lambda * cu.ce);
      if (!grads) continue;
      // dU = c·λ·(p_U − 1_y) + dF, dF = c·(1−λ)·(p_F − 1_y) (F = U + correction); uncorrected
      // rows have F = U, so dU = c·(p_U − 1_y).
      const double c = grad_scale * w;
      pu[y] -= S(1);
      if (!corrected) {
        for (int64_t v = 0; v < d.V; ++v) pu[v] *= static_cast<S>(c);
        continue;
      }
      pf[y] -= S(1);
      for (int64_t v = 0; v < d.V; ++v) {
        pf[v] *= static_cast<S>(c * (1.0 - lambda));
        pu[v] = static_cast<S>(c * lambda) * pu[v] + pf[v];
      }
      head_row_backward(cfg, L, params, grads, k, dhf + (r0 + k) * d.H, ws);
    }
    if (!grads) continue;
    // dhf += dU·LM over the block's rows (rows without supervision have dU = 0).
    fit(ws.dhf, K * d.H);
    linear_bwd_cpu(ws.dhf.data(), static_cast<S*>(nullptr), static_cast<S*>(nullptr),
                   ws.dbase.data(), hf + r0 * d.H, tables.lm_head, K, d.H, d.V);
    for (int64_t j = 0; j < K * d.H; ++j) dhf[r0 * d.H + j] += ws.dhf[j];
    block_gru_backward(cfg, L, params, grads, ws);
  }
  return sums;
}

template <typename S>
std::vector<S> domino_block_logits(const DrafterConfig& cfg, const DrafterLayout& L,
                                   const S* params, const DrafterTables<S>& tables,
                                   const DrafterBatch& batch, const S* hf, DominoWorkspace<S>& ws) {
  check_head(cfg, L, "domino_block_logits");
  const HeadDims d(cfg);
  const int64_t K = d.K, HG = d.H + d.G, N = batch.N();
  std::vector<S> out(static_cast<size_t>(N * K * d.V));
  fit(ws.head_in, HG);
  fit(ws.head_a, d.E);
  fit(ws.head_s, d.E);
  for (int64_t b = 0; b < N; ++b) {
    block_gru(cfg, L, params, tables.embed, batch, batch.anchors[b], ws);
    S* rows = out.data() + b * K * d.V;
    linear_fwd_cpu(rows, hf + b * K * d.H, tables.lm_head, nullptr, K, d.H, d.V);
    for (int64_t k = cfg.domino.suffix_start(); k < K; ++k) {
      const S* g = ws.states.data() + cfg.domino.state_of_slot(static_cast<int>(k)) * d.G;
      head_correct(L, params, d, hf + (b * K + k) * d.H, g, rows + k * d.V, ws.head_in.data(),
                   ws.head_a.data(), ws.head_s.data(), ws);
    }
  }
  return out;
}

void domino_block_start(const DrafterConfig& cfg, DominoSlotState& st) {
  st.g.assign(static_cast<size_t>(cfg.domino.gru_hidden_dim), 0.0f);
  st.fed = 0;
}

void domino_feed(const DrafterConfig& cfg, const DrafterLayout& L, const float* params,
                 const float* embed, int32_t token, DominoSlotState& st) {
  check_head(cfg, L, "domino_feed");
  const HeadDims d(cfg);
  DFLASH_CHECK(token >= 0 && token < d.V, "domino_feed: token {} outside [0, {})", token, d.V);
  DFLASH_CHECK(st.fed < cfg.domino.gru_steps(cfg.block_size),
               "domino_feed: the block's GRU has read all its {} tokens",
               cfg.domino.gru_steps(cfg.block_size));
  DFLASH_CHECK(static_cast<int64_t>(st.g.size()) == d.G,
               "domino_feed: the state has {} values, gru_hidden_dim is {} (call "
               "domino_block_start first)",
               st.g.size(), d.G);
  fit(st.ws.states, d.G);
  fit(st.ws.gates, 4 * d.G);
  gru_step(L, params, d, embed + static_cast<int64_t>(token) * d.H, st.g.data(),
           st.ws.states.data(), st.ws.gates.data(), st.ws);
  st.g.swap(st.ws.states);
  st.fed += 1;
}

void domino_slot_logits(const DrafterConfig& cfg, const DrafterLayout& L, const float* params,
                        float* logits, const float* h, int k, DominoSlotState& st) {
  check_head(cfg, L, "domino_slot_logits");
  if (k < cfg.domino.suffix_start()) return;
  const int want = cfg.domino.state_of_slot(k) + 1;
  DFLASH_CHECK(st.fed == want,
               "domino_slot_logits: slot {} reads the state after {} tokens, the GRU has read {}",
               k, want, st.fed);
  const HeadDims d(cfg);
  fit(st.ws.head_in, d.H + d.G);
  fit(st.ws.head_a, d.E);
  fit(st.ws.head_s, d.E);
  head_correct(L, params, d, h, st.g.data(), logits, st.ws.head_in.data(), st.ws.head_a.data(),
               st.ws.head_s.data(), st.ws);
}

#define DFLASH_DOMINO_INSTANTIATE(S)                                                            \
  template DominoSums domino_head_step<S>(const DrafterConfig&, const DrafterLayout&, const S*, \
                                          S*, const DrafterTables<S>&, const DrafterBatch&,     \
                                          const S*, double, S*, int32_t*, DominoWorkspace<S>&); \
  template std::vector<S> domino_block_logits<S>(                                               \
      const DrafterConfig&, const DrafterLayout&, const S*, const DrafterTables<S>&,            \
      const DrafterBatch&, const S*, DominoWorkspace<S>&);
DFLASH_DOMINO_INSTANTIATE(float)
DFLASH_DOMINO_INSTANTIATE(double)

}  // namespace dflash
