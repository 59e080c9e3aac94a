// dflash.cpp — checked CUDA entry points of the element type conversion (contract:
// src/ops/cast.hpp). Each checks sizes and pointers (errors name the entry point and the bad
// value), takes any scratch from the context's caching allocator and runs a raw launcher of
// backend/cuda/cast.cu (declared in cast_launch.hpp) on the context's stream. Templates are
// instantiated at the end for float and uint16_t (bf16 bits).
#include "backend/cuda/cast_launch.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "core/error.hpp"
#include "ops/cast.hpp"

namespace dflash {

template <typename D, typename S>
void cast_cuda(cuda::CudaContext& ctx, D* dst, const S* src, int64_t n) {
  DFLASH_CHECK(n >= 0, "cast_cuda: bad size {}", n);
  if (n == 0) return;
  DFLASH_CHECK(dst && src, "cast_cuda: null pointer");
  cuda::launch::cast(dst, cuda::dtype_of<D>(), src, cuda::dtype_of<S>(), n, ctx.stream());
}

// ---------------------------------------------------------------- instantiations
template void cast_cuda(cuda::CudaContext&, float*, const float*, int64_t);
template void cast_cuda(cuda::CudaContext&, float*, const uint16_t*, int64_t);
template void cast_cuda(cuda::CudaContext&, uint16_t*, const float*, int64_t);
template void cast_cuda(cuda::CudaContext&, uint16_t*, const uint16_t*, int64_t);

}  // namespace dflash
