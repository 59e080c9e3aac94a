// dflash.cpp — raw-pointer launchers of the residual add (kernels: src/backend/cuda/residual.cu;
// contract and checked entry points: src/ops/residual.hpp, src/backend/cuda/residual_cuda.cpp).
// Internal to the backend: model code calls the checked entry points. Each launcher enqueues on `s`
// and checks the launch (throws dflash::Error via backend/cuda/check.hpp); float arrays are f32 or
// bf16 (raw uint16_t bits) as tagged by a DType. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

void residual_fwd(void* y, const void* a, const void* b, DType t, int64_t n, cudaStream_t s);
void residual_accumulate(void* y, DType yt, const void* b, DType bt, int64_t n, cudaStream_t s);

}  // namespace dflash::cuda::launch
