// dflash.cpp — one CPU training step of the embedded default, in its two halves: the tiny target's
// tap forward over a 1,024-token row and the 1-layer drafter's forward + backward on it.
//
// The row packs documents of 40–99 tokens (the corpus' typical lengths; the first half of each is
// the unsupervised prompt, the second the supervised answer) with random token ids, 4 anchors per
// document, block 16, gamma 7, taps [3], mask 8000: the shapes of `dflash train` without a config
// (about 56 blocks, 896 block rows). The drafter is freshly initialised (drafter_init, seed 0).
// Reports wall time and the process CPU time (all threads) per step; on a shared machine read the
// CPU time, and the min aggregate of `--benchmark_repetitions=N`.
//   build/bench/cpu_step_bench [--benchmark_repetitions=5 --benchmark_report_aggregates_only=true]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <vector>

#include "core/parallel.hpp"
#include "core/rng.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_io.hpp"
#include "model/objective.hpp"
#include "model/target.hpp"

namespace {

using namespace dflash;

struct Step {
  TargetModel target;
  DrafterConfig cfg;
  DrafterLayout layout;
  std::vector<float> params, grads, embed;
  DrafterBatch batch;  // one row, as a step of the embedded default
  DrafterWorkspace<float> ws;

  Step()
      : target(
            TargetModel::load(std::filesystem::path(DFLASH_SOURCE_DIR) / "assets" / "tiny-qwen3")),
        cfg(drafter_config_for_target(target.config(), 1, {}, 8000, std::vector<int>{3})),
        layout(cfg),
        batch(cfg.block_size) {
    params.resize(static_cast<size_t>(layout.total));
    grads.resize(params.size());
    drafter_init(params, layout, 0);
    embed = target.embedding_f32();
    std::mt19937 g(5);
    const int32_t T = 1024;
    std::vector<int32_t> tokens(T), offsets{0};
    std::vector<uint8_t> mask(T);
    for (auto& t : tokens) t = static_cast<int32_t>(100 + g() % 7000);
    while (offsets.back() < T)
      offsets.push_back(std::min<int32_t>(T, offsets.back() + 40 + g() % 60));
    for (size_t d = 0; d + 1 < offsets.size(); ++d) {
      const int32_t s = offsets[d], e = offsets[d + 1];
      for (int32_t t = s; t < e; ++t) mask[t] = 2 * (t - s) >= e - s;
    }
    Rng rng(1);
    const std::vector<Anchor> anchors = sample_anchors(mask, offsets, 4, rng);
    const BlockTargets targets = block_targets(tokens, mask, offsets, anchors, cfg.block_size, 7.0);
    batch.append_row(tokens, offsets, anchors, targets);
    batch.validate();
  }
};

Step& step() {
  static Step s;
  return s;
}

void BM_TargetTaps(benchmark::State& state) {
  Step& s = step();
  set_parallel_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    Tensor f = s.target.forward_taps(s.batch.tokens, s.batch.doc_offsets, s.cfg.target_layer_ids);
    benchmark::DoNotOptimize(f.data<float>());
  }
  set_parallel_threads(0);
}

void BM_DrafterStep(benchmark::State& state) {
  Step& s = step();
  set_parallel_threads(static_cast<int>(state.range(0)));
  const Tensor f =
      s.target.forward_taps(s.batch.tokens, s.batch.doc_offsets, s.cfg.target_layer_ids);
  const DrafterTables<float> tables{s.embed.data(), s.embed.data()};  // tiny-qwen3 ties them
  for (auto _ : state) {
    std::fill(s.grads.begin(), s.grads.end(), 0.0f);
    const DrafterTrainResult r =
        drafter_train_step<float>(s.cfg, s.layout, s.params.data(), s.grads.data(), tables, s.batch,
                                  f.data<float>(), 1.0 / s.batch.weight_sum, s.ws);
    benchmark::DoNotOptimize(r.loss_sum);
  }
  state.counters["blocks"] = static_cast<double>(s.batch.N());
  set_parallel_threads(0);
}

void threads(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1)->Arg(2)->MeasureProcessCPUTime()->UseRealTime();
  b->Unit(benchmark::kMillisecond);
  b->ComputeStatistics(
      "min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
}

}  // namespace

BENCHMARK(BM_TargetTaps)->Apply(threads);
BENCHMARK(BM_DrafterStep)->Apply(threads);

BENCHMARK_MAIN();
