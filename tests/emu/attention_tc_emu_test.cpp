// dflash.cpp — the tensor-core attention kernels (src/backend/cuda/attention_tc.cuh) run on the
// CPU through the warp emulator (tests/emu/cuda_emu.hpp) and compared with the CPU reference, so
// that their tiling, masking, pipelining and fragment indexing are checked on machines without a
// GPU (CI). The same launch sequence as src/backend/cuda/attention_tc.cu: forward; Δ, dq, key-tile
// spans, dk/dv. Outputs start poisoned and end in a guard region that must stay intact.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/cuda/attention_tc.cuh"  // with the emulator's common.cuh / mma.cuh
#include "cuda/tolerances.hpp"
#include "util/attention_cases.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;
using namespace dflash::cuda::attn_tc;

namespace {

constexpr size_t kGuard = 64;  // elements after every output
constexpr uint16_t kPoison = 0xFFFF;

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16_bits(d(gen));
  return v;
}
std::vector<float> widen(const std::vector<uint16_t>& v, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = bf16_bits_to_f32(v[i]);
  return f;
}
bool guard_intact(const std::vector<uint16_t>& v, size_t n) {
  for (size_t i = n; i < v.size(); ++i)
    if (v[i] != kPoison) return false;
  return true;
}

// The forward with IPW items per warp (both variants are compiled for the GPU), then the backward.
// The forward with per-head sinks from the forward without: a sink adds e^{sink} to each row's
// softmax denominator, so o scales by 1 / (1 + e^{sink − lse}) and lse becomes
// logaddexp(lse, sink) (lse = sink, o = 0 for a row that sees nothing).
void apply_sinks(std::vector<float>& o, std::vector<float>& lse, const std::vector<float>& sinks,
                 int64_t Tq, int64_t NH, int64_t D) {
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t h = 0; h < NH; ++h) {
      float& l = lse[static_cast<size_t>(h * Tq + t)];
      const float sk = sinks[static_cast<size_t>(h)];
      const float w = std::isinf(l) ? 0.f : 1.f / (1.f + std::exp(sk - l));
      for (int64_t d = 0; d < D; ++d) o[static_cast<size_t>((t * NH + h) * D + d)] *= w;
      l = std::isinf(l) ? sk : std::max(l, sk) + std::log1p(std::exp(-std::abs(l - sk)));
    }
}

