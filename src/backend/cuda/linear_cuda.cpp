// dflash.cpp — checked CUDA entry points of the linear layer through cuBLASLt and its bias add
// (contract: src/ops/linear.hpp). Each checks sizes and pointers (errors name the entry point and
// the bad value), takes any scratch from the context's caching allocator and runs cuBLASLt
// (backend/cuda/gemm.hpp) or the bias launcher of backend/cuda/linear.cu on the context's stream.
// Templates are instantiated at the end for float and uint16_t (bf16 bits).
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/gemm.hpp"
#include "backend/cuda/linear_launch.hpp"
#include "core/error.hpp"
#include "ops/linear.hpp"

namespace dflash {

template <typename Y>
void linear_fwd_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                     int64_t T, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_fwd_cuda: bad sizes T={} IN={} OUT={}", T, IN,
               OUT);
  if (T == 0) return;
  // y[T,OUT] = x[T,IN] · W[OUT,IN]ᵀ
  cuda::gemm_bf16(ctx, y, cuda::dtype_of<Y>(), OUT, x, IN, false, w_bf16, IN, true, T, OUT, IN);
}

template <typename Y>
void linear_fwd_acc_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                         int64_t T, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_fwd_acc_cuda: bad sizes T={} IN={} OUT={}", T,
               IN, OUT);
  if (T == 0) return;
  // y[T,OUT] += x[T,IN] · W[OUT,IN]ᵀ
  cuda::gemm_bf16(ctx, y, cuda::dtype_of<Y>(), OUT, x, IN, false, w_bf16, IN, true, T, OUT, IN,
                  1.0f, 1.0f);
}

template <typename Y>
void linear_fwd_res_cuda(cuda::CudaContext& ctx, Y* y, const Y* res, const uint16_t* x,
                         const uint16_t* w_bf16, int64_t T, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_fwd_res_cuda: bad sizes T={} IN={} OUT={}", T,
               IN, OUT);
  if (T == 0) return;
  DFLASH_CHECK(res, "linear_fwd_res_cuda: null residual");
  // y[T,OUT] = res[T,OUT] + x[T,IN] · W[OUT,IN]ᵀ
  cuda::gemm_bf16(ctx, y, cuda::dtype_of<Y>(), OUT, x, IN, false, w_bf16, IN, true, T, OUT, IN,
                  1.0f, 1.0f, res);
}

template <typename Y>
void bias_add_cuda(cuda::CudaContext& ctx, Y* y, const float* bias, int64_t T, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && OUT > 0, "bias_add_cuda: bad sizes T={} OUT={}", T, OUT);
  if (T == 0) return;
  DFLASH_CHECK(y && bias, "bias_add_cuda: null pointer");
  cuda::launch::bias_add(y, cuda::dtype_of<Y>(), bias, T, OUT, ctx.stream());
}

template <typename Y>
void linear_fwd_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                     const float* bias, int64_t T, int64_t IN, int64_t OUT) {
  linear_fwd_cuda(ctx, y, x, w_bf16, T, IN, OUT);
  if (bias) bias_add_cuda(ctx, y, bias, T, OUT);
}

template <typename DX>
void linear_bwd_cuda(cuda::CudaContext& ctx, DX* dx, float* dw, const uint16_t* dy,
                     const uint16_t* x, const uint16_t* w_bf16, int64_t T, int64_t IN,
                     int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_bwd_cuda: bad sizes T={} IN={} OUT={}", T, IN,
               OUT);
  if (T == 0) return;
  // dx[T,IN] = dy[T,OUT] · W[OUT,IN]
  if (dx)
    cuda::gemm_bf16(ctx, dx, cuda::dtype_of<DX>(), IN, dy, OUT, false, w_bf16, IN, false, T, IN,
                    OUT);
  // dW[OUT,IN] += dy[T,OUT]ᵀ · x[T,IN]
  if (dw)
    cuda::gemm_bf16(ctx, dw, DType::f32, IN, dy, OUT, true, x, IN, false, OUT, IN, T, 1.0f, 1.0f);
}

template <typename DX>
void linear_bwd_dx_acc_cuda(cuda::CudaContext& ctx, DX* dx, const uint16_t* dy,
                            const uint16_t* w_bf16, int64_t T, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_bwd_dx_acc_cuda: bad sizes T={} IN={} OUT={}",
               T, IN, OUT);
  if (T == 0) return;
  // dx[T,IN] += dy[T,OUT] · W[OUT,IN]
  cuda::gemm_bf16(ctx, dx, cuda::dtype_of<DX>(), IN, dy, OUT, false, w_bf16, IN, false, T, IN, OUT,
                  1.0f, 1.0f);
}

// ---------------------------------------------------------------- instantiations
#define DFLASH_INST_T(T)                                                                           \
  template void linear_fwd_cuda(cuda::CudaContext&, T*, const uint16_t*, const uint16_t*,          \
                                const float*, int64_t, int64_t, int64_t);                          \
  template void bias_add_cuda(cuda::CudaContext&, T*, const float*, int64_t, int64_t);             \
  template void linear_fwd_cuda(cuda::CudaContext&, T*, const uint16_t*, const uint16_t*, int64_t, \
                                int64_t, int64_t);                                                 \
  template void linear_fwd_acc_cuda(cuda::CudaContext&, T*, const uint16_t*, const uint16_t*,      \
                                    int64_t, int64_t, int64_t);                                    \
  template void linear_fwd_res_cuda(cuda::CudaContext&, T*, const T*, const uint16_t*,             \
                                    const uint16_t*, int64_t, int64_t, int64_t);                   \
  template void linear_bwd_cuda(cuda::CudaContext&, T*, float*, const uint16_t*, const uint16_t*,  \
                                const uint16_t*, int64_t, int64_t, int64_t);                       \
  template void linear_bwd_dx_acc_cuda(cuda::CudaContext&, T*, const uint16_t*, const uint16_t*,   \
                                       int64_t, int64_t, int64_t);
DFLASH_INST_T(float)
DFLASH_INST_T(uint16_t)
#undef DFLASH_INST_T

}  // namespace dflash
