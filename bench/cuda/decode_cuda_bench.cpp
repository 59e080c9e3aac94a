// Speculative decoding on the GPU (infer/decoder_cuda.hpp), the figures of issue 16:
//   Step/…:  a Qwen3-8B-shaped target with random weights and a random 5-layer drafter (block 16),
//            every request's caches prefilled with 512 random tokens; the target's one-token step
//            (K = 1) and its 16-row verify step (K = 16) — target forward over the KV cache,
//            final norm, LM head and argmax —, the drafter's block forward with its proposals, and
//            a whole speculative step without acceptance, at batch 1 and 8. Each is a captured
//            CUDA graph replayed; GPU time of each replay from CUDA events (manual time; kIters).
//            The layer projections run on cuBLASLt; …RowGemm: on decode_linear_cuda instead
//            (SpeculativeDecoderCuda::row_gemm(true)). TargetStep1Pad16 is the one-token step
//            with its GEMMs run on 16 rows (pad_gemm_rows).
//   Gemm/…:  the cuBLASLt GEMM (backend/cuda/gemm.hpp) of each 8B weight shape (the fused q/k/v
//            projection the steps run and, for comparison, its parts) at M = 1, 8, 16
//            and 128 rows (bf16 in, f32 out), with the weight bytes read per second: what the steps
//            above are made of. DecodeLinear/…: the same shapes on decode_linear_cuda.
//   Sample/…: the sampling work of one speculative step at V = 151,936 (ops/sample.hpp): the
//            drafter's B·K rows processed into q, the drafts drawn, the target's B·K rows processed
//            into p in place, the rejection rule; B = 1 and 8, K = 16, random logits (normal, sd
//            3), plain temperature 1 (arg 0) or temperature 0.7 with top-k 50 and top-p 0.9 (arg
//            1). What sampling adds to the Step/SpecStep16 figures (greedy: two argmax passes).
//   Tiny/…:  the tiny fixture (tiny-qwen3, a random 2-layer drafter of block 16, so τ ≈ 1) over
//            62 eval prompts (the first 22 of each source), 128 new tokens each, greedy: aggregate
//            tokens/s of target-only and speculative decoding at batch 1 and 64 (wall time of the
//            call).
//
//     build/bench/decode_cuda_bench --benchmark_counters_tabular=true
// The source tree is found through DFLASH_TEST_SOURCE_DIR (else the configured source dir).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/gemm.hpp"
#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder_cuda.hpp"
#include "infer/eval.hpp"
#include "model/drafter_io.hpp"
#include "model/presets.hpp"
#include "ops/decode_fused.hpp"
#include "ops/sample.hpp"

using namespace dflash;

