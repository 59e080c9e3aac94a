// dflash.cpp — CPU embedding lookup (see ops/embedding.hpp).
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/embedding.hpp"

namespace dflash {

namespace {

void check_ids(const char* op, const int32_t* ids, int64_t T, int64_t V, int64_t H) {
  DFLASH_CHECK(T >= 0 && V > 0 && H > 0, "{}: bad sizes T={} V={} H={}", op, T, V, H);
  for (int64_t t = 0; t < T; ++t)
    DFLASH_CHECK(ids[t] >= 0 && ids[t] < V, "{}: token id {} at position {} is outside [0, {})",
                 op, ids[t], t, V);
}

template <typename Y, typename W>
void fwd_impl(Y* y, const W* table, const int32_t* ids, int64_t T, int64_t V, int64_t H) {
  check_ids("embedding_fwd", ids, T, V, H);
  for (int64_t t = 0; t < T; ++t) {
    const W* row = table + static_cast<int64_t>(ids[t]) * H;
    Y* out = y + t * H;
    for (int64_t h = 0; h < H; ++h) {
      if constexpr (sizeof(W) == 2) {
        out[h] = bf16_bits_to_f32(row[h]);
      } else {
        out[h] = row[h];
      }
    }
  }
}

template <typename S>
void bwd_impl(S* dtable, const S* dy, const int32_t* ids, int64_t T, int64_t V, int64_t H) {
  check_ids("embedding_bwd", ids, T, V, H);
  for (int64_t t = 0; t < T; ++t) {
    S* row = dtable + static_cast<int64_t>(ids[t]) * H;
    for (int64_t h = 0; h < H; ++h) row[h] += dy[t * H + h];
  }
}

}  // namespace

void embedding_fwd_cpu(float* y, const float* table, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H) {
  fwd_impl(y, table, ids, T, V, H);
}
void embedding_fwd_cpu(double* y, const double* table, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H) {
  fwd_impl(y, table, ids, T, V, H);
}
void embedding_fwd_cpu(float* y, const uint16_t* table_bf16, const int32_t* ids, int64_t T,
                       int64_t V, int64_t H) {
  fwd_impl(y, table_bf16, ids, T, V, H);
}
void embedding_bwd_cpu(float* dtable, const float* dy, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H) {
  bwd_impl(dtable, dy, ids, T, V, H);
}
void embedding_bwd_cpu(double* dtable, const double* dy, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H) {
  bwd_impl(dtable, dy, ids, T, V, H);
}

}  // namespace dflash
