// Forward checks of the CPU reference ops against naive formulas written out here (double), the
// RoPE frequencies against numbers computed independently from HF modeling_rope_utils.py formulas
// (numpy, float64), error reporting, stray-write guards, visibility (masked keys never read) and
// determinism across thread counts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <complex>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/simd.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/attention.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/embedding.hpp"
#include "ops/linear.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::GuardedBuffer;
using Vec = std::vector<double>;
using VecF = std::vector<float>;

VecF randf(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  VecF v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
double max_abs_diff(const float* a, const Vec& b) {
  double m = 0;
  for (size_t i = 0; i < b.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}
bool same_bits(const VecF& a, const VecF& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
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

// ------------------------------------------------------------------------------------------ linear

TEST(LinearFwd, MatchesNaiveLoopsWithF32AndBf16Weights) {
  const int64_t T = 17, IN = 300, OUT = 1029;  // OUT spans several bf16 tiles (873 rows each)
  std::mt19937 rng(1);
  VecF x = randf(T * IN, rng), w = randf(OUT * IN, rng, 0.05f), b = randf(OUT, rng);
  std::vector<uint16_t> wb(w.size());
  VecF w_rounded(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    wb[i] = f32_to_bf16_bits(w[i]);
    w_rounded[i] = bf16_bits_to_f32(wb[i]);
  }
  Vec ref(T * OUT), ref_b(T * OUT);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < OUT; ++o) {
      double s = b[o], sb = b[o];
      for (int64_t i = 0; i < IN; ++i) {
        s += static_cast<double>(x[t * IN + i]) * w[o * IN + i];
        sb += static_cast<double>(x[t * IN + i]) * w_rounded[o * IN + i];
      }
      ref[t * OUT + o] = s;
      ref_b[t * OUT + o] = sb;
    }
  GuardedBuffer y(T * OUT), yb(T * OUT);
  linear_fwd_cpu(y.data(), x.data(), w.data(), b.data(), T, IN, OUT);
  linear_fwd_cpu(yb.data(), x.data(), wb.data(), b.data(), T, IN, OUT);
  EXPECT_LT(max_abs_diff(y.data(), ref), 1e-4);
  EXPECT_LT(max_abs_diff(yb.data(), ref_b), 1e-4);
  EXPECT_TRUE(y.intact());
  EXPECT_TRUE(yb.intact());

  // bf16-weight backward equals the f32 backward on the rounded weights.
  VecF dy = randf(T * OUT, rng), dx1(T * IN), dx2(T * IN), dw1(OUT * IN, 0.f), dw2(OUT * IN, 0.f);
  linear_bwd_cpu(dx1.data(), dw1.data(), nullptr, dy.data(), x.data(), wb.data(), T, IN, OUT);
  linear_bwd_cpu(dx2.data(), dw2.data(), nullptr, dy.data(), x.data(), w_rounded.data(), T, IN,
                 OUT);
  EXPECT_LT(test::rel_error(dx1, dx2), 1e-6);
  EXPECT_EQ(dw1, dw2);
}

// The few-rows kernel (T ≤ 16): against the naive sums for every T from 1 to 16, with a tail of
// IN % 16 = 12 lanes and an odd OUT (a lone weight row at the end of the last block).
TEST(LinearFwd, FewRowsMatchNaiveLoops) {
  const int64_t IN = 300, OUT = 1029;
  std::mt19937 rng(11);
  VecF x = randf(16 * IN, rng), w = randf(OUT * IN, rng, 0.05f), b = randf(OUT, rng);
  std::vector<uint16_t> wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) wb[i] = f32_to_bf16_bits(w[i]);
  for (int64_t T = 1; T <= 16; ++T) {
    Vec ref(T * OUT), ref_b(T * OUT);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < OUT; ++o) {
        double s = b[o], sb = b[o];
        for (int64_t i = 0; i < IN; ++i) {
          s += static_cast<double>(x[t * IN + i]) * w[o * IN + i];
          sb += static_cast<double>(x[t * IN + i]) * bf16_bits_to_f32(wb[o * IN + i]);
        }
        ref[t * OUT + o] = s;
        ref_b[t * OUT + o] = sb;
      }
    GuardedBuffer y(T * OUT), yb(T * OUT);
    linear_fwd_cpu(y.data(), x.data(), w.data(), b.data(), T, IN, OUT);
    linear_fwd_cpu(yb.data(), x.data(), wb.data(), b.data(), T, IN, OUT);
    EXPECT_LT(max_abs_diff(y.data(), ref), 1e-4) << "T=" << T;
    EXPECT_LT(max_abs_diff(yb.data(), ref_b), 1e-4) << "T=" << T;
    EXPECT_TRUE(y.intact()) << "T=" << T;
    EXPECT_TRUE(yb.intact()) << "T=" << T;
  }
}

