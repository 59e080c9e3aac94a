// dflash.cpp — CUDA kernels of DFlash2's candidate selector and loss (semantics:
// src/model/dflash2_selector.hpp, the step: src/model/dflash2_head_cuda.hpp). The row kernel runs
// one block per block row: the unary transform in place, the argmax and base CE, the top-K
// (backend/cuda/dflash2_topk.cuh: a radix select and a bitonic sort into the CPU's candidate
// order, shared with the decoder's walk), the scores, the K-way CE and its gradient pieces. The
// parameter gradients are fixed-order sums: dP_h over rows in order, dA and dBs per key over a
// stable radix sort of the items. Deterministic: no float atomics. No fmt in this file (nvcc).
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/common.cuh"
#include "backend/cuda/dflash2_selector_launch.hpp"
#include "backend/cuda/dflash2_topk.cuh"

namespace dflash::cuda {
namespace {

using launch::Dflash2SelIn;
using launch::Dflash2SelRows;
using launch::kDflash2MaxRank;
using launch::kDflash2MaxTopK;

constexpr int kThreads = kDflash2TopKThreads;

__device__ __forceinline__ float unary_of(float z, float m, float cap) {
  const float x = m * z;
  return cap > 0.f ? cap * tanhf(x / cap) : x;
}
// ∂ū/∂U at ū.
__device__ __forceinline__ float unary_deriv(float u, float m, float cap) {
  return cap > 0.f ? m * (1.f - (u / cap) * (u / cap)) : m;
}

// (value, index) maximum over the block, the lowest index on ties; every thread gets it.
__device__ void block_argmax(float& v, int32_t& idx, float* sv, int32_t* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sv[warp] = v, si[warp] = idx;
  __syncthreads();
  v = sv[0];
  idx = si[0];
  for (int w = 1; w < kThreads / 32; ++w) {
    if (sv[w] > v || (sv[w] == v && si[w] < idx)) v = sv[w], idx = si[w];
  }
}

__device__ float block_max(float v, float* sh) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float r = sh[0];
  for (int w = 1; w < kThreads / 32; ++w) r = fmaxf(r, sh[w]);
  return r;
}

struct RowShared {
  uint32_t key[kDflash2MaxTopK];
  int32_t id[kDflash2MaxTopK];
  float val[kDflash2MaxTopK];     // ū of the candidate, then its score, then ds
  float vec[3][kDflash2MaxRank];  // P_h·h, e, ∂e
  uint32_t hist[256];
  float red[kThreads / 32];
  int32_t redi[kThreads / 32];
  uint32_t prefix, mask;
  int32_t remaining, count, gold;
};

__global__ void __launch_bounds__(kThreads)
    selector_rows_kernel(Dflash2SelIn in, Dflash2SelRows out) {
  __shared__ RowShared sh;
  const int64_t i = blockIdx.x, V = in.V, H = in.H, r = in.r;
  const int K = in.K, tid = threadIdx.x;
  float* u = in.logits + i * V;
  uint16_t* dl = in.dl + i * V;
  const float w = in.weights[i];
  const int32_t y = in.labels[i], prev = in.prev[i];
  const bool term = w != 0.f && prev < V;
  float* e_out = out.e + i * r;
  float* dproj_out = out.dproj + i * r;
  float* da_out = out.da + i * r;
  int32_t* cand_out = out.cand + i * K;
  float* ds_out = out.ds + i * K;
  for (int64_t q = tid; q < r; q += kThreads) e_out[q] = 0.f, dproj_out[q] = 0.f, da_out[q] = 0.f;
  for (int j = tid; j < K; j += kThreads) cand_out[j] = static_cast<int32_t>(V), ds_out[j] = 0.f;
  if (w == 0.f) {
    for (int64_t v = tid; v < V; v += kThreads) dl[v] = 0;
    if (tid == 0) {
      out.base[i] = 0.f, out.sel[i] = 0.f, out.in_topk[i] = 0.f;
      if (out.argmax) out.argmax[i] = -1;
    }
    return;
  }
  // ū in place, its argmax and Σ exp(ū − max).
  float best = -INFINITY;
  int32_t best_i = 0x7fffffff;
  for (int64_t v = tid; v < V; v += kThreads) {
    const float x = unary_of(u[v], in.m, in.cap);
    u[v] = x;
    if (x > best) best = x, best_i = static_cast<int32_t>(v);
  }
  block_argmax(best, best_i, sh.red, sh.redi);
  const float mx = best;
  float z = 0.f;
  for (int64_t v = tid; v < V; v += kThreads) z += expf(u[v] - mx);
  z = block_sum(z, sh.red);
  const float base = mx + logf(z) - u[y];
  // The selector term.
  float sel = 0.f, found = 0.f;
  const float scale = in.grad_scale * static_cast<float>(*in.alpha) * w;
  bool grad_sel = false;
  if (term) {
    dflash2_top_k(u, V, K, sh);
    // P_h·h: one warp per rank coordinate, lanes over columns, the warp's fixed butterfly.
    const uint16_t* h = in.hf + i * H;
    const int lane = tid & 31, warp = tid >> 5;
    for (int64_t q = warp; q < r; q += kThreads / 32) {
      float acc = 0.f;
      for (int64_t c = lane; c < H; c += 32) acc += in.Ph[q * H + c] * to_f32(h[c]);
      acc = warp_sum(acc);
      if (lane == 0) sh.vec[0][q] = acc, sh.vec[1][q] = in.A[prev * r + q] * acc;
    }
    if (tid == 0) sh.gold = -1;
    __syncthreads();
    for (int j = tid; j < K; j += kThreads) {  // scores, in sh.val
      const int32_t c = sh.id[j];
      float dot = 0.f;
      for (int64_t q = 0; q < r; ++q) dot += sh.vec[1][q] * in.Bs[c * r + q];
      sh.val[j] = u[c] + dot;
      if (c == y) sh.gold = j;
    }
    __syncthreads();
    float smx = -INFINITY;
    for (int j = tid; j < K; j += kThreads) smx = fmaxf(smx, sh.val[j]);
    smx = block_max(smx, sh.red);
    float sz = 0.f;
    for (int j = tid; j < K; j += kThreads) sz += expf(sh.val[j] - smx);
    sz = block_sum(sz, sh.red);
    const int g = sh.gold;
    if (g >= 0) {
      sel = smx + logf(sz) - sh.val[g];
      found = 1.f;
      grad_sel = scale != 0.f;
    }
    __syncthreads();
    if (grad_sel) {
      for (int j = tid; j < K; j += kThreads) {  // ds, in sh.val; the candidates out
        const float ds = scale * (expf(sh.val[j] - smx) / sz - (j == g ? 1.f : 0.f));
        sh.val[j] = ds;
        ds_out[j] = ds;
        cand_out[j] = sh.id[j];
      }
      __syncthreads();
      for (int64_t q = tid; q < r; q += kThreads) {  // ∂e, then dA's row and ∂(P_h·h)
        float de = 0.f;
        for (int j = 0; j < K; ++j) de += sh.val[j] * in.Bs[sh.id[j] * r + q];
        e_out[q] = sh.vec[1][q];
        da_out[q] = de * sh.vec[0][q];
        dproj_out[q] = de * in.A[prev * r + q];
      }
    }
  }
  // dl = ∂/∂U: grad_scale·w·(softmax(ū) − onehot(y)), + ds on the candidates (unless stop),
  // through ∂ū/∂U. The candidates' ū are read before the row is overwritten.
  const float cw = in.with_base ? in.grad_scale * w : 0.f;
  const bool add_ds = grad_sel && !in.stop;
  float cand_u[kDflash2MaxTopK / kThreads];
  if (add_ds) {
    for (int j = tid, k = 0; j < K; j += kThreads, ++k) cand_u[k] = u[sh.id[j]];
  }
  __syncthreads();
  for (int64_t v = tid; v < V; v += kThreads) {
    const float x = u[v];
    const float du = cw * (expf(x - mx) / z) - (v == y ? cw : 0.f);
    u[v] = du * unary_deriv(x, in.m, in.cap);
  }
  __syncthreads();
  if (add_ds) {
    for (int j = tid, k = 0; j < K; j += kThreads, ++k) {
      u[sh.id[j]] += sh.val[j] * unary_deriv(cand_u[k], in.m, in.cap);
    }
  }
  __syncthreads();
  for (int64_t v = tid; v < V; v += kThreads) dl[v] = f32_to_bf16(u[v]);
  if (tid == 0) {
    out.base[i] = base;
    out.sel[i] = sel;
    out.in_topk[i] = found;
    if (out.argmax) out.argmax[i] = best_i;
  }
}

__global__ void dh_add_kernel(float* dhf, const float* dproj, const float* Ph, int64_t n, int64_t H,
                              int64_t r) {
  const int64_t total = n * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / H, c = e % H;
    float acc = 0.f;
    for (int64_t q = 0; q < r; ++q) acc += dproj[i * r + q] * Ph[q * H + c];
    dhf[e] += acc;
  }
}

