// dflash.cpp — checked CUDA entry points of SwiGLU (contract: src/ops/swiglu.hpp). Each checks
// sizes and pointers (errors name the entry point and the bad value), takes any scratch from the
// context's caching allocator and runs a raw launcher of backend/cuda/swiglu.cu (declared in
// swiglu_launch.hpp) on the context's stream. Templates are instantiated at the end for float and
// uint16_t (bf16 bits).
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/swiglu_launch.hpp"
#include "core/error.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

template <typename T>
void swiglu_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* gate, const T* up, int64_t Tn,
                     int64_t I, int64_t ld_in) {
  DFLASH_CHECK(Tn >= 0 && I > 0 && ld_in >= I, "swiglu_fwd_cuda: bad sizes T={} I={} ld_in={}", Tn,
               I, ld_in);
  if (Tn == 0) return;
  DFLASH_CHECK(y && gate && up, "swiglu_fwd_cuda: null pointer");
  cuda::launch::swiglu_fwd(y, gate, up, cuda::dtype_of<T>(), Tn, I, ld_in, ctx.stream());
}
template <typename T>
void swiglu_bwd_cuda(cuda::CudaContext& ctx, T* dgate, T* dup, const T* dy, const T* gate,
                     const T* up, int64_t Tn, int64_t I, int64_t ld_in) {
  DFLASH_CHECK(Tn >= 0 && I > 0 && ld_in >= I, "swiglu_bwd_cuda: bad sizes T={} I={} ld_in={}", Tn,
               I, ld_in);
  if (Tn == 0) return;
  DFLASH_CHECK(dgate && dup && dy && gate && up, "swiglu_bwd_cuda: null pointer");
  cuda::launch::swiglu_bwd(dgate, dup, dy, gate, up, cuda::dtype_of<T>(), Tn, I, ld_in,
                           ctx.stream());
}

// ---------------------------------------------------------------- instantiations
#define DFLASH_INST_T(T)                                                                           \
  template void swiglu_fwd_cuda(cuda::CudaContext&, T*, const T*, const T*, int64_t, int64_t,      \
                                int64_t);                                                          \
  template void swiglu_bwd_cuda(cuda::CudaContext&, T*, T*, const T*, const T*, const T*, int64_t, \
                                int64_t, int64_t);
DFLASH_INST_T(float)
DFLASH_INST_T(uint16_t)
#undef DFLASH_INST_T

}  // namespace dflash
