// CUDA fused LM-head cross-entropy vs cross_entropy_fused_cpu (bf16 head, fp32 hidden rounded to
// bf16): V not a multiple of any tile, chunks that do not divide R, zero-weight rows with garbage
// labels, guard bytes, deterministic sums; blocks whose first row is skipped (skip_first_of).
#include <cmath>
#include <random>
#include <tuple>
#include <utility>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/cross_entropy.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

// cross_entropy_fused_cpu on the bf16 hidden states (as fp32): d_hidden, lse, argmax and sums.
struct CpuCe {
  std::vector<float> dh, lse;
  std::vector<int32_t> argmax;
  CrossEntropyStats st;
};
CpuCe cpu_ce(const std::vector<uint16_t>& hidden, const std::vector<uint16_t>& head,
             const std::vector<int32_t>& labels, const std::vector<float>& weights,
             const FusedCeParams& p) {
  CpuCe c{std::vector<float>(static_cast<size_t>(p.R * p.H)),
          std::vector<float>(static_cast<size_t>(p.R)),
          std::vector<int32_t>(static_cast<size_t>(p.R)), {}};
  const auto hf = from_bf16(hidden);
  c.st = cross_entropy_fused_cpu(c.dh.data(), c.lse.data(), c.argmax.data(), nullptr, hf.data(),
                                 head.data(), labels.data(), weights.data(), p);
  return c;
}

// Random bf16 hidden states [R, H] and LM head [V, H]; row r's label and weight from
// row(r, a random label in [0, V)).
struct Inputs {
  std::vector<uint16_t> hidden, head;
  std::vector<int32_t> labels;
  std::vector<float> weights;
};
template <class Row>
Inputs make_inputs(int64_t R, int64_t H, int64_t V, uint32_t seed, Row row) {
  Inputs in{to_bf16(randn(static_cast<size_t>(R * H), seed)),
            to_bf16(randn(static_cast<size_t>(V * H), seed + 1, 0.2f)),
            std::vector<int32_t>(static_cast<size_t>(R)), std::vector<float>(static_cast<size_t>(R))};
  std::mt19937 rng(seed + 2);
  for (int64_t r = 0; r < R; ++r) {
    const auto [label, weight] = row(r, static_cast<int32_t>(rng() % V));
    in.labels[static_cast<size_t>(r)] = label;
    in.weights[static_cast<size_t>(r)] = weight;
  }
  return in;
}

void run(int64_t R, int64_t H, int64_t V, int64_t chunk, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "R=" << R << " H=" << H << " V=" << V << " chunk=" << chunk);
  cuda::CudaContext ctx(0);
  const auto [hidden, head, labels, weights] =
      make_inputs(R, H, V, seed, [&](int64_t r, int32_t label) {
        const bool pad = R > 1 && r % 5 == 3;
        return std::pair{pad ? -77 : label,
                         pad ? 0.0f : std::exp(-static_cast<float>(r % 16) / 7.0f)};
      });
  FusedCeParams p{R, H, V, chunk, 0.37};
  const CpuCe ref = cpu_ce(hidden, head, labels, weights, p);
  const auto& [dh_ref, lse_ref, am_ref, st] = ref;

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

