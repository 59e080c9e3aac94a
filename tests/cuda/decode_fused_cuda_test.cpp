// CUDA fused decoding kernels (ops/decode_fused.hpp) on the device:
//   qkv_prepare_cuda against the launches it replaces in TargetCuda's layer (rmsnorm_fwd_cuda on
//   q and k heads, rope_fwd_cuda, kv_scatter_cuda of k and v): the same bits, untouched cache rows
//   intact, guard bytes intact;
//   decode_attention_cuda against the tensor-core attention_fwd_cuda over a cache of several
//   requests (tolerance of bf16 attention), and every row alone against the same row among the
//   others: the same bits (what makes batch N decode as batch 1);
//   decode_linear_cuda against cuBLASLt (gemm_bf16) within fp32-accumulation noise, f32, bf16 and
//   accumulating outputs, and its first rows at M = 1, 16, 128 the bits of the same rows at
//   M = 200 (two row blocks).
#include <cmath>

#include "backend/cuda/context.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/decode.hpp"
#include "ops/decode_fused.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

void check_prepare(int64_t NH, int64_t NKV, int64_t D, bool norm) {
  SCOPED_TRACE(::testing::Message()
               << "NH " << NH << " NKV " << NKV << " D " << D << " norm " << norm);
  cuda::CudaContext ctx(0);
  const int64_t T = 5, QD = NH * D, KD = NKV * D, W = QD + 2 * KD, rows = 9;
  auto qkv = to_bf16(randn(static_cast<size_t>(T * W), 3));
  // NaNs with a sign and a payload: in a q head (the norm and RoPE make the whole head NaN), a k
  // head and a v head (copied as they are); both sides must give them the same bits.
  qkv[static_cast<size_t>(W + 3)] = 0x7fc5;
  qkv[static_cast<size_t>(2 * W + QD + 7)] = 0xffc1;
  qkv[static_cast<size_t>(3 * W + QD + KD + 5)] = 0xff91;
  std::vector<uint16_t> q(static_cast<size_t>(T * QD)), k(static_cast<size_t>(T * KD)), v = k;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < W; ++j) {
      const uint16_t x = qkv[static_cast<size_t>(t * W + j)];
      if (j < QD)
        q[static_cast<size_t>(t * QD + j)] = x;
      else if (j < QD + KD)
        k[static_cast<size_t>(t * KD + j - QD)] = x;
      else
        v[static_cast<size_t>(t * KD + j - QD - KD)] = x;
    }
  std::vector<float> qn = randn(static_cast<size_t>(D), 4, 0.3f),
                     kn = randn(static_cast<size_t>(D), 5, 0.3f);
  for (auto& x : qn) x += 1.0f;
  for (auto& x : kn) x += 1.0f;
  std::vector<float> inv(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i)
    inv[static_cast<size_t>(i)] =
        std::pow(1e6f, -2.0f * static_cast<float>(i) / static_cast<float>(D));
  const std::vector<int32_t> pos{0, 1, 77, 511, 4000}, slots{8, 2, 0, 5, 3};
  const double eps = 1e-6;
  const float scaling = 1.0f;
  DeviceGuarded<uint16_t> dqkv(qkv), dq(q), dk(k), dv(v);
  DeviceGuarded<float> dqn(qn), dkn(kn), dinv(inv);
  DeviceGuarded<int32_t> dpos(pos), dslots(slots);
  // The composition (the layer before the fusion).
  DeviceGuarded<uint16_t> ref_k(static_cast<size_t>(rows * KD)),
      ref_v(static_cast<size_t>(rows * KD));
  if (norm) {
    rmsnorm_fwd_cuda(ctx, dq.get(), static_cast<float*>(nullptr), dq.get(), dqn.get(), T * NH, D,
                     eps);
    rmsnorm_fwd_cuda(ctx, dk.get(), static_cast<float*>(nullptr), dk.get(), dkn.get(), T * NKV, D,
                     eps);
  }
  rope_fwd_cuda(ctx, dq.get(), dq.get(), dpos.get(), dinv.get(), scaling, T, NH, D);
  rope_fwd_cuda(ctx, dk.get(), dk.get(), dpos.get(), dinv.get(), scaling, T, NKV, D);
  kv_scatter_cuda(ctx, ref_k.get(), dk.get(), dslots.get(), T, KD);
  kv_scatter_cuda(ctx, ref_v.get(), dv.get(), dslots.get(), T, KD);
  // The fused kernel.
  DeviceGuarded<uint16_t> fq(static_cast<size_t>(T * QD)), fk(static_cast<size_t>(rows * KD)),
      fv(static_cast<size_t>(rows * KD));
  QkvPrepare p{
      T,   NH,         NKV,        D,      norm ? dqn.get() : nullptr, norm ? dkn.get() : nullptr,
      eps, dpos.get(), dinv.get(), scaling};
  qkv_prepare_cuda(ctx, fq.get(), nullptr, fk.get(), fv.get(), dslots.get(), dqkv.get(), p);
  EXPECT_TRUE(same_bits(fq.download(), dq.download())) << "q";
  EXPECT_TRUE(same_bits(fk.download(), ref_k.download())) << "k (untouched rows stay poisoned)";
  EXPECT_TRUE(same_bits(fv.download(), ref_v.download())) << "v";
  EXPECT_TRUE(fq.guard_intact() && fk.guard_intact() && fv.guard_intact());
}

