// CUDA fused LM-head cross-entropy vs cross_entropy_fused_cpu (bf16 head, fp32 hidden rounded to
// bf16): V not a multiple of any tile, chunks that do not divide R, zero-weight rows with garbage
// labels, guard bytes, deterministic sums.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/cross_entropy.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

void run(int64_t R, int64_t H, int64_t V, int64_t chunk, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "R=" << R << " H=" << H << " V=" << V << " chunk=" << chunk);
  cuda::CudaContext ctx(0);
  const auto hidden = to_bf16(randn(static_cast<size_t>(R * H), seed));
  const auto head = to_bf16(randn(static_cast<size_t>(V * H), seed + 1, 0.2f));
  std::vector<int32_t> labels(static_cast<size_t>(R));
  std::vector<float> weights(static_cast<size_t>(R));
  std::mt19937 rng(seed + 2);
  for (int64_t r = 0; r < R; ++r) {
    const bool pad = R > 1 && r % 5 == 3;
    labels[static_cast<size_t>(r)] = pad ? -77 : static_cast<int32_t>(rng() % V);
    weights[static_cast<size_t>(r)] = pad ? 0.0f : std::exp(-static_cast<float>(r % 16) / 7.0f);
  }
  FusedCeParams p{R, H, V, chunk, 0.37};
  const auto hf = from_bf16(hidden);
  std::vector<float> dh_ref(static_cast<size_t>(R * H)), lse_ref(static_cast<size_t>(R));
  std::vector<int32_t> am_ref(static_cast<size_t>(R));
  const CrossEntropyStats st =
      cross_entropy_fused_cpu(dh_ref.data(), lse_ref.data(), am_ref.data(), nullptr, hf.data(),
                              head.data(), labels.data(), weights.data(), p);

  DeviceGuarded<uint16_t> dhid(hidden), dhead(head);
  DeviceGuarded<int32_t> dlab(labels);
  DeviceGuarded<float> dw(weights);
  DeviceGuarded<float> dh(static_cast<size_t>(R * H)), lse(static_cast<size_t>(R)),
      loss(static_cast<size_t>(R));
  DeviceGuarded<int32_t> am(static_cast<size_t>(R));
  DeviceGuarded<double> sums(2);
  cross_entropy_fused_cuda(ctx, dh.get(), lse.get(), am.get(), loss.get(), sums.get(),
                           dhid.get(), dhead.get(), dlab.get(), dw.get(), p);
  const auto s = sums.download();
  EXPECT_NEAR(s[0], st.loss_sum, tol::kCeLoss * std::abs(st.loss_sum));
  EXPECT_NEAR(s[1], st.weight_sum, 1e-6 * st.weight_sum);
  EXPECT_LT(rel_error(lse.download(), lse_ref), tol::kLse);
  EXPECT_EQ(am.download(), am_ref);
  EXPECT_LT(rel_error(dh.download(), dh_ref), tol::kCeGrad);
  EXPECT_TRUE(dh.guard_intact() && lse.guard_intact() && loss.guard_intact() &&
              am.guard_intact() && sums.guard_intact());
  // Determinism of everything, and the forward-only path (no d_hidden) gives the same sums.
  const auto dh1 = dh.download();
  cross_entropy_fused_cuda(ctx, dh.get(), nullptr, nullptr, nullptr, sums.get(), dhid.get(),
                           dhead.get(), dlab.get(), dw.get(), p);
  EXPECT_TRUE(same_bits(dh.download(), dh1));
  EXPECT_TRUE(same_bits(sums.download(), s));
  cross_entropy_fused_cuda(ctx, nullptr, nullptr, nullptr, nullptr, sums.get(), dhid.get(),
                           dhead.get(), dlab.get(), dw.get(), p);
  EXPECT_TRUE(same_bits(sums.download(), s));
}

}  // namespace

TEST(CrossEntropyCuda, FusedMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  run(1, 64, 1000, 64, 1);
  run(17, 64, 1000, 7, 2);
  run(129, 128, 3001, 50, 3);
}

TEST(CrossEntropyCuda, NullWeightsMeanAllOnes) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t R = 9, H = 64, V = 517;
  const auto hidden = to_bf16(randn(static_cast<size_t>(R * H), 5));
  const auto head = to_bf16(randn(static_cast<size_t>(V * H), 6, 0.2f));
  std::vector<int32_t> labels(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) labels[static_cast<size_t>(r)] = static_cast<int32_t>(r * 31 % V);
  FusedCeParams p{R, H, V, 4, 1.0};
  const auto hf = from_bf16(hidden);
  const CrossEntropyStats st = cross_entropy_fused_cpu(
      nullptr, nullptr, nullptr, nullptr, hf.data(), head.data(), labels.data(), nullptr, p);
  DeviceGuarded<uint16_t> dhid(hidden), dhead(head);
  DeviceGuarded<int32_t> dlab(labels);
  DeviceGuarded<double> sums(2);
  cross_entropy_fused_cuda(ctx, nullptr, nullptr, nullptr, nullptr, sums.get(), dhid.get(),
                           dhead.get(), dlab.get(), nullptr, p);
  const auto s = sums.download();
  EXPECT_NEAR(s[0], st.loss_sum, tol::kCeLoss * st.loss_sum);
  EXPECT_EQ(s[1], static_cast<double>(R));
}
