// dflash.cpp — raw-pointer launchers of the decoding kernels (src/backend/cuda/decode.cu; the
// checked entry points and their contracts are in src/ops/decode.hpp). Internal to the backend.
// Each launcher enqueues on `s` and checks the launch; sizes are already checked by the caller.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash::cuda::launch {

void decode_rows(int32_t* pos, int32_t* slots, AttnRange* causal, AttnRange* block,
                 const int32_t* lens, int B, int K, int first, int C, cudaStream_t s);
void kv_scatter(uint16_t* cache, const uint16_t* rows, const int32_t* slots, int64_t R, int64_t W,
                cudaStream_t s);
/// Row r of `logits` [R, V] → out[r], skipping rows with r % skip == 0 when skip > 0 (out is then
/// indexed like the rows).
void argmax_rows(int32_t* out, const float* logits, int64_t R, int64_t V, int skip, cudaStream_t s);
void greedy_accept(int32_t* out, int32_t* lens, int32_t* block, const int32_t* target,
                   const int32_t* active, int B, int K, int32_t mask, cudaStream_t s);
void decode_admit(int32_t* lens, int32_t* active, int32_t* block, const int32_t* first_token, int b,
                  int K, int len, int32_t mask, cudaStream_t s);

}  // namespace dflash::cuda::launch
