// dflash.cpp — raw-pointer launchers of the mixture-of-experts block (kernels:
// src/backend/cuda/moe.cu; contract and checked entry points: src/ops/moe.hpp,
// src/backend/cuda/moe_cuda.cpp). Internal to the backend: model code calls the checked entry
// points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

// (semantics: ops/moe.hpp)
void moe_route(int32_t* ids, float* weights, const float* logits, int64_t T, int64_t E, int64_t K,
               bool softmax_first, bool norm_topk, cudaStream_t s);
/// counts_ws: int32 [E] scratch.
void moe_dispatch(int32_t* perm, int32_t* slot, int32_t* offsets, int32_t* row_expert,
                  int32_t* counts_ws, const int32_t* ids, int64_t R, int64_t E, cudaStream_t s);
void moe_gather(uint16_t* xs, const uint16_t* x, const int32_t* perm, int64_t R, int64_t K,
                int64_t H, cudaStream_t s);
/// Upper bound of the row tiles of a grouped linear over R rows and E experts (its grid height).
int64_t moe_grouped_tiles(int64_t R, int64_t E);
/// y f32 or bf16 (yt), x bf16 [R, IN], w a device array of E device pointers [OUT, IN].
void moe_grouped_linear(void* y, DType yt, int64_t ldy, const uint16_t* x, const uint16_t* const* w,
                        const int32_t* offsets, int64_t E, int64_t R, int64_t IN, int64_t OUT,
                        cudaStream_t s);
/// gate/up f32 or bf16 (t), y bf16.
void moe_glu(uint16_t* y, const void* gate, const void* up, DType t, int64_t ld_in,
             const float* gate_bias, const float* up_bias, const int32_t* row_expert, int64_t R,
             int64_t I, bool clamped, float alpha, float limit, cudaStream_t s);
void moe_combine(float* y, const float* ys, const float* down_bias, const int32_t* ids,
                 const float* weights, const int32_t* slot, int64_t T, int64_t K, int64_t H,
                 cudaStream_t s);

}  // namespace dflash::cuda::launch