// What lossless speculative decoding leans on: a row's output does not depend on the rows
// computed with it (a token decoded alone vs inside a 16-row verified block), nor on the thread
// count; bf16 weights give the bits of their f32 values.
TEST(LinearFwd, FewRowsAreBitIdenticalAloneInABlockAndOnAnyThreadCount) {
  const int64_t T = 16, IN = 300, OUT = 1029;
  std::mt19937 rng(12);
  VecF x = randf(T * IN, rng), w = randf(OUT * IN, rng, 0.05f);
  std::vector<uint16_t> wb(w.size());
  VecF w_rounded(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    wb[i] = f32_to_bf16_bits(w[i]);
    w_rounded[i] = bf16_bits_to_f32(wb[i]);
  }
  VecF block(T * OUT);
  linear_fwd_cpu(block.data(), x.data(), w.data(), nullptr, T, IN, OUT);
  for (int64_t t = 0; t < T; ++t) {
    VecF alone(OUT);
    linear_fwd_cpu(alone.data(), x.data() + t * IN, w.data(), nullptr, 1, IN, OUT);
    EXPECT_TRUE(same_bits(alone, VecF(block.begin() + t * OUT, block.begin() + (t + 1) * OUT)))
        << "row " << t;
  }
  for (int64_t rows : {3, 5, 13}) {  // other groupings of the same rows (4-row tiles + leftovers)
    VecF part(rows * OUT);
    linear_fwd_cpu(part.data(), x.data() + (T - rows) * IN, w.data(), nullptr, rows, IN, OUT);
    EXPECT_TRUE(same_bits(part, VecF(block.end() - rows * OUT, block.end()))) << rows << " rows";
  }
  for (int threads : {1, 2, 3}) {
    set_parallel_threads(threads);
    VecF y(T * OUT), yb(T * OUT), yr(T * OUT);
    linear_fwd_cpu(y.data(), x.data(), w.data(), nullptr, T, IN, OUT);
    linear_fwd_cpu(yb.data(), x.data(), wb.data(), nullptr, T, IN, OUT);
    linear_fwd_cpu(yr.data(), x.data(), w_rounded.data(), nullptr, T, IN, OUT);
    EXPECT_TRUE(same_bits(y, block)) << threads << " threads";
    EXPECT_TRUE(same_bits(yb, yr)) << threads << " threads";
  }
  set_parallel_threads(0);
}

// The OpenBLAS path splits each product over the thread pool (one range of rows or columns of C
// per worker): for every thread count it matches the naive sums, and a repeat gives the same bits.
TEST(LinearFwd, GemmPathMatchesNaiveLoopsAndRepeatsOnAnyThreadCount) {
  std::mt19937 rng(13);
  for (const auto& [T, IN, OUT] : std::vector<std::array<int64_t, 3>>{
           {17, 300, 1029}, {1000, 129, 300}, {129, 1000, 64}, {300, 384, 2000}}) {
    VecF x = randf(T * IN, rng), w = randf(OUT * IN, rng, 0.05f), dy = randf(T * OUT, rng);
    Vec ref(T * OUT), ref_dx(T * IN, 0.0), ref_dw(OUT * IN, 0.5);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < OUT; ++o) {
        double s = 0;
        for (int64_t i = 0; i < IN; ++i) {
          s += static_cast<double>(x[t * IN + i]) * w[o * IN + i];
          ref_dx[t * IN + i] += static_cast<double>(dy[t * OUT + o]) * w[o * IN + i];
          ref_dw[o * IN + i] += static_cast<double>(dy[t * OUT + o]) * x[t * IN + i];
        }
        ref[t * OUT + o] = s;
      }
    for (int threads : {1, 2, 3}) {
      set_parallel_threads(threads);
      std::vector<VecF> runs;
      for (int rep = 0; rep < 2; ++rep) {
        VecF y(T * OUT), dx(T * IN), dw(OUT * IN, 0.5f);
        linear_fwd_cpu(y.data(), x.data(), w.data(), nullptr, T, IN, OUT);
        linear_bwd_cpu(dx.data(), dw.data(), nullptr, dy.data(), x.data(), w.data(), T, IN, OUT);
        EXPECT_LT(max_abs_diff(y.data(), ref), 1e-4) << threads << " threads";
        EXPECT_LT(max_abs_diff(dx.data(), ref_dx), 1e-3) << threads << " threads";
        EXPECT_LT(max_abs_diff(dw.data(), ref_dw), 1e-3) << threads << " threads";
        y.insert(y.end(), dx.begin(), dx.end());
        y.insert(y.end(), dw.begin(), dw.end());
        runs.push_back(std::move(y));
      }
      EXPECT_TRUE(same_bits(runs[0], runs[1])) << T << "x" << IN << "x" << OUT;
    }
    set_parallel_threads(0);
  }
}

// --------------------------------------------------------------------------------------- embedding

TEST(EmbeddingFwd, GathersRowsAndNamesBadIds) {
  const int64_t V = 10, H = 3;
  VecF table(V * H);
  std::vector<uint16_t> tb(V * H);
  for (int64_t i = 0; i < V * H; ++i) {
    table[i] = static_cast<float>(i) + 0.5f;  // exact in bf16
    tb[i] = f32_to_bf16_bits(table[i]);
  }
  std::vector<int32_t> ids = {9, 0, 4, 4};
  GuardedBuffer y(ids.size() * H), yb(ids.size() * H);
  embedding_fwd_cpu(y.data(), table.data(), ids.data(), 4, V, H);
  embedding_fwd_cpu(yb.data(), tb.data(), ids.data(), 4, V, H);
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(y.data()[t * H + h], static_cast<float>(ids[t] * H + h) + 0.5f);
      EXPECT_EQ(yb.data()[t * H + h], y.data()[t * H + h]);
    }
  EXPECT_TRUE(y.intact() && yb.intact());

  ids[2] = 10;
  std::string msg = error_of([&] { embedding_fwd_cpu(y.data(), table.data(), ids.data(), 4, V, H); });
  EXPECT_NE(msg.find("token id 10 at position 2"), std::string::npos) << msg;
  ids[2] = -1;
  msg = error_of([&] {
    VecF d(V * H);
    embedding_bwd_cpu(d.data(), y.data(), ids.data(), 4, V, H);
  });
  EXPECT_NE(msg.find("token id -1 at position 2"), std::string::npos) << msg;
}

