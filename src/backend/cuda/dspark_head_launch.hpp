// dflash.cpp — raw-pointer launchers of the DSpark head's row kernels (kernels:
// src/backend/cuda/dspark_head.cu; the step and its contract: src/model/dspark_head_cuda.hpp, the
// CPU reference src/model/dspark_head.hpp). Internal to the backend: model code calls
// dspark_head_cuda. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp). bf16 arrays are raw uint16_t bits. No fmt in this header (nvcc
// includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::cuda::launch {

/// out[i, :] = table[idx[i], :] for i < n (bf16 rows of `cols` values, leading dimension `ld` in
/// the table, `cols` in out); idx[i] < 0 gives a zero row. The gathers of the Markov embedding
/// e = W1[prev] and of the teacher rows Hl[a+k].
void dspark_gather_rows(uint16_t* out, const uint16_t* table, const int32_t* idx, int64_t n,
                        int64_t cols, int64_t ld, cudaStream_t s);

/// Per-row statistics of one chunk, as struct-of-arrays views of [R] arrays offset to the chunk.
struct DsparkRowOut {
  float* ce = nullptr;        ///< CE_k (0 on unsupervised rows)
  float* l1 = nullptr;        ///< L1_k (0 on unsupervised rows)
  float* bce = nullptr;       ///< BCE_k (0 without a confidence head or on unsupervised rows)
  float* acc = nullptr;       ///< acc_k (NaN on unsupervised rows)
  float* conf = nullptr;      ///< c_k (NaN without a confidence head or on unsupervised rows)
  float* dconf = nullptr;     ///< grad_scale·w·αconf·(σ(c) − acc) (0 when not computed)
  int32_t* argmax = nullptr;  ///< argmax D_k (−1 on unsupervised rows)
};

/// The inputs of the row pass of one chunk of n rows.
struct DsparkRowIn {
  const float* d = nullptr;         ///< draft logits D [n, V] f32
  const float* t = nullptr;         ///< teacher logits [n, V] f32
  const uint16_t* hf = nullptr;     ///< drafter final hidden states [n, H] bf16
  const uint16_t* emb = nullptr;    ///< gathered W1 rows [n, r] bf16 (read when conf_r > 0)
  const float* conf_w = nullptr;    ///< confidence weight [H + conf_r] f32 (null: no head)
  const float* conf_b = nullptr;    ///< confidence bias [1] f32
  const int32_t* labels = nullptr;  ///< [n]
  const float* weights = nullptr;   ///< [n]
  int64_t n = 0, V = 0, H = 0, r = 0;
  int64_t conf_r = 0;  ///< Markov columns of the confidence input (0 or r)
  float a_ce = 0, a_l1 = 0, a_conf = 0, grad_scale = 0;
};

/// One block per row: softmax D and softmax T (online max and Σexp), argmax D, CE, L1, acc, the
/// confidence logit and its BCE and, when dd is not null, dd bf16 [n, V] (leading dimension ldd ≥
/// V) = grad_scale·w·(αce·(P − onehot(y)) + αl1·P⊙(sign(P − T) − Σ_v P_v·sign(P_v − T_v))) (0 on
/// rows with w = 0). dd may overlay the teacher logits in place: dd = (uint16_t*)in.t with ldd =
/// 2V (row i of dD in the first half of TL's row i; TL is garbage afterwards); any other overlap of
/// dd with in.d or in.t is undefined.
void dspark_rows(const DsparkRowIn& in, const DsparkRowOut& out, uint16_t* dd, int64_t ldd,
                 cudaStream_t s);

/// The confidence head's backward over one chunk: dhf[i, h] += dconf[i]·wc[h] (h < H), demb[i, j]
/// += dconf[i]·wc[H + j] (j < conf_r), gw[c] += Σ_i dconf[i]·x[i, c] (x = [hf ; emb], rows in
/// order) and gb += Σ_i dconf[i].
void dspark_conf_bwd(float* dhf, float* demb, float* gw, float* gb, const float* dconf,
                     const uint16_t* hf, const uint16_t* emb, const float* wc, int64_t n, int64_t H,
                     int64_t r, int64_t conf_r, cudaStream_t s);

/// gw1[tok, :] += Σ_{i ∈ segment} demb[order[i], :] for each segment s of `order` (rows sorted by
/// previous token; segment s is [seg[s], seg[s+1]) and its token prev[order[seg[s]]]), summed in
/// the segment's order: deterministic, no atomics. max_segments ≥ the number of segments (seg has
/// max_segments + 1 entries; trailing segments are empty).
void dspark_w1_scatter(float* gw1, const float* demb, const int32_t* prev, const int32_t* order,
                       const int32_t* seg, int64_t max_segments, int64_t r, cudaStream_t s);

