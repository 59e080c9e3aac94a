// dflash.cpp — the DSpark head's row kernels (launchers: dspark_head_launch.hpp; the step that
// runs them between its cuBLASLt GEMMs: src/model/dspark_head_cuda.cpp; the formulas:
// src/model/dspark_head.hpp, ../shared/OBJECTIVES.md §1.3).
//
// Invariants: every reduction runs in a fixed order (per-thread partials over a fixed stride,
// then warp shuffles and the warps' partials in warp order, or one thread per output column
// walking the rows in order), so the same inputs give the same bits; there are no atomics. Rows
// with weight 0 are never read past their weight and get a zero gradient. Softmax statistics,
// CE, L1 and the confidence logit are fp32; the step's sums are double.
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/dspark_head_launch.hpp"
#include "backend/cuda/online_softmax.cuh"

namespace dflash::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kGradTile = 4;  // columns per thread between the gradient pass's barriers

__device__ __forceinline__ float sign_of(float x) {
  return static_cast<float>((x > 0.f) - (x < 0.f));
}

__global__ void gather_rows_kernel(uint16_t* out, const uint16_t* table, const int32_t* idx,
                                   int64_t cols, int64_t ld) {
  const int64_t i = blockIdx.x;
  const int32_t row = idx[i];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    out[i * cols + c] = row < 0 ? uint16_t{0} : table[row * ld + c];
}

__global__ void rows_kernel(launch::DsparkRowIn in, launch::DsparkRowOut out, uint16_t* dd,
                            int64_t ldd) {
  __shared__ Online sh_online[32];
  __shared__ float sh_sum[32];
  const int64_t i = blockIdx.x, V = in.V;
  const float w = in.weights[i];
  const float* d = in.d + i * V;
  const float* t = in.t + i * V;
  const float nan = __int_as_float(0x7fc00000);
  if (w == 0.f) {
    if (threadIdx.x == 0) {
      out.ce[i] = 0.f, out.l1[i] = 0.f, out.bce[i] = 0.f, out.dconf[i] = 0.f;
      out.acc[i] = nan, out.conf[i] = nan, out.argmax[i] = -1;
    }
    if (dd)
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) dd[i * ldd + v] = 0;
    return;
  }
  // Pass 1: softmax statistics of D (with its argmax) and of T.
  Online sd = online_empty(), st = online_empty();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    online_add(sd, d[v], static_cast<int>(v));
    online_add(st, t[v], static_cast<int>(v));
  }
  sd = online_block(sd, sh_online);
  st = online_block(st, sh_online);
  const float lse_d = sd.m + logf(sd.s), lse_t = st.m + logf(st.s);
  // Pass 2: L1 = Σ|P − T| and sp = Σ P·sign(P − T); the confidence logit's dot product.
  float l1 = 0.f, sp = 0.f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(d[v] - lse_d), q = expf(t[v] - lse_t);
    l1 += fabsf(p - q);
    sp += p * sign_of(p - q);
  }
  l1 = block_sum(l1, sh_sum);
  sp = block_sum(sp, sh_sum);
  float z = nan;
  if (in.conf_w) {
    const uint16_t* h = in.hf + i * in.H;
    float c = 0.f;
    for (int64_t k = threadIdx.x; k < in.H; k += blockDim.x) c += to_f32(h[k]) * in.conf_w[k];
    for (int64_t k = threadIdx.x; k < in.conf_r; k += blockDim.x)
      c += to_f32(in.emb[i * in.r + k]) * in.conf_w[in.H + k];
    z = block_sum(c, sh_sum) + in.conf_b[0];
  }
  const int32_t y = in.labels[i];
  const float acc = fminf(fmaxf(1.0f - 0.5f * l1, 0.f), 1.f);
  if (threadIdx.x == 0) {
    out.ce[i] = y >= 0 && y < V ? lse_d - d[y] : nan;
    out.l1[i] = l1;
    out.acc[i] = acc;
    out.argmax[i] = sd.bi == INT_MAX ? 0 : sd.bi;
    out.conf[i] = z;
    float bce = 0.f, dz = 0.f;
    if (in.conf_w) {
      bce = fmaxf(z, 0.f) - z * acc + log1pf(expf(-fabsf(z)));
      dz = in.grad_scale * w * in.a_conf * (1.f / (1.f + expf(-z)) - acc);
    }
    out.bce[i] = bce;
    out.dconf[i] = dz;
  }
  if (!dd) return;
  // Pass 3: the logits gradient, tile by tile of kGradTile·blockDim columns: every thread reads
  // its columns of the tile, a barrier, then the tile's bf16 values are written. When dd overlays
  // TL's row (dspark_rows), column v's value lands on TL's column v/2: inside the tile or an
  // earlier one, all read before the barrier; later tiles' columns are not touched.
  const float gs = in.grad_scale * w;
  const int64_t tile = static_cast<int64_t>(kGradTile) * blockDim.x;
  for (int64_t v0 = 0; v0 < V; v0 += tile) {
    float g[kGradTile] = {};
#pragma unroll
    for (int e = 0; e < kGradTile; ++e) {
      const int64_t v = v0 + e * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (v >= V) break;
      const float p = expf(d[v] - lse_d), q = expf(t[v] - lse_t);
      g[e] = in.a_ce * (p - (v == y ? 1.f : 0.f)) + in.a_l1 * p * (sign_of(p - q) - sp);
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < kGradTile; ++e) {
      const int64_t v = v0 + e * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (v >= V) break;
      dd[i * ldd + v] = f32_to_bf16(gs * g[e]);
    }
  }
}