TEST(DecodeFusedCuda, QkvPrepareEqualsNormRopeScatter) {
  DFLASH_REQUIRE_GPU();
  check_prepare(32, 8, 128, true);  // Qwen3-8B
  check_prepare(6, 2, 64, true);    // tiny-qwen3
  check_prepare(8, 8, 128, false);  // no q/k norm
  check_prepare(64, 8, 128, true);  // 80 heads: two rounds of a 256-thread CTA
  check_prepare(56, 4, 64, false);  // 64 heads, D 64, no norm: one full round
}

TEST(DecodeFusedCuda, QkvPrepareRejectsBadArguments) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  DeviceGuarded<uint16_t> buf(1024);
  DeviceGuarded<float> w(128);
  DeviceGuarded<int32_t> pos(4);
  QkvPrepare p{1, 2, 1, 96, nullptr, nullptr, 1e-6, pos.get(), w.get(), 1.0f};
  EXPECT_THROW(
      qkv_prepare_cuda(ctx, buf.get(), nullptr, buf.get(), buf.get(), nullptr, buf.get(), p),
      Error);  // head_dim 96
  p.D = 64;
  p.q_norm = w.get();
  EXPECT_THROW(
      qkv_prepare_cuda(ctx, buf.get(), nullptr, buf.get(), buf.get(), nullptr, buf.get(), p),
      Error);  // q_norm without k_norm
  p.k_norm = w.get();
  EXPECT_NO_THROW(
      qkv_prepare_cuda(ctx, buf.get(), nullptr, buf.get(), buf.get(), nullptr, buf.get(), p));
  EXPECT_THROW(
      qkv_prepare_cuda(ctx, buf.get() + 4, nullptr, buf.get(), buf.get(), nullptr, buf.get(), p),
      Error);  // q_out 8-byte aligned: the kernel moves 16-byte vectors
  EXPECT_THROW(
      qkv_prepare_cuda(ctx, buf.get(), nullptr, buf.get(), buf.get(), nullptr, buf.get() + 1, p),
      Error);  // qkv 2-byte aligned
}

