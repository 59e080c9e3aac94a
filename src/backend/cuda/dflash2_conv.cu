// dflash.cpp — CUDA kernels of DFlash2's grouped dynamic causal conv and its backward (semantics:
// src/ops/dflash2_conv.hpp). fp32 arithmetic; x/out f32 or bf16. out and dx: one thread per
// element, the taps in order. dδ: one warp per (row, tap, group), lanes striding the group's
// channels, then the warp's fixed butterfly. dβ: one thread per (column, tap) and row chunk, rows
// in order, then a second pass summing the chunks in order. Deterministic, no atomics. No fmt in
// this file (nvcc).
#include "backend/cuda/common.cuh"
#include "backend/cuda/dflash2_conv_launch.hpp"

namespace dflash::cuda {
namespace {

using launch::Dflash2ConvDims;

// The column of δ [rows, 2·T·Gc] of side σ, tap t, group G: σ·T·Gc + t·Gc + G.
__device__ __forceinline__ int64_t delta_col(const Dflash2ConvDims& d, int side, int64_t t,
                                             int64_t group) {
  const int64_t groups = d.H / d.group;
  return (side * d.taps + t) * groups + group;
}

template <typename X, typename O>
__global__ void conv_fwd_kernel(O* out, const float* residual, const X* x, const float* base,
                                const float* delta, int side, Dflash2ConvDims d) {
  const int64_t n = d.rows * d.H, width = 2 * d.taps * (d.H / d.group);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / d.H, c = e % d.H, slot = i % d.block, grp = c / d.group;
    const int64_t last = slot < d.taps - 1 ? slot : d.taps - 1;  // taps stay inside the block
    float acc = 0.f;
    for (int64_t t = 0; t <= last; ++t) {
      const float k = base[t * d.H + c] + delta[i * width + delta_col(d, side, t, grp)];
      acc += k * to_f32(x[(i - t) * d.H + c]);
    }
    out[e] = from_f32<O>(residual ? residual[e] + acc : acc);
  }
}

template <typename DX, bool kAccumulate>
__global__ void conv_bwd_dx_kernel(DX* dx, const float* dout, const float* base, const float* delta,
                                   int side, Dflash2ConvDims d) {
  const int64_t n = d.rows * d.H, width = 2 * d.taps * (d.H / d.group);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = e / d.H, c = e % d.H, slot = k % d.block, grp = c / d.group;
    // Row i = k + t reads x[k] through tap t while i stays in k's block.
    const int64_t reach = d.block - 1 - slot;
    const int64_t last = reach < d.taps - 1 ? reach : d.taps - 1;
    float acc = 0.f;
    for (int64_t t = 0; t <= last; ++t) {
      const int64_t i = k + t;
      const float w = base[t * d.H + c] + delta[i * width + delta_col(d, side, t, grp)];
      acc += w * dout[i * d.H + c];
    }
    if constexpr (kAccumulate) {
      dx[e] = from_f32<DX>(to_f32(dx[e]) + acc);
    } else {
      dx[e] = from_f32<DX>(acc);
    }
  }
}

constexpr int kWarpsPerBlock = 8;

// One warp per item (row i, tap t, group G) of the side's half; items past the block start get 0.
template <typename X, typename DD>
__global__ void conv_bwd_ddelta_kernel(DD* ddelta, const float* dout, const X* x, int side,
                                       Dflash2ConvDims d) {
  const int64_t groups = d.H / d.group, width = 2 * d.taps * groups;
  const int64_t items = d.rows * d.taps * groups;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       it < items; it += warps) {
    const int64_t i = it / (d.taps * groups), t = (it / groups) % d.taps, grp = it % groups;
    float acc = 0.f;
    if (t <= i % d.block) {
      const float* go = dout + i * d.H + grp * d.group;
      const X* xs = x + (i - t) * d.H + grp * d.group;
      for (int64_t c = lane; c < d.group; c += 32) acc += go[c] * to_f32(xs[c]);
      acc = warp_sum(acc);
    }
    if (lane == 0) ddelta[i * width + delta_col(d, side, t, grp)] = from_f32<DD>(acc);
  }
}