// One thread per input column c of the confidence head (then one per element of dhf / demb).
__global__ void conf_wgrad_kernel(float* gw, float* gb, const float* dconf, const uint16_t* hf,
                                  const uint16_t* emb, int64_t n, int64_t H, int64_t r,
                                  int64_t conf_r) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c > H + conf_r) return;
  if (c == H + conf_r) {  // the bias
    float b = 0.f;
    for (int64_t i = 0; i < n; ++i) b += dconf[i];
    gb[0] += b;
    return;
  }
  float g = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = c < H ? to_f32(hf[i * H + c]) : to_f32(emb[i * r + (c - H)]);
    g += dconf[i] * x;
  }
  gw[c] += g;
}

__global__ void conf_dx_kernel(float* dhf, float* demb, const float* dconf, const float* wc,
                               int64_t n, int64_t H, int64_t r, int64_t conf_r) {
  const int64_t cols = H + conf_r;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n * cols;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    if (c < H)
      dhf[i * H + c] += dconf[i] * wc[c];
    else
      demb[i * r + (c - H)] += dconf[i] * wc[c];
  }
}

__global__ void w1_scatter_kernel(float* gw1, const float* demb, const int32_t* prev,
                                  const int32_t* order, const int32_t* seg, int64_t r) {
  const int64_t s = blockIdx.x;
  const int32_t b = seg[s], e = seg[s + 1];
  if (b >= e) return;
  const int64_t tok = prev[order[b]];
  for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
    float g = 0.f;
    for (int32_t k = b; k < e; ++k) g += demb[static_cast<int64_t>(order[k]) * r + j];
    gw1[tok * r + j] += g;
  }
}

__device__ __forceinline__ float sigmoid_of(float x) {
  return 1.0f / (1.0f + expf(-x));
}
// z2 [n, 2r] (dspark_head_launch.hpp): z_hi at column j, z_lo at column r + j of row i.
__device__ __forceinline__ void latent_store(uint16_t* z2, int64_t i, int64_t j, int64_t r,
                                             float v) {
  const uint16_t hi = f32_to_bf16(v);
  z2[i * 2 * r + j] = hi;
  z2[i * 2 * r + r + j] = f32_to_bf16(v - to_f32(hi));
}

__global__ void copy_cols_kernel(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src,
                                 int64_t n, int64_t cols) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n * cols;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    dst[i * ld_dst + c] = src ? src[i * ld_src + c] : uint16_t{0};
  }
}

__global__ void gated_fwd_kernel(float* pre, const float* bias, const uint16_t* emb, uint16_t* z2,
                                 int64_t n, int64_t r) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n * r;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float p = pre[e] + bias[e % r];
    pre[e] = p;
    latent_store(z2, e / r, e % r, r, sigmoid_of(p) * to_f32(emb[e]));
  }
}

__global__ void gated_bwd_kernel(const float* dz, const float* pre, const uint16_t* emb,
                                 float* demb, float* dpre, uint16_t* dpre_bf16, int64_t n,
                                 int64_t r) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n * r;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = sigmoid_of(pre[e]);
    demb[e] = dz[e] * g;
    const float d = dz[e] * to_f32(emb[e]) * g * (1.0f - g);
    dpre[e] = d;
    dpre_bf16[e] = f32_to_bf16(d);
  }
}