void check_attention(int64_t NH, int64_t NKV, int64_t D, bool sinks) {
  SCOPED_TRACE(::testing::Message()
               << "NH " << NH << " NKV " << NKV << " D " << D << " sinks " << sinks);
  cuda::CudaContext ctx(0);
  // Three requests of stride 640 in one cache; rows as a batch-3 verify of 4 rows would have
  // them, plus a two-interval row and a row without keys.
  const int64_t C = 640, Tk = 3 * C;
  std::vector<AttnRange> ranges;
  for (int b = 0; b < 3; ++b)
    for (int j = 0; j < 4; ++j) {
      const int32_t base = static_cast<int32_t>(b * C), len = 100 * b + 413 + j + 1;
      ranges.push_back(AttnRange{base, base + len, 0, 0});
    }
  ranges.push_back(AttnRange{0, 30, 700, 745});
  ranges.push_back(AttnRange{0, 0, 0, 0});
  const auto T = static_cast<int64_t>(ranges.size());
  const auto q = to_bf16(randn(static_cast<size_t>(T * NH * D), 11));
  const auto k = to_bf16(randn(static_cast<size_t>(Tk * NKV * D), 12));
  const auto v = to_bf16(randn(static_cast<size_t>(Tk * NKV * D), 13));
  std::vector<float> sk(static_cast<size_t>(NH));
  for (int64_t h = 0; h < NH; ++h)
    sk[static_cast<size_t>(h)] = 0.25f * static_cast<float>(h) - 2.0f;
  DeviceGuarded<uint16_t> dq(q), dk(k), dv(v), o(q.size()), o_tc(q.size());
  DeviceGuarded<AttnRange> dr(ranges);
  DeviceGuarded<float> dsinks(sk);
  DeviceGuarded<float> work(static_cast<size_t>(decode_attention_work_floats(T, NH, D, C)));
  AttnParams p{T, Tk, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  if (sinks) p.sinks = dsinks.get();
  decode_attention_cuda(ctx, o.get(), dq.get(), dk.get(), dv.get(), dr.get(), p, work.get(), C);
  attention_fwd_cuda(ctx, o_tc.get(), nullptr, dq.get(), dk.get(), dv.get(), dr.get(), p);
  const auto out = o.download();
  EXPECT_LT(rel_error(from_bf16(out), from_bf16(o_tc.download())), tol::kAttnBf16);
  EXPECT_TRUE(o.guard_intact() && work.guard_intact());
  // Every row alone: the bits it had among the others.
  const auto W = static_cast<size_t>(NH * D);
  for (int64_t t = 0; t < T; ++t) {
    AttnParams p1 = p;
    p1.Tq = 1;
    decode_attention_cuda(ctx, o.get(), dq.get() + t * NH * D, dk.get(), dv.get(), dr.get() + t, p1,
                          work.get(), C);
    const auto one = o.download();
    for (size_t j = 0; j < W; ++j)
      ASSERT_EQ(one[j], out[static_cast<size_t>(t) * W + j])
          << "row " << t << " alone, value " << j;
  }
}

TEST(DecodeFusedCuda, DecodeAttentionMatchesTensorCoreAndIsRowIndependent) {
  DFLASH_REQUIRE_GPU();
  check_attention(32, 8, 128, false);  // Qwen3-8B
  check_attention(6, 2, 64, false);    // tiny-qwen3
  check_attention(8, 2, 64, true);     // sinks
}

TEST(DecodeFusedCuda, DecodeLinearMatchesCublasAndIsRowIndependent) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t M = 200, K = 1024, N = 520;
  const auto x = to_bf16(randn(static_cast<size_t>(M * K), 41));
  const auto w = to_bf16(randn(static_cast<size_t>(N * K), 42, 0.03f));
  DeviceGuarded<uint16_t> dx(x), dw(w), yb(static_cast<size_t>(M * N));
  DeviceGuarded<float> y(static_cast<size_t>(M * N)), ref(static_cast<size_t>(M * N));
  cuda::gemm_bf16(ctx, ref.get(), DType::f32, N, dx.get(), K, false, dw.get(), K, true, M, N, K);
  decode_linear_cuda(ctx, y.get(), dx.get(), dw.get(), M, K, N, false);
  const auto out = y.download(), expect = ref.download();
  EXPECT_LT(rel_error(out, expect), 1e-5);
  EXPECT_TRUE(y.guard_intact());
  decode_linear_cuda(ctx, yb.get(), dx.get(), dw.get(), M, K, N, false);
  EXPECT_TRUE(same_bits(yb.download(), to_bf16(out))) << "bf16 out = the f32 result rounded";
  decode_linear_cuda(ctx, y.get(), dx.get(), dw.get(), M, K, N, true);  // y += the same
  const auto twice = y.download();
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(twice[i], out[i] + out[i]) << "value " << i;
  for (int64_t m : {1, 16, 128}) {
    DeviceGuarded<float> part(static_cast<size_t>(m * N));
    decode_linear_cuda(ctx, part.get(), dx.get(), dw.get(), m, K, N, false);
    const auto p = part.download();
    for (size_t i = 0; i < p.size(); ++i) ASSERT_EQ(p[i], out[i]) << "M " << m << " value " << i;
    EXPECT_TRUE(part.guard_intact());
  }
  EXPECT_THROW(decode_linear_cuda(ctx, y.get(), dx.get(), dw.get(), M, 1000, N, false), Error);
  EXPECT_THROW(decode_linear_cuda(ctx, yb.get(), dx.get(), dw.get(), M, K, N, true), Error);
}

}  // namespace
