// Gradient checks of the CPU reference ops: every backward against central finite differences in
// float64 on random inputs at odd shapes (T = 1, 7, 129; head_dim 64 and 128; GQA 1, 3, 4), and the
// fp32 path against the fp64 path on the same inputs.
//
// Each check uses the scalar L = Σ r ⊙ y (r random, so dy = r) and compares the analytic gradient
// with (L(x+h) − L(x−h)) / 2h at sampled coordinates (all of them for small tensors). Parameter
// gradients are checked on buffers pre-filled with random values (the += contract), activation
// gradients on buffers pre-filled with NaN (the overwrite contract).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ops/attention.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/embedding.hpp"
#include "ops/linear.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"

namespace dflash {
namespace {

using Vec = std::vector<double>;
using VecF = std::vector<float>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Vec randn(size_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
VecF to_f(const Vec& v) { return VecF(v.begin(), v.end()); }
double dotv(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}
Vec sub(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}
// ||a − b|| / ||b|| for an fp32 result against the fp64 one.
double rel_f(const VecF& a, const Vec& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// Compares `analytic` (dL/dx) with central differences of `loss` at up to `max_samples`
// coordinates of x (always including the first and the last), in relative Frobenius norm.
void expect_grad(const std::string& what, Vec& x, const Vec& analytic,
                 const std::function<double()>& loss, int max_samples = 40, double tol = 1e-6,
                 bool may_be_zero = false) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  std::vector<size_t> idx;
  if (x.size() <= static_cast<size_t>(max_samples)) {
    for (size_t i = 0; i < x.size(); ++i) idx.push_back(i);
  } else {
    std::mt19937 rng(static_cast<uint32_t>(x.size() * 7919 + what.size()));
    std::uniform_int_distribution<size_t> pick(0, x.size() - 1);
    idx.push_back(0);
    idx.push_back(x.size() - 1);
    while (idx.size() < static_cast<size_t>(max_samples)) idx.push_back(pick(rng));
  }
  double num = 0, den = 0, worst = 0;
  size_t worst_i = 0;
  for (size_t i : idx) {
    const double h = 1e-5 * std::max(1.0, std::abs(x[i]));
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    const double d = fd - analytic[i];
    num += d * d;
    den += fd * fd;
    if (std::abs(d) > worst) {
      worst = std::abs(d);
      worst_i = i;
    }
  }
  const double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-12);
  EXPECT_LT(rel, tol) << what << ": relative error " << rel << " over " << idx.size()
                      << " coordinates; worst at " << worst_i << " (analytic "
                      << analytic[worst_i] << ")";
  if (!may_be_zero) {
    EXPECT_GT(den, 0.0) << what << ": finite differences are all zero (test cannot fail)";
  }
}

// ------------------------------------------------------------------------------------------ linear

class LinearGrad : public ::testing::TestWithParam<int> {};

TEST_P(LinearGrad, MatchesFiniteDifferencesAndFp32) {
  const int64_t T = GetParam(), IN = 13, OUT = 6;
  std::mt19937 rng(1 + T);
  Vec x = randn(T * IN, rng), w = randn(OUT * IN, rng, 0.3), b = randn(OUT, rng),
      r = randn(T * OUT, rng);
  Vec y(T * OUT);
  auto loss = [&] {
    linear_fwd_cpu(y.data(), x.data(), w.data(), b.data(), T, IN, OUT);
    return dotv(y, r);
  };
  Vec dx(T * IN, kNaN), dw0 = randn(OUT * IN, rng), db0 = randn(OUT, rng);
  Vec dw = dw0, db = db0;
  linear_bwd_cpu(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), T, IN, OUT);
  expect_grad("linear dx", x, dx, loss);
  expect_grad("linear dw", w, sub(dw, dw0), loss);
  expect_grad("linear db", b, sub(db, db0), loss);

