// dflash.cpp — raw-pointer launchers of the seeded uniform fill (kernels: src/backend/cuda/fill.cu;
// contract and checked entry points: src/ops/fill.hpp, src/backend/cuda/fill_cuda.cpp). Internal to
// the backend: model code calls the checked entry points. Each launcher enqueues on `s` and checks
// the launch (throws dflash::Error via backend/cuda/check.hpp); float arrays are f32 or bf16 (raw
// uint16_t bits) as tagged by a DType. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

/// y = offset + bound·(2u − 1), u from the hash of ops/fill.hpp.
void fill_uniform(void* y, DType t, int64_t n, float offset, float bound, uint64_t seed,
                  cudaStream_t s);

}  // namespace dflash::cuda::launch
