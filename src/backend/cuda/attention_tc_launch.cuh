// dflash.cpp — host-side launch pieces shared by the tensor-core (attention_tc.cu) and Hopper
// (attention_wgmma.cu) attention launchers: the argument blocks of one forward or backward call,
// the zero gradients of a call without query rows, a kernel launch with its shared-memory opt-in,
// and the backward's pre-passes (Δ, the query span of each 64-key tile). Kernels and semantics:
// attention_tc.cuh and src/ops/attention.hpp. Included by .cu files only (kernel launches).
// Every launch goes on the caller's stream and is checked (dflash::Error via check.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attention_tc.cuh"

namespace dflash::cuda::attn_tc {
namespace {

/// Launches `kernel` on `grid` × `threads` with `smem` bytes of dynamic shared memory. Raising the
/// dynamic shared-memory limit is a per-device attribute of the function, not a stream operation:
/// cheap, and allowed while a graph is being captured.
template <typename Kernel>
void launch_attn_kernel(Kernel kernel, dim3 grid, int threads, int smem, const Args& a,
                        cudaStream_t s) {
  DFLASH_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, threads, smem, s>>>(a);
  DFLASH_CUDA_LAUNCH_CHECK();
}

/// The kernels' arguments of one forward call (contract of launch::attention_tc_fwd).
inline Args attn_fwd_args(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                          const uint16_t* v, const AttnRange* ranges, const AttnParams& p) {
  Args a = make_args(p, ranges);
  a.q = q, a.k = k, a.v = v, a.out = o, a.lse_out = lse;
  return a;
}

/// The kernels' arguments of one backward call (contract of launch::attention_tc_bwd).
inline Args attn_bwd_args(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                          const uint16_t* q, const uint16_t* k, const uint16_t* v,
                          const uint16_t* o, const float* lse, const AttnRange* ranges,
                          const AttnParams& p, float* delta_ws, int* span_ws) {
  Args a = make_args(p, ranges);
  a.q = q, a.k = k, a.v = v, a.o = o, a.dout = dout;
  a.dq = dq, a.dk = dk, a.dv = dv, a.lse = lse, a.delta = delta_ws, a.span = span_ws;
  return a;
}

/// A backward call without query rows: dk and dv [Tk, NKV, D] (each may be null) are zero, as no
/// row sees any key. Returns true when it handled the call (p.Tq == 0).
inline bool attn_bwd_without_rows(uint16_t* dk, uint16_t* dv, const AttnParams& p, cudaStream_t s) {
  if (p.Tq != 0) return false;
  const size_t bytes = static_cast<size_t>(p.Tk * p.NKV * p.D) * 2;
  if (dk && bytes) DFLASH_CUDA_CHECK(cudaMemsetAsync(dk, 0, bytes, s));
  if (dv && bytes) DFLASH_CUDA_CHECK(cudaMemsetAsync(dv, 0, bytes, s));
  return true;
}

/// The backward's first pre-pass: delta [NH, Tq] (a.delta) = rowsum(dO ∘ O), FlashAttention-2's
/// D_i.
template <int D>
void launch_attn_delta(const Args& a, float* delta, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(a.Tq) * a.NH;
  attn_tc_delta_kernel<D><<<grid_for(rows * 8, 256), 256, 0, s>>>(delta, a.dout, a.o, a.Tq, a.NH);
  DFLASH_CUDA_LAUNCH_CHECK();
}

/// The dk/dv pre-pass: span [2·key_tiles(a)] (a.span) = the first and last query row whose ranges
/// touch each 64-key tile (INT_MAX and −1 for a tile no row touches). Needs a.Tk > 0.
inline void launch_attn_spans(const Args& a, int* span, cudaStream_t s) {
  const int n_tiles = key_tiles(a);
  attn_tc_span_init_kernel<<<grid_for(n_tiles, 256), 256, 0, s>>>(span, n_tiles);
  DFLASH_CUDA_LAUNCH_CHECK();
  attn_tc_span_kernel<<<grid_for(a.Tq, 256), 256, 0, s>>>(span, a.ranges, a.Tq, a.Tk);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace dflash::cuda::attn_tc
