// dflash.cpp — raw launchers of the fused decoding kernels (src/backend/cuda/decode_fused.cu; the
// checked entry points and their contracts are in src/ops/decode_fused.hpp). Internal to the
// backend. Each enqueues on `s` and checks the launch; sizes are already checked by the caller.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/decode_fused_args.hpp"

namespace dflash::cuda::launch {

/// qkv_prepare_cuda's kernel (D = 64 or 128).
void qkv_prepare(const decode_fused::QkvPrepArgs& a, int D, cudaStream_t s);
/// decode_attention_cuda's two kernels, the splits then the combine (D = 64 or 128).
void decode_attention(const decode_fused::DecodeAttnArgs& a, int D, cudaStream_t s);

/// decode_linear_cuda's kernel over row blocks of 16·kGemmMaxTiles rows; y f32 (accumulate
/// allowed) or bf16 bits.
void decode_linear(const decode_fused::DecodeLinearArgs& a, bool f32_out, bool accumulate,
                   cudaStream_t s);

}  // namespace dflash::cuda::launch
