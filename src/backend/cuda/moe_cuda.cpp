// dflash.cpp — checked CUDA entry points of the mixture-of-experts ops (declared in ops/moe.hpp):
// sizes and pointers are checked here, scratch comes from the context's caching allocator, and the
// raw launchers of backend/cuda/moe.cu run on the context's stream.
#include <cstdint>
#include <limits>
#include <type_traits>

#include "backend/cuda/context.hpp"
#include "backend/cuda/moe_launch.hpp"
#include "core/error.hpp"
#include "ops/moe.hpp"

namespace dflash {

namespace {

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

void moe_route_cuda(cuda::CudaContext& ctx, int32_t* ids, float* weights, const float* logits,
                    int64_t T, int64_t E, const MoeRouting& r) {
  DFLASH_CHECK(T >= 0 && E >= 1 && E <= 1024 && r.K >= 1 && r.K <= E && r.K <= 32,
               "moe_route_cuda: top-k {} must be in [1, min(E, 32)] and E={} in [1, 1024] (T={})",
               r.K, E, T);
  if (T == 0) return;
  DFLASH_CHECK(ids && weights && logits, "moe_route_cuda: null pointer");
  cuda::launch::moe_route(ids, weights, logits, T, E, r.K, r.mode == MoeRoutingMode::softmax_topk,
                          r.norm_topk_prob, ctx.stream());
}

void moe_dispatch_cuda(cuda::CudaContext& ctx, int32_t* perm, int32_t* slot, int32_t* offsets,
                       int32_t* row_expert, const int32_t* ids, int64_t T, int64_t K, int64_t E) {
  DFLASH_CHECK(
      T >= 0 && K >= 1 && E >= 1 && T * K <= std::numeric_limits<int32_t>::max() && E <= 65535,
      "moe_dispatch_cuda: bad sizes T={} K={} E={}", T, K, E);
  DFLASH_CHECK(offsets && (T == 0 || (perm && slot && row_expert && ids)),
               "moe_dispatch_cuda: null pointer");
  // Sizes as moe_dispatch_cuda_scratch_bytes (the memory plan's op scratch pool).
  cuda::DeviceBuffer counts = ctx.scratch(static_cast<size_t>(E) * sizeof(int32_t));
  cuda::launch::moe_dispatch(perm, slot, offsets, row_expert, counts.as<int32_t>(), ids, T * K, E,
                             ctx.stream());
}

void moe_gather_cuda(cuda::CudaContext& ctx, uint16_t* xs, const uint16_t* x, const int32_t* perm,
                     int64_t R, int64_t K, int64_t H) {
  DFLASH_CHECK(R >= 0 && K >= 1 && H > 0, "moe_gather_cuda: bad sizes R={} K={} H={}", R, K, H);
  if (R == 0) return;
  DFLASH_CHECK(xs && x && perm, "moe_gather_cuda: null pointer");
  cuda::launch::moe_gather(xs, x, perm, R, K, H, ctx.stream());
}

template <typename Y>
void moe_grouped_linear_cuda(cuda::CudaContext& ctx, Y* y, int64_t ldy, const uint16_t* x,
                             const uint16_t* const* w, const int32_t* offsets, int64_t E, int64_t R,
                             int64_t IN, int64_t OUT) {
  static_assert(std::is_same_v<Y, float> || std::is_same_v<Y, uint16_t>);
  DFLASH_CHECK(E >= 1 && R >= 0 && IN > 0 && OUT > 0 && ldy >= OUT && IN % 8 == 0 &&
                   IN < (1ll << 31) && OUT < (1ll << 31),
               "moe_grouped_linear_cuda: bad sizes E={} R={} IN={} OUT={} ldy={} (IN must be a "
               "multiple of 8)",
               E, R, IN, OUT, ldy);
  if (R == 0) return;
  DFLASH_CHECK(y && x && w && offsets, "moe_grouped_linear_cuda: null pointer");
  DFLASH_CHECK(aligned16(x), "moe_grouped_linear_cuda: x must be 16-byte aligned");
  DFLASH_CHECK(cuda::launch::moe_grouped_tiles(R, E) <= 65535,
               "moe_grouped_linear_cuda: {} rows over {} experts need more than 65535 row tiles", R,
               E);
  cuda::launch::moe_grouped_linear(y, std::is_same_v<Y, float> ? DType::f32 : DType::bf16, ldy, x,
                                   w, offsets, E, R, IN, OUT, ctx.stream());
}

template <typename T>
void moe_glu_cuda(cuda::CudaContext& ctx, uint16_t* y, const T* gate, const T* up, int64_t ld_in,
                  const float* gate_bias, const float* up_bias, const int32_t* row_expert,
                  int64_t R, int64_t I, const MoeGlu& glu) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>);
  DFLASH_CHECK(R >= 0 && I > 0 && ld_in >= I, "moe_glu_cuda: bad sizes R={} I={} ld_in={}", R, I,
               ld_in);
  if (R == 0) return;
  DFLASH_CHECK(y && gate && up && row_expert, "moe_glu_cuda: null pointer");
  cuda::launch::moe_glu(y, gate, up, std::is_same_v<T, float> ? DType::f32 : DType::bf16, ld_in,
                        gate_bias, up_bias, row_expert, R, I,
                        glu.act == MoeActivation::clamped_swiglu, glu.alpha, glu.limit,
                        ctx.stream());
}

void moe_combine_cuda(cuda::CudaContext& ctx, float* y, const float* ys, const float* down_bias,
                      const int32_t* ids, const float* weights, const int32_t* slot, int64_t T,
                      int64_t K, int64_t H) {
  DFLASH_CHECK(T >= 0 && K >= 1 && H > 0, "moe_combine_cuda: bad sizes T={} K={} H={}", T, K, H);
  if (T == 0) return;
  DFLASH_CHECK(y && ys && ids && weights && slot, "moe_combine_cuda: null pointer");
  cuda::launch::moe_combine(y, ys, down_bias, ids, weights, slot, T, K, H, ctx.stream());
}

template void moe_grouped_linear_cuda(cuda::CudaContext&, float*, int64_t, const uint16_t*,
                                      const uint16_t* const*, const int32_t*, int64_t, int64_t,
                                      int64_t, int64_t);
template void moe_grouped_linear_cuda(cuda::CudaContext&, uint16_t*, int64_t, const uint16_t*,
                                      const uint16_t* const*, const int32_t*, int64_t, int64_t,
                                      int64_t, int64_t);
template void moe_glu_cuda(cuda::CudaContext&, uint16_t*, const float*, const float*, int64_t,
                           const float*, const float*, const int32_t*, int64_t, int64_t,
                           const MoeGlu&);
template void moe_glu_cuda(cuda::CudaContext&, uint16_t*, const uint16_t*, const uint16_t*, int64_t,
                           const float*, const float*, const int32_t*, int64_t, int64_t,
                           const MoeGlu&);

}  // namespace dflash
