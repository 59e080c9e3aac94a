// dflash.cpp — kernels of the decoding ops (contracts in src/ops/decode.hpp, launchers declared in
// backend/cuda/decode_launch.hpp). All per-request state is read from device memory, so every
// launch here can be captured in a graph and replayed while the lengths change.
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_launch.hpp"

namespace dflash::cuda {
namespace {

// One thread per row r = b·K + j of the step.
__global__ void decode_rows_kernel(int32_t* pos, int32_t* slots, AttnRange* causal,
                                   AttnRange* block, const int32_t* lens, int B, int K, int first,
                                   int C) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= B * K) return;
  const int b = r / K, j = r % K;
  // Clamped so that a finished request's rows (still computed by a fixed-shape step) stay inside
  // its own C rows; a live request always has lens[b] + K <= C (the caller's plan).
  const int len = min(lens[b], C - K), p = len + j, base = (first + b) * C;
  pos[r] = p;
  slots[r] = base + p;
  causal[r] = AttnRange{base, base + p + 1, 0, 0};
  if (block) block[r] = AttnRange{base, base + len + K, 0, 0};
}

// A grid-stride loop over the R·W values (row-contiguous reads, one scattered row per token).
__global__ void kv_scatter_kernel(uint16_t* cache, const uint16_t* rows, const int32_t* slots,
                                  int64_t R, int64_t W) {
  const int64_t n = R * W;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / W, c = i % W;
    cache[static_cast<int64_t>(slots[r]) * W + c] = rows[i];
  }
}

constexpr int kArgmaxThreads = 256;

// One CTA per row: block_argmax (common.cuh), the smallest index of the row's maximum.
__global__ void argmax_rows_kernel(int32_t* out, const float* logits, int64_t V, int skip) {
  const int64_t r = blockIdx.x;
  if (skip > 0 && r % skip == 0) return;
  const float* row = logits + r * V;
  const int32_t best = block_argmax<kArgmaxThreads>(row, V);
  if (threadIdx.x == 0) out[r] = best;
}

// One thread per request.
__global__ void greedy_accept_kernel(int32_t* out, int32_t* lens, int32_t* block,
                                     const int32_t* target, const int32_t* active, int B, int K,
                                     int32_t mask) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  int32_t* o = out + b * (K + 1);
  if (!active[b]) {
    o[0] = 0;
    return;
  }
  int32_t* blk = block + b * K;
  const int32_t* t = target + b * K;
  int n = 0;
  while (n + 1 < K && blk[n + 1] == t[n]) ++n;
  const int32_t bonus = t[n];
  o[0] = n + 1;
  for (int i = 0; i < n; ++i) o[1 + i] = blk[1 + i];
  o[1 + n] = bonus;
  lens[b] += n + 1;
  blk[0] = bonus;
  for (int k = 1; k < K; ++k) blk[k] = mask;
}

__global__ void decode_admit_kernel(int32_t* lens, int32_t* active, int32_t* block,
                                    const int32_t* first_token, int b, int K, int len,
                                    int32_t mask) {
  const int k = threadIdx.x;
  if (k == 0) {
    lens[b] = len;
    active[b] = 1;
  }
  for (int j = k; j < K; j += blockDim.x) block[b * K + j] = j == 0 ? *first_token : mask;
}

}  // namespace

namespace launch {

void decode_rows(int32_t* pos, int32_t* slots, AttnRange* causal, AttnRange* block,
                 const int32_t* lens, int B, int K, int first, int C, cudaStream_t s) {
  const int n = B * K;
  decode_rows_kernel<<<(n + 127) / 128, 128, 0, s>>>(pos, slots, causal, block, lens, B, K, first,
                                                     C);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void kv_scatter(uint16_t* cache, const uint16_t* rows, const int32_t* slots, int64_t R, int64_t W,
                cudaStream_t s) {
  if (R == 0) return;
  kv_scatter_kernel<<<grid_for(R * W, 256), 256, 0, s>>>(cache, rows, slots, R, W);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void argmax_rows(int32_t* out, const float* logits, int64_t R, int64_t V, int skip,
                 cudaStream_t s) {
  if (R == 0) return;
  argmax_rows_kernel<<<static_cast<unsigned>(R), kArgmaxThreads, 0, s>>>(out, logits, V, skip);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void greedy_accept(int32_t* out, int32_t* lens, int32_t* block, const int32_t* target,
                   const int32_t* active, int B, int K, int32_t mask, cudaStream_t s) {
  greedy_accept_kernel<<<(B + 63) / 64, 64, 0, s>>>(out, lens, block, target, active, B, K, mask);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void decode_admit(int32_t* lens, int32_t* active, int32_t* block, const int32_t* first_token, int b,
                  int K, int len, int32_t mask, cudaStream_t s) {
  decode_admit_kernel<<<1, 64, 0, s>>>(lens, active, block, first_token, b, K, len, mask);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
