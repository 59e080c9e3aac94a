// dflash.cpp — the CPU decoder: the batched round loop of decoder_cpu.hpp over SpecState
// (speculative) or TargetState (target-only) slots.
#include "infer/decoder_cpu.hpp"

#include <fmt/format.h>

#include <chrono>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace dflash {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Errors a request would raise at its start, raised before any request is decoded: the index
// names the request.
void check_prompts(std::span<const std::vector<int32_t>> prompts, int64_t vocab, int batch_size) {
  DFLASH_CHECK(batch_size >= 1, "batch size must be >= 1 (got {})", batch_size);
  for (size_t i = 0; i < prompts.size(); ++i) {
    DFLASH_CHECK(!prompts[i].empty(), "request {}: empty prompt", i);
    for (size_t j = 0; j < prompts[i].size(); ++j)
      DFLASH_CHECK(prompts[i][j] >= 0 && prompts[i][j] < vocab,
                   "request {}: prompt token {} is {}, outside the vocabulary [0, {})", i, j,
                   prompts[i][j], vocab);
  }
}

// One slot of the round loop: the request it serves, its state, the tokens of the current round
// (handed to the callback on the calling thread) and its admission time.
template <typename State>
struct Slot {
  explicit Slot(const ModelConfig& c) : state(c) {}
  State state;
  size_t request = 0;
  bool active = false, fresh = false;
  std::vector<int32_t> pending;
  Clock::time_point admitted;
};

// The round loop (file comment of decoder_cpu.hpp). `start(State&, prompt, opts, cb)` prefills,
// `step(State&, opts, cb)` advances by one step; each request's options carry seed opts.seed + i.
template <typename State, typename Start, typename Step>
std::vector<DecodeResult> run_rounds(const ModelConfig& cfg,
                                     std::span<const std::vector<int32_t>> prompts,
                                     const DecodeOptions& opts, int batch_size,
                                     const BatchTokenCallback& on_tokens, Start&& start,
                                     Step&& step) {
  std::vector<DecodeResult> results(prompts.size());
  std::vector<Slot<State>> slots;
  slots.reserve(std::min(prompts.size(), static_cast<size_t>(batch_size)));
  size_t next = 0, finished = 0;
  std::vector<size_t> active;  // indices into `slots` of this round's work
  while (finished < prompts.size()) {
    const Clock::time_point round_start = Clock::now();
    for (size_t k = 0; next < prompts.size(); ++k) {  // refill free slots from the queue
      if (k == slots.size()) {
        if (slots.size() == static_cast<size_t>(batch_size)) break;
        slots.emplace_back(cfg);
      }
      Slot<State>& s = slots[k];
      if (s.active) continue;
      s.active = s.fresh = true;
      s.request = next++;
      s.admitted = round_start;
    }
    active.clear();
    for (size_t k = 0; k < slots.size(); ++k)
      if (slots[k].active) active.push_back(k);
    parallel_for(static_cast<int64_t>(active.size()), [&](int64_t b, int64_t e) {
      for (int64_t a = b; a < e; ++a) {
        Slot<State>& s = slots[active[static_cast<size_t>(a)]];
        const TokenCallback cb = [&s](std::span<const int32_t> t) {
          s.pending.insert(s.pending.end(), t.begin(), t.end());
        };
        DecodeOptions o = opts;
        o.seed = opts.seed + s.request;
        try {
          if (s.fresh)
            start(s.state, prompts[s.request], o, cb);
          else
            step(s.state, o, cb);
        } catch (const Error& err) {
          throw err.with_context(fmt::format("request {}", s.request));
        }
      }
    });
    const Clock::time_point round_end = Clock::now();
    for (size_t k : active) {
      Slot<State>& s = slots[k];
      s.fresh = false;
      if (on_tokens && !s.pending.empty()) on_tokens(s.request, s.pending);
      s.pending.clear();
      if (!s.state.done) continue;
      DecodeResult& r = results[s.request];
      r = std::move(s.state.result);
      r.decode_seconds = seconds_between(s.admitted, round_end) - r.prefill_seconds;
      s.active = false;
      ++finished;
    }
  }
  return results;
}

}  // namespace

DecoderCpu::DecoderCpu(const TargetModel& target, const LoadedDrafter* drafter) : target_(target) {
  if (drafter) spec_.emplace(target, *drafter);
}

std::vector<DecodeResult> DecoderCpu::generate(std::span<const std::vector<int32_t>> prompts,
                                               const DecodeOptions& opts, int batch_size,
                                               const BatchTokenCallback& on_tokens) {
  DFLASH_CHECK(spec_.has_value(),
               "speculative decoding needs a drafter (this decoder was made without one)");
  check_prompts(prompts, target_.vocab_size(), batch_size);
  const SpeculativeDecoder& dec = *spec_;
  return run_rounds<SpecState>(
      target_.config(), prompts, opts, batch_size, on_tokens,
      [&dec](SpecState& s, std::span<const int32_t> p, const DecodeOptions& o,
             const TokenCallback& cb) { dec.start_into(s, p, o, cb); },
      [&dec](SpecState& s, const DecodeOptions& o, const TokenCallback& cb) {
        dec.step(s, o, cb);
      });
}

std::vector<DecodeResult> DecoderCpu::target_generate(std::span<const std::vector<int32_t>> prompts,
                                                      const DecodeOptions& opts, int batch_size,
                                                      const BatchTokenCallback& on_tokens) {
  check_prompts(prompts, target_.vocab_size(), batch_size);
  const TargetModel& t = target_;
  return run_rounds<TargetState>(
      t.config(), prompts, opts, batch_size, on_tokens,
      [&t](TargetState& s, std::span<const int32_t> p, const DecodeOptions& o,
           const TokenCallback& cb) { target_state_start(t, s, p, o, cb); },
      [&t](TargetState& s, const DecodeOptions& o, const TokenCallback& cb) {
        target_state_step(t, s, o, cb);
      });
}

}  // namespace dflash
