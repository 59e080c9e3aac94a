// dflash.cpp — checked CUDA entry points of the ops (declared in src/ops/*.hpp and
// src/train/optimizer.hpp under DFLASH_HAVE_CUDA). Each one checks sizes and pointers, takes
// scratch from the context's caching allocator and calls a raw launcher (backend/cuda/launch.hpp)
// on the context's stream. Templates are instantiated here for float and uint16_t (bf16 bits).
#include <cmath>
#include <type_traits>

#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/gemm.hpp"
#include "backend/cuda/launch.hpp"
#include "core/error.hpp"
#include "ops/attention.hpp"
#include "ops/cast.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/embedding.hpp"
#include "ops/fill.hpp"
#include "ops/linear.hpp"
#include "ops/residual.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/swiglu.hpp"
#include "train/optimizer.hpp"

namespace dflash {

namespace {

template <typename T>
constexpr DType dt() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>,
                "CUDA ops take float or uint16_t (bf16 bits)");
  return std::is_same_v<T, float> ? DType::f32 : DType::bf16;
}

bool aligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

// ---------------------------------------------------------------- embedding

template <typename Y, typename W>
void embedding_fwd_cuda(cuda::CudaContext& ctx, Y* y, const W* table, const int32_t* ids,
                        int64_t T, int64_t V, int64_t H) {
  DFLASH_CHECK(T >= 0 && V > 0 && H > 0, "embedding_fwd_cuda: bad sizes T={} V={} H={}", T, V, H);
  if (T == 0) return;
  DFLASH_CHECK(y && table && ids, "embedding_fwd_cuda: null pointer");
  cuda::launch::embedding_fwd(y, dt<Y>(), table, dt<W>(), ids, T, V, H, ctx.stream());
}

// ---------------------------------------------------------------- rmsnorm

template <typename Y, typename X>
void rmsnorm_fwd_cuda(cuda::CudaContext& ctx, Y* y, float* rstd, const X* x, const float* w,
                      int64_t R, int64_t D, double eps) {
  DFLASH_CHECK(R >= 0 && D > 0 && eps >= 0, "rmsnorm_fwd_cuda: bad sizes R={} D={} eps={}", R, D,
               eps);
  if (R == 0) return;
  DFLASH_CHECK(y && x && w, "rmsnorm_fwd_cuda: null pointer");
  cuda::launch::rmsnorm_fwd(y, dt<Y>(), rstd, x, dt<X>(), w, R, D, static_cast<float>(eps),
                            ctx.stream());
}

template <typename G, typename X>
void rmsnorm_bwd_cuda(cuda::CudaContext& ctx, G* dx, float* dw, const G* dy, const X* x,
                      const float* w, int64_t R, int64_t D, double eps) {
  DFLASH_CHECK(R >= 0 && D > 0 && eps >= 0, "rmsnorm_bwd_cuda: bad sizes R={} D={} eps={}", R, D,
               eps);
  if (R == 0) return;
  DFLASH_CHECK(dy && x && w, "rmsnorm_bwd_cuda: null pointer");
  // Sizes as rmsnorm_bwd_cuda_scratch_bytes.
  cuda::DeviceBuffer rstd = ctx.scratch(static_cast<size_t>(R) * sizeof(float));
  cuda::DeviceBuffer part;
  if (dw) part = ctx.scratch(static_cast<size_t>(rmsnorm_cuda_dw_chunks(R) * D) * sizeof(float));
  cuda::launch::rmsnorm_bwd(dx, dy, dt<G>(), dw, x, dt<X>(), w, R, D, static_cast<float>(eps),
                            rstd.as<float>(), part.as<float>(), ctx.stream());
}

// ---------------------------------------------------------------- rope

namespace {
template <typename T>
void rope_entry(const char* op, cuda::CudaContext& ctx, T* y, const T* x, const int32_t* pos,
                const float* inv_freq, float scaling, float sign, int64_t Tn, int64_t NH,
                int64_t D) {
  DFLASH_CHECK(Tn >= 0 && NH > 0 && D > 0 && D % 2 == 0, "{}: bad sizes T={} NH={} D={}", op, Tn,
               NH, D);
  DFLASH_CHECK(std::isfinite(scaling), "{}: scaling must be finite", op);
  if (Tn == 0) return;
  DFLASH_CHECK(y && x && pos && inv_freq, "{}: null pointer", op);
  cuda::launch::rope(y, x, dt<T>(), pos, inv_freq, scaling, sign, Tn, NH, D, ctx.stream());
}
}  // namespace

