// dflash.cpp — CPU mixture-of-experts ops (see ops/moe.hpp for the layout and formulas).
//
// The grouped linear runs one OpenBLAS GEMM per expert over that expert's contiguous rows (bf16
// weights converted one tile of rows at a time, as linear_fwd_cpu does); everything else is plain
// loops, parallel over tokens or rows where each output row belongs to one worker.
#include "ops/moe.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/gemm.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"

namespace dflash {

namespace {

// Indices of the K largest of `score` [E], larger first, ties to the lower index.
void top_k(int32_t* out, const float* score, int64_t E, int64_t K) {
  std::vector<int32_t> idx(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) idx[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::copy_n(idx.begin(), K, out);
}

void check_offsets(const char* op, const int32_t* offsets, int64_t E, int64_t R) {
  DFLASH_CHECK(offsets[0] == 0 && offsets[E] == R,
               "{}: expert offsets must run from 0 to R={}, got {} .. {}", op, R, offsets[0],
               offsets[E]);
  for (int64_t e = 0; e < E; ++e)
    DFLASH_CHECK(offsets[e] <= offsets[e + 1],
                 "{}: expert offsets must be non-decreasing, offsets[{}]={} > offsets[{}]={}", op,
                 e, offsets[e], e + 1, offsets[e + 1]);
}

float silu(float g) {
  return g / (1.0f + std::exp(-g));
}

template <typename W>
void grouped_impl(float* y, int64_t ldy, const float* x, const W* const* w, const int32_t* offsets,
                  int64_t E, int64_t R, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(E > 0 && R >= 0 && IN > 0 && OUT > 0 && ldy >= OUT,
               "moe_grouped_linear: bad sizes E={} R={} IN={} OUT={} ldy={}", E, R, IN, OUT, ldy);
  check_offsets("moe_grouped_linear", offsets, E, R);
  std::vector<float> tile;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
    if (n == 0) continue;
    if constexpr (std::is_same_v<W, float>) {
      cpu::gemm(false, true, n, OUT, IN, 1.0f, x + r0 * IN, IN, w[e], IN, 0.0f, y + r0 * ldy, ldy);
    } else {
      // bf16 weights: convert about 1 MiB of rows at a time.
      const int64_t rows = std::max<int64_t>(1, (int64_t(1) << 18) / IN);
      tile.resize(static_cast<size_t>(std::min(rows, OUT) * IN));
      for (int64_t o0 = 0; o0 < OUT; o0 += rows) {
        const int64_t m = std::min(rows, OUT - o0);
        const uint16_t* src = w[e] + o0 * IN;
        for (int64_t i = 0; i < m * IN; ++i)
          tile[static_cast<size_t>(i)] = bf16_bits_to_f32(src[i]);
        cpu::gemm(false, true, n, m, IN, 1.0f, x + r0 * IN, IN, tile.data(), IN, 0.0f,
                  y + r0 * ldy + o0, ldy);
      }
    }
  }
}

}  // namespace

void moe_route_cpu(int32_t* ids, float* weights, const float* logits, int64_t T, int64_t E,
                   const MoeRouting& r) {
  DFLASH_CHECK(T >= 0 && E > 0 && r.K >= 1 && r.K <= E,
               "moe_route: top-k {} must be in [1, E={}] (T={})", r.K, E, T);
  const int64_t K = r.K;
  parallel_for(
      T,
      [&](int64_t t0, int64_t t1) {
        std::vector<float> p(static_cast<size_t>(E));
        for (int64_t t = t0; t < t1; ++t) {
          const float* l = logits + t * E;
          int32_t* id = ids + t * K;
          float* w = weights + t * K;
          if (r.mode == MoeRoutingMode::softmax_topk) {
            const float m = *std::max_element(l, l + E);
            float sum = 0;
            for (int64_t e = 0; e < E; ++e) sum += p[static_cast<size_t>(e)] = std::exp(l[e] - m);
            for (int64_t e = 0; e < E; ++e) p[static_cast<size_t>(e)] /= sum;
            top_k(id, p.data(), E, K);
            float s = 0;
            for (int64_t k = 0; k < K; ++k) s += w[k] = p[static_cast<size_t>(id[k])];
            if (r.norm_topk_prob)
              for (int64_t k = 0; k < K; ++k) w[k] /= s;
          } else {
            top_k(id, l, E, K);
            const float m = l[id[0]];  // the largest
            float sum = 0;
            for (int64_t k = 0; k < K; ++k) sum += w[k] = std::exp(l[id[k]] - m);
            for (int64_t k = 0; k < K; ++k) w[k] /= sum;
          }
        }
      },
      16);
}

void moe_dispatch_cpu(int32_t* perm, int32_t* slot, int32_t* offsets, int32_t* row_expert,
                      const int32_t* ids, int64_t T, int64_t K, int64_t E) {
  DFLASH_CHECK(T >= 0 && K >= 1 && E >= 1 && T * K <= std::numeric_limits<int32_t>::max(),
               "moe_dispatch: bad sizes T={} K={} E={}", T, K, E);
  const int64_t R = T * K;
  for (int64_t i = 0; i < R; ++i)
    DFLASH_CHECK(ids[i] >= 0 && ids[i] < E,
                 "moe_dispatch: token {} slot {} routes to expert {}, outside [0, {})", i / K,
                 i % K, ids[i], E);
  std::fill(offsets, offsets + E + 1, 0);
  for (int64_t i = 0; i < R; ++i) ++offsets[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int32_t> next(offsets, offsets + E);
  for (int64_t i = 0; i < R; ++i) {  // stable: pairs in increasing (t, k) order
    const int32_t e = ids[i], r = next[static_cast<size_t>(e)]++;
    perm[r] = static_cast<int32_t>(i);
    slot[i] = r;
    row_expert[r] = e;
  }
}

void moe_gather_cpu(float* xs, const float* x, const int32_t* perm, int64_t R, int64_t K,
                    int64_t H) {
  DFLASH_CHECK(R >= 0 && K >= 1 && H > 0, "moe_gather: bad sizes R={} K={} H={}", R, K, H);
  for (int64_t r = 0; r < R; ++r) std::copy_n(x + (perm[r] / K) * H, H, xs + r * H);
}

void moe_grouped_linear_cpu(float* y, int64_t ldy, const float* x, const uint16_t* const* w,
                            const int32_t* offsets, int64_t E, int64_t R, int64_t IN, int64_t OUT) {
  grouped_impl(y, ldy, x, w, offsets, E, R, IN, OUT);
}
void moe_grouped_linear_cpu(float* y, int64_t ldy, const float* x, const float* const* w,
                            const int32_t* offsets, int64_t E, int64_t R, int64_t IN, int64_t OUT) {
  grouped_impl(y, ldy, x, w, offsets, E, R, IN, OUT);
}

void moe_glu_cpu(float* y, const float* gate, const float* up, int64_t ld_in,
                 const float* gate_bias, const float* up_bias, const int32_t* row_expert, int64_t R,
                 int64_t I, const MoeGlu& glu) {
  DFLASH_CHECK(R >= 0 && I > 0 && ld_in >= I, "moe_glu: bad sizes R={} I={} ld_in={}", R, I, ld_in);
  const bool clamped = glu.act == MoeActivation::clamped_swiglu;
  parallel_for(
      R,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = row_expert[r];
          const float* bg = gate_bias ? gate_bias + e * I : nullptr;
          const float* bu = up_bias ? up_bias + e * I : nullptr;
          for (int64_t i = 0; i < I; ++i) {
            float g = gate[r * ld_in + i] + (bg ? bg[i] : 0.0f);
            float u = up[r * ld_in + i] + (bu ? bu[i] : 0.0f);
            if (clamped) {
              g = std::min(g, glu.limit);
              u = std::clamp(u, -glu.limit, glu.limit);
              y[r * I + i] = (u + 1.0f) * (g / (1.0f + std::exp(-glu.alpha * g)));
            } else {
              y[r * I + i] = silu(g) * u;
            }
          }
        }
      },
      16);
}

