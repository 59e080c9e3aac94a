// dflash.cpp — checked CUDA entry points of RoPE (contract: src/ops/rope.hpp). Each checks sizes
// and pointers (errors name the entry point and the bad value), takes any scratch from the
// context's caching allocator and runs a raw launcher of backend/cuda/rope.cu (declared in
// rope_launch.hpp) on the context's stream. Templates are instantiated at the end for float and
// uint16_t (bf16 bits); the fused RMSNorm + RoPE for the same type in and out.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/rope_launch.hpp"
#include "core/error.hpp"
#include "ops/rope.hpp"

namespace dflash {

namespace {
template <typename T>
void rope_entry(const char* op, cuda::CudaContext& ctx, T* y, const T* x, const int32_t* pos,
                const float* inv_freq, float scaling, float sign, int64_t Tn, int64_t NH,
                int64_t D) {
  DFLASH_CHECK(Tn >= 0 && NH > 0 && D > 0 && D % 2 == 0, "{}: bad sizes T={} NH={} D={}", op, Tn,
               NH, D);
  DFLASH_CHECK(std::isfinite(scaling), "{}: scaling must be finite", op);
  if (Tn == 0) return;
  DFLASH_CHECK(y && x && pos && inv_freq, "{}: null pointer", op);
  cuda::launch::rope(y, x, cuda::dtype_of<T>(), pos, inv_freq, scaling, sign, Tn, NH, D,
                     ctx.stream());
}
}  // namespace

template <typename T>
void rope_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* x, const int32_t* pos,
                   const float* inv_freq, float scaling, int64_t Tn, int64_t NH, int64_t D) {
  rope_entry("rope_fwd_cuda", ctx, y, x, pos, inv_freq, scaling, 1.0f, Tn, NH, D);
}
template <typename T>
void rope_bwd_cuda(cuda::CudaContext& ctx, T* dx, const T* dy, const int32_t* pos,
                   const float* inv_freq, float scaling, int64_t Tn, int64_t NH, int64_t D) {
  rope_entry("rope_bwd_cuda", ctx, dx, dy, pos, inv_freq, scaling, -1.0f, Tn, NH, D);
}

template <typename Y, typename X>
void rmsnorm_rope_fwd_cuda(cuda::CudaContext& ctx, Y* y, const X* x, const float* w,
                           const int32_t* pos, const float* inv_freq, float scaling, int64_t Tn,
                           int64_t NH, int64_t D, double eps) {
  DFLASH_CHECK(Tn >= 0 && NH > 0 && D > 0 && D % 2 == 0 && eps >= 0,
               "rmsnorm_rope_fwd_cuda: bad sizes T={} NH={} D={} eps={}", Tn, NH, D, eps);
  DFLASH_CHECK(std::isfinite(scaling), "rmsnorm_rope_fwd_cuda: scaling must be finite");
  if (Tn == 0) return;
  DFLASH_CHECK(y && x && w && pos && inv_freq, "rmsnorm_rope_fwd_cuda: null pointer");
  cuda::launch::rmsnorm_rope_fwd(y, cuda::dtype_of<Y>(), x, cuda::dtype_of<X>(), w, pos, inv_freq,
                                 scaling, Tn, NH, D, static_cast<float>(eps), ctx.stream());
}

// ---------------------------------------------------------------- instantiations
#define DFLASH_INST_T(T)                                                                      \
  template void rope_fwd_cuda(cuda::CudaContext&, T*, const T*, const int32_t*, const float*, \
                              float, int64_t, int64_t, int64_t);                              \
  template void rope_bwd_cuda(cuda::CudaContext&, T*, const T*, const int32_t*, const float*, \
                              float, int64_t, int64_t, int64_t);
#define DFLASH_INST_YX(Y, X)                                                                 \
  template void rmsnorm_rope_fwd_cuda(cuda::CudaContext&, Y*, const X*, const float*,        \
                                      const int32_t*, const float*, float, int64_t, int64_t, \
                                      int64_t, double);
DFLASH_INST_T(float)
DFLASH_INST_T(uint16_t)
DFLASH_INST_YX(float, float)
DFLASH_INST_YX(uint16_t, uint16_t)
#undef DFLASH_INST_T
#undef DFLASH_INST_YX

}  // namespace dflash
