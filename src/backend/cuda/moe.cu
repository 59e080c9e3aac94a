// dflash.cpp — CUDA mixture-of-experts kernels (semantics and layout: src/ops/moe.hpp).
//
// Routing: one warp per token, K rounds of a warp arg-max (larger score first, ties to the lower
// expert index, as the CPU reference). Dispatch: a counting sort in three kernels — per-expert
// counts (one block per expert), one exclusive scan, and a stable scatter (one block per expert
// walking the pairs in order with a block-wide prefix of its matches) — so the layout is a pure
// function of ids, with no atomics on anything but integer counts. Grouped linear: bf16 tensor-core
// tiles (WMMA m16n16k16, fp32 accumulate) of 64 sorted rows × 128 output columns; a block finds its
// expert and row range from the device offsets (tile t of expert e covers rows offsets[e] + 64·t
// onward), so nothing is read back to the host and the launch is graph-capturable. Operand tiles
// stream through shared memory with cp.async, two stages. Every output element is written by one
// thread after a fixed-order K loop: results are bit-reproducible.
// No fmt in this file (nvcc); shapes are checked by the entry points in moe_cuda.cpp.
#include <cuda_bf16.h>
#include <mma.h>

#include <climits>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/moe_launch.hpp"

namespace dflash::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// ------------------------------------------------------------------------------------ routing

constexpr int kRouteMaxPerLane = 32;  // E ≤ 1024

// Arg-max over the warp of (value, expert): larger value, then lower expert.
__device__ __forceinline__ void warp_argmax(float& v, int& e) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oe = __shfl_xor_sync(kFull, e, o);
    if (ov > v || (ov == v && oe < e)) v = ov, e = oe;
  }
}

__global__ void moe_route_kernel(int32_t* ids, float* weights, const float* logits, int T, int E,
                                 int K, int softmax_first, int norm_topk) {
  const int t =
      static_cast<int>((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  if (t >= T) return;  // the whole warp leaves together
  const float* l = logits + static_cast<int64_t>(t) * E;
  const int per = (E + 31) / 32;
  float v[kRouteMaxPerLane];
  float m = -INFINITY;
  for (int i = 0; i < per; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? l[e] : -INFINITY;
    m = fmaxf(m, v[i]);
  }
  m = warp_max(m);
  if (softmax_first) {  // p = softmax over all experts
    float sum = 0.f;
    for (int i = 0; i < per; ++i) {
      if (lane + 32 * i < E) v[i] = expf(v[i] - m), sum += v[i];
    }
    sum = warp_sum(sum);
    for (int i = 0; i < per; ++i) v[i] /= sum;
  }
  uint32_t taken = 0;  // bit i: expert lane + 32·i already chosen
  float top0 = 0.f, total = 0.f;
  for (int k = 0; k < K; ++k) {
    float bv = -INFINITY;
    int be = INT_MAX;
    for (int i = 0; i < per; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !(taken >> i & 1u) && (v[i] > bv || (v[i] == bv && e < be))) bv = v[i], be = e;
    }
    warp_argmax(bv, be);
    if ((be & 31) == lane) taken |= 1u << (be >> 5);
    if (k == 0) top0 = bv;
    const float w = softmax_first ? bv : expf(bv - top0);
    total += w;
    if (lane == 0) {
      ids[static_cast<int64_t>(t) * K + k] = be;
      weights[static_cast<int64_t>(t) * K + k] = w;
    }
  }
  __syncwarp();
  if (lane == 0 && (!softmax_first || norm_topk)) {
    for (int k = 0; k < K; ++k) weights[static_cast<int64_t>(t) * K + k] /= total;
  }
}

// ----------------------------------------------------------------------------------- dispatch

constexpr int kSortThreads = 256;

__global__ void moe_count_kernel(int32_t* counts, const int32_t* ids, int R) {
  __shared__ int n;
  if (threadIdx.x == 0) n = 0;
  __syncthreads();
  const int e = blockIdx.x;
  int mine = 0;
  for (int i = threadIdx.x; i < R; i += blockDim.x) mine += ids[i] == e;
  atomicAdd(&n, mine);  // integer sum: exact in any order
  __syncthreads();
  if (threadIdx.x == 0) counts[e] = n;
}

__global__ void moe_scan_kernel(int32_t* offsets, const int32_t* counts, int E) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int s = 0;
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) offsets[e + 1] = s += counts[e];
}