namespace {

constexpr int kContext = 512, kBlock = 16, kMaxBatch = 8, kIters = 30;

std::filesystem::path source_dir() {
  const char* s = std::getenv("DFLASH_TEST_SOURCE_DIR");
  return s ? std::filesystem::path(s) : std::filesystem::path(DFLASH_SOURCE_DIR);
}

// One decoder at Qwen3-8B shapes for the whole process (16 GB of weights made once).
SpeculativeDecoderCuda& big() {
  static cuda::CudaContext ctx(0);
  static std::unique_ptr<SpeculativeDecoderCuda> dec = [] {
    const ModelPreset& p = model_preset("qwen3-8b");
    DrafterSizes sizes;
    sizes.block_size = kBlock;
    const DrafterConfig d = drafter_config_for_target(p.config, 5, sizes, p.mask_token_id);
    DecoderCudaLimits lim{kMaxBatch, kContext + 2 * kBlock, kContext};
    auto r = std::make_unique<SpeculativeDecoderCuda>(ctx, p.config, d, 1, lim);
    std::mt19937 rng(3);
    std::uniform_int_distribution<int32_t> tok(0, 150000);
    std::vector<int32_t> prompt(kContext);
    for (auto& t : prompt) t = tok(rng);
    r->bench_prefill(kMaxBatch, prompt);
    return r;
  }();
  return *dec;
}

void run_part(benchmark::State& st, SpeculativeDecoderCuda::BenchPart part, int K, int pad = 1,
              bool row_gemm = false) {
  if (cuda::device_count() == 0) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const int B = static_cast<int>(st.range(0));
  SpeculativeDecoderCuda& dec = big();
  dec.pad_gemm_rows(pad);
  dec.row_gemm(row_gemm);
  cudaStream_t s = dec.context().stream();
  dec.bench_enqueue(part, B, K);  // capture + warm-up
  dec.context().synchronize();
  cudaEvent_t e0, e1;
  DFLASH_CUDA_CHECK(cudaEventCreate(&e0));
  DFLASH_CUDA_CHECK(cudaEventCreate(&e1));
  for (auto _ : st) {
    DFLASH_CUDA_CHECK(cudaEventRecord(e0, s));
    dec.bench_enqueue(part, B, K);
    DFLASH_CUDA_CHECK(cudaEventRecord(e1, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  dec.pad_gemm_rows(1);
  dec.row_gemm(false);
  st.counters["batch"] = B;
  st.counters["rows"] = B * K;
  st.counters["gemm_pad"] = pad;
  st.counters["row_gemm"] = row_gemm ? 1 : 0;
  st.counters["context"] = kContext;
}

void BM_TargetStep1(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::target_step, 1);
}
void BM_TargetVerify16(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::target_step, kBlock);
}
void BM_TargetStep1Pad16(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::target_step, 1, 16);
}
void BM_TargetStep1RowGemm(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::target_step, 1, 1, true);
}
void BM_TargetVerify16RowGemm(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::target_step, kBlock, 1, true);
}
void BM_DrafterBlock16RowGemm(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::draft, kBlock, 1, true);
}
void BM_DrafterBlock16(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::draft, kBlock);
}
void BM_SpecStep16(benchmark::State& st) {
  run_part(st, SpeculativeDecoderCuda::BenchPart::spec_step, kBlock);
}

// ---- the GEMMs of the steps