// ----------------------------------------------------------------------------------------- rmsnorm

TEST(RmsNormFwd, MatchesFormulaAndWorksInPlace) {
  const int64_t R = 17, D = 130;
  const double eps = 1e-6;
  std::mt19937 rng(2);
  VecF x = randf(R * D, rng, 3.0f), w = randf(D, rng);
  Vec ref(R * D), ref_rstd(R);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(x[r * D + j]) * x[r * D + j];
    ref_rstd[r] = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t j = 0; j < D; ++j) ref[r * D + j] = w[j] * x[r * D + j] * ref_rstd[r];
  }
  GuardedBuffer y(R * D), rstd(R);
  rmsnorm_fwd_cpu(y.data(), rstd.data(), x.data(), w.data(), R, D, eps);
  EXPECT_LT(max_abs_diff(y.data(), ref), 1e-5);
  EXPECT_LT(max_abs_diff(rstd.data(), ref_rstd), 1e-6);
  EXPECT_TRUE(y.intact() && rstd.intact());
  VecF inplace = x;
  rmsnorm_fwd_cpu(inplace.data(), nullptr, inplace.data(), w.data(), R, D, eps);
  EXPECT_EQ(0, std::memcmp(inplace.data(), y.data(), inplace.size() * sizeof(float)));
}

// -------------------------------------------------------------------------------------------- rope

// Expected values: HF modeling_rope_utils.py formulas evaluated with numpy in float64.
void expect_inv(const std::vector<double>& inv, int64_t i, double expected) {
  EXPECT_NEAR(inv[static_cast<size_t>(i)], expected, 1e-13 * expected) << "index " << i;
}

TEST(RopeFreq, MatchesHfFormulas) {
  RopeParams p;
  p.theta = 1e6;
  auto inv = rope_inv_freq(p, 128);
  ASSERT_EQ(inv.size(), 64u);
  expect_inv(inv, 0, 1.0);
  expect_inv(inv, 1, 0.8058421877614819);
  expect_inv(inv, 17, 0.025482967479793464);
  expect_inv(inv, 63, 1.2409377607517195e-06);
  EXPECT_EQ(rope_attention_scaling(p), 1.0);

  p = RopeParams{};
  p.type = RopeType::linear;
  p.theta = 1e4;
  p.factor = 4;
  inv = rope_inv_freq(p, 64);
  expect_inv(inv, 0, 0.25);
  expect_inv(inv, 5, 0.059284342641541386);
  expect_inv(inv, 31, 3.33380358040831e-05);
  EXPECT_EQ(rope_attention_scaling(p), 1.0);

  // Llama 3.1: theta 5e5, factor 8, low 1, high 4, original 8192. Index 20: high-frequency band
  // (kept), 30..34: medium band (smoothed), 40+: low band (divided by 8).
  p = RopeParams{};
  p.type = RopeType::llama3;
  p.theta = 500000;
  p.factor = 8;
  p.low_freq_factor = 1;
  p.high_freq_factor = 4;
  p.original_max_position_embeddings = 8192;
  inv = rope_inv_freq(p, 128);
  expect_inv(inv, 0, 1.0);
  expect_inv(inv, 20, 0.016560440080994446);
  expect_inv(inv, 30, 0.0013718935677611381);
  expect_inv(inv, 32, 0.0005248461609929547);
  expect_inv(inv, 34, 0.00017850781276799638);
  expect_inv(inv, 40, 3.428102195952591e-05);
  expect_inv(inv, 63, 3.068925988914511e-07);
  EXPECT_EQ(rope_attention_scaling(p), 1.0);

  // YaRN as Qwen3 long-context configs: theta 1e6, factor 4, original 32768 (ramp 23..40).
  p = RopeParams{};
  p.type = RopeType::yarn;
  p.theta = 1e6;
  p.factor = 4;
  p.original_max_position_embeddings = 32768;
  inv = rope_inv_freq(p, 128);
  expect_inv(inv, 0, 1.0);
  expect_inv(inv, 10, 0.11547819846894583);
  expect_inv(inv, 20, 0.01333521432163324);
  expect_inv(inv, 30, 0.0010643609812470017);
  expect_inv(inv, 40, 4.445698525097307e-05);
  expect_inv(inv, 50, 5.133812566142866e-06);
  expect_inv(inv, 63, 3.102344401879299e-07);
  EXPECT_NEAR(rope_attention_scaling(p), 1.138629436111989, 1e-15);
  p.attention_factor = 0.75;
  EXPECT_EQ(rope_attention_scaling(p), 0.75);
  p.attention_factor.reset();
  p.factor = 40;
  p.mscale = 1.0;
  p.mscale_all_dim = 0.5;
  EXPECT_NEAR(rope_attention_scaling(p), 1.1557219901962608, 1e-15);

  // YaRN without truncation: theta 1e4, factor 8, original 4096, D 64 (ramp 10.47..22.51).
  p = RopeParams{};
  p.type = RopeType::yarn;
  p.theta = 1e4;
  p.factor = 8;
  p.original_max_position_embeddings = 4096;
  p.truncate = false;
  inv = rope_inv_freq(p, 64);
  expect_inv(inv, 5, 0.23713737056616555);
  expect_inv(inv, 10, 0.056234132519034905);
  expect_inv(inv, 15, 0.008947669055942235);
  expect_inv(inv, 20, 0.000972857759153073);
  expect_inv(inv, 31, 1.666901790204155e-05);
}

