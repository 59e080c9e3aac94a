// dflash.cpp — the Domino head on the CUDA backend (see domino_head_cuda.hpp). The row index and
// the sizes are host code (built and tested without a GPU); the step runs cuBLASLt GEMMs
// (ops/gemm.hpp) and the kernels of backend/cuda/domino_head.cu on the context's stream.
#include "model/domino_head_cuda.hpp"

#include <algorithm>

#include "core/error.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/domino_head_launch.hpp"
#include "ops/gemm.hpp"
#endif

namespace dflash {

namespace {
uint64_t u(int64_t v) {
  return static_cast<uint64_t>(v);
}
}  // namespace

DominoRowIndex domino_row_index(const DrafterConfig& cfg, const DrafterBatch& b, int64_t rows) {
  DFLASH_CHECK(cfg.domino.enabled, "Domino row index for a drafter without the Domino head");
  DFLASH_CHECK(b.objective.domino() && b.objective.domino_shift_label == cfg.domino.shift_label,
               "Domino row index of a batch of the {} objective (shift_label {}) for a drafter "
               "with shift_label {}",
               objective_kind_name(b.objective.kind), b.objective.domino_shift_label,
               cfg.domino.shift_label);
  const int64_t K = b.block_size, NK = b.N() * K, V = cfg.vocab_size;
  DFLASH_CHECK(K == cfg.block_size, "Domino row index: a batch of block size {} for block_size {}",
               K, cfg.block_size);
  DFLASH_CHECK(rows >= NK && rows % K == 0,
               "Domino row index: {} rows for a batch of {} block rows (must be whole blocks of "
               "{})",
               rows, NK, K);
  const double lambda = b.objective.domino_lambda;
  DFLASH_CHECK(lambda >= 0 && lambda <= 1, "Domino row index: lambda {} outside [0, 1]", lambda);
  const int64_t off = cfg.domino.shift_label ? 0 : 1, steps = cfg.domino.gru_steps(cfg.block_size);
  DominoRowIndex x;
  x.lambda = lambda;
  x.gru_tok.assign(u(rows), -1);
  for (int64_t row = 0; row < NK; ++row) {
    const Anchor& a = b.anchors[u(row / K)];
    const int64_t j = row % K - off;
    if (j >= 0 && j < steps) {
      const int64_t pos = a.pos + j;
      const int32_t tok = pos < b.doc_offsets[u(a.doc) + 1] ? b.tokens[u(pos)] : 0;
      DFLASH_CHECK(tok >= 0 && tok < V,
                   "Domino block row {}: token {} at position {} outside "
                   "[0, {})",
                   row, tok, pos, V);
      x.gru_tok[u(row)] = tok;
    }
    if (b.targets.weights[u(row)] == 0.0f) continue;
    const int32_t y = b.targets.labels[u(row)];
    DFLASH_CHECK(y >= 0 && y < V, "Domino block row {}: label {} outside [0, {})", row, y, V);
  }
  return x;
}

int64_t domino_chunk_rows(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows) {
  const int64_t K = cfg.block_size;
  const int64_t blocks = std::max<int64_t>(1, chunk_rows / K);
  return std::min(blocks * K, std::max(R, K));
}

uint64_t domino_head_cuda_workspace_bytes(const DrafterConfig& cfg, int64_t R, int64_t chunk_rows) {
  const uint64_t C = u(domino_chunk_rows(cfg, R, chunk_rows)), nb = C / u(cfg.block_size);
  const uint64_t V = u(cfg.vocab_size), H = u(cfg.hidden_size);
  const uint64_t G = u(cfg.domino.gru_hidden_dim), E = u(cfg.domino.emb_dim);
  return 2 * arena_round(C * V * 4) + 2 * arena_round(C * V * 2)    // U, F; dU, dF
         + arena_round(C * H * 2) + arena_round(C * 3 * G * 4)      // GRU inputs, XI
         + arena_round(nb * 3 * G * 4)                              // HH
         + arena_round(C * G * 4) + arena_round(C * G * 2)          // g f32, bf16
         + arena_round(C * 4 * G * 4)                               // gates
         + 2 * arena_round(C * E * 4) + 2 * arena_round(C * E * 2)  // A, dZ; Z, dA
         + arena_round(C * G * 4)                                   // dg
         + 2 * arena_round(C * 3 * G * 2)                           // dXI, dHH
         + 2 * arena_round(nb * G * 4);                             // carry, dprev
}

uint64_t domino_head_cuda_rows_bytes(int64_t R) {
  return 2 * arena_round(u(std::max<int64_t>(R, 1)) * 4);
}

DominoRowsView domino_rows_view(const void* rows, int64_t R) {
  const auto* at = static_cast<const char*>(rows);
  const uint64_t one = arena_round(u(std::max<int64_t>(R, 1)) * 4);
  return {reinterpret_cast<const float*>(at), reinterpret_cast<const float*>(at + one)};
}

#ifdef DFLASH_HAVE_CUDA

namespace {

// The chunk workspace (domino_head_cuda_workspace_bytes' order).
struct Chunk {
  float *u, *f;
  uint16_t *du, *df, *xe;
  float *xi, *hh, *g;
  uint16_t* gb;
  float *gates, *a, *dz;
  uint16_t *z, *da;
  float* dg;
  uint16_t *dxi, *dhh;
  float *carry, *dprev;
};

Chunk chunk_buffers(void* ws, const DrafterConfig& cfg, int64_t C) {
  const uint64_t nb = u(C / cfg.block_size), V = u(cfg.vocab_size), H = u(cfg.hidden_size);
  const uint64_t G = u(cfg.domino.gru_hidden_dim), E = u(cfg.domino.emb_dim), c = u(C);
  auto* at = static_cast<char*>(ws);
  auto take = [&](uint64_t bytes) {
    char* p = at;
    at += arena_round(bytes);
    return p;
  };
  Chunk k{};
  k.u = reinterpret_cast<float*>(take(c * V * 4));
  k.f = reinterpret_cast<float*>(take(c * V * 4));
  k.du = reinterpret_cast<uint16_t*>(take(c * V * 2));
  k.df = reinterpret_cast<uint16_t*>(take(c * V * 2));
  k.xe = reinterpret_cast<uint16_t*>(take(c * H * 2));
  k.xi = reinterpret_cast<float*>(take(c * 3 * G * 4));
  k.hh = reinterpret_cast<float*>(take(nb * 3 * G * 4));
  k.g = reinterpret_cast<float*>(take(c * G * 4));
  k.gb = reinterpret_cast<uint16_t*>(take(c * G * 2));
  k.gates = reinterpret_cast<float*>(take(c * 4 * G * 4));
  k.a = reinterpret_cast<float*>(take(c * E * 4));
  k.dz = reinterpret_cast<float*>(take(c * E * 4));
  k.z = reinterpret_cast<uint16_t*>(take(c * E * 2));
  k.da = reinterpret_cast<uint16_t*>(take(c * E * 2));
  k.dg = reinterpret_cast<float*>(take(c * G * 4));
  k.dxi = reinterpret_cast<uint16_t*>(take(c * 3 * G * 2));
  k.dhh = reinterpret_cast<uint16_t*>(take(c * 3 * G * 2));
  k.carry = reinterpret_cast<float*>(take(nb * G * 4));
  k.dprev = reinterpret_cast<float*>(take(nb * G * 4));
  return k;
}

// The head's weights (bf16 copies) and their gradients.
struct HeadWeights {
  const uint16_t *w_ih, *w_hh, *w1, *w2;
  float *g_ih, *g_hh, *g1, *g2;
};

// Forward of one chunk of n rows at r0: U, the GRU, A, Z, F.
void chunk_forward(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DominoCudaArgs& a,
                   const HeadWeights& w, const Chunk& k, int64_t r0, int64_t n) {
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, K = cfg.block_size;
  const int64_t G = cfg.domino.gru_hidden_dim, E = cfg.domino.emb_dim, HG = H + G;
  const cuda::launch::DominoGruDims d{n / K, K, G, cfg.domino.shift_label ? 0 : 1};
  const int64_t steps = cfg.domino.gru_steps(cfg.block_size);
  cudaStream_t s = ctx.stream();
  const uint16_t* hf = a.hf + r0 * H;
  // U [n, V] = hf·LMheadᵀ
  gemm_bf16_cuda(ctx, k.u, DType::f32, V, hf, H, false, a.lm_head, H, true, n, V, H);
  // XI [n, 3G] = E·W_ihᵀ over the rows that hold a GRU input (zero rows elsewhere).
  cuda::launch::domino_gather_rows(k.xe, a.embed, a.gru_tok + r0, n, H, s);
  gemm_bf16_cuda(ctx, k.xi, DType::f32, 3 * G, k.xe, H, false, w.w_ih, H, true, n, 3 * G, H);
  // The recurrence: rows without a state stay 0 (they feed the GEMMs below).
  DFLASH_CUDA_CHECK(cudaMemsetAsync(k.g, 0, u(n * G) * 4, s));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(k.gb, 0, u(n * G) * 2, s));
  for (int64_t j = 0; j < steps; ++j) {
    if (j > 0) {  // HH [nb, 3G] = g_{j−1}·W_hhᵀ, block b's g_{j−1} at row b·K + j − 1 + off
      gemm_bf16_cuda(ctx, k.hh, DType::f32, 3 * G, k.gb + (j - 1 + d.off) * G, K * G, false, w.w_hh,
                     G, true, d.nb, 3 * G, G);
    }
    cuda::launch::domino_gru_fwd_step(k.g, k.gb, k.gates, k.xi, j > 0 ? k.hh : nullptr, d, j, s);
  }
  // A [n, E] = hf·W1[:, :H]ᵀ + g·W1[:, H:]ᵀ; Z = SiLU(A) on corrected slots; F = U + Z·W2ᵀ.
  gemm_bf16_cuda(ctx, k.a, DType::f32, E, hf, H, false, w.w1, HG, true, n, E, H);
  gemm_bf16_cuda(ctx, k.a, DType::f32, E, k.gb, G, false, w.w1 + H, HG, true, n, E, G, 1.0f, 1.0f);
  cuda::launch::domino_silu_rows(k.z, k.a, n, E, K, cfg.domino.suffix_start(), s);
  gemm_bf16_cuda(ctx, k.f, DType::f32, V, k.z, E, false, w.w2, E, true, n, V, E, 1.0f, 1.0f, k.u);
}

// Backward of one chunk from dU and dF: dhf, the head's and the GRU's weight gradients.
void chunk_backward(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DominoCudaArgs& a,
                    const HeadWeights& w, const Chunk& k, int64_t r0, int64_t n) {
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, K = cfg.block_size;
  const int64_t G = cfg.domino.gru_hidden_dim, E = cfg.domino.emb_dim, HG = H + G;
  const cuda::launch::DominoGruDims d{n / K, K, G, cfg.domino.shift_label ? 0 : 1};
  const int64_t steps = cfg.domino.gru_steps(cfg.block_size);
  cudaStream_t s = ctx.stream();
  const uint16_t* hf = a.hf + r0 * H;
  float* dhf = a.dhf + r0 * H;
  // dhf [n, H] = dU·LMhead; dZ [n, E] = dF·W2; dW2 [V, E] += dFᵀ·Z
  gemm_bf16_cuda(ctx, dhf, DType::f32, H, k.du, V, false, a.lm_head, H, false, n, H, V);
  gemm_bf16_cuda(ctx, k.dz, DType::f32, E, k.df, V, false, w.w2, E, false, n, E, V);
  gemm_bf16_cuda(ctx, w.g2, DType::f32, E, k.df, V, true, k.z, E, false, V, E, n, 1.0f, 1.0f);
  // dA = dZ ⊙ SiLU′(A); dhf += dA·W1[:, :H]; dg [n, G] = dA·W1[:, H:]; dW1 += dAᵀ·[hf | g]
  cuda::launch::domino_silu_bwd(k.da, k.dz, k.a, n, E, s);
  gemm_bf16_cuda(ctx, dhf, DType::f32, H, k.da, E, false, w.w1, HG, false, n, H, E, 1.0f, 1.0f);
  gemm_bf16_cuda(ctx, k.dg, DType::f32, G, k.da, E, false, w.w1 + H, HG, false, n, G, E);
  gemm_bf16_cuda(ctx, w.g1, DType::f32, HG, k.da, E, true, hf, H, false, E, H, n, 1.0f, 1.0f);
  gemm_bf16_cuda(ctx, w.g1 + H, DType::f32, HG, k.da, E, true, k.gb, G, false, E, G, n, 1.0f, 1.0f);
  // The GRU backward through time; rows without a step keep dXI = dHH = 0.
  DFLASH_CUDA_CHECK(cudaMemsetAsync(k.dxi, 0, u(n * 3 * G) * 2, s));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(k.dhh, 0, u(n * 3 * G) * 2, s));
  for (int64_t j = steps - 1; j >= 0; --j) {
    const bool later = j < steps - 1;
    cuda::launch::domino_gru_bwd_step(k.dxi, k.dhh, k.carry, later ? k.dprev : nullptr, k.dg, k.g,
                                      k.gates, d, j, s);
    if (j > 0) {  // dprev [nb, G] = dhh_j·W_hh, block b's dhh_j at row b·K + j + off
      gemm_bf16_cuda(ctx, k.dprev, DType::f32, G, k.dhh + (j + d.off) * 3 * G, K * 3 * G, false,
                     w.w_hh, G, false, d.nb, G, 3 * G);
    }
  }
  // dW_ih [3G, H] += dXIᵀ·E; dW_hh [3G, G] += Σ_j dhh_jᵀ·g_{j−1}: rows r of dHH with rows r − 1
  // of g (dhh is 0 where j = 0 and on rows without a step).
  gemm_bf16_cuda(ctx, w.g_ih, DType::f32, H, k.dxi, 3 * G, true, k.xe, H, false, 3 * G, H, n, 1.0f,
                 1.0f);
  if (n > 1) {
    gemm_bf16_cuda(ctx, w.g_hh, DType::f32, G, k.dhh + 3 * G, 3 * G, true, k.gb, G, false, 3 * G, G,
                   n - 1, 1.0f, 1.0f);
  }
}

}  // namespace

