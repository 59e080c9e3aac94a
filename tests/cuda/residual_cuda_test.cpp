// CUDA residual adds and f32 <-> bf16 casts vs the CPU: residual_fwd/accumulate/bwd (fp32 exact,
// mixed f32 += bf16), casts bit-identical to f32_to_bf16_bits (ties, NaN sign, ±Inf, subnormals),
// guard bytes.
#include <cmath>
#include <limits>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/cast.hpp"
#include "ops/residual.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

TEST(ResidualCuda, MatchesCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (int64_t n : {1, 17, 129 * 1000}) {
    const auto a = randn(static_cast<size_t>(n), 1), b = randn(static_cast<size_t>(n), 2);
    std::vector<float> y_ref(a.size());
    residual_fwd_cpu(y_ref.data(), a.data(), b.data(), n);
    DeviceGuarded<float> da(a), db(b), y(a.size());
    residual_fwd_cuda(ctx, y.get(), da.get(), db.get(), n);
    EXPECT_EQ(y.download(), y_ref);  // one fp32 add: exact
    residual_accumulate_cuda(ctx, da.get(), db.get(), n);
    EXPECT_EQ(da.download(), y_ref);
    // f32 stream += bf16 branch
    const auto bb = to_bf16(b);
    const auto br = from_bf16(bb);
    std::vector<float> acc_ref = a;
    residual_accumulate_cpu(acc_ref.data(), br.data(), n);
    DeviceGuarded<float> s(a);
    DeviceGuarded<uint16_t> dbb(bb);
    residual_accumulate_cuda(ctx, s.get(), dbb.get(), n);
    EXPECT_EQ(s.download(), acc_ref);
    // backward: two copies
    DeviceGuarded<float> ga(a.size()), gb(a.size());
    residual_bwd_cuda(ctx, ga.get(), gb.get(), db.get(), n);
    EXPECT_EQ(ga.download(), b);
    EXPECT_EQ(gb.download(), b);
    EXPECT_TRUE(y.guard_intact() && da.guard_intact() && s.guard_intact() && ga.guard_intact() &&
                gb.guard_intact());
  }
}

TEST(CastCuda, BitIdenticalToCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  std::vector<float> x = randn(1001, 3, 100.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (float special : {0.0f, -0.0f, inf, -inf, std::nanf(""), -std::nanf(""), 1.0039062f,
                        1.01171875f, 3.0e38f, 1e-40f, -1e-45f})
    x.push_back(special);
  // exact ties: 1 + 2^-8 (round down to even) and 1 + 3·2^-8 (round up to even)
  x.push_back(1.00390625f);
  x.push_back(1.01171875f);
  const int64_t n = static_cast<int64_t>(x.size());
  DeviceGuarded<float> dx(x);
  DeviceGuarded<uint16_t> b(x.size());
  cast_cuda(ctx, b.get(), dx.get(), n);
  const auto bits = b.download();
  EXPECT_EQ(bits, to_bf16(x));
  DeviceGuarded<float> back(x.size());
  cast_cuda(ctx, back.get(), b.get(), n);
  const auto bf = back.download();
  const auto ref = from_bf16(bits);
  EXPECT_TRUE(same_bits(bf, ref));
  EXPECT_TRUE(b.guard_intact() && back.guard_intact());
}
