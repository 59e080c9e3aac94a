// dflash.cpp — the sampling ops of speculative decoding on the GPU (infer/decoder_cuda.hpp): the
// processed distribution of logits rows (temperature, top-k, top-p), draws from it keyed by a
// counter-based generator, and the exact speculative rejection rule.
//
// Processing of one row (the CPU's infer/sampling.hpp, in the same order and with the same ties):
//   x_i = logit_i · inv_temperature (f32);
//   top-k (0 < k < V): keep x_i ≥ the k-th largest x (ties kept), found by a radix select over the
//     order-preserving bits of x (4 passes of 8 bits), not a sort;
//   e_i = exp(x_i − max x) over the kept tokens (f32), Z = Σ e_i (f64, a fixed order);
//   top-p (p < 1): order the kept tokens by x descending, ties by id ascending, and keep the
//     shortest prefix whose mass reaches p, i.e. token j is kept iff the mass strictly before it is
//     < p (at least one token). The last kept value v* is found by a radix descent over the same
//     bits whose bins sum the masses e_i / Z in fixed point (units of 2^-52, integer atomics:
//     deterministic, within V·2^-53 of the exact sum); among the tokens of value v* the first
//     ones by id are kept;
//   probs_i = e_i / Σ_kept e (f64 sum, stored f32); every other token has probability exactly 0.
// A draw of a token from weights w (probabilities, or the residual max(0, p − q)) with a uniform u
// in [0, 1): the smallest i with Σ_{j ≤ i} w_j > u · Σ w (f64 prefix sums in a fixed order),
// never a token of weight 0 (the CPU's sample_index).
//
// Random numbers: philox_uniform(seeds[b], steps[b], slot, purpose) (core/philox.hpp): request b's
// seed, its step count (0 for the first token, +1 per accepted step), the block slot decided and
// what is decided. A request's draws therefore depend on neither the batch nor the other requests.
//
// Speculative rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2; infer/sampling.hpp):
// for n = 0, 1, …: the draft d_{n+1} ~ q_{n+1} is accepted when u < min(1, p_n(d)/q_{n+1}(d))
// (u: purpose accept, slot n+1); at the first rejection the token is drawn from
// norm(max(0, p_n − q_{n+1})) (purpose token, slot n+1; from p_n when that residual is all 0);
// when all K−1 are accepted the bonus is drawn from p_{K−1} (purpose token, slot K).
//
// Errors inside a captured step cannot throw: a row with a NaN logit or no finite one sets
// status[request] (kSampleStatusNan / kSampleStatusNoFinite), and spec_sample_accept_cuda reports
// it as the request's output count −status (the host turns it into a dflash::Error).
// Invariants: nothing allocates; sizes come from the arguments and per-request state from device
// memory (graph-capturable; a captured step stays valid while lengths, seeds and the sampling
// settings in `params` change). Outputs are OVERWRITTEN.
#pragma once

#include <cstdint>

#ifdef DFLASH_HAVE_CUDA

namespace dflash {

namespace cuda {
class CudaContext;
}

/// The sampling settings as the kernels read them (device memory, so that a captured step stays
/// valid when they change): inv_temperature = 1/T (T > 0), top_k (0: off), top_p in (0, 1].
struct SampleParamsDevice {
  float inv_temperature = 1.0f;
  int32_t top_k = 0;
  double top_p = 1.0;
};

/// status codes of a request (0: fine).
constexpr int32_t kSampleStatusNan = 1;       ///< a logit of one of its rows is NaN
constexpr int32_t kSampleStatusNoFinite = 2;  ///< every kept logit of one of its rows is -inf

/// probs [R, V] f32 = the processed distribution (file comment) of logits [R, V] f32 under
/// *params, for every row r except those with r % skip == 0 when skip > 0 (left as they are).
/// probs may alias logits (each entry is read before it is written by the same thread). A bad
/// row sets status[r / rows_per_request] (and its probs are all 0). Throws dflash::Error for
/// R < 0, V < 1, skip < 0, rows_per_request < 1 or a null pointer.
void sample_probs_cuda(cuda::CudaContext& ctx, float* probs, const float* logits, int64_t R,
                       int64_t V, int64_t skip, const SampleParamsDevice* params, int32_t* status,
                       int64_t rows_per_request);

/// The drafter's proposals under sampling: for b < B, k in [1, K): block[b·K + k] = a draw from
/// q row b·K + k ([B·K, V] f32 probabilities) with philox_uniform(seeds[b], steps[b], k, draft).
/// Throws dflash::Error for B < 1, K < 2, V < 1 or a null pointer.
void sample_drafts_cuda(cuda::CudaContext& ctx, int32_t* block, const float* q,
                        const uint64_t* seeds, const int32_t* steps, int64_t B, int64_t K,
                        int64_t V);

/// The speculative rule (file comment) for every request b < B with active[b] != 0, given the
/// step's block [B, K] = [anchor, d_1 … d_{K−1}], the target's probabilities p [B·K, V] (row
/// b·K + n: the distribution after block token n) and the drafter's q [B·K, V] (row b·K + k: the
/// distribution d_k was drawn from; row b·K unused). Writes out[b·(K+1)] = n + 1 and the n
/// accepted drafts then the drawn token after it; lens[b] += n + 1; steps[b] += 1; block[b·K..] =
/// [token, mask × (K−1)]. When status[b] != 0 it writes out[b·(K+1)] = −status[b] and changes
/// nothing else. Inactive requests get out[b·(K+1)] = 0. K = 1 is target-only sampling (q unread,
/// may be null). Throws dflash::Error for B < 1, K < 1, V < 1 or a null pointer.
void spec_sample_accept_cuda(cuda::CudaContext& ctx, int32_t* out, int32_t* lens, int32_t* block,
                             int32_t* steps, const float* p, const float* q, const uint64_t* seeds,
                             const int32_t* status, const int32_t* active, int64_t B, int64_t K,
                             int64_t V, int32_t mask);

/// The first token of request b after its prefill: seeds[b] = seed, steps[b] = 1 and *token = a
/// draw from the probabilities row `p` [V] with philox_uniform(seed, 0, 0, token), or −status[b]
/// when status[b] != 0. Throws dflash::Error for b < 0, V < 1 or a null pointer.
void sample_first_cuda(cuda::CudaContext& ctx, int32_t* token, const float* p, uint64_t* seeds,
                       int32_t* steps, const int32_t* status, int64_t b, uint64_t seed, int64_t V);

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
