// dflash.cpp — the sequential draft heads of DSpark and Domino in the CUDA decoder
// (infer/decoder_cuda.hpp): after the drafter's block forward, each slot's proposal for all B
// requests of a step, slot by slot on the device (ops/decode_heads.hpp), each slot reading the
// token drafted before it from the verify block, so that the step stays one CUDA graph.
//
// Per step of block size K (the CPU decoder's rules, infer/speculative.hpp; OBJECTIVES.md §1.2,
// §1.3):
//   DSpark: all K slots draft. The verify block is [anchor, d_0 … d_{K−1}] (K + 1 rows per request,
//           verify_width); the drafter's input [anchor, MASK × (K−1)] is made from it
//           (drafter_input). Slot k: D_k = U_k + W2·z_k with z_k the Markov latent of
//           prev = block[k] (the anchor for k = 0; vanilla W1[prev], gated σ(Wg[h_k; W1[prev]] +
//           bg) ⊙ W1[prev], rnn tanh of the third part of J[s; W1[prev]; h_k] + bJ with its state
//           s, 0 at slot 0); D_k = U_k without a Markov head. d_k goes to block column k + 1.
//   Domino: K − 1 proposals, verified as DFlash's ([anchor, d_1 … d_{K−1}]). Proposal j (column
//           j + 1) comes from slot k = j + 1 (k = j with shift_label): the GRU (state 0 at the
//           block start) is fed block[j] (the anchor, then each proposal), then F_k = U_k +
//           W2·SiLU(W1·[h_k; g]) for k ≥ suffix_start, else F_k = U_k.
//   Greedy: the token is the argmax of the slot's row. Sampling: the row is processed as the
//           DFlash path's (sample_probs_cuda: temperature, top-k, top-p), the token drawn from it
//           with philox_uniform(seed, step, column, draft), and the row written to the q row of
//           its block column for the rejection rule.
// U_k are the drafter's block logits (f32 [B·K, V], left unchanged) and h_k its final-norm rows
// (bf16 [B·K, H]). The heads' weights are f32 copies of the drafter's parameters (the CPU
// decoder's values); their scratch is planned by the decoder (buffers()).
//
// Invariants: nothing allocates after construction; a request's proposals do not depend on the
// other requests of the batch (every op computes a request's row alone, in a fixed order).
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_io.hpp"
#include "ops/sample.hpp"

namespace dflash {

namespace cuda {
class CudaContext;
class PinnedUploader;
}  // namespace cuda

/// One buffer the heads need in the decoder's plan: its name, size and where its pointer goes.
struct DecodeHeadBuffer {
  std::string name;
  uint64_t bytes = 0;
  void** dst = nullptr;
};

/// The step's device arrays the head walk reads and writes (owned by the decoder).
struct HeadWalkIo {
  const float* base = nullptr;       ///< U [B·K, V] f32: the drafter's block logits
  const uint16_t* hidden = nullptr;  ///< h [B·K, H] bf16: its final-norm rows
  const uint16_t* embed = nullptr;   ///< the target's embedding [V, H] bf16 (Domino's GRU input)
  int32_t* block = nullptr;          ///< the verify block [B, verify_width(K)]
  bool sampled = false;              ///< sampling (the fields below) or greedy
  float* q = nullptr;                ///< q rows [B·verify_width(K), V] f32
  const uint64_t* seeds = nullptr;   ///< [B] request seeds
  const int32_t* steps = nullptr;    ///< [B] request step counts
  const SampleParamsDevice* params = nullptr;
  int32_t* status = nullptr;  ///< [B] sampling status (ops/sample.hpp)
};

/// The DSpark or Domino head of a drafter on the device (file comment).
class DecodeHeadsCuda {
 public:
  /// True for a drafter whose proposals come from a sequential head (DSpark, Domino).
  static bool handles(const DrafterConfig& cfg) { return cfg.dspark.enabled || cfg.domino.enabled; }
  /// The verify rows per request of a step of block size K: K + 1 for DSpark (all K slots draft),
  /// else K.
  static int verify_width(const DrafterConfig& cfg, int K) {
    return cfg.dspark.enabled ? K + 1 : K;
  }

  /// The head of `cfg` (handles(cfg) must hold: else dflash::Error) for up to `max_batch`
  /// requests of block size up to cfg.block_size. Throws dflash::Error for a DSpark drafter with
  /// the DFlash2 or Domino heads too, or bad sizes.
  DecodeHeadsCuda(const DrafterConfig& cfg, int max_batch);

  /// The weights and scratch to plan (names start with "decode.heads."); every pointer is set
  /// when the decoder takes its plan.
  std::vector<DecodeHeadBuffer> buffers();
  /// Uploads the head's weights from the drafter's parameters (f32, its layout's offsets).
  void upload(cuda::PinnedUploader& up, const LoadedDrafter& drafter);
  /// Fills the weights with uniform values of standard deviation 0.02 (the decode bench's random
  /// drafter), stream ids from `seed`.
  void randomize(cuda::CudaContext& ctx, uint64_t seed);

  /// The drafter's input block [B, K] for the verify block `block` [B, verify_width(K)]: DSpark's
  /// [anchor, mask × (K−1)] made on the device; the block itself otherwise.
  const int32_t* drafter_input(cuda::CudaContext& ctx, const int32_t* block, int B, int K,
                               int32_t mask);
  /// The proposals of a step of B requests, block size K, into io.block (and io.q when sampled):
  /// the file comment's walk. Enqueued on ctx's stream; no host sync.
  void walk(cuda::CudaContext& ctx, int B, int K, const HeadWalkIo& io);

 private:
  void walk_dspark(cuda::CudaContext& ctx, int B, int K, const HeadWalkIo& io);
  void walk_domino(cuda::CudaContext& ctx, int B, int K, const HeadWalkIo& io);
  /// The token of block column `col` from the slot row `row` (leading dimension ld) of every
  /// request: argmax, or processed, drawn and written to the q rows.
  void propose(cuda::CudaContext& ctx, int B, int ld_block, int col, const float* row, int64_t ld,
               const HeadWalkIo& io);

  DrafterConfig cfg_;
  int max_batch_ = 1;
  // DSpark: W1, W2 [V, r]; gate [r, H+r] + [r]; joint [3r, 2r+H] + [3r].
  float *w1_ = nullptr, *w2_ = nullptr, *gate_w_ = nullptr, *gate_b_ = nullptr;
  float *joint_w_ = nullptr, *joint_b_ = nullptr;
  // Domino: W_ih [3G, H], W_hh [3G, G], W1 [E, H+G], W2 [V, E].
  float *gru_ih_ = nullptr, *gru_hh_ = nullptr, *proj1_ = nullptr, *proj2_ = nullptr;
  // Scratch: a packed input row [B, ·], linear outputs u [B, ·] and hh [B, 3G], the latent or
  // activation z [B, ·], the recurrent state [B, ·], one slot's row [B, V], DSpark's drafter input.
  float *x_ = nullptr, *u_ = nullptr, *hh_ = nullptr, *z_ = nullptr, *state_ = nullptr;
  float* row_ = nullptr;
  int32_t* input_ = nullptr;
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
