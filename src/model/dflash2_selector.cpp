#include "model/dflash2_selector.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>

#include "core/error.hpp"
#include "ops/linear.hpp"
#include "ops/loss_weights.hpp"

namespace dflash {

double dflash2_selector_alpha(double alpha, double warmup_ratio, double ramp_ratio, int64_t step,
                              int64_t total_steps) {
  DFLASH_CHECK(step >= 0 && total_steps >= 0, "dflash2 selector schedule at step {} of {}", step,
               total_steps);
  const double steps = static_cast<double>(total_steps);
  const double warmup = warmup_ratio * steps, ramp = ramp_ratio * steps;
  const double done = static_cast<double>(step + 1) - warmup;  // steps past the warmup
  if (done <= 0) return 0.0;
  if (ramp <= 0) return alpha;
  return alpha * std::min(1.0, done / ramp);
}

template <typename S>
S dflash2_unary(S z, double m, double c) {
  const S x = static_cast<S>(m) * z;
  return c > 0 ? static_cast<S>(c) * std::tanh(x / static_cast<S>(c)) : x;
}

template <typename S>
void dflash2_topk(std::vector<int32_t>& cand, const S* unary, int64_t V, int K) {
  DFLASH_CHECK(K >= 1 && K <= V, "dflash2 top-K of {} among {} logits", K, V);
  auto before = [unary](int32_t a, int32_t b) {
    return unary[a] > unary[b] || (unary[a] == unary[b] && a < b);
  };
  // A heap of the K best so far (its top is the worst of them), then sorted.
  cand.resize(static_cast<size_t>(K));
  std::iota(cand.begin(), cand.end(), 0);
  std::make_heap(cand.begin(), cand.end(), before);
  for (int64_t v = K; v < V; ++v) {
    const auto id = static_cast<int32_t>(v);
    if (!before(id, cand.front())) continue;
    std::pop_heap(cand.begin(), cand.end(), before);
    cand.back() = id;
    std::push_heap(cand.begin(), cand.end(), before);
  }
  std::sort_heap(cand.begin(), cand.end(), before);
}

namespace {

// One supervised row's selector term: C_k, S_k(prev, ·), the K-way CE when the gold is a
// candidate (returns false otherwise) and, with `scale` ≠ 0, its gradient scale·∂sel: dunary
// [V] += (unless stop), dhsel [H] += (unless stop), dA, dBs, dP_h +=.
template <typename S>
struct SelectorRow {
  const DrafterConfig& cfg;
  const DrafterLayout& layout;
  const S* params;
  S* grads;
  Dflash2Workspace<S>& ws;

