// dflash.cpp — CPU linear layer (see ops/linear.hpp for shapes and the gradient contract).
#include <algorithm>
#include <type_traits>
#include <vector>

#include "backend/cpu/few_rows.hpp"
#include "backend/cpu/gemm.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/linear.hpp"

namespace dflash {

namespace {

void check_sizes(const char* op, int64_t T, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "{}: bad sizes T={} IN={} OUT={}", op, T, IN, OUT);
}

template <typename S>
void add_bias(S* y, const S* bias, int64_t T, int64_t OUT) {
  if (!bias) return;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < OUT; ++o) y[t * OUT + o] += bias[o];
}

template <typename S>
void bias_grad(S* db, const S* dy, int64_t T, int64_t OUT) {
  if (!db) return;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < OUT; ++o) db[o] += dy[t * OUT + o];
}

template <typename S>
void fwd_impl(S* y, const S* x, const S* w, const S* bias, int64_t T, int64_t IN, int64_t OUT) {
  check_sizes("linear_fwd", T, IN, OUT);
  if constexpr (std::is_same_v<S, float>) {
    if (T <= cpu::kFewRowsMax) {
      cpu::few_rows_linear(y, x, w, T, IN, OUT);
      add_bias(y, bias, T, OUT);
      return;
    }
  }
  cpu::gemm(false, true, T, OUT, IN, S(1), x, IN, w, IN, S(0), y, OUT);
  add_bias(y, bias, T, OUT);
}

template <typename S>
void bwd_impl(S* dx, S* dw, S* db, const S* dy, const S* x, const S* w, int64_t T, int64_t IN,
              int64_t OUT) {
  check_sizes("linear_bwd", T, IN, OUT);
  if (dx) cpu::gemm(false, false, T, IN, OUT, S(1), dy, OUT, w, IN, S(0), dx, IN);
  if (dw) cpu::gemm(true, false, OUT, IN, T, S(1), dy, OUT, x, IN, S(1), dw, IN);
  bias_grad(db, dy, T, OUT);
}

// Rows of W per converted bf16 tile: about 1 MiB of fp32.
int64_t bf16_tile_rows(int64_t IN) { return std::max<int64_t>(1, (int64_t(1) << 18) / IN); }

void convert_rows(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(src[i]);
}

// The calling thread's f32 tile of at least `n` values; kept between calls, so that its pages are
// touched once per thread, not once per product.
float* bf16_tile(int64_t n) {
  thread_local std::vector<float> tile;
  if (static_cast<int64_t>(tile.size()) < n) tile.resize(static_cast<size_t>(n));
  return tile.data();
}

}  // namespace

void linear_fwd_cpu(float* y, const float* x, const float* w, const float* bias, int64_t T,
                    int64_t IN, int64_t OUT) {
  fwd_impl(y, x, w, bias, T, IN, OUT);
}
void linear_fwd_cpu(double* y, const double* x, const double* w, const double* bias, int64_t T,
                    int64_t IN, int64_t OUT) {
  fwd_impl(y, x, w, bias, T, IN, OUT);
}

void linear_fwd_cpu(float* y, const float* x, const uint16_t* w_bf16, const float* bias,
                    int64_t T, int64_t IN, int64_t OUT) {
  check_sizes("linear_fwd(bf16 w)", T, IN, OUT);
  if (T == 0) return;
  if (T <= cpu::kFewRowsMax) {
    cpu::few_rows_linear(y, x, w_bf16, T, IN, OUT);
    add_bias(y, bias, T, OUT);
    return;
  }
  const int64_t rows = bf16_tile_rows(IN);
  float* tile = bf16_tile(std::min(rows, OUT) * IN);
  for (int64_t o0 = 0; o0 < OUT; o0 += rows) {
    const int64_t n = std::min(rows, OUT - o0);
    convert_rows(tile, w_bf16 + o0 * IN, n * IN);
    // y[:, o0:o0+n] = x · tileᵀ
    cpu::gemm(false, true, T, n, IN, 1.0f, x, IN, tile, IN, 0.0f, y + o0, OUT);
  }
  add_bias(y, bias, T, OUT);
}

void linear_bwd_cpu(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const float* w, int64_t T, int64_t IN, int64_t OUT) {
  bwd_impl(dx, dw, db, dy, x, w, T, IN, OUT);
}
void linear_bwd_cpu(double* dx, double* dw, double* db, const double* dy, const double* x,
                    const double* w, int64_t T, int64_t IN, int64_t OUT) {
  bwd_impl(dx, dw, db, dy, x, w, T, IN, OUT);
}

void linear_bwd_cpu(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const uint16_t* w_bf16, int64_t T, int64_t IN, int64_t OUT) {
  check_sizes("linear_bwd(bf16 w)", T, IN, OUT);
  if (dx) {
    if (T > 0) {
      const int64_t rows = bf16_tile_rows(IN);
      float* tile = bf16_tile(std::min(rows, OUT) * IN);
      for (int64_t o0 = 0; o0 < OUT; o0 += rows) {
        const int64_t n = std::min(rows, OUT - o0);
        convert_rows(tile, w_bf16 + o0 * IN, n * IN);
        // dx (+)= dy[:, o0:o0+n] · tile; tiles are summed in a fixed order.
        cpu::gemm(false, false, T, IN, n, 1.0f, dy + o0, OUT, tile, IN, o0 == 0 ? 0.0f : 1.0f, dx,
                  IN);
      }
    }
  }
  if (dw) cpu::gemm(true, false, OUT, IN, T, 1.0f, dy, OUT, x, IN, 1.0f, dw, IN);
  bias_grad(db, dy, T, OUT);
}

}  // namespace dflash
