// dflash.cpp — kernels of the decode heads' ops (contracts and formulas in
// src/ops/decode_heads.hpp, launchers declared in backend/cuda/decode_heads_launch.hpp). One row
// per request: the linear layer gives each output a warp (the requests in order inside it), the
// slot decisions a CTA per request; every sum runs in a fixed order, so a row has the same bits in
// any batch.
#include <algorithm>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_heads_launch.hpp"
#include "core/philox.hpp"
#include "ops/decode_heads.hpp"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;      // elementwise kernels and the linear layer (8 warps)
constexpr int kRowThreads = 1024;  // the slot decisions: one CTA per request's row

__device__ __forceinline__ float sigmoidf(float x) {
  return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float seg_value(const HeadSegment& g, int64_t b, int64_t i) {
  const int64_t row = g.index ? static_cast<int64_t>(g.index[b * g.index_ld + g.index_col])
                              : b * g.row_stride + g.row_offset;
  return g.f32 ? g.f32[row * g.ld + i] : to_f32(g.bf16[row * g.ld + i]);
}

// One CTA column-range per request (blockIdx.y = b).
__global__ void head_pack_kernel(float* x, int64_t W, HeadSegment s0, HeadSegment s1,
                                 HeadSegment s2) {
  const int64_t b = blockIdx.y;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < W;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v;
    if (c < s0.n)
      v = seg_value(s0, b, c);
    else if (c < s0.n + s1.n)
      v = seg_value(s1, b, c - s0.n);
    else
      v = seg_value(s2, b, c - s0.n - s1.n);
    x[b * W + c] = v;
  }
}

// One warp per output o; the requests in order inside it. Lane l sums i = l, l + 32, … in order,
// then warp_sum's fixed tree.
__global__ void head_linear_kernel(float* y, int64_t ldy, const float* base, int64_t ldb,
                                   const float* W, const float* bias, const float* x, int64_t B,
                                   int64_t IN, int64_t OUT) {
  const int64_t o = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (o >= OUT) return;
  const float* w = W + o * IN;
  for (int64_t b = 0; b < B; ++b) {
    const float* xb = x + b * IN;
    float acc = 0.0f;
    for (int64_t i = lane; i < IN; i += 32) acc = fmaf(w[i], xb[i], acc);
    acc = warp_sum(acc);
    if (lane == 0) {
      if (bias) acc += bias[o];
      y[b * ldy + o] = base ? base[b * ldb + o] + acc : acc;
    }
  }
}

__global__ void dspark_gated_kernel(float* z, const float* u, const float* e, int64_t lde,
                                    int64_t B, int64_t r) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * r) return;
  const int64_t b = t / r, j = t % r;
  z[t] = sigmoidf(u[t]) * e[b * lde + j];
}

__global__ void dspark_rnn_kernel(float* z, float* state, const float* u, int64_t B, int64_t r) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * r) return;
  const int64_t b = t / r, j = t % r;
  const float* ub = u + b * 3 * r;
  const float g = sigmoidf(ub[j]);
  state[t] = g * state[t] + (1.0f - g) * tanhf(ub[r + j]);
  z[t] = tanhf(ub[2 * r + j]);
}

__global__ void dspark_input_kernel(int32_t* input, const int32_t* block, int64_t B, int64_t K,
                                    int32_t mask) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * K) return;
  const int64_t b = t / K, j = t % K;
  input[t] = j == 0 ? block[b * (K + 1)] : mask;
}

__global__ void domino_gru_kernel(float* state, const float* xi, const float* hh, int64_t B,
                                  int64_t G) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * G) return;
  const int64_t b = t / G, j = t % G;
  const float* x = xi + b * 3 * G;
  const float* h = hh + b * 3 * G;
  const float r = sigmoidf(x[j] + h[j]);
  const float z = sigmoidf(x[G + j] + h[G + j]);
  const float n = tanhf(x[2 * G + j] + r * h[2 * G + j]);
  state[t] = (1.0f - z) * n + z * state[t];
}

__global__ void head_silu_kernel(float* a, int64_t n) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) a[t] = a[t] * sigmoidf(a[t]);
}

// One CTA per request: block_argmax (common.cuh), the smallest index of the row's maximum.
__global__ void __launch_bounds__(kRowThreads)
    slot_argmax_kernel(int32_t* block, int64_t ld_block, int64_t col, const float* rows, int64_t ld,
                       int64_t V) {
  const int64_t b = blockIdx.x;
  const float* row = rows + b * ld;
  const int32_t best = block_argmax<kRowThreads>(row, V);
  if (threadIdx.x == 0) block[b * ld_block + col] = best;
}

