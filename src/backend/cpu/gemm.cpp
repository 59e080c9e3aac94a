// dflash.cpp — row-major GEMM through OpenBLAS (see gemm.hpp).
#include "backend/cpu/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace dflash::cpu {

namespace {

// Granularity of the split: a multiple of every OpenBLAS register tile.
constexpr int64_t kSplitUnit = 64;
// Multiply-adds below which a worker's share is not worth a thread hand-off (~10 µs of work).
constexpr int64_t kMinWorkerMacs = int64_t(1) << 19;

// OpenBLAS runs single-threaded: our pool splits each product (one set of threads for every op;
// OpenBLAS's own threads would spin in sched_yield between calls, competing with ours).
void blas_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

// C = alpha·op(A)·op(B) + beta·C split along the rows (M ≥ N) or the columns of C into one
// contiguous range of kSplitUnit-multiples per worker, each range one OpenBLAS call over the whole
// K (so each operand is packed once per worker, as OpenBLAS's own threads would).
template <typename S, typename Blas>
void gemm_split(int64_t M, int64_t N, int64_t K, bool ta, bool tb, const S* A, int64_t lda,
                const S* B, int64_t ldb, S* C, int64_t ldc, Blas&& blas) {
  blas_single_threaded();
  const bool by_rows = M >= N;
  const int64_t along = by_rows ? M : N, across = by_rows ? N : M;
  const int64_t units = (along + kSplitUnit - 1) / kSplitUnit;
  const int64_t unit_macs = kSplitUnit * across * K;
  const int64_t min_units = std::max<int64_t>(1, (kMinWorkerMacs + unit_macs - 1) / unit_macs);
  parallel_for(
      units,
      [&](int64_t u0, int64_t u1) {
        const int64_t i0 = u0 * kSplitUnit, n = std::min(along, u1 * kSplitUnit) - i0;
        if (by_rows) {  // rows i0.. of op(A) and C
          blas(n, N, ta ? A + i0 : A + i0 * lda, B, C + i0 * ldc);
        } else {  // columns i0.. of op(B) and C
          blas(M, n, A, tb ? B + i0 * ldb : B + i0, C + i0);
        }
      },
      min_units);
}

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
  gemm_split(M, N, K, ta, tb, A, lda, B, ldb, C, ldc,
             [&](int64_t m, int64_t n, const float* a, const float* b, float* c) {
               cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                           tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
                           static_cast<blasint>(n), static_cast<blasint>(K), alpha, a,
                           static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
                           static_cast<blasint>(ldc));
             });
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
          int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  check_dims(M, N, K);
  if (handle_empty(M, N, K, beta, C, ldc)) return;
  gemm_split(M, N, K, ta, tb, A, lda, B, ldb, C, ldc,
             [&](int64_t m, int64_t n, const double* a, const double* b, double* c) {
               cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                           tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
                           static_cast<blasint>(n), static_cast<blasint>(K), alpha, a,
                           static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
                           static_cast<blasint>(ldc));
             });
}

}  // namespace dflash::cpu
