// dflash.cpp — raw-pointer launchers of DFlash2's grouped dynamic causal conv (kernels:
// src/backend/cuda/dflash2_conv.cu; contract and checked entry points: src/ops/dflash2_conv.hpp,
// src/backend/cuda/dflash2_conv_cuda.cpp). Internal to the backend: model code calls the checked
// entry points. Each launcher enqueues on `s` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp); arrays tagged by a DType are f32 or bf16 (raw uint16_t bits). The sizes
// are those of Dflash2ConvShape (rows, H, block b, taps T, group g). No fmt in this header (nvcc
// includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

/// The sizes of one conv as the kernels take them.
struct Dflash2ConvDims {
  int64_t rows = 0, H = 0, block = 0, taps = 0, group = 0;
};

/// out = residual (or 0) + conv_side(x) (src/ops/dflash2_conv.hpp).
void dflash2_conv_fwd(void* out, DType ot, const float* residual, const void* x, DType xt,
                      const float* base_side, const float* delta, int side,
                      const Dflash2ConvDims& d, cudaStream_t s);
/// dx = (accumulate: +=) Σ_t (β + δ)·dout over the rows the taps reach.
void dflash2_conv_bwd_dx(void* dx, DType dt, bool accumulate, const float* dout,
                         const float* base_side, const float* delta, int side,
                         const Dflash2ConvDims& d, cudaStream_t s);
/// The `side` half of ddelta = Σ_{c ∈ group} dout·x[i−t] (one warp per row, tap and group).
void dflash2_conv_bwd_ddelta(void* ddelta, DType dt, const float* dout, const void* x, DType xt,
                             int side, const Dflash2ConvDims& d, cudaStream_t s);
/// dbase_side += Σ_i dout·x[i−t]: partials [chunks, T, H] in `part` (chunks of rows_per_chunk
/// rows, the last one shorter), then the chunks in order.
void dflash2_conv_bwd_dbase(float* dbase_side, const float* dout, const void* x, DType xt,
                            float* part, int64_t rows_per_chunk, const Dflash2ConvDims& d,
                            cudaStream_t s);

}  // namespace dflash::cuda::launch
