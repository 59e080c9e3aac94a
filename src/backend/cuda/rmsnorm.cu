// dflash.cpp — CUDA kernels of RMSNorm, full-width and per-head (semantics: src/ops/rmsnorm.hpp).
// Forward: rows of D a multiple of kWideCols (the hidden sizes: 4096 at Qwen3-8B) with 16-byte
// aligned rows take one CTA per row (rmsnorm_fwd_wide_kernel: each thread loads its kWideVecs
// vectors of 4 columns at once, 16-byte loads for fp32 and 8-byte for bf16, the row's sum of
// squares over the CTA, the row read from memory once); other rows take one warp per row, each
// lane loading four of its columns before using them (lane_cols, the same order of operations as
// one column at a time). Which kernel runs depends on D and the pointers' alignment only, so a
// row's bits never depend on R. Arithmetic in fp32 whatever the storage type. The weight gradient
// is summed over fixed row chunks, then the chunks in order (no atomics): bit-reproducible. No fmt
// (nvcc).
#include <cmath>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/rmsnorm_launch.hpp"
#include "ops/rmsnorm.hpp"

namespace dflash::cuda {
namespace {

constexpr int kRowsPerBlock = 8;

/// The one-CTA-per-row forward: each thread owns kWideVecs vectors of 4 columns, vector v at
/// columns 4·(tid + threads·v) .. +3, threads = D / kWideCols · 32 (a multiple of 32, ≤ 1024).
constexpr int kWideVecs = 4;
constexpr int64_t kWideCols = 4 * kWideVecs * 32;  // columns per warp: D must be a multiple
constexpr int64_t kWideMaxD = kWideCols * 32;      // 1,024 threads

/// 4 consecutive elements at p (16-byte aligned for fp32, 8-byte for bf16) widened to fp32.
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  v[0] = to_f32(static_cast<uint16_t>(u.x & 0xffffu));
  v[1] = to_f32(static_cast<uint16_t>(u.x >> 16));
  v[2] = to_f32(static_cast<uint16_t>(u.y & 0xffffu));
  v[3] = to_f32(static_cast<uint16_t>(u.y >> 16));
}
/// Stores 4 fp32 values at p as the storage type (bf16: rounded to nearest even).
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(uint16_t* p, const float (&v)[4]) {
  uint2 u;
  u.x = static_cast<uint32_t>(from_f32<uint16_t>(v[0])) |
        (static_cast<uint32_t>(from_f32<uint16_t>(v[1])) << 16);
  u.y = static_cast<uint32_t>(from_f32<uint16_t>(v[2])) |
        (static_cast<uint32_t>(from_f32<uint16_t>(v[3])) << 16);
  *reinterpret_cast<uint2*>(p) = u;
}

/// The forward of row blockIdx.x (D a multiple of kWideCols, at most kWideMaxD; rows 16-byte
/// aligned): every load is issued before the first use, the sum of squares is each thread's
/// (vectors in order, columns in order) then block_sum's fixed order, and y is written only after
/// the block's barrier in block_sum, so y may alias x.
template <typename Y, typename X>
__global__ void rmsnorm_fwd_wide_kernel(Y* y, float* rstd, const X* x, const float* w, int64_t D,
                                        float eps) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const X* xr = x + r * D;
  float v[kWideVecs][4];
#pragma unroll
  for (int i = 0; i < kWideVecs; ++i) load4(xr + 4 * (threadIdx.x + blockDim.x * i), v[i]);
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kWideVecs; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) ss += v[i][k] * v[i][k];
  ss = block_sum(ss, sh);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  Y* yr = y + r * D;
#pragma unroll
  for (int i = 0; i < kWideVecs; ++i) {
    const int64_t c = 4 * (threadIdx.x + blockDim.x * i);
    float wv[4], out[4];
    load4(w + c, wv);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = wv[k] * (v[i][k] * rs);
    store4(yr + c, out);
  }
  if (rstd && threadIdx.x == 0) rstd[r] = rs;
}

