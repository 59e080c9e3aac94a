// dflash.cpp — CPU reference of the AdamW and gradient-norm ops (contract: src/ops/adamw.hpp).
// Plain fp32 expressions in the contract's order (the build does not contract them into FMAs), so
// the CUDA kernel (backend/cuda/adamw.cu) reproduces them bit for bit with round-to-nearest
// intrinsics; the sum of squares runs in index order in double.
#include "ops/adamw.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace dflash {

void adamw_step_cpu(float* p, float* m, float* v, const float* g, int64_t n, const AdamWConfig& c,
                    double lr, int64_t step, double grad_scale) {
  DFLASH_CHECK(step >= 1, "AdamW step must be >= 1 (got {})", step);
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  const float decay = static_cast<float>(1.0 - lr * c.weight_decay);
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = static_cast<float>(c.eps);
  const float gs = static_cast<float>(grad_scale);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * gs;
    p[i] *= decay;
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    const float denom = std::sqrt(v[i]) * inv_sqrt_bc2 + eps;
    p[i] -= step_size * m[i] / denom;
  }
}

double sum_squares_cpu(const float* g, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  return s;
}

double clip_scale(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace dflash
