// dflash.cpp — deterministic random numbers.
//
// Invariant: every random draw of the project goes through Rng, whose output depends only on the
// seed and the sequence of calls (xoshiro256** seeded by splitmix64; no std:: distributions, whose
// results differ between standard libraries). The state is four 64-bit words and can be saved and
// restored exactly (checkpoints, exact resume).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace dflash {

/// xoshiro256** (Blackman & Vigna, 2018), seeded with splitmix64 from one 64-bit seed.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { reseed(seed); }
  /// Resets the state from `seed` (splitmix64 expansion).
  void reseed(uint64_t seed);
  /// Next 64 random bits.
  uint64_t next_u64();
  /// Uniform double in [0, 1) with 53 random bits.
  double uniform();
  /// Uniform integer in [0, n) without modulo bias; n must be > 0.
  uint64_t below(uint64_t n);
  /// Standard normal (Box–Muller on two uniforms; deterministic, one value per call).
  double normal();

  /// The raw state, for checkpoints.
  std::array<uint64_t, 4> state() const { return s_; }
  void set_state(const std::array<uint64_t, 4>& s) { s_ = s; }

 private:
  std::array<uint64_t, 4> s_{};
};

/// A seed derived from a base seed and a list of integers (e.g. {epoch, document index}): mixes with
/// splitmix64 so that nearby inputs give unrelated streams.
uint64_t derive_seed(uint64_t base, std::initializer_list<uint64_t> parts);

}  // namespace dflash