  // fp32 path on the same inputs.
  VecF xf = to_f(x), wf = to_f(w), bf = to_f(b), rf = to_f(r), yf(T * OUT), dxf(T * IN),
       dwf(OUT * IN, 0.f), dbf(OUT, 0.f);
  linear_fwd_cpu(yf.data(), xf.data(), wf.data(), bf.data(), T, IN, OUT);
  linear_bwd_cpu(dxf.data(), dwf.data(), dbf.data(), rf.data(), xf.data(), wf.data(), T, IN, OUT);
  loss();
  EXPECT_LT(rel_f(yf, y), 1e-5);
  EXPECT_LT(rel_f(dxf, dx), 1e-5);
  EXPECT_LT(rel_f(dwf, sub(dw, dw0)), 1e-5);
  EXPECT_LT(rel_f(dbf, sub(db, db0)), 1e-5);
}
INSTANTIATE_TEST_SUITE_P(Shapes, LinearGrad, ::testing::Values(1, 7, 129));

// --------------------------------------------------------------------------------------- embedding

TEST(EmbeddingGrad, ScatterAddMatchesFiniteDifferences) {
  for (int64_t T : {1, 7, 129}) {
    const int64_t V = 11, H = 5;
    std::mt19937 rng(10 + T);
    Vec table = randn(V * H, rng), r = randn(T * H, rng), y(T * H);
    std::vector<int32_t> ids(T);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V) - 1);
    for (auto& id : ids) id = pick(rng);  // repeats are certain at T=129
    auto loss = [&] {
      embedding_fwd_cpu(y.data(), table.data(), ids.data(), T, V, H);
      return dotv(y, r);
    };
    Vec d0 = randn(V * H, rng), d = d0;
    embedding_bwd_cpu(d.data(), r.data(), ids.data(), T, V, H);
    expect_grad("embedding dtable T=" + std::to_string(T), table, sub(d, d0), loss, 60);
  }
}

// ----------------------------------------------------------------------------------------- rmsnorm

struct NormCase {
  int64_t T, NH, D;  // rows = T*NH, each of width D (NH = 1: full width)
};
class RmsNormGrad : public ::testing::TestWithParam<NormCase> {};

TEST_P(RmsNormGrad, MatchesFiniteDifferencesAndFp32) {
  const auto c = GetParam();
  const int64_t R = c.T * c.NH, D = c.D;
  const double eps = 1e-6;
  std::mt19937 rng(static_cast<uint32_t>(100 + R + D));
  Vec x = randn(R * D, rng, 2.0), w = randn(D, rng), r = randn(R * D, rng), y(R * D);
  auto loss = [&] {
    rmsnorm_fwd_cpu(y.data(), nullptr, x.data(), w.data(), R, D, eps);
    return dotv(y, r);
  };
  Vec dx(R * D, kNaN), dw0 = randn(D, rng), dw = dw0;
  rmsnorm_bwd_cpu(dx.data(), dw.data(), r.data(), x.data(), w.data(), R, D, eps);
  expect_grad("rmsnorm dx", x, dx, loss);
  expect_grad("rmsnorm dw", w, sub(dw, dw0), loss);

  VecF xf = to_f(x), wf = to_f(w), rf = to_f(r), yf(R * D), dxf(R * D), dwf(D, 0.f);
  rmsnorm_fwd_cpu(yf.data(), nullptr, xf.data(), wf.data(), R, D, eps);
  rmsnorm_bwd_cpu(dxf.data(), dwf.data(), rf.data(), xf.data(), wf.data(), R, D, eps);
  loss();
  EXPECT_LT(rel_f(yf, y), 1e-5);
  EXPECT_LT(rel_f(dxf, dx), 1e-5);
  EXPECT_LT(rel_f(dwf, sub(dw, dw0)), 1e-5);
}
INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormGrad,
                         ::testing::Values(NormCase{1, 1, 96}, NormCase{7, 1, 40},
                                           NormCase{129, 1, 24}, NormCase{1, 3, 64},
                                           NormCase{7, 2, 128}, NormCase{129, 2, 64}));

// -------------------------------------------------------------------------------------------- rope

struct RopeCase {
  RopeType type;
  int64_t T, NH, D;
};
class RopeGrad : public ::testing::TestWithParam<RopeCase> {};

RopeParams rope_params(RopeType type) {
  RopeParams p;
  p.type = type;
  p.theta = 1e6;
  p.factor = 4.0;
  p.original_max_position_embeddings = 4096;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  return p;
}

