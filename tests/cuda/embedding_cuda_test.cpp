// CUDA embedding gather vs embedding_fwd_cpu: bf16 and f32 tables, f32 and bf16 outputs, repeated
// ids, an out-of-range id gives a NaN row (never an out-of-bounds read), guard bytes.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/embedding.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

TEST(EmbeddingCuda, GatherMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  for (int64_t T : {1, 17, 1000}) {
    const int64_t V = 517, H = 129;
    const auto table = to_bf16(randn(static_cast<size_t>(V * H), 1));
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 97 + 3) % V);
    std::vector<float> ref(static_cast<size_t>(T * H));
    embedding_fwd_cpu(ref.data(), table.data(), ids.data(), T, V, H);
    DeviceGuarded<uint16_t> dt(table);
    DeviceGuarded<float> dt32(from_bf16(table));
    DeviceGuarded<int32_t> di(ids);
    DeviceGuarded<float> y(static_cast<size_t>(T * H)), y2(static_cast<size_t>(T * H));
    DeviceGuarded<uint16_t> y16(static_cast<size_t>(T * H));
    embedding_fwd_cuda(ctx, y.get(), dt.get(), di.get(), T, V, H);
    embedding_fwd_cuda(ctx, y16.get(), dt.get(), di.get(), T, V, H);
    embedding_fwd_cuda(ctx, y2.get(), dt32.get(), di.get(), T, V, H);
    EXPECT_EQ(y.download(), ref);  // exact: a gather
    EXPECT_EQ(from_bf16(y16.download()), ref);
    EXPECT_EQ(y2.download(), ref);
    EXPECT_TRUE(y.guard_intact() && y16.guard_intact() && y2.guard_intact());
  }
}

TEST(EmbeddingCuda, BadIdGivesNaNRow) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t V = 10, H = 33;
  DeviceGuarded<float> table(randn(static_cast<size_t>(V * H), 2));
  DeviceGuarded<int32_t> ids(std::vector<int32_t>{3, 10, -1});
  DeviceGuarded<float> y(static_cast<size_t>(3 * H));
  embedding_fwd_cuda(ctx, y.get(), table.get(), ids.get(), 3, V, H);
  const auto out = y.download();
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_FALSE(std::isnan(out[static_cast<size_t>(h)]));
    EXPECT_TRUE(std::isnan(out[static_cast<size_t>(H + h)]));
    EXPECT_TRUE(std::isnan(out[static_cast<size_t>(2 * H + h)]));
  }
  EXPECT_TRUE(y.guard_intact());
}
