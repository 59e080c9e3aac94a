// dflash.cpp — raw-pointer launchers of the dtype cast (kernels: src/backend/cuda/cast.cu; contract
// and checked entry points: src/ops/cast.hpp, src/backend/cuda/cast_cuda.cpp). Internal to the
// backend: model code calls the checked entry points. Each launcher enqueues on `s` and checks the
// launch (throws dflash::Error via backend/cuda/check.hpp); float arrays are f32 or bf16 (raw
// uint16_t bits) as tagged by a DType. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

/// dst = src converted (f32 <-> bf16, or a same-type copy).
void cast(void* dst, DType dt, const void* src, DType st, int64_t n, cudaStream_t s);

}  // namespace dflash::cuda::launch