TEST_P(RopeGrad, BackwardIsTransposeOfForward) {
  const auto c = GetParam();
  const RopeParams p = rope_params(c.type);
  const Vec inv = rope_inv_freq(p, c.D);
  const double sc = rope_attention_scaling(p);
  std::mt19937 rng(static_cast<uint32_t>(200 + c.T + c.D + static_cast<int>(c.type)));
  std::vector<int32_t> pos(c.T);
  std::uniform_int_distribution<int32_t> pick(0, 20000);
  for (auto& q : pos) q = pick(rng);
  const int64_t n = c.T * c.NH * c.D;
  Vec x = randn(n, rng), r = randn(n, rng), y(n);
  auto loss = [&] {
    rope_fwd_cpu(y.data(), x.data(), pos.data(), inv.data(), sc, c.T, c.NH, c.D);
    return dotv(y, r);
  };
  Vec dx(n, kNaN);
  rope_bwd_cpu(dx.data(), r.data(), pos.data(), inv.data(), sc, c.T, c.NH, c.D);
  expect_grad("rope dx", x, dx, loss);

  // fp32: angles formed in fp32 from fp32 frequencies (as HF); positions up to 2e4 lose a few
  // bits of angle, hence the looser bound.
  VecF invf = to_f(inv), xf = to_f(x), rf = to_f(r), yf(n), dxf(n);
  rope_fwd_cpu(yf.data(), xf.data(), pos.data(), invf.data(), static_cast<float>(sc), c.T, c.NH,
               c.D);
  rope_bwd_cpu(dxf.data(), rf.data(), pos.data(), invf.data(), static_cast<float>(sc), c.T, c.NH,
               c.D);
  loss();
  EXPECT_LT(rel_f(yf, y), 1e-3);
  EXPECT_LT(rel_f(dxf, dx), 1e-3);
}
INSTANTIATE_TEST_SUITE_P(
    Shapes, RopeGrad,
    ::testing::Values(RopeCase{RopeType::standard, 1, 2, 64}, RopeCase{RopeType::linear, 7, 3, 128},
                      RopeCase{RopeType::llama3, 129, 1, 64}, RopeCase{RopeType::yarn, 7, 2, 128},
                      RopeCase{RopeType::yarn, 129, 1, 64}));

// ------------------------------------------------------------------------------ swiglu and residual

TEST(SwigluGrad, FusedLayoutMatchesFiniteDifferencesAndFp32) {
  for (int64_t T : {1, 7, 129}) {
    const int64_t I = 9, ld = 2 * I;  // gate = first half, up = second half of each row
    std::mt19937 rng(300 + T);
    Vec gu = randn(T * ld, rng, 2.0), r = randn(T * I, rng), y(T * I);
    auto loss = [&] {
      swiglu_fwd_cpu(y.data(), gu.data(), gu.data() + I, T, I, ld);
      return dotv(y, r);
    };
    Vec dgu(T * ld, kNaN);
    swiglu_bwd_cpu(dgu.data(), dgu.data() + I, r.data(), gu.data(), gu.data() + I, T, I, ld);
    expect_grad("swiglu d(gate|up) T=" + std::to_string(T), gu, dgu, loss, 60);

    VecF guf = to_f(gu), rf = to_f(r), yf(T * I), dguf(T * ld);
    swiglu_fwd_cpu(yf.data(), guf.data(), guf.data() + I, T, I, ld);
    swiglu_bwd_cpu(dguf.data(), dguf.data() + I, rf.data(), guf.data(), guf.data() + I, T, I, ld);
    loss();
    EXPECT_LT(rel_f(yf, y), 1e-5);
    EXPECT_LT(rel_f(dguf, dgu), 1e-5);
  }
}

TEST(ResidualGrad, PassesGradientToBothBranches) {
  const int64_t n = 7 * 5;
  std::mt19937 rng(400);
  Vec a = randn(n, rng), b = randn(n, rng), r = randn(n, rng), y(n);
  auto loss = [&] {
    residual_fwd_cpu(y.data(), a.data(), b.data(), n);
    return dotv(y, r);
  };
  Vec da(n, kNaN), db(n, kNaN);
  residual_bwd_cpu(da.data(), db.data(), r.data(), n);
  expect_grad("residual da", a, da, loss);
  expect_grad("residual db", b, db, loss);
  Vec acc = a;
  residual_accumulate_cpu(acc.data(), b.data(), n);
  loss();
  EXPECT_EQ(acc, y);
}

// --------------------------------------------------------------------------------------- attention

struct AttnCase {
  std::string name;
  int64_t NH, NKV, D;
  int64_t Tq, Tk;
  std::vector<AttnRange> ranges;
  int samples;
};