  bool run(const S* unary, const S* h, int32_t prev, int32_t gold, double scale, bool stop,
           S* dunary, S* dhsel, double& ce) {
    const int64_t V = cfg.vocab_size, H = cfg.hidden_size, r = cfg.dflash2.selector_rank;
    const int K = cfg.dflash2.selector_top_k;
    dflash2_topk(ws.cand, unary, V, K);
    const auto g = std::find(ws.cand.begin(), ws.cand.end(), gold) - ws.cand.begin();
    if (g == K) return false;
    const S* A = params + layout.dflash2.predecessor;
    const S* Bs = params + layout.dflash2.successor;
    const S* Ph = params + layout.dflash2.hidden_proj;
    ws.proj.resize(static_cast<size_t>(r));
    linear_fwd_cpu(ws.proj.data(), h, Ph, nullptr, 1, H, r);
    ws.e.resize(static_cast<size_t>(r));
    for (int64_t q = 0; q < r; ++q) ws.e[q] = A[prev * r + q] * ws.proj[q];
    ws.score.resize(static_cast<size_t>(K));
    S mx = -INFINITY;
    for (int j = 0; j < K; ++j) {
      S dot = 0;
      for (int64_t q = 0; q < r; ++q) dot += ws.e[q] * Bs[ws.cand[j] * r + q];
      ws.score[j] = unary[ws.cand[j]] + dot;
      mx = std::max(mx, ws.score[j]);
    }
    S z = 0;
    for (int j = 0; j < K; ++j) z += std::exp(ws.score[j] - mx);
    ce = static_cast<double>(mx + std::log(z) - ws.score[g]);
    if (scale == 0 || grads == nullptr) return true;
    // dS_j = scale·(softmax_j − [j = g]); S_j = ū[c_j] + ⟨e, Bs[c_j]⟩, e = A[prev] ⊙ P_h·h.
    ws.dproj.assign(static_cast<size_t>(r), S(0));  // holds ∂e first
    S* dBs = grads + layout.dflash2.successor;
    for (int j = 0; j < K; ++j) {
      const S ds = static_cast<S>(scale) * (std::exp(ws.score[j] - mx) / z - S(j == g ? 1 : 0));
      const int64_t c = ws.cand[j];
      for (int64_t q = 0; q < r; ++q) {
        ws.dproj[q] += ds * Bs[c * r + q];
        dBs[c * r + q] += ds * ws.e[q];
      }
      if (!stop) dunary[c] += ds;
    }
    S* dA = grads + layout.dflash2.predecessor;
    for (int64_t q = 0; q < r; ++q) {
      dA[prev * r + q] += ws.dproj[q] * ws.proj[q];
      ws.dproj[q] *= A[prev * r + q];  // now ∂(P_h·h)
    }
    // dP_h += ∂proj ⊗ h; dh += P_hᵀ·∂proj.
    S* dPh = grads + layout.dflash2.hidden_proj;
    for (int64_t q = 0; q < r; ++q) {
      for (int64_t c = 0; c < H; ++c) {
        dPh[q * H + c] += ws.dproj[q] * h[c];
        if (!stop) dhsel[c] += ws.dproj[q] * Ph[q * H + c];
      }
    }
    return true;
  }
};

// The end of the chunk of rows that starts at row j0: at most `chunk` rows (chunk ≥ K), cut at a
// block boundary, so that a block's rows (consecutive in `rows`) share a chunk and D-PACE's
// weights, which depend on every slot of the block, are known before any of its gradients.
int64_t chunk_end(const std::vector<int32_t>& rows, int64_t j0, int64_t chunk, int64_t K) {
  const auto R = static_cast<int64_t>(rows.size());
  int64_t j1 = std::min(j0 + chunk, R);
  if (j1 == R) return j1;
  while (j1 > j0 && rows[j1] / K == rows[j1 - 1] / K) --j1;
  DFLASH_CHECK(j1 > j0, "dflash2 head step: a block of more than {} rows", chunk);
  return j1;
}

}  // namespace

template <typename S>
Dflash2Sums dflash2_head_step(const DrafterConfig& cfg, const DrafterLayout& layout,
                              const S* params, S* grads, const S* lm_head,
                              const DrafterBatch& batch, const S* hf, double grad_scale, S* dhf,
                              int32_t* argmax, Dflash2Workspace<S>& ws) {
  const Objective& obj = batch.objective;
  DFLASH_CHECK(cfg.dflash2.enabled, "dflash2 head step on a drafter without DFlash2's selector");
  DFLASH_CHECK(obj.dflash2(), "dflash2 head step on a batch of objective {}",
               objective_kind_name(obj.kind));
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, K = cfg.block_size;
  const int64_t NK = batch.N() * K;
  const double m = cfg.dflash2.output_multiplier, cap = cfg.dflash2.final_logit_softcapping;
  const double alpha = obj.dflash2_selector_alpha;
  const BlockTargets& t = batch.targets;
  Dflash2Sums sums;
  std::fill(argmax, argmax + NK, -1);
  if (grads) std::fill(dhf, dhf + NK * H, S(0));
  ws.rows.clear();
  for (int64_t i = 0; i < NK; ++i) {
    if (t.weights[i] != 0.0f || t.counted[i]) ws.rows.push_back(static_cast<int32_t>(i));
  }
  const int64_t R = static_cast<int64_t>(ws.rows.size());
  const int64_t chunk =
      std::max<int64_t>(K, ws.chunk_rows > 0 ? ws.chunk_rows : (int64_t(1) << 22) / V);
  SelectorRow<S> sel{cfg, layout, params, grads, ws};
  for (int64_t j0 = 0, j1 = 0; j0 < R; j0 = j1) {
    j1 = chunk_end(ws.rows, j0, chunk, K);
    const int64_t n = j1 - j0;
    const auto nz = static_cast<size_t>(n);
    ws.hin.resize(nz * static_cast<size_t>(H));
    for (int64_t j = 0; j < n; ++j) {
      std::copy_n(hf + ws.rows[j0 + j] * H, H, ws.hin.data() + j * H);
    }
    ws.logits.resize(nz * static_cast<size_t>(V));
    linear_fwd_cpu(ws.logits.data(), ws.hin.data(), lm_head, nullptr, n, H, V);
    // Pass 1: ū in place of U, its argmax and the base CE of every row of the chunk.
    ws.row_max.resize(nz);
    ws.row_sum.resize(nz);
    ws.row_ce.resize(nz);
    ws.row_weight.resize(nz);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = ws.rows[j0 + j];
      const int32_t y = t.labels[i];
      DFLASH_CHECK(y >= 0 && y < V, "dflash2 head step: block row {} has label {} outside [0, {})",
                   i, y, V);
      S* u = ws.logits.data() + j * V;
      for (int64_t v = 0; v < V; ++v) u[v] = dflash2_unary(u[v], m, cap);
      int64_t best = 0;
      S mx = u[0];
      for (int64_t v = 1; v < V; ++v) {
        if (u[v] > mx) mx = u[v], best = v;
      }
      argmax[i] = static_cast<int32_t>(best);
      S z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(u[v] - mx);
      ws.row_max[j] = mx;
      ws.row_sum[j] = z;
      ws.row_ce[j] = static_cast<double>(mx + std::log(z) - u[y]);
    }
    // The rows' weights: dflash's static ones, or D-PACE's from the base CE of their blocks
    // (constants of the step: no gradient flows through them).
    if (obj.dpace()) {
      const auto chunk_rows =
          std::span<const int32_t>(ws.rows).subspan(static_cast<size_t>(j0), nz);
      dpace_row_weights(ws.row_weight, chunk_rows, ws.row_ce, t.counted, K, obj);
    } else {
      for (int64_t j = 0; j < n; ++j) ws.row_weight[j] = t.weights[ws.rows[j0 + j]];
    }
    // Pass 2: the weighted base CE, the selector's term and the gradients.
    ws.dunary.assign(nz * static_cast<size_t>(V), S(0));
    ws.dhsel.assign(nz * static_cast<size_t>(H), S(0));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = ws.rows[j0 + j], slot = i % K;
      const int32_t y = t.labels[i];
      const double w = ws.row_weight[j];
      const S* u = ws.logits.data() + j * V;
      sums.base_sum += w * ws.row_ce[j];
      sums.weight_sum += w;
      S* du = ws.dunary.data() + j * V;
      if (grads) {
        const S c = static_cast<S>(grad_scale * w), mx = ws.row_max[j], z = ws.row_sum[j];
        for (int64_t v = 0; v < V; ++v) du[v] = c * (std::exp(u[v] - mx) / z);
        du[y] -= c;
      }
      // Selector: predecessor x[a+k−1] (the anchor token at slot 1), gold x[a+k].
      if (slot > 0) {
        const int32_t prev = slot == 1 ? batch.tokens[static_cast<size_t>(batch.anchors[i / K].pos)]
                                       : t.labels[i - 1];
        DFLASH_CHECK(prev >= 0 && prev < V,
                     "dflash2 head step: block row {} has predecessor {} outside [0, {})", i, prev,
                     V);
        double ce = 0;
        const double scale = grad_scale * alpha * w;
        if (sel.run(u, ws.hin.data() + j * H, prev, y, scale, obj.dflash2_stop_gradient, du,
                    ws.dhsel.data() + j * H, ce)) {
          sums.selector_sum += w * ce;
          sums.in_topk_weight += w;
        }
      }
      if (!grads) continue;
      // Through the transform: ∂ū/∂U = m·(1 − (ū/c)²) (softcap) or m.
      for (int64_t v = 0; v < V; ++v) {
        du[v] *= cap > 0 ? static_cast<S>(m) * (S(1) - (u[v] / S(cap)) * (u[v] / S(cap)))
                         : static_cast<S>(m);
      }
    }
    if (!grads) continue;
    ws.dhin.resize(nz * static_cast<size_t>(H));
    linear_bwd_cpu(ws.dhin.data(), static_cast<S*>(nullptr), static_cast<S*>(nullptr),
                   ws.dunary.data(), ws.hin.data(), lm_head, n, H, V);
    for (int64_t j = 0; j < n; ++j) {
      S* d = dhf + ws.rows[j0 + j] * H;
      for (int64_t c = 0; c < H; ++c) d[c] = ws.dhin[j * H + c] + ws.dhsel[j * H + c];
    }
  }
  sums.loss_sum = sums.base_sum + alpha * sums.selector_sum;
  return sums;
}

