// CUDA attention vs the CPU reference (fp32 on the same bf16-rounded inputs): causal varlen with
// GQA, the DFlash two-range training pattern (NaN in keys nobody sees), block verification over a
// KV cache; forward o and lse, backward dq/dk/dv; guard bytes; bit-reproducible backward.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/attention.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

struct Case {
  int64_t Tq, Tk, NH, NKV, D;
  std::vector<AttnRange> ranges;
  std::vector<int64_t> nan_keys;  // key rows no query sees: filled with NaN
};

void run_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "Tq=" << c.Tq << " Tk=" << c.Tk << " NH=" << c.NH
                                    << " NKV=" << c.NKV << " D=" << c.D);
  cuda::CudaContext ctx(0);
  AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, c.D, 1.0 / std::sqrt(static_cast<double>(c.D))};
  const size_t nq = static_cast<size_t>(c.Tq * c.NH * c.D), nk = static_cast<size_t>(c.Tk * c.NKV * c.D);
  auto q = to_bf16(randn(nq, seed)), k = to_bf16(randn(nk, seed + 1)),
       v = to_bf16(randn(nk, seed + 2)), dout = to_bf16(randn(nq, seed + 3));
  for (int64_t j : c.nan_keys)
    for (int64_t e = 0; e < c.NKV * c.D; ++e) {
      k[static_cast<size_t>(j * c.NKV * c.D + e)] = 0x7fc0;
      v[static_cast<size_t>(j * c.NKV * c.D + e)] = 0x7fc0;
    }
  // CPU reference on the widened bf16 values.
  const auto qf = from_bf16(q), kf = from_bf16(k), vf = from_bf16(v), dof = from_bf16(dout);
  std::vector<float> o_ref(nq), lse_ref(static_cast<size_t>(c.NH * c.Tq));
  attention_fwd_cpu(o_ref.data(), lse_ref.data(), qf.data(), kf.data(), vf.data(),
                    c.ranges.data(), p);

  DeviceGuarded<uint16_t> dq_(q), dk_(k), dv_(v), ddo(dout);
  DeviceGuarded<AttnRange> dr(c.ranges);
  DeviceGuarded<uint16_t> o(nq);
  DeviceGuarded<float> lse(static_cast<size_t>(c.NH * c.Tq));
  attention_fwd_cuda(ctx, o.get(), lse.get(), dq_.get(), dk_.get(), dv_.get(), dr.get(), p);
  const auto o_gpu = o.download();
  const auto lse_gpu = lse.download();
  EXPECT_LT(rel_error(from_bf16(o_gpu), o_ref), tol::kAttnBf16);
  // lse: compare finite entries; -inf must match exactly.
  std::vector<float> lg, lr;
  for (size_t i = 0; i < lse_ref.size(); ++i) {
    if (std::isinf(lse_ref[i])) {
      EXPECT_TRUE(std::isinf(lse_gpu[i]) && lse_gpu[i] < 0) << "row/head " << i;
    } else {
      lg.push_back(lse_gpu[i]);
      lr.push_back(lse_ref[i]);
    }
  }
  EXPECT_LT(rel_error(lg, lr), tol::kLse);
  EXPECT_TRUE(o.guard_intact());
  EXPECT_TRUE(lse.guard_intact());

  // Backward from the GPU forward's o and lse (the CPU gets the same o, widened).
  const auto of = from_bf16(o_gpu);
  std::vector<float> dq_ref(nq), dk_ref(nk), dv_ref(nk);
  attention_bwd_cpu(dq_ref.data(), dk_ref.data(), dv_ref.data(), dof.data(), qf.data(), kf.data(),
                    vf.data(), of.data(), lse_gpu.data(), c.ranges.data(), p);
  DeviceGuarded<uint16_t> gq(nq), gk(nk), gv(nk);
  attention_bwd_cuda(ctx, gq.get(), gk.get(), gv.get(), ddo.get(), dq_.get(), dk_.get(), dv_.get(),
                     o.get(), lse.get(), dr.get(), p);
  const auto dq1 = gq.download(), dk1 = gk.download(), dv1 = gv.download();
  // Rows of keys nobody sees have zero gradients on both sides; NaN keys must not leak.
  EXPECT_LT(rel_error(from_bf16(dq1), dq_ref), tol::kAttnBf16);
  EXPECT_LT(rel_error(from_bf16(dk1), dk_ref), tol::kAttnBf16);
  EXPECT_LT(rel_error(from_bf16(dv1), dv_ref), tol::kAttnBf16);
  EXPECT_TRUE(gq.guard_intact() && gk.guard_intact() && gv.guard_intact());
  // Determinism: a second backward gives the same bits.
  attention_bwd_cuda(ctx, gq.get(), gk.get(), gv.get(), ddo.get(), dq_.get(), dk_.get(), dv_.get(),
                     o.get(), lse.get(), dr.get(), p);
  EXPECT_TRUE(same_bits(gq.download(), dq1));
  EXPECT_TRUE(same_bits(gk.download(), dk1));
  EXPECT_TRUE(same_bits(gv.download(), dv1));
}