AttnCase causal_case(std::string name, int64_t NH, int64_t NKV, int64_t D,
                     std::vector<int32_t> offsets, int samples) {
  const int64_t T = offsets.back();
  auto ranges = attention_causal_varlen_ranges(offsets.data(),
                                               static_cast<int64_t>(offsets.size()) - 1, T);
  return AttnCase{std::move(name), NH, NKV, D, T, T, std::move(ranges), samples};
}

// DFlash-style visibility: ctx keys [0, Tc) then n_blocks blocks of K keys; block b's queries see
// ctx [doc_start, anchor_b) and their own block. One extra padding query sees nothing.
AttnCase drafter_case() {
  const int32_t Tc = 20, K = 4;
  const std::vector<int32_t> anchors = {0, 5, 13, 19}, doc_start = {0, 0, 10, 10};
  std::vector<AttnRange> ranges;
  for (size_t b = 0; b < anchors.size(); ++b)
    for (int32_t j = 0; j < K; ++j) {
      const int32_t blk = Tc + static_cast<int32_t>(b) * K;
      ranges.push_back(AttnRange{doc_start[b], anchors[b], blk, blk + K});
    }
  ranges.push_back(AttnRange{0, 0, 0, 0});
  const int64_t Tq = static_cast<int64_t>(ranges.size());
  return AttnCase{"drafter ranges", 6, 2, 64, Tq, Tc + K * 4, ranges, 30};
}

class AttentionGrad : public ::testing::TestWithParam<int> {};

std::vector<AttnCase> attention_cases() {
  return {
      causal_case("T=1 D=64 gqa1", 1, 1, 64, {0, 1}, 40),
      // One query over 9 keys (a decoding step over a cache), gqa 4.
      AttnCase{"Tq=1 Tk=9 D=128 gqa4", 4, 1, 128, 1, 9, {AttnRange{0, 9, 0, 0}}, 40},
      causal_case("T=7 D=128 gqa3 2 docs", 3, 1, 128, {0, 3, 7}, 40),
      causal_case("T=7 D=64 gqa1 NKV=2", 2, 2, 64, {0, 7}, 40),
      causal_case("T=129 D=64 gqa4 3 docs", 4, 1, 64, {0, 50, 51, 129}, 14),
      causal_case("T=129 D=128 gqa3", 3, 1, 128, {0, 129}, 8),
      drafter_case(),
  };
}

TEST_P(AttentionGrad, MatchesFiniteDifferencesAndFp32) {
  const AttnCase c = attention_cases()[static_cast<size_t>(GetParam())];
  SCOPED_TRACE(c.name);
  // With a single visible key per row the softmax is constant: dq = dk = 0 exactly.
  const bool one_key = c.Tk == 1;
  AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, c.D, 1.0 / std::sqrt(static_cast<double>(c.D))};
  std::mt19937 rng(static_cast<uint32_t>(500 + GetParam()));
  const int64_t nq = c.Tq * c.NH * c.D, nk = c.Tk * c.NKV * c.D;
  Vec q = randn(nq, rng, 1.5), k = randn(nk, rng, 1.5), v = randn(nk, rng), r = randn(nq, rng);
  Vec o(nq), lse(c.NH * c.Tq);
  auto loss = [&] {
    attention_fwd_cpu(o.data(), lse.data(), q.data(), k.data(), v.data(), c.ranges.data(), p);
    return dotv(o, r);
  };
  loss();
  Vec dq(nq, kNaN), dk(nk, kNaN), dv(nk, kNaN);
  attention_bwd_cpu(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(), v.data(),
                    o.data(), lse.data(), c.ranges.data(), p);
  expect_grad("attention dq", q, dq, loss, c.samples, 1e-6, one_key);
  expect_grad("attention dk", k, dk, loss, c.samples, 1e-6, one_key);
  if (one_key) {
    for (double g : dq) EXPECT_EQ(g, 0.0);
    for (double g : dk) EXPECT_EQ(g, 0.0);
  }
  expect_grad("attention dv", v, dv, loss, c.samples);

  VecF qf = to_f(q), kf = to_f(k), vf = to_f(v), rf = to_f(r), of(nq), lsef(c.NH * c.Tq),
       dqf(nq), dkf(nk), dvf(nk);
  attention_fwd_cpu(of.data(), lsef.data(), qf.data(), kf.data(), vf.data(), c.ranges.data(), p);
  attention_bwd_cpu(dqf.data(), dkf.data(), dvf.data(), rf.data(), qf.data(), kf.data(), vf.data(),
                    of.data(), lsef.data(), c.ranges.data(), p);
  loss();
  EXPECT_LT(rel_f(of, o), 1e-5);
  EXPECT_LT(rel_f(dqf, dq), 1e-5);
  EXPECT_LT(rel_f(dkf, dk), 1e-5);
  EXPECT_LT(rel_f(dvf, dv), 1e-5);
}
INSTANTIATE_TEST_SUITE_P(Cases, AttentionGrad, ::testing::Range(0, 7));