/// dst[i, c] = src[i, c] for i < n, c < cols (bf16 rows; leading dimensions ld_dst and ld_src);
/// zeros when src is null. Builds the gated head's input [h ; e] and the rnn head's [s ; e ; h].
void dspark_copy_cols(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src, int64_t n,
                      int64_t cols, cudaStream_t s);

/// The latent z [n, r] of a gated or rnn head is written as z2 bf16 [n, 2r]: columns [0, r) hold
/// z_hi = bf16(z), columns [r, 2r) z_lo = bf16(z − z_hi), so z_hi + z_lo is z to about 16 bits. One
/// bias GEMM D += z2·[W2 | W2]ᵀ (K = 2r) then matches the CPU's fp32 z, where a bf16 z alone would
/// move the logits by ~2⁻⁹·|W2·z|.

/// The gated head's forward over n rows (model/drafter.hpp MarkovHeadType::gated): pre [n, r]
/// holds Wg·[h ; e] on entry and Wg·[h ; e] + bg on return; z = σ(pre) ⊙ e into z2 [n, 2r].
void dspark_gated_fwd(float* pre, const float* bias, const uint16_t* emb, uint16_t* z2, int64_t n,
                      int64_t r, cudaStream_t s);

/// The gated head's backward from dz [n, r] = ∂/∂z: with g = σ(pre), demb = dz ⊙ g (overwritten),
/// dpre = dz ⊙ e ⊙ g ⊙ (1 − g), written as f32 (for ∂bg) and bf16 (the input of the GEMMs ∂[h ; e]
/// = dpre·Wg and ∂Wg += dpreᵀ·[h ; e]).
void dspark_gated_bwd(const float* dz, const float* pre, const uint16_t* emb, float* demb,
                      float* dpre, uint16_t* dpre_bf16, int64_t n, int64_t r, cudaStream_t s);

/// The rnn head's recurrence over n rows = n/K whole blocks of K slots, one block of threads per
/// block row group, slots in order (model/drafter.hpp MarkovHeadType::rnn). u [n, 3r] holds
/// J[:, r:]·[e ; h] on entry (the GEMM over the non-recurrent inputs, the s columns of `in` being
/// 0) and u = J·[s_{k−1} ; e ; h] + bJ on return (s_{k−1}·J[:, :r]ᵀ summed in j order, fp32, J
/// read from its bf16 copy `jw` [3r, ld]); sprev [n, r] f32 and the s columns of in [n, ld] (bf16)
/// receive s_{k−1} (0 at slot 0); z = tanh(u[2r:3r]) into z2 [n, 2r].
void dspark_rnn_fwd(float* u, const float* bias, const uint16_t* jw, int64_t ld, float* sprev,
                    uint16_t* in, uint16_t* z2, int64_t n, int64_t K, int64_t r, cudaStream_t s);

/// The rnn head's backward through each block's slots, last to first (the CPU's
/// markov_backward): from dz [n, r], u and sprev of dspark_rnn_fwd, du [n, 3r] = ∂/∂u as f32 and
/// bf16; the recurrence ∂s_{k−1} = ∂s_k ⊙ σ(g) + du·J[:, :r] runs in fp32 in a fixed order.
void dspark_rnn_bwd(const float* dz, const float* u, const float* sprev, const uint16_t* jw,
                    int64_t ld, float* du, uint16_t* du_bf16, int64_t n, int64_t K, int64_t r,
                    cudaStream_t s);

/// out[c] += Σ_i in[i, c] for c < cols (rows in order, one thread per column): a bias gradient.
void dspark_col_sum(float* out, const float* in, int64_t n, int64_t cols, cudaStream_t s);

/// The Markov head's input gradient dx [n, ldx] (columns h_col.. the hidden state, e_col.. the
/// embedding) into dhf [n, H] (+=) and demb [n, r] (+= when add_e, else =).
void dspark_markov_dx(float* dhf, float* demb, const float* dx, int64_t ldx, int64_t h_col,
                      int64_t e_col, int64_t n, int64_t H, int64_t r, bool add_e, cudaStream_t s);

/// sums[0..5] = Σ w·(αce·CE + αl1·L1 + αconf·BCE), Σ w, Σ w·CE, Σ w·L1, Σ w·BCE, Σ w·acc over the
/// R rows with w ≠ 0, in double, in a fixed order (one block).
void dspark_sums(double* sums, const DsparkRowOut& rows, const float* weights, int64_t R,
                 double a_ce, double a_l1, double a_conf, cudaStream_t s);

}  // namespace dflash::cuda::launch
