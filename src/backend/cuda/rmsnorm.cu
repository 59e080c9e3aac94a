// dflash.cpp — CUDA kernels of RMSNorm, full-width and per-head (semantics: src/ops/rmsnorm.hpp).
// One warp per row, each lane loading four of its columns before using them (lane_cols, the same
// order of operations as one column at a time); arithmetic in fp32 whatever the storage type. The
// weight gradient is summed over fixed row chunks, then the chunks in order (no atomics):
// bit-reproducible. No fmt (nvcc).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/rmsnorm_launch.hpp"
#include "ops/rmsnorm.hpp"

namespace dflash::cuda {
namespace {

constexpr int kRowsPerBlock = 8;

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
  const unsigned grid = static_cast<unsigned>((R + kRowsPerBlock - 1) / kRowsPerBlock);
  dispatch_dtype(yt, [&](auto yv) {
    dispatch_dtype(xt, [&](auto xv) {
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
