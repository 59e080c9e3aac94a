// dflash.cpp — the decoding contract every backend implements (`dflash eval`, `generate`,
// `regenerate`): speculative decoding with a DFlash drafter and target-only decoding, for a set
// of requests of which up to `batch_size` are in flight at once.
//
// Invariants (each backend's tests check them):
//   - request i of a call uses seed opts.seed + i, whatever batch_size is: its output does not
//     depend on batch_size nor on the other requests (greedy: token for token; sampling: the same
//     draws from the request's own Rng(seed) on one backend);
//   - greedy speculative output equals greedy target-only output (lossless), and sampled output is
//     distributed as the target's (infer/speculative.hpp, the rejection rule of infer/sampling.hpp);
//   - results come back in request order; DecodeResult's seconds are the request's own wall time
//     from its admission to its end (prefill_seconds: its prefill and first token), so that the
//     sums over requests are comparable between batch sizes only through the aggregate wall time
//     the caller measures around the call.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "infer/speculative.hpp"

namespace dflash {

/// Called with (request index, the tokens a step added to that request's output).
using BatchTokenCallback = std::function<void(size_t, std::span<const int32_t>)>;

/// One backend's decoding of a target with a drafter (file comment for the invariants).
class Decoder {
 public:
  virtual ~Decoder() = default;

  /// Decodes every prompt speculatively with `opts` (request i: seed opts.seed + i), at most
  /// `batch_size` (≥ 1) requests in flight. Throws dflash::Error for batch_size < 1 and for the
  /// errors of SpeculativeDecoder::start (naming the request index).
  virtual std::vector<DecodeResult> generate(std::span<const std::vector<int32_t>> prompts,
                                             const DecodeOptions& opts, int batch_size,
                                             const BatchTokenCallback& on_tokens = {}) = 0;

  /// The same requests decoded by the target alone (block size ignored): the baseline of
  /// `dflash eval` (tokens/s, speedup, losslessness).
  virtual std::vector<DecodeResult> target_generate(std::span<const std::vector<int32_t>> prompts,
                                                    const DecodeOptions& opts, int batch_size,
                                                    const BatchTokenCallback& on_tokens = {}) = 0;

  /// "cpu" or "cuda" (for reports).
  virtual const char* backend() const = 0;
};

}  // namespace dflash