TEST(RopeFreq, RejectsInvalidSettings) {
  RopeParams p;
  EXPECT_NE(error_of([&] { rope_inv_freq(p, 63); }).find("even"), std::string::npos);
  p.type = RopeType::yarn;
  p.factor = 4;
  EXPECT_NE(error_of([&] { rope_inv_freq(p, 64); }).find("original_max_position_embeddings"),
            std::string::npos);
  p.type = RopeType::llama3;
  p.original_max_position_embeddings = 8192;
  p.low_freq_factor = p.high_freq_factor = 2;
  EXPECT_NE(error_of([&] { rope_inv_freq(p, 64); }).find("high_freq_factor"), std::string::npos);
}

TEST(RopeFwd, RotatesHalvesLikeComplexMultiplication) {
  const int64_t T = 7, NH = 3, D = 64, half = D / 2;
  RopeParams p;
  p.type = RopeType::yarn;
  p.factor = 2;
  p.original_max_position_embeddings = 2048;
  const auto inv = rope_inv_freq(p, D);
  const double sc = rope_attention_scaling(p);
  std::vector<int32_t> pos = {0, 1, 2, 0, 1, 700, 4095};  // two packed documents
  std::mt19937 rng(3);
  Vec x(T * NH * D), y(T * NH * D);
  for (auto& v : x) v = std::normal_distribution<double>(0, 1)(rng);
  GuardedBuffer yf(T * NH * D);
  VecF xf(x.begin(), x.end()), invf(inv.begin(), inv.end());
  rope_fwd_cpu(y.data(), x.data(), pos.data(), inv.data(), sc, T, NH, D);
  rope_fwd_cpu(yf.data(), xf.data(), pos.data(), invf.data(), static_cast<float>(sc), T, NH, D);
  EXPECT_TRUE(yf.intact());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t base = (t * NH + h) * D;
        // (a + ib)·e^{iθ}·sc with a = x_i, b = x_{i+D/2}.
        const std::complex<double> z(x[base + i], x[base + i + half]);
        const std::complex<double> rz = z * std::polar(sc, pos[t] * inv[i]);
        EXPECT_NEAR(y[base + i], rz.real(), 1e-12);
        EXPECT_NEAR(y[base + i + half], rz.imag(), 1e-12);
        // fp32 (like HF): the angle pos·inv_freq carries a relative error of ~1 float ulp.
        const double tol32 = 1e-5 + 2.4e-7 * pos[t] * std::abs(z) * sc;
        EXPECT_NEAR(yf.data()[base + i], rz.real(), tol32);
        EXPECT_NEAR(yf.data()[base + i + half], rz.imag(), tol32);
      }
  // In place gives the same result.
  Vec inplace = x;
  rope_fwd_cpu(inplace.data(), inplace.data(), pos.data(), inv.data(), sc, T, NH, D);
  EXPECT_EQ(inplace, y);
}

// ------------------------------------------------------------------------------ swiglu, residual

TEST(SwigluFwd, MatchesFormula) {
  const int64_t T = 7, I = 11;
  std::mt19937 rng(4);
  VecF g = randf(T * I, rng, 3.f), u = randf(T * I, rng);
  GuardedBuffer y(T * I);
  swiglu_fwd_cpu(y.data(), g.data(), u.data(), T, I, I);
  Vec ref(T * I);
  for (int64_t i = 0; i < T * I; ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
  EXPECT_LT(max_abs_diff(y.data(), ref), 1e-6);
  EXPECT_TRUE(y.intact());
  // Float forward and backward 16 lanes at a time: whole slices and a tail (I = 37 = 16+16+5),
  // gate and up interleaved in rows of 2I (the drafter's layout), large |g| included.
  const int64_t I2 = 37, ld = 2 * I2;
  VecF gu = randf(T * ld, rng, 4.f), dy = randf(T * I2, rng);
  gu[3] = 95.f;
  gu[4] = -95.f;
  GuardedBuffer y2(T * I2), dgu(T * ld);
  swiglu_fwd_cpu(y2.data(), gu.data(), gu.data() + I2, T, I2, ld);
  swiglu_bwd_cpu(dgu.data(), dgu.data() + I2, dy.data(), gu.data(), gu.data() + I2, T, I2, ld);
  Vec ref_y(T * I2), ref_dg(T * ld);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I2; ++i) {
      const double gv = gu[t * ld + i], uv = gu[t * ld + I2 + i], d = dy[t * I2 + i];
      const double sg = 1.0 / (1.0 + std::exp(-gv));
      ref_y[t * I2 + i] = gv * sg * uv;
      ref_dg[t * ld + i] = d * uv * sg * (1.0 + gv * (1.0 - sg));
      ref_dg[t * ld + I2 + i] = d * gv * sg;
    }
  for (int64_t i = 0; i < T * I2; ++i)
    EXPECT_NEAR(y2.data()[i], ref_y[i], 1e-6 * (1.0 + std::abs(ref_y[i]))) << i;
  for (int64_t i = 0; i < T * ld; ++i)
    EXPECT_NEAR(dgu.data()[i], ref_dg[i], 1e-6 * (1.0 + std::abs(ref_dg[i]))) << i;
  EXPECT_TRUE(y2.intact());
  EXPECT_TRUE(dgu.intact());
  VecF a = {1, 2}, b = {0.5f, -4}, s(2);
  residual_fwd_cpu(s.data(), a.data(), b.data(), 2);
  EXPECT_EQ(s, (VecF{1.5f, -2}));
}

