// dflash.cpp — Philox4x32-10, the counter-based random generator of sampling on the GPU
// (infer/decoder_cuda.hpp), callable from host and device code alike.
//
// Philox4x32 with 10 rounds is the generator of Salmon, Moraes, Dror and Shaw, "Parallel Random
// Numbers: As Easy as 1, 2, 3" (SC 2011), Fig. 2 and §4: a keyed bijection of a 128-bit counter,
// so the draw for a counter needs no state and no sequence of earlier draws. The round multipliers
// and the Weyl key increments are the paper's (the same as Random123's and cuRAND's Philox).
//
// Invariants: philox4x32_10 is a pure function of (counter, key): the host and the device give the
// same bits for the same arguments (tests/cuda/sample_cuda_test checks known-answer values of the
// paper's reference implementation). philox_uniform maps two of its words to a double in [0, 1)
// with 53 random bits, as Rng::uniform does with one 64-bit word.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

namespace dflash {

/// Four 32-bit words: a Philox counter or output block.
struct Philox4 {
  uint32_t w[4];
};

/// The Philox4x32-10 block of `counter` under the 64-bit key (key_lo, key_hi) (file comment).
DFLASH_HOST_DEVICE inline Philox4 philox4x32_10(Philox4 counter, uint32_t key_lo, uint32_t key_hi) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // round multipliers
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
  Philox4 x = counter;
  uint32_t k0 = key_lo, k1 = key_hi;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * x.w[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * x.w[2];
    const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    x = Philox4{{hi1 ^ x.w[1] ^ k0, lo1, hi0 ^ x.w[3] ^ k1, lo0}};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return x;
}

/// What a uniform of a sampling step decides (the third counter word; infer/decoder_cuda.hpp).
enum class PhiloxPurpose : uint32_t {
  draft = 0,   ///< the drafter's proposal d_k drawn from q_k
  accept = 1,  ///< the acceptance test u < min(1, p/q) of d_k
  token = 2,   ///< a token drawn from the target: the first token, a resampled one, the bonus
};

/// The uniform double in [0, 1) (53 bits) of request seed `seed`, step `step` (0: the prefill's
/// first token, then one per decoding step), slot `slot` (the block position it decides) and
/// `purpose`: counter (step, slot, purpose, 0) under key seed; the top 53 bits of the first two
/// output words (w0 high, w1 low).
DFLASH_HOST_DEVICE inline double philox_uniform(uint64_t seed, uint32_t step, uint32_t slot,
                                                PhiloxPurpose purpose) {
  const Philox4 r = philox4x32_10(Philox4{{step, slot, static_cast<uint32_t>(purpose), 0u}},
                                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (static_cast<uint64_t>(r.w[0]) << 32) | r.w[1];
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

}  // namespace dflash
