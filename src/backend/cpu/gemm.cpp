// dflash.cpp — row-major GEMM through OpenBLAS (see gemm.hpp).
#include "backend/cpu/gemm.hpp"

#include <cblas.h>

#include "core/error.hpp"

namespace dflash::cpu {

namespace {
template <typename S>
bool handle_empty(int64_t M, int64_t N, int64_t K, S beta, S* C, int64_t ldc) {
  if (M == 0 || N == 0) return true;
  if (K != 0) return false;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == S(0) ? S(0) : beta * C[i * ldc + j];
  return true;
}
void check_dims(int64_t M, int64_t N, int64_t K) {
  DFLASH_CHECK(M >= 0 && N >= 0 && K >= 0 && M < (int64_t(1) << 31) && N < (int64_t(1) << 31) &&
                   K < (int64_t(1) << 31),
               "gemm: bad sizes M={} N={} K={}", M, N, K);
}
}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  check_dims(M, N, K);
  if (handle_empty(M, N, K, beta, C, ldc)) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
          int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  check_dims(M, N, K);
  if (handle_empty(M, N, K, beta, C, ldc)) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

}  // namespace dflash::cpu
