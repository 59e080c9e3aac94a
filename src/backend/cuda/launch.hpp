// dflash.cpp — raw-pointer launchers of the CUDA kernels, one section per op family: the kernels
// and launchers of family F live in backend/cuda/F.cu, its checked entry points (declared in
// src/ops/F.hpp) in backend/cuda/F_cuda.cpp. Internal to the backend: model code calls the checked
// entry points instead.
// Each launcher enqueues on `stream` and checks the launch (throws dflash::Error via
// backend/cuda/check.hpp). Float arrays are f32 or bf16 (raw uint16_t bits) as tagged by a DType;
// statistics (rstd, lse, Δ, losses) are always f32. No fmt in this header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.hpp"
#include "ops/adamw.hpp"
#include "ops/attention.hpp"
#include "ops/loss_weights.hpp"

namespace dflash::cuda {

/// Ranks of one in-process device all-reduce at most (train/collective_cuda.cpp).
inline constexpr int kMaxLocalRanks = 16;
/// The device arrays of the ranks of one in-process all-reduce, passed by value to the kernel.
struct RankBuffers {
  float* p[kMaxLocalRanks] = {};
  int n = 0;
};

}  // namespace dflash::cuda

namespace dflash::cuda::launch {

// ---- collective.cu
/// For i in [begin, end): s = p[0][i] + p[1][i] + … in rank order (f32, no contraction), then
/// p[r][i] = s for every rank. Every array must be readable and writable from `s`'s device.
void sum_ranks(const RankBuffers& bufs, int64_t begin, int64_t end, cudaStream_t s);

// ---- embedding.cu
void embedding_fwd(void* y, DType yt, const void* table, DType wt, const int32_t* ids, int64_t T,
                   int64_t V, int64_t H, cudaStream_t s);

// ---- rmsnorm.cu
void rmsnorm_fwd(void* y, DType yt, float* rstd, const void* x, DType xt, const float* w,
                 int64_t R, int64_t D, float eps, cudaStream_t s);
/// rstd_ws [R] and part_ws [rmsnorm_dw_chunks(R)·D] are scratch (part_ws only when dw).
void rmsnorm_bwd(void* dx, const void* dy, DType gt, float* dw, const void* x, DType xt,
                 const float* w, int64_t R, int64_t D, float eps, float* rstd_ws, float* part_ws,
                 cudaStream_t s);
int64_t rmsnorm_dw_chunks(int64_t R);
/// The backward fused with the residual gradient (ops/rmsnorm.hpp, rmsnorm_bwd_res_cuda); scratch
/// as rmsnorm_bwd.
void rmsnorm_bwd_res(float* dres, uint16_t* dres_bf, bool accumulate, float* dw, const float* dy,
                     const float* x, const float* w, int64_t R, int64_t D, float eps,
                     float* rstd_ws, float* part_ws, cudaStream_t s);

// ---- rope.cu
void rope(void* y, const void* x, DType t, const int32_t* pos, const float* inv_freq,
          float scaling, float sign, int64_t T, int64_t NH, int64_t D, cudaStream_t s);
/// y = rope(rmsnorm(x)) per head row (ops/rope.hpp, rmsnorm_rope_fwd_cuda); y may alias x.
void rmsnorm_rope_fwd(void* y, DType yt, const void* x, DType xt, const float* w,
                      const int32_t* pos, const float* inv_freq, float scaling, int64_t T,
                      int64_t NH, int64_t D, float eps, cudaStream_t s);

// ---- swiglu.cu
void swiglu_fwd(void* y, const void* gate, const void* up, DType t, int64_t T, int64_t I,
                int64_t ld_in, cudaStream_t s);
void swiglu_bwd(void* dgate, void* dup, const void* dy, const void* gate, const void* up, DType t,
                int64_t T, int64_t I, int64_t ld_in, cudaStream_t s);

// ---- residual.cu
void residual_fwd(void* y, const void* a, const void* b, DType t, int64_t n, cudaStream_t s);
void residual_accumulate(void* y, DType yt, const void* b, DType bt, int64_t n, cudaStream_t s);

// ---- cast.cu
/// dst = src converted (f32 <-> bf16, or a same-type copy).
void cast(void* dst, DType dt, const void* src, DType st, int64_t n, cudaStream_t s);

// ---- fill.cu
/// y = offset + bound·(2u − 1), u from the hash of ops/fill.hpp.
void fill_uniform(void* y, DType t, int64_t n, float offset, float bound, uint64_t seed,
                  cudaStream_t s);

// ---- adamw.cu
void adamw(const AdamWSegment* segs, int n_segs, int64_t max_n, float b1, float b2, float eps,
           float decay, float step_size, float inv_sqrt_bc2, const float* grad_scale,
           const int32_t* skip, cudaStream_t s);
/// Blocks per segment of the first pass of grad_sumsq (partials: n_segs·kSumsqBlocks doubles).
constexpr int kSumsqBlocks = kGradSumsqCudaBlocks;
void grad_sumsq(double* out, double* partials, const AdamWSegment* segs, int n_segs,
                cudaStream_t s);
void grad_clip(float* grad_scale, int32_t* skip, double* norm, const double* sumsq,
               double max_norm, cudaStream_t s);
void nonfinite_check(int32_t* flag, const void* x, DType t, int64_t n, cudaStream_t s);

// ---- attention.cu
/// q, k, v, o bf16; lse f32 [NH, Tq]; ranges on the device.
void attention_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                   const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                   cudaStream_t s);
/// delta_ws: f32 [NH, Tq] scratch; span_ws: int32 [2·ceil(Tk/32)] scratch (query span per key
/// tile).
void attention_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                   const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                   const float* lse, const AttnRange* ranges, const AttnParams& p,
                   float* delta_ws, int* span_ws, cudaStream_t s);
