// DeviceArena (a memory plan's one allocation: buffers by name, never larger than planned),
// PinnedUploader (host → device through pinned staging, chunks larger and smaller than a staging
// buffer, bf16 conversion on the way) and fill_uniform_cuda (the same bits as the CPU formula).
#include <cuda_runtime.h>

#include "backend/cuda/arena.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "ops/fill.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

TEST(DeviceArena, BuffersByNameWithinTheirPlannedSize) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  ArenaPlanner p({"a", "b"});
  p.add("x", "g", 1000, 0b01);
  p.add("y", "g", 4000, 0b10);
  p.add("z", "g", 10, 0b11);
  cuda::DeviceArena arena(ctx, p.finish());
  EXPECT_EQ(arena.untaken().size(), 3u);
  float* x = arena.get<float>("x", 250);
  float* y = arena.get<float>("y", 1000);
  EXPECT_EQ(static_cast<void*>(x), static_cast<void*>(y));  // disjoint phases share
  EXPECT_THROW(arena.get<float>("x", 251), Error);          // more than planned
  EXPECT_THROW(arena.get<float>("w", 1), Error);            // not planned
  EXPECT_EQ(arena.untaken(), (std::vector<std::string>{"z"}));
  // The memory is real: write y, read it back.
  const std::vector<float> v = randn(1000, 3);
  DFLASH_CUDA_CHECK(cudaMemcpy(y, v.data(), 4000, cudaMemcpyHostToDevice));
  std::vector<float> back(1000);
  DFLASH_CUDA_CHECK(cudaMemcpy(back.data(), y, 4000, cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, v);
}

TEST(PinnedUploader, CopiesEveryByteThroughSmallStagingBuffers) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  std::vector<uint16_t> a(100003), b(17);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint16_t>(i * 7 + 1);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(60000 + i);
  DeviceGuarded<uint16_t> da(a.size()), db(b.size()), dc(a.size());
  {
    cuda::PinnedUploader up(ctx, 4096, 2);  // many chunks, two staging buffers
    up.upload(da.get(), a.data(), a.size() * 2);
    up.upload(db.get(), b.data(), b.size() * 2);
    // A converting fill: element i = bf16(i / 8).
    up.upload(dc.get(), a.size() * 2, [](void* out, size_t off, size_t n) {
      for (size_t i = 0; i < n / 2; ++i) {
        static_cast<uint16_t*>(out)[i] = f32_to_bf16_bits(static_cast<float>(off / 2 + i) / 8);
      }
    });
    up.finish();
    EXPECT_EQ(up.bytes(), (2 * a.size() + b.size()) * 2);
  }
  EXPECT_EQ(da.download(), a);
  EXPECT_EQ(db.download(), b);
  const std::vector<uint16_t> c = dc.download();
  for (size_t i = 0; i < c.size(); ++i) {
    ASSERT_EQ(c[i], f32_to_bf16_bits(static_cast<float>(i) / 8)) << i;
  }
  EXPECT_TRUE(da.guard_intact() && db.guard_intact() && dc.guard_intact());
}

TEST(FillUniform, SameBitsAsTheCpuAndTheRightSpread) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t n = 100001;
  DeviceGuarded<float> f(static_cast<size_t>(n));
  DeviceGuarded<uint16_t> h(static_cast<size_t>(n));
  fill_uniform_cuda(ctx, f.get(), n, 0.5f, 0.25f, 42);
  fill_uniform_cuda(ctx, h.get(), n, 0.0f, 0.02f * std::sqrt(3.0f), 7);
  ctx.synchronize();
  std::vector<float> cf(static_cast<size_t>(n));
  std::vector<uint16_t> ch(static_cast<size_t>(n));
  fill_uniform_cpu(cf.data(), n, 0.5f, 0.25f, 42);
  fill_uniform_cpu(ch.data(), n, 0.0f, 0.02f * std::sqrt(3.0f), 7);
  EXPECT_TRUE(same_bits(f.download(), cf));
  EXPECT_TRUE(same_bits(h.download(), ch));
  double mean = 0, sq = 0;
  for (float x : cf) {
    EXPECT_GE(x, 0.25f);
    EXPECT_LT(x, 0.75f);
    mean += x;
  }
  mean /= static_cast<double>(n);
  for (uint16_t b : ch) sq += static_cast<double>(bf16_bits_to_f32(b)) * bf16_bits_to_f32(b);
  EXPECT_NEAR(mean, 0.5, 0.002);
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(n)), 0.02, 0.0005);  // std 0.02
  EXPECT_TRUE(f.guard_intact() && h.guard_intact());
}
