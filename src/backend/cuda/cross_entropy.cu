// dflash.cpp — CUDA cross-entropy over one chunk of fp32 logits (the row part of the fused LM-head
// CE; the GEMMs are cuBLASLt calls in the entry point). One block per row, two passes over its
// logits: max, first argmax and the sum of exp in one online pass (the sum rescaled when the max
// grows, merged in a fixed order), then lse, the weighted loss and, optionally, the bf16 logits
// gradient grad_scale·w·(softmax − onehot) (float4 loads when V % 4 == 0). Rows with w = 0 give
// loss 0 and a zero gradient; a row with w ≠ 0 and a label outside [0, V) gives a NaN loss (the
// caller's non-finite check stops the step; labels are validated on the host when they are made).
// Everything is deterministic.
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cross_entropy_launch.hpp"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;

// (value, index) max with the smaller index on ties; NaN never wins.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

// Online log-sum-exp state of a set of logits: m = their max, s = Σ exp(x − m) (FlashAttention's
// rescaling, Milakov & Gimelshein 2018), with the first argmax (bv, bi).
// (Trivial type: it also lives in shared memory; lse_empty() is the empty set.)
struct LseState {
  float m, s, bv;
  int bi;
};
__device__ __forceinline__ LseState lse_empty() {
  return {-INFINITY, 0.f, -INFINITY, INT_MAX};
}

// Adds logit x at index v. A −inf logit adds 0 (exp(−inf − m) is NaN when m = −inf too); a NaN
// logit makes s NaN, as it makes the plain sum NaN.
__device__ __forceinline__ void lse_add(LseState& a, float x, int v) {
  argmax_merge(a.bv, a.bi, x, v);
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;
    a.m = x;
  } else {
    a.s += x == -INFINITY ? 0.f : expf(x - a.m);
  }
}

// Merges b into a (the order of merges is fixed by the callers: deterministic).
__device__ __forceinline__ void lse_merge(LseState& a, const LseState& b) {
  argmax_merge(a.bv, a.bi, b.bv, b.bi);
  const float M = fmaxf(a.m, b.m);
  const float sa = a.m == M ? a.s : a.s * expf(a.m - M);
  const float sb = b.m == M ? b.s : b.s * expf(b.m - M);
  a.s = sa + sb;
  a.m = M;
}

// One block per row, two passes over the row's logits: (1) max, first argmax and Σ exp online,
// (2) the gradient. kVec: V % 4 == 0 and 16-byte aligned rows, float4 loads.
template <bool kVec>
__global__ void ce_rows_kernel(float* row_loss, float* lse_out, int32_t* argmax_out,
                               uint16_t* dlogits, const float* logits, const int32_t* labels,
                               const float* weights, float grad_scale, int64_t V) {
  __shared__ LseState sh[32];
  const int64_t r = blockIdx.x;
  const float* z = logits + r * V;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  LseState st = lse_empty();
  if (kVec) {
    const auto* z4 = reinterpret_cast<const float4*>(z);
    for (int64_t c = threadIdx.x; c < V / 4; c += blockDim.x) {
      const float4 q = z4[c];
      const int v = static_cast<int>(4 * c);
      lse_add(st, q.x, v);
      lse_add(st, q.y, v + 1);
      lse_add(st, q.z, v + 2);
      lse_add(st, q.w, v + 3);
    }
  } else {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) lse_add(st, z[v], static_cast<int>(v));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    LseState b;
    b.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    b.bv = __shfl_xor_sync(0xffffffffu, st.bv, o);
    b.bi = __shfl_xor_sync(0xffffffffu, st.bi, o);
    lse_merge(st, b);
  }
  if (lane == 0) sh[warp] = st;
  __syncthreads();
  st = sh[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) lse_merge(st, sh[w]);
  const float m = st.m;
  int bi = st.bi;
  if (bi == INT_MAX) bi = 0;  // all logits NaN or -inf: torch.argmax gives 0 for all -inf
  const float lse = isinf(m) ? m : m + logf(st.s);
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
  auto grad = [&](float x, int64_t v) {
    float g = 0.f;
    if (ws != 0.f) {
      g = ws * expf(x - lse);
      if (v == y) g -= ws;
    }
    return f32_to_bf16(g);
  };
  if (kVec) {
    const auto* z4 = reinterpret_cast<const float4*>(z);
    auto* dz4 = reinterpret_cast<uint2*>(dz);  // 4 bf16 values
    for (int64_t c = threadIdx.x; c < V / 4; c += blockDim.x) {
      const float4 q = z4[c];
      const int64_t v = 4 * c;
      const uint32_t lo = grad(q.x, v) | static_cast<uint32_t>(grad(q.y, v + 1)) << 16;
      const uint32_t hi = grad(q.z, v + 2) | static_cast<uint32_t>(grad(q.w, v + 3)) << 16;
      dz4[c] = make_uint2(lo, hi);
    }
  } else {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) dz[v] = grad(z[v], v);
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
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dlogits) % 8 == 0;
  if (vec)
    ce_rows_kernel<true><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
        row_loss, lse, argmax, dlogits, logits, labels, weights, grad_scale, V);
  else
    ce_rows_kernel<false><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
        row_loss, lse, argmax, dlogits, logits, labels, weights, grad_scale, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void ce_sums(double* sums, const float* row_loss, const float* weights, int64_t R,
             cudaStream_t s) {
  ce_sums_kernel<<<1, 1024, 0, s>>>(sums, row_loss, weights, R);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
