// dflash.cpp — checked CUDA entry points of RMSNorm (contract: src/ops/rmsnorm.hpp). Each checks
// sizes and pointers (errors name the entry point and the bad value), takes any scratch from the
// context's caching allocator and runs a raw launcher of backend/cuda/rmsnorm.cu (declared in
// rmsnorm_launch.hpp) on the context's stream. Templates are instantiated at the end for float and
// uint16_t (bf16 bits).
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/rmsnorm_launch.hpp"
#include "core/error.hpp"
#include "ops/rmsnorm.hpp"

namespace dflash {

template <typename Y, typename X>
void rmsnorm_fwd_cuda(cuda::CudaContext& ctx, Y* y, float* rstd, const X* x, const float* w,
                      int64_t R, int64_t D, double eps) {
  DFLASH_CHECK(R >= 0 && D > 0 && eps >= 0, "rmsnorm_fwd_cuda: bad sizes R={} D={} eps={}", R, D,
               eps);
  if (R == 0) return;
  DFLASH_CHECK(y && x && w, "rmsnorm_fwd_cuda: null pointer");
  cuda::launch::rmsnorm_fwd(y, cuda::dtype_of<Y>(), rstd, x, cuda::dtype_of<X>(), w, R, D,
                            static_cast<float>(eps), ctx.stream());
}

template <typename G, typename X>
void rmsnorm_bwd_cuda(cuda::CudaContext& ctx, G* dx, float* dw, const G* dy, const X* x,
                      const float* w, int64_t R, int64_t D, double eps) {
  DFLASH_CHECK(R >= 0 && D > 0 && eps >= 0, "rmsnorm_bwd_cuda: bad sizes R={} D={} eps={}", R, D,
               eps);
  if (R == 0) return;
  DFLASH_CHECK(dy && x && w, "rmsnorm_bwd_cuda: null pointer");
  // Sizes as rmsnorm_bwd_cuda_scratch_bytes.
  cuda::DeviceBuffer rstd = ctx.scratch(static_cast<size_t>(R) * sizeof(float));
  cuda::DeviceBuffer part;
  if (dw) part = ctx.scratch(static_cast<size_t>(rmsnorm_cuda_dw_chunks(R) * D) * sizeof(float));
  cuda::launch::rmsnorm_bwd(dx, dy, cuda::dtype_of<G>(), dw, x, cuda::dtype_of<X>(), w, R, D,
                            static_cast<float>(eps), rstd.as<float>(), part.as<float>(),
                            ctx.stream());
}

void rmsnorm_bwd_res_cuda(cuda::CudaContext& ctx, float* dres, uint16_t* dres_bf, bool accumulate,
                          float* dw, const float* dy, const float* x, const float* w, int64_t R,
                          int64_t D, double eps) {
  DFLASH_CHECK(R >= 0 && D > 0 && eps >= 0, "rmsnorm_bwd_res_cuda: bad sizes R={} D={} eps={}", R,
               D, eps);
  if (R == 0) return;
  DFLASH_CHECK(dy && x && w, "rmsnorm_bwd_res_cuda: null pointer");
  DFLASH_CHECK(dres || !dres_bf, "rmsnorm_bwd_res_cuda: a bf16 copy needs dres");
  cuda::DeviceBuffer rstd = ctx.scratch(static_cast<size_t>(R) * sizeof(float));
  cuda::DeviceBuffer part;
  if (dw) part = ctx.scratch(static_cast<size_t>(rmsnorm_cuda_dw_chunks(R) * D) * sizeof(float));
  cuda::launch::rmsnorm_bwd_res(dres, dres_bf, accumulate, dw, dy, x, w, R, D,
                                static_cast<float>(eps), rstd.as<float>(), part.as<float>(),
                                ctx.stream());
}

// ---------------------------------------------------------------- instantiations
#define DFLASH_INST_YX(Y, X)                                                                       \
  template void rmsnorm_fwd_cuda(cuda::CudaContext&, Y*, float*, const X*, const float*, int64_t,  \
                                 int64_t, double);                                                 \
  template void rmsnorm_bwd_cuda(cuda::CudaContext&, Y*, float*, const Y*, const X*, const float*, \
                                 int64_t, int64_t, double);
DFLASH_INST_YX(float, float)
DFLASH_INST_YX(float, uint16_t)
DFLASH_INST_YX(uint16_t, float)
DFLASH_INST_YX(uint16_t, uint16_t)
#undef DFLASH_INST_YX

}  // namespace dflash
