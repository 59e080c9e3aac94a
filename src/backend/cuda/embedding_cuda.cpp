// dflash.cpp — checked CUDA entry points of the embedding gather (contract: src/ops/embedding.hpp).
// Each checks sizes and pointers (errors name the entry point and the bad value), takes any scratch
// from the context's caching allocator and runs a raw launcher of backend/cuda/embedding.cu
// (declared in embedding_launch.hpp) on the context's stream. Templates are instantiated at the end
// for float and uint16_t (bf16 bits).
#include "backend/cuda/context.hpp"
#include "backend/cuda/embedding_launch.hpp"
#include "backend/cuda/entry.hpp"
#include "core/error.hpp"
#include "ops/embedding.hpp"

namespace dflash {

template <typename Y, typename W>
void embedding_fwd_cuda(cuda::CudaContext& ctx, Y* y, const W* table, const int32_t* ids, int64_t T,
                        int64_t V, int64_t H) {
  DFLASH_CHECK(T >= 0 && V > 0 && H > 0, "embedding_fwd_cuda: bad sizes T={} V={} H={}", T, V, H);
  if (T == 0) return;
  DFLASH_CHECK(y && table && ids, "embedding_fwd_cuda: null pointer");
  cuda::launch::embedding_fwd(y, cuda::dtype_of<Y>(), table, cuda::dtype_of<W>(), ids, T, V, H,
                              ctx.stream());
}

// ---------------------------------------------------------------- instantiations
template void embedding_fwd_cuda(cuda::CudaContext&, float*, const float*, const int32_t*, int64_t,
                                 int64_t, int64_t);
template void embedding_fwd_cuda(cuda::CudaContext&, float*, const uint16_t*, const int32_t*,
                                 int64_t, int64_t, int64_t);
template void embedding_fwd_cuda(cuda::CudaContext&, uint16_t*, const float*, const int32_t*,
                                 int64_t, int64_t, int64_t);
template void embedding_fwd_cuda(cuda::CudaContext&, uint16_t*, const uint16_t*, const int32_t*,
                                 int64_t, int64_t, int64_t);

}  // namespace dflash