// Block e writes its pairs in increasing pair order to rows offsets[e], offsets[e] + 1, ...
__global__ void __launch_bounds__(kSortThreads)
    moe_scatter_kernel(int32_t* perm, int32_t* slot, int32_t* row_expert, const int32_t* ids,
                       const int32_t* offsets, int R) {
  __shared__ int warp_tot[kSortThreads / 32];
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int base = offsets[e];
  for (int i0 = 0; i0 < R; i0 += kSortThreads) {
    const int i = i0 + threadIdx.x;
    const bool hit = i < R && ids[i] == e;
    const unsigned b = __ballot_sync(kFull, hit);
    if (lane == 0) warp_tot[warp] = __popc(b);
    __syncthreads();
    int before = 0, chunk = 0;
    for (int w = 0; w < kSortThreads / 32; ++w) {
      before += w < warp ? warp_tot[w] : 0;
      chunk += warp_tot[w];
    }
    if (hit) {
      const int r = base + before + __popc(b & ((1u << lane) - 1u));
      perm[r] = i;
      slot[i] = r;
      row_expert[r] = e;
    }
    base += chunk;
    __syncthreads();
  }
}

// ------------------------------------------------------------------------------------- gather

__global__ void moe_gather_vec_kernel(uint4* xs, const uint4* x, const int32_t* perm, int64_t R,
                                      int K, int64_t H8) {
  const int64_t n = R * H8;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / H8, c = i % H8;
    xs[i] = x[static_cast<int64_t>(perm[r] / K) * H8 + c];
  }
}

__global__ void moe_gather_kernel(uint16_t* xs, const uint16_t* x, const int32_t* perm, int64_t R,
                                  int K, int64_t H) {
  const int64_t n = R * H;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / H, c = i % H;
    xs[i] = x[static_cast<int64_t>(perm[r] / K) * H + c];
  }
}

// ----------------------------------------------------------------------------- grouped linear

constexpr int kGM = 64, kGN = 128, kGK = 32;  // block tile: rows × output columns × k step
constexpr int kLds = kGK + 8;                 // smem row stride of operand tiles (halves)
constexpr int kLdc = kGN + 4;                 // smem row stride of the fp32 epilogue tile
constexpr int kGemmThreads = 128;             // 4 warps, 2 × 2, each 32 rows × 64 columns
constexpr int kStageHalves = (kGM + kGN) * kLds;
constexpr int kSmemBytes =
    2 * kStageHalves * 2 > kGM* kLdc * 4 ? 2 * kStageHalves * 2 : kGM* kLdc * 4;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_one() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// The expert and row range of m-tile `tile` (warp 0): tiles of expert e are numbered after those of
// experts < e, ceil(count_e / kGM) each. Returns e = -1 past the last tile.
__device__ void find_tile(int tile, const int32_t* offsets, int E, int* out_e, int* out_r0,
                          int* out_r1) {
  const int lane = threadIdx.x & 31;
  int base = 0, found = -1, first = 0;
  for (int e0 = 0; e0 < E && found < 0; e0 += 32) {
    const int e = e0 + lane;
    const int c = e < E ? (offsets[e + 1] - offsets[e] + kGM - 1) / kGM : 0;
    int inc = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(kFull, inc, o);
      if (lane >= o) inc += n;
    }
    const bool mine = c > 0 && tile >= base + inc - c && tile < base + inc;
    const unsigned b = __ballot_sync(kFull, mine);
    if (b) {
      const int src = __ffs(b) - 1;
      found = e0 + src;
      first = base + __shfl_sync(kFull, inc - c, src);
    }
    base += __shfl_sync(kFull, inc, 31);
  }
  if (lane == 0) {
    *out_e = found;
    if (found >= 0) {
      *out_r0 = offsets[found] + (tile - first) * kGM;
      *out_r1 = min(*out_r0 + kGM, offsets[found + 1]);
    }
  }
}

// Loads k-tile [k0, k0 + kGK) of rows [r0, r1) of x and of output rows [n0, n0 + kGN) of W.
__device__ __forceinline__ void load_stage(uint16_t* a, uint16_t* b, const uint16_t* x,
                                           const uint16_t* W, int r0, int r1, int n0, int OUT,
                                           int IN, int k0) {
  constexpr int kChunks = kGK / 8;  // 16-byte chunks per tile row
  for (int c = threadIdx.x; c < kGM * kChunks; c += kGemmThreads) {
    const int row = c / kChunks, k = k0 + (c % kChunks) * 8;
    const bool ok = r0 + row < r1 && k < IN;
    cp_async16(a + row * kLds + (c % kChunks) * 8,
               ok ? x + static_cast<int64_t>(r0 + row) * IN + k : x, ok);
  }
  for (int c = threadIdx.x; c < kGN * kChunks; c += kGemmThreads) {
    const int row = c / kChunks, k = k0 + (c % kChunks) * 8;
    const bool ok = n0 + row < OUT && k < IN;
    cp_async16(b + row * kLds + (c % kChunks) * 8,
               ok ? W + static_cast<int64_t>(n0 + row) * IN + k : W, ok);
  }
}