// ----------------------------------------------------------------------------------- cross-entropy

TEST(CrossEntropyGrad, WeightedLossMatchesFiniteDifferencesAndFp32) {
  for (int64_t R : {1, 7, 129}) {
    const int64_t V = 37;
    std::mt19937 rng(600 + R);
    Vec z = randn(R * V, rng, 3.0), w(R);
    std::vector<int32_t> labels(R);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V) - 1);
    std::uniform_real_distribution<double> uw(0.1, 2.0);
    for (int64_t i = 0; i < R; ++i) {
      labels[i] = pick(rng);
      w[i] = uw(rng);
    }
    if (R > 1) {
      w[1] = 0.0;  // a padding row: weight 0, label never read
      labels[1] = -100;
    }
    const double gscale = 0.37;
    auto loss = [&] {
      return gscale *
             cross_entropy_fwd_cpu(static_cast<double*>(nullptr), nullptr, z.data(),
                                   labels.data(), w.data(), R, V)
                 .loss_sum;
    };
    Vec lse(R), dz(R * V, kNaN);
    cross_entropy_fwd_cpu(lse.data(), nullptr, z.data(), labels.data(), w.data(), R, V);
    cross_entropy_bwd_cpu(dz.data(), z.data(), lse.data(), labels.data(), w.data(), gscale, R, V);
    expect_grad("cross-entropy dlogits R=" + std::to_string(R), z, dz, loss, 60);

    VecF zf = to_f(z), wf = to_f(w), lsef(R), dzf(R * V);
    auto st = cross_entropy_fwd_cpu(lsef.data(), nullptr, zf.data(), labels.data(), wf.data(), R,
                                    V);
    cross_entropy_bwd_cpu(dzf.data(), zf.data(), lsef.data(), labels.data(), wf.data(), gscale, R,
                          V);
    EXPECT_NEAR(st.loss_sum * gscale, loss(), 1e-5 * std::abs(loss()));
    EXPECT_LT(rel_f(lsef, lse), 1e-6);
    EXPECT_LT(rel_f(dzf, dz), 1e-5);
  }
}

TEST(CrossEntropyGrad, FusedHiddenGradientMatchesFiniteDifferences) {
  for (int64_t R : {1, 7, 129}) {
    const int64_t H = 16, V = 50;
    std::mt19937 rng(700 + R);
    Vec hidden = randn(R * H, rng), head = randn(V * H, rng, 0.5), w(R);
    std::vector<int32_t> labels(R);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V) - 1);
    for (int64_t i = 0; i < R; ++i) {
      labels[i] = pick(rng);
      w[i] = 1.0 + 0.1 * static_cast<double>(i % 5);
    }
    FusedCeParams p{R, H, V, 5, 0.5};  // chunks of 5 rows: 129 is not a multiple
    auto loss = [&] {
      return p.grad_scale * cross_entropy_fused_cpu(static_cast<double*>(nullptr), nullptr, nullptr,
                                                    nullptr, hidden.data(), head.data(),
                                                    labels.data(), w.data(), p)
                                .loss_sum;
    };
    Vec dh(R * H, kNaN);
    cross_entropy_fused_cpu(dh.data(), nullptr, nullptr, nullptr, hidden.data(), head.data(),
                            labels.data(), w.data(), p);
    expect_grad("fused CE d_hidden R=" + std::to_string(R), hidden, dh, loss, 40);

    VecF hf = to_f(hidden), headf = to_f(head), wf = to_f(w), dhf(R * H);
    auto st = cross_entropy_fused_cpu(dhf.data(), nullptr, nullptr, nullptr, hf.data(),
                                      headf.data(), labels.data(), wf.data(), p);
    EXPECT_NEAR(st.loss_sum * p.grad_scale, loss(), 1e-5 * std::abs(loss()));
    EXPECT_LT(rel_f(dhf, dh), 1e-5);
  }
}

}  // namespace
}  // namespace dflash