template <int D, int IPW>
void run_emulated_ipw(const AttnCase& c, uint32_t seed, const std::vector<float>& sinks = {}) {
  SCOPED_TRACE(::testing::Message() << "Tq=" << c.Tq << " Tk=" << c.Tk << " NH=" << c.NH
                                    << " NKV=" << c.NKV << " D=" << D << " items/warp=" << IPW);
  const AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  const size_t nq = static_cast<size_t>(c.Tq * c.NH * D),
               nk = static_cast<size_t>(c.Tk * c.NKV * D);
  auto q = random_bf16(nq, seed), k = random_bf16(nk, seed + 1), v = random_bf16(nk, seed + 2),
       dout = random_bf16(nq, seed + 3);
  for (int64_t j : c.nan_keys)
    for (int64_t e = 0; e < c.NKV * D; ++e) {
      k[static_cast<size_t>(j * c.NKV * D + e)] = 0x7fc0;
      v[static_cast<size_t>(j * c.NKV * D + e)] = 0x7fc0;
    }
  std::vector<uint16_t> o(nq + kGuard, kPoison), dq(nq + kGuard, kPoison), dk(nk + kGuard, kPoison),
      dv(nk + kGuard, kPoison);
  std::vector<float> lse(static_cast<size_t>(c.NH * c.Tq), NAN),
      delta(static_cast<size_t>(c.NH * c.Tq), NAN);

  AttnParams ps = p;
  ps.sinks = sinks.empty() ? nullptr : sinks.data();
  Args a = make_args(ps, c.ranges.data());
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = o.data(), a.lse_out = lse.data();
  const unsigned nkv = static_cast<unsigned>(c.NKV);
  emu::launch({static_cast<unsigned>(query_ctas(a, IPW)), nkv, 1}, {kThreads, 1, 1},
              query_cta_smem<D, IPW>(1), [&] { attn_tc_fwd_kernel<D, IPW>(a); });

  const auto qf = widen(q, nq), kf = widen(k, nk), vf = widen(v, nk), dof = widen(dout, nq);
  std::vector<float> o_ref(nq), lse_ref(lse.size());
  attention_fwd_cpu(o_ref.data(), lse_ref.data(), qf.data(), kf.data(), vf.data(), c.ranges.data(),
                    p);
  if (!sinks.empty()) apply_sinks(o_ref, lse_ref, sinks, c.Tq, c.NH, D);
  const auto o_emu = widen(o, nq);
  EXPECT_LT(rel_error(o_emu, o_ref), tol::kAttnBf16);
  std::vector<float> lg, lr;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse_ref[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "lse " << i << " = " << lse[i];
    } else {
      lg.push_back(lse[i]);
      lr.push_back(lse_ref[i]);
    }
  }
  EXPECT_LT(rel_error(lg, lr), tol::kLse);
  EXPECT_TRUE(guard_intact(o, nq));

  // Backward from the emulated forward's o and lse.
  std::vector<float> dq_ref(nq), dk_ref(nk), dv_ref(nk);
  attention_bwd_cpu(dq_ref.data(), dk_ref.data(), dv_ref.data(), dof.data(), qf.data(), kf.data(),
                    vf.data(), o_emu.data(), lse.data(), c.ranges.data(), p);
  std::vector<int> span(static_cast<size_t>(2 * std::max(key_tiles(a), 1)));
  a.o = o.data(), a.dout = dout.data(), a.lse = lse.data(), a.delta = delta.data();
  a.dq = dq.data(), a.dk = dk.data(), a.dv = dv.data(), a.span = span.data();
  const int64_t rows = c.Tq * c.NH;
  emu::launch({static_cast<unsigned>((rows * 8 + 255) / 256), 1, 1}, {256, 1, 1}, 0,
              [&] { attn_tc_delta_kernel<D>(delta.data(), a.dout, a.o, a.Tq, a.NH); });
  emu::launch({static_cast<unsigned>(query_ctas(a, 1)), nkv, 1}, {kThreads, 1, 1},
              query_cta_smem<D, 1>(2), [&] { attn_tc_dq_kernel<D>(a); });
  const int n_tiles = key_tiles(a);
  emu::launch({1, 1, 1}, {256, 1, 1}, 0, [&] { attn_tc_span_init_kernel(span.data(), n_tiles); });
  emu::launch({1, 1, 1}, {256, 1, 1}, 0,
              [&] { attn_tc_span_kernel(span.data(), a.ranges, a.Tq, a.Tk); });
  emu::launch({static_cast<unsigned>(n_tiles) * nkv, 1, 1}, {kThreads, 1, 1}, dkdv_smem<D>(),
              [&] { attn_tc_dkdv_kernel<D>(a); });
  EXPECT_LT(rel_error(widen(dq, nq), dq_ref), tol::kAttnBf16);
  EXPECT_LT(rel_error(widen(dk, nk), dk_ref), tol::kAttnBf16);
  EXPECT_LT(rel_error(widen(dv, nk), dv_ref), tol::kAttnBf16);
  EXPECT_TRUE(guard_intact(dq, nq) && guard_intact(dk, nk) && guard_intact(dv, nk));
}

template <int D>
void run_emulated(const AttnCase& c, uint32_t seed) {
  run_emulated_ipw<D, 1>(c, seed);
  run_emulated_ipw<D, 2>(c, seed);
}

}  // namespace

TEST(AttentionTcEmulated, DFlashMixedTilesWithNaNKeys) {
  run_emulated<64>(attn_dflash_mixed_tiles(64, 7), 74);
}

TEST(AttentionTcEmulated, DFlashBlocksOfSixteen) {
  // Two documents (40 and 57 rows), an empty context (anchor at a document start), one inert
  // block; keys past each document's last anchor hold NaN.
  AttnCase c = attn_dflash_blocks({40, 57}, {0, 5, 17, 38, 40, 41, 60, 95}, 1, 16, 4, 2, 128);
  c.nan_keys = {38, 39, 95, 96};
  run_emulated<128>(c, 40);
}

TEST(AttentionTcEmulated, CausalOddShapes) {
  run_emulated<64>(attn_causal({17, 50}, 2, 1, 64), 1);
  run_emulated<128>(attn_causal({70}, 1, 1, 128), 2);
}

TEST(AttentionTcEmulated, SecondRangeFirstAndEmptyRows) {
  run_emulated<128>(attn_second_range_first(2, 2, 128), 53);
  run_emulated<64>(attn_empty_rows(), 30);
}

TEST(AttentionTcEmulated, SinksJoinTheSoftmax) {
  // gpt-oss's per-head sink logits, one of them far above the scores; rows that see nothing get
  // o = 0 and lse = sink.
  run_emulated_ipw<64, 2>(attn_empty_rows(), 60, {0.5f, 4.0f});  // NH 2
  run_emulated_ipw<64, 2>(attn_causal({40}, 2, 1, 64), 61, {-1.0f, 2.0f});
}
