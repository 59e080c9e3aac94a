// dflash.cpp — the Domino head's kernels (launchers: domino_head_launch.hpp; the step that runs
// them between its cuBLASLt GEMMs: src/model/domino_head_cuda.cpp; the formulas:
// src/model/domino_head.hpp, ../shared/OBJECTIVES.md §1.2).
//
// Invariants: every reduction runs in a fixed order (per-thread partials over a fixed stride,
// then warp shuffles and the warps' partials in warp order), so the same inputs give the same
// bits; there are no atomics. Rows with weight 0 are never read past their weight and get a zero
// gradient. Gates, softmax statistics and CE are fp32; the step's sums are double.
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/domino_head_launch.hpp"
#include "backend/cuda/online_softmax.cuh"

namespace dflash::cuda {
namespace {

constexpr int kRowThreads = 256;

__device__ __forceinline__ float sigmoid(float x) {
  return 1.f / (1.f + expf(-x));
}

__global__ void gather_rows_kernel(uint16_t* out, const uint16_t* table, const int32_t* idx,
                                   int64_t cols) {
  const int64_t i = blockIdx.x;
  const int32_t row = idx[i];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    out[i * cols + c] = row < 0 ? uint16_t{0} : table[row * cols + c];
}

__global__ void gru_fwd_kernel(float* g, uint16_t* gb, float* gates, const float* xi,
                               const float* hh, launch::DominoGruDims d, int64_t j) {
  const int64_t G = d.G;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < d.nb * G;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = e / G, i = e % G, row = b * d.K + j + d.off;
    const float* x = xi + row * 3 * G;
    const float hr = hh ? hh[b * 3 * G + i] : 0.f;
    const float hz = hh ? hh[b * 3 * G + G + i] : 0.f;
    const float hn = hh ? hh[b * 3 * G + 2 * G + i] : 0.f;
    const float gp = j > 0 ? g[(row - 1) * G + i] : 0.f;
    const float r = sigmoid(x[i] + hr);
    const float z = sigmoid(x[G + i] + hz);
    const float n = tanhf(x[2 * G + i] + r * hn);
    const float out = (1.f - z) * n + z * gp;
    g[row * G + i] = out;
    gb[row * G + i] = f32_to_bf16(out);
    float* gt = gates + row * 4 * G;
    gt[i] = r;
    gt[G + i] = z;
    gt[2 * G + i] = n;
    gt[3 * G + i] = hn;
  }
}

__global__ void gru_bwd_kernel(uint16_t* dxi, uint16_t* dhh, float* carry, const float* dprev,
                               const float* dstates, const float* g, const float* gates,
                               launch::DominoGruDims d, int64_t j) {
  const int64_t G = d.G;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < d.nb * G;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = e / G, i = e % G, row = b * d.K + j + d.off;
    const float* gt = gates + row * 4 * G;
    const float r = gt[i], z = gt[G + i], n = gt[2 * G + i], hn = gt[3 * G + i];
    const float gp = j > 0 ? g[(row - 1) * G + i] : 0.f;
    // The CPU's order: carry = dg·z, then carry += W_hhᵀ·dhh, then dg = dstates + carry.
    const float later = dprev ? carry[e] + dprev[e] : 0.f;
    const float dg = dstates[row * G + i] + later;
    const float dn = dg * (1.f - z) * (1.f - n * n);
    const float dz = dg * (gp - n) * z * (1.f - z);
    const float dr = dn * hn * r * (1.f - r);
    uint16_t* x = dxi + row * 3 * G;
    x[i] = f32_to_bf16(dr);
    x[G + i] = f32_to_bf16(dz);
    x[2 * G + i] = f32_to_bf16(dn);
    if (j > 0) {
      uint16_t* h = dhh + row * 3 * G;
      h[i] = f32_to_bf16(dr);
      h[G + i] = f32_to_bf16(dz);
      h[2 * G + i] = f32_to_bf16(dn * r);
    }
    carry[e] = dg * z;
  }
}

__global__ void silu_rows_kernel(uint16_t* z, const float* a, int64_t n, int64_t E, int64_t K,
                                 int64_t s0) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n * E;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t slot = (e / E) % K;
    const float x = a[e];
    z[e] = slot >= s0 ? f32_to_bf16(x * sigmoid(x)) : uint16_t{0};
  }
}

__global__ void silu_bwd_kernel(uint16_t* da, const float* dz, const float* a, int64_t count) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = a[e], sg = sigmoid(x);
    da[e] = f32_to_bf16(dz[e] * sg * (1.f + x * (1.f - sg)));
  }
}