template <typename T>
void rope_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* x, const int32_t* pos,
                   const float* inv_freq, float scaling, int64_t Tn, int64_t NH, int64_t D) {
  rope_entry("rope_fwd_cuda", ctx, y, x, pos, inv_freq, scaling, 1.0f, Tn, NH, D);
}
template <typename T>
void rope_bwd_cuda(cuda::CudaContext& ctx, T* dx, const T* dy, const int32_t* pos,
                   const float* inv_freq, float scaling, int64_t Tn, int64_t NH, int64_t D) {
  rope_entry("rope_bwd_cuda", ctx, dx, dy, pos, inv_freq, scaling, -1.0f, Tn, NH, D);
}

// ---------------------------------------------------------------- swiglu

template <typename T>
void swiglu_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* gate, const T* up, int64_t Tn,
                     int64_t I, int64_t ld_in) {
  DFLASH_CHECK(Tn >= 0 && I > 0 && ld_in >= I, "swiglu_fwd_cuda: bad sizes T={} I={} ld_in={}",
               Tn, I, ld_in);
  if (Tn == 0) return;
  DFLASH_CHECK(y && gate && up, "swiglu_fwd_cuda: null pointer");
  cuda::launch::swiglu_fwd(y, gate, up, dt<T>(), Tn, I, ld_in, ctx.stream());
}
template <typename T>
void swiglu_bwd_cuda(cuda::CudaContext& ctx, T* dgate, T* dup, const T* dy, const T* gate,
                     const T* up, int64_t Tn, int64_t I, int64_t ld_in) {
  DFLASH_CHECK(Tn >= 0 && I > 0 && ld_in >= I, "swiglu_bwd_cuda: bad sizes T={} I={} ld_in={}",
               Tn, I, ld_in);
  if (Tn == 0) return;
  DFLASH_CHECK(dgate && dup && dy && gate && up, "swiglu_bwd_cuda: null pointer");
  cuda::launch::swiglu_bwd(dgate, dup, dy, gate, up, dt<T>(), Tn, I, ld_in, ctx.stream());
}

// ---------------------------------------------------------------- residual

template <typename T>
void residual_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* a, const T* b, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_fwd_cuda: bad size {}", n);
  if (n == 0) return;
  DFLASH_CHECK(y && a && b, "residual_fwd_cuda: null pointer");
  cuda::launch::residual_fwd(y, a, b, dt<T>(), n, ctx.stream());
}
template <typename Y, typename B>
void residual_accumulate_cuda(cuda::CudaContext& ctx, Y* y, const B* b, int64_t n) {
  DFLASH_CHECK(n >= 0, "residual_accumulate_cuda: bad size {}", n);
  if (n == 0) return;
  DFLASH_CHECK(y && b, "residual_accumulate_cuda: null pointer");
  cuda::launch::residual_accumulate(y, dt<Y>(), b, dt<B>(), n, ctx.stream());
}
template <typename T>
void residual_bwd_cuda(cuda::CudaContext& ctx, T* da, T* db, const T* dy, int64_t n) {
  DFLASH_CHECK(n >= 0 && dy, "residual_bwd_cuda: bad size {} or null dy", n);
  const size_t bytes = static_cast<size_t>(n) * sizeof(T);
  for (T* d : {da, db})
    if (d && d != dy && n > 0)
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(d, dy, bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
}

// ---------------------------------------------------------------- cast

template <typename D, typename S>
void cast_cuda(cuda::CudaContext& ctx, D* dst, const S* src, int64_t n) {
  DFLASH_CHECK(n >= 0, "cast_cuda: bad size {}", n);
  if (n == 0) return;
  DFLASH_CHECK(dst && src, "cast_cuda: null pointer");
  cuda::launch::cast(dst, dt<D>(), src, dt<S>(), n, ctx.stream());
}

// ---------------------------------------------------------------- fill

template <typename Y>
void fill_uniform_cuda(cuda::CudaContext& ctx, Y* y, int64_t n, float offset, float bound,
                       uint64_t seed) {
  DFLASH_CHECK(n >= 0 && std::isfinite(offset) && std::isfinite(bound),
               "fill_uniform_cuda: bad arguments n={} offset={} bound={}", n, offset, bound);
  if (n == 0) return;
  DFLASH_CHECK(y, "fill_uniform_cuda: null pointer");
  cuda::launch::fill_uniform(y, dt<Y>(), n, offset, bound, seed, ctx.stream());
}
template void fill_uniform_cuda(cuda::CudaContext&, float*, int64_t, float, float, uint64_t);
template void fill_uniform_cuda(cuda::CudaContext&, uint16_t*, int64_t, float, float, uint64_t);

// ---------------------------------------------------------------- linear (cuBLASLt)

template <typename Y>
void linear_fwd_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                     int64_t T, int64_t IN, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_fwd_cuda: bad sizes T={} IN={} OUT={}", T, IN,
               OUT);
  if (T == 0) return;
  // y[T,OUT] = x[T,IN] · W[OUT,IN]ᵀ
  cuda::gemm_bf16(ctx, y, dt<Y>(), OUT, x, IN, false, w_bf16, IN, true, T, OUT, IN);
}

