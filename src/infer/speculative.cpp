// dflash.cpp — speculative decoding loop (see speculative.hpp for the step and its invariants).
#include "infer/speculative.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "core/error.hpp"
#include "model/dflash2_selector.hpp"
#include "model/domino_head.hpp"
#include "model/dspark_head.hpp"

namespace dflash {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void check_options(const DecodeOptions& opts) {
  DFLASH_CHECK(opts.max_new_tokens >= 1, "max_new_tokens must be >= 1 (got {})",
               opts.max_new_tokens);
  opts.sampling.validate();
}

bool is_stop(const DecodeOptions& opts, int32_t t) {
  return std::find(opts.stop_ids.begin(), opts.stop_ids.end(), static_cast<int64_t>(t)) !=
         opts.stop_ids.end();
}

}  // namespace

size_t decode_result_append(DecodeResult& r, std::span<const int32_t> toks,
                            const DecodeOptions& opts, bool& done) {
  size_t n = 0;
  done = false;
  for (int32_t t : toks) {
    if (static_cast<int64_t>(r.tokens.size()) >= opts.max_new_tokens) {
      done = true;
      break;
    }
    r.tokens.push_back(t);
    ++n;
    if (is_stop(opts, t)) {
      r.stopped = true;
      done = true;
      break;
    }
  }
  if (static_cast<int64_t>(r.tokens.size()) >= opts.max_new_tokens) done = true;
  return n;
}


double DecodeResult::tau() const {
  if (accept_lengths.empty()) return 0.0;
  const double sum = std::accumulate(accept_lengths.begin(), accept_lengths.end(), 0.0);
  return sum / static_cast<double>(accept_lengths.size());
}

SpeculativeDecoder::SpeculativeDecoder(const TargetModel& target, const LoadedDrafter& drafter)
    : target_(target), drafter_(drafter) {
  drafter_check_target(drafter.config, target.config());
  DFLASH_CHECK(static_cast<int64_t>(drafter.params.size()) == drafter.layout.total,
               "drafter holds {} parameters, its layout needs {}", drafter.params.size(),
               drafter.layout.total);
  embed_f32_ = target.embedding_f32();
  const bool tied = target.lm_head().raw() == target.embed_tokens().raw();
  if (!tied) lm_head_f32_ = target.lm_head_f32();
  tables_.embed = embed_f32_.data();
  tables_.lm_head = tied ? embed_f32_.data() : lm_head_f32_.data();
  taps_.assign(drafter.config.target_layer_ids.begin(), drafter.config.target_layer_ids.end());
}

DrafterConfig SpeculativeDecoder::config_for_block(int block_size) const {
  DrafterConfig c = drafter_.config;
  if (block_size == 0) return c;
  DFLASH_CHECK(block_size >= 2 && block_size <= c.block_size,
               "block size {} is outside [2, {}] (the drafter was trained with block_size {})",
               block_size, c.block_size, c.block_size);
  c.block_size = block_size;
  return c;
}

void SpeculativeDecoder::emit(SpecState& s, std::span<const int32_t> toks,
                              const DecodeOptions& opts, const TokenCallback& on_tokens) const {
  const size_t before = s.result.tokens.size();
  bool done = false;
  const size_t n = decode_result_append(s.result, toks, opts, done);
  if (on_tokens && n > 0) on_tokens(std::span<const int32_t>(s.result.tokens).subspan(before, n));
  if (done) s.done = true;
}

SpecState SpeculativeDecoder::start(std::span<const int32_t> prompt, const DecodeOptions& opts,
                                    const TokenCallback& on_tokens) const {
  SpecState s(target_.config());
  start_into(s, prompt, opts, on_tokens);
  return s;
}

