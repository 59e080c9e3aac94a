// dflash.cpp — the DSpark head on the CUDA backend (see dspark_head_cuda.hpp). The row index is
// host code (built and tested without a GPU); the step runs cuBLASLt GEMMs (ops/gemm.hpp)
// and the row kernels of backend/cuda/dspark_head.cu on the context's stream.
#include "model/dspark_head_cuda.hpp"

#include <algorithm>
#include <numeric>

#include "core/error.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/context.hpp"
#include "backend/cuda/dspark_head_launch.hpp"
#include "ops/gemm.hpp"
#endif

namespace dflash {

namespace {
uint64_t u(int64_t v) {
  return static_cast<uint64_t>(v);
}
bool has_latent(const DrafterConfig& cfg) {
  return cfg.dspark.markov_rank > 0 && cfg.dspark.markov_type != MarkovHeadType::vanilla;
}
// Rows per chunk: at most chunk_rows and R; whole blocks of K slots for the rnn head (its state
// runs through a block's slots), at least one block.
int64_t chunk_of(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows) {
  const int64_t C = std::min(chunk_rows, std::max<int64_t>(R, 1));
  if (cfg.dspark.markov_rank == 0 || cfg.dspark.markov_type != MarkovHeadType::rnn) return C;
  const int64_t K = cfg.block_size;
  return std::max(K, C / K * K);
}
constexpr int kRowArrays = 6;  // ce, l1, bce, acc, conf, dconf

// Byte offsets of the chunk workspace's buffers (C rows), each rounded to kArenaAlign:
//   d, t      D and TL f32 [C, V]; dD bf16 [C, V] is written over TL in place (leading dimension
//             2V: row i in the first half of TL's row i; dspark_rows);  teach  Hl rows bf16 [C, H]
//   emb       E = W1[p] bf16 [C, r]
// and for the gated and rnn heads (X = H + r columns of the gated input [h ; e], 2r + H of the
// rnn input [s ; e ; h]; A = r gate pre-activations or 3r rnn pre-activations u):
//   z2   the latent z as bf16 hi | lo [C, 2r] (dspark_head_launch.hpp);  x  the input bf16 [C, X]
//   act  f32 [C, A];  dz  ∂z f32 [C, r];  dact, dact_bf16  ∂act f32 and bf16 [C, A]
//   dx   ∂x f32 [C, X];  sprev  s_{k−1} f32 [C, r] (rnn);  w2x2  [W2 | W2] bf16 [V, 2r] (the
//        bias GEMM's weight for z2, copied from W2's bf16 copy at the step's start)
struct ChunkLayout {
  uint64_t d = 0, t = 0, teach = 0, emb = 0;
  uint64_t z2 = 0, x = 0, act = 0, dz = 0, dact = 0, dact_bf16 = 0, dx = 0, sprev = 0, w2x2 = 0;
  int64_t X = 0, A = 0;
  uint64_t total = 0;
};
ChunkLayout chunk_layout(const DrafterConfig& cfg, int64_t C) {
  const uint64_t V = u(cfg.vocab_size), H = u(cfg.hidden_size), r = u(cfg.dspark.markov_rank);
  const uint64_t n = u(C);
  ChunkLayout l;
  auto take = [&](uint64_t bytes) {
    const uint64_t at = l.total;
    l.total += arena_round(bytes);
    return at;
  };
  l.d = take(n * V * 4);
  l.t = take(n * V * 4);
  l.teach = take(n * H * 2);
  l.emb = take(std::max<uint64_t>(n * r, 1) * 2);
  if (!has_latent(cfg)) return l;
  const bool gated = cfg.dspark.markov_type == MarkovHeadType::gated;
  l.X = static_cast<int64_t>(gated ? H + r : 2 * r + H);
  l.A = static_cast<int64_t>(gated ? r : 3 * r);
  l.z2 = take(n * 2 * r * 2);
  l.x = take(n * u(l.X) * 2);
  l.act = take(n * u(l.A) * 4);
  l.dz = take(n * r * 4);
  l.dact = take(n * u(l.A) * 4);
  l.dact_bf16 = take(n * u(l.A) * 2);
  l.dx = take(n * u(l.X) * 4);
  if (!gated) l.sprev = take(n * r * 4);
  l.w2x2 = take(V * 2 * r * 2);
  return l;
}
}  // namespace

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
  return chunk_layout(cfg, chunk_of(cfg, R, chunk_rows)).total;
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

// Device views of one chunk's workspace (ChunkLayout).
struct ChunkBufs {
  float *d = nullptr, *t = nullptr;
  uint16_t *dd = nullptr, *teach = nullptr, *emb = nullptr;
  uint16_t *z2 = nullptr, *w2x2 = nullptr;
  uint16_t* x = nullptr;
  float *act = nullptr, *dz = nullptr, *dact = nullptr;
  uint16_t* dact_bf16 = nullptr;
  float *dx = nullptr, *sprev = nullptr;
  int64_t X = 0;
};
ChunkBufs chunk_bufs(void* workspace, const ChunkLayout& l) {
  auto* at = static_cast<char*>(workspace);
  auto f32 = [&](uint64_t off) { return reinterpret_cast<float*>(at + off); };
  auto b16 = [&](uint64_t off) { return reinterpret_cast<uint16_t*>(at + off); };
  ChunkBufs b;
  b.d = f32(l.d);
  b.t = f32(l.t);
  b.dd = b16(l.t);  // over TL, leading dimension 2V
  b.teach = b16(l.teach);
  b.emb = b16(l.emb);
  if (l.X == 0) return b;
  b.z2 = b16(l.z2);
  b.w2x2 = b16(l.w2x2);
  b.x = b16(l.x);
  b.act = f32(l.act);
  b.dz = f32(l.dz);
  b.dact = f32(l.dact);
  b.dact_bf16 = b16(l.dact_bf16);
  b.dx = f32(l.dx);
  b.sprev = l.sprev ? f32(l.sprev) : nullptr;
  b.X = l.X;
  return b;
}

// The latent z of a gated or rnn head over n rows (b.emb gathered): into b.z, keeping the input
// b.x and the pre-activations b.act (and the rnn's s_{k−1}) for the backward.
void latent_fwd(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                const DsparkCudaArgs& a, const ChunkBufs& b, const uint16_t* hf, int64_t n) {
  namespace L = cuda::launch;
  const int64_t H = cfg.hidden_size, r = cfg.dspark.markov_rank, X = b.X;
  cudaStream_t s = ctx.stream();
  if (cfg.dspark.markov_type == MarkovHeadType::gated) {  // x = [hf ; E]
    const uint16_t* wg = a.weights_bf16 + layout.dspark.gate_w;
    L::dspark_copy_cols(b.x, X, hf, H, n, H, s);
    L::dspark_copy_cols(b.x + H, X, b.emb, r, n, r, s);
    gemm_bf16_cuda(ctx, b.act, DType::f32, r, b.x, X, false, wg, X, true, n, r, X);
    L::dspark_gated_fwd(b.act, a.params + layout.dspark.gate_b, b.emb, b.z2, n, r, s);
    return;
  }
  // rnn: x = [s_{k−1} ; E ; hf], the s columns 0 for the GEMM and filled by the recurrence.
  const uint16_t* jw = a.weights_bf16 + layout.dspark.joint_w;
  L::dspark_copy_cols(b.x, X, nullptr, 0, n, r, s);
  L::dspark_copy_cols(b.x + r, X, b.emb, r, n, r, s);
  L::dspark_copy_cols(b.x + 2 * r, X, hf, H, n, H, s);
  gemm_bf16_cuda(ctx, b.act, DType::f32, 3 * r, b.x, X, false, jw, X, true, n, 3 * r, X);
  L::dspark_rnn_fwd(b.act, a.params + layout.dspark.joint_b, jw, X, b.sprev, b.x, b.z2, n,
                    cfg.block_size, r, s);
}

// The backward of a gated or rnn head over n rows from dD (bf16, leading dimension ldd): dW2 and
// the head's parameters +=, dhf += its part, demb = its part (the confidence head adds after).
void latent_bwd(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                const DsparkCudaArgs& a, const ChunkBufs& b, const uint16_t* dd, int64_t ldd,
                float* dhf, float* demb, int64_t n) {
  namespace L = cuda::launch;
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, r = cfg.dspark.markov_rank, X = b.X;
  const DsparkOffsets& o = layout.dspark;
  cudaStream_t s = ctx.stream();
  const uint16_t* w2 = a.weights_bf16 + o.markov_w2;
  // dz [n, r] = dD·W2; dW2 [V, r] += dDᵀ·z
  gemm_bf16_cuda(ctx, b.dz, DType::f32, r, dd, ldd, false, w2, r, false, n, r, V);
  gemm_bf16_cuda(ctx, a.grads + o.markov_w2, DType::f32, r, dd, ldd, true, b.z2, 2 * r, false, V, r,
                 n, 1.0f, 1.0f);
  const bool gated = cfg.dspark.markov_type == MarkovHeadType::gated;
  const int64_t A = gated ? r : 3 * r;  // pre-activation columns
  const uint16_t* w = a.weights_bf16 + (gated ? o.gate_w : o.joint_w);
  if (gated) {
    L::dspark_gated_bwd(b.dz, b.act, b.emb, demb, b.dact, b.dact_bf16, n, r, s);
  } else {
    L::dspark_rnn_bwd(b.dz, b.act, b.sprev, w, X, b.dact, b.dact_bf16, n, cfg.block_size, r, s);
  }
  // dx [n, X] = dact·W; dW [A, X] += dactᵀ·x; db [A] += Σ_rows dact
  gemm_bf16_cuda(ctx, b.dx, DType::f32, X, b.dact_bf16, A, false, w, X, false, n, X, A);
  gemm_bf16_cuda(ctx, a.grads + (gated ? o.gate_w : o.joint_w), DType::f32, X, b.dact_bf16, A, true,
                 b.x, X, false, A, X, n, 1.0f, 1.0f);
  L::dspark_col_sum(a.grads + (gated ? o.gate_b : o.joint_b), b.dact, n, A, s);
  if (gated) {  // x = [hf ; E]; demb already holds dz⊙σ(pre)
    L::dspark_markov_dx(dhf, demb, b.dx, X, 0, H, n, H, r, true, s);
  } else {  // x = [s ; E ; hf]
    L::dspark_markov_dx(dhf, demb, b.dx, X, 2 * r, r, n, H, r, false, s);
  }
}

}  // namespace

