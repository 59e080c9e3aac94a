// dflash.cpp — sampling and the speculative rejection rule (see sampling.hpp for the formulas).
#include "infer/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.hpp"
#include "model/target.hpp"

namespace dflash {

void SamplingParams::validate() const {
  DFLASH_CHECK(std::isfinite(temperature) && temperature >= 0.0,
               "sampling: temperature must be a finite number >= 0 (got {})", temperature);
  DFLASH_CHECK(top_k >= 0, "sampling: top_k must be >= 0 (0 = off), got {}", top_k);
  DFLASH_CHECK(top_p > 0.0 && top_p <= 1.0, "sampling: top_p must be in (0, 1] (got {})", top_p);
}

void sampling_probs(std::vector<double>& probs, std::span<const float> logits,
                    const SamplingParams& params) {
  DFLASH_CHECK(!params.greedy(), "sampling_probs: temperature 0 is greedy (no distribution)");
  const int64_t V = static_cast<int64_t>(logits.size());
  DFLASH_CHECK(V > 0, "sampling_probs: empty logits row");
  probs.assign(static_cast<size_t>(V), 0.0);
  const double inv_t = 1.0 / params.temperature;
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  // 1. temperature (scaled logits kept in probs for now).
  for (int64_t i = 0; i < V; ++i) {
    DFLASH_CHECK(!std::isnan(logits[i]), "sampling: logit {} is NaN", i);
    probs[i] = static_cast<double>(logits[i]) * inv_t;
  }
  // 2. top-k: threshold = k-th largest scaled logit; ties with it are kept (HF `<` comparison).
  if (params.top_k > 0 && params.top_k < V) {
    std::vector<double> tmp(probs);
    std::nth_element(tmp.begin(), tmp.begin() + (params.top_k - 1), tmp.end(),
                     std::greater<double>());
    const double kth = tmp[static_cast<size_t>(params.top_k - 1)];
    for (double& x : probs)
      if (x < kth) x = kNegInf;
  }
  // 4 (before 3, which works on probabilities): softmax over the kept tokens.
  const double mx = *std::max_element(probs.begin(), probs.end());
  DFLASH_CHECK(mx > kNegInf, "sampling: every logit is -inf");
  double sum = 0;
  for (double& x : probs) {
    x = (x == kNegInf) ? 0.0 : std::exp(x - mx);
    sum += x;
  }
  for (double& x : probs) x /= sum;
  // 3. top-p: keep the shortest prefix (by descending probability, ties by id) whose mass
  // reaches top_p, i.e. token i is kept iff the mass strictly before it is < top_p.
  if (params.top_p < 1.0) {
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
    double before = 0, kept = 0;
    size_t n_keep = 0;
    for (; n_keep < order.size(); ++n_keep) {
      if (before >= params.top_p && n_keep >= 1) break;
      before += probs[order[n_keep]];
    }
    for (size_t j = n_keep; j < order.size(); ++j) probs[order[j]] = 0.0;
    for (size_t j = 0; j < n_keep; ++j) kept += probs[order[j]];
    for (double& x : probs) x /= kept;
  }
}

int32_t sample_index(std::span<const double> probs, Rng& rng) {
  DFLASH_CHECK(!probs.empty(), "sample_index: empty distribution");
  double sum = 0;
  for (double x : probs) sum += x;
  DFLASH_CHECK(sum > 0 && std::isfinite(sum),
               "sample_index: the probabilities sum to {} (need a positive finite sum)", sum);
  const double u = rng.uniform() * sum;
  double acc = 0;
  int32_t last_nonzero = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    acc += probs[i];
    last_nonzero = static_cast<int32_t>(i);
    if (u < acc) return last_nonzero;
  }
  return last_nonzero;  // u within rounding of the total: the last token of positive mass
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params, Rng& rng,
                     std::vector<double>& scratch) {
  if (params.greedy()) return argmax_row(logits.data(), static_cast<int64_t>(logits.size()));
  sampling_probs(scratch, logits, params);
  return sample_index(scratch, rng);
}

double acceptance_probability(std::span<const double> p, std::span<const double> q, int32_t x) {
  DFLASH_CHECK(p.size() == q.size(), "speculative rule: p has {} entries, q has {}", p.size(),
               q.size());
  DFLASH_CHECK(x >= 0 && static_cast<size_t>(x) < q.size(),
               "speculative rule: draft token {} outside [0, {})", x, q.size());
  DFLASH_CHECK(q[x] > 0,
               "speculative rule: draft token {} has drafter probability {} (it cannot "
               "have been drawn from q)",
               x, q[x]);
  return std::min(1.0, p[x] / q[x]);
}

void residual_distribution(std::vector<double>& out, std::span<const double> p,
                           std::span<const double> q) {
  DFLASH_CHECK(p.size() == q.size(), "speculative rule: p has {} entries, q has {}", p.size(),
               q.size());
  out.resize(p.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    out[i] = std::max(0.0, p[i] - q[i]);
    sum += out[i];
  }
  if (sum > 0) {
    for (double& x : out) x /= sum;
  } else {
    out.assign(p.begin(), p.end());
  }
}

RejectionOutcome speculative_reject(std::span<const double> p, std::span<const double> q, int32_t x,
                                    Rng& rng, std::vector<double>& scratch) {
  const double a = acceptance_probability(p, q, x);
  if (rng.uniform() < a) return {true, x};
  residual_distribution(scratch, p, q);
  return {false, sample_index(scratch, rng)};
}

}  // namespace dflash
