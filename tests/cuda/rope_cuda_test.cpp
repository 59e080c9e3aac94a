// CUDA RoPE vs rope_fwd_cpu/rope_bwd_cpu for every scaling type (frequencies from rope_inv_freq),
// fp32 and bf16 storage, in place, packed positions that restart, guard bytes; the fused per-head
// RMSNorm + RoPE against the CPU (rmsnorm_fwd_cpu then rope_fwd_cpu) and, bit for bit, against
// rmsnorm_fwd_cuda then rope_fwd_cuda.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/rmsnorm.hpp"
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

// Fused per-head RMSNorm + RoPE at T tokens of NH heads of D (D odd multiples of 32 included).
void run_norm_rope(const RopeParams& rp, int64_t T, int64_t NH, int64_t D, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "norm+rope T=" << T << " NH=" << NH << " D=" << D);
  cuda::CudaContext ctx(0);
  const double eps = 1e-6;
  const auto inv64 = rope_inv_freq(rp, D);
  std::vector<float> inv(inv64.begin(), inv64.end());
  const float scaling = static_cast<float>(rope_attention_scaling(rp));
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    pos[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7) % 1500);
  const size_t n = static_cast<size_t>(T * NH * D);
  const auto x = randn(n, seed, 3.0f), w = randn(static_cast<size_t>(D), seed + 1);
  DeviceGuarded<float> dinv(inv), dw(w);
  DeviceGuarded<int32_t> dpos(pos);
  // fp32 against the CPU.
  std::vector<float> normed(n), ref(n);
  rmsnorm_fwd_cpu(normed.data(), nullptr, x.data(), w.data(), T * NH, D, eps);
  rope_fwd_cpu(ref.data(), normed.data(), pos.data(), inv.data(), scaling, T, NH, D);
  DeviceGuarded<float> fx(x), fy(n);
  rmsnorm_rope_fwd_cuda(ctx, fy.get(), fx.get(), dw.get(), dpos.get(), dinv.get(), scaling, T, NH,
                        D, eps);
  EXPECT_LT(rel_error(fy.download(), ref), tol::kF32);
  EXPECT_TRUE(fy.guard_intact() && fx.guard_intact());
  // bf16 in place against the CPU on the bf16-rounded normed rows, and against the two kernels.
  const auto xb = to_bf16(x);
  std::vector<float> nb(n), refb(n);
  rmsnorm_fwd_cpu(nb.data(), nullptr, from_bf16(xb).data(), w.data(), T * NH, D, eps);
  nb = round_bf16(nb);
  rope_fwd_cpu(refb.data(), nb.data(), pos.data(), inv.data(), scaling, T, NH, D);
  DeviceGuarded<uint16_t> fused(xb), chain(xb);
  rmsnorm_rope_fwd_cuda(ctx, fused.get(), fused.get(), dw.get(), dpos.get(), dinv.get(), scaling, T,
                        NH, D, eps);
  rmsnorm_fwd_cuda(ctx, chain.get(), static_cast<float*>(nullptr), chain.get(), dw.get(), T * NH, D,
                   eps);
  rope_fwd_cuda(ctx, chain.get(), chain.get(), dpos.get(), dinv.get(), scaling, T, NH, D);
  EXPECT_LT(rel_error(from_bf16(fused.download()), refb), tol::kBf16);
  EXPECT_TRUE(same_bits(fused.download(), chain.download()));
  EXPECT_TRUE(fused.guard_intact() && chain.guard_intact());
}

}  // namespace

TEST(RopeCuda, NormThenRopeFused) {
  DFLASH_REQUIRE_GPU();
  RopeParams standard;
  standard.theta = 1e6;
  RopeParams yarn;
  yarn.type = RopeType::yarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 32768;
  run_norm_rope(standard, 1, 1, 128, 11);
  run_norm_rope(standard, 17, 3, 64, 12);
  run_norm_rope(standard, 129, 8, 128, 13);
  run_norm_rope(yarn, 1000, 2, 96, 14);    // D/2 = 48: lanes with one pair and with two
  run_norm_rope(standard, 33, 5, 16, 15);  // D/2 = 8 < 32: idle lanes
}

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
