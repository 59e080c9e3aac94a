// dflash.cpp — raw-pointer launchers of the linear layer's bias add (its GEMMs are cuBLASLt calls,
// backend/cuda/gemm.hpp) (kernels: src/backend/cuda/linear.cu; contract and checked entry points:
// src/ops/linear.hpp, src/backend/cuda/linear_cuda.cpp). Internal to the backend: model code calls
// the checked entry points. Each launcher enqueues on `s` and checks the launch (throws
// dflash::Error via backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as
// tagged by a DType. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

/// y[t, o] += bias[o] for t < T, o < OUT; y f32 or bf16 [T, OUT] (row stride OUT), bias f32.
void bias_add(void* y, DType yt, const float* bias, int64_t T, int64_t OUT, cudaStream_t s);

}  // namespace dflash::cuda::launch
