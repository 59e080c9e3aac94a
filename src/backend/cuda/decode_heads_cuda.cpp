// dflash.cpp — checked CUDA entry points of the decode heads' ops (declared in
// ops/decode_heads.hpp): sizes and pointers are checked here, the raw launchers of
// backend/cuda/decode_heads.cu run on the context's stream. Nothing allocates.
#include <cstdint>
#include <limits>

#include "backend/cuda/context.hpp"
#include "backend/cuda/decode_heads_launch.hpp"
#include "core/error.hpp"
#include "ops/decode_heads.hpp"

namespace dflash {

namespace {

constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();

void check_segment(const HeadSegment& g, int which) {
  if (g.n == 0) return;
  DFLASH_CHECK(g.n > 0 && g.ld >= g.n && ((g.f32 != nullptr) != (g.bf16 != nullptr)),
               "head_pack_cuda: segment {} needs n >= 0, ld >= n and exactly one table (n={} "
               "ld={})",
               which, g.n, g.ld);
  DFLASH_CHECK(!g.index || (g.index_ld >= 1 && g.index_col >= 0 && g.index_col < g.index_ld),
               "head_pack_cuda: segment {} has index column {} of {}", which, g.index_col,
               g.index_ld);
}

}  // namespace

void head_pack_cuda(cuda::CudaContext& ctx, float* x, int64_t B, const HeadSegment& s0,
                    const HeadSegment& s1, const HeadSegment& s2) {
  DFLASH_CHECK(B >= 1 && B <= 65535, "head_pack_cuda: bad batch B={}", B);
  DFLASH_CHECK(x != nullptr, "head_pack_cuda: null output");
  check_segment(s0, 0);
  check_segment(s1, 1);
  check_segment(s2, 2);
  const int64_t W = s0.n + s1.n + s2.n;
  DFLASH_CHECK(W >= 1, "head_pack_cuda: no input columns");
  cuda::launch::head_pack(x, B, W, s0, s1, s2, ctx.stream());
}

void head_linear_cuda(cuda::CudaContext& ctx, float* y, int64_t ldy, const float* base, int64_t ldb,
                      const float* W, const float* bias, const float* x, int64_t B, int64_t IN,
                      int64_t OUT) {
  DFLASH_CHECK(
      B >= 1 && IN >= 1 && OUT >= 1 && OUT * 32 <= kI32 && ldy >= OUT && (!base || ldb >= OUT),
      "head_linear_cuda: bad sizes B={} IN={} OUT={} ldy={} ldb={}", B, IN, OUT, ldy, ldb);
  DFLASH_CHECK(y && W && x, "head_linear_cuda: null pointer");
  cuda::launch::head_linear(y, ldy, base, ldb, W, bias, x, B, IN, OUT, ctx.stream());
}

void dspark_decode_gated_cuda(cuda::CudaContext& ctx, float* z, const float* u, const float* e,
                              int64_t lde, int64_t B, int64_t r) {
  DFLASH_CHECK(B >= 1 && r >= 1 && lde >= r && B * r <= kI32,
               "dspark_decode_gated_cuda: bad sizes B={} r={} lde={}", B, r, lde);
  DFLASH_CHECK(z && u && e, "dspark_decode_gated_cuda: null pointer");
  cuda::launch::dspark_decode_gated(z, u, e, lde, B, r, ctx.stream());
}

void dspark_decode_rnn_cuda(cuda::CudaContext& ctx, float* z, float* state, const float* u,
                            int64_t B, int64_t r) {
  DFLASH_CHECK(B >= 1 && r >= 1 && B * r <= kI32, "dspark_decode_rnn_cuda: bad sizes B={} r={}", B,
               r);
  DFLASH_CHECK(z && state && u, "dspark_decode_rnn_cuda: null pointer");
  cuda::launch::dspark_decode_rnn(z, state, u, B, r, ctx.stream());
}

void dspark_decode_input_cuda(cuda::CudaContext& ctx, int32_t* input, const int32_t* block,
                              int64_t B, int64_t K, int32_t mask) {
  DFLASH_CHECK(B >= 1 && K >= 1 && B * (K + 1) <= kI32,
               "dspark_decode_input_cuda: bad sizes B={} K={}", B, K);
  DFLASH_CHECK(input && block, "dspark_decode_input_cuda: null pointer");
  cuda::launch::dspark_decode_input(input, block, B, K, mask, ctx.stream());
}

void domino_decode_gru_cuda(cuda::CudaContext& ctx, float* state, const float* xi, const float* hh,
                            int64_t B, int64_t G) {
  DFLASH_CHECK(B >= 1 && G >= 1 && B * 3 * G <= kI32, "domino_decode_gru_cuda: bad sizes B={} G={}",
               B, G);
  DFLASH_CHECK(state && xi && hh, "domino_decode_gru_cuda: null pointer");
  cuda::launch::domino_decode_gru(state, xi, hh, B, G, ctx.stream());
}

void head_silu_cuda(cuda::CudaContext& ctx, float* a, int64_t n) {
  DFLASH_CHECK(n >= 0 && n <= kI32, "head_silu_cuda: bad size n={}", n);
  if (n == 0) return;
  DFLASH_CHECK(a != nullptr, "head_silu_cuda: null pointer");
  cuda::launch::head_silu(a, n, ctx.stream());
}

void decode_slot_argmax_cuda(cuda::CudaContext& ctx, int32_t* block, int64_t ld_block, int64_t col,
                             const float* rows, int64_t ld, int64_t B, int64_t V) {
  DFLASH_CHECK(B >= 1 && B <= kI32 && V >= 1 && V <= kI32 && ld >= V && col >= 0 && col < ld_block,
               "decode_slot_argmax_cuda: bad sizes B={} V={} ld={} col={} ld_block={}", B, V, ld,
               col, ld_block);
  DFLASH_CHECK(block && rows, "decode_slot_argmax_cuda: null pointer");
  cuda::launch::decode_slot_argmax(block, ld_block, col, rows, ld, B, V, ctx.stream());
}

void decode_slot_draw_cuda(cuda::CudaContext& ctx, int32_t* block, int64_t ld_block, int64_t col,
                           float* q, const float* probs, const uint64_t* seeds,
                           const int32_t* steps, int64_t B, int64_t V) {
  DFLASH_CHECK(B >= 1 && B <= kI32 && V >= 1 && V <= kI32 && col >= 1 && col < ld_block,
               "decode_slot_draw_cuda: bad sizes B={} V={} col={} ld_block={}", B, V, col,
               ld_block);
  DFLASH_CHECK(block && q && probs && seeds && steps, "decode_slot_draw_cuda: null pointer");
  cuda::launch::decode_slot_draw(block, ld_block, col, q, probs, seeds, steps, B, V, ctx.stream());
}

}  // namespace dflash
