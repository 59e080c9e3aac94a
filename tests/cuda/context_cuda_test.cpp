// CudaContext and its caching allocator: size classes, reuse without cudaMalloc after warm-up,
// frozen allocator throws on a miss, allocator-backed tensors, and two threads driving two
// contexts at once (nothing shared but read-only data).
#include <thread>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "ops/cast.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

TEST(CachingAllocator, SizeClasses) {
  using cuda::CachingAllocator;
  EXPECT_EQ(CachingAllocator::size_class(1), 512u);
  EXPECT_EQ(CachingAllocator::size_class(512), 512u);
  EXPECT_EQ(CachingAllocator::size_class(513), 1024u);
  EXPECT_EQ(CachingAllocator::size_class(65537), 131072u);
  EXPECT_EQ(CachingAllocator::size_class((64u << 20) + 1), (64u << 20) + (2u << 20));
}

TEST(CudaContext, NoCudaMallocAfterWarmup) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  auto& a = ctx.allocator();
  auto step = [&] {  // one "step": a few scratch buffers of fixed sizes
    auto x = ctx.scratch(1000);
    auto y = ctx.scratch(3 << 20);
    auto z = ctx.scratch(100 << 20);
    Tensor t = ctx.empty({17, 129}, DType::bf16);
    EXPECT_TRUE(t.device().is_cuda());
  };
  step();
  const int64_t mallocs = a.stats().n_cuda_malloc;
  EXPECT_EQ(mallocs, 4);
  a.freeze();
  for (int i = 0; i < 5; ++i) step();
  EXPECT_EQ(a.stats().n_cuda_malloc, mallocs);
  EXPECT_EQ(a.stats().bytes_in_use, 0u);
  EXPECT_GE(a.stats().n_hits, 20);
  EXPECT_THROW(ctx.scratch(7 << 20), Error);  // a new size class while frozen
  a.unfreeze();
  EXPECT_NO_THROW(ctx.scratch(7 << 20));
  a.release_cached();
  EXPECT_EQ(a.stats().bytes_reserved, 0u);
}

TEST(CudaContext, TwoThreadsTwoContexts) {
  DFLASH_REQUIRE_GPU();
  const auto x = randn(1 << 20, 4);
  const auto ref = to_bf16(x);
  DeviceGuarded<float> src(x);  // read-only, shared
  std::vector<std::vector<uint16_t>> out(2);
  auto work = [&](int i) {
    cuda::CudaContext ctx(0);
    auto dst = ctx.scratch(x.size() * 2);
    for (int rep = 0; rep < 20; ++rep)
      cast_cuda(ctx, dst.as<uint16_t>(), src.get(), static_cast<int64_t>(x.size()));
    ctx.synchronize();
    out[static_cast<size_t>(i)].resize(x.size());
    DFLASH_CUDA_CHECK(cudaMemcpy(out[static_cast<size_t>(i)].data(), dst.data(), x.size() * 2,
                                 cudaMemcpyDeviceToHost));
  };
  std::thread t0(work, 0), t1(work, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(out[0], ref);
  EXPECT_EQ(out[1], ref);
}

TEST(CachingAllocator, ScratchPoolIsAStackInsideItsRange) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  auto before = ctx.scratch(5000);         // from the free lists: returned there after use_pool
  DeviceGuarded<char> pool_mem(64 << 10);  // not a block of the allocator (like an arena buffer)
  auto& a = ctx.allocator();
  EXPECT_THROW(a.use_pool(before.data(), 4096), Error);  // a live block of its own is no pool
  const int64_t mallocs = a.stats().n_cuda_malloc;
  a.use_pool(pool_mem.get(), 64 << 10);
  char* base = pool_mem.get();
  {
    auto x = ctx.scratch(1000);  // [0, 1024)
    auto y = ctx.scratch(300);   // [1024, 1536): blocks are 256-byte multiples
    EXPECT_EQ(x.data(), base);
    EXPECT_EQ(y.data(), base + 1024);
    x = cuda::DeviceBuffer();  // freed out of order: kept until y goes
    auto z = ctx.scratch(10);
    EXPECT_EQ(z.data(), base + 1536);
  }
  auto w = ctx.scratch(2000);  // everything freed: back at the start
  EXPECT_EQ(w.data(), base);
  EXPECT_THROW(ctx.scratch(64 << 10), Error);   // does not fit above w
  EXPECT_EQ(a.stats().n_cuda_malloc, mallocs);  // the pool never calls cudaMalloc
  EXPECT_EQ(a.stats().pool_peak, 2048u);
  before = cuda::DeviceBuffer();  // a block from before the pool goes back to its free list
}
