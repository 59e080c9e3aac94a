// dflash.cpp — few-rows linear kernel (see few_rows.hpp for the summation order it guarantees).
//
// Register blocking: 4 rows of x × 2 weight rows per pass (8 accumulators of 16 lanes), so each
// 16-element slice of a weight row is loaded once per 4 rows of x; leftover rows of x go one at a
// time, a leftover weight row alone. Every path feeds a lane the same products in the same order.
#include "backend/cpu/few_rows.hpp"

#include <algorithm>

#include "backend/cpu/simd.hpp"
#include "core/parallel.hpp"

namespace dflash::cpu {

namespace {

using simd::f32x16;
using simd::finish;
using simd::kLanes;
using simd::load16;

// Outputs per parallel block, and the least multiply-adds worth handing to another thread.
constexpr int64_t kOutBlock = 32;
constexpr int64_t kMinWorkerMacs = int64_t(1) << 16;

// y[r, c] = x[r]·w[c] for R rows of x (stride IN) and C weight rows (stride IN).
template <int R, int C, typename W>
DFLASH_INLINE void tile(float* y, int64_t ldy, const float* x, const W* w, int64_t IN) {
  const int64_t main = IN / kLanes * kLanes;
  f32x16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = f32x16{};
  for (int64_t i = 0; i < main; i += kLanes) {
    f32x16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load16(w + c * IN + i);
    for (int r = 0; r < R; ++r) {
      const f32x16 xv = load16(x + r * IN + i);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[r * ldy + c] = finish(acc[r][c], x + r * IN, w + c * IN, main, IN);
}

// Outputs [0, n_out) of y (row stride ldy) from weight rows w[0, n_out), all T rows of x.
template <typename W>
DFLASH_INLINE void block(float* y, int64_t ldy, const float* x, const W* w, int64_t T, int64_t IN,
                         int64_t n_out) {
  int64_t o = 0;
  for (; o + 2 <= n_out; o += 2) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) tile<4, 2>(y + t * ldy + o, ldy, x + t * IN, w + o * IN, IN);
    for (; t < T; ++t) tile<1, 2>(y + t * ldy + o, ldy, x + t * IN, w + o * IN, IN);
  }
  if (o < n_out) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) tile<4, 1>(y + t * ldy + o, ldy, x + t * IN, w + o * IN, IN);
    for (; t < T; ++t) tile<1, 1>(y + t * ldy + o, ldy, x + t * IN, w + o * IN, IN);
  }
}

DFLASH_CPU_CLONES void block_f32(float* y, int64_t ldy, const float* x, const float* w, int64_t T,
                                 int64_t IN, int64_t n_out) {
  block(y, ldy, x, w, T, IN, n_out);
}

DFLASH_CPU_CLONES void block_bf16(float* y, int64_t ldy, const float* x, const uint16_t* w,
                                  int64_t T, int64_t IN, int64_t n_out) {
  block(y, ldy, x, w, T, IN, n_out);
}

template <typename W, typename Block>
void run(float* y, const float* x, const W* w, int64_t T, int64_t IN, int64_t OUT, Block&& fn) {
  if (T == 0) return;
  const int64_t blocks = (OUT + kOutBlock - 1) / kOutBlock;
  const int64_t block_macs = kOutBlock * T * IN;
  const int64_t min_blocks = std::max<int64_t>(1, (kMinWorkerMacs + block_macs - 1) / block_macs);
  parallel_for(
      blocks,
      [&](int64_t b0, int64_t b1) {
        const int64_t o0 = b0 * kOutBlock, o1 = std::min(OUT, b1 * kOutBlock);
        fn(y + o0, OUT, x, w + o0 * IN, T, IN, o1 - o0);
      },
      min_blocks);
}

}  // namespace

void few_rows_linear(float* y, const float* x, const float* w, int64_t T, int64_t IN, int64_t OUT) {
  run(y, x, w, T, IN, OUT, block_f32);
}

void few_rows_linear(float* y, const float* x, const uint16_t* w_bf16, int64_t T, int64_t IN,
                     int64_t OUT) {
  run(y, x, w_bf16, T, IN, OUT, block_bf16);
}

}  // namespace dflash::cpu
