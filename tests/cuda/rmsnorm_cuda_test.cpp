// CUDA RMSNorm (full width and per head) vs rmsnorm_fwd_cpu/rmsnorm_bwd_cpu: fp32 and bf16
// storage, dx overwritten, dw accumulated (+=) and bit-reproducible, guard bytes; the backward
// fused with the residual gradient (rmsnorm_bwd_res_cuda) against the CPU and, bit for bit, against
// the unfused chain rmsnorm_bwd_cuda → residual_accumulate_cuda → cast_cuda.
#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/cast.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

void run(int64_t R, int64_t D, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "R=" << R << " D=" << D);
  cuda::CudaContext ctx(0);
  const double eps = 1e-6;
  const auto x = randn(static_cast<size_t>(R * D), seed, 2.0f);
  const auto w = randn(static_cast<size_t>(D), seed + 1);
  const auto dy = randn(static_cast<size_t>(R * D), seed + 2);
  const auto dw0 = randn(static_cast<size_t>(D), seed + 3);
  std::vector<float> y_ref(x.size()), rstd_ref(static_cast<size_t>(R)), dx_ref(x.size());
  std::vector<float> dw_ref = dw0;
  rmsnorm_fwd_cpu(y_ref.data(), rstd_ref.data(), x.data(), w.data(), R, D, eps);
  rmsnorm_bwd_cpu(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), R, D, eps);

  DeviceGuarded<float> dx_in(x), dwt(w), ddy(dy);
  DeviceGuarded<float> y(x.size()), rstd(static_cast<size_t>(R)), gx(x.size()), gw(dw0);
  rmsnorm_fwd_cuda(ctx, y.get(), rstd.get(), dx_in.get(), dwt.get(), R, D, eps);
  rmsnorm_bwd_cuda(ctx, gx.get(), gw.get(), ddy.get(), dx_in.get(), dwt.get(), R, D, eps);
  EXPECT_LT(rel_error(y.download(), y_ref), tol::kF32);
  EXPECT_LT(rel_error(rstd.download(), rstd_ref), tol::kF32);
  EXPECT_LT(rel_error(gx.download(), dx_ref), tol::kF32);
  EXPECT_LT(rel_error(gw.download(), dw_ref), tol::kF32);
  EXPECT_TRUE(y.guard_intact() && rstd.guard_intact() && gx.guard_intact() && gw.guard_intact());
  // dw determinism: accumulating the same gradient again from the same start gives the same bits.
  const auto gw1 = gw.download();
  gw.upload(dw0);
  rmsnorm_bwd_cuda<float, float>(ctx, nullptr, gw.get(), ddy.get(), dx_in.get(), dwt.get(), R, D,
                                 eps);
  EXPECT_TRUE(same_bits(gw.download(), gw1));

  // bf16 storage: x bf16 -> y bf16 and y f32; gradients bf16.
  const auto xb = to_bf16(x), dyb = to_bf16(dy);
  const auto xr = from_bf16(xb), dyr = from_bf16(dyb);
  std::vector<float> yb_ref(x.size()), dxb_ref(x.size()), dwb_ref = dw0;
  rmsnorm_fwd_cpu(yb_ref.data(), nullptr, xr.data(), w.data(), R, D, eps);
  rmsnorm_bwd_cpu(dxb_ref.data(), dwb_ref.data(), dyr.data(), xr.data(), w.data(), R, D, eps);
  DeviceGuarded<uint16_t> bx(xb), bdy(dyb), by(x.size()), bgx(x.size());
  DeviceGuarded<float> by32(x.size()), bgw(dw0);
  rmsnorm_fwd_cuda(ctx, by.get(), nullptr, bx.get(), dwt.get(), R, D, eps);
  rmsnorm_fwd_cuda(ctx, by32.get(), nullptr, bx.get(), dwt.get(), R, D, eps);
  rmsnorm_bwd_cuda(ctx, bgx.get(), bgw.get(), bdy.get(), bx.get(), dwt.get(), R, D, eps);
  EXPECT_LT(rel_error(from_bf16(by.download()), yb_ref), tol::kBf16);
  EXPECT_LT(rel_error(by32.download(), yb_ref), tol::kF32);
  EXPECT_LT(rel_error(from_bf16(bgx.download()), dxb_ref), tol::kBf16);
  EXPECT_LT(rel_error(bgw.download(), dwb_ref), tol::kF32);
  EXPECT_TRUE(by.guard_intact() && bgx.guard_intact() && bgw.guard_intact());
}

