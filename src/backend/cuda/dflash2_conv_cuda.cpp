// dflash.cpp — checked CUDA entry points of DFlash2's grouped dynamic causal conv (contract:
// src/ops/dflash2_conv.hpp). Each checks the shape, the side and the pointers (errors name the
// entry point and the bad value), takes dβ's partial sums from the context's caching allocator
// and runs a raw launcher of backend/cuda/dflash2_conv.cu (dflash2_conv_launch.hpp) on the
// context's stream. Templates are instantiated at the end for float and uint16_t (bf16 bits).
#include <type_traits>

#include "backend/cuda/context.hpp"
#include "backend/cuda/dflash2_conv_launch.hpp"
#include "backend/cuda/entry.hpp"
#include "core/error.hpp"
#include "ops/dflash2_conv.hpp"

namespace dflash {

namespace {

// The shape checked for entry point `what`, as the launchers take it.
cuda::launch::Dflash2ConvDims checked_dims(const char* what, const Dflash2ConvShape& s, int side) {
  try {
    s.check();
  } catch (const Error& e) {
    throw e.with_context(what);
  }
  DFLASH_CHECK(side == 0 || side == 1, "{}: side {} (0 pre, 1 post)", what, side);
  return {s.rows, s.H, s.block, s.taps, s.group};
}

}  // namespace

template <typename X, typename O>
void dflash2_conv_fwd_cuda(cuda::CudaContext& ctx, O* out, const float* residual, const X* x,
                           const float* base_side, const float* delta, int side,
                           const Dflash2ConvShape& s) {
  const auto d = checked_dims("dflash2_conv_fwd_cuda", s, side);
  if (s.rows == 0) return;
  DFLASH_CHECK(out && x && base_side && delta, "dflash2_conv_fwd_cuda: null pointer");
  DFLASH_CHECK((!residual || std::is_same_v<O, float>),
               "dflash2_conv_fwd_cuda: a residual needs an f32 output");
  cuda::launch::dflash2_conv_fwd(out, cuda::dtype_of<O>(), residual, x, cuda::dtype_of<X>(),
                                 base_side, delta, side, d, ctx.stream());
}

template <typename DX>
void dflash2_conv_bwd_dx_cuda(cuda::CudaContext& ctx, DX* dx, bool accumulate, const float* dout,
                              const float* base_side, const float* delta, int side,
                              const Dflash2ConvShape& s) {
  const auto d = checked_dims("dflash2_conv_bwd_dx_cuda", s, side);
  if (s.rows == 0) return;
  DFLASH_CHECK(dx && dout && base_side && delta, "dflash2_conv_bwd_dx_cuda: null pointer");
  DFLASH_CHECK((!accumulate || std::is_same_v<DX, float>),
               "dflash2_conv_bwd_dx_cuda: accumulating needs an f32 dx");
  cuda::launch::dflash2_conv_bwd_dx(dx, cuda::dtype_of<DX>(), accumulate, dout, base_side, delta,
                                    side, d, ctx.stream());
}

template <typename X, typename DD>
void dflash2_conv_bwd_ddelta_cuda(cuda::CudaContext& ctx, DD* ddelta, const float* dout, const X* x,
                                  int side, const Dflash2ConvShape& s) {
  const auto d = checked_dims("dflash2_conv_bwd_ddelta_cuda", s, side);
  if (s.rows == 0) return;
  DFLASH_CHECK(ddelta && dout && x, "dflash2_conv_bwd_ddelta_cuda: null pointer");
  cuda::launch::dflash2_conv_bwd_ddelta(ddelta, cuda::dtype_of<DD>(), dout, x, cuda::dtype_of<X>(),
                                        side, d, ctx.stream());
}

template <typename X>
void dflash2_conv_bwd_dbase_cuda(cuda::CudaContext& ctx, float* dbase_side, const float* dout,
                                 const X* x, const Dflash2ConvShape& s) {
  const auto d = checked_dims("dflash2_conv_bwd_dbase_cuda", s, 0);
  if (s.rows == 0) return;
  DFLASH_CHECK(dbase_side && dout && x, "dflash2_conv_bwd_dbase_cuda: null pointer");
  // Sizes as dflash2_conv_bwd_cuda_scratch_bytes.
  const int64_t chunks = dflash2_conv_cuda_dbase_chunks(s.rows);
  cuda::DeviceBuffer part = ctx.scratch(static_cast<size_t>(chunks * s.taps * s.H) * sizeof(float));
  cuda::launch::dflash2_conv_bwd_dbase(dbase_side, dout, x, cuda::dtype_of<X>(), part.as<float>(),
                                       dflash2_conv_cuda_dbase_rows_per_chunk(s.rows), d,
                                       ctx.stream());
}

// ---------------------------------------------------------------- instantiations
#define DFLASH_INST_X(X)                                                                           \
  template void dflash2_conv_fwd_cuda(cuda::CudaContext&, X*, const float*, const X*,              \
                                      const float*, const float*, int, const Dflash2ConvShape&);   \
  template void dflash2_conv_bwd_dx_cuda(cuda::CudaContext&, X*, bool, const float*, const float*, \
                                         const float*, int, const Dflash2ConvShape&);              \
  template void dflash2_conv_bwd_ddelta_cuda(cuda::CudaContext&, X*, const float*, const X*, int,  \
                                             const Dflash2ConvShape&);                             \
  template void dflash2_conv_bwd_dbase_cuda(cuda::CudaContext&, float*, const float*, const X*,    \
                                            const Dflash2ConvShape&);
DFLASH_INST_X(float)
DFLASH_INST_X(uint16_t)
#undef DFLASH_INST_X
// A bf16 conv input with an f32 dδ (tests), an f32 input with a bf16 dδ (the post-conv's y).
template void dflash2_conv_bwd_ddelta_cuda(cuda::CudaContext&, float*, const float*,
                                           const uint16_t*, int, const Dflash2ConvShape&);
template void dflash2_conv_bwd_ddelta_cuda(cuda::CudaContext&, uint16_t*, const float*,
                                           const float*, int, const Dflash2ConvShape&);

}  // namespace dflash