// One CTA per request: thread t sums its contiguous slice of the row (f64, in id order); thread 0
// turns the slice sums into each slice's start (in thread order) and the target u·Σ; the owner,
// the last slice with mass starting at or below the target, walks its slice to the token (the
// last token of mass when rounding runs past the end). Then the row is copied to its q row.
__global__ void __launch_bounds__(kRowThreads)
    slot_draw_kernel(int32_t* block, int64_t ld_block, int64_t col, float* q, const float* probs,
                     const uint64_t* seeds, const int32_t* steps, int64_t V) {
  __shared__ double start[kRowThreads];
  __shared__ double s_target;
  __shared__ int s_owner, s_pick;
  const int64_t b = blockIdx.x;
  const float* row = probs + b * V;
  const int64_t chunk = (V + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(V, static_cast<int64_t>(threadIdx.x) * chunk), hi = min(V, lo + chunk);
  double s = 0;
  for (int64_t i = lo; i < hi; ++i)
    if (row[i] > 0.0f) s += row[i];
  start[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double acc = 0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
      const double v = start[t];
      start[t] = acc;
      acc += v;
    }
    const double u = philox_uniform(seeds[b], static_cast<uint32_t>(steps[b]),
                                    static_cast<uint32_t>(col), PhiloxPurpose::draft);
    s_target = u * acc;
    s_owner = acc > 0 ? -1 : -2;  // −2: a row without mass (its status is set)
    s_pick = 0;
  }
  __syncthreads();
  if (s_owner == -1 && s > 0 && start[threadIdx.x] <= s_target)
    atomicMax(&s_owner, static_cast<int>(threadIdx.x));
  __syncthreads();
  if (static_cast<int>(threadIdx.x) == s_owner) {
    double acc = start[threadIdx.x];
    int64_t last = -1, pick = -1;
    for (int64_t i = lo; i < hi && pick < 0; ++i) {
      const double w = row[i];
      if (!(w > 0)) continue;
      acc += w;
      last = i;
      if (s_target < acc) pick = i;
    }
    s_pick = static_cast<int>(pick >= 0 ? pick : last);
  }
  __syncthreads();
  float* qr = q + (b * ld_block + col) * V;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) qr[i] = row[i];
  if (threadIdx.x == 0) block[b * ld_block + col] = s_pick;
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

}  // namespace

namespace launch {

void head_pack(float* x, int64_t B, int64_t W, const HeadSegment& s0, const HeadSegment& s1,
               const HeadSegment& s2, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_for(W), 64)),
                  static_cast<unsigned>(B));
  head_pack_kernel<<<grid, kThreads, 0, s>>>(x, W, s0, s1, s2);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void head_linear(float* y, int64_t ldy, const float* base, int64_t ldb, const float* W,
                 const float* bias, const float* x, int64_t B, int64_t IN, int64_t OUT,
                 cudaStream_t s) {
  head_linear_kernel<<<blocks_for(OUT * 32), kThreads, 0, s>>>(y, ldy, base, ldb, W, bias, x, B, IN,
                                                               OUT);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_decode_gated(float* z, const float* u, const float* e, int64_t lde, int64_t B,
                         int64_t r, cudaStream_t s) {
  dspark_gated_kernel<<<blocks_for(B * r), kThreads, 0, s>>>(z, u, e, lde, B, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_decode_rnn(float* z, float* state, const float* u, int64_t B, int64_t r,
                       cudaStream_t s) {
  dspark_rnn_kernel<<<blocks_for(B * r), kThreads, 0, s>>>(z, state, u, B, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_decode_input(int32_t* input, const int32_t* block, int64_t B, int64_t K, int32_t mask,
                         cudaStream_t s) {
  dspark_input_kernel<<<blocks_for(B * K), kThreads, 0, s>>>(input, block, B, K, mask);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_decode_gru(float* state, const float* xi, const float* hh, int64_t B, int64_t G,
                       cudaStream_t s) {
  domino_gru_kernel<<<blocks_for(B * G), kThreads, 0, s>>>(state, xi, hh, B, G);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void head_silu(float* a, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  head_silu_kernel<<<blocks_for(n), kThreads, 0, s>>>(a, n);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void decode_slot_argmax(int32_t* block, int64_t ld_block, int64_t col, const float* rows,
                        int64_t ld, int64_t B, int64_t V, cudaStream_t s) {
  slot_argmax_kernel<<<static_cast<unsigned>(B), kRowThreads, 0, s>>>(block, ld_block, col, rows,
                                                                      ld, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void decode_slot_draw(int32_t* block, int64_t ld_block, int64_t col, float* q, const float* probs,
                      const uint64_t* seeds, const int32_t* steps, int64_t B, int64_t V,
                      cudaStream_t s) {
  slot_draw_kernel<<<static_cast<unsigned>(B), kRowThreads, 0, s>>>(block, ld_block, col, q, probs,
                                                                    seeds, steps, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