void SpeculativeDecoder::start_into(SpecState& s, std::span<const int32_t> prompt,
                                    const DecodeOptions& opts,
                                    const TokenCallback& on_tokens) const {
  s.target_cache.clear();
  s.drafter_cache.truncate(0);
  s.prompt.clear();
  s.result = DecodeResult{};
  s.last_proposals.clear();
  s.done = true;  // until the prefill succeeded
  check_options(opts);
  (void)config_for_block(opts.block_size);  // validates the block size before any work
  DFLASH_CHECK(!prompt.empty(), "speculative decoding: empty prompt");
  const auto t0 = std::chrono::steady_clock::now();
  s.prompt.assign(prompt.begin(), prompt.end());
  s.rng.reseed(opts.seed);
  const ForwardResult r =
      target_.prefill(s.target_cache, prompt, ForwardOptions{taps_, LogitsRows::last, false});
  drafter_cache_append(s.drafter_cache, drafter_.config, drafter_.layout, drafter_.params.data(),
                       r.taps.data<float>(), static_cast<int64_t>(prompt.size()), s.drafter_ws);
  const int64_t V = target_.vocab_size();
  s.anchor = sample_token(std::span<const float>(r.logits.data<float>(), static_cast<size_t>(V)),
                          opts.sampling, s.rng, s.sample_scratch);
  s.result.prefill_seconds = seconds_since(t0);
  s.done = false;
  emit(s, std::span<const int32_t>(&s.anchor, 1), opts, on_tokens);
}

void SpeculativeDecoder::step(SpecState& s, const DecodeOptions& opts,
                              const TokenCallback& on_tokens) const {
  if (s.done) return;
  const auto t0 = std::chrono::steady_clock::now();
  const DrafterConfig cfg = config_for_block(opts.block_size);
  const int64_t K = cfg.block_size, V = target_.vocab_size();
  const int64_t L = s.target_cache.length();
  DFLASH_CHECK(s.drafter_cache.len == L,
               "speculative state: drafter cache holds {} positions, target cache {}",
               s.drafter_cache.len, L);

  // Draft: one drafter pass over [anchor, MASK × (K−1)] at positions L..L+K−1.
  const std::span<const float> dlogits =
      drafter_draft_block(s.drafter_cache, cfg, drafter_.layout, drafter_.params.data(), tables_,
                          s.anchor, s.drafter_ws);
  const bool greedy = opts.sampling.greedy();
  // DFlash drafts with slots 1..K−1 (slot 0 holds the anchor); DSpark with all K slots, slot k's
  // logits biased by the token drafted at slot k−1 (prev₀ = the anchor, the bonus token); DFlash2
  // with slots 1..K−1, walking its selector from prev₁ = the anchor (model/dflash2_selector.hpp).
  // Domino drafts K−1 tokens, one at a time: slot k's logits (k = j+1, or j with shift_label)
  // corrected by the GRU state after the anchor and proposals 0..j−1 (SpecForge
  // `DominoDraftModel._sample_draft_tokens`); the first pure_draft_prefix_len are base-only.
  const bool dspark = cfg.dspark.enabled, domino = cfg.domino.enabled;
  const int64_t P = dspark ? K : K - 1;
  const int64_t first = dspark || (domino && cfg.domino.shift_label) ? 0 : 1;
  s.proposals.resize(static_cast<size_t>(P));
  s.draft_q.resize(greedy ? 0 : static_cast<size_t>(P));  // inner vectors keep capacity
  int32_t prev = s.anchor;
  if (domino) domino_block_start(cfg, s.domino_slot);
  for (int64_t j = 0; j < P; ++j) {
    const int64_t k = first + j;  // the slot that drafts proposal j
    std::span<const float> row(dlogits.data() + k * V, static_cast<size_t>(V));
    if (cfg.dflash2.enabled) {
      // DFlash2's selector walk: C_k = top-K of the unary logits, scored with prev.
      dflash2_slot_scores(cfg, drafter_.layout, drafter_.params.data(), row.data(),
                          s.drafter_ws.hf.data() + k * cfg.hidden_size, prev, s.dflash2_slot);
      if (greedy) {
        s.proposals[j] = dflash2_greedy(s.dflash2_slot);
      } else {
        dflash2_sampling_probs(s.draft_q[j], s.dflash2_slot, V, opts.sampling.temperature);
        s.proposals[j] = sample_index(s.draft_q[j], s.rng);
      }
      prev = s.proposals[j];
      continue;
    }
    if (dspark) {
      s.dspark_row.assign(row.begin(), row.end());
      dspark_slot_logits(cfg, drafter_.layout, drafter_.params.data(), s.dspark_row.data(),
                         s.drafter_ws.hf.data() + k * cfg.hidden_size, prev, static_cast<int>(k),
                         s.dspark_slot);
      row = s.dspark_row;
    }
    if (domino) {
      domino_feed(cfg, drafter_.layout, drafter_.params.data(), tables_.embed, prev,
                  s.domino_slot);
      s.domino_row.assign(row.begin(), row.end());
      domino_slot_logits(cfg, drafter_.layout, drafter_.params.data(), s.domino_row.data(),
                         s.drafter_ws.hf.data() + k * cfg.hidden_size, static_cast<int>(k),
                         s.domino_slot);
      row = s.domino_row;
    }
    if (greedy) {
      s.proposals[j] = argmax_row(row.data(), V);
    } else {
      sampling_probs(s.draft_q[j], row, opts.sampling);
      s.proposals[j] = sample_index(s.draft_q[j], s.rng);
    }
    prev = s.proposals[j];
  }
  s.result.decode_seconds += seconds_since(t0);
  verify(s, opts, s.proposals, s.draft_q, on_tokens);
}

