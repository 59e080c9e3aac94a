// CUDA DFlash2 grouped dynamic causal conv (ops/dflash2_conv.hpp) vs the CPU reference
// dflash2_conv_fwd/_bwd (model/dflash2_conv.hpp) at odd shapes: H not a multiple of 32, groups of
// 1, 5 and 64 channels, T = 1, 2 and T = b, several blocks; f32 and bf16 inputs and outputs, the
// residual form, dx both overwritten and accumulated, the side's half of dδ (the other half
// untouched), dβ accumulated. Then: no tap crosses a block boundary, and every output is the same
// bits on a second run (the fixed-order reductions).
#include <gmock/gmock.h>

#include <cmath>
#include <tuple>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "model/dflash2_conv.hpp"
#include "ops/dflash2_conv.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

size_t sz(int64_t n) {
  return static_cast<size_t>(n);
}

// Random inputs of one conv, bf16-representable so that the CPU sees what the GPU reads.
struct ConvData {
  Dflash2ConvShape s;
  std::vector<float> x, base, delta, dout, res;
  ConvData(const Dflash2ConvShape& shape, uint32_t seed) : s(shape) {
    x = round_bf16(randn(sz(s.rows * s.H), seed));
    base = randn(sz(2 * s.taps * s.H), seed + 1, 0.5f);
    delta = randn(sz(s.rows * s.delta_width()), seed + 2, 0.5f);
    dout = randn(sz(s.rows * s.H), seed + 3);
    res = randn(sz(s.rows * s.H), seed + 4);
  }
};