// Partial dβ of row chunk blockIdx.z for tap blockIdx.y, one thread per column, rows in order.
template <typename X>
__global__ void conv_dbase_part_kernel(float* part, const float* dout, const X* x,
                                       int64_t rows_per_chunk, Dflash2ConvDims d) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= d.H) return;
  const int64_t t = blockIdx.y, chunk = blockIdx.z, r0 = chunk * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < d.rows ? r0 + rows_per_chunk : d.rows;
  float acc = 0.f;
  for (int64_t i = r0; i < r1; ++i) {
    if (t <= i % d.block) acc += dout[i * d.H + c] * to_f32(x[(i - t) * d.H + c]);
  }
  part[(chunk * d.taps + t) * d.H + c] = acc;
}

__global__ void conv_dbase_final_kernel(float* dbase, const float* part, int64_t chunks,
                                        int64_t n) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  float acc = 0.f;
  for (int64_t k = 0; k < chunks; ++k) acc += part[k * n + e];
  dbase[e] += acc;
}

}  // namespace

namespace launch {

void dflash2_conv_fwd(void* out, DType ot, const float* residual, const void* x, DType xt,
                      const float* base_side, const float* delta, int side,
                      const Dflash2ConvDims& d, cudaStream_t s) {
  const int64_t n = d.rows * d.H;
  if (n == 0) return;
  dispatch_dtype(ot, [&](auto ov) {
    dispatch_dtype(xt, [&](auto xv) {
      using O = decltype(ov);
      using X = decltype(xv);
      conv_fwd_kernel<X, O><<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          static_cast<O*>(out), residual, static_cast<const X*>(x), base_side, delta, side, d);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_conv_bwd_dx(void* dx, DType dt, bool accumulate, const float* dout,
                         const float* base_side, const float* delta, int side,
                         const Dflash2ConvDims& d, cudaStream_t s) {
  const int64_t n = d.rows * d.H;
  if (n == 0) return;
  const unsigned grid = grid_for(n, kElementwiseThreads);
  dispatch_dtype(dt, [&](auto dv) {
    using DX = decltype(dv);
    if (accumulate) {
      conv_bwd_dx_kernel<DX, true><<<grid, kElementwiseThreads, 0, s>>>(static_cast<DX*>(dx), dout,
                                                                        base_side, delta, side, d);
    } else {
      conv_bwd_dx_kernel<DX, false><<<grid, kElementwiseThreads, 0, s>>>(static_cast<DX*>(dx), dout,
                                                                         base_side, delta, side, d);
    }
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_conv_bwd_ddelta(void* ddelta, DType dt, const float* dout, const void* x, DType xt,
                             int side, const Dflash2ConvDims& d, cudaStream_t s) {
  const int64_t items = d.rows * d.taps * (d.H / d.group);
  if (items == 0) return;
  const unsigned grid = grid_for(items, kWarpsPerBlock);
  dispatch_dtype(dt, [&](auto dv) {
    dispatch_dtype(xt, [&](auto xv) {
      using DD = decltype(dv);
      using X = decltype(xv);
      conv_bwd_ddelta_kernel<X, DD><<<grid, 32 * kWarpsPerBlock, 0, s>>>(
          static_cast<DD*>(ddelta), dout, static_cast<const X*>(x), side, d);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_conv_bwd_dbase(float* dbase_side, const float* dout, const void* x, DType xt,
                            float* part, int64_t rows_per_chunk, const Dflash2ConvDims& d,
                            cudaStream_t s) {
  if (d.rows == 0) return;
  const int64_t chunks = (d.rows + rows_per_chunk - 1) / rows_per_chunk, n = d.taps * d.H;
  constexpr int kThreads = kElementwiseThreads;
  const auto col_blocks = static_cast<unsigned>((d.H + kThreads - 1) / kThreads);
  const dim3 grid(col_blocks, static_cast<unsigned>(d.taps), static_cast<unsigned>(chunks));
  dispatch_dtype(xt, [&](auto xv) {
    using X = decltype(xv);
    conv_dbase_part_kernel<X>
        <<<grid, kThreads, 0, s>>>(part, dout, static_cast<const X*>(x), rows_per_chunk, d);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
  conv_dbase_final_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(dbase_side, part, chunks, n);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