void dspark_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                      const Objective& obj, const DsparkCudaArgs& a) {
  DFLASH_CHECK(cfg.dspark.enabled, "DSpark head step for a drafter without DSpark heads");
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
  const bool latent = has_latent(cfg);
  DFLASH_CHECK(!latent || cfg.dspark.markov_type != MarkovHeadType::rnn || R % cfg.block_size == 0,
               "dspark_head_cuda: the rnn Markov head runs whole blocks, got {} rows for "
               "block_size {}",
               R, cfg.block_size);
  const uint64_t need_ws = dspark_head_cuda_workspace_bytes(cfg, R, a.chunk_rows);
  const uint64_t need_rows = dspark_head_cuda_rows_bytes(cfg, R);
  DFLASH_CHECK(a.workspace_bytes >= need_ws && a.rows_bytes >= need_rows,
               "dspark_head_cuda: workspace of {} bytes and row buffers of {} bytes for {} rows "
               "in chunks of {} (need {} and {})",
               a.workspace_bytes, a.rows_bytes, R, a.chunk_rows, need_ws, need_rows);
  const bool conf = cfg.dspark.confidence_head;
  const int64_t conf_r = conf && cfg.dspark.confidence_with_markov ? r : 0;
  const int64_t C = chunk_of(cfg, R, a.chunk_rows);
  cudaStream_t s = ctx.stream();
  const ChunkBufs b = chunk_bufs(a.workspace, chunk_layout(cfg, C));
  const RowBuffers rb = row_buffers(a.rows, cfg, R, a.argmax);
  const uint16_t* w1 = r > 0 ? a.weights_bf16 + layout.dspark.markov_w1 : nullptr;
  const uint16_t* w2 = r > 0 ? a.weights_bf16 + layout.dspark.markov_w2 : nullptr;
  const float* wc = conf ? a.params + layout.dspark.conf_w : nullptr;
  if (latent) {  // [W2 | W2], the weight of the bias GEMM over z2 = [z_hi | z_lo]
    cuda::launch::dspark_copy_cols(b.w2x2, 2 * r, w2, r, V, r, s);
    cuda::launch::dspark_copy_cols(b.w2x2 + r, 2 * r, w2, r, V, r, s);
  }
  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t n = std::min(C, R - r0);
    const uint16_t* hf = a.hf + r0 * H;
    // D [n, V] = hf·LMheadᵀ (+ z·W2ᵀ)
    gemm_bf16_cuda(ctx, b.d, DType::f32, V, hf, H, false, a.lm_head, H, true, n, V, H);
    if (r > 0) {
      cuda::launch::dspark_gather_rows(b.emb, w1, a.prev + r0, n, r, r, s);
      if (latent) {
        latent_fwd(ctx, cfg, layout, a, b, hf, n);
        gemm_bf16_cuda(ctx, b.d, DType::f32, V, b.z2, 2 * r, false, b.w2x2, 2 * r, true, n, V,
                       2 * r, 1.0f, 1.0f);
      } else {
        gemm_bf16_cuda(ctx, b.d, DType::f32, V, b.emb, r, false, w2, r, true, n, V, r, 1.0f, 1.0f);
      }
    }
    // TL [n, V] = Hl[a+k]·LMheadᵀ
    cuda::launch::dspark_gather_rows(b.teach, a.target_final, a.teacher_pos + r0, n, H, H, s);
    gemm_bf16_cuda(ctx, b.t, DType::f32, V, b.teach, H, false, a.lm_head, H, true, n, V, H);
    cuda::launch::DsparkRowIn in;
    in.d = b.d;
    in.t = b.t;
    in.hf = hf;
    in.emb = b.emb;
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
    cuda::launch::dspark_rows(in, rows_at(rb.out, r0), a.grads ? b.dd : nullptr, 2 * V, s);
    if (!a.grads) continue;
    float* dhf = a.dhf + r0 * H;
    float* demb = rb.demb + r0 * r;
    // dhf [n, H] = dD·LMhead, then the Markov head's parts
    const int64_t ldd = 2 * V;
    gemm_bf16_cuda(ctx, dhf, DType::f32, H, b.dd, ldd, false, a.lm_head, H, false, n, H, V);
    if (latent) {
      latent_bwd(ctx, cfg, layout, a, b, b.dd, ldd, dhf, demb, n);
    } else if (r > 0) {  // vanilla: dE [n, r] = dD·W2; dW2 [V, r] += dDᵀ·E
      gemm_bf16_cuda(ctx, demb, DType::f32, r, b.dd, ldd, false, w2, r, false, n, r, V);
      gemm_bf16_cuda(ctx, a.grads + layout.dspark.markov_w2, DType::f32, r, b.dd, ldd, true, b.emb,
                     r, false, V, r, n, 1.0f, 1.0f);
    }
    if (conf) {
      cuda::launch::dspark_conf_bwd(dhf, demb, a.grads + layout.dspark.conf_w,
                                    a.grads + layout.dspark.conf_b, rb.out.dconf + r0, hf, b.emb,
                                    wc, n, H, r, conf_r, s);
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