// One block of threads per block of K slots; shared memory: s [r].
__global__ void rnn_fwd_kernel(float* u, const float* bias, const uint16_t* jw, int64_t ld,
                               float* sprev, uint16_t* in, uint16_t* z2, int64_t K, int64_t r) {
  extern __shared__ float sh_state[];
  float* st = sh_state;
  for (int64_t j = threadIdx.x; j < r; j += blockDim.x) st[j] = 0.f;
  __syncthreads();
  for (int64_t k = 0; k < K; ++k) {
    const int64_t i = blockIdx.x * K + k;
    float* ui = u + i * 3 * r;
    for (int64_t t = threadIdx.x; t < 3 * r; t += blockDim.x) {
      float acc = ui[t] + bias[t];
      for (int64_t j = 0; j < r; ++j) acc += st[j] * to_f32(jw[t * ld + j]);
      ui[t] = acc;
    }
    for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
      sprev[i * r + j] = st[j];
      in[i * ld + j] = f32_to_bf16(st[j]);
    }
    __syncthreads();  // u of row i complete; every read of st done
    for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
      const float g = sigmoid_of(ui[j]);
      st[j] = g * st[j] + (1.0f - g) * tanhf(ui[r + j]);
      latent_store(z2, i, j, r, tanhf(ui[2 * r + j]));
    }
    __syncthreads();
  }
}

// One block of threads per block of K slots, slots last to first; shared memory: ds [r], du [3r].
__global__ void rnn_bwd_kernel(const float* dz, const float* u, const float* sprev,
                               const uint16_t* jw, int64_t ld, float* du, uint16_t* du_bf16,
                               int64_t K, int64_t r) {
  extern __shared__ float sh_state[];
  float* ds = sh_state;
  float* dui = sh_state + r;
  for (int64_t j = threadIdx.x; j < r; j += blockDim.x) ds[j] = 0.f;
  __syncthreads();
  for (int64_t k = K - 1; k >= 0; --k) {
    const int64_t i = blockIdx.x * K + k;
    const float* ui = u + i * 3 * r;
    for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
      const float g = sigmoid_of(ui[j]), c = tanhf(ui[r + j]), o = tanhf(ui[2 * r + j]);
      const float d[3] = {ds[j] * (sprev[i * r + j] - c) * g * (1.0f - g),
                          ds[j] * (1.0f - g) * (1.0f - c * c), dz[i * r + j] * (1.0f - o * o)};
      for (int q = 0; q < 3; ++q) {
        dui[q * r + j] = d[q];
        du[i * 3 * r + q * r + j] = d[q];
        du_bf16[i * 3 * r + q * r + j] = f32_to_bf16(d[q]);
      }
      ds[j] *= g;  // s_k = g⊙s_{k−1} + …: the direct path to s_{k−1}
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < r; j += blockDim.x) {
      float acc = 0.f;
      for (int64_t t = 0; t < 3 * r; ++t) acc += dui[t] * to_f32(jw[t * ld + j]);
      ds[j] += acc;
    }
    __syncthreads();
  }
}

__global__ void col_sum_kernel(float* out, const float* in, int64_t n, int64_t cols) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float g = 0.f;
  for (int64_t i = 0; i < n; ++i) g += in[i * cols + c];
  out[c] += g;
}

__global__ void markov_dx_kernel(float* dhf, float* demb, const float* dx, int64_t ldx,
                                 int64_t h_col, int64_t e_col, int64_t n, int64_t H, int64_t r,
                                 bool add_e) {
  const int64_t cols = H + r;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n * cols;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    if (c < H) {
      dhf[i * H + c] += dx[i * ldx + h_col + c];
    } else {
      const float v = dx[i * ldx + e_col + (c - H)];
      demb[i * r + (c - H)] = add_e ? demb[i * r + (c - H)] + v : v;
    }
  }
}

__global__ void sums_kernel(double* sums, launch::DsparkRowOut rows, const float* weights,
                            int64_t R, double a_ce, double a_l1, double a_conf) {
  __shared__ double sh[32];
  double acc[6] = {0, 0, 0, 0, 0, 0};
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
    const double w = weights[i];
    if (w == 0.0) continue;
    const double ce = rows.ce[i], l1 = rows.l1[i], bce = rows.bce[i];
    acc[0] += w * (a_ce * ce + a_l1 * l1 + a_conf * bce);
    acc[1] += w;
    acc[2] += w * ce;
    acc[3] += w * l1;
    acc[4] += w * bce;
    acc[5] += w * static_cast<double>(rows.acc[i]);
  }
  for (int k = 0; k < 6; ++k) {
    const double v = block_sum(acc[k], sh);
    if (threadIdx.x == 0) sums[k] = v;
  }
}

}  // namespace

