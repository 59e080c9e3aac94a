// dflash.cpp — CUDA cross-entropy over one chunk of fp32 logits (the row part of the fused LM-head
// CE; the GEMMs are cuBLASLt calls in the entry point). One block per row, two passes over its
// logits: max, first argmax and the sum of exp in one online pass (the sum rescaled when the max
// grows, merged in a fixed order), then lse, the weighted loss and, optionally, the bf16 logits
// gradient grad_scale·w·(softmax − onehot) (float4 loads when V % 4 == 0). Rows with w = 0 give
// loss 0 and a zero gradient; a row with w ≠ 0 and a label outside [0, V) gives a NaN loss (the
// caller's non-finite check stops the step; labels are validated on the host when they are made).
// With blocks whose first row is skipped (FusedCeParams::skip_first_of), a gather of each chunk's
// head rows before the GEMMs and a scatter of their outputs after. Everything is deterministic.
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

// Head row j of a chunk of blocks of K rows whose first row is skipped: its source row.
__device__ __forceinline__ int64_t head_row_source(int64_t j, int64_t K) {
  return j / (K - 1) * K + 1 + j % (K - 1);
}

// One block per head row j: hidden_c[j] = hidden[src(j)] (16-byte vectors when kVec: H % 8 == 0
// and both row bases 16-byte aligned), and its label and weight.
template <bool kVec>
__global__ void ce_gather_kernel(uint16_t* hidden_c, int32_t* labels_c, float* weights_c,
                                 const uint16_t* hidden, const int32_t* labels,
                                 const float* weights, int64_t K, int64_t H) {
  const int64_t j = blockIdx.x, src = head_row_source(j, K);
  const uint16_t* from = hidden + src * H;
  uint16_t* to = hidden_c + j * H;
  if (kVec) {
    const auto* f4 = reinterpret_cast<const uint4*>(from);
    auto* t4 = reinterpret_cast<uint4*>(to);
    for (int64_t c = threadIdx.x; c < H / 8; c += blockDim.x) t4[c] = f4[c];
  } else {
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) to[c] = from[c];
  }
  if (threadIdx.x == 0) {
    labels_c[j] = labels[src];
    if (weights_c) weights_c[j] = weights[src];
  }
}

// One block per row o of the chunk's blocks: a head row takes its outputs from head row j; a
// skipped row (o % K == 0) gets d_hidden 0, row_loss 0 (NaN when its weight is not 0), lse NaN,
// argmax −1. kVec: H % 4 == 0 and 16-byte aligned rows.
template <bool kVec>
__global__ void ce_scatter_kernel(float* d_hidden, float* row_loss, float* lse, int32_t* argmax,
                                  const float* d_hidden_c, const float* row_loss_c,
                                  const float* lse_c, const int32_t* argmax_c,
                                  const float* weights, int64_t K, int64_t H) {
  const int64_t o = blockIdx.x, slot = o % K;
  const bool skipped = slot == 0;
  const int64_t j = o / K * (K - 1) + slot - 1;
  if (d_hidden) {
    float* to = d_hidden + o * H;
    const float* from = skipped ? nullptr : d_hidden_c + j * H;
    if (kVec) {
      auto* t4 = reinterpret_cast<float4*>(to);
      const auto* f4 = reinterpret_cast<const float4*>(from);
      for (int64_t c = threadIdx.x; c < H / 4; c += blockDim.x)
        t4[c] = skipped ? make_float4(0.f, 0.f, 0.f, 0.f) : f4[c];
    } else {
      for (int64_t c = threadIdx.x; c < H; c += blockDim.x) to[c] = skipped ? 0.f : from[c];
    }
  }
  if (threadIdx.x != 0) return;
  const float nan = __int_as_float(0x7fc00000);
  if (skipped) {
    const bool inert = !weights || weights[o] == 0.f;  // null weights are all 1: not inert
    row_loss[o] = weights && inert ? 0.f : nan;
    if (lse) lse[o] = nan;
    if (argmax) argmax[o] = -1;
  } else {
    row_loss[o] = row_loss_c[j];
    if (lse) lse[o] = lse_c[j];
    if (argmax) argmax[o] = argmax_c[j];
  }
}

}  // namespace

namespace launch {

void ce_gather(uint16_t* hidden_c, int32_t* labels_c, float* weights_c, const uint16_t* hidden,
               const int32_t* labels, const float* weights, int64_t blocks, int64_t K, int64_t H,
               cudaStream_t s) {
  const int64_t n = blocks * (K - 1);
  if (n == 0) return;
  const bool vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(hidden) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(hidden_c) % 16 == 0;
  if (vec)
    ce_gather_kernel<true><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
        hidden_c, labels_c, weights_c, hidden, labels, weights, K, H);
  else
    ce_gather_kernel<false><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
        hidden_c, labels_c, weights_c, hidden, labels, weights, K, H);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void ce_scatter(float* d_hidden, float* row_loss, float* lse, int32_t* argmax,
                const float* d_hidden_c, const float* row_loss_c, const float* lse_c,
                const int32_t* argmax_c, const float* weights, int64_t blocks, int64_t K,
                int64_t H, cudaStream_t s) {
  const int64_t n = blocks * K;
  if (n == 0) return;
  const bool vec = H % 4 == 0 && reinterpret_cast<uintptr_t>(d_hidden) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(d_hidden_c) % 16 == 0;
  if (vec)
    ce_scatter_kernel<true><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
        d_hidden, row_loss, lse, argmax, d_hidden_c, row_loss_c, lse_c, argmax_c, weights, K, H);
  else
    ce_scatter_kernel<false><<<static_cast<unsigned>(n), kThreads, 0, s>>>(
        d_hidden, row_loss, lse, argmax, d_hidden_c, row_loss_c, lse_c, argmax_c, weights, K, H);
  DFLASH_CUDA_LAUNCH_CHECK();
}

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
