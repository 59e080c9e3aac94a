// dflash.cpp — CPU RMSNorm (see ops/rmsnorm.hpp for the formula and the gradient contract).
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/rmsnorm.hpp"

namespace dflash {

namespace {

template <typename S>
S row_rstd(const S* x, int64_t D, double eps) {
  S ss = 0;
  for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
  return S(1) / std::sqrt(ss / static_cast<S>(D) + static_cast<S>(eps));
}

void check_sizes(const char* op, int64_t R, int64_t D, double eps) {
  DFLASH_CHECK(R >= 0 && D > 0 && eps >= 0, "{}: bad sizes R={} D={} eps={}", op, R, D, eps);
}

template <typename S>
void fwd_impl(S* y, S* rstd, const S* x, const S* w, int64_t R, int64_t D, double eps) {
  check_sizes("rmsnorm_fwd", R, D, eps);
  parallel_for(
      R,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const S* xr = x + r * D;
          S* yr = y + r * D;
          const S rs = row_rstd(xr, D, eps);
          for (int64_t j = 0; j < D; ++j) yr[j] = w[j] * (xr[j] * rs);
          if (rstd) rstd[r] = rs;
        }
      },
      64);
}

template <typename S>
void bwd_impl(S* dx, S* dw, const S* dy, const S* x, const S* w, int64_t R, int64_t D,
              double eps) {
  check_sizes("rmsnorm_bwd", R, D, eps);
  std::vector<S> rs(static_cast<size_t>(R));
  parallel_for(
      R,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const S* xr = x + r * D;
          const S* dyr = dy + r * D;
          const S rr = row_rstd(xr, D, eps);
          rs[static_cast<size_t>(r)] = rr;
          if (!dx) continue;
          S dot = 0;  // Σ_j (w_j dy_j) x_j
          for (int64_t j = 0; j < D; ++j) dot += w[j] * dyr[j] * xr[j];
          const S c = rr * rr * rr * dot / static_cast<S>(D);
          S* dxr = dx + r * D;
          for (int64_t j = 0; j < D; ++j) dxr[j] = rr * w[j] * dyr[j] - c * xr[j];
        }
      },
      64);
  if (!dw) return;
  // Each worker owns a range of columns and sums rows in order.
  parallel_for(
      D,
      [&](int64_t j0, int64_t j1) {
        for (int64_t r = 0; r < R; ++r) {
          const S rr = rs[static_cast<size_t>(r)];
          for (int64_t j = j0; j < j1; ++j) dw[j] += dy[r * D + j] * (x[r * D + j] * rr);
        }
      },
      64);
}

}  // namespace

void rmsnorm_fwd_cpu(float* y, float* rstd, const float* x, const float* w, int64_t R, int64_t D,
                     double eps) {
  fwd_impl(y, rstd, x, w, R, D, eps);
}
void rmsnorm_fwd_cpu(double* y, double* rstd, const double* x, const double* w, int64_t R,
                     int64_t D, double eps) {
  fwd_impl(y, rstd, x, w, R, D, eps);
}
void rmsnorm_bwd_cpu(float* dx, float* dw, const float* dy, const float* x, const float* w,
                     int64_t R, int64_t D, double eps) {
  bwd_impl(dx, dw, dy, x, w, R, D, eps);
}
void rmsnorm_bwd_cpu(double* dx, double* dw, const double* dy, const double* x, const double* w,
                     int64_t R, int64_t D, double eps) {
  bwd_impl(dx, dw, dy, x, w, R, D, eps);
}

}  // namespace dflash
