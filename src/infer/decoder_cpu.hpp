// dflash.cpp — the CPU backend of the decoding contract (infer/decoder.hpp): batched speculative
// decoding (SpeculativeDecoder) and batched target-only decoding over a set of requests.
//
// Scheduling: up to batch_size requests are in flight, each in its own slot with its own state
// (target and drafter caches, RNG, output). A round gives every active slot one unit of work —
// a newly admitted request its prefill and first token, any other one speculative step (or one
// target token) — and the active slots of a round are split into contiguous chunks run on the
// thread pool (core/parallel.hpp). When a request ends its slot takes the next request of the
// queue in the next round (its buffers are kept: caches, drafter workspace and scratch only
// grow). Token callbacks are made on the calling thread after each round, in slot order.
//
// Invariants: a request's computation reads only its own state and the immutable models. An op
// called inside a chunk runs its parallel_for chunks inline, the same chunks it would hand to the
// pool (parallel.hpp), so it computes the same bits as when the request runs alone: a request's
// output does not depend on batch_size nor on the other requests. Request i decodes exactly as
// SpeculativeDecoder::generate / target_generate with seed opts.seed + i (on a given machine:
// the chunking of the prefill's GEMMs follows the thread count, see backend/cpu/gemm.hpp).
// Results come back in request order; a request's DecodeResult seconds are its own wall time from
// admission (the start of the round that prefilled it) to the end of the round it finished in.
#pragma once

#include <optional>

#include "infer/decoder.hpp"

namespace dflash {

/// The CPU decoder of a target, with an optional drafter (without one only target_generate works).
class DecoderCpu final : public Decoder {
 public:
  /// `drafter` may be null (target-only decoding); when given it is checked against the target as
  /// SpeculativeDecoder's constructor does (same errors). Both must outlive this object.
  DecoderCpu(const TargetModel& target, const LoadedDrafter* drafter);

  /// See Decoder::generate. Also throws dflash::Error when the decoder has no drafter. Errors of a
  /// request (an empty prompt, a token outside the vocabulary) name its index and are raised before
  /// any request is decoded.
  std::vector<DecodeResult> generate(std::span<const std::vector<int32_t>> prompts,
                                     const DecodeOptions& opts, int batch_size,
                                     const BatchTokenCallback& on_tokens = {}) override;

  /// See Decoder::target_generate (the drafter, when given, is not used).
  std::vector<DecodeResult> target_generate(std::span<const std::vector<int32_t>> prompts,
                                            const DecodeOptions& opts, int batch_size,
                                            const BatchTokenCallback& on_tokens = {}) override;

  const char* backend() const override { return "cpu"; }

  /// The speculative decoder (null without a drafter), e.g. for step-by-step tracing.
  const SpeculativeDecoder* speculative() const { return spec_ ? &*spec_ : nullptr; }

 private:
  const TargetModel& target_;
  std::optional<SpeculativeDecoder> spec_;
};

}  // namespace dflash
