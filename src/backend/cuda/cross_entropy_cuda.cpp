// dflash.cpp — checked CUDA entry points of the fused LM-head cross-entropy (contract:
// src/ops/cross_entropy.hpp). Each checks sizes and pointers (errors name the entry point and the
// bad value), takes any scratch from the context's caching allocator and runs cuBLASLt for the
// logits and the hidden-state gradient and the per-row kernels of backend/cuda/cross_entropy.cu on
// the context's stream.
#include <algorithm>
#include <cmath>

#include "backend/cuda/context.hpp"
#include "backend/cuda/cross_entropy_launch.hpp"
#include "backend/cuda/entry.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/error.hpp"
#include "ops/cross_entropy.hpp"

namespace dflash {

void cross_entropy_fused_cuda(cuda::CudaContext& ctx, float* d_hidden, float* lse, int32_t* argmax,
                              float* row_loss, double* sums, const uint16_t* hidden,
                              const uint16_t* head, const int32_t* labels, const float* weights,
                              const FusedCeParams& p, void* workspace, uint64_t workspace_bytes) {
  const int64_t R = p.R, H = p.H, V = p.V;
  DFLASH_CHECK(R >= 0 && H > 0 && V > 0 && p.chunk_rows > 0 && V < (1ll << 31),
               "cross_entropy_fused_cuda: bad sizes R={} H={} V={} chunk_rows={}", R, H, V,
               p.chunk_rows);
  DFLASH_CHECK(std::isfinite(p.grad_scale), "cross_entropy_fused_cuda: grad_scale not finite");
  DFLASH_CHECK(R == 0 || (hidden && head && labels), "cross_entropy_fused_cuda: null pointer");
  const int64_t C = std::min(p.chunk_rows, std::max<int64_t>(R, 1));
  const uint64_t need = cross_entropy_fused_cuda_workspace_bytes(p, d_hidden, row_loss);
  cuda::DeviceBuffer own;
  if (!workspace) {
    own = ctx.scratch(need);
    workspace = own.data();
  } else {
    DFLASH_CHECK(workspace_bytes >= need,
                 "cross_entropy_fused_cuda: workspace of {} bytes for {} rows in chunks of {} "
                 "(needs {})",
                 workspace_bytes, R, C, need);
  }
  // Layout of the workspace (cross_entropy_fused_cuda_workspace_bytes): logits, dlogits, losses.
  auto* at = static_cast<char*>(workspace);
  auto* logits = reinterpret_cast<float*>(at);
  at += arena_round(static_cast<uint64_t>(C * V) * sizeof(float));
  uint16_t* dlogits = nullptr;
  if (d_hidden) {
    dlogits = reinterpret_cast<uint16_t*>(at);
    at += arena_round(static_cast<uint64_t>(C * V) * sizeof(uint16_t));
  }
  if (!row_loss) row_loss = reinterpret_cast<float*>(at);
  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t n = std::min(C, R - r0);
    // logits[n,V] = hidden[n,H] · head[V,H]ᵀ (fp32 out)
    cuda::gemm_bf16(ctx, logits, DType::f32, V, hidden + r0 * H, H, false, head, H, true, n, V, H);
    cuda::launch::ce_rows(row_loss + r0, lse ? lse + r0 : nullptr, argmax ? argmax + r0 : nullptr,
                          dlogits, logits, labels + r0, weights ? weights + r0 : nullptr,
                          static_cast<float>(p.grad_scale), n, V, ctx.stream());
    // d_hidden[n,H] = dlogits[n,V] · head[V,H]
    if (d_hidden)
      cuda::gemm_bf16(ctx, d_hidden + r0 * H, DType::f32, H, dlogits, V, false, head, H, false, n,
                      H, V);
  }
  if (sums) cuda::launch::ce_sums(sums, row_loss, weights, R, ctx.stream());
}

}  // namespace dflash