__global__ void rows_kernel(launch::DominoRowIn in, launch::DominoRowOut out, uint16_t* du,
                            uint16_t* df) {
  __shared__ Online sh_online[32];
  const int64_t i = blockIdx.x, V = in.V;
  const float w = in.weights[i];
  const float* u = in.u + i * V;
  const float* f = in.f + i * V;
  const bool corrected = i % in.K >= in.s0;
  if (w == 0.f) {
    if (threadIdx.x == 0) out.ce_f[i] = 0.f, out.ce_u[i] = 0.f, out.argmax[i] = -1;
    if (du) {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) du[i * V + v] = 0, df[i * V + v] = 0;
    }
    return;
  }
  // Pass 1: softmax statistics of U and of F (with its argmax).
  Online su = online_empty(), sf = online_empty();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    online_add(su, u[v], static_cast<int>(v));
    online_add(sf, f[v], static_cast<int>(v));
  }
  su = online_block(su, sh_online);
  sf = online_block(sf, sh_online);
  const float lse_u = su.m + logf(su.s), lse_f = sf.m + logf(sf.s);
  const int32_t y = in.labels[i];
  if (threadIdx.x == 0) {
    out.ce_u[i] = lse_u - u[y];
    out.ce_f[i] = lse_f - f[y];
    out.argmax[i] = sf.bi == INT_MAX ? 0 : sf.bi;
  }
  if (!du) return;
  // Pass 2: the logits gradients.
  const double c = static_cast<double>(in.grad_scale) * w, lambda = in.lambda[0];
  const auto cf = static_cast<float>(c * (1.0 - lambda));
  const auto cu = static_cast<float>(corrected ? c * lambda : c);
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float one = v == y ? 1.f : 0.f;
    const float gu = expf(u[v] - lse_u) - one;
    const float gf = corrected ? cf * (expf(f[v] - lse_f) - one) : 0.f;
    du[i * V + v] = f32_to_bf16(cu * gu + gf);
    df[i * V + v] = f32_to_bf16(gf);
  }
}

__global__ void sums_kernel(double* sums, const float* ce_f, const float* ce_u,
                            const float* weights, int64_t R, const double* lambda_in) {
  __shared__ double sh[32];
  const double lambda = lambda_in[0];
  double acc[4] = {0, 0, 0, 0};
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
    const double w = weights[i];
    if (w == 0.0) continue;
    const double f = ce_f[i], u = ce_u[i];
    acc[0] += w * ((1.0 - lambda) * f + lambda * u);
    acc[1] += w;
    acc[2] += w * f;
    acc[3] += w * u;
  }
  for (int k = 0; k < 4; ++k) {
    const double v = block_sum(acc[k], sh);
    if (threadIdx.x == 0) sums[k] = v;
  }
}

}  // namespace

namespace launch {

void domino_gather_rows(uint16_t* out, const uint16_t* table, const int32_t* idx, int64_t n,
                        int64_t cols, cudaStream_t s) {
  if (n == 0 || cols == 0) return;
  gather_rows_kernel<<<static_cast<unsigned>(n), 128, 0, s>>>(out, table, idx, cols);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_gru_fwd_step(float* g, uint16_t* gb, float* gates, const float* xi, const float* hh,
                         const DominoGruDims& d, int64_t j, cudaStream_t s) {
  if (d.nb == 0) return;
  gru_fwd_kernel<<<grid_for(d.nb * d.G, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      g, gb, gates, xi, hh, d, j);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_gru_bwd_step(uint16_t* dxi, uint16_t* dhh, float* carry, const float* dprev,
                         const float* dstates, const float* g, const float* gates,
                         const DominoGruDims& d, int64_t j, cudaStream_t s) {
  if (d.nb == 0) return;
  gru_bwd_kernel<<<grid_for(d.nb * d.G, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      dxi, dhh, carry, dprev, dstates, g, gates, d, j);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_silu_rows(uint16_t* z, const float* a, int64_t n, int64_t E, int64_t K, int64_t s0,
                      cudaStream_t s) {
  if (n * E == 0) return;
  silu_rows_kernel<<<grid_for(n * E, kElementwiseThreads), kElementwiseThreads, 0, s>>>(z, a, n, E,
                                                                                        K, s0);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_silu_bwd(uint16_t* da, const float* dz, const float* a, int64_t n, int64_t E,
                     cudaStream_t s) {
  if (n * E == 0) return;
  silu_bwd_kernel<<<grid_for(n * E, kElementwiseThreads), kElementwiseThreads, 0, s>>>(da, dz, a,
                                                                                       n * E);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_rows(const DominoRowIn& in, const DominoRowOut& out, uint16_t* du, uint16_t* df,
                 cudaStream_t s) {
  if (in.n == 0) return;
  rows_kernel<<<static_cast<unsigned>(in.n), kRowThreads, 0, s>>>(in, out, du, df);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void domino_sums(double* sums, const float* ce_f, const float* ce_u, const float* weights,
                 int64_t R, const double* lambda, cudaStream_t s) {
  sums_kernel<<<1, 1024, 0, s>>>(sums, ce_f, ce_u, weights, R, lambda);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
