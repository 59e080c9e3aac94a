// dflash.cpp — Dflash2DecodeCuda (see decoder_cuda_dflash2.hpp): DFlash2's conv and selector walk
// in the CUDA decoder's step.
#include "infer/decoder_cuda_dflash2.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cmath>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/context.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/decode_fused.hpp"
#include "ops/dflash2_conv.hpp"
#include "ops/fill.hpp"
#include "ops/linear.hpp"

namespace dflash {

Dflash2DecodeCuda::Dflash2DecodeCuda(const DrafterConfig& c, int64_t max_rows)
    : c_(c), max_rows_(max_rows) {
  const Dflash2Heads& d = c.dflash2;
  DFLASH_CHECK(d.enabled, "Dflash2DecodeCuda: the drafter is not DFlash2");
  DFLASH_CHECK(d.selector_top_k >= 1 && d.selector_top_k <= kDflash2WalkMaxTopK,
               "the CUDA decoder's DFlash2 walk holds selector_top_k up to {} (the drafter has {})",
               kDflash2WalkMaxTopK, d.selector_top_k);
  DFLASH_CHECK(d.selector_rank >= 1 && d.selector_rank <= kDflash2WalkMaxRank,
               "the CUDA decoder's DFlash2 walk holds selector_rank up to {} (the drafter has {})",
               kDflash2WalkMaxRank, d.selector_rank);
  W_ = 2 * int64_t{d.conv_kernel_size} * (c.hidden_size / d.conv_group_size);
  conv_.resize(static_cast<size_t>(2 * c.num_layers));
}

void Dflash2DecodeCuda::plan(const AddBuffer& add) {
  const int64_t H = c_.hidden_size, V = c_.vocab_size, T = c_.dflash2.conv_kernel_size;
  const int64_t r = c_.dflash2.selector_rank, Kc = c_.dflash2.selector_top_k, R = max_rows_;
  auto f32 = [&](const std::string& n, int64_t count, float** dst) {
    add("decode.drafter.dflash2." + n, static_cast<uint64_t>(count) * 4,
        reinterpret_cast<void**>(dst));
  };
  for (size_t i = 0; i < conv_.size(); ++i) {
    const std::string n =
        "layers." + std::to_string(i / 2) + (i % 2 == 0 ? ".attention_conv." : ".mlp_conv.");
    f32(n + "base_kernel", 2 * T * H, &conv_[i].base);
    add("decode.drafter.dflash2." + n + "kernel_projection", static_cast<uint64_t>(W_ * H) * 2,
        reinterpret_cast<void**>(&conv_[i].kp));
  }
  f32("predecessor_codebook", V * r, &A_);
  f32("successor_codebook", V * r, &Bs_);
  f32("hidden_projection", r * H, &Ph_);
  f32("delta", R * W_, &delta_);
  f32("y", R * H, &y_);
  f32("residual2", R * H, &h2_);
  add("decode.drafter.dflash2.ut", static_cast<uint64_t>(R * H) * 2,
      reinterpret_cast<void**>(&ut_));
  add("decode.drafter.dflash2.cand", static_cast<uint64_t>(R * Kc) * 4,
      reinterpret_cast<void**>(&cand_));
  f32("cand_u", R * Kc, &cand_u_);
  f32("proj", R * r, &proj_);
}

void Dflash2DecodeCuda::upload(cuda::PinnedUploader& up, const DrafterLayout& layout,
                               const float* params) {
  const int64_t H = c_.hidden_size, V = c_.vocab_size, T = c_.dflash2.conv_kernel_size;
  const int64_t r = c_.dflash2.selector_rank;
  const Dflash2Offsets& o = layout.dflash2;
  DFLASH_CHECK(o.attn_base.size() * 2 == conv_.size() && o.mlp_base.size() * 2 == conv_.size(),
               "DFlash2 drafter layout: {} conv layers for a drafter of {} layers",
               o.attn_base.size(), conv_.size() / 2);
  auto f32 = [&](float* dst, int64_t offset, int64_t n) {
    up.upload(dst, params + offset, static_cast<size_t>(n) * sizeof(float));
  };
  auto bf16 = [&](uint16_t* dst, int64_t offset, int64_t n) {
    up.upload(dst, static_cast<size_t>(n) * 2,
              [params, offset](void* out, size_t off, size_t bytes) {
                auto* b = static_cast<uint16_t*>(out);
                const float* src = params + offset + static_cast<int64_t>(off / 2);
                for (size_t i = 0; i < bytes / 2; ++i) b[i] = f32_to_bf16_bits(src[i]);
              });
  };
  for (size_t l = 0; l < o.attn_base.size(); ++l) {
    f32(conv_[2 * l].base, o.attn_base[l], 2 * T * H);
    bf16(conv_[2 * l].kp, o.attn_kp[l], W_ * H);
    f32(conv_[2 * l + 1].base, o.mlp_base[l], 2 * T * H);
    bf16(conv_[2 * l + 1].kp, o.mlp_kp[l], W_ * H);
  }
  f32(A_, o.predecessor, V * r);
  f32(Bs_, o.successor, V * r);
  f32(Ph_, o.hidden_proj, r * H);
}

void Dflash2DecodeCuda::randomize(cuda::CudaContext& ctx, uint64_t& stream) {
  const int64_t H = c_.hidden_size, V = c_.vocab_size, T = c_.dflash2.conv_kernel_size;
  const int64_t r = c_.dflash2.selector_rank;
  const float bound = 0.02f * std::sqrt(3.0f);  // uniform with standard deviation 0.02
  for (const Conv& cv : conv_) {
    fill_uniform_cuda(ctx, cv.base, 2 * T * H, 0.0f, bound, ++stream);
    fill_uniform_cuda(ctx, cv.kp, W_ * H, 0.0f, bound, ++stream);
  }
  fill_uniform_cuda(ctx, A_, V * r, 0.0f, bound, ++stream);
  fill_uniform_cuda(ctx, Bs_, V * r, 0.0f, bound, ++stream);
  fill_uniform_cuda(ctx, Ph_, r * H, 0.0f, bound, ++stream);
}

void Dflash2DecodeCuda::check_block(int K) const {
  DFLASH_CHECK(K >= c_.dflash2.conv_kernel_size,
               "block size {} is below the DFlash2 drafter's conv_kernel_size {}: the CUDA "
               "decoder's conv needs every tap inside the block",
               K, c_.dflash2.conv_kernel_size);
}

const uint16_t* Dflash2DecodeCuda::pre(cuda::CudaContext& ctx, int64_t l, int sub,
                                       const uint16_t* u, int B, int K) {
  const int64_t R = int64_t{B} * K, H = c_.hidden_size;
  const Conv& cv = conv_[static_cast<size_t>(2 * l + sub)];
  if (H % 64 == 0 && W_ % 8 == 0)
    decode_linear_cuda(ctx, delta_, u, cv.kp, R, H, W_, false);
  else
    linear_fwd_cuda(ctx, delta_, u, cv.kp, R, H, W_);
  const Dflash2ConvShape s{R, H, K, c_.dflash2.conv_kernel_size, c_.dflash2.conv_group_size};
  dflash2_conv_fwd_cuda(ctx, ut_, static_cast<const float*>(nullptr), u, cv.base, delta_, 0, s);
  return ut_;
}

void Dflash2DecodeCuda::post(cuda::CudaContext& ctx, int64_t l, int sub, float* out, const float* h,
                             int B, int K) const {
  const int64_t R = int64_t{B} * K, H = c_.hidden_size, T = c_.dflash2.conv_kernel_size;
  DFLASH_CHECK(out != h, "Dflash2DecodeCuda::post: the output aliases the residual");
  const Conv& cv = conv_[static_cast<size_t>(2 * l + sub)];
  const Dflash2ConvShape s{R, H, K, c_.dflash2.conv_kernel_size, c_.dflash2.conv_group_size};
  dflash2_conv_fwd_cuda(ctx, out, h, static_cast<const float*>(y_), cv.base + T * H, delta_, 1, s);
}

void Dflash2DecodeCuda::walk(cuda::CudaContext& ctx, float* logits, const uint16_t* hf,
                             int32_t* block, float* q, const uint64_t* seeds, const int32_t* steps,
                             int32_t* status, const SampleParamsDevice* params, int B, int K,
                             bool sampled) const {
  Dflash2WalkArgs a;
  a.logits = logits;
  a.hf = hf;
  a.A = A_;
  a.Bs = Bs_;
  a.Ph = Ph_;
  a.block = block;
  a.cand = cand_;
  a.cand_u = cand_u_;
  a.proj = proj_;
  if (sampled) {
    a.q = q;
    a.seeds = seeds;
    a.steps = steps;
    a.status = status;
    a.params = params;
  }
  a.B = B;
  a.K = K;
  a.V = c_.vocab_size;
  a.H = c_.hidden_size;
  a.r = c_.dflash2.selector_rank;
  a.top_k = c_.dflash2.selector_top_k;
  a.m = static_cast<float>(c_.dflash2.output_multiplier);
  a.cap = static_cast<float>(c_.dflash2.final_logit_softcapping);
  dflash2_walk_cuda(ctx, a);
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