template <typename S>
std::vector<S> dflash2_unary_logits(const DrafterConfig& cfg, const S* lm_head, const S* hf,
                                    int64_t rows) {
  const int64_t V = cfg.vocab_size;
  std::vector<S> out(static_cast<size_t>(rows * V));
  linear_fwd_cpu(out.data(), hf, lm_head, nullptr, rows, cfg.hidden_size, V);
  for (S& x : out) {
    x = dflash2_unary(x, cfg.dflash2.output_multiplier, cfg.dflash2.final_logit_softcapping);
  }
  return out;
}

void dflash2_slot_scores(const DrafterConfig& cfg, const DrafterLayout& layout, const float* params,
                         const float* logits, const float* h, int32_t prev,
                         Dflash2SlotScores& out) {
  DFLASH_CHECK(cfg.dflash2.enabled, "dflash2 slot scores of a drafter without a selector");
  const int64_t V = cfg.vocab_size, H = cfg.hidden_size, r = cfg.dflash2.selector_rank;
  const int K = cfg.dflash2.selector_top_k;
  DFLASH_CHECK(prev >= 0 && prev < V, "dflash2 walk: predecessor token {} outside [0, {})", prev,
               V);
  out.unary.resize(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) {
    out.unary[v] = dflash2_unary(logits[v], cfg.dflash2.output_multiplier,
                                 cfg.dflash2.final_logit_softcapping);
  }
  dflash2_topk(out.cand, out.unary.data(), V, K);
  out.proj.resize(static_cast<size_t>(r));
  linear_fwd_cpu(out.proj.data(), h, params + layout.dflash2.hidden_proj, nullptr, 1, H, r);
  const float* A = params + layout.dflash2.predecessor + static_cast<int64_t>(prev) * r;
  const float* Bs = params + layout.dflash2.successor;
  out.score.resize(static_cast<size_t>(K));
  for (int j = 0; j < K; ++j) {
    float dot = 0;
    for (int64_t q = 0; q < r; ++q) dot += A[q] * out.proj[q] * Bs[out.cand[j] * r + q];
    out.score[j] = out.unary[out.cand[j]] + dot;
  }
}

