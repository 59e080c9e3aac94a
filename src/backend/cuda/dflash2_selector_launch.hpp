// dflash.cpp — raw-pointer launchers of DFlash2's candidate selector and loss rows (kernels:
// src/backend/cuda/dflash2_selector.cu; the step and its contract: src/model/dflash2_head_cuda.hpp,
// the CPU reference src/model/dflash2_selector.hpp). Internal to the backend: model code calls
// dflash2_head_cuda. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp). bf16 arrays are raw uint16_t bits. No fmt in this header (nvcc
// includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dflash::cuda::launch {

/// The most candidates (selector_top_k) and the largest rank (selector_rank) the row kernel holds.
constexpr int kDflash2MaxTopK = 1024;
constexpr int kDflash2MaxRank = 1024;

/// The inputs of the row pass of one chunk of n rows.
struct Dflash2SelIn {
  float* logits = nullptr;          ///< [n, V] f32: U on entry, overwritten (scratch)
  uint16_t* dl = nullptr;           ///< [n, V] bf16 out: ∂loss/∂U·grad_scale (0 on rows w = 0)
  const uint16_t* hf = nullptr;     ///< [n, H] the final-norm block rows
  const int32_t* labels = nullptr;  ///< [n] gold y
  const float* weights = nullptr;   ///< [n] w (0: the row adds nothing)
  const int32_t* prev = nullptr;    ///< [n] predecessor in [0, V]; V: the row has no selector term
  const float *A = nullptr, *Bs = nullptr, *Ph = nullptr;  ///< f32 [V, r], [V, r], [r, H]
  int64_t n = 0, V = 0, H = 0, r = 0;
  int K = 0;
  float m = 1, cap = 0, grad_scale = 0;
  /// [1] α_sel on the device (read by the kernel, so that a replayed CUDA graph uses each step's;
  /// cast to f32 as the CPU step's scale).
  const double* alpha = nullptr;
  bool stop = false;      ///< stop_gradient: no ∂ū (and no ∂h) from the selector
  bool with_base = true;  ///< dl includes the base CE's gradient (false: the fused CE's job)
};

/// Per-row outputs of the row pass, views of [R]-row arrays offset to the chunk.
struct Dflash2SelRows {
  float* base = nullptr;      ///< [n] CE(ū, y) (0 on rows w = 0)
  float* sel = nullptr;       ///< [n] the K-way CE (0 when y ∉ C or no selector term)
  float* in_topk = nullptr;   ///< [n] 1 when the row has a selector term and y ∈ C, else 0
  int32_t* argmax = nullptr;  ///< [n] argmax ū (lowest id on ties; −1 on rows w = 0); null: none
  float* e = nullptr;         ///< [n, r] A[prev] ⊙ P_h·h (0 without a selector term)
  float* dproj = nullptr;     ///< [n, r] ∂/∂(P_h·h), scaled (0 without; kept with stop: dP_h)
  float* da = nullptr;        ///< [n, r] the row's ∂A[prev], scaled (0 without)
  int32_t* cand = nullptr;    ///< [n, K] C sorted by ū descending then id (V without a term)
  float* ds = nullptr;        ///< [n, K] grad_scale·α·w·(softmax − onehot) over C (0 without)
};

/// One block per row: ū = softcap(m·U), argmax, the base CE and, on rows with a predecessor and
/// w ≠ 0, the top-K candidates, the scores S = ū[c] + ⟨A[prev] ⊙ P_h·h, Bs[c]⟩, the K-way CE and
/// its gradient pieces; dl = ∂/∂U of grad_scale·w·(base + α·sel) (without base unless with_base;
/// the selector's part unless stop).
void dflash2_selector_rows(const Dflash2SelIn& in, const Dflash2SelRows& out, cudaStream_t s);

/// dhf[i, c] += Σ_q dproj[i, q]·Ph[q, c] for i < n (the selector's ∂h; rows in parallel, q in
/// order).
void dflash2_dh_add(float* dhf, const float* dproj, const float* Ph, int64_t n, int64_t H,
                    int64_t r, cudaStream_t s);

/// dPh[q, c] += Σ_{i < R} dproj[i, q]·hf[i, c], rows in order.
void dflash2_dph(float* dPh, const float* dproj, const uint16_t* hf, int64_t R, int64_t H,
                 int64_t r, cudaStream_t s);

/// Bytes of cub's radix-sort scratch for `items` (key, index) pairs with keys in [0, V].
size_t dflash2_sort_scratch_bytes(int64_t items, int64_t V);

/// grad[key, :] += Σ_{items k with keys[k] = key} coef[k]·vec[k / per, :] (coef null: 1) for keys
/// in [0, V) (key V: skipped), each key's items summed in item order: the items are sorted by key
/// with a stable radix sort (deterministic), then each key's segment is summed by one thread per
/// column. Scratch: idx_in, keys_sorted, idx_sorted [items] and sort_ws (sort_bytes ≥
/// dflash2_sort_scratch_bytes).
void dflash2_keyed_scatter(float* grad, const int32_t* keys, const float* coef, const float* vec,
                           int64_t items, int64_t per, int64_t r, int64_t V, int32_t* idx_in,
                           int32_t* keys_sorted, int32_t* idx_sorted, void* sort_ws,
                           size_t sort_bytes, cudaStream_t s);

/// sums[0..4] = Σ w·base, Σ w, Σ w·sel, Σ w·in_topk, Σ w·(base + α·sel) over the R rows, in
/// double, in a fixed order (one block); α = *alpha, read on the device.
void dflash2_sums(double* sums, const Dflash2SelRows& rows, const float* weights, int64_t R,
                  const double* alpha, cudaStream_t s);

}  // namespace dflash::cuda::launch
