// dflash.cpp — the general matrix product on the device: bf16 operands, fp32 accumulation, f32 or
// bf16 output, the entry point model and inference code call (they never call the backend's
// cuBLASLt wrapper, backend/cuda/gemm.hpp, themselves: issue 13's layout rule).
//
// Invariants: every matrix is row-major with a leading dimension (elements between consecutive
// rows) ≥ its stored column count. D = alpha·op(A)·op(B) + beta·C: D is OVERWRITTEN when
// beta = 0 (C not read); beta = 1 with C = D (no c_in) ACCUMULATES, D += alpha·op(A)·op(B). The
// call is enqueued on the context's stream and uses its workspace; it allocates nothing once the
// shape's plan is cached. Deterministic: the same inputs give the same bits (a fixed algorithm
// per shape, from the measured plan table ops/gemm_plan_table.hpp or cuBLASLt's heuristic, and
// no atomic split-K reductions). No CPU entry point: the CPU backend multiplies through
// OpenBLAS inside its ops (ops/linear.hpp).
#pragma once

#include <cstdint>

#include "core/dtype.hpp"

namespace dflash {

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// D[M,N] = alpha·op(A)[M,K]·op(B)[K,N] + beta·C[M,N] through cuBLASLt (BLAS GEMM semantics).
/// Shapes, row-major: A is stored [M,K] with leading dimension lda, or [K,M] when trans_a
/// (op(A) = Aᵀ); B is stored [K,N] with ldb, or [N,K] when trans_b (op(B) = Bᵀ, the
/// torch.nn.Linear weight layout: y = x·Wᵀ is trans_b with B = W). Dtypes: A and B are bf16 (raw
/// bits); D (`d`) and C are `c_dtype`, DType::f32 or DType::bf16, both with leading dimension ldc;
/// alpha, beta and the accumulation are fp32 (a bf16 D is rounded once, from the fp32 result).
/// C is `c_in` when given (read only, the layout of D, must not overlap D: a residual added in the
/// epilogue, y = x + A·B, without a copy of x first), else D itself (in place); C is not read
/// when beta = 0. M, N or K may be 1; M = 0 or N = 0 does nothing. Errors (dflash::Error, the
/// message naming M, N, K, the leading dimensions, the transposes and the output dtype): K < 1 or
/// a negative size, another output dtype, a leading dimension below its row length, a null A, B
/// or D, C overlapping D, cuBLASLt finding no algorithm, or a matching plan table entry whose
/// algorithm cuBLASLt refuses or that needs more workspace than the context holds (naming the
/// entry).
void gemm_bf16_cuda(cuda::CudaContext& ctx, void* d, DType c_dtype, int64_t ldc, const uint16_t* a,
                    int64_t lda, bool trans_a, const uint16_t* b, int64_t ldb, bool trans_b,
                    int64_t M, int64_t N, int64_t K, float alpha = 1.0f, float beta = 0.0f,
                    const void* c_in = nullptr);
#endif

}  // namespace dflash
