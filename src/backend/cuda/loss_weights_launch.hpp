// dflash.cpp — raw-pointer launchers of the D-PACE loss weights (kernels:
// src/backend/cuda/loss_weights.cu; contract and checked entry points: src/ops/loss_weights.hpp,
// src/backend/cuda/loss_weights_cuda.cpp). Internal to the backend: model code calls the checked
// entry points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"
#include "ops/loss_weights.hpp"

namespace dflash::cuda::launch {

// (semantics: ops/loss_weights.hpp)
/// D-PACE weights in place (w: CE in, weight out) and sums {Σ w·CE, Σ w}; one CTA; K ≤ 64.
void dpace_weights(float* w, double* sums, const float* mask, int64_t N, int K, LossType loss,
                   double alpha, cudaStream_t s);
/// x[r, :] *= w[r] over R rows of H.
void rows_scale(float* x, const float* w, int64_t R, int64_t H, cudaStream_t s);

}  // namespace dflash::cuda::launch
