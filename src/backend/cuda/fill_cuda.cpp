// dflash.cpp — checked CUDA entry points of the uniform fill (contract: src/ops/fill.hpp). Each
// checks sizes and pointers (errors name the entry point and the bad value), takes any scratch from
// the context's caching allocator and runs a raw launcher of backend/cuda/fill.cu (declared in
// fill_launch.hpp) on the context's stream.
#include <cmath>

#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/fill_launch.hpp"
#include "core/error.hpp"
#include "ops/fill.hpp"

namespace dflash {

template <typename Y>
void fill_uniform_cuda(cuda::CudaContext& ctx, Y* y, int64_t n, float offset, float bound,
                       uint64_t seed) {
  DFLASH_CHECK(n >= 0 && std::isfinite(offset) && std::isfinite(bound),
               "fill_uniform_cuda: bad arguments n={} offset={} bound={}", n, offset, bound);
  if (n == 0) return;
  DFLASH_CHECK(y, "fill_uniform_cuda: null pointer");
  cuda::launch::fill_uniform(y, cuda::dtype_of<Y>(), n, offset, bound, seed, ctx.stream());
}
template void fill_uniform_cuda(cuda::CudaContext&, float*, int64_t, float, float, uint64_t);
template void fill_uniform_cuda(cuda::CudaContext&, uint16_t*, int64_t, float, float, uint64_t);

}  // namespace dflash
