// dflash.cpp — CPU residual add (see ops/residual.hpp).
#include <algorithm>

#include "core/error.hpp"
#include "ops/residual.hpp"

namespace dflash {

namespace {

template <typename S>
void fwd_impl(S* y, const S* a, const S* b, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_fwd: bad size n={}", n);
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}
template <typename S>
void acc_impl(S* y, const S* b, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_accumulate: bad size n={}", n);
  for (int64_t i = 0; i < n; ++i) y[i] += b[i];
}
template <typename S>
void bwd_impl(S* da, S* db, const S* dy, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_bwd: bad size n={}", n);
  if (da && da != dy) std::copy(dy, dy + n, da);
  if (db && db != dy) std::copy(dy, dy + n, db);
}

}  // namespace

void residual_fwd_cpu(float* y, const float* a, const float* b, int64_t n) { fwd_impl(y, a, b, n); }
void residual_fwd_cpu(double* y, const double* a, const double* b, int64_t n) {
  fwd_impl(y, a, b, n);
}
void residual_accumulate_cpu(float* y, const float* b, int64_t n) { acc_impl(y, b, n); }
void residual_accumulate_cpu(double* y, const double* b, int64_t n) { acc_impl(y, b, n); }
void residual_bwd_cpu(float* da, float* db, const float* dy, int64_t n) { bwd_impl(da, db, dy, n); }
void residual_bwd_cpu(double* da, double* db, const double* dy, int64_t n) {
  bwd_impl(da, db, dy, n);
}

}  // namespace dflash
