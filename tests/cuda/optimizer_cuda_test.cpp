// CUDA optimizer kernels vs the CPU: fused multi-tensor AdamW (bit-identical, and the bf16 copy it
// writes in the same pass), the deterministic gradient sum of squares, the clip factor, skipping
// on a non-finite norm, the non-finite check.
#include <cmath>
#include <vector>

#include "backend/cuda/context.hpp"
#include "core/dtype.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "train/optimizer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

struct Params {
  std::vector<int64_t> sizes{1, 17, 1000, 129 * 33};
  std::vector<std::vector<float>> p, m, v, g;
  explicit Params(uint32_t seed) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t n = static_cast<size_t>(sizes[i]);
      p.push_back(randn(n, seed + 4 * static_cast<uint32_t>(i)));
      m.push_back(randn(n, seed + 4 * static_cast<uint32_t>(i) + 1, 0.01f));
      auto vv = randn(n, seed + 4 * static_cast<uint32_t>(i) + 2, 0.01f);
      for (float& x : vv) x = x * x;
      v.push_back(vv);
      g.push_back(randn(n, seed + 4 * static_cast<uint32_t>(i) + 3, 0.5f));
    }
  }
};

// The sentinel the bf16 copies start from (a NaN pattern f32_to_bf16_bits never writes).
constexpr uint16_t kBf16Sentinel = 0x7fa5;

// Device copies of Params plus the segment table; with `bf16_copy` every segment also names a bf16
// copy (bf[i], filled with kBf16Sentinel).
struct DeviceParams {
  std::vector<std::unique_ptr<DeviceGuarded<float>>> p, m, v, g;
  std::vector<std::unique_ptr<DeviceGuarded<uint16_t>>> bf;
  std::unique_ptr<DeviceGuarded<AdamWSegment>> table;
  int64_t max_n = 0;
  explicit DeviceParams(const Params& h, bool bf16_copy = false) {
    std::vector<AdamWSegment> segs;
    for (size_t i = 0; i < h.sizes.size(); ++i) {
      p.push_back(std::make_unique<DeviceGuarded<float>>(h.p[i]));
      m.push_back(std::make_unique<DeviceGuarded<float>>(h.m[i]));
      v.push_back(std::make_unique<DeviceGuarded<float>>(h.v[i]));
      g.push_back(std::make_unique<DeviceGuarded<float>>(h.g[i]));
      uint16_t* copy = nullptr;
      if (bf16_copy) {
        bf.push_back(std::make_unique<DeviceGuarded<uint16_t>>(
            std::vector<uint16_t>(static_cast<size_t>(h.sizes[i]), kBf16Sentinel)));
        copy = bf.back()->get();
      }
      segs.push_back({p[i]->get(), m[i]->get(), v[i]->get(), g[i]->get(), h.sizes[i], copy});
      max_n = std::max(max_n, h.sizes[i]);
    }
    table = std::make_unique<DeviceGuarded<AdamWSegment>>(segs);
  }
};

}  // namespace

TEST(OptimizerCuda, AdamWBitIdenticalToCpuWithClipping) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  Params h(1);
  DeviceParams d(h);
  AdamWConfig cfg;
  cfg.weight_decay = 0.01;
  const double max_norm = 1.0;
  DeviceGuarded<double> sumsq(1), norm(1);
  DeviceGuarded<float> scale(1);
  DeviceGuarded<int32_t> skip(1);
  for (int64_t step = 1; step <= 3; ++step) {
    const double lr = 6e-4 * static_cast<double>(step);
    // CPU: global norm in double, clip factor, then AdamW per array.
    double ss = 0;
    for (size_t i = 0; i < h.sizes.size(); ++i) ss += sum_squares_cpu(h.g[i].data(), h.sizes[i]);
    grad_sumsq_cuda(ctx, sumsq.get(), d.table->get(), static_cast<int>(h.sizes.size()));
    grad_clip_cuda(ctx, scale.get(), skip.get(), norm.get(), sumsq.get(), max_norm);
    const double ss_gpu = sumsq.download()[0];
    EXPECT_NEAR(ss_gpu, ss, tol::kF64Sum * ss);
    EXPECT_NEAR(norm.download()[0], std::sqrt(ss), 1e-12 * std::sqrt(ss));
    EXPECT_EQ(skip.download()[0], 0);
    // The GPU's float clip factor drives both sides (it equals the CPU's up to the double sum).
    const float gs = scale.download()[0];
    EXPECT_NEAR(gs, clip_scale(std::sqrt(ss), max_norm), 1e-7);
    EXPECT_LT(gs, 1.0f);  // the random gradients have norm > 1: clipping is active
    for (size_t i = 0; i < h.sizes.size(); ++i)
      adamw_step_cpu(h.p[i].data(), h.m[i].data(), h.v[i].data(), h.g[i].data(), h.sizes[i], cfg,
                     lr, step, gs);
    adamw_step_cuda(ctx, d.table->get(), static_cast<int>(h.sizes.size()), d.max_n, cfg, lr, step,
                    scale.get(), skip.get());
    for (size_t i = 0; i < h.sizes.size(); ++i) {
      EXPECT_TRUE(same_bits(d.p[i]->download(), h.p[i])) << "param " << i << " step " << step;
      EXPECT_TRUE(same_bits(d.m[i]->download(), h.m[i])) << "m " << i;
      EXPECT_TRUE(same_bits(d.v[i]->download(), h.v[i])) << "v " << i;
      EXPECT_TRUE(d.p[i]->guard_intact() && d.m[i]->guard_intact() && d.v[i]->guard_intact());
    }
  }
}

