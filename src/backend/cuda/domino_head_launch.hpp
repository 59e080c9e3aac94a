// dflash.cpp — raw-pointer launchers of the Domino head's kernels (kernels:
// src/backend/cuda/domino_head.cu; the step and its contract: src/model/domino_head_cuda.hpp, the
// CPU reference src/model/domino_head.hpp). Internal to the backend: model code calls
// domino_head_cuda. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp). bf16 arrays are raw uint16_t bits. No fmt in this header (nvcc
// includes it).
//
// Row layout of a chunk (all [n, ·] arrays, n = nb·K rows, block-major): the GRU state g_j of
// block b (and its input e_j, its gates) lives at row b·K + j + off, off = 0 with shift_label and
// 1 without, which is the row of the slot that reads it (s(k) = k − off). Rows that hold no state
// (slot 0 without shift_label) are zero.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::cuda::launch {

/// out[i, :] = table[idx[i], :] for i < n (bf16 rows of `cols` values); idx[i] < 0 gives a zero
/// row. The GRU's teacher-forced inputs e = Embed(x).
void domino_gather_rows(uint16_t* out, const uint16_t* table, const int32_t* idx, int64_t n,
                        int64_t cols, cudaStream_t s);

/// Shapes of one chunk's GRU: nb blocks of K rows, state width G, `off` as above.
struct DominoGruDims {
  int64_t nb = 0, K = 0, G = 0, off = 0;
};

/// GRU step j of every block of the chunk (PyTorch gate order r, z, n, no bias):
///   r = σ(xi_r + hh_r), z = σ(xi_z + hh_z), n = tanh(xi_n + r ⊙ hh_n), g_j = (1 − z) ⊙ n + z ⊙
///   g_{j−1}
/// xi [n, 3G] f32 (rows of the layout), hh [nb, 3G] f32 = W_hh·g_{j−1} per block (null for j = 0:
/// g_{−1} = 0). Writes g_j into g [n, G] f32 and its bf16 copy gb [n, G], and gates [n, 4G] f32 =
/// (r, z, n, hh_n) at the row of g_j (=).
void domino_gru_fwd_step(float* g, uint16_t* gb, float* gates, const float* xi, const float* hh,
                         const DominoGruDims& d, int64_t j, cudaStream_t s);

/// Backward of GRU step j (called for j = steps − 1 down to 0): with dg = dstates[row] + carry +
/// dprev (dprev null for j = steps − 1, carry 0 then), writes dxi [n, 3G] bf16 = (dr, dz, dn) and,
/// for j > 0, dhh [n, 3G] bf16 = (dr, dz, dn ⊙ r) at row b·K + j + off (=), and carry [nb, G] =
/// dg ⊙ z (the direct path to g_{j−1}). dprev [nb, G] f32 is W_hhᵀ·dhh of step j + 1 (the caller's
/// GEMM). dstates [n, G] f32 is ∂loss/∂g from the head.
void domino_gru_bwd_step(uint16_t* dxi, uint16_t* dhh, float* carry, const float* dprev,
                         const float* dstates, const float* g, const float* gates,
                         const DominoGruDims& d, int64_t j, cudaStream_t s);

/// z [n, E] bf16 = SiLU(a) on rows whose slot (row mod K) is ≥ s0, 0 on the others (=).
void domino_silu_rows(uint16_t* z, const float* a, int64_t n, int64_t E, int64_t K, int64_t s0,
                      cudaStream_t s);

/// da [n, E] bf16 = dz ⊙ SiLU′(a) (=).
void domino_silu_bwd(uint16_t* da, const float* dz, const float* a, int64_t n, int64_t E,
                     cudaStream_t s);

/// The inputs of the row pass of one chunk of n rows (rows of whole blocks of K).
struct DominoRowIn {
  const float* u = nullptr;         ///< base logits U [n, V] f32
  const float* f = nullptr;         ///< corrected logits F [n, V] f32 (F = U on rows k < s0)
  const int32_t* labels = nullptr;  ///< [n]
  const float* weights = nullptr;   ///< [n]
  const double* lambda = nullptr;   ///< λ [1] (device memory: a graph replays it per step)
  int64_t n = 0, V = 0, K = 0, s0 = 0;
  float grad_scale = 0;
};

/// Per-row outputs of one chunk (views of [R] arrays offset to the chunk).
struct DominoRowOut {
  float* ce_f = nullptr;      ///< CE(F_k, y_k) (0 on unsupervised rows)
  float* ce_u = nullptr;      ///< CE(U_k, y_k) (0 on unsupervised rows)
  int32_t* argmax = nullptr;  ///< argmax F_k, first index of the largest (−1 unsupervised)
};

/// One block per row: softmax statistics of U and F, both CEs, argmax F and, when du is not
/// null, with c = grad_scale·w: on corrected rows (k ≥ s0) df = c·(1−λ)·(P_F − 1_y) and du =
/// c·λ·(P_U − 1_y) + df; on the others du = c·(P_U − 1_y), df = 0; both 0 on rows with w = 0
/// (bf16 [n, V], =).
void domino_rows(const DominoRowIn& in, const DominoRowOut& out, uint16_t* du, uint16_t* df,
                 cudaStream_t s);

/// sums[0..3] = Σ w·((1−λ)·CE_F + λ·CE_U), Σ w, Σ w·CE_F, Σ w·CE_U over the R rows with w ≠ 0,
/// in double, in a fixed order (one block); λ = lambda[0] (device memory).
void domino_sums(double* sums, const float* ce_f, const float* ce_u, const float* weights,
                 int64_t R, const double* lambda, cudaStream_t s);

}  // namespace dflash::cuda::launch
