// dflash.cpp — CUDA cross-entropy over one chunk of fp32 logits (the row part of the fused LM-head
// CE; the GEMMs are cuBLASLt calls in the entry point). One block per row: max and first argmax,
// sum of exp in a fixed order, lse, the weighted loss and, optionally, the bf16 logits gradient
// grad_scale·w·(softmax − onehot). Rows with w = 0 give loss 0 and a zero gradient; a row with
// w ≠ 0 and a label outside [0, V) gives a NaN loss (the caller's non-finite check stops the step;
// labels are validated on the host when they are made). Everything is deterministic.
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/launch.hpp"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;

// (value, index) max with the smaller index on ties; NaN never wins.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

__global__ void ce_rows_kernel(float* row_loss, float* lse_out, int32_t* argmax_out,
                               uint16_t* dlogits, const float* logits, const int32_t* labels,
                               const float* weights, float grad_scale, int64_t V) {
  __shared__ float shv[32];
  __shared__ int shi[32];
  __shared__ float shs[32];
  const int64_t r = blockIdx.x;
  const float* z = logits + r * V;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) argmax_merge(bv, bi, z[v], static_cast<int>(v));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
    argmax_merge(bv, bi, v2, i2);
  }
  if (lane == 0) shv[warp] = bv, shi[warp] = bi;
  __syncthreads();
  bv = -INFINITY;
  bi = INT_MAX;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) argmax_merge(bv, bi, shv[w], shi[w]);
  const float m = bv;
  if (bi == INT_MAX) bi = 0;  // all logits NaN or -inf: torch.argmax gives 0 for all -inf
  float lse;
  if (isinf(m)) {
    lse = m;
  } else {
    float s = 0.f;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += expf(z[v] - m);
    s = block_sum(s, shs);
    lse = m + logf(s);
  }
  const float w = weights ? weights[r] : 1.0f;
  const int32_t y = labels[r];
  const bool label_ok = y >= 0 && y < V;
  if (threadIdx.x == 0) {
    if (lse_out) lse_out[r] = lse;
    if (argmax_out) argmax_out[r] = bi;
    row_loss[r] = w == 0.f ? 0.f : (label_ok ? w * (lse - z[y]) : __int_as_float(0x7fc00000));
  }
  if (!dlogits) return;
  const float ws = grad_scale * w;
  uint16_t* dz = dlogits + r * V;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    float g = 0.f;
    if (ws != 0.f) {
      g = ws * expf(z[v] - lse);
      if (v == y) g -= ws;
    }
    dz[v] = f32_to_bf16(g);
  }
}

__global__ void ce_sums_kernel(double* sums, const float* row_loss, const float* weights,
                               int64_t R) {
  __shared__ double sh[32];
  double a = 0.0, b = 0.0;
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {
    a += row_loss[r];
    b += weights ? weights[r] : 1.0f;
  }
  a = block_sum(a, sh);
  b = block_sum(b, sh);
  if (threadIdx.x == 0) sums[0] = a, sums[1] = b;
}

}  // namespace

namespace launch {

void ce_rows(float* row_loss, float* lse, int32_t* argmax, uint16_t* dlogits, const float* logits,
             const int32_t* labels, const float* weights, float grad_scale, int64_t n, int64_t V,
             cudaStream_t s) {
  if (n == 0) return;
  ce_rows_kernel<<<static_cast<unsigned>(n), kThreads, 0, s>>>(row_loss, lse, argmax, dlogits,
                                                               logits, labels, weights,
                                                               grad_scale, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void ce_sums(double* sums, const float* row_loss, const float* weights, int64_t R,
             cudaStream_t s) {
  ce_sums_kernel<<<1, 1024, 0, s>>>(sums, row_loss, weights, R);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
