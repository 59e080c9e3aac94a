// dflash.cpp — CUDA loss weights from the rows' own CE (ops/loss_weights.hpp): D-PACE weights of
// blocks of rows (the formula of dpace_block_weights, ops/loss_weights.hpp, in double), and the row
// scaling that applies them to a gradient made with unit weights. One CTA computes every block's
// weights (a step has at most a few thousand blocks of ≤ 64 rows: microseconds) and reduces the
// sums in a fixed order, so two runs give the same bits.
#include <cfloat>
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/loss_weights_launch.hpp"
#include "ops/loss_weights.hpp"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 256;

// Thread t takes blocks t, t + blockDim.x, …: P_k forward, R_k backward, then the weight.
__global__ void dpace_weights_kernel(float* w, double* sums, const float* mask, int64_t N, int K,
                                     LossType loss, double alpha) {
  __shared__ double sh[32];
  double loss_sum = 0.0, weight_sum = 0.0;
  for (int64_t b = threadIdx.x; b < N; b += blockDim.x) {
    float* wb = w + b * K;
    const float* mb = mask + b * K;
    double P[kDpaceMaxBlock], ce[kDpaceMaxBlock];
    double prefix = 1.0;
    for (int k = 0; k < K; ++k) {
      const bool m = mb[k] != 0.0f;
      ce[k] = m ? static_cast<double>(wb[k]) : 0.0;
      if (m) prefix *= (1.0 - alpha) * exp(-ce[k]) + alpha;
      P[k] = prefix;
    }
    double suffix = 0.0;
    for (int k = K - 1; k >= 0; --k) {
      const bool m = mb[k] != 0.0f;
      if (m) suffix += P[k];
      double x = loss == LossType::dpace_cumulative_confidence_only ? P[k]
                 : loss == LossType::dpace                          ? suffix
                                                                    : suffix / fmax(P[k], DBL_MIN);
      if (!m) x = 0.0;
      loss_sum += x * ce[k];
      weight_sum += x;
      wb[k] = static_cast<float>(x);
    }
  }
  loss_sum = block_sum(loss_sum, sh);
  weight_sum = block_sum(weight_sum, sh);
  if (threadIdx.x == 0) sums[0] = loss_sum, sums[1] = weight_sum;
}

__global__ void rows_scale_kernel(float* x, const float* w, int64_t R, int64_t H) {
  const int64_t n = R * H;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[e] *= w[e / H];
}

}  // namespace

namespace launch {

void dpace_weights(float* w, double* sums, const float* mask, int64_t N, int K, LossType loss,
                   double alpha, cudaStream_t s) {
  dpace_weights_kernel<<<1, kThreads, 0, s>>>(w, sums, mask, N, K, loss, alpha);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void rows_scale(float* x, const float* w, int64_t R, int64_t H, cudaStream_t s) {
  if (R * H == 0) return;
  rows_scale_kernel<<<grid_for(R * H, kThreads), kThreads, 0, s>>>(x, w, R, H);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