__global__ void dph_kernel(float* dPh, const float* dproj, const uint16_t* hf, int64_t R, int64_t H,
                           int64_t r) {
  const int64_t total = r * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t q = e / H, c = e % H;
    float acc = 0.f;
    for (int64_t i = 0; i < R; ++i) acc += dproj[i * r + q] * to_f32(hf[i * H + c]);
    dPh[e] += acc;
  }
}

__global__ void iota_kernel(int32_t* idx, int64_t n) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    idx[k] = static_cast<int32_t>(k);
  }
}

// One thread per (sorted position, column): a segment's first position sums the segment.
__global__ void segment_sum_kernel(float* grad, const int32_t* keys, const int32_t* idx,
                                   const float* coef, const float* vec, int64_t items, int64_t per,
                                   int64_t r, int64_t V) {
  const int64_t total = items * r;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = e / r, q = e % r;
    const int32_t key = keys[p];
    if (key >= V || (p > 0 && keys[p - 1] == key)) continue;
    float acc = 0.f;
    for (int64_t k = p; k < items && keys[k] == key; ++k) {
      const int64_t item = idx[k];
      acc += (coef ? coef[item] : 1.f) * vec[(item / per) * r + q];
    }
    grad[static_cast<int64_t>(key) * r + q] += acc;
  }
}

