// dflash.cpp — the fused decoding kernels (src/backend/cuda/decode_fused.cuh) run on the CPU
// through the warp emulator (tests/emu/cuda_emu.hpp), with the launch shapes of
// src/backend/cuda/decode_fused.cu:
//   qkv_prepare against the composition it replaces (per-head RMSNorm rounded to bf16, RoPE,
//   rows to their cache slots), computed here in the kernels' summation order: bit for bit;
//   untouched output rows keep their poison; heads in one and several rounds of a CTA. Its
//   four-lane sum of squares (head_rstd) against the warp-per-row order on wide-range values.
//   decode attention against the CPU attention_fwd_cpu (two-interval ranges, empty rows, rows
//   longer than one split, sinks), and each row alone against the same row among others: the
//   bits must not depend on the other rows of the launch (the batch invariance of decoding).
//   decode_linear against a double-precision product (bf16 and f32 outputs, accumulation), its
//   rows for M = 1 and 37 (one and three 16-row tiles) the bits of the same rows at M = 70.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cuda/decode_fused.cuh"  // with the emulator's common.cuh and mma.cuh
#include "cuda/tolerances.hpp"
#include "ops/decode_fused.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;
using namespace dflash::cuda::decode_fused;

namespace {

constexpr uint16_t kPoison = 0xFFFF;

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16_bits(d(gen));
  return v;
}

// The warp's sum of x[j]² for a head of D values: lane partials over j = lane, lane + 32, …, then
// the butterfly xor 16, 8, 4, 2, 1 (warp_sum), as the kernel and rmsnorm_fwd_cuda sum.
float warp_order_sum_sq(const float* x, int D) {
  float lanes[32];
  for (int l = 0; l < 32; ++l) {
    lanes[l] = 0.f;
    for (int j = l; j < D; j += 32) lanes[l] += x[j] * x[j];
  }
  for (int o = 16; o > 0; o >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ o];
    std::copy(next, next + 32, lanes);
  }
  return lanes[0];
}

// One head through RMSNorm (when w) and RoPE at position p, as rmsnorm_fwd_cuda then
// rope_fwd_cuda compute it (bf16 between the two).
std::vector<uint16_t> reference_head(const uint16_t* src, const float* w, int D, float eps,
                                     int32_t p, const std::vector<float>& inv_freq, float scaling) {
  std::vector<float> x(static_cast<size_t>(D));
  for (int j = 0; j < D; ++j) x[j] = bf16_bits_to_f32(src[j]);
  if (w) {
    const float rs = 1.0f / std::sqrt(warp_order_sum_sq(x.data(), D) / static_cast<float>(D) + eps);
    for (int j = 0; j < D; ++j) x[j] = bf16_bits_to_f32(f32_to_bf16_bits(w[j] * (x[j] * rs)));
  }
  std::vector<uint16_t> y(static_cast<size_t>(D));
  for (int i = 0; i < D / 2; ++i) {
    float sn, cs;
    sincosf(static_cast<float>(p) * inv_freq[i], &sn, &cs);
    const float c = cs * scaling, s = sn * scaling;
    // rope_pair (common.cuh): the first product fused with the rounded second one.
    y[i] = f32_to_bf16_bits(std::fma(x[i], c, -(x[i + D / 2] * s)));
    y[i + D / 2] = f32_to_bf16_bits(std::fma(x[i + D / 2], c, x[i] * s));
  }
  return y;
}

