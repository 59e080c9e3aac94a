// CUDA mixture-of-experts ops (ops/moe.hpp) against their CPU references on the same values (bf16
// inputs rounded first): routing of both HF routers (ids identical, weights to fp32 rounding),
// the dispatch layout bit for bit (stable, empty experts), gather, the grouped tensor-core GEMM
// (f32 and bf16 outputs, row strides, odd row counts and widths that are not multiples of any
// tile, experts without rows, determinism), both gated activations with per-expert biases, the
// accumulating combine, and a whole sparse block; guard regions after every output.
#include <algorithm>
#include <numeric>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/moe.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

// Random expert ids [T, K]: K distinct experts per token from [0, E), expert `skip` never used.
std::vector<int32_t> random_ids(int64_t T, int64_t K, int64_t E, int64_t skip, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids;
  std::vector<int32_t> all;
  for (int32_t e = 0; e < E; ++e)
    if (e != skip) all.push_back(e);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + K);
  }
  return ids;
}

struct Layout {
  std::vector<int32_t> perm, slot, offsets, row_expert;
};
Layout cpu_layout(const std::vector<int32_t>& ids, int64_t T, int64_t K, int64_t E) {
  Layout l{std::vector<int32_t>(ids.size()), std::vector<int32_t>(ids.size()),
           std::vector<int32_t>(static_cast<size_t>(E + 1)), std::vector<int32_t>(ids.size())};
  moe_dispatch_cpu(l.perm.data(), l.slot.data(), l.offsets.data(), l.row_expert.data(), ids.data(),
                   T, K, E);
  return l;
}

}  // namespace

TEST(MoeCuda, RoutingMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (const auto& [T, E, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 2},
                                {17, 8, 2},
                                {129, 128, 8},
                                {1000, 32, 4},
                                {33, 300, 5}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T << " E=" << E << " K=" << K);
    auto logits = randn(static_cast<size_t>(T * E), static_cast<uint32_t>(T + E));
    logits[0] = logits[1];  // a tie: the lower expert comes first on both backends
    for (MoeRoutingMode mode : {MoeRoutingMode::softmax_topk, MoeRoutingMode::topk_softmax}) {
      for (bool norm : {false, true}) {
        const MoeRouting r{mode, K, norm};
        std::vector<int32_t> ids(static_cast<size_t>(T * K));
        std::vector<float> w(ids.size());
        moe_route_cpu(ids.data(), w.data(), logits.data(), T, E, r);
        DeviceGuarded<float> dl(logits);
        DeviceGuarded<int32_t> did(ids.size());
        DeviceGuarded<float> dw(w.size());
        moe_route_cuda(ctx, did.get(), dw.get(), dl.get(), T, E, r);
        EXPECT_EQ(did.download(), ids);
        EXPECT_LT(rel_error(dw.download(), w), tol::kF32);
        EXPECT_TRUE(did.guard_intact() && dw.guard_intact());
      }
    }
  }
}

TEST(MoeCuda, DispatchLayoutIsTheCpuLayoutBitForBit) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (const auto& [T, K, E] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 3},
                                {17, 2, 8},
                                {1000, 8, 128},
                                {4097, 4, 32}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T << " K=" << K << " E=" << E);
    const auto ids = random_ids(T, K, E, E / 2, static_cast<uint32_t>(T));
    const Layout want = cpu_layout(ids, T, K, E);
    DeviceGuarded<int32_t> dids(ids), perm(ids.size()), slot(ids.size()), rexp(ids.size()),
        off(static_cast<size_t>(E + 1));
    moe_dispatch_cuda(ctx, perm.get(), slot.get(), off.get(), rexp.get(), dids.get(), T, K, E);
    EXPECT_EQ(off.download(), want.offsets);
    EXPECT_EQ(perm.download(), want.perm);
    EXPECT_EQ(slot.download(), want.slot);
    EXPECT_EQ(rexp.download(), want.row_expert);
    EXPECT_TRUE(perm.guard_intact() && slot.guard_intact() && rexp.guard_intact() &&
                off.guard_intact());
  }
}

