// Every cuBLASLt GEMM shape of one training step at the reference batch (`dflash bench --preset
// qwen3-8b`: Qwen3-8B target, 5-layer drafter, 4 × 2,048 context tokens, 2,048 blocks of 16), timed
// alone through gemm_bf16 exactly as the ops call it (same transposes, output dtype, beta, C ≠ D
// for the residual epilogue), with the plan's algorithm (tile, stages, split-K, CTA swizzle) and
// the TFLOP/s against the 825 TFLOP/s ceiling, and whether the plan came from the measured table
// (ops/gemm_plan_table.hpp) or the heuristic. Then the heuristic's candidates for the same
// descriptors and preferences (16 asked for, cuBLASLt 13.1 answers 8 on the H200; deterministic
// reduction schemes only; candidate 0 is its first) are timed too, each printed as one
// machine-readable line
//     PLAN sm=… lt=… M=… N=… K=… lda=… ldb=… ldc=… ta=… tb=… out=… acc=… cand=… ms=… algo=… tile=…
//          stages=… splitk=… reduction=… swizzle=… custom=… inner=… cluster=… ws=… rebuild=…
//          words=w0,…,w7 name=…
// (ws: the workspace it needs; rebuild: whether AlgoInit plus the attributes gives back the same
// words; words: the opaque cublasLtMatmulAlgo_t in hex), which tools/gemm_plan_table.py turns
// into the table; a candidate more than 3 % faster than the plan used is also printed in words.
// GPU time from CUDA events: the plan used, the median of 9 runs after 2 warm-up runs; the
// candidates, 2 warm-up runs each, then 15 rounds (--rounds=N) that run each candidate once in
// turn (drift falls on all alike), the median per candidate.
//
//     build/bench/gemm_bench [table|heuristic] [--rounds=N] [--only=PREFIX]
//         the plan source (default table); rounds per candidate (default 15); only the shapes
//         whose name starts with PREFIX (e.g. "target"). One H200, all shapes, 15 rounds: about
//         15 s.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/fill.hpp"
#include "ops/gemm_plan_table.hpp"

using namespace dflash;