/// True when rows of D elements of y, x and w at these addresses suit rmsnorm_fwd_wide_kernel.
bool rmsnorm_fwd_wide(const void* y, const void* x, const float* w, int64_t D) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return D % kWideCols == 0 && D <= kWideMaxD && aligned(y) && aligned(x) && aligned(w);
}

template <typename Y, typename X>
__global__ void rmsnorm_fwd_kernel(Y* y, float* rstd, const X* x, const float* w, int64_t R,
                                   int64_t D, float eps) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (r >= R) return;
  const X* xr = x + r * D;
  const float rs = row_rstd(xr, D, eps);
  Y* yr = y + r * D;
  // y may alias x: each lane reads its columns before it writes them.
  lane_cols(
      D,
      [&](int64_t a, int64_t b, int64_t c, int64_t d) {
        const float xa = to_f32(xr[a]), xb = to_f32(xr[b]), xc = to_f32(xr[c]), xd = to_f32(xr[d]);
        yr[a] = from_f32<Y>(w[a] * (xa * rs));
        yr[b] = from_f32<Y>(w[b] * (xb * rs));
        yr[c] = from_f32<Y>(w[c] * (xc * rs));
        yr[d] = from_f32<Y>(w[d] * (xd * rs));
      },
      [&](int64_t j) { yr[j] = from_f32<Y>(w[j] * (to_f32(xr[j]) * rs)); });
  if (rstd && (threadIdx.x & 31) == 0) rstd[r] = rs;
}

// One element of dx (ops/rmsnorm.hpp): r·w_j·dy_j − c·x_j with c = r³/D · Σ_j w_j dy_j x_j. Shared
// by the plain and the fused backward so that both round the same way.
__device__ __forceinline__ float rms_dx(float rr, float wj, float dyj, float c, float xj) {
  return rr * wj * dyj - c * xj;
}

// c = r³/D · Σ_j w_j dy_j x_j over the row (lane sums in column order, then warp_sum).
template <typename G, typename X>
__device__ __forceinline__ float rms_dx_coef(const G* dyr, const X* xr, const float* w, int64_t D,
                                             float rr) {
  float dot = 0.f;
  lane_cols(
      D,
      [&](int64_t a, int64_t b, int64_t c, int64_t d) {
        const float ya = to_f32(dyr[a]), yb = to_f32(dyr[b]), yc = to_f32(dyr[c]),
                    yd = to_f32(dyr[d]);
        const float xa = to_f32(xr[a]), xb = to_f32(xr[b]), xc = to_f32(xr[c]), xd = to_f32(xr[d]);
        dot += w[a] * ya * xa;
        dot += w[b] * yb * xb;
        dot += w[c] * yc * xc;
        dot += w[d] * yd * xd;
      },
      [&](int64_t j) { dot += w[j] * to_f32(dyr[j]) * to_f32(xr[j]); });
  dot = warp_sum(dot);
  return rr * rr * rr * dot / static_cast<float>(D);
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
  const float c = rms_dx_coef(dyr, xr, w, D, rr);
  G* dxr = dx + r * D;
  lane_cols(
      D,
      [&](int64_t a, int64_t b, int64_t cc, int64_t d) {
        const float ya = to_f32(dyr[a]), yb = to_f32(dyr[b]), yc = to_f32(dyr[cc]),
                    yd = to_f32(dyr[d]);
        const float xa = to_f32(xr[a]), xb = to_f32(xr[b]), xc = to_f32(xr[cc]), xd = to_f32(xr[d]);
        dxr[a] = from_f32<G>(rms_dx(rr, w[a], ya, c, xa));
        dxr[b] = from_f32<G>(rms_dx(rr, w[b], yb, c, xb));
        dxr[cc] = from_f32<G>(rms_dx(rr, w[cc], yc, c, xc));
        dxr[d] = from_f32<G>(rms_dx(rr, w[d], yd, c, xd));
      },
      [&](int64_t j) { dxr[j] = from_f32<G>(rms_dx(rr, w[j], to_f32(dyr[j]), c, to_f32(xr[j]))); });
}

