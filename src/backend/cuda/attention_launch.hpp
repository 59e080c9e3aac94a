// dflash.cpp — raw-pointer launchers of the attention kernels (attention.cu: CUDA cores;
// attention_tc.cu: tensor cores), checked entry points in backend/cuda/attention_cuda.cpp
// (contract: src/ops/attention.hpp); as for every op family F, in backend/cuda/F_launch.hpp.
// Internal to the backend: model code calls the checked entry points.
// Each launcher enqueues on `stream` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp). Statistics (lse, Δ) are always f32. No fmt in this header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"
#include "ops/attention.hpp"

namespace dflash::cuda::launch {

// ---- attention.cu
/// q, k, v, o bf16; lse f32 [NH, Tq]; ranges on the device.
void attention_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                   const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                   cudaStream_t s);
/// delta_ws: f32 [NH, Tq] scratch; span_ws: int32 [2·ceil(Tk/32)] scratch (query span per key
/// tile).
void attention_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                   const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                   const float* lse, const AttnRange* ranges, const AttnParams& p,
                   float* delta_ws, int* span_ws, cudaStream_t s);
/// Key-tile width of the attention kernels (span_ws has 2 ints per tile of this many keys).
constexpr int kAttnKeyTile = kAttnCudaKeyTile;
/// out[t] = in[t] with lo1 = max(lo1, hi1 − window) (device arrays; out may alias in).
void attention_window_ranges(AttnRange* out, const AttnRange* in, int64_t T, int64_t window,
                             cudaStream_t s);

// ---- attention_tc.cu (tensor cores; same contracts as attention_fwd / attention_bwd, all bf16
// arrays 16-byte aligned, D 64 or 128; span_ws sized as for attention_bwd)
void attention_tc_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                      cudaStream_t s);
void attention_tc_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                      const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                      const float* lse, const AttnRange* ranges, const AttnParams& p,
                      float* delta_ws, int* span_ws, cudaStream_t s);

}  // namespace dflash::cuda::launch
