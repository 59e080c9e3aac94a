// dflash.cpp — checked CUDA entry points of the fused decoding ops (declared in
// ops/decode_fused.hpp): sizes and pointers are checked here, the raw launchers of
// backend/cuda/decode_fused.cu run on the context's stream. Nothing allocates.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

#include "backend/cuda/context.hpp"
#include "backend/cuda/decode_fused_launch.hpp"
#include "core/error.hpp"
#include "ops/decode_fused.hpp"

namespace dflash {

namespace {

constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
// Warps of one CTA of the split attention (G query heads × rows_per_cta rows) at most this many
// when G allows it (16 warps: 4 rows of Qwen3-8B's G = 4 share their K/V lines in L1).
constexpr int64_t kSplitCtaWarps = 16;

static_assert(cuda::decode_fused::kSplitKeys == kDecodeSplitKeys);

}  // namespace

void qkv_prepare_cuda(cuda::CudaContext& ctx, uint16_t* q_out, const int32_t* q_rows,
                      uint16_t* k_out, uint16_t* v_out, const int32_t* kv_rows, const uint16_t* qkv,
                      const QkvPrepare& p) {
  DFLASH_CHECK(p.T >= 0 && p.T <= kI32 && p.NH >= 1 && p.NKV >= 1 && (p.D == 64 || p.D == 128) &&
                   (p.NH + 2 * p.NKV) * p.D <= kI32,
               "qkv_prepare_cuda: bad sizes T={} NH={} NKV={} D={} (D must be 64 or 128)", p.T,
               p.NH, p.NKV, p.D);
  DFLASH_CHECK((p.q_norm == nullptr) == (p.k_norm == nullptr),
               "qkv_prepare_cuda: q_norm and k_norm must both be given or both be null");
  if (p.T == 0) return;
  DFLASH_CHECK(q_out && k_out && v_out && qkv && p.pos && p.inv_freq,
               "qkv_prepare_cuda: null pointer");
  const auto misaligned = [](const void* ptr) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 != 0;
  };
  for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"qkv", qkv},
                                  {"q_out", q_out},
                                  {"k_out", k_out},
                                  {"v_out", v_out},
                                  {"q_norm", p.q_norm},
                                  {"k_norm", p.k_norm}})
    DFLASH_CHECK(!misaligned(ptr),
                 "qkv_prepare_cuda: {} must be 16-byte aligned (it moves 16-byte "
                 "vectors)",
                 name);
  const cuda::decode_fused::QkvPrepArgs a{q_out,
                                          q_rows,
                                          k_out,
                                          v_out,
                                          kv_rows,
                                          qkv,
                                          p.q_norm,
                                          p.k_norm,
                                          p.pos,
                                          p.inv_freq,
                                          p.rope_scaling,
                                          static_cast<float>(p.eps),
                                          p.T,
                                          static_cast<int>(p.NH),
                                          static_cast<int>(p.NKV)};
  cuda::launch::qkv_prepare(a, static_cast<int>(p.D), ctx.stream());
}

void decode_attention_cuda(cuda::CudaContext& ctx, uint16_t* o, const uint16_t* q,
                           const uint16_t* k, const uint16_t* v, const AttnRange* ranges,
                           const AttnParams& p, float* work, int64_t max_keys) {
  const int64_t T = p.Tq, G = p.NKV >= 1 ? p.NH / p.NKV : 0;
  DFLASH_CHECK(T >= 0 && p.Tk >= 1 && p.NKV >= 1 && p.NH % p.NKV == 0 && G >= 1 && G <= 32 &&
                   (p.D == 64 || p.D == 128) && max_keys >= 1 && max_keys <= kI32 && p.Tk <= kI32 &&
                   p.Tk * p.NKV * p.D <= std::numeric_limits<int64_t>::max() / 2,
               "decode_attention_cuda: bad sizes Tq={} Tk={} NH={} NKV={} D={} max_keys={} "
               "(NH a multiple of NKV, NH/NKV <= 32, D 64 or 128)",
               T, p.Tk, p.NH, p.NKV, p.D, max_keys);
  if (T == 0) return;
  DFLASH_CHECK(o && q && k && v && ranges && work, "decode_attention_cuda: null pointer");
  const int64_t S = (max_keys + kDecodeSplitKeys - 1) / kDecodeSplitKeys;
  const int64_t rows_per_cta = std::max<int64_t>(1, std::min(T, kSplitCtaWarps / G));
  DFLASH_CHECK(S <= 65535 && (T + rows_per_cta - 1) / rows_per_cta <= 65535,
               "decode_attention_cuda: {} rows seeing up to {} keys exceed the launch grid "
               "(65535 splits or row groups)",
               T, max_keys);
  float* part_o = work;
  float* part_ml = work + T * p.NH * S * p.D;
  const cuda::decode_fused::DecodeAttnArgs a{q,
                                             k,
                                             v,
                                             ranges,
                                             p.sinks,
                                             part_o,
                                             part_ml,
                                             o,
                                             static_cast<float>(p.scale),
                                             T,
                                             static_cast<int>(p.NH),
                                             static_cast<int>(p.NKV),
                                             static_cast<int>(S),
                                             static_cast<int>(rows_per_cta)};
  cuda::launch::decode_attention(a, static_cast<int>(p.D), ctx.stream());
}

template <typename Y>
void decode_linear_cuda(cuda::CudaContext& ctx, Y* y, const uint16_t* x, const uint16_t* w,
                        int64_t M, int64_t IN, int64_t OUT, bool accumulate) {
  constexpr bool f32 = std::is_same_v<Y, float>;
  DFLASH_CHECK(M >= 0 && IN >= 64 && IN % 64 == 0 && OUT >= 8 && OUT % 8 == 0 && OUT / 8 <= kI32,
               "decode_linear_cuda: bad sizes M={} IN={} OUT={} (IN a multiple of 64, OUT of 8)", M,
               IN, OUT);
  DFLASH_CHECK(f32 || !accumulate, "decode_linear_cuda: accumulating needs an f32 output");
  if (M == 0) return;
  DFLASH_CHECK(y && x && w, "decode_linear_cuda: null pointer");
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0,
               "decode_linear_cuda: x and W must be 16-byte aligned");
  const cuda::decode_fused::DecodeLinearArgs a{y, x, w, M, OUT, IN};
  cuda::launch::decode_linear(a, f32, accumulate, ctx.stream());
}

template void decode_linear_cuda<float>(cuda::CudaContext&, float*, const uint16_t*,
                                        const uint16_t*, int64_t, int64_t, int64_t, bool);
template void decode_linear_cuda<uint16_t>(cuda::CudaContext&, uint16_t*, const uint16_t*,
                                           const uint16_t*, int64_t, int64_t, int64_t, bool);

}  // namespace dflash
