// dflash.cpp — raw-pointer launchers of RoPE (and the fused per-head RMSNorm + RoPE) (kernels:
// src/backend/cuda/rope.cu; contract and checked entry points: src/ops/rope.hpp,
// src/backend/cuda/rope_cuda.cpp). Internal to the backend: model code calls the checked entry
// points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

void rope(void* y, const void* x, DType t, const int32_t* pos, const float* inv_freq, float scaling,
          float sign, int64_t T, int64_t NH, int64_t D, cudaStream_t s);
/// y = rope(rmsnorm(x)) per head row (ops/rope.hpp, rmsnorm_rope_fwd_cuda); y may alias x.
void rmsnorm_rope_fwd(void* y, DType yt, const void* x, DType xt, const float* w,
                      const int32_t* pos, const float* inv_freq, float scaling, int64_t T,
                      int64_t NH, int64_t D, float eps, cudaStream_t s);

}  // namespace dflash::cuda::launch
