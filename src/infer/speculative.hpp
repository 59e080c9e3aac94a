// dflash.cpp — speculative decoding with a DFlash drafter (DESIGN.md §1 "Inference"), CPU backend.
//
// One request, one step:
//   state: the target KV cache and the drafter cache both hold the L tokens whose K/V are final
//          (prompt + accepted output except the last token); `anchor` is the last output token,
//          at position L, in neither cache yet.
//   draft:  drafter block [anchor, MASK × (K−1)] at positions L..L+K−1 over its cache → proposals
//           d_1..d_{K−1} (greedy: argmax; sampling: drawn from the processed drafter rows q_k).
//   verify: target append [anchor, d_1..d_{K−1}] at positions L..L+K−1 → taps and final-norm
//           rows of the K rows, in one pass; logits p_k computed from those rows only for the
//           k the acceptance rule reads (0..n).
//   accept: greedy: the longest prefix with d_k == argmax p_{k−1}; the bonus token is
//           argmax p_n after the n accepted. Sampling: the rejection rule (infer/sampling.hpp) on
//           d_1, d_2, … in order; the first rejection's resampled token (or, when all K−1 are
//           accepted, a token drawn from p_{K−1}) is the bonus.
//   roll back: target cache truncated to L+1+n (anchor + accepted drafts); the drafter cache gets
//           the taps rows 0..n of the verify pass (the same tokens) at positions L..L+n; the
//           bonus becomes the next anchor. Acceptance length of the step = n + 1.
// The first output token comes from the prefill (taps of the prompt go to the drafter cache).
//
// A DSpark drafter (OBJECTIVES.md §1.3, vLLM's DSpark proposer) drafts with all K slots: the same
// block, slot k (k = 0..K−1) proposing the token at L+1+k from its logits plus the Markov bias of
// the token drafted at slot k−1 (prev₀ = anchor); the verify block is [anchor, d_0..d_{K−1}], so an
// acceptance length is in [1, K+1]. Sampling draws each d_k from its biased q_k, which the
// rejection rule reads as for DFlash.
// A DFlash2 drafter (OBJECTIVES.md §1.4) drafts slots 1..K−1 as DFlash does, but each slot's token
// comes from its selector walk (model/dflash2_selector.hpp): greedy argmax of S_k(prev, ·) over the
// unary top-K C_k, or a draw from q_k = softmax(S_k/T) on C_k (zero elsewhere), which the rejection
// rule reads as any q.
//
// Invariants: greedy output equals the target's own greedy decoding token for token (the
// verification logits are the target's); sampled output is distributed exactly as the target's
// (Leviathan et al. 2023, Thm. 1). Output stops after the first stop token (included) or at
// max_new_tokens (a step's surplus tokens are dropped; its acceptance length is still counted
// whole). All state of a request lives in SpecState, so a batched loop can hold several.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/rng.hpp"
#include "infer/sampling.hpp"
#include "model/dflash2_selector.hpp"
#include "model/drafter.hpp"
#include "model/drafter_io.hpp"
#include "model/domino_head.hpp"
#include "model/dspark_head.hpp"
#include "model/target.hpp"

namespace dflash {

/// Settings of one generation.
struct DecodeOptions {
  int64_t max_new_tokens = 256;   ///< ≥ 1
  int block_size = 0;             ///< 0: the drafter's trained block size; else in [2, trained]
  std::vector<int64_t> stop_ids;  ///< generation stops after the first of these (included)
  SamplingParams sampling;        ///< temperature 0: greedy
  uint64_t seed = 0;              ///< seed of the request's Rng (sampling only)
};

/// Called with the tokens each step adds to the output (after stop/max trimming).
using TokenCallback = std::function<void(std::span<const int32_t>)>;

/// Outcome of one generation.
struct DecodeResult {
  std::vector<int32_t> tokens;      ///< generated tokens (stop token included when hit)
  std::vector<int> accept_lengths;  ///< per speculative step, in [1, K] (DSpark: [1, K+1])
  bool stopped = false;             ///< ended on a stop token (else on max_new_tokens)
  double prefill_seconds = 0;       ///< prompt prefill (first token included)
  double decode_seconds = 0;        ///< everything after the prefill
  /// Mean acceptance length τ (0 when no step ran).
  double tau() const;
};

/// The loop state of one request (target and drafter caches, output, RNG, counters).
struct SpecState {
  TargetKvCache target_cache;
  DrafterCache drafter_cache;
  std::vector<int32_t> prompt;
  int32_t anchor = 0;  ///< last output token, at position target_cache.length()
  Rng rng;
  DecodeResult result;
  /// The last verify step's proposals d_1..d_{K−1} (before acceptance; for tracing tools).
  std::vector<int32_t> last_proposals;
  bool done = false;
  // Scratch kept between steps so that a step allocates little once warm: the drafter's
  // workspace, the proposals, the drafter distributions q_k, one row of target logits and the
  // target's p (sampling).
  DrafterWorkspace<float> drafter_ws;
  std::vector<int32_t> proposals, block;
  std::vector<std::vector<double>> draft_q;
  std::vector<float> target_logits;
  std::vector<double> target_p, sample_scratch;
  std::vector<float> dspark_row;  // a DSpark drafter: one slot's logits with the Markov bias
  DsparkSlotState dspark_slot;    // and its head's state between slots
  Dflash2SlotScores dflash2_slot;  // a DFlash2 drafter: one slot's candidates and scores
  std::vector<float> domino_row;  // a Domino drafter: one slot's corrected logits
  DominoSlotState domino_slot;    // and its GRU state, fed the anchor and each proposal
  explicit SpecState(const ModelConfig& c) : target_cache(c) {}
};

/// Appends `toks` (one step's output) to `r.tokens` up to and including the first of
/// opts.stop_ids (then r.stopped) and up to opts.max_new_tokens tokens in all; returns how many
/// were appended and sets `done` when the request is over. The output rule of every decoder
/// (file comment); call it only while the request is not done.
size_t decode_result_append(DecodeResult& r, std::span<const int32_t> toks,
                            const DecodeOptions& opts, bool& done);

/// A target and a drafter checked to fit each other, ready to decode.
class SpeculativeDecoder {
 public:
  /// Checks the drafter against the target (drafter_check_target: hidden size, vocab,
  /// num_target_layers, tap ids, mask id; the error names the field and both values) and copies
  /// the target's embedding and LM head to f32 for the drafter. Both objects must outlive this.
  SpeculativeDecoder(const TargetModel& target, const LoadedDrafter& drafter);

