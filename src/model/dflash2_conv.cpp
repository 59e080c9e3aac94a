#include "model/dflash2_conv.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "ops/linear.hpp"

namespace dflash {

template <typename S>
void dflash2_conv_fwd(S* out, const S* x, const S* base_side, const S* delta, int side,
                      const Dflash2ConvShape& s) {
  const int64_t H = s.H, T = s.taps, G = s.groups(), gs = s.group, W = s.delta_width();
  for (int64_t i = 0; i < s.rows; ++i) {
    const int64_t slot = i % s.block;
    S* o = out + i * H;
    std::fill(o, o + H, S(0));
    const S* d = delta + i * W + side * T * G;
    for (int64_t t = 0; t <= std::min(T - 1, slot); ++t) {
      const S* xs = x + (i - t) * H;
      const S* b = base_side + t * H;
      for (int64_t c = 0; c < H; ++c) o[c] += (b[c] + d[t * G + c / gs]) * xs[c];
    }
  }
}

template <typename S>
void dflash2_conv_bwd(S* dx, S* dbase_side, S* ddelta, const S* dout, const S* x,
                      const S* base_side, const S* delta, int side, const Dflash2ConvShape& s) {
  const int64_t H = s.H, T = s.taps, G = s.groups(), gs = s.group, W = s.delta_width();
  for (int64_t i = 0; i < s.rows; ++i) {
    const int64_t slot = i % s.block;
    const S* go = dout + i * H;
    const S* d = delta + i * W + side * T * G;
    for (int64_t t = 0; t <= std::min(T - 1, slot); ++t) {
      const S* xs = x + (i - t) * H;
      const S* b = base_side + t * H;
      for (int64_t g = 0; g < G; ++g) {
        S acc = 0;
        for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
          if (dx) dx[(i - t) * H + c] += (b[c] + d[t * G + g]) * go[c];
          if (dbase_side) dbase_side[t * H + c] += go[c] * xs[c];
          acc += go[c] * xs[c];
        }
        if (ddelta) ddelta[i * W + side * T * G + t * G + g] += acc;
      }
    }
  }
}

template <typename S>
void dflash2_conv_pre(S* hn, Dflash2ConvActs<S>& a, const S* base, const S* w_kp,
                      const Dflash2ConvShape& s) {
  a.u.assign(hn, hn + s.rows * s.H);
  a.delta.resize(static_cast<size_t>(s.rows * s.delta_width()));
  linear_fwd_cpu(a.delta.data(), a.u.data(), w_kp, nullptr, s.rows, s.H, s.delta_width());
  dflash2_conv_fwd(hn, a.u.data(), base, a.delta.data(), 0, s);
}

template <typename S>
void dflash2_conv_post(S* y, Dflash2ConvActs<S>& a, const S* base, const Dflash2ConvShape& s) {
  a.y.assign(y, y + s.rows * s.H);
  dflash2_conv_fwd(y, a.y.data(), base + s.taps * s.H, a.delta.data(), 1, s);
}

template <typename S>
void dflash2_conv_post_bwd(S* dy, S* dbase, std::vector<S>& ddelta, const S* dout,
                           const Dflash2ConvActs<S>& a, const S* base, const Dflash2ConvShape& s) {
  ddelta.assign(static_cast<size_t>(s.rows * s.delta_width()), S(0));
  std::fill(dy, dy + s.rows * s.H, S(0));
  dflash2_conv_bwd(dy, dbase + s.taps * s.H, ddelta.data(), dout, a.y.data(), base + s.taps * s.H,
                   a.delta.data(), 1, s);
}

template <typename S>
void dflash2_conv_pre_bwd(S* du, S* dbase, S* dw_kp, std::vector<S>& ddelta, std::vector<S>& dtmp,
                          const S* dutilde, const Dflash2ConvActs<S>& a, const S* base,
                          const S* w_kp, const Dflash2ConvShape& s) {
  const int64_t n = s.rows * s.H;
  dflash2_conv_bwd(static_cast<S*>(nullptr), dbase, ddelta.data(), dutilde, a.u.data(), base,
                   a.delta.data(), 0, s);
  // du = ∂δ·W_kp (the projection), then += the taps' direct path; dW_kp += ∂δᵀ·u.
  linear_bwd_cpu(du, dw_kp, static_cast<S*>(nullptr), ddelta.data(), a.u.data(), w_kp, s.rows, s.H,
                 s.delta_width());
  dtmp.assign(static_cast<size_t>(n), S(0));
  dflash2_conv_bwd(dtmp.data(), static_cast<S*>(nullptr), static_cast<S*>(nullptr), dutilde,
                   a.u.data(), base, a.delta.data(), 0, s);
  for (int64_t k = 0; k < n; ++k) du[k] += dtmp[k];
}

#define DFLASH2_CONV_INSTANTIATE(S)                                                               \
  template void dflash2_conv_fwd<S>(S*, const S*, const S*, const S*, int,                        \
                                    const Dflash2ConvShape&);                                     \
  template void dflash2_conv_bwd<S>(S*, S*, S*, const S*, const S*, const S*, const S*, int,      \
                                    const Dflash2ConvShape&);                                     \
  template void dflash2_conv_pre<S>(S*, Dflash2ConvActs<S>&, const S*, const S*,                  \
                                    const Dflash2ConvShape&);                                     \
  template void dflash2_conv_post<S>(S*, Dflash2ConvActs<S>&, const S*, const Dflash2ConvShape&); \
  template void dflash2_conv_post_bwd<S>(S*, S*, std::vector<S>&, const S*,                       \
                                         const Dflash2ConvActs<S>&, const S*,                     \
                                         const Dflash2ConvShape&);                                \
  template void dflash2_conv_pre_bwd<S>(S*, S*, S*, std::vector<S>&, std::vector<S>&, const S*,   \
                                        const Dflash2ConvActs<S>&, const S*, const S*,            \
                                        const Dflash2ConvShape&);
DFLASH2_CONV_INSTANTIATE(float)
DFLASH2_CONV_INSTANTIATE(double)

}  // namespace dflash
