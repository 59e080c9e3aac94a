// dflash.cpp — launchers of the fused decoding kernels (device code: decode_fused.cuh; contracts:
// src/ops/decode_fused.hpp). Sizes are checked by decode_fused_cuda.cpp before these run. No fmt
// in this file (nvcc).
#include "backend/cuda/decode_fused.cuh"
#include "backend/cuda/decode_fused_launch.hpp"

namespace dflash::cuda {
namespace {

template <int D>
__global__ void __launch_bounds__(decode_fused::kPrepMaxThreads, decode_fused::kPrepMinCtas)
    qkv_prepare_kernel(decode_fused::QkvPrepArgs a) {
  DFLASH_DYNAMIC_SMEM(smem);
  decode_fused::qkv_prepare<D>(a, reinterpret_cast<float*>(smem));
}

template <int D>
__global__ void __launch_bounds__(1024) decode_attn_split_kernel(decode_fused::DecodeAttnArgs a) {
  decode_fused::decode_attn_split<D>(a);
}

template <int D>
__global__ void __launch_bounds__(32 * decode_fused::kCombineWarps)
    decode_attn_combine_kernel(decode_fused::DecodeAttnArgs a) {
  decode_fused::decode_attn_combine<D>(a);
}

template <int MT, typename Y, bool ACC>
__global__ void __launch_bounds__(32 * decode_fused::kGemmWarps)
    decode_linear_kernel(decode_fused::DecodeLinearArgs a) {
  DFLASH_DYNAMIC_SMEM(smem);
  decode_fused::decode_linear<MT, Y, ACC>(a, reinterpret_cast<float*>(smem));
}

// One launch of at most kGemmMaxTiles row tiles: MT rounded up to 1, 2, 4 or 8.
template <typename Y, bool ACC>
void decode_linear_tiles(const decode_fused::DecodeLinearArgs& a, cudaStream_t s) {
  using decode_fused::kGemmWarps;
  const int tiles = static_cast<int>((a.M + 15) / 16);
  const int mt = tiles <= 1 ? 1 : tiles <= 2 ? 2 : tiles <= 4 ? 4 : 8;
  const auto grid = static_cast<unsigned>(a.N / 8);
  const size_t smem = sizeof(float) * (kGemmWarps - 1) * static_cast<size_t>(mt) * 128;
  const int threads = 32 * kGemmWarps;
  if (mt == 1)
    decode_linear_kernel<1, Y, ACC><<<grid, threads, smem, s>>>(a);
  else if (mt == 2)
    decode_linear_kernel<2, Y, ACC><<<grid, threads, smem, s>>>(a);
  else if (mt == 4)
    decode_linear_kernel<4, Y, ACC><<<grid, threads, smem, s>>>(a);
  else
    decode_linear_kernel<8, Y, ACC><<<grid, threads, smem, s>>>(a);
}

}  // namespace

namespace launch {

void decode_linear(const decode_fused::DecodeLinearArgs& a, bool f32_out, bool accumulate,
                   cudaStream_t s) {
  constexpr int64_t kRows = 16 * decode_fused::kGemmMaxTiles;
  for (int64_t r0 = 0; r0 < a.M; r0 += kRows) {  // each row block reads the weights once
    decode_fused::DecodeLinearArgs b = a;
    b.M = a.M - r0 < kRows ? a.M - r0 : kRows;
    b.x = a.x + r0 * a.K;
    if (f32_out) {
      b.y = static_cast<float*>(a.y) + r0 * a.N;
      if (accumulate)
        decode_linear_tiles<float, true>(b, s);
      else
        decode_linear_tiles<float, false>(b, s);
    } else {
      b.y = static_cast<uint16_t*>(a.y) + r0 * a.N;
      decode_linear_tiles<uint16_t, false>(b, s);
    }
  }
  DFLASH_CUDA_LAUNCH_CHECK();
}

void qkv_prepare(const decode_fused::QkvPrepArgs& a, int D, cudaStream_t s) {
  if (a.T == 0) return;
  const auto grid = static_cast<unsigned>(a.T);
  const int threads = decode_fused::qkv_prep_threads(a.NH + 2 * a.NKV);
  const size_t smem = sizeof(float) * static_cast<size_t>(D);  // the token's cos and sin
  if (D == 64)
    qkv_prepare_kernel<64><<<grid, threads, smem, s>>>(a);
  else
    qkv_prepare_kernel<128><<<grid, threads, smem, s>>>(a);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void decode_attention(const decode_fused::DecodeAttnArgs& a, int D, cudaStream_t s) {
  if (a.T == 0) return;
  const int G = a.NH / a.NKV;
  const dim3 split_grid(static_cast<unsigned>(a.S), static_cast<unsigned>(a.NKV),
                        static_cast<unsigned>((a.T + a.rows_per_cta - 1) / a.rows_per_cta));
  const int split_threads = 32 * G * a.rows_per_cta;
  const int64_t warps = a.T * a.NH;
  const auto combine_grid = static_cast<unsigned>((warps + decode_fused::kCombineWarps - 1) /
                                                  decode_fused::kCombineWarps);
  const int combine_threads = 32 * decode_fused::kCombineWarps;
  if (D == 64) {
    decode_attn_split_kernel<64><<<split_grid, split_threads, 0, s>>>(a);
    decode_attn_combine_kernel<64><<<combine_grid, combine_threads, 0, s>>>(a);
  } else {
    decode_attn_split_kernel<128><<<split_grid, split_threads, 0, s>>>(a);
    decode_attn_combine_kernel<128><<<combine_grid, combine_threads, 0, s>>>(a);
  }
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