void moe_combine_cpu(float* y, const float* ys, const float* down_bias, const int32_t* ids,
                     const float* weights, const int32_t* slot, int64_t T, int64_t K, int64_t H) {
  DFLASH_CHECK(T >= 0 && K >= 1 && H > 0, "moe_combine: bad sizes T={} K={} H={}", T, K, H);
  parallel_for(
      T,
      [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          float* yt = y + t * H;
          for (int64_t k = 0; k < K; ++k) {
            const float w = weights[t * K + k];
            const float* src = ys + static_cast<int64_t>(slot[t * K + k]) * H;
            const float* b =
                down_bias ? down_bias + static_cast<int64_t>(ids[t * K + k]) * H : nullptr;
            for (int64_t h = 0; h < H; ++h) yt[h] += w * (src[h] + (b ? b[h] : 0.0f));
          }
        }
      },
      4);
}

void mxfp4_dequantize_cpu(uint16_t* out, const uint8_t* blocks, const uint8_t* scales, int64_t rows,
                          int64_t G) {
  DFLASH_CHECK(rows >= 0 && G > 0, "mxfp4_dequantize: bad sizes rows={} G={}", rows, G);
  static constexpr float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  parallel_for(
      rows * G,
      [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int exp = static_cast<int>(scales[b]) - 127;
          const uint8_t* blk = blocks + b * 16;
          uint16_t* o = out + b * 32;
          if (scales[b] == 0xff) {  // E8M0 NaN
            std::fill(o, o + 32, uint16_t{0x7fc0});
            continue;
          }
          for (int j = 0; j < 16; ++j) {
            for (int half = 0; half < 2; ++half) {
              const int n = half ? blk[j] >> 4 : blk[j] & 0x0f;
              const float v = std::ldexp(kE2M1[n & 7], exp);
              o[2 * j + half] = f32_to_bf16_bits(n & 8 ? -v : v);
            }
          }
        }
      },
      256);
}

}  // namespace dflash
