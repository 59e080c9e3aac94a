// dflash.cpp — residual connection y = a + b (elementwise).
//
// Invariants: a, b, y contiguous with n elements; y may alias a or b. Backward passes the gradient
// to both branches: da = dy and db = dy (activation gradients, OVERWRITTEN; either may be null,
// and either may alias dy). `residual_accumulate_cpu` is the in-place form y += b used when a
// residual stream is updated in place (its backward is "dy flows on unchanged, and into b").
#pragma once

#include <cstdint>

namespace dflash {

/// y = a + b.
void residual_fwd_cpu(float* y, const float* a, const float* b, int64_t n);
void residual_fwd_cpu(double* y, const double* a, const double* b, int64_t n);
/// y += b.
void residual_accumulate_cpu(float* y, const float* b, int64_t n);
void residual_accumulate_cpu(double* y, const double* b, int64_t n);
/// da = dy, db = dy (each may be null or alias dy).
void residual_bwd_cpu(float* da, float* db, const float* dy, int64_t n);
void residual_bwd_cpu(double* da, double* db, const double* dy, int64_t n);


#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA y = a + b, T ∈ {float, uint16_t (bf16 bits)} (sum in fp32, rounded once).
template <typename T>
void residual_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* a, const T* b, int64_t n);
/// CUDA y += b; (Y, B) ∈ {(f32, f32), (f32, bf16), (bf16, bf16)} (e.g. an fp32 residual stream plus
/// a bf16 branch output).
template <typename Y, typename B>
void residual_accumulate_cuda(cuda::CudaContext& ctx, Y* y, const B* b, int64_t n);
/// CUDA da = dy, db = dy (device copies; either may be null or alias dy).
template <typename T>
void residual_bwd_cuda(cuda::CudaContext& ctx, T* da, T* db, const T* dy, int64_t n);
#endif

}  // namespace dflash
