// dflash.cpp — CPU linear layer at the tiny target's decoding shapes: y[T, OUT] = x·Wᵀ for
// T = 1 (a decoded token), 16 (a verified block: the few-rows kernel), 17 and 64 (the OpenBLAS
// GEMM), with f32 and bf16 weights, on 1 thread and on the default pool.
//
// Reports GFLOP/s (2·T·IN·OUT per call) and GB/s of weight bytes read. Run with
// `--benchmark_repetitions=N` on a shared machine and read the min aggregate (the other helpers'
// load only ever slows a run down).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.hpp"
#include "core/parallel.hpp"
#include "ops/linear.hpp"

namespace {

// Args: T, IN, OUT, bf16 (0/1), threads (0 = default).
void BM_LinearFwd(benchmark::State& state) {
  const int64_t T = state.range(0), IN = state.range(1), OUT = state.range(2);
  const bool bf16 = state.range(3) != 0;
  dflash::set_parallel_threads(static_cast<int>(state.range(4)));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * IN)), w(static_cast<size_t>(OUT * IN));
  std::vector<float> y(static_cast<size_t>(T * OUT));
  for (auto& v : x) v = u(rng);
  for (auto& v : w) v = u(rng);
  std::vector<uint16_t> wb(w.size());
  std::transform(w.begin(), w.end(), wb.begin(), dflash::f32_to_bf16_bits);
  for (auto _ : state) {
    if (bf16) {
      dflash::linear_fwd_cpu(y.data(), x.data(), wb.data(), nullptr, T, IN, OUT);
    } else {
      dflash::linear_fwd_cpu(y.data(), x.data(), w.data(), nullptr, T, IN, OUT);
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double calls = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * T * IN * OUT * calls / 1e9, benchmark::Counter::kIsRate);
  state.counters["GB/s(W)"] = benchmark::Counter(
      static_cast<double>(OUT * IN) * (bf16 ? 2 : 4) * calls / 1e9, benchmark::Counter::kIsRate);
  dflash::set_parallel_threads(0);
}

void decode_shapes(benchmark::internal::Benchmark* b) {
  // tiny-qwen3: q/o 384→384, gate/up 384→1024, down 1024→384, LM head 384→8192.
  const int64_t shapes[][2] = {{384, 384}, {384, 1024}, {1024, 384}, {384, 8192}};
  for (int64_t threads : {1, 0})
    for (int64_t bf16 : {0, 1})
      for (int64_t T : {1, 16, 17, 64})
        for (const auto& s : shapes) b->Args({T, s[0], s[1], bf16, threads});
  b->ArgNames({"T", "IN", "OUT", "bf16", "threads"});
  b->ComputeStatistics(
      "min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
}

}  // namespace

BENCHMARK(BM_LinearFwd)->Apply(decode_shapes)->MinTime(0.05);

BENCHMARK_MAIN();
