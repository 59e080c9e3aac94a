// dflash.cpp — DFlash2's part of the CUDA decoder (infer/decoder_cuda.hpp): the grouped dynamic
// conv around each sublayer of the drafter's block forward and the selector walk that turns the
// block logits into proposals (../shared/OBJECTIVES.md §1.4; the CPU decoder's:
// model/dflash2_conv.hpp in drafter_draft_block, model/dflash2_selector.hpp in
// infer/speculative.cpp).
//
// In a step the block rows of B requests are B·K rows, request-major: the training layout with B
// anchors, so the conv is ops/dflash2_conv.hpp's with block size K (taps zero across blocks: no
// request reads another's rows). Per layer and sublayer (attention, MLP) with input u = RMSNorm(h):
//   δ = u·W_kpᵀ [B·K, 2·T·Gc] f32;  ũ = pre-conv(u) (bf16, the sublayer's input)
//   y = Sublayer's output projection (f32);  h ← h + post-conv(y)
// After the final norm and LM head, ops/dflash2_walk.hpp proposes slots 1..K−1 (greedy, or drawn
// from q_k, whose rows the rejection rule reads).
//
// Invariants: every device buffer (the conv and selector weights, δ, ũ, y, the second residual
// buffer, the walk's scratch) is planned by the decoder at construction for its max_batch · block
// rows (plan); a step allocates nothing and keeps no host state, so it is captured in the
// decoder's graph. Weights: base kernels, codebooks and P_h f32 (the CPU's values), W_kp bf16 (a
// GEMM operand, as the other projections).
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "ops/dflash2_walk.hpp"

namespace dflash {

namespace cuda {
class CudaContext;
class PinnedUploader;
}  // namespace cuda

/// DFlash2's weights and scratch in a SpeculativeDecoderCuda, and the steps' pieces that use them.
class Dflash2DecodeCuda {
 public:
  /// One buffer of the decoder's plan: `name`, `bytes`, and where its device pointer goes.
  using AddBuffer = std::function<void(std::string name, uint64_t bytes, void** dst)>;

  /// For drafter `c` (c.dflash2.enabled) and step blocks of up to `max_rows` rows. Throws
  /// dflash::Error when c is not DFlash2 or its selector exceeds what the walk holds (naming
  /// selector_top_k or selector_rank and the limit).
  Dflash2DecodeCuda(const DrafterConfig& c, int64_t max_rows);

  /// Adds the weights and the scratch to the decoder's plan (names decode.drafter.dflash2.*).
  void plan(const AddBuffer& add);
  /// Enqueues the weights' upload from `params` laid out as `layout` (f32 host values).
  void upload(cuda::PinnedUploader& up, const DrafterLayout& layout, const float* params);
  /// Random weights for the decode bench: every tensor uniform with standard deviation 0.02
  /// (fill_uniform_cuda, streams `stream` + 1, + 2, …; `stream` is advanced).
  void randomize(cuda::CudaContext& ctx, uint64_t& stream);

  /// Throws dflash::Error when a step of block size K cannot run the conv (K < conv_kernel_size).
  void check_block(int K) const;

  /// The pre-conv of sublayer `sub` (0 attention, 1 MLP) of layer l over the B·K rows u [B·K, H]
  /// (bf16, the sublayer's RMSNorm output): δ = u·W_kpᵀ, kept for post(); returns ũ [B·K, H] bf16
  /// (this object's buffer). δ runs on decode_linear_cuda (a row's bits do not depend on the row
  /// count, so neither does a request's output on the batch) where H % 64 == 0 and 2·T·Gc % 8 ==
  /// 0 (every recipe's shapes), else on cuBLASLt.
  const uint16_t* pre(cuda::CudaContext& ctx, int64_t l, int sub, const uint16_t* u, int B, int K);
  /// The buffer [max_rows, H] f32 where the caller writes the sublayer's output projection y (the
  /// decoder zeroes it and accumulates: the GEMM of plain DFlash's residual projection, beta 1).
  float* y() const { return y_; }
  /// out [B·K, H] = h + post-conv(y) of sublayer `sub` of layer l (δ of the matching pre()).
  /// out must not be h.
  void post(cuda::CudaContext& ctx, int64_t l, int sub, float* out, const float* h, int B,
            int K) const;
  /// The second residual buffer [max_rows, H] f32 (the decoder alternates its h and this one).
  float* residual2() const { return h2_; }

  /// The walk (ops/dflash2_walk.hpp) over logits [B·K, V] and final-norm rows hf [B·K, H]: block
  /// slots 1..K−1 and, when `sampled`, q rows. The other pointers are the decoder's step state.
  void walk(cuda::CudaContext& ctx, float* logits, const uint16_t* hf, int32_t* block, float* q,
            const uint64_t* seeds, const int32_t* steps, int32_t* status,
            const SampleParamsDevice* params, int B, int K, bool sampled) const;

 private:
  struct Conv {
    float* base = nullptr;   // [2, T, H] f32: β (pre: rows [0, T), post: rows [T, 2T))
    uint16_t* kp = nullptr;  // [2·T·Gc, H] bf16: W_kp
  };
  DrafterConfig c_;
  int64_t max_rows_ = 0, W_ = 0;  // W_ = 2·T·Gc
  std::vector<Conv> conv_;        // [layer·2 + sub]
  float *A_ = nullptr, *Bs_ = nullptr, *Ph_ = nullptr;
  float *delta_ = nullptr, *y_ = nullptr, *h2_ = nullptr;
  uint16_t* ut_ = nullptr;
  int32_t* cand_ = nullptr;
  float *cand_u_ = nullptr, *proj_ = nullptr;
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
