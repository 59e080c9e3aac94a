// The DFlash attention kernels alone at the reference batch (`dflash bench --preset qwen3-8b`'s
// drafter attention: 4 documents of 2,048 context tokens, 512 anchors per document = 2,048 blocks
// of 16 = 32,768 query rows, 32 query / 8 KV heads, head_dim 128), every CUDA kernel family in
// one process on the same inputs: forward and backward per family, GPU time from CUDA events
// (median of --reps runs after --warmup runs, default 10 and 2), and the % of the floor: the
// useful FLOPs at 825 TFLOP/s, counted as the bench counts them (forward 4·D·NH·visible keys,
// backward 2.5× that). Small and quick, so that Nsight Compute can profile single launches of
// each kernel:
//
//     build/bench/attention_bench [--reps N] [--warmup N] [--families wgmma,tensor_core]
//                                 [--head-dim 64|128] [--bwd-only]
//
// (under Nsight Compute: --reps 1 --warmup 0 --bwd-only launches each backward kernel once per
// family, after one untimed forward for o and lse)
//
// Inputs: q, k, v, dout uniform in [-1, 1) (fill_uniform_cuda, fixed seeds); the block rows'
// ranges as drafter_batch_block_rows makes them (block i at anchor a of document [s, e) sees
// [s, a) ∪ [T + 16i, T + 16i + 16)), anchors from sample_anchors with a fixed seed on an all-ones
// loss mask, as the bench's step. Exit status 1 with a message on a bad option.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "model/objective.hpp"
#include "ops/attention.hpp"
#include "ops/fill.hpp"

using namespace dflash;

