// dflash.cpp — CUDA elementwise and per-row kernels: embedding gather, RMSNorm (full and
// per-head), RoPE, SwiGLU, residual adds, f32 <-> bf16 casts. Semantics are those of the CPU ops
// (src/ops/*.hpp); arithmetic is fp32 whatever the storage type. Every reduction runs in a fixed
// order (no atomics), so results are bit-reproducible.
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/launch.hpp"
#include "ops/rmsnorm.hpp"

namespace dflash::cuda {
namespace {

// Calls fn(T{}) with T = float for f32 or uint16_t for bf16.
template <typename Fn>
void dispatch(DType t, Fn&& fn) {
  if (t == DType::bf16)
    fn(uint16_t{});
  else
    fn(float{});
}

// ---------------------------------------------------------------- embedding

template <typename Y, typename W>
__global__ void embedding_fwd_kernel(Y* y, const W* table, const int32_t* ids, int64_t T,
                                     int64_t V, int64_t H) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const bool ok = id >= 0 && id < V;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
    y[t * H + h] = from_f32<Y>(ok ? to_f32(table[id * H + h]) : __int_as_float(0x7fc00000));
}

// ---------------------------------------------------------------- RMSNorm: one warp per row

constexpr int kRowsPerBlock = 8;

template <typename X>
__device__ float row_rstd(const X* x, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t j = threadIdx.x & 31; j < D; j += 32) {
    const float v = to_f32(x[j]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  return 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
}

template <typename Y, typename X>
__global__ void rmsnorm_fwd_kernel(Y* y, float* rstd, const X* x, const float* w, int64_t R,
                                   int64_t D, float eps) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (r >= R) return;
  const X* xr = x + r * D;
  const float rs = row_rstd(xr, D, eps);
  for (int64_t j = threadIdx.x & 31; j < D; j += 32) y[r * D + j] = from_f32<Y>(w[j] * (to_f32(xr[j]) * rs));
  if (rstd && (threadIdx.x & 31) == 0) rstd[r] = rs;
}

template <typename G, typename X>
__global__ void rmsnorm_bwd_dx_kernel(G* dx, const G* dy, const X* x, const float* w, int64_t R,
                                      int64_t D, float eps, float* rstd_out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (r >= R) return;
  const X* xr = x + r * D;
  const G* dyr = dy + r * D;
  const float rr = row_rstd(xr, D, eps);
  if ((threadIdx.x & 31) == 0) rstd_out[r] = rr;
  if (!dx) return;
  float dot = 0.f;
  for (int64_t j = threadIdx.x & 31; j < D; j += 32) dot += w[j] * to_f32(dyr[j]) * to_f32(xr[j]);
  dot = warp_sum(dot);
  const float c = rr * rr * rr * dot / static_cast<float>(D);
  for (int64_t j = threadIdx.x & 31; j < D; j += 32)
    dx[r * D + j] = from_f32<G>(rr * w[j] * to_f32(dyr[j]) - c * to_f32(xr[j]));
}

// dw partials: chunk c of rows, one thread per column, rows in order.
template <typename G, typename X>
__global__ void rmsnorm_dw_part_kernel(float* part, const G* dy, const X* x, const float* rstd,
                                       int64_t R, int64_t D, int64_t rows_per_chunk) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= D) return;
  const int64_t c = blockIdx.y, r0 = c * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < R ? r0 + rows_per_chunk : R;
  float s = 0.f;
  for (int64_t r = r0; r < r1; ++r) s += to_f32(dy[r * D + j]) * (to_f32(x[r * D + j]) * rstd[r]);
  part[c * D + j] = s;
}

__global__ void rmsnorm_dw_final_kernel(float* dw, const float* part, int64_t chunks, int64_t D) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= D) return;
  float s = 0.f;
  for (int64_t c = 0; c < chunks; ++c) s += part[c * D + j];
  dw[j] += s;
}

int64_t dw_rows_per_chunk(int64_t R) {
  return rmsnorm_cuda_dw_rows_per_chunk(R);
}

// ---------------------------------------------------------------- RoPE (rotate_half pairs)

