// dflash.cpp — checked CUDA entry points of AdamW, the gradient norm, the clip factor and the non-
// finite check (contract: src/ops/adamw.hpp). Each checks sizes and pointers (errors name the entry
// point and the bad value), takes any scratch from the context's caching allocator and runs a raw
// launcher of backend/cuda/adamw.cu (declared in adamw_launch.hpp) on the context's stream.
// Templates are instantiated at the end for float and uint16_t (bf16 bits).
#include <cmath>

#include "backend/cuda/adamw_launch.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "core/error.hpp"
#include "ops/adamw.hpp"

namespace dflash {

void adamw_step_cuda(cuda::CudaContext& ctx, const AdamWSegment* segs, int n_segs, int64_t max_n,
                     const AdamWConfig& c, double lr, int64_t step, const float* grad_scale,
                     const int32_t* skip) {
  DFLASH_CHECK(step >= 1, "AdamW step must be >= 1 (got {})", step);
  DFLASH_CHECK(n_segs >= 0 && n_segs < 65536 && max_n >= 0,
               "adamw_step_cuda: bad segment count {} or size {}", n_segs, max_n);
  if (n_segs == 0) return;
  DFLASH_CHECK(segs, "adamw_step_cuda: null segment table");
  // The same float scalars as adamw_step_cpu.
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  cuda::launch::adamw(segs, n_segs, max_n, static_cast<float>(c.beta1), static_cast<float>(c.beta2),
                      static_cast<float>(c.eps), static_cast<float>(1.0 - lr * c.weight_decay),
                      static_cast<float>(lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2)),
                      grad_scale, skip, ctx.stream());
}

void grad_sumsq_cuda(cuda::CudaContext& ctx, double* out, const AdamWSegment* segs, int n_segs) {
  DFLASH_CHECK(out && n_segs >= 0 && n_segs < 65536 && (n_segs == 0 || segs),
               "grad_sumsq_cuda: bad arguments (n_segs={})", n_segs);
  cuda::DeviceBuffer part = ctx.scratch(grad_sumsq_cuda_scratch_bytes(n_segs));
  cuda::launch::grad_sumsq(out, part.as<double>(), segs, n_segs, ctx.stream());
}

void grad_clip_cuda(cuda::CudaContext& ctx, float* grad_scale, int32_t* skip, double* norm,
                    const double* sumsq, double max_norm) {
  DFLASH_CHECK(sumsq, "grad_clip_cuda: null sumsq");
  cuda::launch::grad_clip(grad_scale, skip, norm, sumsq, max_norm, ctx.stream());
}

template <typename T>
void nonfinite_check_cuda(cuda::CudaContext& ctx, int32_t* flag, const T* x, int64_t n) {
  DFLASH_CHECK(flag && n >= 0 && (n == 0 || x), "nonfinite_check_cuda: bad arguments (n={})", n);
  cuda::launch::nonfinite_check(flag, x, cuda::dtype_of<T>(), n, ctx.stream());
}

// ---------------------------------------------------------------- instantiations
template void nonfinite_check_cuda(cuda::CudaContext&, int32_t*, const float*, int64_t);
template void nonfinite_check_cuda(cuda::CudaContext&, int32_t*, const uint16_t*, int64_t);

}  // namespace dflash