int32_t dflash2_greedy(const Dflash2SlotScores& s) {
  DFLASH_CHECK(!s.score.empty(), "dflash2 walk: no candidates");
  const auto best = std::max_element(s.score.begin(), s.score.end()) - s.score.begin();
  return s.cand[static_cast<size_t>(best)];
}

void dflash2_sampling_probs(std::vector<double>& q, const Dflash2SlotScores& s, int64_t V,
                            double temperature) {
  DFLASH_CHECK(temperature > 0 && std::isfinite(temperature),
               "dflash2 sampling at temperature {} (must be > 0)", temperature);
  const auto inv_t = static_cast<float>(1.0 / temperature);
  const float mx = *std::max_element(s.score.begin(), s.score.end()) * inv_t;
  float z = 0;
  for (float x : s.score) z += std::exp(x * inv_t - mx);
  q.assign(static_cast<size_t>(V), 0.0);
  for (size_t j = 0; j < s.cand.size(); ++j) {
    q[static_cast<size_t>(s.cand[j])] = static_cast<double>(std::exp(s.score[j] * inv_t - mx) / z);
  }
}

#define DFLASH2_SELECTOR_INSTANTIATE(S)                                                           \
  template S dflash2_unary<S>(S, double, double);                                                 \
  template void dflash2_topk<S>(std::vector<int32_t>&, const S*, int64_t, int);                   \
  template Dflash2Sums dflash2_head_step<S>(const DrafterConfig&, const DrafterLayout&, const S*, \
                                            S*, const S*, const DrafterBatch&, const S*, double,  \
                                            S*, int32_t*, Dflash2Workspace<S>&);                  \
  template std::vector<S> dflash2_unary_logits<S>(const DrafterConfig&, const S*, const S*,       \
                                                  int64_t);
DFLASH2_SELECTOR_INSTANTIATE(float)
DFLASH2_SELECTOR_INSTANTIATE(double)

}  // namespace dflash
