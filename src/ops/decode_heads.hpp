// dflash.cpp — the device ops of the sequential draft heads of DSpark and Domino in the CUDA
// decoder (infer/decoder_cuda_heads.hpp): after the drafter's block forward, each slot's head
// (one row per request of a batch of B) is computed slot by slot, reading the token drafted at
// the slot before it from the device block buffer, so that a step stays one graph with no host
// sync.
//
// Layout shared by these ops. `block` is the step's verify block, request-major [B, ld_block]
// (ld_block tokens per request); column `col` of request b is block[b·ld_block + col]. Rows of
// f32 or bf16 matrices are contiguous with a leading dimension (elements between rows).
// Head weights are f32 (the drafter's master values, the CPU decoder's numbers); activations f32.
// The formulas are the CPU decoder's (model/dspark_head.hpp dspark_slot_logits,
// model/domino_head.hpp domino_feed and domino_slot_logits; OBJECTIVES.md §1.2, §1.3).
//
// Invariants: nothing allocates; every size comes from the arguments and every token from device
// memory (graph-capturable). Outputs are OVERWRITTEN (=), except where a contract says +=. Sums
// run in a fixed order (the same bits every run, for every batch size: a request's row never
// depends on another request's).
#pragma once

#include <cstdint>

#include "ops/sample.hpp"

#ifdef DFLASH_HAVE_CUDA

namespace dflash {

namespace cuda {
class CudaContext;
}

/// One input segment of head_pack_cuda: n values per request from a row of a table (f32 or bf16,
/// exactly one of the two non-null) with leading dimension ld. The row of request b is
/// index[b·index_ld + index_col] when `index` is set (a token id: an embedding row), else
/// b·row_stride + row_offset.
struct HeadSegment {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t ld = 0, n = 0;
  const int32_t* index = nullptr;
  int64_t index_ld = 0, index_col = 0;
  int64_t row_stride = 0, row_offset = 0;
};

/// x [B, W] f32 (W = Σ n of the used segments) = for each request b the concatenation of its rows
/// of segments s0, s1, s2 (a segment with n = 0 is unused; bf16 values converted exactly). A token
/// index outside [0, rows) is the caller's bug (the block holds drafted tokens in [0, V)). Throws
/// dflash::Error for B < 1, a segment with n > 0 whose table is missing or doubly given, ld < n,
/// or a null x.
void head_pack_cuda(cuda::CudaContext& ctx, float* x, int64_t B, const HeadSegment& s0,
                    const HeadSegment& s1 = {}, const HeadSegment& s2 = {});

/// The head's linear layer on one row per request (torch.nn.Linear, y = x·Wᵀ + b):
///   y[b·ldy + o] = base[b·ldb + o] + (bias[o] + Σ_{i<IN} W[o·IN + i]·x[b·IN + i])   (=)
/// for b < B, o < OUT; base and bias may be null (then 0). W [OUT, IN] f32, x [B, IN] f32, y and
/// base f32; y may equal base (the same row layout) and then is updated in place (+=). The sum
/// over i is f32 in a fixed order (lanes of a warp, then a fixed tree). Throws dflash::Error for
/// B < 1, IN < 1, OUT < 1, ldy < OUT, ldb < OUT with a base, or a null y, W or x.
void head_linear_cuda(cuda::CudaContext& ctx, float* y, int64_t ldy, const float* base, int64_t ldb,
                      const float* W, const float* bias, const float* x, int64_t B, int64_t IN,
                      int64_t OUT);

/// DSpark's gated Markov latent (model/drafter.hpp MarkovHeadType::gated): z[b·r + j] =
/// σ(u[b·r + j])·e[b·lde + j] for b < B, j < r; u = Wg·[h; e] + bg from head_linear_cuda (=).
/// Throws dflash::Error for B < 1, r < 1, lde < r or a null pointer.
void dspark_decode_gated_cuda(cuda::CudaContext& ctx, float* z, const float* u, const float* e,
                              int64_t lde, int64_t B, int64_t r);

/// DSpark's rnn Markov head, one slot (MarkovHeadType::rnn): with u [B, 3r] = J·[s; e; h] + bJ
/// (head_linear_cuda, s the state before the slot) and g = σ(u[:, 0:r]):
///   s ← g ⊙ s + (1 − g) ⊙ tanh(u[:, r:2r])   (state [B, r], updated in place)
///   z = tanh(u[:, 2r:3r])                      (z [B, r], =)
/// Throws dflash::Error for B < 1, r < 1 or a null pointer.
void dspark_decode_rnn_cuda(cuda::CudaContext& ctx, float* z, float* state, const float* u,
                            int64_t B, int64_t r);

/// DSpark's drafter input from the verify block [B, K+1] = [anchor, d_0 … d_{K−1}]:
/// input[b·K + j] = j == 0 ? block[b·(K+1)] : mask, for b < B, j < K (=). Throws dflash::Error
/// for B < 1, K < 1 or a null pointer.
void dspark_decode_input_cuda(cuda::CudaContext& ctx, int32_t* input, const int32_t* block,
                              int64_t B, int64_t K, int32_t mask);

/// One step of Domino's GRU for every request (PyTorch nn.GRU without bias, gate rows r, z, n):
/// with xi = W_ih·e and hh = W_hh·g ([B, 3G] f32 from head_linear_cuda, g the state before),
///   r = σ(xi_r + hh_r), z = σ(xi_z + hh_z), n = tanh(xi_n + r ⊙ hh_n),
///   g ← (1 − z) ⊙ n + z ⊙ g   (state [B, G], updated in place).
/// Throws dflash::Error for B < 1, G < 1 or a null pointer.
void domino_decode_gru_cuda(cuda::CudaContext& ctx, float* state, const float* xi, const float* hh,
                            int64_t B, int64_t G);

/// a ← SiLU(a) = a·σ(a) in place for the n values of `a` (Domino's embed_proj activation).
/// Throws dflash::Error for n < 0 or a null pointer.
void head_silu_cuda(cuda::CudaContext& ctx, float* a, int64_t n);

/// The greedy proposal of one slot: block[b·ld_block + col] = the smallest i with rows[b·ld + i]
/// maximal over i < V (the rule of argmax_rows_cuda; NaN never chosen unless the row has nothing
/// else, then 0), for b < B. Throws dflash::Error for B < 1, V < 1, ld < V, col outside
/// [0, ld_block) or a null pointer.
void decode_slot_argmax_cuda(cuda::CudaContext& ctx, int32_t* block, int64_t ld_block, int64_t col,
                             const float* rows, int64_t ld, int64_t B, int64_t V);

/// The sampled proposal of one slot: with probs [B, V] f32 the processed rows of sample_probs_cuda,
/// block[b·ld_block + col] = a draw from row b (the inverse-CDF rule of ops/sample.hpp, f64 prefix
/// sums in a fixed order, never a token of probability 0; 0 for a row without mass, which
/// sample_probs_cuda reported in the request's status) with
/// philox_uniform(seeds[b], steps[b], col, draft), and q row b·ld_block + col ([·, V] f32) =
/// probs row b, the distribution spec_sample_accept_cuda reads for that block token (=). Throws
/// dflash::Error for B < 1, V < 1, col outside [1, ld_block) or a null pointer.
void decode_slot_draw_cuda(cuda::CudaContext& ctx, int32_t* block, int64_t ld_block, int64_t col,
                           float* q, const float* probs, const uint64_t* seeds,
                           const int32_t* steps, int64_t B, int64_t V);

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