void SpeculativeDecoder::verify(SpecState& s, const DecodeOptions& opts,
                                std::span<const int32_t> proposals,
                                std::span<const std::vector<double>> q,
                                const TokenCallback& on_tokens) const {
  if (s.done) return;
  const auto t0 = std::chrono::steady_clock::now();
  const bool greedy = opts.sampling.greedy();
  const int64_t K = static_cast<int64_t>(proposals.size()) + 1, V = target_.vocab_size();
  const int64_t L = s.target_cache.length();
  DFLASH_CHECK(s.drafter_cache.len == L,
               "speculative state: drafter cache holds {} positions, target cache {}",
               s.drafter_cache.len, L);
  DFLASH_CHECK(greedy ? q.empty() : q.size() == proposals.size(),
               "speculative verify: {} proposals with {} drafter distributions ({})",
               proposals.size(), q.size(),
               greedy ? "greedy needs none" : "sampling needs one each");
  s.last_proposals.assign(proposals.begin(), proposals.end());
  std::vector<int32_t>& block = s.block;
  block.resize(static_cast<size_t>(K));
  block[0] = s.anchor;
  std::copy(proposals.begin(), proposals.end(), block.begin() + 1);

  // Verify: one target pass over the block (taps and final-norm rows of all K rows). The LM head
  // runs only on the rows the acceptance rule reads (n + 1 of K), one at a time: its rows have the
  // bits of an all-rows forward (TargetModel::lm_head_rows).
  const ForwardResult r =
      target_.append(s.target_cache, block, ForwardOptions{taps_, LogitsRows::none, true});
  const int64_t H = target_.hidden_size();
  s.target_logits.resize(static_cast<size_t>(V));
  const float* logits = s.target_logits.data();
  auto logits_of = [&](int64_t row) {
    target_.lm_head_rows(s.target_logits.data(), r.final_norm.data<float>() + row * H, 1);
  };

  // Accept the longest agreeing prefix, then the bonus (or resampled) token.
  int64_t n = 0;
  int32_t bonus = 0;
  if (greedy) {
    for (;;) {
      logits_of(n);
      const int32_t t = argmax_row(logits, V);
      if (n + 1 < K && block[n + 1] == t) {
        ++n;
        continue;
      }
      bonus = t;
      break;
    }
  } else {
    std::vector<double>& p = s.target_p;
    for (;;) {
      logits_of(n);
      sampling_probs(p, std::span<const float>(logits, static_cast<size_t>(V)), opts.sampling);
      if (n + 1 >= K) {
        bonus = sample_index(p, s.rng);
        break;
      }
      DFLASH_CHECK(static_cast<int64_t>(q[n].size()) == V,
                   "speculative verify: drafter distribution {} has {} entries, vocab is {}", n,
                   q[n].size(), V);
      const RejectionOutcome o = speculative_reject(p, q[n], block[n + 1], s.rng, s.sample_scratch);
      if (!o.accepted) {
        bonus = o.token;
        break;
      }
      ++n;
    }
  }

  // Roll back: keep anchor + n accepted drafts in both caches; the bonus is the next anchor.
  s.target_cache.truncate(L + 1 + n);
  drafter_cache_append(s.drafter_cache, drafter_.config, drafter_.layout, drafter_.params.data(),
                       r.taps.data<float>(), n + 1, s.drafter_ws);
  s.result.accept_lengths.push_back(static_cast<int>(n + 1));
  std::vector<int32_t> out(block.begin() + 1, block.begin() + 1 + n);
  out.push_back(bonus);
  s.anchor = bonus;
  s.result.decode_seconds += seconds_since(t0);
  emit(s, out, opts, on_tokens);
}