void run_res(int64_t R, int64_t D, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "R=" << R << " D=" << D);
  cuda::CudaContext ctx(0);
  const double eps = 1e-6;
  const size_t n = static_cast<size_t>(R * D);
  const auto x = randn(n, seed, 2.0f), dy = randn(n, seed + 1), dres0 = randn(n, seed + 2);
  const auto w = randn(static_cast<size_t>(D), seed + 3),
             dw0 = randn(static_cast<size_t>(D), seed + 4);
  std::vector<float> dx_ref(n), dw_ref = dw0, acc_ref(n);
  rmsnorm_bwd_cpu(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), R, D, eps);
  for (size_t i = 0; i < n; ++i) acc_ref[i] = dres0[i] + dx_ref[i];
  DeviceGuarded<float> gx(x), gy(dy), gw(w);

  // Fused: accumulate with a bf16 copy, and overwrite.
  DeviceGuarded<float> acc(dres0), acc_dw(dw0), over(n);
  DeviceGuarded<uint16_t> acc_bf(n), over_bf(n);
  rmsnorm_bwd_res_cuda(ctx, acc.get(), acc_bf.get(), true, acc_dw.get(), gy.get(), gx.get(),
                       gw.get(), R, D, eps);
  rmsnorm_bwd_res_cuda(ctx, over.get(), over_bf.get(), false, nullptr, gy.get(), gx.get(), gw.get(),
                       R, D, eps);
  EXPECT_LT(rel_error(acc.download(), acc_ref), tol::kF32);
  EXPECT_LT(rel_error(from_bf16(acc_bf.download()), acc_ref), tol::kBf16);
  EXPECT_LT(rel_error(over.download(), dx_ref), tol::kF32);
  EXPECT_LT(rel_error(acc_dw.download(), dw_ref), tol::kF32);
  EXPECT_TRUE(same_bits(acc_bf.download(), to_bf16(acc.download())));
  EXPECT_TRUE(same_bits(over_bf.download(), to_bf16(over.download())));
  EXPECT_TRUE(acc.guard_intact() && acc_bf.guard_intact() && over.guard_intact() &&
              over_bf.guard_intact() && acc_dw.guard_intact());

  // The unfused chain gives the same bits.
  DeviceGuarded<float> tmp(n), chain(dres0), chain_dw(dw0);
  DeviceGuarded<uint16_t> chain_bf(n);
  rmsnorm_bwd_cuda(ctx, tmp.get(), chain_dw.get(), gy.get(), gx.get(), gw.get(), R, D, eps);
  residual_accumulate_cuda(ctx, chain.get(), tmp.get(), static_cast<int64_t>(n));
  cast_cuda(ctx, chain_bf.get(), chain.get(), static_cast<int64_t>(n));
  EXPECT_TRUE(same_bits(acc.download(), chain.download()));
  EXPECT_TRUE(same_bits(acc_bf.download(), chain_bf.download()));
  EXPECT_TRUE(same_bits(acc_dw.download(), chain_dw.download()));
  EXPECT_TRUE(same_bits(over.download(), tmp.download()));

  // No dres: the weight gradient alone, the same bits.
  DeviceGuarded<float> only_dw(dw0);
  rmsnorm_bwd_res_cuda(ctx, nullptr, nullptr, true, only_dw.get(), gy.get(), gx.get(), gw.get(), R,
                       D, eps);
  EXPECT_TRUE(same_bits(only_dw.download(), acc_dw.download()));
}

}  // namespace

TEST(RmsNormCuda, BackwardFusedWithTheResidualGradient) {
  DFLASH_REQUIRE_GPU();
  run_res(1, 384, 11);
  run_res(17, 1000, 12);
  run_res(129, 4096, 13);
}

TEST(RmsNormCuda, FullWidth) {
  DFLASH_REQUIRE_GPU();
  run(1, 384, 1);
  run(17, 1000, 2);
  run(129, 4096, 3);
}

// Rows of D a multiple of 512 (one CTA per row, vector loads; the target's f32 residual into
// bf16): fp32 rows into bf16 against the CPU, and in place (y = x, fp32). D 512 (one warp per
// CTA), 2,048 and 5,120 (10 warps); the other tests cover bf16 inputs and the warp-per-row rows.
TEST(RmsNormCuda, WideRowsIntoBf16AndInPlace) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const double eps = 1e-6;
  for (const int64_t D : {512, 2048, 5120}) {
    SCOPED_TRACE(::testing::Message() << "D=" << D);
    const int64_t R = 37;
    const auto x = randn(static_cast<size_t>(R * D), 40 + static_cast<uint32_t>(D), 2.0f);
    const auto w = randn(static_cast<size_t>(D), 41 + static_cast<uint32_t>(D));
    std::vector<float> y_ref(x.size()), rstd_ref(static_cast<size_t>(R));
    rmsnorm_fwd_cpu(y_ref.data(), rstd_ref.data(), x.data(), w.data(), R, D, eps);
    DeviceGuarded<float> dx(x), dw(w), rstd(static_cast<size_t>(R));
    DeviceGuarded<uint16_t> yb(x.size());
    rmsnorm_fwd_cuda(ctx, yb.get(), rstd.get(), dx.get(), dw.get(), R, D, eps);
    EXPECT_LT(rel_error(from_bf16(yb.download()), y_ref), tol::kBf16);
    EXPECT_LT(rel_error(rstd.download(), rstd_ref), tol::kF32);
    rmsnorm_fwd_cuda(ctx, dx.get(), static_cast<float*>(nullptr), dx.get(), dw.get(), R, D, eps);
    EXPECT_LT(rel_error(dx.download(), y_ref), tol::kF32);
    EXPECT_TRUE(dx.guard_intact() && yb.guard_intact() && rstd.guard_intact());
  }
}

TEST(RmsNormCuda, PerHead) {
  DFLASH_REQUIRE_GPU();
  run(17 * 3, 64, 4);    // T=17, 3 heads of 64
  run(1000 * 4, 128, 5); // T=1000, 4 heads of 128
}
