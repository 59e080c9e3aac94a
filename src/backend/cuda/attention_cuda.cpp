// dflash.cpp — checked CUDA entry points of DFlash/causal attention, CUDA-core and tensor-core
// kernels (contract: src/ops/attention.hpp). Each checks sizes and pointers (errors name the entry
// point and the bad value), takes any scratch from the context's caching allocator and runs a raw
// launcher of backend/cuda/attention.cu (CUDA cores) or attention_tc.cu (tensor cores) (declared in
// attention_launch.hpp) or attention_wgmma.cu (Hopper, attention_wgmma.hpp) on the context's
// stream.
// AttnCudaKernels::automatic resolves to kAttnHopperKernels on an sm_90 device, tensor_core on any
// other: a choice by device, made before any launch, never a retry after an error.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_launch.hpp"
#include "backend/cuda/attention_wgmma.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "core/error.hpp"
#include "ops/attention.hpp"

namespace dflash {

namespace {
/// True for the Hopper family (AttnCudaKernels::wgmma).
bool is_wgmma(AttnCudaKernels k) {
  return k == AttnCudaKernels::wgmma;
}

void check_attn(const char* op, const AttnParams& p) {
  DFLASH_CHECK(p.Tq >= 0 && p.Tk >= 0 && p.NH > 0 && p.NKV > 0 && p.NH % p.NKV == 0 &&
                   p.Tq < (1ll << 31) && p.Tk < (1ll << 31) && std::isfinite(p.scale),
               "{}: bad sizes Tq={} Tk={} NH={} NKV={} scale={} (NH must be a multiple of NKV)", op,
               p.Tq, p.Tk, p.NH, p.NKV, p.scale);
  DFLASH_CHECK(p.D == 64 || p.D == 128, "{}: head dimension {} is not supported (64 or 128)", op,
               p.D);
}
}  // namespace

void attention_window_ranges_cuda(cuda::CudaContext& ctx, AttnRange* out, const AttnRange* in,
                                  int64_t T, int64_t window) {
  DFLASH_CHECK(T >= 0 && window >= 1,
               "attention_window_ranges_cuda: window must be >= 1, got {} (T={})", window, T);
  if (T == 0) return;
  DFLASH_CHECK(out && in, "attention_window_ranges_cuda: null pointer");
  cuda::launch::attention_window_ranges(out, in, T, window, ctx.stream());
}

bool attention_wgmma_available_cuda(cuda::CudaContext& ctx) {
  int major = 0;
  DFLASH_CUDA_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx.device()));
  return major == 9;
}

AttnCudaKernels attention_kernels_cuda(cuda::CudaContext& ctx, AttnCudaKernels k) {
  if (k != AttnCudaKernels::automatic) return k;
  return attention_wgmma_available_cuda(ctx) ? kAttnHopperKernels : AttnCudaKernels::tensor_core;
}

void attention_fwd_cuda(cuda::CudaContext& ctx, uint16_t* o, float* lse, const uint16_t* q,
                        const uint16_t* k, const uint16_t* v, const AttnRange* ranges,
                        const AttnParams& p) {
  check_attn("attention_fwd_cuda", p);
  if (p.Tq == 0) return;
  DFLASH_CHECK(o && q && ranges && (p.Tk == 0 || (k && v)), "attention_fwd_cuda: null pointer");
  const AttnCudaKernels kind = attention_kernels_cuda(ctx, p.kernels);
  if (is_wgmma(kind)) {
    DFLASH_CHECK(
        cuda::aligned16(o) && cuda::aligned16(q) && cuda::aligned16(k) && cuda::aligned16(v),
        "attention_fwd_cuda (wgmma): o, q, k, v must be 16-byte aligned");
    DFLASH_CHECK(attention_wgmma_available_cuda(ctx),
                 "attention_fwd_cuda (wgmma): the wgmma kernels need an sm_90 GPU (Hopper); "
                 "device {} is not one (choose the tensor_core kernels)",
                 ctx.device());
    cuda::launch::attention_wgmma_fwd(o, lse, q, k, v, ranges, p, ctx.stream());
    return;
  }
  if (kind == AttnCudaKernels::tensor_core) {
    DFLASH_CHECK(
        cuda::aligned16(o) && cuda::aligned16(q) && cuda::aligned16(k) && cuda::aligned16(v),
        "attention_fwd_cuda (tensor cores): o, q, k, v must be 16-byte aligned");
    cuda::launch::attention_tc_fwd(o, lse, q, k, v, ranges, p, ctx.stream());
    return;
  }
  DFLASH_CHECK(cuda::aligned4(q) && cuda::aligned4(k) && cuda::aligned4(v),
               "attention_fwd_cuda: q, k, v must be 4-byte aligned");
  cuda::launch::attention_fwd(o, lse, q, k, v, ranges, p, ctx.stream());
}

void attention_bwd_cuda(cuda::CudaContext& ctx, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                        const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, const uint16_t* o, const float* lse,
                        const AttnRange* ranges, const AttnParams& p) {
  check_attn("attention_bwd_cuda", p);
  DFLASH_CHECK((dout && q && k && v && o && lse && ranges) || p.Tq == 0,
               "attention_bwd_cuda: an input pointer is null");
  const AttnCudaKernels kind = attention_kernels_cuda(ctx, p.kernels);
  const bool wg = is_wgmma(kind);
  const bool tc = kind == AttnCudaKernels::tensor_core || wg;
  if (wg)
    DFLASH_CHECK(attention_wgmma_available_cuda(ctx),
                 "attention_bwd_cuda (wgmma): the wgmma kernels need an sm_90 GPU (Hopper); "
                 "device {} is not one (choose the tensor_core kernels)",
                 ctx.device());
  if (tc)
    DFLASH_CHECK(cuda::aligned16(dq) && cuda::aligned16(dk) && cuda::aligned16(dv) &&
                     cuda::aligned16(dout) && cuda::aligned16(q) && cuda::aligned16(k) &&
                     cuda::aligned16(v) && cuda::aligned16(o),
                 "attention_bwd_cuda (tensor cores): dq, dk, dv, dout, q, k, v, o must be "
                 "16-byte aligned");
  else
    DFLASH_CHECK(cuda::aligned4(q) && cuda::aligned4(k) && cuda::aligned4(v),
                 "attention_bwd_cuda: q, k, v must be 4-byte aligned");
  // Sizes as attention_bwd_cuda_scratch_bytes.
  cuda::DeviceBuffer delta = ctx.scratch(static_cast<size_t>(p.NH * p.Tq) * sizeof(float));
  const int64_t tiles = (p.Tk + cuda::launch::kAttnKeyTile - 1) / cuda::launch::kAttnKeyTile;
  cuda::DeviceBuffer span =
      ctx.scratch(static_cast<size_t>(std::max<int64_t>(tiles, 1)) * 2 * sizeof(int));
  if (wg)
    cuda::launch::attention_wgmma_bwd(dq, dk, dv, dout, q, k, v, o, lse, ranges, p,
                                      delta.as<float>(), span.as<int>(), ctx.stream());
  else if (tc)
    cuda::launch::attention_tc_bwd(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta.as<float>(),
                                   span.as<int>(), ctx.stream());
  else
    cuda::launch::attention_bwd(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta.as<float>(),
                                span.as<int>(), ctx.stream());
}

}  // namespace dflash