// --------------------------------------------------------------------------------------- attention

// Dense reference: full [Tq, Tk] score matrix with a boolean mask, softmax in double.
Vec dense_attention(const VecF& q, const VecF& k, const VecF& v,
                    const std::vector<AttnRange>& ranges, const AttnParams& p) {
  const int64_t rep = p.NH / p.NKV;
  Vec o(p.Tq * p.NH * p.D, 0.0);
  for (int64_t t = 0; t < p.Tq; ++t)
    for (int64_t h = 0; h < p.NH; ++h) {
      const int64_t g = h / rep;
      std::vector<double> s(p.Tk, -INFINITY);
      double m = -INFINITY;
      for (int64_t j = 0; j < p.Tk; ++j) {
        const auto& r = ranges[t];
        const bool vis = (j >= r.lo1 && j < r.hi1) || (j >= r.lo2 && j < r.hi2);
        if (!vis) continue;
        double d = 0;
        for (int64_t e = 0; e < p.D; ++e)
          d += double(q[(t * p.NH + h) * p.D + e]) * k[(j * p.NKV + g) * p.D + e];
        s[j] = d * p.scale;
        m = std::max(m, s[j]);
      }
      if (m == -INFINITY) continue;
      double sum = 0;
      for (int64_t j = 0; j < p.Tk; ++j) sum += std::exp(s[j] - m);
      for (int64_t j = 0; j < p.Tk; ++j) {
        const double pj = std::exp(s[j] - m) / sum;
        if (pj == 0) continue;
        for (int64_t e = 0; e < p.D; ++e)
          o[(t * p.NH + h) * p.D + e] += pj * v[(j * p.NKV + g) * p.D + e];
      }
    }
  return o;
}

TEST(AttentionFwd, CausalVarlenMatchesDenseMaskedSoftmax) {
  std::vector<int32_t> offsets = {0, 5, 6, 17};
  const int64_t T = 17;
  AttnParams p{T, T, 6, 2, 64, 1.0 / 8.0};
  const auto ranges = attention_causal_varlen_ranges(offsets.data(), 3, T);
  EXPECT_EQ(ranges[5].lo1, 5);
  EXPECT_EQ(ranges[5].hi1, 6);
  EXPECT_EQ(ranges[16].lo1, 6);
  EXPECT_EQ(ranges[16].hi1, 17);
  std::mt19937 rng(5);
  VecF q = randf(T * 6 * 64, rng), k = randf(T * 2 * 64, rng), v = randf(T * 2 * 64, rng);
  GuardedBuffer o(T * 6 * 64), lse(6 * T);
  attention_fwd_cpu(o.data(), lse.data(), q.data(), k.data(), v.data(), ranges.data(), p);
  EXPECT_LT(max_abs_diff(o.data(), dense_attention(q, k, v, ranges, p)), 1e-5);
  EXPECT_TRUE(o.intact() && lse.intact());
}

// Sinks: one extra logit per head in the softmax denominator (HF GptOssAttention, eager path:
// cat([scores, sink]) → softmax → drop the sink column).
TEST(AttentionFwd, SinksJoinTheSoftmaxWithoutValues) {
  const int64_t T = 9, NH = 4, NKV = 2, D = 64;
  std::vector<int32_t> offsets = {0, 4, 9};
  const auto ranges = attention_causal_varlen_ranges(offsets.data(), 2, T);
  std::mt19937 rng(17);
  const VecF q = randf(T * NH * D, rng), k = randf(T * NKV * D, rng), v = randf(T * NKV * D, rng);
  const VecF sinks = {-1.0f, 0.0f, 2.5f, 8.0f};
  AttnParams p{T, T, NH, NKV, D, 1.0 / 8.0};
  p.sinks = sinks.data();
  GuardedBuffer o(T * NH * D), lse(NH * T);
  attention_fwd_cpu(o.data(), lse.data(), q.data(), k.data(), v.data(), ranges.data(), p);
  EXPECT_TRUE(o.intact() && lse.intact());
  double worst = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / (NH / NKV);
      std::vector<double> s;
      for (int64_t j = ranges[t].lo1; j < ranges[t].hi1; ++j) {
        double d = 0;
        for (int64_t e = 0; e < D; ++e)
          d += double(q[(t * NH + h) * D + e]) * k[(j * NKV + g) * D + e];
        s.push_back(d / 8.0);
      }
      s.push_back(sinks[h]);  // the sink column
      double m = -INFINITY, sum = 0;
      for (double x : s) m = std::max(m, x);
      for (double x : s) sum += std::exp(x - m);
      EXPECT_NEAR(lse.data()[h * T + t], m + std::log(sum), 1e-5);
      for (int64_t e = 0; e < D; ++e) {
        double want = 0;
        for (int64_t j = ranges[t].lo1; j < ranges[t].hi1; ++j)
          want += std::exp(s[j - ranges[t].lo1] - m) / sum * v[(j * NKV + g) * D + e];
        worst = std::max(worst, std::abs(o.data()[(t * NH + h) * D + e] - want));
      }
    }
  EXPECT_LT(worst, 1e-5);
  // Head 3's sink (8) dominates: its outputs are far smaller than without sinks.
  p.sinks = nullptr;
  GuardedBuffer o2(T * NH * D);
  attention_fwd_cpu(o2.data(), nullptr, q.data(), k.data(), v.data(), ranges.data(), p);
  const int64_t at = (8 * NH + 3) * D;
  EXPECT_LT(std::abs(o.data()[at]), 0.1 * std::abs(o2.data()[at]) + 1e-3);
}