  /// The drafter config with block size `block_size` (0: trained). Throws dflash::Error when
  /// block_size is outside [2, trained block size] (naming both).
  DrafterConfig config_for_block(int block_size) const;

  /// Prefills the target on `prompt` (≥ 1 token), fills the drafter cache with the prompt's taps
  /// and emits the first token. Throws dflash::Error for an empty prompt, a token outside the
  /// vocabulary, max_new_tokens < 1, a bad block size or bad sampling settings.
  SpecState start(std::span<const int32_t> prompt, const DecodeOptions& opts,
                  const TokenCallback& on_tokens = {}) const;

  /// start() into an existing state (of this decoder's target), which is emptied first and keeps
  /// its buffers (caches, workspace, scratch): a batched loop refills a finished request's slot
  /// without allocating what the slot already holds. Same errors as start(); on error the state
  /// is empty (done, no output).
  void start_into(SpecState& state, std::span<const int32_t> prompt, const DecodeOptions& opts,
                  const TokenCallback& on_tokens = {}) const;

  /// One draft-verify-accept step (file comment). No-op when state.done.
  void step(SpecState& state, const DecodeOptions& opts, const TokenCallback& on_tokens = {}) const;

  /// The verify-accept-rollback half of step() for given proposals d_1..d_{K−1} (K − 1 ≥ 0
  /// tokens after the anchor; K need not be the drafter's block size) and, when sampling, the
  /// distributions q_1..q_{K−1} [V] they were drawn from (q.size() == proposals.size(); empty in
  /// greedy mode). The drafter cache gets the accepted rows' taps as in step(). Exposed so that
  /// tests can drive the rule with oracle proposals; throws dflash::Error on size mismatches.
  void verify(SpecState& state, const DecodeOptions& opts, std::span<const int32_t> proposals,
              std::span<const std::vector<double>> q, const TokenCallback& on_tokens = {}) const;

  /// start() then step() until done.
  DecodeResult generate(std::span<const int32_t> prompt, const DecodeOptions& opts,
                        const TokenCallback& on_tokens = {}) const;

  const TargetModel& target() const { return target_; }
  const LoadedDrafter& drafter() const { return drafter_; }

 private:
  // Appends `toks` to the output, trimming at a stop token / max_new_tokens; sets done.
  void emit(SpecState& s, std::span<const int32_t> toks, const DecodeOptions& opts,
            const TokenCallback& on_tokens) const;

  const TargetModel& target_;
  const LoadedDrafter& drafter_;
  std::vector<float> embed_f32_, lm_head_f32_;  // lm_head_f32_ empty when tied
  DrafterTables<float> tables_;
  std::vector<int> taps_;
};

/// The loop state of one target-only request: its cache, RNG, output, and the buffers kept between
/// steps (the last position's final-norm row and logits, the sampling scratch).
struct TargetState {
  TargetKvCache cache;
  Rng rng;
  DecodeResult result;
  bool done = false;
  std::vector<float> logits;  ///< [V] logits of the last position
  std::vector<double> sample_scratch;
  explicit TargetState(const ModelConfig& c) : cache(c) {}
};

/// Starts target-only decoding of `prompt` (≥ 1 token) in `s` (emptied first, buffers kept):
/// prefill, then the first token from the last position's logits (argmax, or drawn from
/// Rng(opts.seed) with the processing of infer/sampling.hpp). Throws dflash::Error for an empty
/// prompt, a token outside the vocabulary or bad options; on error `s` is empty and done.
void target_state_start(const TargetModel& target, TargetState& s, std::span<const int32_t> prompt,
                        const DecodeOptions& opts, const TokenCallback& on_tokens = {});

/// One target-only step: appends the last output token to the cache and picks the next token from
/// its logits (as target_state_start). No-op when s.done.
void target_state_step(const TargetModel& target, TargetState& s, const DecodeOptions& opts,
                       const TokenCallback& on_tokens = {});

/// Target-only decoding with the same options (block size ignored): target_state_start, then
/// target_state_step until done. The baseline of `dflash eval` (tokens/s, speedup,
/// losslessness).
DecodeResult target_generate(const TargetModel& target, std::span<const int32_t> prompt,
                             const DecodeOptions& opts, const TokenCallback& on_tokens = {});

}  // namespace dflash