template <typename Y>
void bias_add_cuda(cuda::CudaContext& ctx, Y* y, const float* bias, int64_t T, int64_t OUT) {
  DFLASH_CHECK(T >= 0 && OUT > 0, "bias_add_cuda: bad sizes T={} OUT={}", T, OUT);
  if (T == 0) return;
  DFLASH_CHECK(y && bias, "bias_add_cuda: null pointer");
  cuda::launch::bias_add(y, dt<Y>(), bias, T, OUT, ctx.stream());
}

template <typename Y>
void linear_fwd_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w_bf16,
                     const float* bias, int64_t T, int64_t IN, int64_t OUT) {
  linear_fwd_cuda(ctx, y, x, w_bf16, T, IN, OUT);
  if (bias) bias_add_cuda(ctx, y, bias, T, OUT);
}

template <typename DX>
void linear_bwd_cuda(cuda::CudaContext& ctx, DX* dx, float* dw, const uint16_t* dy,
                     const uint16_t* x, const uint16_t* w_bf16, int64_t T, int64_t IN,
                     int64_t OUT) {
  DFLASH_CHECK(T >= 0 && IN > 0 && OUT > 0, "linear_bwd_cuda: bad sizes T={} IN={} OUT={}", T, IN,
               OUT);
  if (T == 0) return;
  // dx[T,IN] = dy[T,OUT] · W[OUT,IN]
  if (dx) cuda::gemm_bf16(ctx, dx, dt<DX>(), IN, dy, OUT, false, w_bf16, IN, false, T, IN, OUT);
  // dW[OUT,IN] += dy[T,OUT]ᵀ · x[T,IN]
  if (dw)
    cuda::gemm_bf16(ctx, dw, DType::f32, IN, dy, OUT, true, x, IN, false, OUT, IN, T, 1.0f, 1.0f);
}

// ---------------------------------------------------------------- attention

namespace {
void check_attn(const char* op, const AttnParams& p) {
  DFLASH_CHECK(p.Tq >= 0 && p.Tk >= 0 && p.NH > 0 && p.NKV > 0 && p.NH % p.NKV == 0 &&
                   p.Tq < (1ll << 31) && p.Tk < (1ll << 31) && std::isfinite(p.scale),
               "{}: bad sizes Tq={} Tk={} NH={} NKV={} scale={} (NH must be a multiple of NKV)",
               op, p.Tq, p.Tk, p.NH, p.NKV, p.scale);
  DFLASH_CHECK(p.D == 64 || p.D == 128, "{}: head dimension {} is not supported (64 or 128)", op,
               p.D);
}
}  // namespace

void attention_window_ranges_cuda(cuda::CudaContext& ctx, AttnRange* out, const AttnRange* in,
                                  int64_t T, int64_t window) {
  DFLASH_CHECK(T >= 0 && window >= 1,
               "attention_window_ranges_cuda: window must be >= 1, got {} (T={})", window, T);
  if (T == 0) return;
  DFLASH_CHECK(out && in, "attention_window_ranges_cuda: null pointer");
  cuda::launch::attention_window_ranges(out, in, T, window, ctx.stream());
}