namespace {

constexpr double kPeakTflops = 825.0;
constexpr int kWarmup = 2, kRuns = 9;
// Rounds of the candidates' timing: each round runs every candidate once, in order, so drift in
// clocks or temperature over a shape's measurement falls on all of them alike.
constexpr int kDefaultCandidateRounds = 15;
constexpr int kCandidates = 16;  // the heuristic's answers timed per shape

// One GEMM of the step: D[M,N] = op(A)·op(B) (+ C), as gemm_bf16's arguments.
struct Case {
  const char* name;
  int64_t M, N, K;
  bool trans_a, trans_b;
  DType out;
  float beta;
  bool c_separate;  // C ≠ D (the residual epilogue of linear_fwd_res_cuda)
  int per_step;     // calls per training step (target 34 layers, drafter 5)
};

// Sizes of the reference batch. CE: the fused CE's chunk of 8,192 block rows = 512 blocks, whose
// 15 head rows each enter the GEMMs (the anchor slot is skipped: FusedCeParams::skip_first_of).
constexpr int64_t T = 8192, NK = 32768, TK = T + NK, H = 4096, I = 12288, QD = 4096, KD = 1024;
constexpr int64_t F = 5 * H, V = 151936, CE = 8192 / 16 * 15;
constexpr DType f32 = DType::f32, bf = DType::bf16;

// linear_fwd: y[T,OUT] = x·Wᵀ → (M T, N OUT, K IN, ta false, tb true).
// linear_bwd dx: dx[T,IN] = dy·W → (T, IN, OUT, false, false); dW[OUT,IN] += dyᵀ·x → (OUT, IN, T,
// true, false, f32, beta 1).
const std::vector<Case> kCases = {
    {"target q|k|v_proj", T, QD + 2 * KD, H, false, true, bf, 0, false, 34},
    {"target o_proj (+= stream)", T, H, QD, false, true, f32, 1, false, 34},
    {"target gate|up", T, 2 * I, H, false, true, bf, 0, false, 34},
    {"target down (+= stream)", T, H, I, false, true, f32, 1, false, 34},
    {"drafter fc", T, H, F, false, true, f32, 0, false, 1},
    {"drafter q_proj", NK, QD, H, false, true, bf, 0, false, 5},
    {"drafter k/v_proj", TK, KD, H, false, true, bf, 0, false, 10},
    {"drafter o_proj (res epilogue)", NK, H, QD, false, true, f32, 1, true, 5},
    {"drafter gate|up", NK, 2 * I, H, false, true, bf, 0, false, 5},
    {"drafter down (res epilogue)", NK, H, I, false, true, f32, 1, true, 5},
    {"CE logits chunk", CE, V, H, false, true, f32, 0, false, 4},
    {"CE d_hidden chunk", CE, H, V, false, false, f32, 0, false, 4},
    {"bwd down dx", NK, I, H, false, false, bf, 0, false, 5},
    {"bwd down dW", H, I, NK, true, false, f32, 1, false, 5},
    {"bwd gate|up dx", NK, H, 2 * I, false, false, f32, 0, false, 5},
    {"bwd gate|up dW", 2 * I, H, NK, true, false, f32, 1, false, 5},
    {"bwd o_proj dx", NK, QD, H, false, false, bf, 0, false, 5},
    {"bwd o_proj dW", H, QD, NK, true, false, f32, 1, false, 5},
    {"bwd k_proj dx", TK, H, KD, false, false, f32, 0, false, 5},
    {"bwd v_proj dx (+=)", TK, H, KD, false, false, f32, 1, false, 5},
    {"bwd q_proj dx (+=)", NK, H, QD, false, false, f32, 1, false, 5},
    {"bwd k/v_proj dW", KD, H, TK, true, false, f32, 1, false, 10},
    {"bwd q_proj dW", QD, H, NK, true, false, f32, 1, false, 5},
    {"bwd fc dW", H, F, T, true, false, f32, 1, false, 1},
};

float median_ms(cudaStream_t s, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  DFLASH_CUDA_CHECK(cudaEventCreate(&a));
  DFLASH_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < kWarmup; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < kRuns; ++i) {
    DFLASH_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    DFLASH_CUDA_CHECK(cudaEventRecord(b, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Medians of fns[i]'s GPU time over `rounds` interleaved rounds, after kWarmup runs each.
std::vector<float> interleaved_median_ms(cudaStream_t s,
                                         const std::vector<std::function<void()>>& fns,
                                         int rounds) {
  cudaEvent_t a, b;
  DFLASH_CUDA_CHECK(cudaEventCreate(&a));
  DFLASH_CUDA_CHECK(cudaEventCreate(&b));
  for (const auto& fn : fns)
    for (int i = 0; i < kWarmup; ++i) fn();
  std::vector<std::vector<float>> ms(fns.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < fns.size(); ++i) {
      DFLASH_CUDA_CHECK(cudaEventRecord(a, s));
      fns[i]();
      DFLASH_CUDA_CHECK(cudaEventRecord(b, s));
      DFLASH_CUDA_CHECK(cudaEventSynchronize(b));
      float t = 0;
      DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
      ms[i].push_back(t);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<float> med;
  for (std::vector<float>& v : ms) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

std::string algo_string(const cublasLtMatmulAlgo_t& algo) {
  return gemm_algo_config_string(cuda::gemm_algo_config(algo));
}

// Whether AlgoInit(id) plus the readable attributes gives back the same words (informative: the
// table restores the words, which cuBLASLt documents as serializable for the same version).
bool rebuilds_from_attributes(cuda::CudaContext& ctx, const GemmShapeKey& k,
                              const GemmAlgoConfig& c) {
  cublasLtMatmulAlgo_t algo{};
  const cudaDataType_t ct = k.out == f32 ? CUDA_R_32F : CUDA_R_16BF;
  if (cublasLtMatmulAlgoInit(ctx.cublaslt(), CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF,
                             CUDA_R_16BF, ct, ct, c.algo_id, &algo) != CUBLAS_STATUS_SUCCESS)
    return false;
  const uint16_t inner = static_cast<uint16_t>(c.inner_shape),
                 cluster = static_cast<uint16_t>(c.cluster_shape);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile, 4);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages, 4);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.split_k, 4);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.reduction,
                                       4);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c.swizzle, 4);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &c.custom, 4);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, 2);
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, 2);
  return std::equal(std::begin(algo.data), std::end(algo.data), c.words.begin());
}