template <typename Y>
__global__ void __launch_bounds__(kGemmThreads)
    moe_grouped_gemm_kernel(Y* y, int64_t ldy, const uint16_t* x, const uint16_t* const* w,
                            const int32_t* offsets, int E, int IN, int OUT) {
  using namespace nvcuda;
  __shared__ __align__(128) unsigned char smem[kSmemBytes];
  __shared__ int s_e, s_r0, s_r1;
  if (threadIdx.x < 32) find_tile(blockIdx.y, offsets, E, &s_e, &s_r0, &s_r1);
  __syncthreads();
  if (s_e < 0) return;
  const int r0 = s_r0, r1 = s_r1, n0 = blockIdx.x * kGN;
  const uint16_t* W = w[s_e];
  uint16_t* st = reinterpret_cast<uint16_t*>(smem);
  const int warp = threadIdx.x >> 5, wm = warp / 2, wn = warp % 2;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int n_k = (IN + kGK - 1) / kGK;
  load_stage(st, st + kGM * kLds, x, W, r0, r1, n0, OUT, IN, 0);
  cp_async_commit();
  for (int kt = 0; kt < n_k; ++kt) {
    uint16_t* cur = st + (kt & 1) * kStageHalves;
    if (kt + 1 < n_k) {
      uint16_t* nxt = st + ((kt + 1) & 1) * kStageHalves;
      load_stage(nxt, nxt + kGM * kLds, x, W, r0, r1, n0, OUT, IN, (kt + 1) * kGK);
      cp_async_commit();
      cp_async_wait_one();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(cur);
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(cur + kGM * kLds);
#pragma unroll
    for (int kk = 0; kk < kGK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        wmma::load_matrix_sync(fa[i], a + (wm * 32 + i * 16) * kLds + kk, kLds);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wmma::load_matrix_sync(fb[j], b + (wn * 64 + j * 16) * kLds + kk, kLds);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();  // the stage is refilled by the next iteration's loads
  }

  float* c = reinterpret_cast<float*>(smem);  // the operand stages are no longer needed
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(c + (wm * 32 + i * 16) * kLdc + wn * 64 + j * 16, acc[i][j], kLdc,
                              wmma::mem_row_major);
  __syncthreads();
  const int rows = r1 - r0;
  for (int idx = threadIdx.x; idx < kGM * kGN; idx += kGemmThreads) {
    const int row = idx / kGN, col = idx % kGN;
    if (row < rows && n0 + col < OUT)
      y[static_cast<int64_t>(r0 + row) * ldy + n0 + col] = from_f32<Y>(c[row * kLdc + col]);
  }
}

// ---------------------------------------------------------------------------------------- glu

template <typename T>
__global__ void moe_glu_kernel(uint16_t* y, const T* gate, const T* up, int64_t ld_in,
                               const float* gate_bias, const float* up_bias,
                               const int32_t* row_expert, int64_t R, int64_t I, int clamped,
                               float alpha, float limit) {
  const int64_t n = R * I;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / I, i = idx % I, e = row_expert[r];
    float g = to_f32(gate[r * ld_in + i]) + (gate_bias ? gate_bias[e * I + i] : 0.f);
    float u = to_f32(up[r * ld_in + i]) + (up_bias ? up_bias[e * I + i] : 0.f);
    float out;
    if (clamped) {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
      out = (u + 1.f) * (g / (1.f + expf(-alpha * g)));
    } else {
      out = g / (1.f + expf(-g)) * u;
    }
    y[idx] = f32_to_bf16(out);
  }
}

// ------------------------------------------------------------------------------------ combine

__global__ void moe_combine_kernel(float* y, const float* ys, const float* down_bias,
                                   const int32_t* ids, const float* weights, const int32_t* slot,
                                   int64_t T, int K, int64_t H) {
  const int64_t n = T * H;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / H, h = idx % H;
    float acc = y[idx];
    for (int k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      const float b = down_bias ? down_bias[static_cast<int64_t>(ids[p]) * H + h] : 0.f;
      acc += weights[p] * (ys[static_cast<int64_t>(slot[p]) * H + h] + b);
    }
    y[idx] = acc;
  }
}

}  // namespace

