// dflash.cpp — DFlash2's selector and loss on the CUDA backend (see dflash2_head_cuda.hpp). The
// predecessor index and the buffer sizes are host code (built and tested without a GPU); the step
// runs cuBLASLt GEMMs (ops/gemm.hpp) and the kernels of backend/cuda/dflash2_selector.cu on
// the context's stream.
#include "model/dflash2_head_cuda.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/arena_plan.hpp"
#include "core/error.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/dflash2_selector_launch.hpp"
#include "ops/gemm.hpp"
#include "ops/loss_weights.hpp"
#endif

namespace dflash {

namespace {
uint64_t u(int64_t v) {
  return static_cast<uint64_t>(v);
}
int64_t chunk_of(int64_t R, int64_t chunk_rows) {
  return std::min(chunk_rows, std::max<int64_t>(R, 1));
}
constexpr int kMaxTopK = 1024, kMaxRank = 1024;  // cuda::launch::kDflash2MaxTopK / MaxRank
// cub's radix-sort scratch, bounded: 16 bytes an item plus 1 MiB (checked against cub's query).
uint64_t sort_bound(int64_t items) {
  return u(items) * 16 + (uint64_t{1} << 20);
}
}  // namespace

std::vector<std::string> dflash2_cuda_unsupported(const DrafterConfig& cfg) {
  std::vector<std::string> out;
  if (!cfg.dflash2.enabled) return out;
  if (cfg.dflash2.selector_top_k > kMaxTopK) {
    out.push_back(fmt::format("the CUDA DFlash2 selector takes selector_top_k up to {} (got {})",
                              kMaxTopK, cfg.dflash2.selector_top_k));
  }
  if (cfg.dflash2.selector_rank > kMaxRank) {
    out.push_back(fmt::format("the CUDA DFlash2 selector takes selector_rank up to {} (got {})",
                              kMaxRank, cfg.dflash2.selector_rank));
  }
  return out;
}

std::vector<int32_t> dflash2_prev_tokens(const DrafterBatch& b, int64_t rows, int64_t vocab) {
  DFLASH_CHECK(b.objective.dflash2(), "DFlash2 predecessors of a batch of the {} objective",
               objective_kind_name(b.objective.kind));
  const int64_t K = b.block_size, NK = b.N() * K;
  DFLASH_CHECK(rows >= NK, "DFlash2 predecessors: {} rows for a batch of {} block rows", rows, NK);
  std::vector<int32_t> prev(u(rows), static_cast<int32_t>(vocab));
  for (int64_t i = 0; i < NK; ++i) {
    const int64_t slot = i % K;
    if (slot == 0 || b.targets.weights[u(i)] == 0.0f) continue;
    const int32_t p = slot == 1 ? b.tokens[u(b.anchors[u(i / K)].pos)] : b.targets.labels[u(i - 1)];
    DFLASH_CHECK(p >= 0 && p < vocab, "DFlash2 block row {} has predecessor {} outside [0, {})", i,
                 p, vocab);
    prev[u(i)] = p;
  }
  return prev;
}

uint64_t dflash2_head_cuda_workspace_bytes(const DrafterConfig& cfg, int64_t R,
                                           int64_t chunk_rows) {
  const uint64_t C = u(chunk_of(R, chunk_rows)), V = u(cfg.vocab_size);
  return arena_round(C * V * 4) + arena_round(C * V * 2);
}

uint64_t dflash2_head_cuda_rows_bytes(const DrafterConfig& cfg, int64_t R) {
  const uint64_t n = u(std::max<int64_t>(R, 1)), r = u(cfg.dflash2.selector_rank);
  const uint64_t K = u(cfg.dflash2.selector_top_k);
  return 3 * arena_round(n * 4) + 3 * arena_round(n * r * 4) + 2 * arena_round(n * K * 4) +
         3 * arena_round(n * K * 4) + arena_round(sort_bound(static_cast<int64_t>(n * K)));
}

#ifdef DFLASH_HAVE_CUDA

void dflash2_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg,
                       const DrafterLayout& layout, const Objective& obj,
                       const Dflash2CudaArgs& a) {
  DFLASH_CHECK(cfg.dflash2.enabled, "DFlash2 head step for a drafter without DFlash2's selector");
  const std::vector<std::string> bad = dflash2_cuda_unsupported(cfg);
  DFLASH_CHECK(bad.empty(), "{}", fmt::join(bad, "; "));
  DFLASH_CHECK(obj.dflash2(), "DFlash2 head step with the {} objective",
               objective_kind_name(obj.kind));
  DFLASH_CHECK(obj.dpace() == (a.dpace_w != nullptr && a.dpace_sums != nullptr),
               "dflash2_head_cuda: loss type {} {} the D-PACE weight and sum buffers",
               loss_type_name(obj.loss), obj.dpace() ? "needs" : "takes no");
  DFLASH_CHECK(!obj.dpace() || a.R % cfg.block_size == 0,
               "dflash2_head_cuda: {} rows are not whole blocks of {} (D-PACE's weights)", a.R,
               cfg.block_size);
  const int64_t R = a.R, H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t r = cfg.dflash2.selector_rank, K = cfg.dflash2.selector_top_k;
  DFLASH_CHECK(R >= 0 && a.chunk_rows > 0, "dflash2_head_cuda: {} rows in chunks of {}", R,
               a.chunk_rows);
  DFLASH_CHECK(a.params && a.grads && a.lm_head && a.hf && a.labels && a.weights && a.prev &&
                   a.alpha && a.dhf && a.sums && a.workspace && a.rows,
               "dflash2_head_cuda: null pointer");
  const uint64_t need_ws = dflash2_head_cuda_workspace_bytes(cfg, R, a.chunk_rows);
  const uint64_t need_rows = dflash2_head_cuda_rows_bytes(cfg, R);
  DFLASH_CHECK(a.workspace_bytes >= need_ws && a.rows_bytes >= need_rows,
               "dflash2_head_cuda: workspace of {} bytes and row buffers of {} bytes for {} rows "
               "in chunks of {} (need {} and {})",
               a.workspace_bytes, a.rows_bytes, R, a.chunk_rows, need_ws, need_rows);
  const uint64_t n = u(std::max<int64_t>(R, 1));
  const uint64_t sort_need = cuda::launch::dflash2_sort_scratch_bytes(R * K, V);
  DFLASH_CHECK(sort_need <= sort_bound(static_cast<int64_t>(n) * K),
               "dflash2_head_cuda: cub's radix sort asks {} bytes of scratch for {} items, more "
               "than the {} the plan reserves",
               sort_need, R * K, sort_bound(static_cast<int64_t>(n) * K));
  const int64_t C = chunk_of(R, a.chunk_rows);
  cudaStream_t s = ctx.stream();
  // Workspace and row buffers (the layouts of the two _bytes functions).
  auto* wat = static_cast<char*>(a.workspace);
  auto* rat = static_cast<char*>(a.rows);
  auto take = [](char*& at, uint64_t bytes) {
    char* p = at;
    at += arena_round(bytes);
    return p;
  };
  auto* logits = reinterpret_cast<float*>(take(wat, u(C * V) * 4));
  auto* dl = reinterpret_cast<uint16_t*>(take(wat, u(C * V) * 2));
  cuda::launch::Dflash2SelRows rows;
  rows.base = reinterpret_cast<float*>(take(rat, n * 4));
  rows.sel = reinterpret_cast<float*>(take(rat, n * 4));
  rows.in_topk = reinterpret_cast<float*>(take(rat, n * 4));
  rows.e = reinterpret_cast<float*>(take(rat, n * u(r) * 4));
  rows.dproj = reinterpret_cast<float*>(take(rat, n * u(r) * 4));
  rows.da = reinterpret_cast<float*>(take(rat, n * u(r) * 4));
  rows.cand = reinterpret_cast<int32_t*>(take(rat, n * u(K) * 4));
  rows.ds = reinterpret_cast<float*>(take(rat, n * u(K) * 4));
  auto* idx_in = reinterpret_cast<int32_t*>(take(rat, n * u(K) * 4));
  auto* keys_sorted = reinterpret_cast<int32_t*>(take(rat, n * u(K) * 4));
  auto* idx_sorted = reinterpret_cast<int32_t*>(take(rat, n * u(K) * 4));
  void* sort_ws = take(rat, sort_bound(static_cast<int64_t>(n) * K));
  rows.argmax = a.argmax;
  const Dflash2Offsets& o = layout.dflash2;
  const float* Ph = a.params + o.hidden_proj;
  // α_sel is read on the device, so the gradients are computed at every α (at α_sel = 0 without
  // the base they are zeros added: the warmup's steps cost the selector's GEMMs anyway).
  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t cn = std::min(C, R - r0);
    const uint16_t* hf = a.hf + r0 * H;
    // U [cn, V] = hf·LMheadᵀ
    gemm_bf16_cuda(ctx, logits, DType::f32, V, hf, H, false, a.lm_head, H, true, cn, V, H);
    cuda::launch::Dflash2SelIn in;
    in.logits = logits;
    in.dl = dl;
    in.hf = hf;
    in.labels = a.labels + r0;
    in.weights = a.weights + r0;
    in.prev = a.prev + r0;
    in.A = a.params + o.predecessor;
    in.Bs = a.params + o.successor;
    in.Ph = Ph;
    in.n = cn;
    in.V = V;
    in.H = H;
    in.r = r;
    in.K = static_cast<int>(K);
    in.m = static_cast<float>(cfg.dflash2.output_multiplier);
    in.cap = static_cast<float>(cfg.dflash2.final_logit_softcapping);
    in.grad_scale = static_cast<float>(a.grad_scale);
    in.alpha = a.alpha;
    in.stop = obj.dflash2_stop_gradient;
    in.with_base = a.base_in_head;
    cuda::launch::Dflash2SelRows at = rows;
    at.base += r0, at.sel += r0, at.in_topk += r0;
    if (at.argmax) at.argmax += r0;
    at.e += r0 * r, at.dproj += r0 * r, at.da += r0 * r;
    at.cand += r0 * K, at.ds += r0 * K;
    cuda::launch::dflash2_selector_rows(in, at, s);
    // dhf [cn, H] (=, or += without the base) dl·LMhead, + P_hᵀ·∂(P_h·h) unless stop_gradient.
    float* dhf = a.dhf + r0 * H;
    gemm_bf16_cuda(ctx, dhf, DType::f32, H, dl, V, false, a.lm_head, H, false, cn, H, V, 1.0f,
                   a.base_in_head ? 0.0f : 1.0f);
    if (!obj.dflash2_stop_gradient) {
      cuda::launch::dflash2_dh_add(dhf, at.dproj, Ph, cn, H, r, s);
    }
  }
  // D-PACE: the rows ran with unit weights; each row's weight w (its block's, from the base CE)
  // scales everything linear in it before the reductions.
  const float* weights = a.weights;
  if (obj.dpace()) {
    if (a.base_in_head) {
      DFLASH_CUDA_CHECK(
          cudaMemcpyAsync(a.dpace_w, rows.base, u(R) * sizeof(float), cudaMemcpyDeviceToDevice, s));
    }
    dpace_weights_cuda(ctx, a.dpace_w, a.dpace_sums, a.weights, R / cfg.block_size, cfg.block_size,
                       obj);
    rows_scale_cuda(ctx, a.dhf, a.dpace_w, R, H);
    rows_scale_cuda(ctx, rows.ds, a.dpace_w, R, K);
    rows_scale_cuda(ctx, rows.da, a.dpace_w, R, r);
    rows_scale_cuda(ctx, rows.dproj, a.dpace_w, R, r);
    weights = a.dpace_w;
  }
  cuda::launch::dflash2_sums(a.sums, rows, weights, R, a.alpha, s);
  // dP_h += Σ_rows ∂(P_h·h) ⊗ h; dA[prev] += the rows' da; dBs[c] += ds·e per candidate.
  cuda::launch::dflash2_dph(a.grads + o.hidden_proj, rows.dproj, a.hf, R, H, r, s);
  const size_t sort_bytes = sort_bound(static_cast<int64_t>(n) * K);
  cuda::launch::dflash2_keyed_scatter(a.grads + o.predecessor, a.prev, nullptr, rows.da, R, 1, r, V,
                                      idx_in, keys_sorted, idx_sorted, sort_ws, sort_bytes, s);
  cuda::launch::dflash2_keyed_scatter(a.grads + o.successor, rows.cand, rows.ds, rows.e, R * K, K,
                                      r, V, idx_in, keys_sorted, idx_sorted, sort_ws, sort_bytes,
                                      s);
}

#endif  // DFLASH_HAVE_CUDA

}  // namespace dflash
