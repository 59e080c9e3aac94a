// dflash.cpp — CUDA kernel of the embedding gather (semantics: src/ops/embedding.hpp): one block
// per token row, fp32 arithmetic whatever the storage type; an id outside [0, V) writes a quiet NaN
// row (the checked entry point cannot see device ids). No fmt in this file (nvcc).
#include "backend/cuda/common.cuh"
#include "backend/cuda/embedding_launch.hpp"

namespace dflash::cuda {
namespace {

template <typename Y, typename W>
__global__ void embedding_fwd_kernel(Y* y, const W* table, const int32_t* ids, int64_t T, int64_t V,
                                     int64_t H) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const bool ok = id >= 0 && id < V;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
    y[t * H + h] = from_f32<Y>(ok ? to_f32(table[id * H + h]) : __int_as_float(0x7fc00000));
}

}  // namespace

namespace launch {

void embedding_fwd(void* y, DType yt, const void* table, DType wt, const int32_t* ids, int64_t T,
                   int64_t V, int64_t H, cudaStream_t s) {
  if (T == 0) return;
  dispatch_dtype(yt, [&](auto yv) {
    dispatch_dtype(wt, [&](auto wv) {
      using Y = decltype(yv);
      using W = decltype(wv);
      embedding_fwd_kernel<Y, W><<<static_cast<unsigned>(T), kElementwiseThreads, 0, s>>>(
          static_cast<Y*>(y), static_cast<const W*>(table), ids, T, V, H);
    });
  });
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