// The backward fused with the residual stream: dres = dx (or += dx), dres_bf = bf16(dres); dx
// itself stays in registers. dres null: only rstd_out (for the weight gradient).
template <bool kAccumulate>
__global__ void rmsnorm_bwd_res_kernel(float* dres, uint16_t* dres_bf, const float* dy,
                                       const float* x, const float* w, int64_t R, int64_t D,
                                       float eps, float* rstd_out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (r >= R) return;
  const float* xr = x + r * D;
  const float* dyr = dy + r * D;
  const float rr = row_rstd(xr, D, eps);
  if ((threadIdx.x & 31) == 0) rstd_out[r] = rr;
  if (!dres) return;
  const float c = rms_dx_coef(dyr, xr, w, D, rr);
  float* dr = dres + r * D;
  uint16_t* br = dres_bf ? dres_bf + r * D : nullptr;
  auto one = [&](int64_t j, float dyj, float xj, float old) {
    const float dx = rms_dx(rr, w[j], dyj, c, xj);
    const float v = kAccumulate ? old + dx : dx;
    dr[j] = v;
    if (br) br[j] = f32_to_bf16(v);
  };
  lane_cols(
      D,
      [&](int64_t a, int64_t b, int64_t cc, int64_t d) {
        const float ya = dyr[a], yb = dyr[b], yc = dyr[cc], yd = dyr[d];
        const float xa = xr[a], xb = xr[b], xc = xr[cc], xd = xr[d];
        const float oa = kAccumulate ? dr[a] : 0.f, ob = kAccumulate ? dr[b] : 0.f,
                    oc = kAccumulate ? dr[cc] : 0.f, od = kAccumulate ? dr[d] : 0.f;
        one(a, ya, xa, oa);
        one(b, yb, xb, ob);
        one(cc, yc, xc, oc);
        one(d, yd, xd, od);
      },
      [&](int64_t j) { one(j, dyr[j], xr[j], kAccumulate ? dr[j] : 0.f); });
}

// dw partials: chunk c of rows, one thread per column, rows in order.
template <typename G, typename X>
__global__ void rmsnorm_dw_part_kernel(float* part, const G* dy, const X* x, const float* rstd,
                                       int64_t R, int64_t D, int64_t rows_per_chunk) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= D) return;
  const int64_t c = blockIdx.y, r0 = c * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < R ? r0 + rows_per_chunk : R;
  // Four rows' loads ahead of their sums (the sums in row order, as one row at a time).
  float s = 0.f;
  auto term = [&](int64_t r) { return to_f32(dy[r * D + j]) * (to_f32(x[r * D + j]) * rstd[r]); };
  int64_t r = r0;
  for (; r + 3 < r1; r += 4) {
    const float y0 = to_f32(dy[r * D + j]), y1 = to_f32(dy[(r + 1) * D + j]),
                y2 = to_f32(dy[(r + 2) * D + j]), y3 = to_f32(dy[(r + 3) * D + j]);
    const float x0 = to_f32(x[r * D + j]), x1 = to_f32(x[(r + 1) * D + j]),
                x2 = to_f32(x[(r + 2) * D + j]), x3 = to_f32(x[(r + 3) * D + j]);
    s += y0 * (x0 * rstd[r]);
    s += y1 * (x1 * rstd[r + 1]);
    s += y2 * (x2 * rstd[r + 2]);
    s += y3 * (x3 * rstd[r + 3]);
  }
  for (; r < r1; ++r) s += term(r);
  part[c * D + j] = s;
}

__global__ void rmsnorm_dw_final_kernel(float* dw, const float* part, int64_t chunks, int64_t D) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= D) return;
  float s = 0.f;
  for (int64_t c = 0; c < chunks; ++c) s += part[c * D + j];
  dw[j] += s;
}

}  // namespace

