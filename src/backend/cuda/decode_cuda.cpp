// dflash.cpp — checked CUDA entry points of the decoding ops (declared in ops/decode.hpp): sizes
// and pointers are checked here, the raw launchers of backend/cuda/decode.cu run on the context's
// stream. Nothing allocates.
#include <cstdint>
#include <limits>

#include "backend/cuda/context.hpp"
#include "backend/cuda/decode_launch.hpp"
#include "core/error.hpp"
#include "ops/decode.hpp"

namespace dflash {

namespace {

constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();

}  // namespace

void decode_rows_cuda(cuda::CudaContext& ctx, int32_t* pos, int32_t* slots, AttnRange* causal,
                      AttnRange* block, const int32_t* lens, int64_t B, int64_t K, int64_t first,
                      int64_t C) {
  DFLASH_CHECK(B >= 1 && K >= 1 && first >= 0 && C >= K && (first + B) * C <= kI32 && B * K <= kI32,
               "decode_rows_cuda: bad sizes B={} K={} first={} C={}", B, K, first, C);
  DFLASH_CHECK(pos && slots && causal && lens, "decode_rows_cuda: null pointer");
  cuda::launch::decode_rows(pos, slots, causal, block, lens, static_cast<int>(B),
                            static_cast<int>(K), static_cast<int>(first), static_cast<int>(C),
                            ctx.stream());
}

void kv_scatter_cuda(cuda::CudaContext& ctx, uint16_t* cache, const uint16_t* rows,
                     const int32_t* slots, int64_t R, int64_t W) {
  DFLASH_CHECK(R >= 0 && W >= 1, "kv_scatter_cuda: bad sizes R={} W={}", R, W);
  if (R == 0) return;
  DFLASH_CHECK(cache && rows && slots, "kv_scatter_cuda: null pointer");
  cuda::launch::kv_scatter(cache, rows, slots, R, W, ctx.stream());
}

void argmax_rows_cuda(cuda::CudaContext& ctx, int32_t* out, const float* logits, int64_t R,
                      int64_t V) {
  DFLASH_CHECK(R >= 0 && R <= kI32 && V >= 1, "argmax_rows_cuda: bad sizes R={} V={}", R, V);
  if (R == 0) return;
  DFLASH_CHECK(out && logits, "argmax_rows_cuda: null pointer");
  cuda::launch::argmax_rows(out, logits, R, V, 0, ctx.stream());
}

void draft_propose_cuda(cuda::CudaContext& ctx, int32_t* block, const float* logits, int64_t B,
                        int64_t K, int64_t V) {
  DFLASH_CHECK(B >= 1 && K >= 2 && B * K <= kI32 && V >= 1,
               "draft_propose_cuda: bad sizes B={} K={} V={}", B, K, V);
  DFLASH_CHECK(block && logits, "draft_propose_cuda: null pointer");
  cuda::launch::argmax_rows(block, logits, B * K, V, static_cast<int>(K), ctx.stream());
}

void greedy_accept_cuda(cuda::CudaContext& ctx, int32_t* out, int32_t* lens, int32_t* block,
                        const int32_t* target, const int32_t* active, int64_t B, int64_t K,
                        int32_t mask) {
  DFLASH_CHECK(B >= 1 && K >= 1 && B * (K + 1) <= kI32, "greedy_accept_cuda: bad sizes B={} K={}",
               B, K);
  DFLASH_CHECK(out && lens && block && target && active, "greedy_accept_cuda: null pointer");
  cuda::launch::greedy_accept(out, lens, block, target, active, static_cast<int>(B),
                              static_cast<int>(K), mask, ctx.stream());
}

void decode_admit_cuda(cuda::CudaContext& ctx, int32_t* lens, int32_t* active, int32_t* block,
                       const int32_t* first_token, int64_t b, int64_t K, int64_t len,
                       int32_t mask) {
  DFLASH_CHECK(b >= 0 && K >= 1 && len >= 1 && len <= kI32 && (b + 1) * K <= kI32,
               "decode_admit_cuda: bad arguments b={} K={} len={}", b, K, len);
  DFLASH_CHECK(lens && active && block && first_token, "decode_admit_cuda: null pointer");
  cuda::launch::decode_admit(lens, active, block, first_token, static_cast<int>(b),
                             static_cast<int>(K), static_cast<int>(len), mask, ctx.stream());
}

}  // namespace dflash
