// dflash.cpp — raw-pointer launchers of AdamW, the gradient norm and the non-finite check (kernels:
// src/backend/cuda/adamw.cu; contract and checked entry points: src/ops/adamw.hpp,
// src/backend/cuda/adamw_cuda.cpp). Internal to the backend: model code calls the checked entry
// points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"
#include "ops/adamw.hpp"

namespace dflash::cuda::launch {

void adamw(const AdamWSegment* segs, int n_segs, int64_t max_n, float b1, float b2, float eps,
           float decay, float step_size, float inv_sqrt_bc2, const float* grad_scale,
           const int32_t* skip, cudaStream_t s);
/// Blocks per segment of the first pass of grad_sumsq (partials: n_segs·kSumsqBlocks doubles).
constexpr int kSumsqBlocks = kGradSumsqCudaBlocks;
void grad_sumsq(double* out, double* partials, const AdamWSegment* segs, int n_segs,
                cudaStream_t s);
void grad_clip(float* grad_scale, int32_t* skip, double* norm, const double* sumsq, double max_norm,
               cudaStream_t s);
void nonfinite_check(int32_t* flag, const void* x, DType t, int64_t n, cudaStream_t s);

}  // namespace dflash::cuda::launch
