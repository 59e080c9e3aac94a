// dflash.cpp — RoPE frequencies (HF modeling_rope_utils.py formulas) and the CPU rotation.
// See ops/rope.hpp for the layout and gradient contract.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/rope.hpp"

namespace dflash {

namespace {

constexpr double kPi = std::numbers::pi;

// HF `get_mscale` of _compute_yarn_parameters.
double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// HF `find_correction_dim`: the dimension index at which a frequency makes `num_rotations` full
// turns over `max_pos` positions.
double yarn_correction_dim(double num_rotations, double dim, double base, double max_pos) {
  return dim * std::log(max_pos / (num_rotations * 2.0 * kPi)) / (2.0 * std::log(base));
}

}  // namespace

std::vector<double> rope_inv_freq(const RopeParams& p, int64_t D) {
  DFLASH_CHECK(D > 0 && D % 2 == 0, "rope: head dimension must be even and positive, got {}", D);
  DFLASH_CHECK(p.theta > 0 && std::isfinite(p.theta), "rope: rope_theta must be > 0, got {}",
               p.theta);
  const int64_t half = D / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  // _compute_default_rope_parameters: 1 / theta^(2i/D).
  for (int64_t i = 0; i < half; ++i)
    inv[static_cast<size_t>(i)] =
        1.0 / std::pow(p.theta, static_cast<double>(2 * i) / static_cast<double>(D));
  if (p.type == RopeType::standard) return inv;
  DFLASH_CHECK(p.factor > 0 && std::isfinite(p.factor), "rope: scaling factor must be > 0, got {}",
               p.factor);

  switch (p.type) {
    case RopeType::standard:
      break;
    case RopeType::linear:
      // _compute_linear_scaling_rope_parameters: inv_freq / factor.
      for (double& f : inv) f /= p.factor;
      break;
    case RopeType::llama3: {
      // _compute_llama3_parameters: wavelengths longer than old_ctx/low_freq_factor are divided by
      // factor, shorter than old_ctx/high_freq_factor kept, in between interpolated smoothly.
      DFLASH_CHECK(p.original_max_position_embeddings > 0,
                   "rope: llama3 scaling needs original_max_position_embeddings > 0");
      DFLASH_CHECK(p.high_freq_factor != p.low_freq_factor,
                   "rope: llama3 scaling needs high_freq_factor != low_freq_factor (both {})",
                   p.low_freq_factor);
      const double old_ctx = static_cast<double>(p.original_max_position_embeddings);
      const double low_freq_wavelen = old_ctx / p.low_freq_factor;
      const double high_freq_wavelen = old_ctx / p.high_freq_factor;
      for (double& f : inv) {
        const double wavelen = 2.0 * kPi / f;
        if (wavelen > low_freq_wavelen) {
          f = f / p.factor;
        } else if (wavelen >= high_freq_wavelen) {  // medium band: neither < high nor > low
          const double smooth =
              (old_ctx / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
          f = (1.0 - smooth) * f / p.factor + smooth * f;
        }
      }
      break;
    }
    case RopeType::yarn: {
      // _compute_yarn_parameters: blend of interpolated (inv/factor) and extrapolated (inv)
      // frequencies with a linear ramp over the dimension range [low, high] found from the
      // beta_fast/beta_slow rotation counts over the original context (YaRN paper, §3.2).
      DFLASH_CHECK(p.original_max_position_embeddings > 0,
                   "rope: yarn scaling needs original_max_position_embeddings > 0");
      const double beta_fast = p.beta_fast != 0 ? p.beta_fast : 32.0;
      const double beta_slow = p.beta_slow != 0 ? p.beta_slow : 1.0;
      const double dim = static_cast<double>(D);
      const double orig = static_cast<double>(p.original_max_position_embeddings);
      double low = yarn_correction_dim(beta_fast, dim, p.theta, orig);
      double high = yarn_correction_dim(beta_slow, dim, p.theta, orig);
      if (p.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1.0);
      if (low == high) high += 0.001;  // HF: prevent a zero-width ramp
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrap_factor = 1.0 - ramp;
        const double extrap = inv[static_cast<size_t>(i)];
        const double interp = extrap / p.factor;
        inv[static_cast<size_t>(i)] = interp * (1.0 - extrap_factor) + extrap * extrap_factor;
      }
      break;
    }
  }
  return inv;
}

double rope_attention_scaling(const RopeParams& p) {
  if (p.type != RopeType::yarn) return 1.0;
  if (p.attention_factor) return *p.attention_factor;
  if (p.mscale != 0 && p.mscale_all_dim != 0)
    return yarn_get_mscale(p.factor, p.mscale) / yarn_get_mscale(p.factor, p.mscale_all_dim);
  return yarn_get_mscale(p.factor, 1.0);
}

namespace {

// sign = +1: forward rotation; sign = -1: the transpose (backward).
template <typename S>
void rotate_impl(S* y, const S* x, const int32_t* pos, const S* inv_freq, S scaling, int64_t T,
                 int64_t NH, int64_t D, S sign, const char* op) {
  DFLASH_CHECK(T >= 0 && NH > 0 && D > 0 && D % 2 == 0, "{}: bad sizes T={} NH={} D={}", op, T,
               NH, D);
  const int64_t half = D / 2;
  parallel_for(
      T,
      [&](int64_t t0, int64_t t1) {
        std::vector<S> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
        for (int64_t t = t0; t < t1; ++t) {
          const S p = static_cast<S>(pos[t]);
          for (int64_t i = 0; i < half; ++i) {
            const S ang = p * inv_freq[i];
            c[static_cast<size_t>(i)] = std::cos(ang) * scaling;
            s[static_cast<size_t>(i)] = sign * (std::sin(ang) * scaling);
          }
          for (int64_t h = 0; h < NH; ++h) {
            const S* xr = x + (t * NH + h) * D;
            S* yr = y + (t * NH + h) * D;
            for (int64_t i = 0; i < half; ++i) {
              const S a = xr[i], b = xr[i + half];
              const S ci = c[static_cast<size_t>(i)], si = s[static_cast<size_t>(i)];
              yr[i] = a * ci - b * si;
              yr[i + half] = b * ci + a * si;
            }
          }
        }
      },
      8);
}

}  // namespace

void rope_fwd_cpu(float* y, const float* x, const int32_t* pos, const float* inv_freq,
                  float scaling, int64_t T, int64_t NH, int64_t D) {
  rotate_impl(y, x, pos, inv_freq, scaling, T, NH, D, 1.0f, "rope_fwd");
}
void rope_fwd_cpu(double* y, const double* x, const int32_t* pos, const double* inv_freq,
                  double scaling, int64_t T, int64_t NH, int64_t D) {
  rotate_impl(y, x, pos, inv_freq, scaling, T, NH, D, 1.0, "rope_fwd");
}
void rope_bwd_cpu(float* dx, const float* dy, const int32_t* pos, const float* inv_freq,
                  float scaling, int64_t T, int64_t NH, int64_t D) {
  rotate_impl(dx, dy, pos, inv_freq, scaling, T, NH, D, -1.0f, "rope_bwd");
}
void rope_bwd_cpu(double* dx, const double* dy, const int32_t* pos, const double* inv_freq,
                  double scaling, int64_t T, int64_t NH, int64_t D) {
  rotate_impl(dx, dy, pos, inv_freq, scaling, T, NH, D, -1.0, "rope_bwd");
}

}  // namespace dflash
