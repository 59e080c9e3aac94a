// dflash.cpp — raw launchers of the Hopper (sm_90a, wgmma) attention forward and backward
// (src/backend/cuda/attention_wgmma.cu). Same contract as launch::attention_tc_fwd
// (src/ops/attention.hpp): all bf16 arrays 16-byte aligned, D 64 or 128; the caller checks sizes,
// pointers, alignment and that the device is sm_90 (attention_cuda.cpp). Host-includable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash::cuda::launch {

/// o [Tq, NH, D] = softmax(scale·q·kᵀ over each row's ranges)·v, lse [NH, Tq] (natural log; may
/// be null), with the wgmma forward (attention_wgmma.cu, v6: one warpgroup per CTA, 64 query
/// rows per CTA; docs/perf.md, "Hopper attention"). Enqueued on `s`; the
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
                         float* delta_ws, int* span_ws, cudaStream_t s);

}  // namespace dflash::cuda::launch