namespace launch {

void moe_route(int32_t* ids, float* weights, const float* logits, int64_t T, int64_t E, int64_t K,
               bool softmax_first, bool norm_topk, cudaStream_t s) {
  if (T == 0) return;
  moe_route_kernel<<<grid_for(T * 32, 256), 256, 0, s>>>(ids, weights, logits, static_cast<int>(T),
                                                         static_cast<int>(E), static_cast<int>(K),
                                                         softmax_first ? 1 : 0, norm_topk ? 1 : 0);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void moe_dispatch(int32_t* perm, int32_t* slot, int32_t* offsets, int32_t* row_expert,
                  int32_t* counts_ws, const int32_t* ids, int64_t R, int64_t E, cudaStream_t s) {
  const int r = static_cast<int>(R), e = static_cast<int>(E);
  moe_count_kernel<<<e, kSortThreads, 0, s>>>(counts_ws, ids, r);
  DFLASH_CUDA_LAUNCH_CHECK();
  moe_scan_kernel<<<1, 32, 0, s>>>(offsets, counts_ws, e);
  DFLASH_CUDA_LAUNCH_CHECK();
  if (R == 0) return;
  moe_scatter_kernel<<<e, kSortThreads, 0, s>>>(perm, slot, row_expert, ids, offsets, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void moe_gather(uint16_t* xs, const uint16_t* x, const int32_t* perm, int64_t R, int64_t K,
                int64_t H, cudaStream_t s) {
  if (R == 0) return;
  const bool vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(xs) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (vec) {
    moe_gather_vec_kernel<<<grid_for(R * H / 8, 256), 256, 0, s>>>(
        reinterpret_cast<uint4*>(xs), reinterpret_cast<const uint4*>(x), perm, R,
        static_cast<int>(K), H / 8);
  } else {
    moe_gather_kernel<<<grid_for(R * H, 256), 256, 0, s>>>(xs, x, perm, R, static_cast<int>(K), H);
  }
  DFLASH_CUDA_LAUNCH_CHECK();
}

int64_t moe_grouped_tiles(int64_t R, int64_t E) {
  return (R + kGM - 1) / kGM + E;
}

void moe_grouped_linear(void* y, DType yt, int64_t ldy, const uint16_t* x, const uint16_t* const* w,
                        const int32_t* offsets, int64_t E, int64_t R, int64_t IN, int64_t OUT,
                        cudaStream_t s) {
  if (R == 0) return;
  dim3 grid(static_cast<unsigned>((OUT + kGN - 1) / kGN),
            static_cast<unsigned>(moe_grouped_tiles(R, E)));
  const int e = static_cast<int>(E), in = static_cast<int>(IN), out = static_cast<int>(OUT);
  if (yt == DType::f32)
    moe_grouped_gemm_kernel<float>
        <<<grid, kGemmThreads, 0, s>>>(static_cast<float*>(y), ldy, x, w, offsets, e, in, out);
  else
    moe_grouped_gemm_kernel<uint16_t>
        <<<grid, kGemmThreads, 0, s>>>(static_cast<uint16_t*>(y), ldy, x, w, offsets, e, in, out);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void moe_glu(uint16_t* y, const void* gate, const void* up, DType t, int64_t ld_in,
             const float* gate_bias, const float* up_bias, const int32_t* row_expert, int64_t R,
             int64_t I, bool clamped, float alpha, float limit, cudaStream_t s) {
  if (R == 0) return;
  const unsigned g = grid_for(R * I, 256);
  if (t == DType::f32)
    moe_glu_kernel<float><<<g, 256, 0, s>>>(y, static_cast<const float*>(gate),
                                            static_cast<const float*>(up), ld_in, gate_bias,
                                            up_bias, row_expert, R, I, clamped, alpha, limit);
  else
    moe_glu_kernel<uint16_t><<<g, 256, 0, s>>>(y, static_cast<const uint16_t*>(gate),
                                               static_cast<const uint16_t*>(up), ld_in, gate_bias,
                                               up_bias, row_expert, R, I, clamped, alpha, limit);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void moe_combine(float* y, const float* ys, const float* down_bias, const int32_t* ids,
                 const float* weights, const int32_t* slot, int64_t T, int64_t K, int64_t H,
                 cudaStream_t s) {
  if (T == 0) return;
  moe_combine_kernel<<<grid_for(T * H, 256), 256, 0, s>>>(y, ys, down_bias, ids, weights, slot, T,
                                                          static_cast<int>(K), H);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