void domino_head_cuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
                      const Objective& obj, const DominoCudaArgs& a) {
  DFLASH_CHECK(cfg.domino.enabled && layout.domino.proj2 >= 0,
               "Domino head step for a drafter without the Domino head");
  DFLASH_CHECK(obj.domino() && obj.domino_shift_label == cfg.domino.shift_label,
               "Domino head step with the {} objective (shift_label {}) for a drafter with "
               "shift_label {}",
               objective_kind_name(obj.kind), obj.domino_shift_label, cfg.domino.shift_label);
  const int64_t R = a.R, K = cfg.block_size;
  DFLASH_CHECK(R >= 0 && R % K == 0 && a.chunk_rows > 0,
               "domino_head_cuda: {} rows (whole blocks of {}) in chunks of {}", R, K,
               a.chunk_rows);
  DFLASH_CHECK(a.weights_bf16 && a.embed && a.lm_head && a.hf && a.labels && a.weights &&
                   a.gru_tok && a.lambda && a.argmax && a.sums && a.workspace && a.rows &&
                   (!a.grads || a.dhf),
               "domino_head_cuda: null pointer");
  const uint64_t need_ws = domino_head_cuda_workspace_bytes(cfg, R, a.chunk_rows);
  const uint64_t need_rows = domino_head_cuda_rows_bytes(R);
  DFLASH_CHECK(a.workspace_bytes >= need_ws && a.rows_bytes >= need_rows,
               "domino_head_cuda: workspace of {} bytes and row buffers of {} bytes for {} rows "
               "in chunks of {} (need {} and {})",
               a.workspace_bytes, a.rows_bytes, R, a.chunk_rows, need_ws, need_rows);
  const int64_t C = domino_chunk_rows(cfg, R, a.chunk_rows);
  const Chunk k = chunk_buffers(a.workspace, cfg, C);
  const DominoOffsets& o = layout.domino;
  float* g = a.grads;
  const HeadWeights w{a.weights_bf16 + o.gru_ih,  a.weights_bf16 + o.gru_hh,
                      a.weights_bf16 + o.proj1,   a.weights_bf16 + o.proj2,
                      g ? g + o.gru_ih : nullptr, g ? g + o.gru_hh : nullptr,
                      g ? g + o.proj1 : nullptr,  g ? g + o.proj2 : nullptr};
  auto* ce_f = static_cast<float*>(a.rows);
  auto* ce_u = reinterpret_cast<float*>(static_cast<char*>(a.rows) +
                                        arena_round(u(std::max<int64_t>(R, 1)) * 4));
  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t n = std::min(C, R - r0);
    chunk_forward(ctx, cfg, a, w, k, r0, n);
    cuda::launch::DominoRowIn in;
    in.u = k.u;
    in.f = k.f;
    in.labels = a.labels + r0;
    in.weights = a.weights + r0;
    in.n = n;
    in.V = cfg.vocab_size;
    in.K = K;
    in.s0 = cfg.domino.suffix_start();
    in.lambda = a.lambda;
    in.grad_scale = static_cast<float>(a.grad_scale);
    const cuda::launch::DominoRowOut out{ce_f + r0, ce_u + r0, a.argmax + r0};
    cuda::launch::domino_rows(in, out, g ? k.du : nullptr, g ? k.df : nullptr, ctx.stream());
    if (g) chunk_backward(ctx, cfg, a, w, k, r0, n);
  }
  cuda::launch::domino_sums(a.sums, ce_f, ce_u, a.weights, R, a.lambda, ctx.stream());
}

#endif  // DFLASH_HAVE_CUDA

}  // namespace dflash
