// dflash.cpp — CPU loss weights from the rows' CE (see ops/loss_weights.hpp).
#include "ops/loss_weights.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "core/error.hpp"

namespace dflash {

void dpace_block_weights(std::span<double> w, std::span<const double> ce,
                         std::span<const uint8_t> supervised, const Objective& obj) {
  DFLASH_CHECK(w.size() == ce.size() && w.size() == supervised.size(),
               "dpace_block_weights: {} weights, {} CE values and {} mask entries", w.size(),
               ce.size(), supervised.size());
  DFLASH_CHECK(obj.dpace(), "dpace_block_weights: loss type dflash has no D-PACE weights");
  const double alpha = obj.dpace_alpha;
  DFLASH_CHECK(alpha >= 0 && alpha <= 1, "dpace_block_weights: alpha {} is outside [0, 1]", alpha);
  const size_t K = w.size();
  // Forward pass: w holds P_k; backward pass: R accumulates Σ_{j≥k} m_j·P_j.
  double prefix = 1.0;
  for (size_t k = 0; k < K; ++k) {
    if (supervised[k]) prefix *= (1.0 - alpha) * std::exp(-ce[k]) + alpha;
    w[k] = prefix;
  }
  if (obj.loss == LossType::dpace_cumulative_confidence_only) return;
  double suffix = 0.0;
  for (size_t k = K; k-- > 0;) {
    const double P = w[k];
    if (supervised[k]) suffix += P;
    w[k] = obj.loss == LossType::dpace ? suffix
                                       : suffix / std::max(P, std::numeric_limits<double>::min());
  }
}

void dpace_row_weights(std::span<double> w, std::span<const int32_t> rows,
                       std::span<const double> ce, std::span<const uint8_t> counted, int64_t K,
                       const Objective& obj) {
  dpace_weights_check("dpace_row_weights", 0, K, obj);
  DFLASH_CHECK(w.size() == rows.size() && ce.size() == rows.size(),
               "dpace_row_weights: {} weights and {} CE values for {} rows", w.size(), ce.size(),
               rows.size());
  const auto k_n = static_cast<size_t>(K);
  std::array<double, kDpaceMaxBlock> block_ce{}, block_w{};
  std::array<uint8_t, kDpaceMaxBlock> block_mask{};
  const std::span<double> bce(block_ce.data(), k_n), bw(block_w.data(), k_n);
  const std::span<uint8_t> bmask(block_mask.data(), k_n);
  const size_t R = rows.size();
  for (size_t j0 = 0; j0 < R;) {
    const int64_t block = rows[j0] / K;
    std::fill(bce.begin(), bce.end(), 0.0);
    std::fill(bmask.begin(), bmask.end(), uint8_t(0));
    size_t j1 = j0;
    for (; j1 < R && rows[j1] / K == block; ++j1) {
      const int32_t row = rows[j1];
      DFLASH_CHECK(
          row >= 0 && static_cast<size_t>(row) < counted.size() && (j1 == 0 || row > rows[j1 - 1]),
          "dpace_row_weights: row {} (entry {}) is out of [0, {}) or not ascending", row, j1,
          counted.size());
      const auto slot = static_cast<size_t>(row % K);
      bce[slot] = ce[j1];
      bmask[slot] = counted[static_cast<size_t>(row)];
    }
    dpace_block_weights(bw, bce, bmask, obj);
    for (size_t j = j0; j < j1; ++j) {
      const auto slot = static_cast<size_t>(rows[j] % K);
      w[j] = bmask[slot] ? bw[slot] : 0.0;
    }
    j0 = j1;
  }
}

void dpace_weights_check(const char* op, int64_t N, int64_t K, const Objective& obj) {
  DFLASH_CHECK(obj.dpace(), "{}: loss type dflash has no D-PACE weights", op);
  DFLASH_CHECK(obj.dpace_alpha >= 0 && obj.dpace_alpha <= 1, "{}: alpha {} is outside [0, 1]", op,
               obj.dpace_alpha);
  DFLASH_CHECK(N >= 0 && K >= 1 && K <= kDpaceMaxBlock,
               "{}: bad sizes N={} K={} (K must be in [1, {}])", op, N, K, kDpaceMaxBlock);
}

void dpace_weights_cpu(float* w, double* sums, const float* mask, int64_t N, int64_t K,
                       const Objective& obj) {
  dpace_weights_check("dpace_weights_cpu", N, K, obj);
  const auto k_n = static_cast<size_t>(K);
  std::vector<double> ce(k_n), wk(k_n);
  std::vector<uint8_t> m(k_n);
  double loss_sum = 0, weight_sum = 0;
  for (int64_t b = 0; b < N; ++b) {
    float* wb = w + b * K;
    for (size_t k = 0; k < k_n; ++k) {
      m[k] = mask[b * K + static_cast<int64_t>(k)] != 0.0f;
      ce[k] = m[k] ? static_cast<double>(wb[k]) : 0.0;
    }
    dpace_block_weights(wk, ce, m, obj);
    for (size_t k = 0; k < k_n; ++k) {
      const double x = m[k] ? wk[k] : 0.0;
      loss_sum += x * ce[k];
      weight_sum += x;
      wb[k] = static_cast<float>(x);
    }
  }
  sums[0] = loss_sum;
  sums[1] = weight_sum;
}

void rows_scale_cpu(float* x, const float* w, int64_t R, int64_t H) {
  DFLASH_CHECK(R >= 0 && H >= 0, "rows_scale_cpu: bad sizes R={} H={}", R, H);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t h = 0; h < H; ++h) x[r * H + h] *= w[r];
  }
}

}  // namespace dflash