template <int D>
void check_qkv_prepare(bool norm, int NH, int NKV) {
  SCOPED_TRACE(testing::Message() << "D " << D << " norm " << norm << " NH " << NH);
  const int T = 3, W = (NH + 2 * NKV) * D, rows = 7;
  const std::vector<uint16_t> qkv = random_bf16(static_cast<size_t>(T) * W, 11);
  std::vector<float> qn(D), kn(D), inv_freq(D / 2);
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (auto& x : qn) x = u(gen);
  for (auto& x : kn) x = u(gen);
  for (int i = 0; i < D / 2; ++i) inv_freq[i] = std::pow(10000.f, -2.f * i / D);
  const std::vector<int32_t> pos{0, 17, 513}, q_rows{4, 0, 2}, kv_rows{6, 1, 3};
  std::vector<uint16_t> q(static_cast<size_t>(rows) * NH * D, kPoison);
  std::vector<uint16_t> k(static_cast<size_t>(rows) * NKV * D, kPoison), v = k;
  const QkvPrepArgs a{q.data(),
                      q_rows.data(),
                      k.data(),
                      v.data(),
                      kv_rows.data(),
                      qkv.data(),
                      norm ? qn.data() : nullptr,
                      norm ? kn.data() : nullptr,
                      pos.data(),
                      inv_freq.data(),
                      0.9f,
                      1e-6f,
                      T,
                      NH,
                      NKV};
  const auto threads = static_cast<unsigned>(qkv_prep_threads(NH + 2 * NKV));
  emu::launch({static_cast<unsigned>(T), 1, 1}, {threads, 1, 1},
              static_cast<int>(sizeof(float)) * D,
              [&] { qkv_prepare<D>(a, reinterpret_cast<float*>(emu::dynamic_smem())); });
  for (int t = 0; t < T; ++t) {
    const uint16_t* row = qkv.data() + static_cast<size_t>(t) * W;
    for (int h = 0; h < NH; ++h) {
      const auto ref =
          reference_head(row + h * D, norm ? qn.data() : nullptr, D, 1e-6f, pos[t], inv_freq, 0.9f);
      for (int j = 0; j < D; ++j)
        ASSERT_EQ(q[(static_cast<size_t>(q_rows[t]) * NH + h) * D + j], ref[j])
            << "q t " << t << " head " << h << " j " << j;
    }
    for (int g = 0; g < NKV; ++g) {
      const auto ref = reference_head(row + (NH + g) * D, norm ? kn.data() : nullptr, D, 1e-6f,
                                      pos[t], inv_freq, 0.9f);
      for (int j = 0; j < D; ++j) {
        const size_t at = (static_cast<size_t>(kv_rows[t]) * NKV + g) * D + j;
        ASSERT_EQ(k[at], ref[j]) << "k t " << t << " head " << g << " j " << j;
        ASSERT_EQ(v[at], row[(NH + NKV + g) * D + j]) << "v t " << t << " head " << g;
      }
    }
  }
  // Rows no token maps to keep their poison.
  for (int r : {1, 3, 5, 6})
    for (int j = 0; j < NH * D; ++j) ASSERT_EQ(q[static_cast<size_t>(r) * NH * D + j], kPoison);
  for (int r : {0, 2, 4, 5})
    for (int j = 0; j < NKV * D; ++j) {
      ASSERT_EQ(k[static_cast<size_t>(r) * NKV * D + j], kPoison);
      ASSERT_EQ(v[static_cast<size_t>(r) * NKV * D + j], kPoison);
    }
}

TEST(DecodeFusedEmu, QkvPrepareEqualsNormRopeScatter) {
  check_qkv_prepare<64>(true, 6, 2);  // tiny-qwen3's heads: q/k norm
  check_qkv_prepare<128>(true, 8, 2);
  check_qkv_prepare<128>(false, 4, 4);  // no norm (Llama-style): RoPE on the projection's bits
  check_qkv_prepare<128>(true, 60, 6);  // 72 heads: two rounds of a 256-thread CTA, 8 in the second
  check_qkv_prepare<64>(false, 64, 8);  // 80 heads, no norm
}

// head_rstd's sum against the warp-per-row order (warp_order_sum_sq) on values whose exponents span
// 2^-12 … 2^12, where a different association of the 32 partial sums changes the f32 result (the
// bf16 outputs of qkv_prepare hide most one-ulp differences of the statistic): one warp, 8 heads of
// 4 lanes, every lane's result compared bit for bit.
template <int D>
void check_head_rstd(uint32_t seed) {
  constexpr int E = D / 32, kHeads = 32 / kPrepLanes;
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ex(-12, 12);
  std::vector<float> x(static_cast<size_t>(kHeads) * D), got(32, std::nanf(""));
  for (auto& v : x) v = std::ldexp(nd(gen), ex(gen));
  const float eps = 1e-6f;
  emu::launch({1, 1, 1}, {32, 1, 1}, 0, [&] {
    const int lane = static_cast<int>(threadIdx.x), head = lane / kPrepLanes, u = lane % kPrepLanes;
    float mine[E][8];
    for (int r = 0; r < E; ++r)
      for (int s = 0; s < 8; ++s)
        mine[r][s] = x[static_cast<size_t>(head * D + 32 * r + 8 * u + s)];
    got[static_cast<size_t>(lane)] = head_rstd<E>(mine, D, eps);
  });
  for (int lane = 0; lane < 32; ++lane) {
    const float* h = x.data() + static_cast<size_t>(lane / kPrepLanes) * D;
    const float want = 1.0f / std::sqrt(warp_order_sum_sq(h, D) / static_cast<float>(D) + eps);
    ASSERT_EQ(got[static_cast<size_t>(lane)], want) << "D " << D << " lane " << lane;
  }
}

