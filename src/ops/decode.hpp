// dflash.cpp — the small device ops of speculative decoding on the GPU (infer/decoder_cuda.hpp):
// the rows of a step over per-request KV caches, the cache writes, argmax, greedy acceptance.
//
// Layout shared by these ops. A batch holds up to B requests; request b owns rows
// [b·C, (b+1)·C) of every KV cache (C = the cache capacity per request, in tokens), and
// lens[b] of them are final (the tokens whose K/V rows are committed). A step feeds K rows per
// request, request-major: row r = b·K + j is the token at position lens[b] + j of request b.
// `block` [B, K] holds those tokens: [anchor, d_1 … d_{K−1}] (the drafter's input is
// [anchor, MASK × (K−1)], its proposals then replace the masks).
//
// Invariants: every op reads its sizes from the arguments and its per-request state (lens,
// active) from device memory, so a step's launches are graph-capturable and a captured step stays
// valid while the lengths change. Nothing here allocates. Outputs are OVERWRITTEN.
// Greedy acceptance is DESIGN.md §1 "Inference": the longest prefix of proposals d_k equal to the
// target's argmax at row k−1, then the target's own token at the first mismatch (the bonus).
#pragma once

#include <cstdint>

#include "ops/attention.hpp"

#ifdef DFLASH_HAVE_CUDA

namespace dflash {

namespace cuda {
class CudaContext;
}

/// Positions, cache slots and key ranges of a step's rows (all device arrays of B·K entries;
/// `lens` [B] device). For row r = b·K + j with L = min(lens[b], C − K) (the clamp keeps the rows
/// of a finished request, which a fixed-shape step still computes, inside its own C rows; a live
/// request has lens[b] + K ≤ C), p = L + j and base = (first + b)·C:
///   pos[r] = p; slots[r] = base + p;
///   causal[r] = {base, base + p + 1, 0, 0} (the target: its cache up to itself);
///   block[r]  = {base, base + L + K, 0, 0} (the drafter: its context and its whole block,
///               bidirectional inside the block).
/// `first` offsets the request index (a prefill of request b alone passes B = 1, first = b and
/// lens + b). `block` may be null. Throws dflash::Error for B < 1, K < 1, C < K or
/// (first + B)·C beyond int32.
void decode_rows_cuda(cuda::CudaContext& ctx, int32_t* pos, int32_t* slots, AttnRange* causal,
                      AttnRange* block, const int32_t* lens, int64_t B, int64_t K, int64_t first,
                      int64_t C);

/// cache[slots[r]·W + i] = rows[r·W + i] for r < R, i < W (bf16 bits; one K or V row of W =
/// NKV·D values per token). Slots must be distinct and inside the cache (the caller's plan).
/// Throws dflash::Error for R < 0, W < 1 or a null pointer.
void kv_scatter_cuda(cuda::CudaContext& ctx, uint16_t* cache, const uint16_t* rows,
                     const int32_t* slots, int64_t R, int64_t W);

/// out[r] = the smallest i with logits[r·V + i] maximal (f32 [R, V]; the rule of the CPU's
/// argmax_row; NaN entries are never chosen unless the row has nothing else). Throws
/// dflash::Error for R < 0, V < 1 or a null pointer.
void argmax_rows_cuda(cuda::CudaContext& ctx, int32_t* out, const float* logits, int64_t R,
                      int64_t V);

/// The drafter's proposals: block[b·K + k] = argmax of logits row b·K + k for k in [1, K) (f32
/// [B·K, V], the drafter's block logits); the anchors block[b·K] are left as they are. Throws
/// dflash::Error for B < 1, K < 2, V < 1 or a null pointer.
void draft_propose_cuda(cuda::CudaContext& ctx, int32_t* block, const float* logits, int64_t B,
                        int64_t K, int64_t V);

/// Greedy acceptance of one step for every request b < B with active[b] != 0, given the step's
/// block [B, K] and the target's argmax `target` [B, K] of its rows:
///   n = the largest n ≤ K−1 with block[b·K + k] == target[b·K + k − 1] for all k in [1, n];
///   out[b·(K+1)] = n + 1; out[b·(K+1) + 1 + i] = block[b·K + 1 + i] for i < n, then the bonus
///   target[b·K + n]; lens[b] += n + 1; the next drafter input block[b·K..] = [bonus,
///   mask × (K−1)].
/// Inactive requests get out[b·(K+1)] = 0 and keep their lens and block. K = 1 is target-only
/// decoding (n = 0, the target's token). Throws dflash::Error for B < 1, K < 1 or a null pointer.
void greedy_accept_cuda(cuda::CudaContext& ctx, int32_t* out, int32_t* lens, int32_t* block,
                        const int32_t* target, const int32_t* active, int64_t B, int64_t K,
                        int32_t mask);

/// Admission of request b after its prefill of `len` tokens: lens[b] = len, active[b] = 1 and
/// block[b·K..] = [*first_token, mask × (K−1)] (first_token: a device int32, the prefill's
/// argmax). Throws dflash::Error for b < 0, K < 1, len < 1 or a null pointer.
void decode_admit_cuda(cuda::CudaContext& ctx, int32_t* lens, int32_t* active, int32_t* block,
                       const int32_t* first_token, int64_t b, int64_t K, int64_t len, int32_t mask);

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