// One machine-readable line per candidate, what tools/gemm_plan_table.py reads.
void print_plan_line(const Case& k, const GemmShapeKey& key, int cand, float ms,
                     const GemmAlgoConfig& c, size_t ws, bool rebuilds) {
  std::printf(
      "PLAN sm=%d lt=%zu M=%ld N=%ld K=%ld lda=%ld ldb=%ld ldc=%ld ta=%d tb=%d out=%s "
      "acc=%d cand=%d ms=%.4f algo=%d tile=%u stages=%u splitk=%d reduction=%u "
      "swizzle=%u custom=%u inner=%u cluster=%u ws=%zu rebuild=%s words=",
      key.sm, static_cast<size_t>(key.lt_version), key.M, key.N, key.K, key.lda, key.ldb, key.ldc,
      key.trans_a ? 1 : 0, key.trans_b ? 1 : 0, key.out == f32 ? "f32" : "bf16",
      key.accumulate ? 1 : 0, cand, ms, c.algo_id, c.tile, c.stages, c.split_k, c.reduction,
      c.swizzle, c.custom, c.inner_shape, c.cluster_shape, ws, rebuilds ? "same" : "differs");
  for (size_t i = 0; i < c.words.size(); ++i)
    std::printf("%s%016lx", i ? "," : "", static_cast<unsigned long>(c.words[i]));
  std::printf(" name=%s\n", k.name);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = kDefaultCandidateRounds;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.starts_with("--rounds=")) {
      rounds = std::atoi(arg.c_str() + 9);
      if (rounds < 1) {
        std::fprintf(stderr, "gemm_bench: --rounds must be >= 1 (got '%s')\n", arg.c_str() + 9);
        return 2;
      }
    } else if (arg.starts_with("--only=")) {
      only = arg.substr(7);
    } else if (arg == "table" || arg == "heuristic") {
      cuda::gemm_plan_source_set(cuda::gemm_plan_source_parse(arg, "gemm_bench argument"));
    } else {
      std::fprintf(stderr,
                   "usage: gemm_bench [table|heuristic] [--rounds=N] [--only=PREFIX] (got '%s')\n",
                   arg.c_str());
      return 2;
    }
  }
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "gemm_bench: no CUDA device\n");
    return 1;
  }
  cuda::CudaContext ctx(0);
  // Operand buffers sized for the largest case of each role.
  size_t max_a = 0, max_b = 0, max_c = 0;
  for (const Case& c : kCases) {
    max_a = std::max(max_a, static_cast<size_t>(c.M * c.K));
    max_b = std::max(max_b, static_cast<size_t>(c.K * c.N));
    max_c = std::max(max_c, static_cast<size_t>(c.M * c.N));
  }
  cuda::DeviceBuffer a = ctx.scratch(max_a * 2), b = ctx.scratch(max_b * 2);
  cuda::DeviceBuffer c = ctx.scratch(max_c * 4), c_in = ctx.scratch(max_c * 4);
  fill_uniform_cuda(ctx, a.as<uint16_t>(), static_cast<int64_t>(max_a), 0.0f, 0.05f, 1);
  fill_uniform_cuda(ctx, b.as<uint16_t>(), static_cast<int64_t>(max_b), 0.0f, 0.05f, 2);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(c.data(), 0, max_c * 4, ctx.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(c_in.data(), 0, max_c * 4, ctx.stream()));
  ctx.synchronize();

  std::printf("%-30s %6s %6s %6s %2s %4s %4s %9s %8s %6s %9s  %-9s %s\n", "gemm", "M", "N", "K",
              "ta", "out", "beta", "ms", "TFLOP/s", "%825", "ms/step", "source", "cuBLASLt plan");
  double step_ms = 0, step_tflop = 0, step_first_ms = 0;
  int n_table = 0;
  int n_cases = 0;
  for (const Case& k : kCases) {
    if (!std::string_view(k.name).starts_with(only)) continue;
    ++n_cases;
    const int64_t lda = k.trans_a ? k.M : k.K, ldb = k.trans_b ? k.K : k.N, ldc = k.N;
    auto run = [&] {
      cuda::gemm_bf16(ctx, c.data(), k.out, ldc, a.as<uint16_t>(), lda, k.trans_a, b.as<uint16_t>(),
                      ldb, k.trans_b, k.M, k.N, k.K, 1.0f, k.beta,
                      k.c_separate ? c_in.data() : nullptr);
    };
    ctx.gemm_plans().clear();
    const float ms = median_ms(ctx.stream(), run);
    const double tflop = 2.0 * k.M * k.N * k.K / 1e12;
    const cuda::GemmPlan& plan = *ctx.gemm_plans().begin()->second;
    const bool from_table = plan.source != "heuristic";
    n_table += from_table ? 1 : 0;
    std::printf("%-30s %6ld %6ld %6ld %2d %4s %4.0f %9.3f %8.0f %6.1f %9.2f  %-9s %s\n", k.name,
                k.M, k.N, k.K, k.trans_a ? 1 : 0, k.out == f32 ? "f32" : "bf16", k.beta, ms,
                tflop / ms * 1e3, 100.0 * tflop / ms * 1e3 / kPeakTflops, ms * k.per_step,
                from_table ? "table" : "heuristic", algo_string(plan.algo).c_str());
    step_ms += ms * k.per_step;
    step_tflop += tflop * k.per_step;

    // The heuristic's candidates for the same descriptors and preferences (deterministic
    // schemes only), each timed and printed as a PLAN line; candidate 0 is the heuristic's first.
    auto res = cuda::gemm_heuristic(ctx, plan, kCandidates);
    std::erase_if(res, [&](const auto& r) { return r.workspaceSize > ctx.workspace_bytes(); });
    const float alpha = 1.0f, beta = k.beta;
    const void* cp = k.c_separate ? c_in.data() : c.data();
    std::vector<std::function<void()>> runs;
    for (const cublasLtMatmulHeuristicResult_t& r : res) {
      runs.push_back([&, algo = r.algo] {
        cublasLtMatmul(ctx.cublaslt(), plan.op, &alpha, b.data(), plan.a, a.data(), plan.b, &beta,
                       cp, plan.c, c.data(), plan.c, &algo, ctx.workspace(), ctx.workspace_bytes(),
                       ctx.stream());
      });
    }
    const std::vector<float> cand_ms = interleaved_median_ms(ctx.stream(), runs, rounds);
    float best = ms, first = cand_ms.empty() ? ms : cand_ms[0];
    int best_i = -1;
    for (size_t i = 0; i < res.size(); ++i) {
      const GemmAlgoConfig cfg = cuda::gemm_algo_config(res[i].algo);
      print_plan_line(k, plan.key, static_cast<int>(i), cand_ms[i], cfg, res[i].workspaceSize,
                      rebuilds_from_attributes(ctx, plan.key, cfg));
      if (cand_ms[i] < best) best = cand_ms[i], best_i = static_cast<int>(i);
    }
    step_first_ms += first * k.per_step;
    if (best_i >= 0 && best < 0.97f * ms)
      std::printf("%-30s   candidate %d of %zu is faster: %.3f ms (%.0f TFLOP/s), %s\n", "", best_i,
                  res.size(), best, tflop / best * 1e3, algo_string(res[best_i].algo).c_str());
  }
  std::printf("plans: %d from the table, %d from the heuristic (%s)\n", n_table, n_cases - n_table,
              cuda::gemm_plan_source_name(cuda::gemm_plan_source()));
  std::printf("sum over one step's GEMMs with the heuristic's first plans: %.1f ms\n",
              step_first_ms);
  std::printf("sum over one step's GEMMs: %.1f ms, %.1f TFLOP, %.0f TFLOP/s (%.1f %% of %.0f)\n",
              step_ms, step_tflop, step_tflop / step_ms * 1e3,
              100.0 * step_tflop / step_ms * 1e3 / kPeakTflops, kPeakTflops);
  return 0;
}
