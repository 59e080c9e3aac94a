// dflash.cpp — raw-pointer launchers of the fused LM-head cross-entropy's row pass (kernels:
// src/backend/cuda/cross_entropy.cu; contract and checked entry points: src/ops/cross_entropy.hpp,
// src/backend/cuda/cross_entropy_cuda.cpp). Internal to the backend: model code calls the checked
// entry points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

/// One chunk of n rows: logits f32 [n, V] → lse, argmax, row_loss [n] (w·loss, 0 when w = 0) and,
/// when dlogits is not null, dlogits bf16 [n, V] = grad_scale·w·(softmax − onehot).
void ce_rows(float* row_loss, float* lse, int32_t* argmax, uint16_t* dlogits, const float* logits,
             const int32_t* labels, const float* weights, float grad_scale, int64_t n, int64_t V,
             cudaStream_t s);
/// Blocks of K rows whose first row is skipped (FusedCeParams::skip_first_of): head row j of the
/// `blocks` blocks is source row j/(K−1)·K + 1 + j%(K−1). hidden_c [blocks·(K−1), H] bf16 =
/// hidden's head rows, labels_c and weights_c (null when weights is) their labels and weights.
void ce_gather(uint16_t* hidden_c, int32_t* labels_c, float* weights_c, const uint16_t* hidden,
               const int32_t* labels, const float* weights, int64_t blocks, int64_t K, int64_t H,
               cudaStream_t s);
/// The inverse for the outputs over the blocks·K rows: head rows take d_hidden (may be null),
/// row_loss, lse and argmax (may be null) from the gathered ones; a skipped row gets d_hidden 0,
/// row_loss 0 (NaN when weights is null or its weight is not 0), lse NaN and argmax −1.
void ce_scatter(float* d_hidden, float* row_loss, float* lse, int32_t* argmax,
                const float* d_hidden_c, const float* row_loss_c, const float* lse_c,
                const int32_t* argmax_c, const float* weights, int64_t blocks, int64_t K,
                int64_t H, cudaStream_t s);
/// sums[0] = Σ row_loss, sums[1] = Σ w (null weights: R) in double, fixed order (one block).
void ce_sums(double* sums, const float* row_loss, const float* weights, int64_t R, cudaStream_t s);

}  // namespace dflash::cuda::launch