// Causal varlen over documents of the given lengths.
Case causal(const std::vector<int32_t>& lens, int64_t NH, int64_t NKV, int64_t D) {
  std::vector<int32_t> off{0};
  for (int32_t l : lens) off.push_back(off.back() + l);
  const int64_t T = off.back();
  Case c{T, T, NH, NKV, D, attention_causal_varlen_ranges(off.data(),
                                                          static_cast<int64_t>(lens.size()), T),
         {}};
  return c;
}

}  // namespace

TEST(AttentionCuda, CausalVarlen) {
  DFLASH_REQUIRE_GPU();
  run_case(causal({1}, 1, 1, 64), 1);
  run_case(causal({17}, 3, 1, 128), 2);         // GQA 3
  run_case(causal({100, 29}, 4, 1, 64), 3);     // GQA 4, two documents
  run_case(causal({1000}, 4, 4, 128), 4);       // MHA, long
  run_case(causal({300, 1, 699}, 6, 2, 64), 5); // GQA 3, three documents
}

TEST(AttentionCuda, DFlashTrainingPattern) {
  DFLASH_REQUIRE_GPU();
  // Context rows [0, T) then N blocks of K rows; block b at anchor a_b sees ctx [doc_start, a_b)
  // and its own K keys. Two documents; a gap of ctx rows nobody sees holds NaN.
  // Block size 7 mixes blocks inside one query tile; 16 is the real one.
  const int64_t T = 129;
  const std::vector<int32_t> anchors{5, 40, 41, 70, 120, 128};
  const std::vector<int32_t> doc_start{0, 0, 0, 60, 60, 60};
  const int64_t N = static_cast<int64_t>(anchors.size());
  for (auto [D, K] : {std::pair<int64_t, int64_t>{64, 7}, {128, 16}}) {
    Case c{N * K, T + N * K, 4, 1, D, {}, {}};
    for (int64_t b = 0; b < N; ++b)
      for (int64_t s = 0; s < K; ++s)
        c.ranges.push_back(AttnRange{doc_start[b], anchors[b], static_cast<int32_t>(T + b * K),
                                     static_cast<int32_t>(T + (b + 1) * K)});
    // Keys 41..59 (between the first document's last anchor and the second document) and 128
    // (past the last anchor) are seen by nobody: poison them. With K = 7 a query tile mixes blocks
    // of both documents, so 41..59 lie inside the tile's key interval and are loaded.
    for (int64_t j = 41; j < 60; ++j) c.nan_keys.push_back(j);
    c.nan_keys.push_back(128);
    run_case(c, 10 + static_cast<uint32_t>(D));
  }
}

TEST(AttentionCuda, BlockVerificationOverKvCache) {
  DFLASH_REQUIRE_GPU();
  // 16 new rows appended to a cache of 300: row t sees [0, 300 + t + 1). Keys past the last
  // visible one (an over-allocated cache) hold NaN.
  const int64_t cache = 300, Tq = 16, Tk = cache + Tq + 11;
  for (int64_t D : {64, 128}) {
    Case c{Tq, Tk, 4, 1, D, {}, {}};
    for (int64_t t = 0; t < Tq; ++t)
      c.ranges.push_back(AttnRange{0, static_cast<int32_t>(cache + t + 1), 0, 0});
    for (int64_t j = cache + Tq; j < Tk; ++j) c.nan_keys.push_back(j);
    run_case(c, 20 + static_cast<uint32_t>(D));
  }
}

TEST(AttentionCuda, EmptyRowsGiveZeroAndMinusInf) {
  DFLASH_REQUIRE_GPU();
  Case c{5, 40, 2, 1, 64, {}, {}};
  for (int32_t t = 0; t < 5; ++t)
    c.ranges.push_back(t % 2 ? AttnRange{0, 0, 0, 0} : AttnRange{t, t + 7, 20, 23});
  run_case(c, 30);
}

TEST(AttentionCuda, RejectsUnsupportedHeadDim) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  AttnParams p{1, 1, 1, 1, 96, 0.1};
  EXPECT_THROW(attention_fwd_cuda(ctx, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, p),
               Error);
}
