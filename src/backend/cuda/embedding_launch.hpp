// dflash.cpp — raw-pointer launchers of the embedding lookup (kernels:
// src/backend/cuda/embedding.cu; contract and checked entry points: src/ops/embedding.hpp,
// src/backend/cuda/embedding_cuda.cpp). Internal to the backend: model code calls the checked entry
// points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

void embedding_fwd(void* y, DType yt, const void* table, DType wt, const int32_t* ids, int64_t T,
                   int64_t V, int64_t H, cudaStream_t s);

}  // namespace dflash::cuda::launch