/// Key-tile width of the attention kernels (span_ws has 2 ints per tile of this many keys).
constexpr int kAttnKeyTile = kAttnCudaKeyTile;
/// out[t] = in[t] with lo1 = max(lo1, hi1 − window) (device arrays; out may alias in).
void attention_window_ranges(AttnRange* out, const AttnRange* in, int64_t T, int64_t window,
                             cudaStream_t s);

// ---- linear.cu
/// y[t, o] += bias[o] for t < T, o < OUT; y f32 or bf16 [T, OUT] (row stride OUT), bias f32.
void bias_add(void* y, DType yt, const float* bias, int64_t T, int64_t OUT, cudaStream_t s);

// ---- moe.cu (semantics: ops/moe.hpp)
void moe_route(int32_t* ids, float* weights, const float* logits, int64_t T, int64_t E, int64_t K,
               bool softmax_first, bool norm_topk, cudaStream_t s);
/// counts_ws: int32 [E] scratch.
void moe_dispatch(int32_t* perm, int32_t* slot, int32_t* offsets, int32_t* row_expert,
                  int32_t* counts_ws, const int32_t* ids, int64_t R, int64_t E, cudaStream_t s);
void moe_gather(uint16_t* xs, const uint16_t* x, const int32_t* perm, int64_t R, int64_t K,
                int64_t H, cudaStream_t s);
/// Upper bound of the row tiles of a grouped linear over R rows and E experts (its grid height).
int64_t moe_grouped_tiles(int64_t R, int64_t E);
/// y f32 or bf16 (yt), x bf16 [R, IN], w a device array of E device pointers [OUT, IN].
void moe_grouped_linear(void* y, DType yt, int64_t ldy, const uint16_t* x,
                        const uint16_t* const* w, const int32_t* offsets, int64_t E, int64_t R,
                        int64_t IN, int64_t OUT, cudaStream_t s);
/// gate/up f32 or bf16 (t), y bf16.
void moe_glu(uint16_t* y, const void* gate, const void* up, DType t, int64_t ld_in,
             const float* gate_bias, const float* up_bias, const int32_t* row_expert, int64_t R,
             int64_t I, bool clamped, float alpha, float limit, cudaStream_t s);
void moe_combine(float* y, const float* ys, const float* down_bias, const int32_t* ids,
                 const float* weights, const int32_t* slot, int64_t T, int64_t K, int64_t H,
                 cudaStream_t s);

// ---- attention_tc.cu (tensor cores; same contracts as attention_fwd / attention_bwd, all bf16
// arrays 16-byte aligned, D 64 or 128; span_ws sized as for attention_bwd)
void attention_tc_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                      cudaStream_t s);
void attention_tc_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                      const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                      const float* lse, const AttnRange* ranges, const AttnParams& p,
                      float* delta_ws, int* span_ws, cudaStream_t s);

// ---- cross_entropy.cu
/// One chunk of n rows: logits f32 [n, V] → lse, argmax, row_loss [n] (w·loss, 0 when w = 0) and,
/// when dlogits is not null, dlogits bf16 [n, V] = grad_scale·w·(softmax − onehot).
void ce_rows(float* row_loss, float* lse, int32_t* argmax, uint16_t* dlogits, const float* logits,
             const int32_t* labels, const float* weights, float grad_scale, int64_t n, int64_t V,
             cudaStream_t s);
/// sums[0] = Σ row_loss, sums[1] = Σ w (null weights: R) in double, fixed order (one block).
void ce_sums(double* sums, const float* row_loss, const float* weights, int64_t R,
             cudaStream_t s);

// ---- loss_weights.cu (semantics: ops/loss_weights.hpp)
/// D-PACE weights in place (w: CE in, weight out) and sums {Σ w·CE, Σ w}; one CTA; K ≤ 64.
void dpace_weights(float* w, double* sums, const float* mask, int64_t N, int K, LossType loss,
                   double alpha, cudaStream_t s);
/// x[r, :] *= w[r] over R rows of H.
void rows_scale(float* x, const float* w, int64_t R, int64_t H, cudaStream_t s);

}  // namespace dflash::cuda::launch
