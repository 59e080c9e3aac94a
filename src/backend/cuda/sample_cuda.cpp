// dflash.cpp — checked CUDA entry points of the sampling ops (declared in ops/sample.hpp): sizes
// and pointers are checked here, the raw launchers of backend/cuda/sample.cu run on the context's
// stream. Nothing allocates.
#include <cstdint>
#include <limits>

#include "backend/cuda/context.hpp"
#include "backend/cuda/sample_launch.hpp"
#include "core/error.hpp"
#include "ops/sample.hpp"

namespace dflash {

namespace {

constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();

}  // namespace

void sample_probs_cuda(cuda::CudaContext& ctx, float* probs, const float* logits, int64_t R,
                       int64_t V, int64_t skip, const SampleParamsDevice* params, int32_t* status,
                       int64_t rows_per_request) {
  DFLASH_CHECK(R >= 0 && R <= kI32 && V >= 1 && V <= kI32 && skip >= 0 && skip <= kI32 &&
                   rows_per_request >= 1 && rows_per_request <= kI32,
               "sample_probs_cuda: bad sizes R={} V={} skip={} rows_per_request={}", R, V, skip,
               rows_per_request);
  if (R == 0) return;
  DFLASH_CHECK(probs && logits && params && status, "sample_probs_cuda: null pointer");
  cuda::launch::sample_probs(probs, logits, R, V, static_cast<int>(skip), params, status,
                             static_cast<int>(rows_per_request), ctx.stream());
}

void sample_drafts_cuda(cuda::CudaContext& ctx, int32_t* block, const float* q,
                        const uint64_t* seeds, const int32_t* steps, int64_t B, int64_t K,
                        int64_t V) {
  DFLASH_CHECK(B >= 1 && K >= 2 && B * K <= kI32 && V >= 1 && V <= kI32,
               "sample_drafts_cuda: bad sizes B={} K={} V={}", B, K, V);
  DFLASH_CHECK(block && q && seeds && steps, "sample_drafts_cuda: null pointer");
  cuda::launch::sample_drafts(block, q, seeds, steps, static_cast<int>(B), static_cast<int>(K), V,
                              ctx.stream());
}

void spec_sample_accept_cuda(cuda::CudaContext& ctx, int32_t* out, int32_t* lens, int32_t* block,
                             int32_t* steps, const float* p, const float* q, const uint64_t* seeds,
                             const int32_t* status, const int32_t* active, int64_t B, int64_t K,
                             int64_t V, int32_t mask) {
  DFLASH_CHECK(B >= 1 && K >= 1 && B * (K + 1) <= kI32 && V >= 1 && V <= kI32,
               "spec_sample_accept_cuda: bad sizes B={} K={} V={}", B, K, V);
  DFLASH_CHECK(out && lens && block && steps && p && (q || K == 1) && seeds && status && active,
               "spec_sample_accept_cuda: null pointer");
  cuda::launch::spec_sample_accept(out, lens, block, steps, p, q, seeds, status, active,
                                   static_cast<int>(B), static_cast<int>(K), V, mask, ctx.stream());
}

void sample_first_cuda(cuda::CudaContext& ctx, int32_t* token, const float* p, uint64_t* seeds,
                       int32_t* steps, const int32_t* status, int64_t b, uint64_t seed, int64_t V) {
  DFLASH_CHECK(b >= 0 && b <= kI32 && V >= 1 && V <= kI32,
               "sample_first_cuda: bad arguments b={} V={}", b, V);
  DFLASH_CHECK(token && p && seeds && steps && status, "sample_first_cuda: null pointer");
  cuda::launch::sample_first(token, p, seeds, steps, status, static_cast<int>(b), seed, V,
                             ctx.stream());
}

}  // namespace dflash
