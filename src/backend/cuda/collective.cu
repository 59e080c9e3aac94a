// dflash.cpp — the kernel of the in-process device collective (train/collective_cuda.cpp): each
// rank reduces its own chunk of every rank's buffer, in rank order, and writes the sum back into
// every buffer. Plain f32 adds with round-to-nearest intrinsics (no contraction), so the result is
// a pure function of the inputs and identical in every buffer.
#include "backend/cuda/collective_launch.hpp"
#include "backend/cuda/common.cuh"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void sum_ranks_kernel(RankBuffers bufs, int64_t begin, int64_t end) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = bufs.p[0][i];
    for (int r = 1; r < bufs.n; ++r) s = __fadd_rn(s, bufs.p[r][i]);
    for (int r = 0; r < bufs.n; ++r) bufs.p[r][i] = s;
  }
}

}  // namespace

namespace launch {

void sum_ranks(const RankBuffers& bufs, int64_t begin, int64_t end, cudaStream_t s) {
  if (end <= begin) return;
  sum_ranks_kernel<<<grid_for(end - begin, kThreads, 4096), kThreads, 0, s>>>(bufs, begin, end);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
