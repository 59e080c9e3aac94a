// dflash.cpp — the DSpark head on the CUDA backend (see dspark_head_cuda.hpp). The row index is
// host code (built and tested without a GPU); the step runs cuBLASLt GEMMs (backend/cuda/gemm)
// and the row kernels of backend/cuda/dspark_head.cu on the context's stream.
#include "model/dspark_head_cuda.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "core/error.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/context.hpp"
#include "backend/cuda/dspark_head_launch.hpp"
#include "backend/cuda/gemm.hpp"
#endif

namespace dflash {

namespace {
uint64_t u(int64_t v) {
  return static_cast<uint64_t>(v);
}
int64_t chunk_of(int64_t R, int64_t chunk_rows) {
  return std::min(chunk_rows, std::max<int64_t>(R, 1));
}
constexpr int kRowArrays = 6;  // ce, l1, bce, acc, conf, dconf
}  // namespace

std::vector<std::string> dspark_cuda_unsupported(const DrafterConfig& cfg) {
  std::vector<std::string> out;
  if (cfg.dspark.enabled && cfg.dspark.markov_rank > 0 &&
      cfg.dspark.markov_type != MarkovHeadType::vanilla) {
    out.push_back(
        fmt::format("dflash_config.markov_head_type {} is implemented on the cpu "
                    "backend only",
                    markov_head_type_name(cfg.dspark.markov_type)));
  }
  return out;
}

DsparkRowIndex dspark_row_index(const DrafterBatch& b, int64_t rows, int64_t vocab) {
  DFLASH_CHECK(b.objective.dspark() && b.targets.first_slot == 0,
               "DSpark row index of a batch of the {} objective",
               objective_kind_name(b.objective.kind));
  const int64_t K = b.block_size, NK = b.N() * K;
  DFLASH_CHECK(rows >= NK, "DSpark row index: {} rows for a batch of {} block rows", rows, NK);
  DsparkRowIndex x;
  x.prev.assign(u(rows), 0);
  x.teacher_pos.assign(u(rows), -1);
  std::vector<int32_t> sup;
  for (int64_t row = 0; row < NK; ++row) {
    const Anchor& a = b.anchors[u(row / K)];
    const int64_t pos = a.pos + row % K;
    x.prev[u(row)] = pos < b.doc_offsets[u(a.doc) + 1] ? b.tokens[u(pos)] : 0;
    if (b.targets.weights[u(row)] == 0.0f) continue;
    const int32_t y = b.targets.labels[u(row)];
    DFLASH_CHECK(y >= 0 && y < vocab, "DSpark block row {}: label {} outside [0, {})", row, y,
                 vocab);
    x.teacher_pos[u(row)] = static_cast<int32_t>(pos);
    sup.push_back(static_cast<int32_t>(row));
  }
  std::stable_sort(sup.begin(), sup.end(),
                   [&](int32_t i, int32_t j) { return x.prev[u(i)] < x.prev[u(j)]; });
  x.w1_order.assign(u(rows), -1);
  std::copy(sup.begin(), sup.end(), x.w1_order.begin());
  const auto n = static_cast<int32_t>(sup.size());
  x.w1_seg.assign(u(rows) + 1, n);
  size_t s = 0;
  for (int32_t k = 0; k < n; ++k) {
    if (k == 0 || x.prev[u(sup[u(k)])] != x.prev[u(sup[u(k) - 1])]) x.w1_seg[s++] = k;
  }
  return x;
}

uint64_t dspark_head_cuda_workspace_bytes(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows) {
  const uint64_t C = u(chunk_of(R, chunk_rows)), V = u(cfg.vocab_size);
  const uint64_t H = u(cfg.hidden_size), r = u(cfg.dspark.markov_rank);
  return 2 * arena_round(C * V * 4) + arena_round(C * V * 2) + arena_round(C * H * 2) +
         arena_round(std::max<uint64_t>(C * r, 1) * 2);
}

uint64_t dspark_head_cuda_rows_bytes(const DrafterConfig& cfg, int64_t R) {
  const uint64_t r = u(cfg.dspark.markov_rank), n = u(std::max<int64_t>(R, 1));
  return arena_round(std::max<uint64_t>(n * r, 1) * 4) + arena_round(kRowArrays * n * 4);
}

DsparkRowsView dspark_rows_view(const DrafterConfig& cfg, const void* rows, int64_t R) {
  const uint64_t r = u(cfg.dspark.markov_rank), n = u(std::max<int64_t>(R, 1));
  const auto* f = reinterpret_cast<const float*>(static_cast<const char*>(rows) +
                                                 arena_round(std::max<uint64_t>(n * r, 1) * 4));
  return {f, f + n, f + 2 * n, f + 3 * n, f + 4 * n};
}

#ifdef DFLASH_HAVE_CUDA

namespace {

// Views of the step-long buffers (dspark_head_cuda_rows_bytes' layout).
struct RowBuffers {
  float* demb;
  cuda::launch::DsparkRowOut out;
};
RowBuffers row_buffers(void* rows, const DrafterConfig& cfg, int64_t R, int32_t* argmax) {
  const uint64_t r = u(cfg.dspark.markov_rank), n = u(std::max<int64_t>(R, 1));
  auto* at = static_cast<char*>(rows);
  RowBuffers b{};
  b.demb = reinterpret_cast<float*>(at);
  auto* f = reinterpret_cast<float*>(at + arena_round(std::max<uint64_t>(n * r, 1) * 4));
  b.out.ce = f;
  b.out.l1 = f + n;
  b.out.bce = f + 2 * n;
  b.out.acc = f + 3 * n;
  b.out.conf = f + 4 * n;
  b.out.dconf = f + 5 * n;
  b.out.argmax = argmax;
  return b;
}

// Offsets of the chunk view of the row arrays.
cuda::launch::DsparkRowOut rows_at(const cuda::launch::DsparkRowOut& o, int64_t r0) {
  return {o.ce + r0, o.l1 + r0, o.bce + r0, o.acc + r0, o.conf + r0, o.dconf + r0, o.argmax + r0};
}

}  // namespace

void dspark_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                      const Objective& obj, const DsparkCudaArgs& a) {
  DFLASH_CHECK(cfg.dspark.enabled, "DSpark head step for a drafter without DSpark heads");
  const std::vector<std::string> bad = dspark_cuda_unsupported(cfg);
  DFLASH_CHECK(bad.empty(), "{}", fmt::join(bad, "; "));
  DFLASH_CHECK(obj.dspark(), "DSpark head step with the {} objective",
               objective_kind_name(obj.kind));
  const int64_t R = a.R, H = cfg.hidden_size, V = cfg.vocab_size, r = cfg.dspark.markov_rank;
  DFLASH_CHECK(R >= 0 && a.chunk_rows > 0, "dspark_head_cuda: {} rows in chunks of {}", R,
               a.chunk_rows);
  DFLASH_CHECK(a.params && a.weights_bf16 && a.lm_head && a.hf && a.target_final && a.labels &&
                   a.weights && a.prev && a.teacher_pos && a.w1_order && a.w1_seg && a.argmax &&
                   a.sums && a.workspace && a.rows && (!a.grads || a.dhf),
               "dspark_head_cuda: null pointer");
  DFLASH_CHECK(r == 0 || layout.dspark.markov_w1 >= 0,
               "dspark_head_cuda: the layout has no Markov head for markov_rank {}", r);
  const uint64_t need_ws = dspark_head_cuda_workspace_bytes(cfg, R, a.chunk_rows);
  const uint64_t need_rows = dspark_head_cuda_rows_bytes(cfg, R);
  DFLASH_CHECK(a.workspace_bytes >= need_ws && a.rows_bytes >= need_rows,
               "dspark_head_cuda: workspace of {} bytes and row buffers of {} bytes for {} rows "
               "in chunks of {} (need {} and {})",
               a.workspace_bytes, a.rows_bytes, R, a.chunk_rows, need_ws, need_rows);
  const bool conf = cfg.dspark.confidence_head;
  const int64_t conf_r = conf && cfg.dspark.confidence_with_markov ? r : 0;
  const int64_t C = chunk_of(R, a.chunk_rows);
  cudaStream_t s = ctx.stream();
  // Workspace layout (dspark_head_cuda_workspace_bytes).
  auto* at = static_cast<char*>(a.workspace);
  auto take = [&](uint64_t bytes) {
    char* p = at;
    at += arena_round(bytes);
    return p;
  };
  auto* dl = reinterpret_cast<float*>(take(u(C * V) * 4));
  auto* tl = reinterpret_cast<float*>(take(u(C * V) * 4));
  auto* dd = reinterpret_cast<uint16_t*>(take(u(C * V) * 2));
  auto* teach = reinterpret_cast<uint16_t*>(take(u(C * H) * 2));
  auto* emb = reinterpret_cast<uint16_t*>(take(std::max<uint64_t>(u(C * r), 1) * 2));
  const RowBuffers rb = row_buffers(a.rows, cfg, R, a.argmax);
  const uint16_t* w1 = r > 0 ? a.weights_bf16 + layout.dspark.markov_w1 : nullptr;
  const uint16_t* w2 = r > 0 ? a.weights_bf16 + layout.dspark.markov_w2 : nullptr;
  const float* wc = conf ? a.params + layout.dspark.conf_w : nullptr;
  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t n = std::min(C, R - r0);
    const uint16_t* hf = a.hf + r0 * H;
    // D [n, V] = hf·LMheadᵀ (+ E·W2ᵀ)
    cuda::gemm_bf16(ctx, dl, DType::f32, V, hf, H, false, a.lm_head, H, true, n, V, H);
    if (r > 0) {
      cuda::launch::dspark_gather_rows(emb, w1, a.prev + r0, n, r, r, s);
      cuda::gemm_bf16(ctx, dl, DType::f32, V, emb, r, false, w2, r, true, n, V, r, 1.0f, 1.0f);
    }
    // TL [n, V] = Hl[a+k]·LMheadᵀ
    cuda::launch::dspark_gather_rows(teach, a.target_final, a.teacher_pos + r0, n, H, H, s);
    cuda::gemm_bf16(ctx, tl, DType::f32, V, teach, H, false, a.lm_head, H, true, n, V, H);
    cuda::launch::DsparkRowIn in;
    in.d = dl;
    in.t = tl;
    in.hf = hf;
    in.emb = emb;
    in.conf_w = wc;
    in.conf_b = conf ? a.params + layout.dspark.conf_b : nullptr;
    in.labels = a.labels + r0;
    in.weights = a.weights + r0;
    in.n = n;
    in.V = V;
    in.H = H;
    in.r = r;
    in.conf_r = conf_r;
    in.a_ce = static_cast<float>(obj.dspark_ce_alpha);
    in.a_l1 = static_cast<float>(obj.dspark_l1_alpha);
    in.a_conf = conf ? static_cast<float>(obj.dspark_conf_alpha) : 0.0f;
    in.grad_scale = static_cast<float>(a.grad_scale);
    cuda::launch::dspark_rows(in, rows_at(rb.out, r0), a.grads ? dd : nullptr, s);
    if (!a.grads) continue;
    float* dhf = a.dhf + r0 * H;
    float* demb = rb.demb + r0 * r;
    // dhf [n, H] = dD·LMhead; dE [n, r] = dD·W2; dW2 [V, r] += dDᵀ·E
    cuda::gemm_bf16(ctx, dhf, DType::f32, H, dd, V, false, a.lm_head, H, false, n, H, V);
    if (r > 0) {
      cuda::gemm_bf16(ctx, demb, DType::f32, r, dd, V, false, w2, r, false, n, r, V);
      cuda::gemm_bf16(ctx, a.grads + layout.dspark.markov_w2, DType::f32, r, dd, V, true, emb, r,
                      false, V, r, n, 1.0f, 1.0f);
    }
    if (conf) {
      cuda::launch::dspark_conf_bwd(dhf, demb, a.grads + layout.dspark.conf_w,
                                    a.grads + layout.dspark.conf_b, rb.out.dconf + r0, hf, emb, wc,
                                    n, H, r, conf_r, s);
    }
  }
  if (a.grads && r > 0) {
    cuda::launch::dspark_w1_scatter(a.grads + layout.dspark.markov_w1, rb.demb, a.prev, a.w1_order,
                                    a.w1_seg, R, r, s);
  }
  cuda::launch::dspark_sums(a.sums, rb.out, a.weights, R, obj.dspark_ce_alpha, obj.dspark_l1_alpha,
                            conf ? obj.dspark_conf_alpha : 0.0, s);
}

#endif  // DFLASH_HAVE_CUDA

}  // namespace dflash
