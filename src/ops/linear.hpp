// dflash.cpp — linear layer y = x·Wᵀ (+ b), as in torch.nn.Linear.
//
// Invariants: row-major; x [T, IN], W [OUT, IN] (the HF/PyTorch weight layout), b [OUT], y [T, OUT].
// Accumulation is fp32 (fp64 in the double overloads, used by the finite-difference tests).
// Backward: the activation gradient dx is OVERWRITTEN; the parameter gradients dW and db
// ACCUMULATE (+=). Any of dx, dW, db may be null to skip it (e.g. frozen weights).
// bf16 weights (raw bf16 bits, uint16_t) are converted to fp32 one tile of rows at a time, so no
// fp32 copy of the whole matrix is made; their gradient, when asked for, is fp32.
// Forward with T ≤ 16 rows (float): a direct kernel that reads W once, as stored, and computes
// every row with the same summation order whatever T is (backend/cpu/few_rows.hpp): a token
// decoded alone and the same token inside a verified block get bit-identical outputs. Larger T
// (and double) go through the OpenBLAS GEMM.
// The CUDA entry points (bf16 x and W through cuBLASLt, fp32 accumulation) sit below the CPU ones.
#pragma once

#include <cstdint>

namespace dflash {

/// y[T,OUT] = x[T,IN]·W[OUT,IN]ᵀ + bias[OUT] (bias may be null). OpenBLAS GEMM, fp32 accumulate.
void linear_fwd_cpu(float* y, const float* x, const float* w, const float* bias, int64_t T,
                    int64_t IN, int64_t OUT);
/// Double-precision twin of the above (for float64 gradient checks).
void linear_fwd_cpu(double* y, const double* x, const double* w, const double* bias, int64_t T,
                    int64_t IN, int64_t OUT);
/// bf16 weights (raw bits, round-to-nearest-even bf16 as produced by PyTorch), fp32 in/out.
void linear_fwd_cpu(float* y, const float* x, const uint16_t* w_bf16, const float* bias,
                    int64_t T, int64_t IN, int64_t OUT);

/// Backward of linear_fwd_cpu: dx[T,IN] = dy·W (overwritten); dw[OUT,IN] += dyᵀ·x;
/// db[OUT] += Σ_t dy[t]. Each output pointer may be null (skipped).
void linear_bwd_cpu(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const float* w, int64_t T, int64_t IN, int64_t OUT);
void linear_bwd_cpu(double* dx, double* dw, double* db, const double* dy, const double* x,
                    const double* w, int64_t T, int64_t IN, int64_t OUT);
/// bf16-weight backward; dw (if not null) is an fp32 [OUT,IN] buffer that accumulates.
void linear_bwd_cpu(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const uint16_t* w_bf16, int64_t T, int64_t IN, int64_t OUT);


#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA y[T,OUT] = x[T,IN]·W[OUT,IN]ᵀ through cuBLASLt: x and W bf16 (raw bits), fp32
/// accumulation, Y ∈ {float, uint16_t (bf16 bits)}. No bias (the Qwen3 projections have none).
template <typename Y>
void linear_fwd_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                     int64_t T, int64_t IN, int64_t OUT);
/// CUDA y[T,OUT] += x[T,IN]·W[OUT,IN]ᵀ: the same GEMM with beta = 1, accumulating into y (the
/// fp32 residual stream of an o_proj or down_proj, in fp32 before any rounding of y).
template <typename Y>
void linear_fwd_acc_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                         int64_t T, int64_t IN, int64_t OUT);
/// CUDA y[T,OUT] = res[T,OUT] + x[T,IN]·W[OUT,IN]ᵀ: the residual add in the GEMM's epilogue
/// (cuBLASLt with C = res, D = y, beta = 1), so the branch output is added to the fp32 residual
/// stream before any rounding and no copy of res is made first. The same bits as a copy of res
/// into y followed by linear_fwd_acc_cuda (the same epilogue, alpha·acc + 1·C). res is read only
/// and must not overlap y (an error otherwise; use linear_fwd_acc_cuda in place). Y ∈ {float,
/// bf16}.
template <typename Y>
void linear_fwd_res_cuda(cuda::CudaContext& ctx, Y* y, const Y* res, const uint16_t* x,
                         const uint16_t* w_bf16, int64_t T, int64_t IN, int64_t OUT);
/// CUDA y[T,OUT] = x·Wᵀ + bias[OUT]: the GEMM above, then bias_add_cuda (`bias` null: none).
template <typename Y>
void linear_fwd_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                     const float* bias, int64_t T, int64_t IN, int64_t OUT);
/// CUDA y[t, o] += bias[o] for every row t < T of y [T, OUT] (f32 or bf16 bits; bias f32 [OUT] on
/// the device): one elementwise pass in fp32 (src/backend/cuda/linear.cu). Projection biases of
/// Qwen2 and gpt-oss, router biases, o_proj/down biases added to the fp32 residual stream.
template <typename Y>
void bias_add_cuda(cuda::CudaContext& ctx, Y* y, const float* bias, int64_t T, int64_t OUT);
/// CUDA backward: dx[T,IN] = dy·W (overwritten; DX ∈ {float, bf16 bits}; may be null);
/// dw[OUT,IN] f32 += dyᵀ·x (accumulated by the GEMM's beta = 1; may be null). dy, x, W bf16.
template <typename DX>
void linear_bwd_cuda(cuda::CudaContext& ctx, DX* dx, float* dw, const uint16_t* dy,
                     const uint16_t* x, const uint16_t* w_bf16, int64_t T, int64_t IN,
                     int64_t OUT);
/// CUDA dx[T,IN] += dy[T,OUT]·W[OUT,IN] (the input-gradient GEMM of linear_bwd_cuda with beta =
/// 1: a second linear reading the same input adds its gradient). DX ∈ {float, bf16 bits}.
template <typename DX>
void linear_bwd_dx_acc_cuda(cuda::CudaContext& ctx, DX* dx, const uint16_t* dy,
                            const uint16_t* w_bf16, int64_t T, int64_t IN, int64_t OUT);
#endif

}  // namespace dflash
