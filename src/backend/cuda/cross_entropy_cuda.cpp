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
  DFLASH_CHECK(R >= 0 && H > 0 && V > 0 && p.chunk_rows > 0 && V < (1ll << 31) &&
                   p.skip_first_of >= 0,
               "cross_entropy_fused_cuda: bad sizes R={} H={} V={} chunk_rows={} skip_first_of={}",
               R, H, V, p.chunk_rows, p.skip_first_of);
  DFLASH_CHECK(std::isfinite(p.grad_scale), "cross_entropy_fused_cuda: grad_scale not finite");
  DFLASH_CHECK(R == 0 || (hidden && head && labels), "cross_entropy_fused_cuda: null pointer");
  const bool skip = p.skip_first_of > 1;
  const int64_t K = p.skip_first_of;
  DFLASH_CHECK(!skip || (R % K == 0 && weights),
               "cross_entropy_fused_cuda: skip_first_of {} needs R a multiple of it and weights "
               "(R={}, weights {})",
               K, R, weights ? "given" : "null");
  const FusedCeWorkspace wl = fused_ce_workspace(p, d_hidden, row_loss);
  const int64_t C = wl.chunk;
  cuda::DeviceBuffer own;
  if (!workspace) {
    own = ctx.scratch(wl.total);
    workspace = own.data();
  } else {
    DFLASH_CHECK(workspace_bytes >= wl.total,
                 "cross_entropy_fused_cuda: workspace of {} bytes for {} rows in chunks of {} "
                 "(needs {})",
                 workspace_bytes, R, C, wl.total);
  }
  // The workspace's blocks (fused_ce_workspace): logits, dlogits, losses, gathered rows.
  auto* base = static_cast<char*>(workspace);
  auto* logits = reinterpret_cast<float*>(base + wl.logits);
  uint16_t* dlogits = d_hidden ? reinterpret_cast<uint16_t*>(base + wl.dlogits) : nullptr;
  if (!row_loss) row_loss = reinterpret_cast<float*>(base + wl.row_loss);
  cudaStream_t s = ctx.stream();
  if (!skip) {
    for (int64_t r0 = 0; r0 < R; r0 += C) {
      const int64_t n = std::min(C, R - r0);
      // logits[n,V] = hidden[n,H] · head[V,H]ᵀ (fp32 out)
      cuda::gemm_bf16(ctx, logits, DType::f32, V, hidden + r0 * H, H, false, head, H, true, n, V,
                      H);
      cuda::launch::ce_rows(row_loss + r0, lse ? lse + r0 : nullptr,
                            argmax ? argmax + r0 : nullptr, dlogits, logits, labels + r0,
                            weights ? weights + r0 : nullptr, static_cast<float>(p.grad_scale), n,
                            V, s);
      // d_hidden[n,H] = dlogits[n,V] · head[V,H]
      if (d_hidden)
        cuda::gemm_bf16(ctx, d_hidden + r0 * H, DType::f32, H, dlogits, V, false, head, H, false,
                        n, H, V);
    }
  } else {
    // Chunks of whole blocks: gather the head rows, the same three steps on them, scatter back.
    auto* hidden_c = reinterpret_cast<uint16_t*>(base + wl.hidden_c);
    float* d_hidden_c = d_hidden ? reinterpret_cast<float*>(base + wl.d_hidden_c) : nullptr;
    auto* rows_c = reinterpret_cast<float*>(base + wl.rows_c);  // five [C] arrays
    auto* labels_c = reinterpret_cast<int32_t*>(rows_c);
    float* weights_c = rows_c + C;
    float* loss_c = rows_c + 2 * C;
    float* lse_c = rows_c + 3 * C;
    auto* argmax_c = reinterpret_cast<int32_t*>(rows_c + 4 * C);
    const int64_t blocks = R / K, per = C / (K - 1);
    for (int64_t b0 = 0; b0 < blocks; b0 += per) {
      const int64_t nb = std::min(per, blocks - b0), n = nb * (K - 1), o0 = b0 * K;
      cuda::launch::ce_gather(hidden_c, labels_c, weights_c, hidden + o0 * H, labels + o0,
                              weights + o0, nb, K, H, s);
      cuda::gemm_bf16(ctx, logits, DType::f32, V, hidden_c, H, false, head, H, true, n, V, H);
      cuda::launch::ce_rows(loss_c, lse_c, argmax_c, dlogits, logits, labels_c, weights_c,
                            static_cast<float>(p.grad_scale), n, V, s);
      if (d_hidden)
        cuda::gemm_bf16(ctx, d_hidden_c, DType::f32, H, dlogits, V, false, head, H, false, n, H,
                        V);
      cuda::launch::ce_scatter(d_hidden ? d_hidden + o0 * H : nullptr, row_loss + o0,
                               lse ? lse + o0 : nullptr, argmax ? argmax + o0 : nullptr,
                               d_hidden_c, loss_c, lse_c, argmax_c, weights + o0, nb, K, H, s);
    }
  }
  if (sums) cuda::launch::ce_sums(sums, row_loss, weights, R, s);
}

}  // namespace dflash
