// dflash.cpp — DFlash2's selector walk in the CUDA decoder's step (infer/decoder_cuda.hpp): the
// proposals of slots 1..K−1 of B requests' blocks from the drafter's block logits, on the device
// (../shared/OBJECTIVES.md §1.4; the CPU walk and its formulas: model/dflash2_selector.hpp, the
// CPU decoder's use of it: infer/speculative.cpp). For request b < B and its row i = b·K + k of
// slot k ∈ [1, K), with U_i the drafter's block logits [V] and h_i its final-norm row [H]:
//   ū_i = softcap(m·U_i), softcap(z) = c·tanh(z/c) (c > 0; c = 0: ū = m·U)
//   C_i = topK(ū_i)                            Kc = selector_top_k, by ū descending then id
//   p_i = P_h·h_i                              [r]
//   prev_1 = block[b·K] (the anchor), prev_{k+1} = d_k (the slot's proposal)
//   S_i(c) = ū_i[c] + Σ_q (A[prev_k, q]·p_i[q])·Bs[c, q]      for c ∈ C_i (q in order, f32)
//   greedy:  d_k = the c ∈ C_i of the largest S_i(c) (the first in C_i's order on ties)
//   sampled: q_i[c] = exp(S_i(c)·τ − max S·τ) / Σ_{C_i} exp(…) on C_i, 0 elsewhere (f32; τ =
//            params->inv_temperature; top-k and top-p do not apply, as on the CPU); d_k = the
//            smallest id c with Σ_{c' ≤ c} q_i[c'] > u·Σ q_i (f64 sums over C_i by id) for
//            u = philox_uniform(seeds[b], steps[b], k, draft) — ops/sample.hpp's draw, which
//            never takes a token of weight 0.
// The slots are walked left to right (greedy, not Viterbi). The parts that do not depend on prev
// (ū, C, p, the zeros of q rows) run for all B·(K−1) rows at once, the walk itself one block per
// request.
//
// Invariants: nothing allocates; sizes come from the arguments, the sampling settings, seeds and
// steps from device memory (graph-capturable). Every sum runs in a fixed order: a request's
// proposals and q rows depend on its own rows only (not on B or the other requests), and a rerun
// gives the same bits. Outputs are OVERWRITTEN: logits rows 1..K−1 of each block with ū, the
// scratch, block slots 1..K−1, and (sampled) q rows 1..K−1. A NaN score sets status[b] =
// kSampleStatusNan and a slot of no finite score kSampleStatusNoFinite (ops/sample.hpp; the step's
// acceptance reports it), the slot then proposing its first candidate.
#pragma once

#include <cstdint>

#ifdef DFLASH_HAVE_CUDA

#include "ops/sample.hpp"

namespace dflash {

namespace cuda {
class CudaContext;
}

/// The arrays and sizes of one walk (the file comment's names).
struct Dflash2WalkArgs {
  float* logits = nullptr;          ///< [B·K, V] f32: U on entry; rows k ≥ 1 hold ū on return
  const uint16_t* hf = nullptr;     ///< [B·K, H] bf16 bits: the drafter's final-norm rows
  const float* A = nullptr;         ///< [V, r] f32: candidate_selector.predecessor_codebook
  const float* Bs = nullptr;        ///< [V, r] f32: candidate_selector.successor_codebook
  const float* Ph = nullptr;        ///< [r, H] f32: candidate_selector.hidden_projection.weight
  int32_t* block = nullptr;         ///< [B·K]: the anchors in, slots 1..K−1 written
  int32_t* cand = nullptr;          ///< [B·K, Kc] scratch: C of each row
  float* cand_u = nullptr;          ///< [B·K, Kc] scratch: ū of each candidate
  float* proj = nullptr;            ///< [B·K, r] scratch: P_h·h of each row
  float* q = nullptr;               ///< [B·K, V] f32 out (sampled) or null (greedy)
  const uint64_t* seeds = nullptr;  ///< [B] (sampled)
  const int32_t* steps = nullptr;   ///< [B] (sampled)
  int32_t* status = nullptr;        ///< [B] (sampled): set on a bad slot
  const SampleParamsDevice* params = nullptr;  ///< (sampled) inv_temperature
  int64_t B = 0, K = 0, V = 0, H = 0, r = 0;
  int top_k = 0;               ///< Kc
  float m = 1.0f, cap = 0.0f;  ///< output_multiplier, final_logit_softcapping
};

/// The most candidates and the largest rank the walk holds (its shared memory).
constexpr int kDflash2WalkMaxTopK = 1024;
constexpr int kDflash2WalkMaxRank = 1024;

/// The walk of the file comment for a.B requests of block size a.K (greedy when a.q is null).
/// Throws dflash::Error for B < 1, K < 2, V < Kc, Kc outside [1, kDflash2WalkMaxTopK], r outside
/// [1, kDflash2WalkMaxRank], H < 1, a null pointer (the sampled ones only when sampled).
void dflash2_walk_cuda(cuda::CudaContext& ctx, const Dflash2WalkArgs& a);

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
