// dflash.cpp — checked CUDA entry points of ops/loss_weights.hpp (sizes and pointers checked here,
// the kernels in loss_weights.cu).
#include "backend/cuda/context.hpp"
#include "backend/cuda/loss_weights_launch.hpp"
#include "core/error.hpp"
#include "ops/loss_weights.hpp"

namespace dflash {

void dpace_weights_cuda(cuda::CudaContext& ctx, float* w, double* sums, const float* mask,
                        int64_t N, int64_t K, const Objective& obj) {
  dpace_weights_check("dpace_weights_cuda", N, K, obj);
  DFLASH_CHECK(sums && (N == 0 || (w && mask)), "dpace_weights_cuda: null pointer");
  cuda::launch::dpace_weights(w, sums, mask, N, static_cast<int>(K), obj.loss, obj.dpace_alpha,
                              ctx.stream());
}

void rows_scale_cuda(cuda::CudaContext& ctx, float* x, const float* w, int64_t R, int64_t H) {
  DFLASH_CHECK(R >= 0 && H >= 0, "rows_scale_cuda: bad sizes R={} H={}", R, H);
  DFLASH_CHECK(R * H == 0 || (x && w), "rows_scale_cuda: null pointer");
  cuda::launch::rows_scale(x, w, R, H, ctx.stream());
}

}  // namespace dflash