namespace launch {

void dspark_gather_rows(uint16_t* out, const uint16_t* table, const int32_t* idx, int64_t n,
                        int64_t cols, int64_t ld, cudaStream_t s) {
  if (n == 0 || cols == 0) return;
  gather_rows_kernel<<<static_cast<unsigned>(n), 128, 0, s>>>(out, table, idx, cols, ld);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_rows(const DsparkRowIn& in, const DsparkRowOut& out, uint16_t* dd, int64_t ldd,
                 cudaStream_t s) {
  if (in.n == 0) return;
  rows_kernel<<<static_cast<unsigned>(in.n), kRowThreads, 0, s>>>(in, out, dd, ldd);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_conf_bwd(float* dhf, float* demb, float* gw, float* gb, const float* dconf,
                     const uint16_t* hf, const uint16_t* emb, const float* wc, int64_t n, int64_t H,
                     int64_t r, int64_t conf_r, cudaStream_t s) {
  if (n == 0) return;
  const int64_t cols = H + conf_r;
  conf_wgrad_kernel<<<grid_for(cols + 1, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      gw, gb, dconf, hf, emb, n, H, r, conf_r);
  DFLASH_CUDA_LAUNCH_CHECK();
  conf_dx_kernel<<<grid_for(n * cols, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      dhf, demb, dconf, wc, n, H, r, conf_r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_w1_scatter(float* gw1, const float* demb, const int32_t* prev, const int32_t* order,
                       const int32_t* seg, int64_t max_segments, int64_t r, cudaStream_t s) {
  if (max_segments == 0 || r == 0) return;
  const int threads = r >= 128 ? 128 : 32;
  w1_scatter_kernel<<<static_cast<unsigned>(max_segments), threads, 0, s>>>(gw1, demb, prev, order,
                                                                            seg, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_copy_cols(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src, int64_t n,
                      int64_t cols, cudaStream_t s) {
  if (n == 0 || cols == 0) return;
  copy_cols_kernel<<<grid_for(n * cols, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      dst, ld_dst, src, ld_src, n, cols);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_gated_fwd(float* pre, const float* bias, const uint16_t* emb, uint16_t* z2, int64_t n,
                      int64_t r, cudaStream_t s) {
  if (n == 0 || r == 0) return;
  gated_fwd_kernel<<<grid_for(n * r, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      pre, bias, emb, z2, n, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_gated_bwd(const float* dz, const float* pre, const uint16_t* emb, float* demb,
                      float* dpre, uint16_t* dpre_bf16, int64_t n, int64_t r, cudaStream_t s) {
  if (n == 0 || r == 0) return;
  gated_bwd_kernel<<<grid_for(n * r, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      dz, pre, emb, demb, dpre, dpre_bf16, n, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

namespace {
// Threads of the rnn kernels: one per u column (3r), in whole warps, at most 1024.
unsigned rnn_threads(int64_t r) {
  const int64_t t = (3 * r + 31) / 32 * 32;
  return static_cast<unsigned>(t < 1024 ? t : 1024);
}
}  // namespace

void dspark_rnn_fwd(float* u, const float* bias, const uint16_t* jw, int64_t ld, float* sprev,
                    uint16_t* in, uint16_t* z2, int64_t n, int64_t K, int64_t r, cudaStream_t s) {
  if (n == 0 || r == 0) return;
  const size_t shmem = static_cast<size_t>(r) * sizeof(float);
  rnn_fwd_kernel<<<static_cast<unsigned>(n / K), rnn_threads(r), shmem, s>>>(u, bias, jw, ld, sprev,
                                                                             in, z2, K, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_rnn_bwd(const float* dz, const float* u, const float* sprev, const uint16_t* jw,
                    int64_t ld, float* du, uint16_t* du_bf16, int64_t n, int64_t K, int64_t r,
                    cudaStream_t s) {
  if (n == 0 || r == 0) return;
  const size_t shmem = static_cast<size_t>(4 * r) * sizeof(float);
  rnn_bwd_kernel<<<static_cast<unsigned>(n / K), rnn_threads(r), shmem, s>>>(dz, u, sprev, jw, ld,
                                                                             du, du_bf16, K, r);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_col_sum(float* out, const float* in, int64_t n, int64_t cols, cudaStream_t s) {
  if (cols == 0) return;
  col_sum_kernel<<<grid_for(cols, kElementwiseThreads), kElementwiseThreads, 0, s>>>(out, in, n,
                                                                                     cols);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_markov_dx(float* dhf, float* demb, const float* dx, int64_t ldx, int64_t h_col,
                      int64_t e_col, int64_t n, int64_t H, int64_t r, bool add_e, cudaStream_t s) {
  if (n == 0) return;
  markov_dx_kernel<<<grid_for(n * (H + r), kElementwiseThreads), kElementwiseThreads, 0, s>>>(
      dhf, demb, dx, ldx, h_col, e_col, n, H, r, add_e);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void dspark_sums(double* sums, const DsparkRowOut& rows, const float* weights, int64_t R,
                 double a_ce, double a_l1, double a_conf, cudaStream_t s) {
  sums_kernel<<<1, 1024, 0, s>>>(sums, rows, weights, R, a_ce, a_l1, a_conf);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