TEST(AttentionWindow, NarrowsTheFirstRangeToTheLastWKeys) {
  // Documents [0, 5) and [5, 12), window 3: row t sees [max(s, t - 2), t + 1).
  std::vector<int32_t> offsets = {0, 5, 12};
  auto r = attention_causal_varlen_ranges(offsets.data(), 2, 12);
  r[11].lo2 = 20;  // a second range is kept as is
  r[11].hi2 = 22;
  std::vector<AttnRange> w(12);
  attention_window_ranges(w.data(), r.data(), 12, 3);
  for (int32_t t = 0; t < 12; ++t) {
    const int32_t s = t < 5 ? 0 : 5;
    EXPECT_EQ(w[t].lo1, std::max(s, t - 2)) << t;
    EXPECT_EQ(w[t].hi1, t + 1) << t;
  }
  EXPECT_EQ(w[11].lo2, 20);
  EXPECT_EQ(w[11].hi2, 22);
  attention_window_ranges(r.data(), r.data(), 12, 1);  // in place; window 1: only itself
  EXPECT_EQ(r[7].lo1, 7);
  EXPECT_THAT(error_of([&] { attention_window_ranges(w.data(), r.data(), 12, 0); }),
              ::testing::HasSubstr("window must be >= 1"));
}

TEST(AttentionCausalVarlenDocs, InvertsTheRangesAndNamesTheFirstRowOfAnotherForm) {
  const std::vector<int32_t> offsets = {0, 5, 6, 12};
  auto r = attention_causal_varlen_ranges(offsets.data(), 3, 12);
  EXPECT_EQ(attention_causal_varlen_docs(r.data(), 12), offsets);
  auto w = r;
  attention_window_ranges(w.data(), r.data(), 12, 3);  // row 3 sees [1, 4): a window
  EXPECT_THAT(error_of([&] { attention_causal_varlen_docs(w.data(), 12); }),
              ::testing::HasSubstr("row 3 has range {1, 4, 0, 0}, not the causal varlen form"));
  r[3].lo2 = 8;  // a second range
  r[3].hi2 = 9;
  EXPECT_THAT(error_of([&] { attention_causal_varlen_docs(r.data(), 12); }),
              ::testing::HasSubstr("row 3 has range {0, 4, 8, 9}"));
  r[0].lo1 = 1;  // row 0 must start a document
  EXPECT_THAT(error_of([&] { attention_causal_varlen_docs(r.data(), 12); }),
              ::testing::HasSubstr("row 0 has range"));
}

TEST(AttentionFwd, MaskedKeysAreNeverRead) {
  // Drafter-like rows: ctx [lo, anchor) plus an own block; every other key/value row is NaN.
  const int64_t Tc = 12, K = 3, Tk = Tc + 2 * K, NH = 4, NKV = 1, D = 64;
  std::vector<AttnRange> ranges = {{2, 7, 12, 15}, {2, 7, 12, 15}, {2, 7, 12, 15},
                                   {15, 18, 2, 7}, {15, 18, 2, 7}, {15, 18, 2, 7},
                                   {0, 0, 0, 0}};
  const int64_t Tq = static_cast<int64_t>(ranges.size());
  AttnParams p{Tq, Tk, NH, NKV, D, 0.125};
  std::mt19937 rng(6);
  VecF q = randf(Tq * NH * D, rng), k = randf(Tk * D, rng), v = randf(Tk * D, rng);
  VecF kn = k, vn = v;
  for (int64_t j : {0, 1, 7, 8, 9, 10, 11})
    for (int64_t e = 0; e < D; ++e) kn[j * D + e] = vn[j * D + e] = NAN;
  VecF o1(Tq * NH * D), o2(Tq * NH * D), l1(NH * Tq), l2(NH * Tq);
  attention_fwd_cpu(o1.data(), l1.data(), q.data(), k.data(), v.data(), ranges.data(), p);
  attention_fwd_cpu(o2.data(), l2.data(), q.data(), kn.data(), vn.data(), ranges.data(), p);
  EXPECT_TRUE(same_bits(o1, o2));
  EXPECT_LT(max_abs_diff(o1.data(), dense_attention(q, k, v, ranges, p)), 1e-5);
  // The empty row: zeros and lse = -inf.
  for (int64_t e = 0; e < NH * D; ++e) EXPECT_EQ(o1[(Tq - 1) * NH * D + e], 0.0f);
  EXPECT_EQ(l1[Tq - 1], -INFINITY);
  // Backward with NaN in the masked rows leaves the visible gradients unchanged and finite.
  VecF dout = randf(Tq * NH * D, rng), dq1(o1.size()), dk1(k.size()), dv1(v.size()),
       dq2(o1.size()), dk2(k.size()), dv2(v.size());
  attention_bwd_cpu(dq1.data(), dk1.data(), dv1.data(), dout.data(), q.data(), k.data(), v.data(),
                    o1.data(), l1.data(), ranges.data(), p);
  attention_bwd_cpu(dq2.data(), dk2.data(), dv2.data(), dout.data(), q.data(), kn.data(),
                    vn.data(), o2.data(), l2.data(), ranges.data(), p);
  EXPECT_TRUE(same_bits(dq1, dq2));
  EXPECT_TRUE(same_bits(dk1, dk2));
  EXPECT_TRUE(same_bits(dv1, dv2));
  for (int64_t e = 0; e < D; ++e) EXPECT_EQ(dk1[0 * D + e], 0.0f);  // invisible key: zero grad
}