TEST(MoeCuda, GatherCopiesTheRowsOfEachPair) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (int64_t H : {64, 30}) {  // vector and scalar paths
    const int64_t T = 37, K = 3, E = 6, R = T * K;
    const auto ids = random_ids(T, K, E, -1, 5);
    const Layout l = cpu_layout(ids, T, K, E);
    const auto x = to_bf16(randn(static_cast<size_t>(T * H), 6));
    std::vector<uint16_t> want(static_cast<size_t>(R * H));
    for (int64_t r = 0; r < R; ++r)
      std::copy_n(x.begin() + (l.perm[static_cast<size_t>(r)] / K) * H, H, want.begin() + r * H);
    DeviceGuarded<uint16_t> dx(x), xs(want.size());
    DeviceGuarded<int32_t> perm(l.perm);
    moe_gather_cuda(ctx, xs.get(), dx.get(), perm.get(), R, K, H);
    EXPECT_EQ(xs.download(), want) << "H=" << H;
    EXPECT_TRUE(xs.guard_intact());
  }
}

namespace {

void grouped_case(int64_t E, const std::vector<int32_t>& counts, int64_t IN, int64_t OUT,
                  int64_t LDY, uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "E=" << E << " IN=" << IN << " OUT=" << OUT << " LDY=" << LDY);
  cuda::CudaContext ctx(0);
  std::vector<int32_t> off(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
  const int64_t R = off[E];
  const auto x = to_bf16(randn(static_cast<size_t>(R * IN), seed));
  const auto w = to_bf16(randn(static_cast<size_t>(E * OUT * IN), seed + 1, 0.1f));
  const auto xf = from_bf16(x);
  std::vector<const uint16_t*> hp;
  for (int64_t e = 0; e < E; ++e) hp.push_back(w.data() + e * OUT * IN);
  // The CPU reference fills columns [0, OUT) of each row; the rest keeps its start value, as the
  // device output must.
  std::vector<float> want(static_cast<size_t>(R * LDY), 0.0f);
  moe_grouped_linear_cpu(want.data(), LDY, xf.data(), hp.data(), off.data(), E, R, IN, OUT);

  DeviceGuarded<uint16_t> dx(x), dw(w);
  std::vector<const uint16_t*> dp;
  for (int64_t e = 0; e < E; ++e) dp.push_back(dw.get() + e * OUT * IN);
  DeviceGuarded<const uint16_t*> dptr(dp);
  DeviceGuarded<int32_t> doff(off);
  DeviceGuarded<float> y32(std::vector<float>(want.size(), 0.0f));
  DeviceGuarded<uint16_t> y16(std::vector<uint16_t>(want.size(), 0));
  moe_grouped_linear_cuda(ctx, y32.get(), LDY, dx.get(), dptr.get(), doff.get(), E, R, IN, OUT);
  moe_grouped_linear_cuda(ctx, y16.get(), LDY, dx.get(), dptr.get(), doff.get(), E, R, IN, OUT);
  const auto g32 = y32.download();
  EXPECT_LT(rel_error(g32, want), tol::kGemmF32);
  EXPECT_LT(rel_error(from_bf16(y16.download()), want), tol::kGemmBf16);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = OUT; c < LDY; ++c) ASSERT_EQ(g32[r * LDY + c], 0.0f) << "column " << c;
  EXPECT_TRUE(y32.guard_intact() && y16.guard_intact());
  // Deterministic: a second run gives the same bits.
  moe_grouped_linear_cuda(ctx, y32.get(), LDY, dx.get(), dptr.get(), doff.get(), E, R, IN, OUT);
  EXPECT_TRUE(same_bits(y32.download(), g32));
}

}  // namespace

TEST(MoeCuda, GroupedLinearMatchesPerExpertCpuGemms) {
  DFLASH_REQUIRE_GPU();
  grouped_case(1, {1}, 8, 1, 1, 1);
  grouped_case(5, {17, 0, 1, 129, 64}, 40, 7, 9, 2);  // an empty expert, tails everywhere
  grouped_case(3, {1000, 3, 65}, 264, 130, 130, 3);
  grouped_case(8, {100, 200, 0, 0, 300, 5, 64, 1}, 2048, 768 * 2, 768 * 2, 4);
  grouped_case(4, {513, 0, 77, 250}, 768, 2048, 2048, 5);
}

