// Mixture-of-experts kernels at real model shapes on the GPU: the grouped expert GEMMs
// (moe_grouped_linear_cuda) and the whole sparse block (route → dispatch → gather → gate/up GEMM →
// activation → down GEMM → combine), with TFLOP/s counted from the expert GEMMs' useful work
// (2·R·IN·OUT per GEMM, R = T·K rows), and the cuBLASLt dense GEMM of the same total work (all R
// rows through one expert's matrix) as the ceiling the grouped GEMM is measured against.
// Shapes (T = 8192 tokens, 4 × 2048): Qwen3-30B-A3B (H 2048, 128 experts, top-8, width 768) and
// gpt-oss-20b (H 2880, 32 experts, top-4, width 2880). Routing is uniform random (balanced load),
// weights random bf16. GPU time from CUDA events (manual time), 1 warm-up call per shape.
//
//     build/bench/moe_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <random>
#include <vector>

#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/dtype.hpp"
#include "ops/moe.hpp"

using namespace dflash;

namespace {

struct Shape {
  int64_t T, H, E, K, EI;
};
constexpr Shape kQwen3_30B{8192, 2048, 128, 8, 768};
constexpr Shape kGptOss20B{8192, 2880, 32, 4, 2880};

template <typename T>
cuda::DeviceBuffer upload(cuda::CudaContext& ctx, const std::vector<T>& h) {
  cuda::DeviceBuffer b = ctx.scratch(h.size() * sizeof(T));
  cudaMemcpy(b.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return b;
}

std::vector<uint16_t> random_bf16(size_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16_bits(d(rng));
  return v;
}

// Everything one sparse block needs on the device.
struct Block {
  Shape s;
  cuda::DeviceBuffer x, logits, wgu, wd, gu_ptrs, d_ptrs, ids, w, perm, slot, rexp, offsets, xs, gu,
      act, ys, y;
  Block(cuda::CudaContext& ctx, const Shape& sh) : s(sh) {
    const int64_t R = s.T * s.K;
    x = upload(ctx, random_bf16(static_cast<size_t>(s.T * s.H), 1.0f, 1));
    std::vector<float> l(static_cast<size_t>(s.T * s.E));
    std::mt19937 rng(2);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& v : l) v = d(rng);
    logits = upload(ctx, l);
    wgu = upload(ctx, random_bf16(static_cast<size_t>(s.E * 2 * s.EI * s.H), 0.02f, 3));
    wd = upload(ctx, random_bf16(static_cast<size_t>(s.E * s.H * s.EI), 0.02f, 4));
    std::vector<const uint16_t*> pg, pd;
    for (int64_t e = 0; e < s.E; ++e) {
      pg.push_back(wgu.as<uint16_t>() + e * 2 * s.EI * s.H);
      pd.push_back(wd.as<uint16_t>() + e * s.H * s.EI);
    }
    gu_ptrs = upload(ctx, pg);
    d_ptrs = upload(ctx, pd);
    ids = ctx.scratch(static_cast<size_t>(R) * 4);
    w = ctx.scratch(static_cast<size_t>(R) * 4);
    perm = ctx.scratch(static_cast<size_t>(R) * 4);
    slot = ctx.scratch(static_cast<size_t>(R) * 4);
    rexp = ctx.scratch(static_cast<size_t>(R) * 4);
    offsets = ctx.scratch(static_cast<size_t>(s.E + 1) * 4);
    xs = ctx.scratch(static_cast<size_t>(R * s.H) * 2);
    gu = ctx.scratch(static_cast<size_t>(R * 2 * s.EI) * 2);
    act = ctx.scratch(static_cast<size_t>(R * s.EI) * 2);
    ys = ctx.scratch(static_cast<size_t>(R * s.H) * 4);
    y = ctx.scratch(static_cast<size_t>(s.T * s.H) * 4);
  }
  void route(cuda::CudaContext& ctx) {
    moe_route_cuda(ctx, ids.as<int32_t>(), w.as<float>(), logits.as<float>(), s.T, s.E,
                   MoeRouting{MoeRoutingMode::softmax_topk, s.K, true});
    moe_dispatch_cuda(ctx, perm.as<int32_t>(), slot.as<int32_t>(), offsets.as<int32_t>(),
                      rexp.as<int32_t>(), ids.as<int32_t>(), s.T, s.K, s.E);
    moe_gather_cuda(ctx, xs.as<uint16_t>(), x.as<uint16_t>(), perm.as<int32_t>(), s.T * s.K, s.K,
                    s.H);
  }
  void experts(cuda::CudaContext& ctx) {
    const int64_t R = s.T * s.K;
    moe_grouped_linear_cuda(ctx, gu.as<uint16_t>(), 2 * s.EI, xs.as<uint16_t>(),
                            gu_ptrs.as<const uint16_t*>(), offsets.as<int32_t>(), s.E, R, s.H,
                            2 * s.EI);
    moe_glu_cuda(ctx, act.as<uint16_t>(), gu.as<uint16_t>(), gu.as<uint16_t>() + s.EI, 2 * s.EI,
                 nullptr, nullptr, rexp.as<int32_t>(), R, s.EI, MoeGlu{});
    moe_grouped_linear_cuda(ctx, ys.as<float>(), s.H, act.as<uint16_t>(),
                            d_ptrs.as<const uint16_t*>(), offsets.as<int32_t>(), s.E, R, s.EI, s.H);
  }
  void combine(cuda::CudaContext& ctx) {
    moe_combine_cuda(ctx, y.as<float>(), ys.as<float>(), nullptr, ids.as<int32_t>(), w.as<float>(),
                     slot.as<int32_t>(), s.T, s.K, s.H);
  }
  // Useful FLOPs of the expert GEMMs: gate/up (2·EI outputs) and down.
  double gemm_flops() const {
    return 2.0 * static_cast<double>(s.T * s.K) * static_cast<double>(s.H) *
           static_cast<double>(3 * s.EI);
  }
};

template <typename Fn>
void timed(benchmark::State& state, cuda::CudaContext& ctx, double flops, Fn&& fn) {
  cudaEvent_t a = ctx.new_event(true), b = ctx.new_event(true);
  fn();  // warm-up (plans, caches)
  ctx.synchronize();
  for (auto _ : state) {
    cudaEventRecord(a, ctx.stream());
    fn();
    cudaEventRecord(b, ctx.stream());
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    state.SetIterationTime(ms / 1e3);
  }
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_GroupedExpertGemms(benchmark::State& state, Shape s) {
  if (cuda::device_count() == 0) return state.SkipWithError("no CUDA device");
  cuda::CudaContext ctx(0);
  Block b(ctx, s);
  b.route(ctx);
  timed(state, ctx, b.gemm_flops(), [&] { b.experts(ctx); });
}

void BM_SparseBlock(benchmark::State& state, Shape s) {
  if (cuda::device_count() == 0) return state.SkipWithError("no CUDA device");
  cuda::CudaContext ctx(0);
  Block b(ctx, s);
  timed(state, ctx, b.gemm_flops(), [&] {
    b.route(ctx);
    b.experts(ctx);
    b.combine(ctx);
  });
}

// The same FLOPs through cuBLASLt as dense GEMMs (R rows × one expert's matrices): the ceiling.
void BM_DenseGemmCeiling(benchmark::State& state, Shape s) {
  if (cuda::device_count() == 0) return state.SkipWithError("no CUDA device");
  cuda::CudaContext ctx(0);
  Block b(ctx, s);
  b.route(ctx);
  const int64_t R = s.T * s.K;
  timed(state, ctx, b.gemm_flops(), [&] {
    cuda::gemm_bf16(ctx, b.gu.data(), DType::bf16, 2 * s.EI, b.xs.as<uint16_t>(), s.H, false,
                    b.wgu.as<uint16_t>(), s.H, true, R, 2 * s.EI, s.H);
    cuda::gemm_bf16(ctx, b.ys.data(), DType::f32, s.H, b.act.as<uint16_t>(), s.EI, false,
                    b.wd.as<uint16_t>(), s.EI, true, R, s.H, s.EI);
  });
}

}  // namespace

BENCHMARK_CAPTURE(BM_GroupedExpertGemms, qwen3_30b_a3b, kQwen3_30B)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DenseGemmCeiling, qwen3_30b_a3b, kQwen3_30B)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SparseBlock, qwen3_30b_a3b, kQwen3_30B)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GroupedExpertGemms, gpt_oss_20b, kGptOss20B)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DenseGemmCeiling, gpt_oss_20b, kGptOss20B)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SparseBlock, gpt_oss_20b, kGptOss20B)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
