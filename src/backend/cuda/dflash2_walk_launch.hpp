// dflash.cpp — raw-pointer launchers of DFlash2's selector walk in the decoder (kernels:
// src/backend/cuda/dflash2_walk.cu; contract and checked entry point: src/ops/dflash2_walk.hpp,
// src/backend/cuda/dflash2_walk_cuda.cpp). Internal to the backend. Each launcher enqueues on `s`
// and checks the launch (throws dflash::Error via backend/cuda/check.hpp); the sizes are already
// checked. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include "ops/dflash2_walk.hpp"

namespace dflash::cuda::launch {

/// The rows' parts that do not depend on the predecessor, one block per row b·K + k (k ≥ 1):
/// ū in place, C and ū of C into the scratch, P_h·h, and the zeros of the q row when sampled.
void dflash2_walk_rows(const Dflash2WalkArgs& a, cudaStream_t s);
/// The walk over slots 1..K−1, one block per request: the scores, the proposal, the q entries.
void dflash2_walk(const Dflash2WalkArgs& a, cudaStream_t s);

}  // namespace dflash::cuda::launch