DecodeResult SpeculativeDecoder::generate(std::span<const int32_t> prompt,
                                          const DecodeOptions& opts,
                                          const TokenCallback& on_tokens) const {
  SpecState s = start(prompt, opts, on_tokens);
  while (!s.done) step(s, opts, on_tokens);
  return std::move(s.result);
}

namespace {

// The next token of target-only decoding from the final-norm row `normed` [H] of the last
// position: its logits (lm_head_rows: the bits of a LogitsRows::last forward) into s.logits,
// then argmax or a draw; appended to the output (trimmed), marking the state done at the end.
void target_state_emit_next(const TargetModel& target, TargetState& s, const float* normed,
                            const DecodeOptions& opts, const TokenCallback& on_tokens) {
  const int64_t V = target.vocab_size();
  s.logits.resize(static_cast<size_t>(V));
  target.lm_head_rows(s.logits.data(), normed, 1);
  const int32_t t = sample_token(s.logits, opts.sampling, s.rng, s.sample_scratch);
  bool done = false;
  const size_t n = decode_result_append(s.result, std::span<const int32_t>(&t, 1), opts, done);
  if (on_tokens && n > 0) on_tokens(std::span<const int32_t>(&t, 1));
  if (done) s.done = true;
}

}  // namespace

void target_state_start(const TargetModel& target, TargetState& s, std::span<const int32_t> prompt,
                        const DecodeOptions& opts, const TokenCallback& on_tokens) {
  s.cache.clear();
  s.result = DecodeResult{};
  s.done = true;  // until the prefill succeeded
  check_options(opts);
  DFLASH_CHECK(!prompt.empty(), "target decoding: empty prompt");
  const auto t0 = std::chrono::steady_clock::now();
  s.rng.reseed(opts.seed);
  const ForwardResult r =
      target.prefill(s.cache, prompt, ForwardOptions{{}, LogitsRows::none, true});
  const int64_t H = target.hidden_size(), T = static_cast<int64_t>(prompt.size());
  s.done = false;
  target_state_emit_next(target, s, r.final_norm.data<float>() + (T - 1) * H, opts, on_tokens);
  s.result.prefill_seconds = seconds_since(t0);
}

void target_state_step(const TargetModel& target, TargetState& s, const DecodeOptions& opts,
                       const TokenCallback& on_tokens) {
  if (s.done) return;
  const auto t0 = std::chrono::steady_clock::now();
  const ForwardResult r =
      target.append(s.cache, std::span<const int32_t>(&s.result.tokens.back(), 1),
                    ForwardOptions{{}, LogitsRows::none, true});
  target_state_emit_next(target, s, r.final_norm.data<float>(), opts, on_tokens);
  s.result.decode_seconds += seconds_since(t0);
}

DecodeResult target_generate(const TargetModel& target, std::span<const int32_t> prompt,
                             const DecodeOptions& opts, const TokenCallback& on_tokens) {
  TargetState s(target.config());
  target_state_start(target, s, prompt, opts, on_tokens);
  while (!s.done) target_state_step(target, s, opts, on_tokens);
  return std::move(s.result);
}

}  // namespace dflash