namespace {

constexpr double kPeakFlops = 825e12;
constexpr int kDocs = 4, kDocLength = 2048, kAnchors = 512, kBlock = 16;
constexpr int kHeads = 32, kKvHeads = 8;

struct Family {
  const char* name;
  AttnCudaKernels kernels;
};
const Family kFamilies[] = {
    {"wgmma", AttnCudaKernels::wgmma},
    {"tensor_core", AttnCudaKernels::tensor_core},
};

// A device buffer freed at scope end.
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { DFLASH_CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Median GPU ms of `reps` runs of fn after `warmup` runs.
template <typename F>
double time_ms(cuda::CudaContext& ctx, int warmup, int reps, F&& fn) {
  cudaEvent_t a = ctx.new_event(true), b = ctx.new_event(true);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    DFLASH_CUDA_CHECK(cudaEventRecord(a, ctx.stream()));
    fn();
    DFLASH_CUDA_CHECK(cudaEventRecord(b, ctx.stream()));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The reference batch's block rows: ranges [NK] over keys [context T ; blocks NK].
std::vector<AttnRange> block_ranges(int64_t& T, int64_t& NK) {
  T = static_cast<int64_t>(kDocs) * kDocLength;
  std::vector<uint8_t> mask(static_cast<size_t>(T), 1);
  std::vector<int32_t> offsets;
  for (int d = 0; d <= kDocs; ++d) offsets.push_back(d * kDocLength);
  Rng rng(12345);
  const std::vector<Anchor> anchors = sample_anchors(mask, offsets, kAnchors, rng);
  NK = static_cast<int64_t>(anchors.size()) * kBlock;
  std::vector<AttnRange> r(static_cast<size_t>(NK));
  for (size_t i = 0; i < anchors.size(); ++i) {
    const int32_t s = offsets[static_cast<size_t>(anchors[i].doc)];
    const auto own = static_cast<int32_t>(T + static_cast<int64_t>(i) * kBlock);
    for (int j = 0; j < kBlock; ++j) r[i * kBlock + j] = {s, anchors[i].pos, own, own + kBlock};
  }
  return r;
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "attention_bench: %s\nusage: attention_bench [--reps N] [--families a,b,...] "
               "[--warmup N] [--head-dim 64|128] [--bwd-only]\n",
               why.c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) try {
  int reps = 10, warmup = 2;
  int64_t D = 128;
  bool bwd_only = false;
  std::vector<Family> fams;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--reps") {
      reps = std::atoi(value().c_str());
      if (reps < 1) usage("--reps must be at least 1");
    } else if (arg == "--warmup") {
      warmup = std::atoi(value().c_str());
      if (warmup < 0) usage("--warmup must be at least 0");
    } else if (arg == "--head-dim") {
      D = std::atoi(value().c_str());
      if (D != 64 && D != 128) usage("--head-dim must be 64 or 128");
    } else if (arg == "--bwd-only") {
      bwd_only = true;
    } else if (arg == "--families") {
      std::string list = value() + ",";
      for (size_t at = 0, comma; (comma = list.find(',', at)) != std::string::npos;
           at = comma + 1) {
        const std::string name = list.substr(at, comma - at);
        const Family* f = std::find_if(std::begin(kFamilies), std::end(kFamilies),
                                       [&](const Family& x) { return name == x.name; });
        if (f == std::end(kFamilies)) usage("unknown family '" + name + "'");
        fams.push_back(*f);
      }
    } else {
      usage("unknown option '" + arg + "'");
    }
  }
  if (fams.empty()) fams.assign(std::begin(kFamilies), std::end(kFamilies));

  cuda::CudaContext ctx(0);
  int64_t T = 0, NK = 0;
  const std::vector<AttnRange> ranges = block_ranges(T, NK);
  const int64_t Tq = NK, Tk = T + NK, QD = kHeads * D, KD = kKvHeads * D;
  double visible = 0;
  for (const AttnRange& r : ranges) visible += (r.hi1 - r.lo1) + (r.hi2 - r.lo2);
  const double fwd_flops = 4.0 * static_cast<double>(D * kHeads) * visible;
  Buf q(Tq * QD * 2), k(Tk * KD * 2), v(Tk * KD * 2), o(Tq * QD * 2), lse(kHeads * Tq * 4),
      dq(Tq * QD * 2), dk(Tk * KD * 2), dv(Tk * KD * 2), dout(Tq * QD * 2),
      rg(ranges.size() * sizeof(AttnRange));
  DFLASH_CUDA_CHECK(
      cudaMemcpy(rg.p, ranges.data(), ranges.size() * sizeof(AttnRange), cudaMemcpyHostToDevice));
  fill_uniform_cuda(ctx, q.as<uint16_t>(), Tq * QD, 0.0f, 1.0f, 11);
  fill_uniform_cuda(ctx, k.as<uint16_t>(), Tk * KD, 0.0f, 1.0f, 12);
  fill_uniform_cuda(ctx, v.as<uint16_t>(), Tk * KD, 0.0f, 1.0f, 13);
  fill_uniform_cuda(ctx, dout.as<uint16_t>(), Tq * QD, 0.0f, 1.0f, 14);
  std::printf(
      "DFlash attention: q %ldx%dx%ld, kv %ldx%dx%ld, %.1f visible keys per row; "
      "floor fwd %.3f ms, bwd %.3f ms at 825 TFLOP/s; median of %d runs\n",
      static_cast<long>(Tq), kHeads, static_cast<long>(D), static_cast<long>(Tk), kKvHeads,
      static_cast<long>(D), visible / static_cast<double>(Tq), fwd_flops / kPeakFlops * 1e3,
      2.5 * fwd_flops / kPeakFlops * 1e3, reps);
  for (const Family& f : fams) {
    AttnParams p{Tq, Tk, kHeads, kKvHeads, D, 1.0 / std::sqrt(static_cast<double>(D))};
    p.kernels = f.kernels;
    auto fwd = [&] {
      attention_fwd_cuda(ctx, o.as<uint16_t>(), lse.as<float>(), q.as<uint16_t>(), k.as<uint16_t>(),
                         v.as<uint16_t>(), rg.as<AttnRange>(), p);
    };
    fwd();  // o and lse for the backward
    const double fwd_ms = bwd_only ? NAN : time_ms(ctx, warmup, reps, fwd);
    const double bwd_ms = time_ms(ctx, warmup, reps, [&] {
      attention_bwd_cuda(ctx, dq.as<uint16_t>(), dk.as<uint16_t>(), dv.as<uint16_t>(),
                         dout.as<uint16_t>(), q.as<uint16_t>(), k.as<uint16_t>(), v.as<uint16_t>(),
                         o.as<uint16_t>(), lse.as<float>(), rg.as<AttnRange>(), p);
    });
    if (bwd_only)
      std::printf("%-12s fwd (not timed)                 bwd %7.3f ms %5.1f %% of floor\n", f.name,
                  bwd_ms, 2.5 * fwd_flops / kPeakFlops * 1e3 / bwd_ms * 100);
    else
      std::printf("%-12s fwd %7.3f ms %5.1f %% of floor  bwd %7.3f ms %5.1f %% of floor\n", f.name,
                  fwd_ms, fwd_flops / kPeakFlops * 1e3 / fwd_ms * 100, bwd_ms,
                  2.5 * fwd_flops / kPeakFlops * 1e3 / bwd_ms * 100);
  }
  DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "attention_bench: %s\n", e.what());
  return 1;
}