template <typename T>
__global__ void rope_kernel(T* y, const T* x, const int32_t* pos, const float* inv_freq,
                            float scaling, float sign, int64_t Tn, int64_t NH, int64_t D) {
  const int64_t half = D / 2;
  const int64_t n = Tn * NH * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, th = e / half, t = th / NH;
    const float ang = static_cast<float>(pos[t]) * inv_freq[i];
    float sn, cs;
    sincosf(ang, &sn, &cs);
    const float c = cs * scaling, s = sign * (sn * scaling);
    const T* xr = x + th * D;
    T* yr = y + th * D;
    const float a = to_f32(xr[i]), b = to_f32(xr[i + half]);
    yr[i] = from_f32<T>(a * c - b * s);
    yr[i + half] = from_f32<T>(b * c + a * s);
  }
}

// ---------------------------------------------------------------- SwiGLU

template <typename T>
__global__ void swiglu_fwd_kernel(T* y, const T* gate, const T* up, int64_t Tn, int64_t I,
                                  int64_t ld) {
  const int64_t n = Tn * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / I, i = e % I;
    const float g = to_f32(gate[t * ld + i]), u = to_f32(up[t * ld + i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    y[e] = from_f32<T>(g * sig * u);
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(T* dgate, T* dup, const T* dy, const T* gate, const T* up,
                                  int64_t Tn, int64_t I, int64_t ld) {
  const int64_t n = Tn * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / I, i = e % I, o = t * ld + i;
    const float g = to_f32(gate[o]), u = to_f32(up[o]), d = to_f32(dy[e]);
    const float sig = 1.0f / (1.0f + expf(-g));
    const float dg = d * u * sig * (1.0f + g * (1.0f - sig));
    const float du = d * g * sig;
    dgate[o] = from_f32<T>(dg);
    dup[o] = from_f32<T>(du);
  }
}

// ---------------------------------------------------------------- residual and casts

template <typename T>
__global__ void residual_fwd_kernel(T* y, const T* a, const T* b, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = from_f32<T>(to_f32(a[e]) + to_f32(b[e]));
}

template <typename Y, typename B>
__global__ void residual_acc_kernel(Y* y, const B* b, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = from_f32<Y>(to_f32(y[e]) + to_f32(b[e]));
}

template <typename D, typename S>
__global__ void cast_kernel(D* dst, const S* src, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[e] = from_f32<D>(to_f32(src[e]));
}

// Uniform fill (ops/fill.hpp): the same integer hash and the same two fp32 roundings as the CPU.
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename Y>
__global__ void fill_uniform_kernel(Y* y, int64_t n, float offset, float bound, uint64_t seed) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ (static_cast<uint64_t>(e) * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    const float t = __fmul_rn(bound, __fsub_rn(__fmul_rn(2.0f, u), 1.0f));
    y[e] = from_f32<Y>(__fadd_rn(offset, t));
  }
}

constexpr int kThreads = 256;

}  // namespace