TEST(MoeCuda, GatedActivationsMatchCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t R = 301, I = 77, E = 5;
  std::vector<int32_t> rexp(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) rexp[r] = static_cast<int32_t>((r * 7) % E);
  const auto gu = round_bf16(randn(static_cast<size_t>(R * 2 * I), 8, 4.0f));  // past ±7 at times
  const auto bg = randn(static_cast<size_t>(E * I), 9, 0.5f), bu = randn(bg.size(), 10, 0.5f);
  for (MoeActivation act : {MoeActivation::swiglu, MoeActivation::clamped_swiglu}) {
    for (bool biased : {false, true}) {
      const MoeGlu glu{act, 1.702f, 7.0f};
      std::vector<float> want(static_cast<size_t>(R * I));
      moe_glu_cpu(want.data(), gu.data(), gu.data() + I, 2 * I, biased ? bg.data() : nullptr,
                  biased ? bu.data() : nullptr, rexp.data(), R, I, glu);
      DeviceGuarded<uint16_t> dgu(to_bf16(gu)), y(want.size());
      DeviceGuarded<float> dgu32(gu), dbg(bg), dbu(bu);
      DeviceGuarded<int32_t> dre(rexp);
      moe_glu_cuda(ctx, y.get(), dgu.get(), dgu.get() + I, 2 * I, biased ? dbg.get() : nullptr,
                   biased ? dbu.get() : nullptr, dre.get(), R, I, glu);
      EXPECT_LT(rel_error(from_bf16(y.download()), want), tol::kBf16);
      moe_glu_cuda(ctx, y.get(), dgu32.get(), dgu32.get() + I, 2 * I, biased ? dbg.get() : nullptr,
                   biased ? dbu.get() : nullptr, dre.get(), R, I, glu);
      EXPECT_LT(rel_error(from_bf16(y.download()), want), tol::kBf16);
      EXPECT_TRUE(y.guard_intact());
    }
  }
}

TEST(MoeCuda, CombineAccumulatesLikeCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t T = 129, K = 3, E = 7, H = 96;
  const auto ids = random_ids(T, K, E, -1, 11);
  const Layout l = cpu_layout(ids, T, K, E);
  const auto w = randn(ids.size(), 12), ys = randn(static_cast<size_t>(T * K * H), 13);
  const auto bias = randn(static_cast<size_t>(E * H), 14),
             y0 = randn(static_cast<size_t>(T * H), 15);
  for (bool biased : {false, true}) {
    std::vector<float> want = y0;
    moe_combine_cpu(want.data(), ys.data(), biased ? bias.data() : nullptr, ids.data(), w.data(),
                    l.slot.data(), T, K, H);
    DeviceGuarded<float> y(y0), dys(ys), db(bias), dw(w);
    DeviceGuarded<int32_t> did(ids), dslot(l.slot);
    moe_combine_cuda(ctx, y.get(), dys.get(), biased ? db.get() : nullptr, did.get(), dw.get(),
                     dslot.get(), T, K, H);
    EXPECT_LT(rel_error(y.download(), want), tol::kF32);
    EXPECT_TRUE(y.guard_intact());
  }
}

