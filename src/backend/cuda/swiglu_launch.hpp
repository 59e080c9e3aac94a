// dflash.cpp — raw-pointer launchers of SwiGLU (kernels: src/backend/cuda/swiglu.cu; contract and
// checked entry points: src/ops/swiglu.hpp, src/backend/cuda/swiglu_cuda.cpp). Internal to the
// backend: model code calls the checked entry points. Each launcher enqueues on `s` and checks the
// launch (throws dflash::Error via backend/cuda/check.hpp); float arrays are f32 or bf16 (raw
// uint16_t bits) as tagged by a DType. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

void swiglu_fwd(void* y, const void* gate, const void* up, DType t, int64_t T, int64_t I,
                int64_t ld_in, cudaStream_t s);
void swiglu_bwd(void* dgate, void* dup, const void* dy, const void* gate, const void* up, DType t,
                int64_t T, int64_t I, int64_t ld_in, cudaStream_t s);

}  // namespace dflash::cuda::launch
