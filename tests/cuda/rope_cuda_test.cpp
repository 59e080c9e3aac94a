// CUDA RoPE vs rope_fwd_cpu/rope_bwd_cpu for every scaling type (frequencies from rope_inv_freq),
// fp32 and bf16 storage, in place, packed positions that restart, guard bytes.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/rope.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

void run(const RopeParams& rp, int64_t T, int64_t NH, int64_t D, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "type=" << static_cast<int>(rp.type) << " T=" << T
                                    << " NH=" << NH << " D=" << D);
  cuda::CudaContext ctx(0);
  const auto inv64 = rope_inv_freq(rp, D);
  std::vector<float> inv(inv64.begin(), inv64.end());
  const float scaling = static_cast<float>(rope_attention_scaling(rp));
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(t < T / 2 ? t + 3000 : t - T / 2);
  const auto x = randn(static_cast<size_t>(T * NH * D), seed);
  std::vector<float> y_ref(x.size()), dx_ref(x.size());
  rope_fwd_cpu(y_ref.data(), x.data(), pos.data(), inv.data(), scaling, T, NH, D);
  rope_bwd_cpu(dx_ref.data(), x.data(), pos.data(), inv.data(), scaling, T, NH, D);
  DeviceGuarded<float> dinv(inv), dx_in(x), y(x.size()), gx(x.size());
  DeviceGuarded<int32_t> dpos(pos);
  rope_fwd_cuda(ctx, y.get(), dx_in.get(), dpos.get(), dinv.get(), scaling, T, NH, D);
  rope_bwd_cuda(ctx, gx.get(), dx_in.get(), dpos.get(), dinv.get(), scaling, T, NH, D);
  EXPECT_LT(rel_error(y.download(), y_ref), tol::kF32);
  EXPECT_LT(rel_error(gx.download(), dx_ref), tol::kF32);
  EXPECT_TRUE(y.guard_intact() && gx.guard_intact());
  // bf16, in place.
  const auto xb = to_bf16(x);
  const auto xr = from_bf16(xb);
  std::vector<float> yb_ref(x.size());
  rope_fwd_cpu(yb_ref.data(), xr.data(), pos.data(), inv.data(), scaling, T, NH, D);
  DeviceGuarded<uint16_t> bx(xb);
  rope_fwd_cuda(ctx, bx.get(), bx.get(), dpos.get(), dinv.get(), scaling, T, NH, D);
  EXPECT_LT(rel_error(from_bf16(bx.download()), yb_ref), tol::kBf16);
  EXPECT_TRUE(bx.guard_intact());
}

}  // namespace

TEST(RopeCuda, AllScalings) {
  DFLASH_REQUIRE_GPU();
  RopeParams standard;
  standard.theta = 1e6;
  RopeParams linear;
  linear.type = RopeType::linear;
  linear.factor = 4.0;
  RopeParams llama3;
  llama3.type = RopeType::llama3;
  llama3.theta = 500000;
  llama3.factor = 8.0;
  llama3.original_max_position_embeddings = 8192;
  RopeParams yarn;
  yarn.type = RopeType::yarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 32768;
  run(standard, 1, 1, 64, 1);
  run(standard, 17, 3, 128, 2);
  run(linear, 129, 4, 64, 3);
  run(llama3, 1000, 2, 128, 4);
  run(yarn, 129, 6, 128, 5);
}