int key_bits(int64_t V) {
  int bits = 1;
  while ((int64_t{1} << bits) <= V) ++bits;
  return bits;
}

__global__ void sums_kernel(double* sums, Dflash2SelRows rows, const float* weights, int64_t R,
                            const double* alpha_in) {
  __shared__ double sh[kThreads / 32];
  const double alpha = *alpha_in;
  double loss = 0, ws = 0, base = 0, sel = 0, hit = 0;
  for (int64_t i = threadIdx.x; i < R; i += kThreads) {
    const double w = weights[i];
    if (w == 0) continue;
    loss += w * (rows.base[i] + alpha * rows.sel[i]);
    ws += w;
    base += w * rows.base[i];
    sel += w * rows.sel[i];
    hit += w * rows.in_topk[i];
  }
  const double v[5] = {base, ws, sel, hit, loss};
  for (int k = 0; k < 5; ++k) {
    const double t = block_sum(v[k], sh);
    if (threadIdx.x == 0) sums[k] = t;
    __syncthreads();
  }
}

}  // namespace

namespace launch {

void dflash2_selector_rows(const Dflash2SelIn& in, const Dflash2SelRows& out, cudaStream_t s) {
  if (in.n == 0) return;
  selector_rows_kernel<<<static_cast<unsigned>(in.n), kThreads, 0, s>>>(in, out);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_dh_add(float* dhf, const float* dproj, const float* Ph, int64_t n, int64_t H,
                    int64_t r, cudaStream_t s) {
  if (n * H == 0) return;
  dh_add_kernel<<<grid_for(n * H, kElementwiseThreads), kElementwiseThreads, 0, s>>>(dhf, dproj, Ph,
                                                                                     n, H, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_dph(float* dPh, const float* dproj, const uint16_t* hf, int64_t R, int64_t H,
                 int64_t r, cudaStream_t s) {
  if (r * H == 0) return;
  dph_kernel<<<grid_for(r * H, kElementwiseThreads), kElementwiseThreads, 0, s>>>(dPh, dproj, hf, R,
                                                                                  H, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

size_t dflash2_sort_scratch_bytes(int64_t items, int64_t V) {
  size_t bytes = 0;
  DFLASH_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(items),
      0, key_bits(V)));
  return bytes;
}

void dflash2_keyed_scatter(float* grad, const int32_t* keys, const float* coef, const float* vec,
                           int64_t items, int64_t per, int64_t r, int64_t V, int32_t* idx_in,
                           int32_t* keys_sorted, int32_t* idx_sorted, void* sort_ws,
                           size_t sort_bytes, cudaStream_t s) {
  if (items == 0 || r == 0) return;
  iota_kernel<<<grid_for(items, kElementwiseThreads), kElementwiseThreads, 0, s>>>(idx_in, items);
  DFLASH_CUDA_LAUNCH_CHECK();
  size_t bytes = sort_bytes;
  DFLASH_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_ws, bytes, keys, keys_sorted, idx_in,
                                                    idx_sorted, static_cast<int>(items), 0,
                                                    key_bits(V), s));
  segment_sum_kernel<<<grid_for(items * r, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      grad, keys_sorted, idx_sorted, coef, vec, items, per, r, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dflash2_sums(double* sums, const Dflash2SelRows& rows, const float* weights, int64_t R,
                  const double* alpha, cudaStream_t s) {
  sums_kernel<<<1, kThreads, 0, s>>>(sums, rows, weights, R, alpha);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
