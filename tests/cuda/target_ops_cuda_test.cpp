// The CUDA pieces the target families need beyond the drafter's ops, against the CPU references on
// the same bf16-rounded values: sliding-window key ranges (bit for bit), attention with sinks over
// windowed ranges (o and lse; the backward with sink-including lse), and the biased linear
// (f32/bf16 outputs, bias added to every row, a null bias changes nothing).
#include <cmath>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/attention.hpp"
#include "ops/linear.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

std::vector<AttnRange> packed_causal(const std::vector<int32_t>& offsets) {
  const int64_t T = offsets.back();
  return attention_causal_varlen_ranges(offsets.data(), static_cast<int64_t>(offsets.size()) - 1,
                                        T);
}

bool same_ranges(const std::vector<AttnRange>& a, const std::vector<AttnRange>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].lo1 != b[i].lo1 || a[i].hi1 != b[i].hi1 || a[i].lo2 != b[i].lo2 ||
        a[i].hi2 != b[i].hi2)
      return false;
  return true;
}

}  // namespace

TEST(TargetOpsCuda, WindowRangesMatchCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const auto full = packed_causal({0, 1, 40, 300, 301, 1000});
  for (int64_t W : {1, 8, 128, 4096}) {
    std::vector<AttnRange> want(full.size());
    attention_window_ranges(want.data(), full.data(), static_cast<int64_t>(full.size()), W);
    DeviceGuarded<AttnRange> in(full), out(full.size());
    attention_window_ranges_cuda(ctx, out.get(), in.get(), static_cast<int64_t>(full.size()), W);
    EXPECT_TRUE(same_ranges(out.download(), want)) << "window " << W;
    EXPECT_TRUE(out.guard_intact());
    attention_window_ranges_cuda(ctx, in.get(), in.get(), static_cast<int64_t>(full.size()), W);
    EXPECT_TRUE(same_ranges(in.download(), want)) << "in place, window " << W;
  }
}

TEST(TargetOpsCuda, AttentionWithSinksOverWindowsMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (int64_t D : {64, 128}) {
    for (int64_t W : {0, 7, 128}) {  // 0: full causal
      SCOPED_TRACE(::testing::Message() << "D=" << D << " window=" << W);
      const int64_t NH = 8, NKV = 2;
      auto ranges = packed_causal({0, 17, 18, 300, 333});
      const int64_t T = static_cast<int64_t>(ranges.size());
      if (W) attention_window_ranges(ranges.data(), ranges.data(), T, W);
      const size_t nq = static_cast<size_t>(T * NH * D), nk = static_cast<size_t>(T * NKV * D);
      const auto q = to_bf16(randn(nq, 1)), k = to_bf16(randn(nk, 2)), v = to_bf16(randn(nk, 3));
      const auto dout = to_bf16(randn(nq, 4));
      const std::vector<float> sinks = {-3.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f, 4.0f, 9.0f};
      AttnParams p{T, T, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
      const auto qf = from_bf16(q), kf = from_bf16(k), vf = from_bf16(v), df = from_bf16(dout);
      std::vector<float> o_ref(nq), lse_ref(static_cast<size_t>(NH * T));
      p.sinks = sinks.data();
      attention_fwd_cpu(o_ref.data(), lse_ref.data(), qf.data(), kf.data(), vf.data(),
                        ranges.data(), p);
      DeviceGuarded<uint16_t> dq(q), dk(k), dv(v), ddo(dout), o(nq);
      DeviceGuarded<float> ds(sinks), lse(static_cast<size_t>(NH * T));
      DeviceGuarded<AttnRange> dr(ranges);
      p.sinks = ds.get();
      attention_fwd_cuda(ctx, o.get(), lse.get(), dq.get(), dk.get(), dv.get(), dr.get(), p);
      const auto o_gpu = o.download();
      const auto lse_gpu = lse.download();
      EXPECT_LT(rel_error(from_bf16(o_gpu), o_ref), tol::kAttnBf16);
      EXPECT_LT(rel_error(lse_gpu, lse_ref), tol::kLse);
      EXPECT_TRUE(o.guard_intact() && lse.guard_intact());
      // The backward reads the sink-including lse; no gradient reaches the sinks.
      const auto of = from_bf16(o_gpu);
      std::vector<float> dq_ref(nq), dk_ref(nk), dv_ref(nk);
      p.sinks = sinks.data();
      attention_bwd_cpu(dq_ref.data(), dk_ref.data(), dv_ref.data(), df.data(), qf.data(),
                        kf.data(), vf.data(), of.data(), lse_gpu.data(), ranges.data(), p);
      DeviceGuarded<uint16_t> gq(nq), gk(nk), gv(nk);
      p.sinks = ds.get();
      attention_bwd_cuda(ctx, gq.get(), gk.get(), gv.get(), ddo.get(), dq.get(), dk.get(), dv.get(),
                         o.get(), lse.get(), dr.get(), p);
      EXPECT_LT(rel_error(from_bf16(gq.download()), dq_ref), tol::kAttnBf16);
      EXPECT_LT(rel_error(from_bf16(gk.download()), dk_ref), tol::kAttnBf16);
      EXPECT_LT(rel_error(from_bf16(gv.download()), dv_ref), tol::kAttnBf16);
    }
  }
}

TEST(TargetOpsCuda, LinearWithBiasMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (const auto& [T, IN, OUT] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 64, 96}, {17, 128, 40}, {1000, 256, 136}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T << " IN=" << IN << " OUT=" << OUT);
    const auto x = to_bf16(randn(static_cast<size_t>(T * IN), 1));
    const auto w = to_bf16(randn(static_cast<size_t>(OUT * IN), 2, 0.1f));
    const auto b = randn(static_cast<size_t>(OUT), 3, 2.0f);
    const auto xf = from_bf16(x);
    std::vector<float> want(static_cast<size_t>(T * OUT)), plain(want.size());
    linear_fwd_cpu(want.data(), xf.data(), w.data(), b.data(), T, IN, OUT);
    linear_fwd_cpu(plain.data(), xf.data(), w.data(), nullptr, T, IN, OUT);
    DeviceGuarded<uint16_t> dx(x), dw(w), y16(want.size());
    DeviceGuarded<float> db(b), y32(want.size());
    linear_fwd_cuda(ctx, y32.get(), dx.get(), dw.get(), db.get(), T, IN, OUT);
    linear_fwd_cuda(ctx, y16.get(), dx.get(), dw.get(), db.get(), T, IN, OUT);
    EXPECT_LT(rel_error(y32.download(), want), tol::kGemmF32);
    EXPECT_LT(rel_error(from_bf16(y16.download()), want), tol::kGemmBf16);
    linear_fwd_cuda(ctx, y32.get(), dx.get(), dw.get(), static_cast<const float*>(nullptr), T, IN,
                    OUT);
    EXPECT_LT(rel_error(y32.download(), plain), tol::kGemmF32);
    EXPECT_TRUE(y32.guard_intact() && y16.guard_intact());
  }
}
