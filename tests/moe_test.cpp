// Tests of the CPU mixture-of-experts ops (ops/moe.hpp) against formulas written out here: routing
// of both HF routers (hand-computed values, ties, norm_topk_prob), the stable expert-sorted
// dispatch, the grouped linear (bf16 and f32 weights, row stride, untouched columns), both gated
// activations with per-expert biases, the accumulating combine, a whole sparse block against a
// per-token loop over the chosen experts, and MXFP4 decoding of hand-made bytes.
#include "ops/moe.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "model/config.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using ::testing::HasSubstr;
using VecF = std::vector<float>;
using VecI = std::vector<int32_t>;

VecF randf(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  VecF v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// ------------------------------------------------------------------------------------ routing

TEST(MoeRoute, SoftmaxTopkMatchesHandComputedValues) {
  // One token, 4 experts, logits [0, ln 2, ln 4, ln 1]: softmax = [1, 2, 4, 1] / 8.
  const VecF logits = {0.0f, std::log(2.0f), std::log(4.0f), 0.0f};
  VecI ids(2);
  VecF w(2);
  moe_route_cpu(ids.data(), w.data(), logits.data(), 1, 4,
                MoeRouting{MoeRoutingMode::softmax_topk, 2, false});
  EXPECT_EQ(ids, (VecI{2, 1}));
  EXPECT_NEAR(w[0], 0.5, 1e-6);
  EXPECT_NEAR(w[1], 0.25, 1e-6);
  moe_route_cpu(ids.data(), w.data(), logits.data(), 1, 4,
                MoeRouting{MoeRoutingMode::softmax_topk, 2, true});
  EXPECT_NEAR(w[0], 2.0 / 3.0, 1e-6);  // renormalised: 4 / (4 + 2)
  EXPECT_NEAR(w[1], 1.0 / 3.0, 1e-6);
  // Top-3: experts 0 and 3 tie at 1/8; the lower index is taken.
  VecI ids3(3);
  VecF w3(3);
  moe_route_cpu(ids3.data(), w3.data(), logits.data(), 1, 4,
                MoeRouting{MoeRoutingMode::softmax_topk, 3, false});
  EXPECT_EQ(ids3, (VecI{2, 1, 0}));
  EXPECT_NEAR(w3[2], 0.125, 1e-6);
}

TEST(MoeRoute, TopkSoftmaxNormalisesOverTheChosenLogits) {
  // Two tokens, 3 experts: the top-2 logits go through a softmax of their own.
  const VecF logits = {1.0f, 3.0f, 2.0f, -1.0f, -5.0f, 0.5f};
  VecI ids(4);
  VecF w(4);
  moe_route_cpu(ids.data(), w.data(), logits.data(), 2, 3,
                MoeRouting{MoeRoutingMode::topk_softmax, 2, false});
  EXPECT_EQ(ids, (VecI{1, 2, 2, 0}));
  const double a = 1.0 / (1.0 + std::exp(-1.0));  // e^3 / (e^3 + e^2)
  const double b = 1.0 / (1.0 + std::exp(-1.5));  // e^0.5 / (e^0.5 + e^-1)
  EXPECT_NEAR(w[0], a, 1e-6);
  EXPECT_NEAR(w[1], 1 - a, 1e-6);
  EXPECT_NEAR(w[2], b, 1e-6);
  EXPECT_NEAR(w[3], 1 - b, 1e-6);
  EXPECT_THAT(error_of([&] {
                moe_route_cpu(ids.data(), w.data(), logits.data(), 2, 3,
                              MoeRouting{MoeRoutingMode::topk_softmax, 4, false});
              }),
              HasSubstr("top-k 4"));
}

// ----------------------------------------------------------------------------------- dispatch

TEST(MoeDispatch, StableExpertSortedLayout) {
  // T = 4 tokens, K = 2, E = 3.
  const VecI ids = {2, 0, 0, 1, 2, 1, 0, 2};
  VecI perm(8), slot(8), off(4), rexp(8);
  moe_dispatch_cpu(perm.data(), slot.data(), off.data(), rexp.data(), ids.data(), 4, 2, 3);
  EXPECT_EQ(off, (VecI{0, 3, 5, 8}));
  EXPECT_EQ(perm, (VecI{1, 2, 6, 3, 5, 0, 4, 7}));  // expert 0: (0,1) (1,0) (3,0); ...
  EXPECT_EQ(rexp, (VecI{0, 0, 0, 1, 1, 2, 2, 2}));
  for (int r = 0; r < 8; ++r) EXPECT_EQ(slot[static_cast<size_t>(perm[static_cast<size_t>(r)])], r);
  const VecI bad = {0, 3};
  EXPECT_THAT(error_of([&] {
                moe_dispatch_cpu(perm.data(), slot.data(), off.data(), rexp.data(), bad.data(), 1,
                                 2, 3);
              }),
              HasSubstr("token 0 slot 1 routes to expert 3"));
}

// ----------------------------------------------------------------------------- grouped linear

TEST(MoeGroupedLinear, EachRowUsesItsExpertBf16AndF32) {
  const int64_t E = 3, IN = 24, OUT = 7, R = 9, LDY = 10;
  std::mt19937 rng(3);
  const VecI off = {0, 4, 4, 9};  // expert 1 has no row
  const VecF x = randf(R * IN, rng);
  std::vector<VecF> wf(E);
  std::vector<std::vector<uint16_t>> wb(E);
  for (int64_t e = 0; e < E; ++e) {
    wf[e] = randf(OUT * IN, rng);
    for (float& v : wf[e]) v = round_to_bf16(v);
    for (float v : wf[e]) wb[e].push_back(f32_to_bf16_bits(v));
  }
  std::vector<const float*> pf;
  std::vector<const uint16_t*> pb;
  for (int64_t e = 0; e < E; ++e) {
    pf.push_back(wf[e].data());
    pb.push_back(wb[e].data());
  }
  for (int variant = 0; variant < 2; ++variant) {
    VecF y(R * LDY, 123.0f);
    if (variant == 0)
      moe_grouped_linear_cpu(y.data(), LDY, x.data(), pf.data(), off.data(), E, R, IN, OUT);
    else
      moe_grouped_linear_cpu(y.data(), LDY, x.data(), pb.data(), off.data(), E, R, IN, OUT);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t e = r < 4 ? 0 : 2;
      for (int64_t o = 0; o < OUT; ++o) {
        double want = 0;
        for (int64_t i = 0; i < IN; ++i) want += double(x[r * IN + i]) * wf[e][o * IN + i];
        EXPECT_NEAR(y[r * LDY + o], want, 1e-4) << "row " << r << " col " << o;
      }
      for (int64_t o = OUT; o < LDY; ++o) EXPECT_EQ(y[r * LDY + o], 123.0f);  // untouched
    }
  }
  const VecI bad = {0, 5, 4, 9};
  EXPECT_THAT(error_of([&] {
                VecF y(R * LDY);
                moe_grouped_linear_cpu(y.data(), LDY, x.data(), pf.data(), bad.data(), E, R, IN,
                                       OUT);
              }),
              HasSubstr("non-decreasing"));
}

