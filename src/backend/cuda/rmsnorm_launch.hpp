// dflash.cpp — raw-pointer launchers of RMSNorm (kernels: src/backend/cuda/rmsnorm.cu; contract and
// checked entry points: src/ops/rmsnorm.hpp, src/backend/cuda/rmsnorm_cuda.cpp). Internal to the
// backend: model code calls the checked entry points. Each launcher enqueues on `s` and checks the
// launch (throws dflash::Error via backend/cuda/check.hpp); float arrays are f32 or bf16 (raw
// uint16_t bits) as tagged by a DType. No fmt in this header (nvcc includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash::cuda::launch {

void rmsnorm_fwd(void* y, DType yt, float* rstd, const void* x, DType xt, const float* w, int64_t R,
                 int64_t D, float eps, cudaStream_t s);
/// rstd_ws [R] and part_ws [rmsnorm_dw_chunks(R)·D] are scratch (part_ws only when dw).
void rmsnorm_bwd(void* dx, const void* dy, DType gt, float* dw, const void* x, DType xt,
                 const float* w, int64_t R, int64_t D, float eps, float* rstd_ws, float* part_ws,
                 cudaStream_t s);
int64_t rmsnorm_dw_chunks(int64_t R);
/// The backward fused with the residual gradient (ops/rmsnorm.hpp, rmsnorm_bwd_res_cuda); scratch
/// as rmsnorm_bwd.
void rmsnorm_bwd_res(float* dres, uint16_t* dres_bf, bool accumulate, float* dw, const float* dy,
                     const float* x, const float* w, int64_t R, int64_t D, float eps,
                     float* rstd_ws, float* part_ws, cudaStream_t s);

}  // namespace dflash::cuda::launch