void run(const Dflash2ConvShape& s, int side, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "rows=" << s.rows << " H=" << s.H << " b=" << s.block
                                    << " T=" << s.taps << " g=" << s.group << " side=" << side);
  cuda::CudaContext ctx(0);
  const ConvData in(s, seed);
  const int64_t n = s.rows * s.H, W = s.delta_width(), TH = s.taps * s.H;
  const float* base_side = in.base.data() + side * TH;
  // CPU reference.
  std::vector<float> out_ref(sz(n)), dx_ref(sz(n), 0.f), ddelta_ref(sz(s.rows * W), 0.f);
  std::vector<float> dbase_ref(sz(TH), 0.25f);  // accumulated onto 0.25
  dflash2_conv_fwd(out_ref.data(), in.x.data(), base_side, in.delta.data(), side, s);
  dflash2_conv_bwd(dx_ref.data(), dbase_ref.data(), ddelta_ref.data(), in.dout.data(), in.x.data(),
                   base_side, in.delta.data(), side, s);
  std::vector<float> res_ref(sz(n));
  for (size_t k = 0; k < sz(n); ++k) res_ref[k] = in.res[k] + out_ref[k];

  DeviceGuarded<float> x(in.x), base(in.base), delta(in.delta), dout(in.dout), res(in.res);
  DeviceGuarded<uint16_t> xb(to_bf16(in.x));
  const float* bs = base.get() + side * TH;
  // Forward: f32 with a residual, f32 without, bf16 in and out.
  DeviceGuarded<float> out(sz(n)), out_res(sz(n));
  DeviceGuarded<uint16_t> out_bf(sz(n));
  dflash2_conv_fwd_cuda(ctx, out.get(), static_cast<const float*>(nullptr), x.get(), bs,
                        delta.get(), side, s);
  dflash2_conv_fwd_cuda(ctx, out_res.get(), res.get(), x.get(), bs, delta.get(), side, s);
  dflash2_conv_fwd_cuda(ctx, out_bf.get(), static_cast<const float*>(nullptr), xb.get(), bs,
                        delta.get(), side, s);
  EXPECT_LT(rel_error(out.download(), out_ref), tol::kF32);
  EXPECT_LT(rel_error(out_res.download(), res_ref), tol::kF32);
  EXPECT_LT(rel_error(from_bf16(out_bf.download()), out_ref), tol::kBf16);
  // dx: overwritten (f32 and bf16), then accumulated onto the residual values.
  DeviceGuarded<float> dx(sz(n)), dx_acc(in.res);
  DeviceGuarded<uint16_t> dx_bf(sz(n));
  dflash2_conv_bwd_dx_cuda(ctx, dx.get(), false, dout.get(), bs, delta.get(), side, s);
  dflash2_conv_bwd_dx_cuda(ctx, dx_bf.get(), false, dout.get(), bs, delta.get(), side, s);
  dflash2_conv_bwd_dx_cuda(ctx, dx_acc.get(), true, dout.get(), bs, delta.get(), side, s);
  std::vector<float> dx_acc_ref(sz(n));
  for (size_t k = 0; k < sz(n); ++k) dx_acc_ref[k] = in.res[k] + dx_ref[k];
  EXPECT_LT(rel_error(dx.download(), dx_ref), tol::kF32);
  EXPECT_LT(rel_error(from_bf16(dx_bf.download()), dx_ref), tol::kBf16);
  EXPECT_LT(rel_error(dx_acc.download(), dx_acc_ref), tol::kF32);
  // dδ: the side's half from an f32 and from a bf16 x; the other half keeps its poison.
  DeviceGuarded<float> dd(sz(s.rows * W)), dd_xb(sz(s.rows * W));
  DeviceGuarded<uint16_t> dd_bf(sz(s.rows * W));
  dflash2_conv_bwd_ddelta_cuda(ctx, dd.get(), dout.get(), x.get(), side, s);
  dflash2_conv_bwd_ddelta_cuda(ctx, dd_xb.get(), dout.get(), xb.get(), side, s);
  dflash2_conv_bwd_ddelta_cuda(ctx, dd_bf.get(), dout.get(), x.get(), side, s);
  const int64_t half = s.taps * s.groups();
  auto side_half = [&](const std::vector<float>& v) {
    std::vector<float> h;
    for (int64_t i = 0; i < s.rows; ++i) {
      const auto row = v.begin() + i * W + side * half;
      h.insert(h.end(), row, row + half);
    }
    return h;
  };
  auto other_half_poisoned = [&](const std::vector<float>& v) {
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t k = 0; k < half; ++k) {
        if (!std::isnan(v[sz(i * W + (1 - side) * half + k)])) return false;
      }
    }
    return true;
  };
  const auto dd_h = dd.download(), dd_xb_h = dd_xb.download();
  const auto dd_bf_h = from_bf16(dd_bf.download());
  EXPECT_LT(rel_error(side_half(dd_h), side_half(ddelta_ref)), tol::kF32);
  EXPECT_LT(rel_error(side_half(dd_xb_h), side_half(ddelta_ref)), tol::kF32);
  EXPECT_LT(rel_error(side_half(dd_bf_h), side_half(ddelta_ref)), tol::kBf16);
  EXPECT_TRUE(other_half_poisoned(dd_h) && other_half_poisoned(dd_bf_h));
  // dβ accumulated onto 0.25, from f32 and from bf16 x.
  DeviceGuarded<float> db(std::vector<float>(sz(TH), 0.25f)),
      db_xb(std::vector<float>(sz(TH), 0.25f));
  dflash2_conv_bwd_dbase_cuda(ctx, db.get(), dout.get(), x.get(), s);
  dflash2_conv_bwd_dbase_cuda(ctx, db_xb.get(), dout.get(), xb.get(), s);
  EXPECT_LT(rel_error(db.download(), dbase_ref), tol::kF32);
  EXPECT_LT(rel_error(db_xb.download(), dbase_ref), tol::kF32);
  for (const auto* g : {&out, &out_res, &dx, &dx_acc, &dd, &dd_xb, &db, &db_xb}) {
    EXPECT_TRUE(g->guard_intact());
  }
  EXPECT_TRUE(out_bf.guard_intact() && dx_bf.guard_intact() && dd_bf.guard_intact());
}

}  // namespace

