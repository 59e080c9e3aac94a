// CUDA linear (cuBLASLt GEMM, bf16 in, fp32 accumulate) vs linear_fwd_cpu/linear_bwd_cpu on the
// same bf16-rounded values: f32 and bf16 outputs, dx overwritten, dW accumulated (+=), odd shapes,
// guard bytes, plan cache reuse; the residual add in the epilogue (linear_fwd_res_cuda) against
// copy + in-place accumulation, bit for bit.
#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/linear.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

void run(int64_t T, int64_t IN, int64_t OUT, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " IN=" << IN << " OUT=" << OUT);
  cuda::CudaContext ctx(0);
  const auto x = to_bf16(randn(static_cast<size_t>(T * IN), seed));
  const auto w = to_bf16(randn(static_cast<size_t>(OUT * IN), seed + 1, 0.1f));
  const auto dy = to_bf16(randn(static_cast<size_t>(T * OUT), seed + 2));
  const auto dw0 = randn(static_cast<size_t>(OUT * IN), seed + 3);
  const auto xf = from_bf16(x), dyf = from_bf16(dy);
  std::vector<float> y_ref(static_cast<size_t>(T * OUT)), dx_ref(static_cast<size_t>(T * IN));
  std::vector<float> dw_ref = dw0;
  linear_fwd_cpu(y_ref.data(), xf.data(), w.data(), nullptr, T, IN, OUT);
  linear_bwd_cpu(dx_ref.data(), dw_ref.data(), nullptr, dyf.data(), xf.data(), w.data(), T, IN,
                 OUT);

  DeviceGuarded<uint16_t> dx_in(x), dw_in(w), ddy(dy);
  DeviceGuarded<float> y32(static_cast<size_t>(T * OUT));
  DeviceGuarded<uint16_t> y16(static_cast<size_t>(T * OUT));
  linear_fwd_cuda(ctx, y32.get(), dx_in.get(), dw_in.get(), T, IN, OUT);
  linear_fwd_cuda(ctx, y16.get(), dx_in.get(), dw_in.get(), T, IN, OUT);
  EXPECT_LT(rel_error(y32.download(), y_ref), tol::kGemmF32);
  EXPECT_LT(rel_error(from_bf16(y16.download()), y_ref), tol::kGemmBf16);
  DeviceGuarded<float> gx(static_cast<size_t>(T * IN)), gw(dw0);
  DeviceGuarded<uint16_t> gx16(static_cast<size_t>(T * IN));
  linear_bwd_cuda(ctx, gx.get(), gw.get(), ddy.get(), dx_in.get(), dw_in.get(), T, IN, OUT);
  linear_bwd_cuda<uint16_t>(ctx, gx16.get(), nullptr, ddy.get(), dx_in.get(), dw_in.get(), T, IN,
                            OUT);
  EXPECT_LT(rel_error(gx.download(), dx_ref), tol::kGemmF32);
  EXPECT_LT(rel_error(from_bf16(gx16.download()), dx_ref), tol::kGemmBf16);
  EXPECT_LT(rel_error(gw.download(), dw_ref), tol::kGemmF32);
  EXPECT_TRUE(y32.guard_intact() && y16.guard_intact() && gx.guard_intact() &&
              gw.guard_intact() && gx16.guard_intact());
  // Residual in the epilogue: y = res + x·Wᵀ, res untouched, the same bits as copy + accumulate.
  const auto res = randn(static_cast<size_t>(T * OUT), seed + 4);
  std::vector<float> yres_ref(res.size());
  for (size_t i = 0; i < res.size(); ++i) yres_ref[i] = res[i] + y_ref[i];
  DeviceGuarded<float> dres(res), yres(res.size()), yacc(res);
  linear_fwd_res_cuda(ctx, yres.get(), dres.get(), dx_in.get(), dw_in.get(), T, IN, OUT);
  linear_fwd_acc_cuda(ctx, yacc.get(), dx_in.get(), dw_in.get(), T, IN, OUT);
  EXPECT_LT(rel_error(yres.download(), yres_ref), tol::kGemmF32);
  EXPECT_TRUE(same_bits(yres.download(), yacc.download()));
  EXPECT_TRUE(same_bits(dres.download(), res));
  EXPECT_TRUE(dres.guard_intact() && yres.guard_intact() && yacc.guard_intact());
  // The second identical call reuses the cached plan.
  const size_t plans = ctx.gemm_plans().size();
  linear_fwd_cuda(ctx, y32.get(), dx_in.get(), dw_in.get(), T, IN, OUT);
  EXPECT_EQ(ctx.gemm_plans().size(), plans);
  EXPECT_LT(rel_error(y32.download(), y_ref), tol::kGemmF32);
}

}  // namespace

TEST(LinearCuda, MatchesCpu) {
  DFLASH_REQUIRE_GPU();
  run(1, 64, 96, 1);
  run(17, 128, 64, 2);
  run(129, 384, 1000, 3);
  run(1000, 256, 136, 4);
}

TEST(LinearCuda, OddInnerAndOuterSizes) {
  DFLASH_REQUIRE_GPU();
  run(7, 37, 53, 5);
  run(129, 17, 3, 6);
}

TEST(LinearCuda, ResidualEpilogueRefusesOverlap) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t T = 4, IN = 8, OUT = 16;
  DeviceGuarded<uint16_t> x(to_bf16(randn(static_cast<size_t>(T * IN), 7)));
  DeviceGuarded<uint16_t> w(to_bf16(randn(static_cast<size_t>(OUT * IN), 8)));
  DeviceGuarded<float> y(static_cast<size_t>((T + 1) * OUT));
  // res shifted by one row inside y: the epilogue would read rows it has already written.
  EXPECT_THROW(linear_fwd_res_cuda(ctx, y.get(), y.get() + OUT, x.get(), w.get(), T, IN, OUT),
               Error);
}
