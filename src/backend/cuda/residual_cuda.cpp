// dflash.cpp — checked CUDA entry points of the residual adds (contract: src/ops/residual.hpp).
// Each checks sizes and pointers (errors name the entry point and the bad value), takes any scratch
// from the context's caching allocator and runs a raw launcher of backend/cuda/residual.cu
// (declared in residual_launch.hpp) on the context's stream. Templates are instantiated at the end
// for float and uint16_t (bf16 bits).
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/residual_launch.hpp"
#include "core/error.hpp"
#include "ops/residual.hpp"

namespace dflash {

template <typename T>
void residual_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* a, const T* b, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_fwd_cuda: bad size {}", n);
  if (n == 0) return;
  DFLASH_CHECK(y && a && b, "residual_fwd_cuda: null pointer");
  cuda::launch::residual_fwd(y, a, b, cuda::dtype_of<T>(), n, ctx.stream());
}
template <typename Y, typename B>
void residual_accumulate_cuda(cuda::CudaContext& ctx, Y* y, const B* b, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_accumulate_cuda: bad size {}", n);
  if (n == 0) return;
  DFLASH_CHECK(y && b, "residual_accumulate_cuda: null pointer");
  cuda::launch::residual_accumulate(y, cuda::dtype_of<Y>(), b, cuda::dtype_of<B>(), n,
                                    ctx.stream());
}
template <typename T>
void residual_bwd_cuda(cuda::CudaContext& ctx, T* da, T* db, const T* dy, int64_t n) {
  DFLASH_CHECK(n >= 0 && dy, "residual_bwd_cuda: bad size {} or null dy", n);
  const size_t bytes = static_cast<size_t>(n) * sizeof(T);
  for (T* d : {da, db})
    if (d && d != dy && n > 0)
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(d, dy, bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
}

// ---------------------------------------------------------------- instantiations
template void residual_fwd_cuda(cuda::CudaContext&, float*, const float*, const float*, int64_t);
template void residual_fwd_cuda(cuda::CudaContext&, uint16_t*, const uint16_t*, const uint16_t*,
                                int64_t);
template void residual_bwd_cuda(cuda::CudaContext&, float*, float*, const float*, int64_t);
template void residual_bwd_cuda(cuda::CudaContext&, uint16_t*, uint16_t*, const uint16_t*, int64_t);
template void residual_accumulate_cuda(cuda::CudaContext&, float*, const float*, int64_t);
template void residual_accumulate_cuda(cuda::CudaContext&, float*, const uint16_t*, int64_t);
template void residual_accumulate_cuda(cuda::CudaContext&, uint16_t*, const uint16_t*, int64_t);

}  // namespace dflash