TEST(Dflash2ConvCuda, MatchesCpuAtOddShapes) {
  DFLASH_REQUIRE_GPU();
  uint32_t seed = 10;
  // {rows, H, block, taps, group}: H = 45 and 195 (not multiples of 32), groups of 1, 5, 65.
  for (int64_t taps : {1, 2, 4}) {
    for (int side : {0, 1}) run({12, 45, 4, taps, 5}, side, seed++);
  }
  run({15, 195, 5, 3, 65}, 1, seed++);  // a group wider than a warp
  run({6, 33, 2, 2, 1}, 0, seed++);     // one channel per group
  run({160, 256, 16, 16, 64}, 0, seed++);
  run({4, 8, 4, 4, 8}, 1, seed++);  // one block, one group
}

TEST(Dflash2ConvCuda, TapsStayInsideTheirBlock) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const Dflash2ConvShape s{12, 40, 4, 4, 8};
  const ConvData in(s, 77);
  auto x2 = in.x;
  for (int64_t c = 0; c < s.H; ++c) x2[sz(3 * s.H + c)] += 1.0f;  // the last row of block 0
  DeviceGuarded<float> x(in.x), xp(x2), base(in.base), delta(in.delta), dout(in.dout);
  DeviceGuarded<float> o(sz(s.rows * s.H)), op(sz(s.rows * s.H));
  auto* nul = static_cast<const float*>(nullptr);
  dflash2_conv_fwd_cuda(ctx, o.get(), nul, x.get(), base.get(), delta.get(), 0, s);
  dflash2_conv_fwd_cuda(ctx, op.get(), nul, xp.get(), base.get(), delta.get(), 0, s);
  const auto a = o.download(), b = op.download();
  const auto block1 = [&](const std::vector<float>& v) {
    return std::vector<float>(v.begin() + 4 * s.H, v.end());
  };
  EXPECT_TRUE(same_bits(block1(a), block1(b)));
  EXPECT_FALSE(same_bits(a, b));
}

TEST(Dflash2ConvCuda, SameBitsEveryRun) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const Dflash2ConvShape s{4096, 320, 16, 16, 64};
  const ConvData in(s, 5);
  DeviceGuarded<float> base(in.base), delta(in.delta), dout(in.dout);
  DeviceGuarded<uint16_t> x(to_bf16(in.x));
  auto once = [&] {
    DeviceGuarded<float> dx(sz(s.rows * s.H)), db(std::vector<float>(sz(s.taps * s.H), 0.f));
    DeviceGuarded<uint16_t> dd(std::vector<uint16_t>(sz(s.rows * s.delta_width()), 0));
    dflash2_conv_bwd_dx_cuda(ctx, dx.get(), false, dout.get(), base.get(), delta.get(), 0, s);
    dflash2_conv_bwd_ddelta_cuda(ctx, dd.get(), dout.get(), x.get(), 0, s);
    dflash2_conv_bwd_dbase_cuda(ctx, db.get(), dout.get(), x.get(), s);
    return std::tuple{dx.download(), dd.download(), db.download()};
  };
  const auto [dx1, dd1, db1] = once();
  const auto [dx2, dd2, db2] = once();
  EXPECT_TRUE(same_bits(dx1, dx2));
  EXPECT_TRUE(same_bits(dd1, dd2));
  EXPECT_TRUE(same_bits(db1, db2));
}

TEST(Dflash2ConvCuda, RefusesBadShapes) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  DeviceGuarded<float> buf(64);
  auto* nul = static_cast<const float*>(nullptr);
  auto expect_error = [](auto call, const char* text) {
    try {
      call();
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(text));
    }
  };
  expect_error(
      [&] {
        dflash2_conv_fwd_cuda(ctx, buf.get(), nul, buf.get(), buf.get(), buf.get(), 0,
                              Dflash2ConvShape{6, 8, 4, 2, 4});
      },
      "not a multiple of the block size");
  expect_error(
      [&] {
        dflash2_conv_fwd_cuda(ctx, buf.get(), nul, buf.get(), buf.get(), buf.get(), 0,
                              Dflash2ConvShape{4, 8, 4, 2, 3});
      },
      "must divide hidden_size");
  expect_error(
      [&] {
        dflash2_conv_bwd_dx_cuda(ctx, buf.get(), false, buf.get(), buf.get(), buf.get(), 2,
                                 Dflash2ConvShape{4, 8, 4, 2, 4});
      },
      "side 2");
}
