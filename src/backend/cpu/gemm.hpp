// dflash.cpp — row-major GEMM on the CPU (OpenBLAS cblas_sgemm / cblas_dgemm), internal to the
// CPU backend.
//
// Invariants: all matrices are row-major; C = alpha·op(A)·op(B) + beta·C with op(A) [M,K],
// op(B) [K,N], C [M,N]; beta = 0 overwrites C (C may hold garbage, even NaN). Empty products
// (M, N or K = 0) are handled here (K = 0 scales C by beta, or zeroes it).
// Threads: OpenBLAS is set to one thread; a product is split along the rows (M ≥ N) or the
// columns of C into one contiguous range per worker of the parallel_for pool (core/parallel.hpp),
// each range one OpenBLAS call over the whole K; small products run on the calling thread. The
// split depends on the shape and the thread count only, so results are reproducible for a given
// thread count; OpenBLAS's rounding can depend on the sizes it is called with (its Haswell
// kernels' does), so another thread count may change the last bits, as OpenBLAS's own threading
// did.
#pragma once

#include <cstdint>

namespace dflash::cpu {

/// C[M,N] = alpha·op(A)·op(B) + beta·C (float). `ta`/`tb`: A/B are stored transposed
/// (A as [K,M], B as [N,K]). lda/ldb/ldc are row strides in elements.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
/// Same in double (used by the float64 finite-difference tests).
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
          int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc);

}  // namespace dflash::cpu