namespace launch {

void embedding_fwd(void* y, DType yt, const void* table, DType wt, const int32_t* ids, int64_t T,
                   int64_t V, int64_t H, cudaStream_t s) {
  if (T == 0) return;
  dispatch(yt, [&](auto yv) {
    dispatch(wt, [&](auto wv) {
      using Y = decltype(yv);
      using W = decltype(wv);
      embedding_fwd_kernel<Y, W><<<static_cast<unsigned>(T), kThreads, 0, s>>>(
          static_cast<Y*>(y), static_cast<const W*>(table), ids, T, V, H);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void rmsnorm_fwd(void* y, DType yt, float* rstd, const void* x, DType xt, const float* w,
                 int64_t R, int64_t D, float eps, cudaStream_t s) {
  if (R == 0) return;
  const unsigned grid = static_cast<unsigned>((R + kRowsPerBlock - 1) / kRowsPerBlock);
  dispatch(yt, [&](auto yv) {
    dispatch(xt, [&](auto xv) {
      using Y = decltype(yv);
      using X = decltype(xv);
      rmsnorm_fwd_kernel<Y, X><<<grid, 32 * kRowsPerBlock, 0, s>>>(
          static_cast<Y*>(y), rstd, static_cast<const X*>(x), w, R, D, eps);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

int64_t rmsnorm_dw_chunks(int64_t R) {
  return rmsnorm_cuda_dw_chunks(R);
}

void rmsnorm_bwd(void* dx, const void* dy, DType gt, float* dw, const void* x, DType xt,
                 const float* w, int64_t R, int64_t D, float eps, float* rstd_ws, float* part_ws,
                 cudaStream_t s) {
  if (R == 0) return;
  const unsigned grid = static_cast<unsigned>((R + kRowsPerBlock - 1) / kRowsPerBlock);
  dispatch(gt, [&](auto gv) {
    dispatch(xt, [&](auto xv) {
      using G = decltype(gv);
      using X = decltype(xv);
      rmsnorm_bwd_dx_kernel<G, X><<<grid, 32 * kRowsPerBlock, 0, s>>>(
          static_cast<G*>(dx), static_cast<const G*>(dy), static_cast<const X*>(x), w, R, D, eps,
          rstd_ws);
      if (dw) {
        const int64_t rows = dw_rows_per_chunk(R), chunks = rmsnorm_dw_chunks(R);
        dim3 g2(static_cast<unsigned>((D + kThreads - 1) / kThreads),
                static_cast<unsigned>(chunks));
        rmsnorm_dw_part_kernel<G, X><<<g2, kThreads, 0, s>>>(
            part_ws, static_cast<const G*>(dy), static_cast<const X*>(x), rstd_ws, R, D, rows);
        rmsnorm_dw_final_kernel<<<static_cast<unsigned>((D + kThreads - 1) / kThreads), kThreads,
                                  0, s>>>(dw, part_ws, chunks, D);
      }
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void rope(void* y, const void* x, DType t, const int32_t* pos, const float* inv_freq,
          float scaling, float sign, int64_t T, int64_t NH, int64_t D, cudaStream_t s) {
  const int64_t n = T * NH * (D / 2);
  if (n == 0) return;
  dispatch(t, [&](auto tv) {
    using X = decltype(tv);
    rope_kernel<X><<<grid_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<X*>(y), static_cast<const X*>(x), pos, inv_freq, scaling, sign, T, NH, D);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void swiglu_fwd(void* y, const void* gate, const void* up, DType t, int64_t T, int64_t I,
                int64_t ld_in, cudaStream_t s) {
  if (T * I == 0) return;
  dispatch(t, [&](auto tv) {
    using X = decltype(tv);
    swiglu_fwd_kernel<X><<<grid_for(T * I, kThreads), kThreads, 0, s>>>(
        static_cast<X*>(y), static_cast<const X*>(gate), static_cast<const X*>(up), T, I, ld_in);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void swiglu_bwd(void* dgate, void* dup, const void* dy, const void* gate, const void* up, DType t,
                int64_t T, int64_t I, int64_t ld_in, cudaStream_t s) {
  if (T * I == 0) return;
  dispatch(t, [&](auto tv) {
    using X = decltype(tv);
    swiglu_bwd_kernel<X><<<grid_for(T * I, kThreads), kThreads, 0, s>>>(
        static_cast<X*>(dgate), static_cast<X*>(dup), static_cast<const X*>(dy),
        static_cast<const X*>(gate), static_cast<const X*>(up), T, I, ld_in);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void residual_fwd(void* y, const void* a, const void* b, DType t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto tv) {
    using X = decltype(tv);
    residual_fwd_kernel<X><<<grid_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<X*>(y), static_cast<const X*>(a), static_cast<const X*>(b), n);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void residual_accumulate(void* y, DType yt, const void* b, DType bt, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(yt, [&](auto yv) {
    dispatch(bt, [&](auto bv) {
      using Y = decltype(yv);
      using B = decltype(bv);
      residual_acc_kernel<Y, B><<<grid_for(n, kThreads), kThreads, 0, s>>>(
          static_cast<Y*>(y), static_cast<const B*>(b), n);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void cast(void* dst, DType dt, const void* src, DType st, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  dispatch(dt, [&](auto dv) {
    dispatch(st, [&](auto sv) {
      using Dd = decltype(dv);
      using Ss = decltype(sv);
      cast_kernel<Dd, Ss><<<grid_for(n, kThreads), kThreads, 0, s>>>(
          static_cast<Dd*>(dst), static_cast<const Ss*>(src), n);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void fill_uniform(void* y, DType t, int64_t n, float offset, float bound, uint64_t seed,
                  cudaStream_t s) {
  if (n == 0) return;
  dispatch(t, [&](auto v) {
    using Y = decltype(v);
    fill_uniform_kernel<Y>
        <<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<Y*>(y), n, offset, bound, seed);
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