TEST(DecodeFusedEmu, HeadRstdSumsInTheWarpPerRowOrder) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    check_head_rstd<64>(seed);
    check_head_rstd<128>(seed);
  }
}

// The launch sequence of launch::decode_attention (both kernels) for the rows of `ranges`.
template <int D>
std::vector<uint16_t> run_decode_attention(const std::vector<uint16_t>& q,
                                           const std::vector<uint16_t>& k,
                                           const std::vector<uint16_t>& v,
                                           const std::vector<AttnRange>& ranges, int NH, int NKV,
                                           const float* sinks, int max_keys) {
  const int64_t T = static_cast<int64_t>(ranges.size());
  const int S = (max_keys + kSplitKeys - 1) / kSplitKeys, G = NH / NKV;
  const int rpc = std::max(1, std::min(static_cast<int>(T), 16 / G));
  std::vector<float> work(static_cast<size_t>(decode_attention_work_floats(T, NH, D, max_keys)),
                          std::nanf(""));
  std::vector<uint16_t> o(static_cast<size_t>(T) * NH * D, kPoison);
  const DecodeAttnArgs a{q.data(),
                         k.data(),
                         v.data(),
                         ranges.data(),
                         sinks,
                         work.data(),
                         work.data() + T * NH * S * D,
                         o.data(),
                         1.0f / std::sqrt(static_cast<float>(D)),
                         T,
                         NH,
                         NKV,
                         S,
                         rpc};
  emu::launch({static_cast<unsigned>(S), static_cast<unsigned>(NKV),
               static_cast<unsigned>((T + rpc - 1) / rpc)},
              {static_cast<unsigned>(32 * G * rpc), 1, 1}, 0, [&] { decode_attn_split<D>(a); });
  emu::launch({static_cast<unsigned>((T * NH + kCombineWarps - 1) / kCombineWarps), 1, 1},
              {32 * kCombineWarps, 1, 1}, 0, [&] { decode_attn_combine<D>(a); });
  return o;
}

