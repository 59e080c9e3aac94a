// dflash.cpp — raw launchers of the Hopper (sm_90a, wgmma) attention forward and backward
// (src/backend/cuda/attention_wgmma.cu). Same contract as launch::attention_tc_fwd
// (src/ops/attention.hpp): all bf16 arrays 16-byte aligned, D 64 or 128; the caller checks sizes,
// pointers, alignment and that the device is sm_90 (attention_cuda.cpp). Host-includable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash::cuda::launch {

/// The versions of the wgmma kernels (docs/perf.md, "Hopper attention"; one warpgroup per CTA,
/// 64 query rows in the forward and dq, 64 keys in dk/dv; all share the forward):
enum class WgmmaVariant {
  v3,  ///< the backward's products one after the other
  v5,  ///< v3 with dq overlapping dQ += dS_{j−1}·K_{j−1} with tile j's products (Q in registers,
       ///< K in three stages)
  v6,  ///< v5 with the backward's instructions per tile cut (dk/dv's chunk loader, dq's and
       ///< dk/dv's dS parts); the same values as v5, bit for bit
};

/// o [Tq, NH, D] = softmax(scale·q·kᵀ over each row's ranges)·v, lse [NH, Tq] (natural log; may
/// be null), with the wgmma forward (every version's; attention_wgmma.cu). Enqueued on `s`; the
/// sm_90a-only instructions trap on any other device, so the caller must check it.
void attention_wgmma_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                         const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                         cudaStream_t s);

/// dq [Tq, NH, D], dk, dv [Tk, NKV, D] (overwritten; each may be null) of attention_wgmma_fwd
/// given dout, o and lse (contract of launch::attention_tc_bwd: delta_ws [NH·Tq] floats, span_ws
/// 2 ints per 64-key tile): Δ, dq per 64 query rows, dk/dv per 64 keys, wgmma products, no
/// atomics on outputs, bit-reproducible.
void attention_wgmma_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                         const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                         const float* lse, const AttnRange* ranges, const AttnParams& p,
                         WgmmaVariant var, float* delta_ws, int* span_ws, cudaStream_t s);

}  // namespace dflash::cuda::launch