// The GEMM of {M, N, K} = st.range(0..2) (bf16 in, f32 out), cuBLASLt or decode_linear_cuda.
void run_gemm(benchmark::State& st, bool row_gemm) {
  if (cuda::device_count() == 0) {
    st.SkipWithError("no CUDA device");
    return;
  }
  static cuda::CudaContext ctx(0);
  const int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  cuda::DeviceBuffer a = ctx.scratch(static_cast<size_t>(M * K) * 2);
  cuda::DeviceBuffer w = ctx.scratch(static_cast<size_t>(N * K) * 2);
  cuda::DeviceBuffer c = ctx.scratch(static_cast<size_t>(M * N) * 4);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(a.data(), 0, a.bytes(), ctx.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(w.data(), 0, w.bytes(), ctx.stream()));
  auto gemm = [&] {
    if (row_gemm)
      decode_linear_cuda(ctx, c.as<float>(), a.as<uint16_t>(), w.as<uint16_t>(), M, K, N, false);
    else
      cuda::gemm_bf16(ctx, c.data(), DType::f32, N, a.as<uint16_t>(), K, false, w.as<uint16_t>(), K,
                      true, M, N, K);
  };
  gemm();
  ctx.synchronize();
  cudaEvent_t e0, e1;
  DFLASH_CUDA_CHECK(cudaEventCreate(&e0));
  DFLASH_CUDA_CHECK(cudaEventCreate(&e1));
  for (auto _ : st) {
    DFLASH_CUDA_CHECK(cudaEventRecord(e0, ctx.stream()));
    gemm();
    DFLASH_CUDA_CHECK(cudaEventRecord(e1, ctx.stream()));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  st.counters["weight_GB_per_s"] = benchmark::Counter(
      static_cast<double>(N * K * 2) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
void BM_Gemm(benchmark::State& st) {
  run_gemm(st, false);
}
void BM_DecodeLinear(benchmark::State& st) {
  run_gemm(st, true);
}

// ---- sampling at the 8B vocabulary

void BM_Sample(benchmark::State& st) {
  if (cuda::device_count() == 0) {
    st.SkipWithError("no CUDA device");
    return;
  }
  static cuda::CudaContext ctx(0);
  const int64_t B = st.range(0), K = kBlock, V = 151936, R = B * K;
  const bool filtered = st.range(1) != 0;
  const SampleParamsDevice prm{filtered ? 1.0f / 0.7f : 1.0f, filtered ? 50 : 0,
                               filtered ? 0.9 : 1.0};
  std::vector<float> logits(static_cast<size_t>(R * V));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (float& x : logits) x = nd(rng);
  const size_t lb = logits.size() * sizeof(float);
  cuda::DeviceBuffer d_src = ctx.scratch(lb), d_logits = ctx.scratch(lb), d_q = ctx.scratch(lb);
  cuda::DeviceBuffer d_prm = ctx.scratch(sizeof(prm));
  // block [B·K], out [B·(K+1)], lens, steps, status, active [B each].
  cuda::DeviceBuffer d_i32 = ctx.scratch(static_cast<size_t>(B * (2 * K + 5)) * sizeof(int32_t));
  cuda::DeviceBuffer d_seeds = ctx.scratch(static_cast<size_t>(B) * 8);
  DFLASH_CUDA_CHECK(cudaMemcpy(d_src.data(), logits.data(), lb, cudaMemcpyHostToDevice));
  DFLASH_CUDA_CHECK(cudaMemcpy(d_prm.data(), &prm, sizeof(prm), cudaMemcpyHostToDevice));
  DFLASH_CUDA_CHECK(cudaMemset(d_i32.data(), 0, d_i32.bytes()));
  DFLASH_CUDA_CHECK(cudaMemset(d_seeds.data(), 0, d_seeds.bytes()));
  int32_t* i32 = d_i32.as<int32_t>();
  int32_t *block = i32, *out = block + B * K, *lens = out + B * (K + 1), *steps = lens + B,
          *status = steps + B, *active = status + B;
  std::vector<int32_t> ones(static_cast<size_t>(B), 1);
  DFLASH_CUDA_CHECK(cudaMemcpy(active, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  const auto* pp = d_prm.as<SampleParamsDevice>();
  auto* seeds = d_seeds.as<uint64_t>();
  cudaStream_t s = ctx.stream();
  auto step = [&] {  // the target's logits are consumed in place: restore them first (not timed)
    sample_probs_cuda(ctx, d_q.as<float>(), d_src.as<float>(), R, V, K, pp, status, K);
    sample_drafts_cuda(ctx, block, d_q.as<float>(), seeds, steps, B, K, V);
    sample_probs_cuda(ctx, d_logits.as<float>(), d_logits.as<float>(), R, V, 0, pp, status, K);
    spec_sample_accept_cuda(ctx, out, lens, block, steps, d_logits.as<float>(), d_q.as<float>(),
                            seeds, status, active, B, K, V, 0);
  };
  cudaEvent_t e0, e1;
  DFLASH_CUDA_CHECK(cudaEventCreate(&e0));
  DFLASH_CUDA_CHECK(cudaEventCreate(&e1));
  for (auto _ : st) {
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(d_logits.data(), d_src.data(), lb, cudaMemcpyDeviceToDevice, s));
    DFLASH_CUDA_CHECK(cudaEventRecord(e0, s));
    step();
    DFLASH_CUDA_CHECK(cudaEventRecord(e1, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  st.counters["batch"] = static_cast<double>(B);
  st.counters["rows"] = static_cast<double>(2 * R);
}

// ---- tiny fixture tokens/s

struct Tiny {
  TargetModel target;
  LoadedDrafter drafter;
  std::vector<std::vector<int32_t>> prompts;
};

const Tiny& tiny() {
  static const Tiny t = [] {
    const auto dir = source_dir() / "assets" / "tiny-qwen3";
    TargetModel target = TargetModel::load(dir);
    DrafterSizes sizes;
    sizes.block_size = kBlock;
    const DrafterConfig c = drafter_config_for_target(target.config(), 2, sizes, 8000);
    Tiny r{std::move(target), LoadedDrafter{c, DrafterLayout(c), {}}, {}};
    r.drafter.params.resize(static_cast<size_t>(r.drafter.layout.total));
    drafter_init(r.drafter.params, r.drafter.layout, 7);
    const Tokenizer tok = Tokenizer::load(dir);
    const ChatTemplate tmpl = resolve_chat_template(dir, "");
    for (const EvalPrompt& p : load_eval_prompts(
             source_dir() / "assets" / "data" / "eval_prompts.jsonl", tmpl, tok, 0, 22))
      r.prompts.push_back(p.tokens);
    return r;
  }();
  return t;
}

void run_tiny(benchmark::State& st, bool speculative) {
  if (cuda::device_count() == 0) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const int batch = static_cast<int>(st.range(0));
  const Tiny& t = tiny();
  DecodeOptions o;
  o.max_new_tokens = 128;
  cuda::CudaContext ctx(0);
  SpeculativeDecoderCuda dec(ctx, t.target, t.drafter,
                             decoder_cuda_limits(t.prompts, o.max_new_tokens, kBlock, batch));
  auto call = [&] {
    return speculative ? dec.generate(t.prompts, o, batch)
                       : dec.target_generate(t.prompts, o, batch);
  };
  (void)call();  // graphs captured, caches warm
  int64_t tokens = 0, steps = 0, accepted = 0;
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<DecodeResult> r = call();
    st.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (const DecodeResult& d : r) {
      tokens += static_cast<int64_t>(d.tokens.size());
      steps += static_cast<int64_t>(d.accept_lengths.size());
      for (int a : d.accept_lengths) accepted += a;
    }
  }
  st.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
  st.counters["batch"] = batch;
  if (speculative && steps > 0) st.counters["tau"] = static_cast<double>(accepted) / steps;
}

void BM_TinyTarget(benchmark::State& st) {
  run_tiny(st, false);
}
void BM_TinySpeculative(benchmark::State& st) {
  run_tiny(st, true);
}

}  // namespace

#define DFLASH_STEP_BENCH(fn) \
  BENCHMARK(fn)->Arg(1)->Arg(8)->UseManualTime()->Iterations(kIters)->Unit(benchmark::kMillisecond)
DFLASH_STEP_BENCH(BM_TargetStep1);
DFLASH_STEP_BENCH(BM_TargetStep1Pad16);
DFLASH_STEP_BENCH(BM_TargetStep1RowGemm);
DFLASH_STEP_BENCH(BM_TargetVerify16RowGemm);
DFLASH_STEP_BENCH(BM_DrafterBlock16RowGemm);
DFLASH_STEP_BENCH(BM_TargetVerify16);
DFLASH_STEP_BENCH(BM_DrafterBlock16);
DFLASH_STEP_BENCH(BM_SpecStep16);
// {M, N, K}: q/o (4096²), k/v (1024 × 4096), fused q/k/v (6144 × 4096), gate+up (24576 × 4096),
// down (4096 × 12288), LM head; M = 1, 8, 16 and 128 step rows.
static void decode_gemm_shapes(benchmark::internal::Benchmark* b) {
  struct Shape {
    int64_t n, k;
  };
  for (const Shape w : {Shape{4096, 4096}, Shape{6144, 4096}, Shape{1024, 4096}, Shape{24576, 4096},
                        Shape{4096, 12288}, Shape{151936, 4096}}) {
    b->ArgsProduct({{1, 8, 16, 128}, {w.n}, {w.k}});
  }
}
BENCHMARK(BM_Gemm)
    ->Apply(decode_gemm_shapes)
    ->UseManualTime()
    ->Iterations(kIters)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeLinear)
    ->Apply(decode_gemm_shapes)
    ->UseManualTime()
    ->Iterations(kIters)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Sample)
    ->ArgsProduct({{1, 8}, {0, 1}})
    ->UseManualTime()
    ->Iterations(kIters)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TinyTarget)
    ->Arg(1)
    ->Arg(64)
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TinySpeculative)
    ->Arg(1)
    ->Arg(64)
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