template <int D>
void check_decode_attention(int NH, int NKV, bool with_sinks) {
  SCOPED_TRACE(testing::Message() << "D " << D << " NH " << NH << " NKV " << NKV << " sinks "
                                  << with_sinks);
  const int Tk = 200, max_keys = 120;
  // Rows: one key; a split exactly; one past it; two intervals; none; many keys.
  const std::vector<AttnRange> ranges{{5, 6, 0, 0},       {0, 32, 0, 0}, {40, 73, 0, 0},
                                      {10, 50, 150, 170}, {0, 0, 0, 0},  {64, 184, 0, 0}};
  const auto T = static_cast<int64_t>(ranges.size());
  const auto q = random_bf16(static_cast<size_t>(T) * NH * D, 21);
  const auto k = random_bf16(static_cast<size_t>(Tk) * NKV * D, 22);
  const auto v = random_bf16(static_cast<size_t>(Tk) * NKV * D, 23);
  std::vector<float> sinks(static_cast<size_t>(NH));
  for (int h = 0; h < NH; ++h) sinks[h] = 0.5f * static_cast<float>(h) - 1.0f;
  const float* sk = with_sinks ? sinks.data() : nullptr;
  const auto o = run_decode_attention<D>(q, k, v, ranges, NH, NKV, sk, max_keys);

  auto widen = [](const std::vector<uint16_t>& x) {
    std::vector<float> f(x.size());
    for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_bits_to_f32(x[i]);
    return f;
  };
  AttnParams p{T, Tk, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  p.sinks = sk;
  std::vector<float> o_ref(o.size()), lse(static_cast<size_t>(NH * T));
  attention_fwd_cpu(o_ref.data(), lse.data(), widen(q).data(), widen(k).data(), widen(v).data(),
                    ranges.data(), p);
  EXPECT_LT(rel_error(widen(o), o_ref), tol::kAttnBf16);
  for (int h = 0; h < NH; ++h)  // the row without keys: exactly 0
    for (int j = 0; j < D; ++j) EXPECT_EQ(o[(4 * static_cast<size_t>(NH) + h) * D + j], 0);

  // Each row alone gives the bits it had among the others.
  for (int64_t t = 0; t < T; ++t) {
    const size_t w = static_cast<size_t>(NH) * D;
    const std::vector<uint16_t> q1(q.begin() + static_cast<long>(t * w),
                                   q.begin() + static_cast<long>((t + 1) * w));
    const auto o1 =
        run_decode_attention<D>(q1, k, v, {ranges[static_cast<size_t>(t)]}, NH, NKV, sk, max_keys);
    for (size_t j = 0; j < w; ++j) ASSERT_EQ(o1[j], o[t * w + j]) << "row " << t << " alone";
  }
}

TEST(DecodeFusedEmu, DecodeAttentionMatchesCpuAndIsRowIndependent) {
  check_decode_attention<64>(6, 2, false);   // tiny-qwen3: G 3, 5 rows per CTA
  check_decode_attention<128>(8, 2, false);  // G 4 (Qwen3-8B)
  check_decode_attention<64>(4, 1, true);    // gpt-oss-like sinks
}

// launch::decode_linear's sequence for one block of ≤ 128 rows.
template <typename Y, bool ACC>
void run_decode_linear(Y* y, const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                       int64_t M, int64_t N, int64_t K) {
  const DecodeLinearArgs a{y, x.data(), w.data(), M, N, K};
  const int tiles = static_cast<int>((M + 15) / 16);
  const int mt = tiles <= 1 ? 1 : tiles <= 2 ? 2 : tiles <= 4 ? 4 : 8;
  const int smem = static_cast<int>(sizeof(float)) * (kGemmWarps - 1) * mt * 128;
  auto kernel = [&] {
    float* sm = reinterpret_cast<float*>(emu::dynamic_smem());
    if (mt == 1)
      decode_linear<1, Y, ACC>(a, sm);
    else if (mt == 2)
      decode_linear<2, Y, ACC>(a, sm);
    else if (mt == 4)
      decode_linear<4, Y, ACC>(a, sm);
    else
      decode_linear<8, Y, ACC>(a, sm);
  };
  emu::launch({static_cast<unsigned>(N / 8), 1, 1}, {32 * kGemmWarps, 1, 1}, smem, kernel);
}

TEST(DecodeFusedEmu, DecodeLinearMatchesReferenceAndIsRowIndependent) {
  // K = 448: 7 chunks, so the four warps take 1, 2, 2, 2 (uneven quarters, unroll tails).
  const int64_t N = 24, K = 448, M = 70;
  const auto x = random_bf16(static_cast<size_t>(M * K), 31);
  const auto w = random_bf16(static_cast<size_t>(N * K), 32, 0.05f);
  std::vector<double> ref(static_cast<size_t>(M * N));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k)
        sum += static_cast<double>(bf16_bits_to_f32(x[static_cast<size_t>(r * K + k)])) *
               bf16_bits_to_f32(w[static_cast<size_t>(n * K + k)]);
      ref[static_cast<size_t>(r * N + n)] = sum;
    }
  std::vector<float> y(static_cast<size_t>(M * N), std::nanf(""));
  run_decode_linear<float, false>(y.data(), x, w, M, N, K);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], ref[i], 1e-4) << "value " << i;
  // Accumulating into f32, and bf16 out.
  std::vector<float> acc(y.size(), 1.5f);
  run_decode_linear<float, true>(acc.data(), x, w, M, N, K);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(acc[i], 1.5f + y[i]) << "value " << i;
  std::vector<uint16_t> yb(y.size(), kPoison);
  run_decode_linear<uint16_t, false>(yb.data(), x, w, M, N, K);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(yb[i], f32_to_bf16_bits(y[i])) << "value " << i;
  // The first rows alone: the same bits; rows past M untouched.
  for (int64_t m : {1, 37}) {
    std::vector<float> part(static_cast<size_t>((m + 1) * N), -7.f);
    run_decode_linear<float, false>(part.data(), x, w, m, N, K);
    for (int64_t i = 0; i < m * N; ++i)
      ASSERT_EQ(part[static_cast<size_t>(i)], y[static_cast<size_t>(i)]) << "M " << m << " " << i;
    for (int64_t i = m * N; i < (m + 1) * N; ++i) ASSERT_EQ(part[static_cast<size_t>(i)], -7.f);
  }
}

}  // namespace