namespace {

// skip_first_of K: blocks of K rows whose first row (weight 0, garbage label) never enters the
// LM head. Against the CPU fused CE over every row and against the CUDA CE without skipping: the
// same sums, gradient and head rows' lse/argmax; a skipped row has d_hidden 0, lse NaN, argmax −1.
void run_skip(int64_t blocks, int64_t K, int64_t H, int64_t V, int64_t chunk, uint32_t seed) {
  const int64_t R = blocks * K;
  SCOPED_TRACE(::testing::Message() << "blocks=" << blocks << " K=" << K << " H=" << H
                                    << " V=" << V << " chunk=" << chunk);
  cuda::CudaContext ctx(0);
  const auto [hidden, head, labels, weights] =
      make_inputs(R, H, V, seed, [&](int64_t r, int32_t label) {
        const bool anchor = r % K == 0, pad = r % 7 == 5;
        return std::pair{anchor ? static_cast<int32_t>(V + 9) : pad ? -3 : label,
                         anchor || pad ? 0.0f : 0.5f + static_cast<float>(r % 3)};
      });
  FusedCeParams p{R, H, V, chunk, 0.61};
  const CpuCe ref = cpu_ce(hidden, head, labels, weights, p);
  const auto& [dh_ref, lse_ref, am_ref, st] = ref;
  DeviceGuarded<uint16_t> dhid(hidden), dhead(head);
  DeviceGuarded<int32_t> dlab(labels);
  DeviceGuarded<float> dw(weights);
  auto fused = [&](const FusedCeParams& q, bool skip_ws) {
    DeviceGuarded<float> dh(static_cast<size_t>(R * H)), lse(static_cast<size_t>(R)),
        loss(static_cast<size_t>(R));
    DeviceGuarded<int32_t> am(static_cast<size_t>(R));
    DeviceGuarded<double> sums(2);
    // Once with the caller's workspace of exactly the documented size, once from scratch.
    const uint64_t bytes = cross_entropy_fused_cuda_workspace_bytes(q, true, false);
    DeviceGuarded<uint8_t> ws(skip_ws ? 0 : static_cast<size_t>(bytes));
    cross_entropy_fused_cuda(ctx, dh.get(), lse.get(), am.get(), loss.get(), sums.get(),
                             dhid.get(), dhead.get(), dlab.get(), dw.get(), q,
                             skip_ws ? nullptr : ws.get(), skip_ws ? 0 : bytes);
    EXPECT_TRUE(dh.guard_intact() && lse.guard_intact() && loss.guard_intact() &&
                am.guard_intact() && sums.guard_intact() && ws.guard_intact());
    return std::make_tuple(dh.download(), lse.download(), am.download(), loss.download(),
                           sums.download());
  };
  FusedCeParams q = p;
  q.skip_first_of = K;
  const auto [dh, lse, am, loss, s] = fused(q, false);
  const auto [dh0, lse0, am0, loss0, s0] = fused(p, true);
  EXPECT_NEAR(s[0], st.loss_sum, tol::kCeLoss * std::abs(st.loss_sum));
  EXPECT_EQ(s[1], s0[1]);
  EXPECT_NEAR(s[0], s0[0], tol::kCeLoss * std::abs(s0[0]));
  EXPECT_LT(rel_error(dh, dh_ref), tol::kCeGrad);
  for (int64_t r = 0; r < R; ++r) {
    const auto i = static_cast<size_t>(r);
    if (r % K == 0) {
      EXPECT_EQ(am[i], -1) << "row " << r;
      EXPECT_TRUE(std::isnan(lse[i])) << "row " << r;
      EXPECT_EQ(loss[i], 0.0f) << "row " << r;
      for (int64_t c = 0; c < H; ++c) ASSERT_EQ(dh[i * H + c], 0.0f) << "row " << r;
    } else {
      EXPECT_EQ(am[i], am_ref[i]) << "row " << r;
      EXPECT_NEAR(lse[i], lse_ref[i], tol::kLse * (1 + std::abs(lse_ref[i]))) << "row " << r;
      EXPECT_NEAR(loss[i], loss0[i], 1e-5f * (1 + std::abs(loss0[i]))) << "row " << r;
    }
  }
  // Deterministic: a second run, from the context's scratch, gives the same bits.
  const auto [dh2, lse2, am2, loss2, s2] = fused(q, true);
  EXPECT_TRUE(same_bits(dh2, dh) && same_bits(s2, s) && same_bits(loss2, loss) && am2 == am);
  // The drafter's layout (no row_loss, lse or argmax: the per-row loss in the workspace, sized
  // exactly) and the forward alone (no d_hidden) give the same bits.
  for (const bool grad : {true, false}) {
    SCOPED_TRACE(grad ? "row_loss in the workspace" : "forward only");
    const uint64_t bytes = cross_entropy_fused_cuda_workspace_bytes(q, grad, false);
    DeviceGuarded<uint8_t> ws(static_cast<size_t>(bytes));
    DeviceGuarded<float> dh3(static_cast<size_t>(R * H));
    DeviceGuarded<double> sums(2);
    cross_entropy_fused_cuda(ctx, grad ? dh3.get() : nullptr, nullptr, nullptr, nullptr,
                             sums.get(), dhid.get(), dhead.get(), dlab.get(), dw.get(), q,
                             ws.get(), bytes);
    EXPECT_TRUE(same_bits(sums.download(), s));
    if (grad) {
      EXPECT_TRUE(same_bits(dh3.download(), dh));
    }
    EXPECT_TRUE(ws.guard_intact() && dh3.guard_intact() && sums.guard_intact());
  }
}

}  // namespace

TEST(CrossEntropyCuda, SkipFirstOfEachBlock) {
  DFLASH_REQUIRE_GPU();
  run_skip(7, 5, 72, 1001, 12, 11);   // 16-byte gather and scatter; 4 chunks, the last of 1 block
  run_skip(7, 5, 36, 1024, 3, 12);    // scalar gather (H % 8 ≠ 0); chunk < K: 1 block a chunk
  run_skip(3, 16, 42, 517, 64, 13);   // both scalar; one chunk of every block
  run_skip(1, 2, 64, 300, 1, 14);     // K 2: one head row a block
}

TEST(CrossEntropyCuda, SkipFirstOfRefusesBadShapesAndFlagsAWeightedSkippedRow) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t K = 4, R = 8, H = 64, V = 257;
  const auto hidden = to_bf16(randn(static_cast<size_t>(R * H), 21));
  const auto head = to_bf16(randn(static_cast<size_t>(V * H), 22, 0.2f));
  std::vector<int32_t> labels(static_cast<size_t>(R), 5);
  std::vector<float> weights(static_cast<size_t>(R), 1.0f);
  DeviceGuarded<uint16_t> dhid(hidden), dhead(head);
  DeviceGuarded<int32_t> dlab(labels);
  DeviceGuarded<float> dw(weights);
  DeviceGuarded<double> sums(2);
  FusedCeParams p{R - 1, H, V, 4, 1.0};
  p.skip_first_of = K;  // R − 1 is not a multiple of K
  EXPECT_THROW(cross_entropy_fused_cuda(ctx, nullptr, nullptr, nullptr, nullptr, sums.get(),
                                        dhid.get(), dhead.get(), dlab.get(), dw.get(), p),
               Error);
  p.R = R;  // null weights would mean weight 1 on the skipped rows
  EXPECT_THROW(cross_entropy_fused_cuda(ctx, nullptr, nullptr, nullptr, nullptr, sums.get(),
                                        dhid.get(), dhead.get(), dlab.get(), nullptr, p),
               Error);
  // Weight 1 on the skipped rows: their loss is NaN, so the step's loss is.
  cross_entropy_fused_cuda(ctx, nullptr, nullptr, nullptr, nullptr, sums.get(), dhid.get(),
                           dhead.get(), dlab.get(), dw.get(), p);
  EXPECT_TRUE(std::isnan(sums.download()[0]));
}
