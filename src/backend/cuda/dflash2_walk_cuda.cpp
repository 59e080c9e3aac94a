// dflash.cpp — the checked CUDA entry point of DFlash2's selector walk in the decoder (contract:
// src/ops/dflash2_walk.hpp): checks the sizes and the pointers (errors name the entry point and the
// bad value), then runs the two launchers of backend/cuda/dflash2_walk.cu on the context's stream.
#include <limits>

#include "backend/cuda/context.hpp"
#include "backend/cuda/dflash2_walk_launch.hpp"
#include "core/error.hpp"
#include "ops/dflash2_walk.hpp"

namespace dflash {

void dflash2_walk_cuda(cuda::CudaContext& ctx, const Dflash2WalkArgs& a) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  DFLASH_CHECK(a.B >= 1 && a.K >= 2 && a.B * a.K <= kI32 && a.H >= 1 && a.V <= kI32,
               "dflash2_walk_cuda: bad sizes B={} K={} V={} H={}", a.B, a.K, a.V, a.H);
  DFLASH_CHECK(a.top_k >= 1 && a.top_k <= kDflash2WalkMaxTopK && a.top_k <= a.V,
               "dflash2_walk_cuda: selector_top_k {} is outside [1, min({}, vocab {})]", a.top_k,
               kDflash2WalkMaxTopK, a.V);
  DFLASH_CHECK(a.r >= 1 && a.r <= kDflash2WalkMaxRank,
               "dflash2_walk_cuda: selector_rank {} is outside [1, {}]", a.r, kDflash2WalkMaxRank);
  DFLASH_CHECK(a.logits && a.hf && a.A && a.Bs && a.Ph && a.block && a.cand && a.cand_u && a.proj,
               "dflash2_walk_cuda: null pointer");
  DFLASH_CHECK(!a.q || (a.seeds && a.steps && a.status && a.params),
               "dflash2_walk_cuda: sampling without seeds, steps, status or settings");
  cuda::launch::dflash2_walk_rows(a, ctx.stream());
  cuda::launch::dflash2_walk(a, ctx.stream());
}

}  // namespace dflash
