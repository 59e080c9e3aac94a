// CUDA attention vs the CPU reference (fp32 on the same bf16-rounded inputs), for every kernel
// family (tensor cores, FFMA, Hopper wgmma v6): causal varlen
// with GQA, the DFlash two-range training pattern (NaN in keys nobody sees), block verification
// over a KV cache; forward o and lse, backward dq/dk/dv; odd shapes that are multiples of no
// tile; guard bytes; bit-reproducible forward and backward (two runs, identical bits).
#include <cmath>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/attention.hpp"
#include "util/attention_cases.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

using Case = AttnCase;

const char* kernels_name(AttnCudaKernels k) {
  switch (k) {
    case AttnCudaKernels::tensor_core:
      return "tensor_core";
    case AttnCudaKernels::ffma:
      return "ffma";
    case AttnCudaKernels::wgmma:
      return "wgmma";
    case AttnCudaKernels::automatic:
      return "automatic";
  }
  return "?";
}

void run_case_with(const Case& c, uint32_t seed, AttnCudaKernels kernels) {
  SCOPED_TRACE(::testing::Message() << kernels_name(kernels) << " Tq=" << c.Tq << " Tk=" << c.Tk
                                    << " NH=" << c.NH << " NKV=" << c.NKV << " D=" << c.D);
  cuda::CudaContext ctx(0);
  AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, c.D, 1.0 / std::sqrt(static_cast<double>(c.D))};
  p.kernels = kernels;
  const size_t nq = static_cast<size_t>(c.Tq * c.NH * c.D);
  const size_t nk = static_cast<size_t>(c.Tk * c.NKV * c.D);
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
  // Determinism of the forward: a second run gives the same bits.
  attention_fwd_cuda(ctx, o.get(), lse.get(), dq_.get(), dk_.get(), dv_.get(), dr.get(), p);
  EXPECT_TRUE(same_bits(o.download(), o_gpu));
  EXPECT_TRUE(same_bits(lse.download(), lse_gpu));

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

// Every kernel family against the CPU reference.
void run_case(const Case& c, uint32_t seed) {
  for (AttnCudaKernels k :
       {AttnCudaKernels::tensor_core, AttnCudaKernels::ffma, AttnCudaKernels::wgmma})
    run_case_with(c, seed, k);
}

}  // namespace

TEST(AttentionCuda, CausalVarlen) {
  DFLASH_REQUIRE_GPU();
  run_case(attn_causal({1}, 1, 1, 64), 1);
  run_case(attn_causal({17}, 3, 1, 128), 2);         // GQA 3
  run_case(attn_causal({100, 29}, 4, 1, 64), 3);     // GQA 4, two documents
  run_case(attn_causal({1000}, 4, 4, 128), 4);       // MHA, long
  run_case(attn_causal({300, 1, 699}, 6, 2, 64), 5); // GQA 3, three documents
}

TEST(AttentionCuda, DFlashTrainingPattern) {
  DFLASH_REQUIRE_GPU();
  // Context rows [0, T) then N blocks of K rows; block b at anchor a_b sees ctx [doc_start, a_b)
  // and its own K keys. Two documents; a gap of ctx rows nobody sees holds NaN. Block size 7
  // mixes blocks of both documents inside one query tile, so the gap lies inside the tile's key
  // interval; 16 is the real one.
  run_case(attn_dflash_mixed_tiles(64, 7), 74);
  run_case(attn_dflash_mixed_tiles(128, 16), 138);
}