void attention_fwd_cuda(cuda::CudaContext& ctx, uint16_t* o, float* lse, const uint16_t* q,
                        const uint16_t* k, const uint16_t* v, const AttnRange* ranges,
                        const AttnParams& p) {
  check_attn("attention_fwd_cuda", p);
  if (p.Tq == 0) return;
  DFLASH_CHECK(o && q && ranges && (p.Tk == 0 || (k && v)), "attention_fwd_cuda: null pointer");
  if (p.kernels == AttnCudaKernels::tensor_core) {
    DFLASH_CHECK(aligned16(o) && aligned16(q) && aligned16(k) && aligned16(v),
                 "attention_fwd_cuda (tensor cores): o, q, k, v must be 16-byte aligned");
    cuda::launch::attention_tc_fwd(o, lse, q, k, v, ranges, p, ctx.stream());
    return;
  }
  DFLASH_CHECK(aligned4(q) && aligned4(k) && aligned4(v),
               "attention_fwd_cuda: q, k, v must be 4-byte aligned");
  cuda::launch::attention_fwd(o, lse, q, k, v, ranges, p, ctx.stream());
}

void attention_bwd_cuda(cuda::CudaContext& ctx, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                        const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, const uint16_t* o, const float* lse,
                        const AttnRange* ranges, const AttnParams& p) {
  check_attn("attention_bwd_cuda", p);
  DFLASH_CHECK((dout && q && k && v && o && lse && ranges) || p.Tq == 0,
               "attention_bwd_cuda: an input pointer is null");
  const bool tc = p.kernels == AttnCudaKernels::tensor_core;
  if (tc)
    DFLASH_CHECK(aligned16(dq) && aligned16(dk) && aligned16(dv) && aligned16(dout) &&
                     aligned16(q) && aligned16(k) && aligned16(v) && aligned16(o),
                 "attention_bwd_cuda (tensor cores): dq, dk, dv, dout, q, k, v, o must be "
                 "16-byte aligned");
  else
    DFLASH_CHECK(aligned4(q) && aligned4(k) && aligned4(v),
                 "attention_bwd_cuda: q, k, v must be 4-byte aligned");
  // Sizes as attention_bwd_cuda_scratch_bytes.
  cuda::DeviceBuffer delta = ctx.scratch(static_cast<size_t>(p.NH * p.Tq) * sizeof(float));
  const int64_t tiles = (p.Tk + cuda::launch::kAttnKeyTile - 1) / cuda::launch::kAttnKeyTile;
  cuda::DeviceBuffer span = ctx.scratch(static_cast<size_t>(std::max<int64_t>(tiles, 1)) * 2 *
                                        sizeof(int));
  if (tc)
    cuda::launch::attention_tc_bwd(dq, dk, dv, dout, q, k, v, o, lse, ranges, p,
                                   delta.as<float>(), span.as<int>(), ctx.stream());
  else
    cuda::launch::attention_bwd(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta.as<float>(),
                                span.as<int>(), ctx.stream());
}

// ---------------------------------------------------------------- fused LM-head cross-entropy

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

// ---------------------------------------------------------------- optimizer

void adamw_step_cuda(cuda::CudaContext& ctx, const AdamWSegment* segs, int n_segs, int64_t max_n,
                     const AdamWConfig& c, double lr, int64_t step, const float* grad_scale,
                     const int32_t* skip) {
  DFLASH_CHECK(step >= 1, "AdamW step must be >= 1 (got {})", step);
  DFLASH_CHECK(n_segs >= 0 && n_segs < 65536 && max_n >= 0,
               "adamw_step_cuda: bad segment count {} or size {}", n_segs, max_n);
  if (n_segs == 0) return;
  DFLASH_CHECK(segs, "adamw_step_cuda: null segment table");
  // The same float scalars as adamw_step_cpu.
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  cuda::launch::adamw(segs, n_segs, max_n, static_cast<float>(c.beta1),
                      static_cast<float>(c.beta2), static_cast<float>(c.eps),
                      static_cast<float>(1.0 - lr * c.weight_decay), static_cast<float>(lr / bc1),
                      static_cast<float>(1.0 / std::sqrt(bc2)), grad_scale, skip, ctx.stream());
}

void grad_sumsq_cuda(cuda::CudaContext& ctx, double* out, const AdamWSegment* segs, int n_segs) {
  DFLASH_CHECK(out && n_segs >= 0 && n_segs < 65536 && (n_segs == 0 || segs),
               "grad_sumsq_cuda: bad arguments (n_segs={})", n_segs);
  cuda::DeviceBuffer part = ctx.scratch(grad_sumsq_cuda_scratch_bytes(n_segs));
  cuda::launch::grad_sumsq(out, part.as<double>(), segs, n_segs, ctx.stream());
}

