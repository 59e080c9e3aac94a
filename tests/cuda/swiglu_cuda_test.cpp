// CUDA SwiGLU vs swiglu_fwd_cpu/swiglu_bwd_cpu: fused [T, 2I] gate|up (ld_in = 2I) and separate
// arrays (ld_in = I), fp32 and bf16, guard bytes; the bf16 vector path (I and ld multiples of 8,
// 16-byte aligned rows) against the scalar path (the same data one element off alignment), bit for
// bit.
#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/swiglu.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

void run(int64_t T, int64_t I, bool fused, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " I=" << I << " fused=" << fused);
  cuda::CudaContext ctx(0);
  const int64_t ld = fused ? 2 * I : I;
  const auto in = randn(static_cast<size_t>(T * 2 * I), seed, 2.0f);  // gate rows then up rows
  const size_t up_off = fused ? static_cast<size_t>(I) : static_cast<size_t>(T * I);
  const auto dy = randn(static_cast<size_t>(T * I), seed + 1);
  std::vector<float> y_ref(static_cast<size_t>(T * I)), dg_ref(in.size()), du_ref(in.size());
  swiglu_fwd_cpu(y_ref.data(), in.data(), in.data() + up_off, T, I, ld);
  swiglu_bwd_cpu(dg_ref.data(), dg_ref.data() + up_off, dy.data(), in.data(), in.data() + up_off,
                 T, I, ld);
  DeviceGuarded<float> din(in), ddy(dy), y(static_cast<size_t>(T * I)), dg(in.size());
  swiglu_fwd_cuda(ctx, y.get(), din.get(), din.get() + up_off, T, I, ld);
  swiglu_bwd_cuda(ctx, dg.get(), dg.get() + up_off, ddy.get(), din.get(), din.get() + up_off, T, I,
                  ld);
  EXPECT_LT(rel_error(y.download(), y_ref), tol::kF32);
  EXPECT_LT(rel_error(dg.download(), dg_ref), tol::kF32);
  EXPECT_TRUE(y.guard_intact() && dg.guard_intact());
  // bf16
  const auto inb = to_bf16(in), dyb = to_bf16(dy);
  const auto inr = from_bf16(inb), dyr = from_bf16(dyb);
  std::vector<float> yb_ref(static_cast<size_t>(T * I)), dgb_ref(in.size());
  swiglu_fwd_cpu(yb_ref.data(), inr.data(), inr.data() + up_off, T, I, ld);
  swiglu_bwd_cpu(dgb_ref.data(), dgb_ref.data() + up_off, dyr.data(), inr.data(),
                 inr.data() + up_off, T, I, ld);
  DeviceGuarded<uint16_t> bin(inb), bdy(dyb), by(static_cast<size_t>(T * I)), bdg(in.size());
  swiglu_fwd_cuda(ctx, by.get(), bin.get(), bin.get() + up_off, T, I, ld);
  swiglu_bwd_cuda(ctx, bdg.get(), bdg.get() + up_off, bdy.get(), bin.get(), bin.get() + up_off, T,
                  I, ld);
  EXPECT_LT(rel_error(from_bf16(by.download()), yb_ref), tol::kBf16);
  EXPECT_LT(rel_error(from_bf16(bdg.download()), dgb_ref), tol::kBf16);
  EXPECT_TRUE(by.guard_intact() && bdg.guard_intact());
}

}  // namespace

TEST(SwigluCuda, MatchesCpu) {
  DFLASH_REQUIRE_GPU();
  run(1, 7, true, 1);
  run(17, 129, false, 2);
  run(129, 1000, true, 3);
  run(1000, 256, false, 4);
}

TEST(SwigluCuda, VectorAndScalarPathsGiveTheSameBits) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t T = 33, I = 1024, ld = 2 * I;
  const size_t n = static_cast<size_t>(T * ld), ny = static_cast<size_t>(T * I);
  const auto in = to_bf16(randn(n, 21, 3.0f)), dy = to_bf16(randn(ny, 22));
  // The same values at offset 0 (vector path) and at offset 1 (scalar path).
  std::vector<uint16_t> in1(n + 1, 0), dy1(ny + 1, 0);
  std::copy(in.begin(), in.end(), in1.begin() + 1);
  std::copy(dy.begin(), dy.end(), dy1.begin() + 1);
  DeviceGuarded<uint16_t> a(in), ady(dy), ay(ny), adg(n);
  DeviceGuarded<uint16_t> b(in1), bdy(dy1), by(ny + 1), bdg(n + 1);
  swiglu_fwd_cuda(ctx, ay.get(), a.get(), a.get() + I, T, I, ld);
  swiglu_bwd_cuda(ctx, adg.get(), adg.get() + I, ady.get(), a.get(), a.get() + I, T, I, ld);
  swiglu_fwd_cuda(ctx, by.get() + 1, b.get() + 1, b.get() + 1 + I, T, I, ld);
  swiglu_bwd_cuda(ctx, bdg.get() + 1, bdg.get() + 1 + I, bdy.get() + 1, b.get() + 1,
                  b.get() + 1 + I, T, I, ld);
  auto from1 = [](std::vector<uint16_t> v) {
    return std::vector<uint16_t>(v.begin() + 1, v.end());
  };
  EXPECT_TRUE(same_bits(ay.download(), from1(by.download())));
  EXPECT_TRUE(same_bits(adg.download(), from1(bdg.download())));
  EXPECT_TRUE(ay.guard_intact() && adg.guard_intact() && by.guard_intact() && bdg.guard_intact());
}