// ---------------------------------------------------------------------------------------- glu

TEST(MoeGlu, SwigluAndClampedSwigluWithPerExpertBiases) {
  const int64_t R = 3, I = 4;
  // gate | up halves of one [R, 2I] buffer; rows 0, 2 on expert 1, row 1 on expert 0.
  const VecF gu = {-9.0f, -1.0f, 0.5f,  8.0f, 2.0f, -8.0f, 0.25f, 7.5f,  0.1f, 0.2f, 0.3f,  0.4f,
                   -0.5f, 0.6f,  -0.7f, 0.8f, 3.0f, 6.5f,  7.5f,  -2.0f, 1.0f, 1.0f, -1.0f, 9.0f};
  const VecF bg = {0, 0, 0, 0, 0.5f, -0.5f, 1.0f, 0}, bu = {0, 0, 0, 0, 0.25f, 0, 0, -1.0f};
  const VecI rexp = {1, 0, 1};
  for (MoeActivation act : {MoeActivation::swiglu, MoeActivation::clamped_swiglu}) {
    const MoeGlu glu{act, 1.702f, 7.0f};
    VecF y(R * I);
    moe_glu_cpu(y.data(), gu.data(), gu.data() + I, 2 * I, bg.data(), bu.data(), rexp.data(), R, I,
                glu);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const int64_t e = rexp[r];
        double g = gu[r * 2 * I + i] + bg[e * I + i], u = gu[r * 2 * I + I + i] + bu[e * I + i];
        double want;
        if (act == MoeActivation::swiglu) {
          want = g / (1 + std::exp(-g)) * u;
        } else {
          g = std::min(g, 7.0);
          u = std::max(-7.0, std::min(u, 7.0));
          want = (u + 1) * g / (1 + std::exp(-1.702 * g));
        }
        EXPECT_NEAR(y[r * I + i], want, 1e-5 * (1 + std::abs(want)))
            << moe_activation_name(act) << " row " << r << " col " << i;
      }
  }
}

