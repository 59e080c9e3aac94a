// dflash.cpp — raw-pointer launchers of the in-process device all-reduce (kernels:
// src/backend/cuda/collective.cu; contract and checked entry points:
// src/train/collective_cuda.cpp). Internal to the backend: model code calls the checked entry
// points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType.
// No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda {

/// Ranks of one in-process device all-reduce at most (train/collective_cuda.cpp).
inline constexpr int kMaxLocalRanks = 16;
/// The device arrays of the ranks of one in-process all-reduce, passed by value to the kernel.
struct RankBuffers {
  float* p[kMaxLocalRanks] = {};
  int n = 0;
};

}  // namespace dflash::cuda

namespace dflash::cuda::launch {

/// For i in [begin, end): s = p[0][i] + p[1][i] + … in rank order (f32, no contraction), then
/// p[r][i] = s for every rank. Every array must be readable and writable from `s`'s device.
void sum_ranks(const RankBuffers& bufs, int64_t begin, int64_t end, cudaStream_t s);

}  // namespace dflash::cuda::launch
