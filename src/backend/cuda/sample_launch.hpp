// dflash.cpp — raw-pointer launchers of the sampling kernels (src/backend/cuda/sample.cu; the
// checked entry points and their contracts are in src/ops/sample.hpp). Internal to the backend.
// Each launcher enqueues on `s` and checks the launch; sizes are already checked by the caller.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/sample.hpp"

namespace dflash::cuda::launch {

void sample_probs(float* probs, const float* logits, int64_t R, int64_t V, int skip,
                  const SampleParamsDevice* params, int32_t* status, int rows_per_request,
                  cudaStream_t s);
void sample_drafts(int32_t* block, const float* q, const uint64_t* seeds, const int32_t* steps,
                   int B, int K, int64_t V, cudaStream_t s);
void spec_sample_accept(int32_t* out, int32_t* lens, int32_t* block, int32_t* steps, const float* p,
                        const float* q, const uint64_t* seeds, const int32_t* status,
                        const int32_t* active, int B, int K, int64_t V, int32_t mask,
                        cudaStream_t s);
void sample_first(int32_t* token, const float* p, uint64_t* seeds, int32_t* steps,
                  const int32_t* status, int b, uint64_t seed, int64_t V, cudaStream_t s);

}  // namespace dflash::cuda::launch