TEST(AttentionFwd, RejectsBadRangesAndOffsets) {
  AttnParams p{2, 4, 1, 1, 8, 1.0};
  VecF q(16), k(32), v(32), o(16);
  std::vector<AttnRange> r = {{0, 2, 0, 0}, {0, 3, 2, 4}};  // overlap in row 1
  std::string msg = error_of(
      [&] { attention_fwd_cpu(o.data(), nullptr, q.data(), k.data(), v.data(), r.data(), p); });
  EXPECT_NE(msg.find("query row 1"), std::string::npos) << msg;
  r[1] = {0, 5, 0, 0};  // past Tk
  msg = error_of(
      [&] { attention_fwd_cpu(o.data(), nullptr, q.data(), k.data(), v.data(), r.data(), p); });
  EXPECT_NE(msg.find("query row 1"), std::string::npos) << msg;
  std::vector<int32_t> bad = {0, 3, 2};
  msg = error_of([&] { attention_causal_varlen_ranges(bad.data(), 2, 2); });
  EXPECT_NE(msg.find("non-decreasing"), std::string::npos) << msg;
  AttnParams gqa{2, 4, 3, 2, 8, 1.0};
  msg = error_of(
      [&] { attention_fwd_cpu(o.data(), nullptr, q.data(), k.data(), v.data(), r.data(), gqa); });
  EXPECT_NE(msg.find("multiple of NKV"), std::string::npos) << msg;
}

TEST(AttentionBwd, BitIdenticalForAnyThreadCount) {
  std::vector<int32_t> offsets = {0, 40, 129};
  const int64_t T = 129;
  AttnParams p{T, T, 4, 1, 64, 0.125};
  const auto ranges = attention_causal_varlen_ranges(offsets.data(), 2, T);
  std::mt19937 rng(7);
  VecF q = randf(T * 4 * 64, rng), k = randf(T * 64, rng), v = randf(T * 64, rng),
       dout = randf(T * 4 * 64, rng);
  std::vector<VecF> results;
  for (int threads : {1, 2, 3}) {
    set_parallel_threads(threads);
    VecF o(q.size()), lse(4 * T), dq(q.size()), dk(k.size()), dv(v.size());
    attention_fwd_cpu(o.data(), lse.data(), q.data(), k.data(), v.data(), ranges.data(), p);
    attention_bwd_cpu(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                      o.data(), lse.data(), ranges.data(), p);
    VecF all = o;
    for (const VecF* part : {&lse, &dq, &dk, &dv}) all.insert(all.end(), part->begin(), part->end());
    results.push_back(all);
  }
  set_parallel_threads(0);
  EXPECT_TRUE(same_bits(results[0], results[1]));
  EXPECT_TRUE(same_bits(results[0], results[2]));
}

// ----------------------------------------------------------------------------------- cross-entropy

// The vectorised exp of the CPU kernels (cross-entropy rows): within 2 ulp of std::exp over its
// range, and the documented values outside it.
TEST(SimdExp, WithinTwoUlpOfStdExpAndDefinedOutsideItsRange) {
  using namespace cpu::simd;
  const int64_t N = 1 << 20;
  VecF x(N), y(N);
  for (int64_t i = 0; i < N; ++i) x[i] = -87.3f + 175.6f * static_cast<float>(i) / N;
  for (int64_t i = 0; i < N; i += kLanes) {
    const f32x16 e = exp16(load16(x.data() + i));
    std::memcpy(y.data() + i, &e, sizeof e);
  }
  double worst = 0;
  for (int64_t i = 0; i < N; ++i) {
    const float ref = std::exp(x[i]);
    const double ulp = std::nextafter(ref, std::numeric_limits<float>::infinity()) - ref;
    worst = std::max(worst, std::abs(static_cast<double>(y[i]) - ref) / ulp);
  }
  EXPECT_LE(worst, 2.0);
  const float inf = std::numeric_limits<float>::infinity();
  float in[kLanes] = {-inf, -100.0f, -87.4f, 0.0f, -0.0f, 1.0f, 89.0f, inf,
                      std::numeric_limits<float>::quiet_NaN(), -1.0f, 2.0f, -2.0f, 0.5f, -0.5f,
                      10.0f, -10.0f};
  float out[kLanes];
  const f32x16 e = exp16(load16(in));
  std::memcpy(out, &e, sizeof e);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[3], 1.0f);
  EXPECT_EQ(out[4], 1.0f);
  EXPECT_NEAR(out[5], std::exp(1.0f), 1e-6);
  EXPECT_TRUE(std::isfinite(out[6]) && out[6] > 2e38f);  // capped at exp(88.376)
  EXPECT_TRUE(std::isfinite(out[7]) && out[7] > 2e38f);
  EXPECT_TRUE(std::isnan(out[8]));
}