// ------------------------------------------------------------------------------------ combine

TEST(MoeCombine, AccumulatesWeightedExpertRowsPlusBiases) {
  const int64_t T = 2, K = 2, H = 3;
  const VecI ids = {1, 0, 0, 1}, slot = {3, 0, 1, 2};
  const VecF w = {0.75f, 0.25f, 0.5f, 0.5f};
  const VecF ys = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const VecF bias = {0.5f, 0.5f, 0.5f, -1, -1, -1};
  VecF y = {100, 100, 100, 0, 0, 0};
  moe_combine_cpu(y.data(), ys.data(), bias.data(), ids.data(), w.data(), slot.data(), T, K, H);
  // token 0: 0.75·(ys[3] − 1) + 0.25·(ys[0] + 0.5); token 1: 0.5·(ys[1] + 0.5) + 0.5·(ys[2] − 1)
  EXPECT_FLOAT_EQ(y[0], 100 + 0.75f * 9 + 0.25f * 1.5f);
  EXPECT_FLOAT_EQ(y[2], 100 + 0.75f * 11 + 0.25f * 3.5f);
  EXPECT_FLOAT_EQ(y[3], 0.5f * 4.5f + 0.5f * 6);
  EXPECT_FLOAT_EQ(y[5], 0.5f * 6.5f + 0.5f * 8);
}

// A whole sparse block through the ops equals a per-token loop over the chosen experts.
TEST(MoeBlock, OpsPipelineEqualsPerTokenExpertLoop) {
  const int64_t T = 13, H = 16, E = 5, K = 2, I = 8;
  std::mt19937 rng(9);
  const VecF x = randf(T * H, rng), wr = randf(E * H, rng, 0.5f);
  std::vector<VecF> wg(E), wu(E), wd(E);
  for (int64_t e = 0; e < E; ++e) {
    wg[e] = randf(I * H, rng, 0.25f);
    wu[e] = randf(I * H, rng, 0.25f);
    wd[e] = randf(H * I, rng, 0.35f);
  }
  const VecF bg = randf(E * I, rng, 0.2f), bu = randf(E * I, rng, 0.2f),
             bd = randf(E * H, rng, 0.2f);
  for (MoeRoutingMode mode : {MoeRoutingMode::softmax_topk, MoeRoutingMode::topk_softmax}) {
    const MoeGlu glu{mode == MoeRoutingMode::softmax_topk ? MoeActivation::swiglu
                                                          : MoeActivation::clamped_swiglu,
                     1.702f, 7.0f};
    const bool biased = mode == MoeRoutingMode::topk_softmax;
    VecF logits(T * E);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) {
        float s = 0;
        for (int64_t h = 0; h < H; ++h) s += x[t * H + h] * wr[e * H + h];
        logits[t * E + e] = s;
      }
    VecI ids(T * K), perm(T * K), slot(T * K), rexp(T * K), off(E + 1);
    VecF w(T * K);
    moe_route_cpu(ids.data(), w.data(), logits.data(), T, E, MoeRouting{mode, K, true});
    moe_dispatch_cpu(perm.data(), slot.data(), off.data(), rexp.data(), ids.data(), T, K, E);
    VecF xs(T * K * H), gu(T * K * 2 * I), act(T * K * I), ys(T * K * H);
    moe_gather_cpu(xs.data(), x.data(), perm.data(), T * K, K, H);
    std::vector<const float*> pg, pu, pd;
    for (int64_t e = 0; e < E; ++e) {
      pg.push_back(wg[e].data());
      pu.push_back(wu[e].data());
      pd.push_back(wd[e].data());
    }
    moe_grouped_linear_cpu(gu.data(), 2 * I, xs.data(), pg.data(), off.data(), E, T * K, H, I);
    moe_grouped_linear_cpu(gu.data() + I, 2 * I, xs.data(), pu.data(), off.data(), E, T * K, H, I);
    moe_glu_cpu(act.data(), gu.data(), gu.data() + I, 2 * I, biased ? bg.data() : nullptr,
                biased ? bu.data() : nullptr, rexp.data(), T * K, I, glu);
    moe_grouped_linear_cpu(ys.data(), H, act.data(), pd.data(), off.data(), E, T * K, I, H);
    VecF y(T * H, 0.0f);
    moe_combine_cpu(y.data(), ys.data(), biased ? bd.data() : nullptr, ids.data(), w.data(),
                    slot.data(), T, K, H);

    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> want(H, 0.0);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = ids[t * K + k];
        std::vector<double> a(I);
        for (int64_t i = 0; i < I; ++i) {
          double g = biased ? bg[e * I + i] : 0, u = biased ? bu[e * I + i] : 0;
          for (int64_t h = 0; h < H; ++h) {
            g += double(x[t * H + h]) * wg[e][i * H + h];
            u += double(x[t * H + h]) * wu[e][i * H + h];
          }
          if (biased) {
            g = std::min(g, 7.0);
            u = std::max(-7.0, std::min(u, 7.0));
            a[i] = (u + 1) * g / (1 + std::exp(-1.702 * g));
          } else {
            a[i] = g / (1 + std::exp(-g)) * u;
          }
        }
        for (int64_t h = 0; h < H; ++h) {
          double d = biased ? bd[e * H + h] : 0;
          for (int64_t i = 0; i < I; ++i) d += a[i] * wd[e][h * I + i];
          want[h] += w[t * K + k] * d;
        }
      }
      for (int64_t h = 0; h < H; ++h)
        EXPECT_NEAR(y[t * H + h], want[h], 1e-4) << moe_routing_name(mode) << " token " << t;
    }
  }
}