// The whole device pipeline of one sparse block against the CPU pipeline on the same bf16 input:
// identical routing (the logits are the same fp32 values), outputs within the bf16 GEMM rows.
TEST(MoeCuda, SparseBlockMatchesCpuPipeline) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t T = 333, H = 256, E = 16, K = 4, EI = 96, R = T * K;
  const auto x = round_bf16(randn(static_cast<size_t>(T * H), 21));
  const auto logits = randn(static_cast<size_t>(T * E), 22, 2.0f);
  const auto wgu = to_bf16(randn(static_cast<size_t>(E * 2 * EI * H), 23, 0.06f));
  const auto wd = to_bf16(randn(static_cast<size_t>(E * H * EI), 24, 0.1f));
  const MoeRouting route{MoeRoutingMode::topk_softmax, K, false};
  const MoeGlu glu{MoeActivation::clamped_swiglu, 1.702f, 7.0f};
  // CPU.
  std::vector<int32_t> ids(static_cast<size_t>(R));
  std::vector<float> w(ids.size());
  moe_route_cpu(ids.data(), w.data(), logits.data(), T, E, route);
  const Layout l = cpu_layout(ids, T, K, E);
  std::vector<float> xs(static_cast<size_t>(R * H)), gu(static_cast<size_t>(R * 2 * EI));
  std::vector<float> act(static_cast<size_t>(R * EI)), ys(static_cast<size_t>(R * H));
  moe_gather_cpu(xs.data(), x.data(), l.perm.data(), R, K, H);
  std::vector<const uint16_t*> hgu, hd;
  for (int64_t e = 0; e < E; ++e) {
    hgu.push_back(wgu.data() + e * 2 * EI * H);
    hd.push_back(wd.data() + e * H * EI);
  }
  moe_grouped_linear_cpu(gu.data(), 2 * EI, xs.data(), hgu.data(), l.offsets.data(), E, R, H,
                         2 * EI);
  moe_glu_cpu(act.data(), gu.data(), gu.data() + EI, 2 * EI, nullptr, nullptr, l.row_expert.data(),
              R, EI, glu);
  moe_grouped_linear_cpu(ys.data(), H, act.data(), hd.data(), l.offsets.data(), E, R, EI, H);
  std::vector<float> want(static_cast<size_t>(T * H), 0.0f);
  moe_combine_cpu(want.data(), ys.data(), nullptr, ids.data(), w.data(), l.slot.data(), T, K, H);
  // GPU.
  DeviceGuarded<uint16_t> dx(to_bf16(x)), dwgu(wgu), dwd(wd), dxs(xs.size()), dgu(gu.size()),
      dact(act.size());
  DeviceGuarded<float> dl(logits), dw(w.size()), dys(ys.size()),
      dy(std::vector<float>(want.size(), 0.0f));
  DeviceGuarded<int32_t> did(ids.size()), perm(ids.size()), slot(ids.size()), rexp(ids.size()),
      off(static_cast<size_t>(E + 1));
  std::vector<const uint16_t*> pgu, pd;
  for (int64_t e = 0; e < E; ++e) {
    pgu.push_back(dwgu.get() + e * 2 * EI * H);
    pd.push_back(dwd.get() + e * H * EI);
  }
  DeviceGuarded<const uint16_t*> dpgu(pgu), dpd(pd);
  moe_route_cuda(ctx, did.get(), dw.get(), dl.get(), T, E, route);
  moe_dispatch_cuda(ctx, perm.get(), slot.get(), off.get(), rexp.get(), did.get(), T, K, E);
  moe_gather_cuda(ctx, dxs.get(), dx.get(), perm.get(), R, K, H);
  moe_grouped_linear_cuda(ctx, dgu.get(), 2 * EI, dxs.get(), dpgu.get(), off.get(), E, R, H,
                          2 * EI);
  moe_glu_cuda(ctx, dact.get(), dgu.get(), dgu.get() + EI, 2 * EI, nullptr, nullptr, rexp.get(), R,
               EI, glu);
  moe_grouped_linear_cuda(ctx, dys.get(), H, dact.get(), dpd.get(), off.get(), E, R, EI, H);
  moe_combine_cuda(ctx, dy.get(), dys.get(), nullptr, did.get(), dw.get(), slot.get(), T, K, H);
  EXPECT_EQ(did.download(), ids);
  const double e = rel_error(dy.download(), want);
  EXPECT_LT(e, tol::kAttnBf16);
  EXPECT_TRUE(dy.guard_intact());
  std::printf("sparse block T=%lld E=%lld K=%lld: relative error %.3g\n", static_cast<long long>(T),
              static_cast<long long>(E), static_cast<long long>(K), e);
}