// The bf16 copy written in AdamW's pass is bf16(p) of the updated p, bit for bit the CPU's
// rounding (what cast_cuda wrote in a second pass before), and a skipped step leaves it as it was.
TEST(OptimizerCuda, AdamWWritesTheBf16CopyInItsPass) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  Params h(5);
  DeviceParams d(h, /*bf16_copy=*/true);
  AdamWConfig cfg;
  cfg.weight_decay = 0.01;
  const int n_segs = static_cast<int>(h.sizes.size());
  DeviceGuarded<int32_t> skip(std::vector<int32_t>{1});
  adamw_step_cuda(ctx, d.table->get(), n_segs, d.max_n, cfg, 1e-3, 1, nullptr, skip.get());
  for (size_t i = 0; i < h.sizes.size(); ++i) {
    for (uint16_t b : d.bf[i]->download()) ASSERT_EQ(b, kBf16Sentinel) << "skipped step, seg " << i;
  }
  for (int64_t step = 1; step <= 2; ++step) {
    adamw_step_cuda(ctx, d.table->get(), n_segs, d.max_n, cfg, 1e-3, step, nullptr, nullptr);
    for (size_t i = 0; i < h.sizes.size(); ++i) {
      adamw_step_cpu(h.p[i].data(), h.m[i].data(), h.v[i].data(), h.g[i].data(), h.sizes[i], cfg,
                     1e-3, step);
      std::vector<uint16_t> want(h.p[i].size());
      for (size_t e = 0; e < want.size(); ++e) want[e] = f32_to_bf16_bits(h.p[i][e]);
      EXPECT_TRUE(same_bits(d.p[i]->download(), h.p[i])) << "param " << i << " step " << step;
      EXPECT_EQ(d.bf[i]->download(), want) << "bf16 copy " << i << " step " << step;
      EXPECT_TRUE(d.bf[i]->guard_intact()) << "bf16 copy " << i;
    }
  }
}

TEST(OptimizerCuda, SumsqIsDeterministic) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  Params h(7);
  DeviceParams d(h);
  DeviceGuarded<double> a(1), b(1);
  grad_sumsq_cuda(ctx, a.get(), d.table->get(), 4);
  grad_sumsq_cuda(ctx, b.get(), d.table->get(), 4);
  EXPECT_TRUE(same_bits(a.download(), b.download()));
  EXPECT_TRUE(a.guard_intact());
}

TEST(OptimizerCuda, NonFiniteGradientSkipsTheStep) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  Params h(3);
  h.g[2][500] = std::numeric_limits<float>::infinity();
  DeviceParams d(h);
  DeviceGuarded<double> sumsq(1);
  DeviceGuarded<float> scale(1);
  DeviceGuarded<int32_t> skip(1);
  grad_sumsq_cuda(ctx, sumsq.get(), d.table->get(), 4);
  grad_clip_cuda(ctx, scale.get(), skip.get(), nullptr, sumsq.get(), 1.0);
  EXPECT_EQ(skip.download()[0], 1);
  adamw_step_cuda(ctx, d.table->get(), 4, d.max_n, AdamWConfig{}, 1e-3, 1, scale.get(), skip.get());
  for (size_t i = 0; i < h.sizes.size(); ++i) EXPECT_TRUE(same_bits(d.p[i]->download(), h.p[i]));
}

TEST(OptimizerCuda, NonFiniteCheck) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (int64_t n : {1, 17, 100000}) {
    auto x = randn(static_cast<size_t>(n), 9);
    DeviceGuarded<float> dx(x);
    DeviceGuarded<uint16_t> db(to_bf16(x));
    DeviceGuarded<int32_t> flag(std::vector<int32_t>{0});
    nonfinite_check_cuda(ctx, flag.get(), dx.get(), n);
    nonfinite_check_cuda(ctx, flag.get(), db.get(), n);
    EXPECT_EQ(flag.download()[0], 0) << n;
    x[static_cast<size_t>(n - 1)] = std::nanf("");
    dx.upload(x);
    nonfinite_check_cuda(ctx, flag.get(), dx.get(), n);
    EXPECT_EQ(flag.download()[0], 1) << n;
    flag.upload({0});
    x[static_cast<size_t>(n - 1)] = -std::numeric_limits<float>::infinity();
    db.upload(to_bf16(x));
    nonfinite_check_cuda(ctx, flag.get(), db.get(), n);
    EXPECT_EQ(flag.download()[0], 1) << n;
  }
}
