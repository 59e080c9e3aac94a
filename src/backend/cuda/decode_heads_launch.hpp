// dflash.cpp — raw-pointer launchers of the decode heads' kernels
// (src/backend/cuda/decode_heads.cu; the checked entry points and their contracts are in
// src/ops/decode_heads.hpp). Internal to the backend. Each launcher enqueues on `s` and checks the
// launch; sizes are checked by the caller. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dflash {
struct HeadSegment;
}

namespace dflash::cuda::launch {

void head_pack(float* x, int64_t B, int64_t W, const HeadSegment& s0, const HeadSegment& s1,
               const HeadSegment& s2, cudaStream_t s);
void head_linear(float* y, int64_t ldy, const float* base, int64_t ldb, const float* W,
                 const float* bias, const float* x, int64_t B, int64_t IN, int64_t OUT,
                 cudaStream_t s);
void dspark_decode_gated(float* z, const float* u, const float* e, int64_t lde, int64_t B,
                         int64_t r, cudaStream_t s);
void dspark_decode_rnn(float* z, float* state, const float* u, int64_t B, int64_t r,
                       cudaStream_t s);
void dspark_decode_input(int32_t* input, const int32_t* block, int64_t B, int64_t K, int32_t mask,
                         cudaStream_t s);
void domino_decode_gru(float* state, const float* xi, const float* hh, int64_t B, int64_t G,
                       cudaStream_t s);
void head_silu(float* a, int64_t n, cudaStream_t s);
void decode_slot_argmax(int32_t* block, int64_t ld_block, int64_t col, const float* rows,
                        int64_t ld, int64_t B, int64_t V, cudaStream_t s);
void decode_slot_draw(int32_t* block, int64_t ld_block, int64_t col, float* q, const float* probs,
                      const uint64_t* seeds, const int32_t* steps, int64_t B, int64_t V,
                      cudaStream_t s);

}  // namespace dflash::cuda::launch
