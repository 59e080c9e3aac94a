// dflash.cpp — GEMM through cuBLASLt: bf16 inputs, fp32 accumulation, bf16 or fp32 output,
// row-major operands with optional transposes.
//
// Invariants: every matrix is row-major with a leading dimension (elements between rows) ≥ its
// column count; the call runs in the context's stream and uses its workspace. Plans (descriptors,
// layouts and the heuristic's algorithm) are cached per context, keyed by sizes, transposes,
// leading dimensions, output dtype, beta ≠ 0 and the pointers' alignment, so a step loop asks the
// heuristic once per shape and allocates nothing. Deterministic: the plan's algorithm is fixed and
// split-K reductions are restricted to the workspace schemes (no atomics), so the same inputs give
// the same bits.
#pragma once

#include <cublasLt.h>

#include <cstdint>

#include "backend/cuda/context.hpp"
#include "core/dtype.hpp"

namespace dflash::cuda {

/// One cached cuBLASLt plan (owned by CudaContext::gemm_plans()).
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~GemmPlan();
};

/// D[M,N] = alpha·op(A)·op(B) + beta·C, all row-major: op(A) is [M,K] (A stored [M,K] with
/// leading dimension lda, or [K,M] when trans_a), op(B) is [K,N] (B stored [K,N], or [N,K] when
/// trans_b). A and B are bf16 (raw bits); D (`d`) and C are `c_dtype` (f32 or bf16) with the same
/// leading dimension ldc; accumulation and alpha/beta are fp32. C is `c_in` when given (read only,
/// same layout as D, must not overlap D: the residual stream y = x + A·B in the GEMM's epilogue
/// instead of a copy of x before an in-place update), else D itself (in place); C is not read when
/// beta = 0. M, N or K may be 1; M = 0 or N = 0 does nothing. Throws dflash::Error (naming the
/// sizes) on bad arguments or when cuBLASLt finds no algorithm.
void gemm_bf16(CudaContext& ctx, void* d, DType c_dtype, int64_t ldc, const uint16_t* a,
               int64_t lda, bool trans_a, const uint16_t* b, int64_t ldb, bool trans_b, int64_t M,
               int64_t N, int64_t K, float alpha = 1.0f, float beta = 0.0f,
               const void* c_in = nullptr);

}  // namespace dflash::cuda
