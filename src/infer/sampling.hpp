// dflash.cpp — token sampling and the speculative rejection rule (DESIGN.md §1 "Inference").
//
// Processing of one logits row into a distribution, in HF `generate` order (transformers
// `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`):
//   1. temperature: logits / T;
//   2. top-k (k > 0): keep every token whose logit is ≥ the k-th largest (ties kept, as HF);
//   3. top-p (p < 1): sort the kept tokens by probability (descending, ties by id) and keep the
//      shortest prefix whose probability sum reaches p (at least one token, as HF's
//      min_tokens_to_keep = 1);
//   4. softmax over the kept tokens (fp64), every other token has probability exactly 0.
// Temperature 0 is greedy decoding: no distribution, argmax (first index on ties).
//
// Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
// Decoding", Alg. 1 / Thm. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
// Sampling", Alg. 2): a draft token x drawn from q is accepted with probability min(1, p(x)/q(x));
// on rejection the token is drawn from norm(max(0, p − q)). The token that comes out is then
// distributed exactly as p, for any q with q(x) > 0 at the drafted x. The drafter's q is its
// logits row processed exactly like the target's (same temperature, top-k, top-p): this keeps q
// close to p (higher acceptance) and, because the rule is exact for any q, costs no exactness.
//
// Invariants: all draws go through dflash::Rng (one uniform per decision, in a fixed order), so a
// seed reproduces a generation bit for bit on a given build. Probabilities are fp64.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/rng.hpp"

namespace dflash {

/// Sampling settings of a generation. temperature == 0 means greedy (top_k/top_p ignored).
struct SamplingParams {
  double temperature = 0.0;  ///< ≥ 0
  int64_t top_k = 0;         ///< 0: no top-k filter
  double top_p = 1.0;        ///< in (0, 1]; 1: no top-p filter

  bool greedy() const { return temperature == 0.0; }
  /// Throws dflash::Error naming the field when temperature < 0 (or not finite), top_k < 0, or
  /// top_p outside (0, 1].
  void validate() const;
};

/// The processed distribution of one logits row `logits` [V] (steps 1–4 of the file comment)
/// written to `probs` (resized to V; sums to 1 up to rounding). Requires !params.greedy().
/// Throws dflash::Error when a logit is NaN or every kept logit is -inf.
void sampling_probs(std::vector<double>& probs, std::span<const float> logits,
                    const SamplingParams& params);

/// Index drawn from `probs` [V] (non-negative, positive sum; need not be normalised) by inverse
/// CDF with one rng.uniform(). Never returns an index of probability 0. Throws dflash::Error when
/// the sum is not positive.
int32_t sample_index(std::span<const double> probs, Rng& rng);

/// Greedy or sampled next token from a logits row [V] (argmax_row for greedy; else
/// sampling_probs + sample_index). `scratch` holds the probabilities afterwards (sampling only).
int32_t sample_token(std::span<const float> logits, const SamplingParams& params, Rng& rng,
                     std::vector<double>& scratch);

/// min(1, p(x)/q(x)): the probability of accepting draft token x. Throws dflash::Error when
/// q(x) ≤ 0 (x could not have been drafted from q).
double acceptance_probability(std::span<const double> p, std::span<const double> q, int32_t x);

/// The residual distribution norm(max(0, p − q)) written to `out` [V]. When p ≤ q everywhere
/// (p == q up to rounding: a rejection then has probability 0 or is rounding noise), `out` is p.
void residual_distribution(std::vector<double>& out, std::span<const double> p,
                           std::span<const double> q);

/// Result of the rejection test of one drafted token.
struct RejectionOutcome {
  bool accepted = false;  ///< the draft token was kept
  int32_t token = 0;      ///< the draft token when accepted, else the resampled one
};

/// The speculative rejection rule for draft token `x` ~ q against target distribution p (both
/// [V]): draws u = rng.uniform(); accepts when u < acceptance_probability(p, q, x), else draws the
/// replacement from residual_distribution(p, q) (one more uniform). `scratch` is workspace.
RejectionOutcome speculative_reject(std::span<const double> p, std::span<const double> q, int32_t x,
                                    Rng& rng, std::vector<double>& scratch);

}  // namespace dflash