TEST(AttentionCuda, DFlashBlocksOfSixteenWithGqa) {
  DFLASH_REQUIRE_GPU();
  // The real drafter pattern at odd sizes: documents of 150 and 203 context rows (T = 353, a
  // multiple of no tile), sorted anchors per document (first anchor at the document start: an
  // empty context range), two inert padding blocks, GQA 4 (a CTA holds one block under 4 heads).
  const std::vector<int32_t> anchors{0, 3, 17, 64, 65, 130, 149, 150, 151, 200, 263, 264, 351};
  for (int64_t D : {64, 128}) {
    Case c = attn_dflash_blocks({150, 203}, anchors, 2, 16, 8, 2, D);
    c.nan_keys = {149, 351, 352};  // past each document's last anchor: seen by nobody
    run_case(c, 40);
  }
  // GQA 8 (a CTA holds half of a block's heads) and MHA (a CTA holds 4 blocks of one head).
  run_case(attn_dflash_blocks({150, 203}, anchors, 1, 16, 8, 1, 128), 41);
  run_case(attn_dflash_blocks({97}, {5, 6, 40, 96}, 0, 16, 2, 2, 64), 42);
}

TEST(AttentionCuda, OddShapes) {
  DFLASH_REQUIRE_GPU();
  // One query row over 70 keys (one key alone would make dq and dk exactly zero: Δ = dP, and
  // a relative error of rounding noise); 17 rows; keys beyond the 64-key tile in both
  // directions; GQA 2 with D = 128.
  run_case(Case{1, 70, 4, 1, 128, {AttnRange{0, 70, 0, 0}}, {}}, 50);
  run_case(attn_causal({17}, 2, 2, 64), 51);
  run_case(attn_causal({65, 1, 63, 129}, 8, 4, 128), 52);
  // Ranges that start mid-tile and a second range before the first.
  run_case(attn_second_range_first(4, 2, 128), 53);
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
  run_case(attn_empty_rows(), 30);
}

TEST(AttentionCuda, AutomaticIsWgmmaOnHopperAndTensorCoresElsewhere) {
  DFLASH_REQUIRE_GPU();
  // The default family resolves by device (ops/attention.hpp): the same bits as the family it
  // names, forward and backward.
  cuda::CudaContext ctx(0);
  const AttnCudaKernels expect =
      attention_wgmma_available_cuda(ctx) ? kAttnHopperKernels : AttnCudaKernels::tensor_core;
  EXPECT_EQ(attention_kernels_cuda(ctx, AttnCudaKernels::automatic), expect);
  EXPECT_EQ(AttnParams{}.kernels, AttnCudaKernels::automatic);
  const Case c = attn_dflash_blocks({150, 203}, {0, 3, 17, 64, 150, 200, 351}, 1, 16, 8, 2, 128);
  const size_t nq = static_cast<size_t>(c.Tq * c.NH * c.D);
  const size_t nk = static_cast<size_t>(c.Tk * c.NKV * c.D);
  DeviceGuarded<uint16_t> q(to_bf16(randn(nq, 90))), k(to_bf16(randn(nk, 91))),
      v(to_bf16(randn(nk, 92))), dout(to_bf16(randn(nq, 93)));
  DeviceGuarded<AttnRange> dr(c.ranges);
  std::vector<std::vector<uint16_t>> got[2];
  const AttnCudaKernels kinds[2] = {AttnCudaKernels::automatic, expect};
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(kernels_name(kinds[i]));
    AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, c.D, 0.088};
    p.kernels = kinds[i];
    DeviceGuarded<uint16_t> o(nq), gq(nq), gk(nk), gv(nk);
    DeviceGuarded<float> lse(static_cast<size_t>(c.NH * c.Tq));
    attention_fwd_cuda(ctx, o.get(), lse.get(), q.get(), k.get(), v.get(), dr.get(), p);
    attention_bwd_cuda(ctx, gq.get(), gk.get(), gv.get(), dout.get(), q.get(), k.get(), v.get(),
                       o.get(), lse.get(), dr.get(), p);
    got[i] = {o.download(), gq.download(), gk.download(), gv.download()};
  }
  for (size_t j = 0; j < got[0].size(); ++j) EXPECT_TRUE(same_bits(got[0][j], got[1][j])) << j;
}