namespace launch {

void rmsnorm_fwd(void* y, DType yt, float* rstd, const void* x, DType xt, const float* w, int64_t R,
                 int64_t D, float eps, cudaStream_t s) {
  if (R == 0) return;
  const bool wide = rmsnorm_fwd_wide(y, x, w, D);
  const unsigned grid = static_cast<unsigned>((R + kRowsPerBlock - 1) / kRowsPerBlock);
  dispatch_dtype(yt, [&](auto yv) {
    dispatch_dtype(xt, [&](auto xv) {
      using Y = decltype(yv);
      using X = decltype(xv);
      if (wide) {
        const auto threads = static_cast<unsigned>(D / kWideCols * 32);
        rmsnorm_fwd_wide_kernel<Y, X><<<static_cast<unsigned>(R), threads, 0, s>>>(
            static_cast<Y*>(y), rstd, static_cast<const X*>(x), w, D, eps);
      } else {
        rmsnorm_fwd_kernel<Y, X><<<grid, 32 * kRowsPerBlock, 0, s>>>(
            static_cast<Y*>(y), rstd, static_cast<const X*>(x), w, R, D, eps);
      }
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

int64_t rmsnorm_dw_chunks(int64_t R) {
  return rmsnorm_cuda_dw_chunks(R);
}

namespace {

// dw += Σ_rows dy ⊙ x · rstd from the rstd the dx kernel left in rstd_ws: fixed row chunks, then
// the chunks in order.
template <typename G, typename X>
void launch_dw(float* dw, const G* dy, const X* x, int64_t R, int64_t D, const float* rstd_ws,
               float* part_ws, cudaStream_t s) {
  constexpr int kThreads = kElementwiseThreads;
  const int64_t rows = rmsnorm_cuda_dw_rows_per_chunk(R), chunks = rmsnorm_dw_chunks(R);
  const auto col_blocks = static_cast<unsigned>((D + kThreads - 1) / kThreads);
  rmsnorm_dw_part_kernel<G, X><<<dim3(col_blocks, static_cast<unsigned>(chunks)), kThreads, 0, s>>>(
      part_ws, dy, x, rstd_ws, R, D, rows);
  rmsnorm_dw_final_kernel<<<col_blocks, kThreads, 0, s>>>(dw, part_ws, chunks, D);
}

}  // namespace

void rmsnorm_bwd(void* dx, const void* dy, DType gt, float* dw, const void* x, DType xt,
                 const float* w, int64_t R, int64_t D, float eps, float* rstd_ws, float* part_ws,
                 cudaStream_t s) {
  if (R == 0) return;
  const unsigned grid = static_cast<unsigned>((R + kRowsPerBlock - 1) / kRowsPerBlock);
  dispatch_dtype(gt, [&](auto gv) {
    dispatch_dtype(xt, [&](auto xv) {
      using G = decltype(gv);
      using X = decltype(xv);
      rmsnorm_bwd_dx_kernel<G, X>
          <<<grid, 32 * kRowsPerBlock, 0, s>>>(static_cast<G*>(dx), static_cast<const G*>(dy),
                                               static_cast<const X*>(x), w, R, D, eps, rstd_ws);
      if (dw)
        launch_dw(dw, static_cast<const G*>(dy), static_cast<const X*>(x), R, D, rstd_ws, part_ws,
                  s);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

void rmsnorm_bwd_res(float* dres, uint16_t* dres_bf, bool accumulate, float* dw, const float* dy,
                     const float* x, const float* w, int64_t R, int64_t D, float eps,
                     float* rstd_ws, float* part_ws, cudaStream_t s) {
  if (R == 0) return;
  const unsigned grid = static_cast<unsigned>((R + kRowsPerBlock - 1) / kRowsPerBlock);
  if (accumulate)
    rmsnorm_bwd_res_kernel<true>
        <<<grid, 32 * kRowsPerBlock, 0, s>>>(dres, dres_bf, dy, x, w, R, D, eps, rstd_ws);
  else
    rmsnorm_bwd_res_kernel<false>
        <<<grid, 32 * kRowsPerBlock, 0, s>>>(dres, dres_bf, dy, x, w, R, D, eps, rstd_ws);
  if (dw) launch_dw(dw, dy, x, R, D, rstd_ws, part_ws, s);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