// -------------------------------------------------------------------------------------- mxfp4

TEST(Mxfp4, DecodesHandMadeBlocks) {
  // Two rows of one group; the low nibble is the even element. Row 0, scale 127 (×1): bytes
  // 0x21 → (0.5, 1), 0x9f → (-6, -0.5), 0x08 → (-0, 0), 0x77 → (6, 6). Row 1, scale 129 (×4):
  // 0x53 → (1.5·4, 3·4), 0xc4 → (2·4, -2·4).
  std::vector<uint8_t> blocks(2 * 16, 0), scales = {127, 129};
  blocks[0] = 0x21;
  blocks[1] = 0x9f;
  blocks[2] = 0x08;
  blocks[3] = 0x77;
  blocks[16 + 0] = 0x53;
  blocks[16 + 1] = 0xc4;
  std::vector<uint16_t> out(2 * 32, 0xdead);
  mxfp4_dequantize_cpu(out.data(), blocks.data(), scales.data(), 2, 1);
  auto v = [&](int row, int col) {
    return bf16_bits_to_f32(out[static_cast<size_t>(row * 32 + col)]);
  };
  EXPECT_EQ(v(0, 0), 0.5f);
  EXPECT_EQ(v(0, 1), 1.0f);
  EXPECT_EQ(v(0, 2), -6.0f);
  EXPECT_EQ(v(0, 3), -0.5f);
  EXPECT_EQ(out[4], 0x8000);  // -0
  EXPECT_EQ(out[5], 0x0000);
  EXPECT_EQ(v(0, 6), 6.0f);
  EXPECT_EQ(v(0, 7), 6.0f);
  EXPECT_EQ(v(0, 31), 0.0f);
  EXPECT_EQ(v(1, 0), 6.0f);
  EXPECT_EQ(v(1, 1), 12.0f);
  EXPECT_EQ(v(1, 2), 8.0f);
  EXPECT_EQ(v(1, 3), -8.0f);
  // Extreme scales: 2^-127 (f32 subnormal, exact in bf16) and E8M0 NaN.
  std::vector<uint8_t> b2(16, 0x11), s2 = {0};
  mxfp4_dequantize_cpu(out.data(), b2.data(), s2.data(), 1, 1);
  EXPECT_EQ(v(0, 0), std::ldexp(0.5f, -127));
  s2[0] = 255;
  mxfp4_dequantize_cpu(out.data(), b2.data(), s2.data(), 1, 1);
  EXPECT_TRUE(std::isnan(v(0, 9)));
}

}  // namespace
}  // namespace dflash