TEST(CrossEntropyFwd, MatchesNaiveFormula) {
  const int64_t R = 7, V = 29;
  std::mt19937 rng(8);
  VecF z = randf(R * V, rng, 4.f), w = {1, 0.5f, 0, 2, 1, 1, 0.25f};
  std::vector<int32_t> labels = {0, 28, 999, 3, 4, 5, 6};  // row 2 has weight 0: label not read
  z[4 * V + 7] = z[4 * V + 9] = 100.f;                    // tie: argmax is the first
  GuardedBuffer lse(R);
  std::vector<int32_t> am(R);
  auto st = cross_entropy_fwd_cpu(lse.data(), am.data(), z.data(), labels.data(), w.data(), R, V);
  double loss = 0, wsum = 0;
  for (int64_t r = 0; r < R; ++r) {
    double m = -INFINITY, s = 0;
    int64_t arg = 0;
    for (int64_t v = 0; v < V; ++v)
      if (z[r * V + v] > m) {
        m = z[r * V + v];
        arg = v;
      }
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(z[r * V + v]) - m);
    const double l = m + std::log(s);
    EXPECT_NEAR(lse.data()[r], l, 1e-5);
    EXPECT_EQ(am[r], arg);
    if (w[r] != 0) loss += w[r] * (l - z[r * V + labels[r]]);
    wsum += w[r];
  }
  EXPECT_EQ(am[4], 7);
  EXPECT_NEAR(st.loss_sum, loss, 1e-5 * std::abs(loss));
  EXPECT_DOUBLE_EQ(st.weight_sum, wsum);
  EXPECT_TRUE(lse.intact());
  labels[3] = 29;
  const std::string msg = error_of([&] {
    cross_entropy_fwd_cpu(lse.data(), am.data(), z.data(), labels.data(), w.data(), R, V);
  });
  EXPECT_NE(msg.find("label 29 of row 3"), std::string::npos) << msg;
}

TEST(CrossEntropyFused, ChunkedEqualsUnfusedForEveryChunkSize) {
  const int64_t R = 129, H = 24, V = 301;
  std::mt19937 rng(9);
  VecF hidden = randf(R * H, rng), head = randf(V * H, rng, 0.3f), w(R);
  std::vector<int32_t> labels(R);
  for (int64_t r = 0; r < R; ++r) {
    labels[r] = static_cast<int32_t>((r * 37) % V);
    w[r] = r % 4 == 0 ? 0.f : 1.f / static_cast<float>(1 + r % 3);
  }
  const double gscale = 1.0 / 64;
  // Unfused: materialised logits, CE forward/backward, linear backward.
  VecF logits(R * V), lse0(R), dlog(R * V), dh0(R * H);
  std::vector<int32_t> am0(R);
  linear_fwd_cpu(logits.data(), hidden.data(), head.data(), nullptr, R, H, V);
  auto st0 = cross_entropy_fwd_cpu(lse0.data(), am0.data(), logits.data(), labels.data(),
                                   w.data(), R, V);
  cross_entropy_bwd_cpu(dlog.data(), logits.data(), lse0.data(), labels.data(), w.data(), gscale,
                        R, V);
  linear_bwd_cpu(dh0.data(), nullptr, nullptr, dlog.data(), hidden.data(), head.data(), R, H, V);

  std::vector<uint16_t> head_bf16(head.size());
  VecF head_rounded(head.size());
  for (size_t i = 0; i < head.size(); ++i) {
    head_bf16[i] = f32_to_bf16_bits(head[i]);
    head_rounded[i] = bf16_bits_to_f32(head_bf16[i]);
  }
  for (int64_t chunk : {1, 7, 64, 1000}) {
    SCOPED_TRACE(chunk);
    GuardedBuffer dh(R * H), lse(R), row_loss(R);
    std::vector<int32_t> am(R);
    FusedCeParams fp{R, H, V, chunk, gscale};
    auto st = cross_entropy_fused_cpu(dh.data(), lse.data(), am.data(), row_loss.data(),
                                      hidden.data(), head.data(), labels.data(), w.data(), fp);
    // row_loss = w·(lse − z_label), 0 on rows of weight 0.
    for (int64_t r = 0; r < R; ++r) {
      const double want = w[r] == 0.f ? 0.0 : w[r] * (lse0[r] - logits[r * V + labels[r]]);
      EXPECT_NEAR(row_loss.data()[r], want, 1e-5 * std::max(1.0, std::abs(want))) << "row " << r;
    }
    EXPECT_TRUE(row_loss.intact());
    EXPECT_NEAR(st.loss_sum, st0.loss_sum, 1e-6 * std::abs(st0.loss_sum));
    EXPECT_EQ(st.weight_sum, st0.weight_sum);
    EXPECT_EQ(am, am0);
    EXPECT_LT(test::rel_error(VecF(lse.data(), lse.data() + R), lse0), 1e-6);
    EXPECT_LT(test::rel_error(VecF(dh.data(), dh.data() + R * H), dh0), 1e-6);
    EXPECT_TRUE(dh.intact() && lse.intact());

    // bf16 head == f32 head holding the same (rounded) values.
    VecF dhb(R * H), dhr(R * H);
    auto sb = cross_entropy_fused_cpu(dhb.data(), nullptr, nullptr, nullptr, hidden.data(),
                                      head_bf16.data(), labels.data(), w.data(), fp);
    auto sr = cross_entropy_fused_cpu(dhr.data(), nullptr, nullptr, nullptr, hidden.data(),
                                      head_rounded.data(), labels.data(), w.data(), fp);
    EXPECT_NEAR(sb.loss_sum, sr.loss_sum, 1e-6 * std::abs(sr.loss_sum));
    EXPECT_LT(test::rel_error(dhb, dhr), 1e-6);
  }
  // Skipping each block's first row is the CUDA entry's alone: the CPU refuses it.
  FusedCeParams skip{R, H, V, 7, gscale};
  skip.skip_first_of = 4;
  EXPECT_THROW(cross_entropy_fused_cpu(nullptr, nullptr, nullptr, nullptr, hidden.data(),
                                       head.data(), labels.data(), w.data(), skip),
               Error);
}

}  // namespace
}  // namespace dflash