TEST(AttentionCuda, RejectsUnsupportedHeadDim) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  AttnParams p{1, 1, 1, 1, 96, 0.1};
  EXPECT_THROW(attention_fwd_cuda(ctx, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, p),
               Error);
}

TEST(AttentionCuda, TensorCoresRejectMisalignedArrays) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  AttnParams p{16, 16, 1, 1, 64, 0.125};
  DeviceGuarded<uint16_t> q(16 * 64 + 8), o(16 * 64 + 8);
  DeviceGuarded<AttnRange> r(std::vector<AttnRange>(16, AttnRange{0, 16, 0, 0}));
  // q + 1 lies 2 bytes past a 256-byte boundary: the tensor-core kernels refuse it (they copy
  // 16-byte chunks); q + 2 (4 bytes past) is all the FFMA kernels need.
  EXPECT_THROW(attention_fwd_cuda(ctx, o.get(), nullptr, q.get() + 1, q.get(), q.get(), r.get(), p),
               Error);
  p.kernels = AttnCudaKernels::ffma;
  EXPECT_NO_THROW(attention_fwd_cuda(ctx, o.get(), nullptr, q.get() + 2, q.get(), q.get(), r.get(),
                                     p));
}

TEST(AttentionCuda, TensorCoreAndWgmmaSinksJoinTheSoftmax) {
  DFLASH_REQUIRE_GPU();
  // Per-head sink logits (gpt-oss) against the CPU forward without them: a sink adds e^{sink} to
  // each row's denominator, so o scales by 1 / (1 + e^{sink − lse}) and lse becomes
  // logaddexp(lse, sink). The backward reads only o and lse and is checked by the other cases.
  cuda::CudaContext ctx(0);
  const Case c = attn_causal({40, 1, 90}, 4, 2, 64);
  const std::vector<float> sinks{0.5f, 3.0f, -2.0f, 1.0f};
  const size_t nq = static_cast<size_t>(c.Tq * c.NH * c.D);
  const size_t nk = static_cast<size_t>(c.Tk * c.NKV * c.D);
  auto q = to_bf16(randn(nq, 70)), k = to_bf16(randn(nk, 71)), v = to_bf16(randn(nk, 72));
  AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, c.D, 0.125};
  std::vector<float> o_ref(nq), lse_ref(static_cast<size_t>(c.NH * c.Tq));
  attention_fwd_cpu(o_ref.data(), lse_ref.data(), from_bf16(q).data(), from_bf16(k).data(),
                    from_bf16(v).data(), c.ranges.data(), p);
  for (int64_t t = 0; t < c.Tq; ++t)
    for (int64_t h = 0; h < c.NH; ++h) {
      float& l = lse_ref[static_cast<size_t>(h * c.Tq + t)];
      const float sk = sinks[static_cast<size_t>(h)];
      const float w = 1.f / (1.f + std::exp(sk - l));
      for (int64_t d = 0; d < c.D; ++d) o_ref[static_cast<size_t>((t * c.NH + h) * c.D + d)] *= w;
      l = std::max(l, sk) + std::log1p(std::exp(-std::abs(l - sk)));
    }
  for (AttnCudaKernels kernels : {AttnCudaKernels::tensor_core, AttnCudaKernels::wgmma}) {
    SCOPED_TRACE(kernels_name(kernels));
    DeviceGuarded<uint16_t> dq(q), dk(k), dv(v), o(nq);
    DeviceGuarded<AttnRange> dr(c.ranges);
    DeviceGuarded<float> ds(sinks), lse(lse_ref.size());
    p.sinks = ds.get();
    p.kernels = kernels;
    attention_fwd_cuda(ctx, o.get(), lse.get(), dq.get(), dk.get(), dv.get(), dr.get(), p);
    EXPECT_LT(rel_error(from_bf16(o.download()), o_ref), tol::kAttnBf16);
    EXPECT_LT(rel_error(lse.download(), lse_ref), tol::kLse);
    EXPECT_TRUE(o.guard_intact() && lse.guard_intact());
  }
}
