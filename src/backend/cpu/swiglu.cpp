// dflash.cpp — CPU SwiGLU (see ops/swiglu.hpp).
#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

template <typename S>
S sigmoid(S g) {
  return S(1) / (S(1) + std::exp(-g));
}

void check_sizes(const char* op, int64_t T, int64_t I, int64_t ld) {
  DFLASH_CHECK(T >= 0 && I > 0 && ld >= I, "{}: bad sizes T={} I={} ld_in={}", op, T, I, ld);
}

template <typename S>
void fwd_impl(S* y, const S* gate, const S* up, int64_t T, int64_t I, int64_t ld) {
  check_sizes("swiglu_fwd", T, I, ld);
  parallel_for(
      T,
      [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t i = 0; i < I; ++i) {
            const S g = gate[t * ld + i];
            y[t * I + i] = g * sigmoid(g) * up[t * ld + i];
          }
      },
      16);
}

template <typename S>
void bwd_impl(S* dgate, S* dup, const S* dy, const S* gate, const S* up, int64_t T, int64_t I,
              int64_t ld) {
  check_sizes("swiglu_bwd", T, I, ld);
  parallel_for(
      T,
      [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t i = 0; i < I; ++i) {
            const S g = gate[t * ld + i], u = up[t * ld + i], d = dy[t * I + i];
            const S sg = sigmoid(g);
            if (dgate) dgate[t * ld + i] = d * u * sg * (S(1) + g * (S(1) - sg));
            if (dup) dup[t * ld + i] = d * g * sg;
          }
      },
      16);
}

}  // namespace

void swiglu_fwd_cpu(float* y, const float* gate, const float* up, int64_t T, int64_t I,
                    int64_t ld_in) {
  fwd_impl(y, gate, up, T, I, ld_in);
}
void swiglu_fwd_cpu(double* y, const double* gate, const double* up, int64_t T, int64_t I,
                    int64_t ld_in) {
  fwd_impl(y, gate, up, T, I, ld_in);
}
void swiglu_bwd_cpu(float* dgate, float* dup, const float* dy, const float* gate, const float* up,
                    int64_t T, int64_t I, int64_t ld_in) {
  bwd_impl(dgate, dup, dy, gate, up, T, I, ld_in);
}
void swiglu_bwd_cpu(double* dgate, double* dup, const double* dy, const double* gate,
                    const double* up, int64_t T, int64_t I, int64_t ld_in) {
  bwd_impl(dgate, dup, dy, gate, up, T, I, ld_in);
}

}  // namespace dflash
