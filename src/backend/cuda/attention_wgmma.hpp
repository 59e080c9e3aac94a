// dflash.cpp — raw launchers of the Hopper (sm_90a, wgmma) attention forward and backward
// (src/backend/cuda/attention_wgmma.cu). Same contract as launch::attention_tc_fwd
// (src/ops/attention.hpp): all bf16 arrays 16-byte aligned, D 64 or 128; the caller checks sizes,
// pointers, alignment and that the device is sm_90 (attention_cuda.cpp). Host-includable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash::cuda::launch {

/// The versions of the wgmma kernels (docs/perf.md, "Hopper attention"):
enum class WgmmaVariant {
  v3,    ///< one warpgroup per CTA (64 query rows in the forward and dq, 64 keys in dk/dv),
         ///< no overlap in the backward
  v5,    ///< v3 with dq overlapping dQ += dS_{j−1}·K_{j−1} with tile j's products (Q in
         ///< registers, K in three stages); the forward and dk/dv of v3
  pair,  ///< v4: two warpgroups per CTA sharing its tiles (128 query rows under one set of K/V
         ///< tiles, 128 keys under one stream of Q/dO chunks), dq and dk/dv overlapped
};

/// o [Tq, NH, D] = softmax(scale·q·kᵀ over each row's ranges)·v, lse [NH, Tq] (natural log; may
/// be null), with the wgmma kernels of version `var` (attention_wgmma.cu). Enqueued on `s`; the
/// sm_90a-only instructions trap on any other device, so the caller must check it.
void attention_wgmma_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                         const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                         WgmmaVariant var, cudaStream_t s);

/// dq [Tq, NH, D], dk, dv [Tk, NKV, D] (overwritten; each may be null) of attention_wgmma_fwd
/// given dout, o and lse (contract of launch::attention_tc_bwd: delta_ws [NH·Tq] floats, span_ws
/// 2 ints per 64-key tile): Δ, dq per 64 (pair: 128) query rows, dk/dv per 64 (pair: 128) keys,
/// wgmma products, no atomics on outputs, bit-reproducible.
void attention_wgmma_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                         const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                         const float* lse, const AttnRange* ranges, const AttnParams& p,
                         WgmmaVariant var, float* delta_ws, int* span_ws, cudaStream_t s);

}  // namespace dflash::cuda::launch