void grad_clip_cuda(cuda::CudaContext& ctx, float* grad_scale, int32_t* skip, double* norm,
                    const double* sumsq, double max_norm) {
  DFLASH_CHECK(sumsq, "grad_clip_cuda: null sumsq");
  cuda::launch::grad_clip(grad_scale, skip, norm, sumsq, max_norm, ctx.stream());
}

template <typename T>
void nonfinite_check_cuda(cuda::CudaContext& ctx, int32_t* flag, const T* x, int64_t n) {
  DFLASH_CHECK(flag && n >= 0 && (n == 0 || x), "nonfinite_check_cuda: bad arguments (n={})", n);
  cuda::launch::nonfinite_check(flag, x, dt<T>(), n, ctx.stream());
}

// ---------------------------------------------------------------- instantiations
using bf16_bits = uint16_t;

template void embedding_fwd_cuda(cuda::CudaContext&, float*, const float*, const int32_t*,
                                 int64_t, int64_t, int64_t);
template void embedding_fwd_cuda(cuda::CudaContext&, float*, const bf16_bits*, const int32_t*,
                                 int64_t, int64_t, int64_t);
template void embedding_fwd_cuda(cuda::CudaContext&, bf16_bits*, const float*, const int32_t*,
                                 int64_t, int64_t, int64_t);
template void embedding_fwd_cuda(cuda::CudaContext&, bf16_bits*, const bf16_bits*,
                                 const int32_t*, int64_t, int64_t, int64_t);

#define DFLASH_INST_YX(Y, X)                                                                     \
  template void rmsnorm_fwd_cuda(cuda::CudaContext&, Y*, float*, const X*, const float*,       \
                                 int64_t, int64_t, double);                                    \
  template void rmsnorm_bwd_cuda(cuda::CudaContext&, Y*, float*, const Y*, const X*,           \
                                 const float*, int64_t, int64_t, double);                      \
  template void cast_cuda(cuda::CudaContext&, Y*, const X*, int64_t);
DFLASH_INST_YX(float, float)
DFLASH_INST_YX(float, bf16_bits)
DFLASH_INST_YX(bf16_bits, float)
DFLASH_INST_YX(bf16_bits, bf16_bits)
#undef DFLASH_INST_YX

#define DFLASH_INST_T(T)                                                                        \
  template void rope_fwd_cuda(cuda::CudaContext&, T*, const T*, const int32_t*, const float*,  \
                              float, int64_t, int64_t, int64_t);                               \
  template void rope_bwd_cuda(cuda::CudaContext&, T*, const T*, const int32_t*, const float*,  \
                              float, int64_t, int64_t, int64_t);                               \
  template void swiglu_fwd_cuda(cuda::CudaContext&, T*, const T*, const T*, int64_t, int64_t,  \
                                int64_t);                                                      \
  template void swiglu_bwd_cuda(cuda::CudaContext&, T*, T*, const T*, const T*, const T*,      \
                                int64_t, int64_t, int64_t);                                    \
  template void residual_fwd_cuda(cuda::CudaContext&, T*, const T*, const T*, int64_t);        \
  template void residual_bwd_cuda(cuda::CudaContext&, T*, T*, const T*, int64_t);              \
  template void linear_fwd_cuda(cuda::CudaContext&, T*, const uint16_t*, const uint16_t*,      \
                                const float*, int64_t, int64_t, int64_t);                      \
  template void bias_add_cuda(cuda::CudaContext&, T*, const float*, int64_t, int64_t);         \
  template void linear_fwd_cuda(cuda::CudaContext&, T*, const uint16_t*, const uint16_t*,      \
                                int64_t, int64_t, int64_t);                                    \
  template void linear_bwd_cuda(cuda::CudaContext&, T*, float*, const uint16_t*,               \
                                const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t);  \
  template void nonfinite_check_cuda(cuda::CudaContext&, int32_t*, const T*, int64_t);
DFLASH_INST_T(float)
DFLASH_INST_T(bf16_bits)
#undef DFLASH_INST_T

template void residual_accumulate_cuda(cuda::CudaContext&, float*, const float*, int64_t);
template void residual_accumulate_cuda(cuda::CudaContext&, float*, const bf16_bits*, int64_t);
template void residual_accumulate_cuda(cuda::CudaContext&, bf16_bits*, const bf16_bits*, int64_t);

}  // namespace dflash
