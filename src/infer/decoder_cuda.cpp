// dflash.cpp — SpeculativeDecoderCuda (see decoder_cuda.hpp): the memory plan, the drafter on the
// device, prefill/admission, the captured step and the host loop over a batch of requests.
#include "infer/decoder_cuda.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cuda/check.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/decode.hpp"
#include "ops/decode_fused.hpp"
#include "ops/embedding.hpp"
#include "ops/fill.hpp"
#include "ops/gemm.hpp"
#include "ops/linear.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/rope.hpp"
#include "ops/sample.hpp"
#include "ops/swiglu.hpp"

namespace dflash {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Rows of every cache per request: max_context rounded up to this, the key-tile width of the
// tensor-core attention (backend/cuda/attention_tc.cuh, kKeys) that a prefill runs. A CTA of the
// attention cuts the union of its rows' key ranges into tiles from the union's start; with every
// request's first row on a tile boundary, a request's keys fall into the same tiles in any batch
// slot, so its online-softmax sums run in the same order and batch N gives batch 1's bits (with an
// unaligned stride a near-tie token of the tiny fixture flipped between slots on the H200). The
// steps' split-key attention (ops/decode_fused.hpp) splits from each row's own first key.
constexpr int64_t kSlotAlign = 64;

// The largest multiple pad_gemm_rows accepts.
constexpr int64_t kMaxRowPad = 16;
// The step buffers hold max_batch · round_up(K, kQueryTile) rows (≥ any padding of
// pad_gemm_rows).
constexpr int64_t kQueryTile = 16;

int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

// One buffer of the decoder's plan and where its pointer goes.
struct Want {
  std::string name;
  uint64_t bytes;
  void** dst;
};

template <typename T>
Want want(std::string name, int64_t count, T** dst) {
  return Want{std::move(name), static_cast<uint64_t>(count) * sizeof(T),
              reinterpret_cast<void**>(dst)};
}

}  // namespace

DecoderCudaLimits decoder_cuda_limits(std::span<const std::vector<int32_t>> prompts,
                                      int64_t max_new_tokens, int block_size, int batch) {
  DecoderCudaLimits l;
  l.max_batch = std::max(1, std::min<int>(batch, static_cast<int>(prompts.size())));
  for (const auto& p : prompts) {
    const auto n = static_cast<int64_t>(p.size());
    l.max_prefill = std::max(l.max_prefill, n);
    l.max_context = std::max(l.max_context, n + max_new_tokens + block_size);
  }
  l.max_prefill = std::max<int64_t>(l.max_prefill, 1);
  l.max_context = std::max<int64_t>(l.max_context, 2);
  return l;
}

SpeculativeDecoderCuda::SpeculativeDecoderCuda(cuda::CudaContext& ctx, const TargetModel& target,
                                               const LoadedDrafter& drafter,
                                               const DecoderCudaLimits& limits)
    : ctx_(ctx), tcfg_(target.config()), dcfg_(drafter.config), limits_(limits) {
  check_setup();
  target_ = std::make_unique<TargetCuda>(ctx, target, max_rows_);
  DFLASH_CHECK(static_cast<int64_t>(drafter.params.size()) == drafter.layout.total,
               "drafter holds {} parameters, its layout needs {}", drafter.params.size(),
               drafter.layout.total);
  init();
  upload_drafter(drafter);
  upload_final_norm(target);
}

SpeculativeDecoderCuda::SpeculativeDecoderCuda(cuda::CudaContext& ctx, const TargetModel& target,
                                               const DecoderCudaLimits& limits)
    : ctx_(ctx), tcfg_(target.config()), limits_(limits), has_drafter_(false) {
  // No drafter: block size 1 (the target-only step), no taps, no drafter buffers in the plan.
  dcfg_.num_layers = 0;
  dcfg_.block_size = 1;
  dcfg_.mask_token_id = 0;  // written to the empty draft slots of a K = 1 block: none exist
  dcfg_.target_layer_ids.clear();
  check_setup();
  target_ = std::make_unique<TargetCuda>(ctx, target, max_rows_);
  init();
  upload_final_norm(target);
}

void SpeculativeDecoderCuda::upload_final_norm(const TargetModel& target) {
  cuda::PinnedUploader up(ctx_);
  const std::vector<float>& fn = target.final_norm_weight();
  DFLASH_CHECK(static_cast<int64_t>(fn.size()) == tcfg_.hidden_size,
               "target final norm 'model.norm.weight' has {} values, hidden_size is {}", fn.size(),
               tcfg_.hidden_size);
  up.upload(final_norm_, fn.data(), fn.size() * sizeof(float));
  up.finish();
}

SpeculativeDecoderCuda::SpeculativeDecoderCuda(cuda::CudaContext& ctx,
                                               const ModelConfig& target_cfg,
                                               const DrafterConfig& drafter_cfg, uint64_t seed,
                                               const DecoderCudaLimits& limits)
    : ctx_(ctx), tcfg_(target_cfg), dcfg_(drafter_cfg), limits_(limits) {
  check_setup();
  target_ = std::make_unique<TargetCuda>(ctx, target_cfg, seed, max_rows_);
  init();
  random_drafter(seed + 1000003);
  fill_uniform_cuda(ctx_, final_norm_, tcfg_.hidden_size, 1.0f, 0.0f, seed);
  ctx_.synchronize();
}

SpeculativeDecoderCuda::~SpeculativeDecoderCuda() = default;

void SpeculativeDecoderCuda::check_setup() {
  if (has_drafter_) {
    drafter_check_target(dcfg_, tcfg_);
    DFLASH_CHECK(dcfg_.head_dim == 64 || dcfg_.head_dim == 128,
                 "the CUDA attention supports head_dim 64 or 128 (drafter: head_dim {})",
                 dcfg_.head_dim);
  }
  DFLASH_CHECK(limits_.max_batch >= 1 && limits_.max_context >= 2 && limits_.max_prefill >= 1,
               "SpeculativeDecoderCuda: bad limits (max_batch {}, max_context {}, max_prefill {})",
               limits_.max_batch, limits_.max_context, limits_.max_prefill);
  DFLASH_CHECK(int64_t{limits_.max_batch} * (limits_.max_context + kSlotAlign) <=
                   std::numeric_limits<int32_t>::max(),
               "SpeculativeDecoderCuda: {} requests × {} tokens of context overflow int32 slots",
               limits_.max_batch, limits_.max_context);
  if (has_drafter_ && DecodeHeadsCuda::handles(dcfg_) && !heads_)
    heads_ = std::make_unique<DecodeHeadsCuda>(dcfg_, limits_.max_batch);
  step_rows_ = int64_t{limits_.max_batch} * round_up(verify_width(dcfg_.block_size), kQueryTile);
  max_rows_ = std::max<int64_t>(limits_.max_prefill, step_rows_);
  stride_ = round_up(limits_.max_context, kSlotAlign);
}

void SpeculativeDecoderCuda::init() {
  taps_ids_.assign(dcfg_.target_layer_ids.begin(), dcfg_.target_layer_ids.end());
  if (has_drafter_) dscaling_ = static_cast<float>(rope_attention_scaling(dcfg_.rope));
  if (has_drafter_ && dcfg_.dflash2.enabled)
    d2_ = std::make_unique<Dflash2DecodeCuda>(dcfg_, step_rows_);
  plan_and_take();
  const int64_t KB = int64_t{limits_.max_batch} * (verify_width(dcfg_.block_size) + 1);
  out_h_ = cuda::PinnedBuffer(static_cast<size_t>(KB) * sizeof(int32_t));
  first_h_ = cuda::PinnedBuffer(sizeof(int32_t));
  active_h_ = cuda::PinnedBuffer(static_cast<size_t>(limits_.max_batch) * sizeof(int32_t));
  tokens_h_ = cuda::PinnedBuffer(static_cast<size_t>(max_rows_) * sizeof(int32_t));
  sparams_h_ = cuda::PinnedBuffer(sizeof(SampleParamsDevice));
  std::memset(active_h_.as<int32_t>(), 0, active_h_.bytes());
  DFLASH_CUDA_CHECK(cudaMemsetAsync(active_, 0, active_h_.bytes(), ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(lens_, 0, active_h_.bytes(), ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(zero_, 0, sizeof(int32_t), ctx_.stream()));
  DFLASH_CUDA_CHECK(
      cudaMemsetAsync(seeds_, 0, limits_.max_batch * sizeof(uint64_t), ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(steps_, 0, active_h_.bytes(), ctx_.stream()));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(status_, 0, active_h_.bytes(), ctx_.stream()));
}

// Every buffer of the decoder in one plan (one phase: all live for the whole decoding).
void SpeculativeDecoderCuda::plan_and_take() {
  // Kmax: the verify rows per request of the largest step (DSpark's block size + 1).
  const int64_t H = tcfg_.hidden_size, V = tcfg_.vocab_size, Kmax = verify_width(dcfg_.block_size);
  const int64_t KD = tcfg_.num_key_value_heads * tcfg_.head_dim;
  const int64_t QDd = dcfg_.num_heads * dcfg_.head_dim, KDd = dcfg_.num_kv_heads * dcfg_.head_dim;
  const int64_t Id = dcfg_.intermediate_size, F = dcfg_.n_taps() * H;
  const int64_t S = int64_t{limits_.max_batch} * stride_;  // cache rows
  const int64_t R = max_rows_, BK = step_rows_, B = limits_.max_batch;
  std::vector<Want> w;
  const int64_t NL = tcfg_.num_hidden_layers, NLd = dcfg_.num_layers;
  tcache_.k.assign(static_cast<size_t>(NL), nullptr);
  tcache_.v.assign(static_cast<size_t>(NL), nullptr);
  tcache_.rows = S;
  for (int64_t l = 0; l < NL; ++l) {
    const auto i = static_cast<size_t>(l);
    w.push_back(want(fmt::format("decode.target_cache.{}.k", l), S * KD, &tcache_.k[i]));
    w.push_back(want(fmt::format("decode.target_cache.{}.v", l), S * KD, &tcache_.v[i]));
  }
  // The drafter's weights, caches and block buffers (none without a drafter: NLd = 0, no taps).
  dk_cache_.assign(static_cast<size_t>(NLd), nullptr);
  dv_cache_.assign(static_cast<size_t>(NLd), nullptr);
  dlayers_.resize(static_cast<size_t>(NLd));
  for (int64_t l = 0; l < NLd; ++l) {
    const auto i = static_cast<size_t>(l);
    const std::string n = fmt::format("decode.drafter.layers.{}.", l);
    w.push_back(want(fmt::format("decode.drafter_cache.{}.k", l), S * KDd, &dk_cache_[i]));
    w.push_back(want(fmt::format("decode.drafter_cache.{}.v", l), S * KDd, &dv_cache_[i]));
    DrafterLayer& d = dlayers_[i];
    w.push_back(want(n + "in_norm", H, &d.in_norm));
    w.push_back(want(n + "post_norm", H, &d.post_norm));
    w.push_back(want(n + "q_norm", dcfg_.head_dim, &d.q_norm));
    w.push_back(want(n + "k_norm", dcfg_.head_dim, &d.k_norm));
    w.push_back(want(n + "wqkv", (QDd + 2 * KDd) * H, &d.wqkv));
    w.push_back(want(n + "wo", H * QDd, &d.wo));
    w.push_back(want(n + "wgu", 2 * Id * H, &d.wgu));
    w.push_back(want(n + "wdown", H * Id, &d.wdown));
  }
  w.push_back(want("decode.target.final_norm", H, &final_norm_));
  if (has_drafter_) {
    w.push_back(want("decode.drafter.fc", H * F, &fc_));
    w.push_back(want("decode.drafter.hidden_norm", H, &hidden_norm_));
    w.push_back(want("decode.drafter.norm", H, &dnorm_));
    w.push_back(want("decode.drafter.inv_freq", dcfg_.head_dim / 2, &dinv_freq_));
  }
  if (d2_)
    d2_->plan([&](std::string n, uint64_t bytes, void** dst) {
      w.push_back(Want{std::move(n), bytes, dst});
    });
  w.push_back(want("decode.step.tokens", R, &tokens_));
  w.push_back(want("decode.step.block", BK, &block_));
  w.push_back(want("decode.step.pos", R, &pos_));
  w.push_back(want("decode.step.slots", R, &slots_));
  w.push_back(want("decode.step.causal", R, &causal_));
  w.push_back(want("decode.step.block_ranges", BK, &brange_));
  w.push_back(want("decode.step.lens", B, &lens_));
  w.push_back(want("decode.step.active", B, &active_));
  w.push_back(want("decode.step.target_argmax", BK, &targ_));
  w.push_back(want("decode.step.out", B * (Kmax + 1), &out_));
  w.push_back(want("decode.step.first", 1, &first_));
  w.push_back(want("decode.step.zero", 1, &zero_));
  // The split-key attention of the steps (a row sees at most its request's stride_ cache rows).
  split_ = DecodeStepWork{nullptr, BK, stride_};
  int64_t split_floats =
      decode_attention_work_floats(BK, tcfg_.num_attention_heads, tcfg_.head_dim, stride_);
  if (has_drafter_)
    split_floats = std::max(
        split_floats, decode_attention_work_floats(BK, dcfg_.num_heads, dcfg_.head_dim, stride_));
  w.push_back(want("decode.step.attn_split", split_floats, &split_.attn_part));
  if (has_drafter_) w.push_back(want("decode.step.taps", R * F, &taps_));
  w.push_back(want("decode.step.final_rows", BK * H, &fnorm_));
  w.push_back(want("decode.step.logits", BK * V, &logits_));
  // Sampling: the drafter's processed rows q (the target's p replace its logits in place), the
  // requests' seeds, step counts and status, the settings (ops/sample.hpp).
  w.push_back(want("decode.sample.q", B * Kmax * V, &q_));
  w.push_back(want("decode.sample.seeds", B, &seeds_));
  w.push_back(want("decode.sample.steps", B, &steps_));
  w.push_back(want("decode.sample.status", B, &status_));
  w.push_back(want("decode.sample.params", 1, &sparams_));
  if (has_drafter_) {
    w.push_back(want("decode.drafter.h", BK * H, &dh_));
    w.push_back(want("decode.drafter.ctx_pre", R * H, &dctx_pre_));
    w.push_back(want("decode.drafter.hn", R * H, &dhn_));
    w.push_back(want("decode.drafter.q", BK * QDd, &dq_));
    w.push_back(want("decode.drafter.k", R * KDd, &dk_));
    w.push_back(want("decode.drafter.v", R * KDd, &dv_));
    w.push_back(want("decode.drafter.o", BK * QDd, &do_));
    w.push_back(want("decode.drafter.gu", BK * 2 * Id, &dgu_));
    w.push_back(want("decode.drafter.act", BK * Id, &dact_));
    w.push_back(want("decode.drafter.qkv", BK * (QDd + 2 * KDd), &dqkv_));
  }
  if (heads_)
    for (DecodeHeadBuffer& x : heads_->buffers()) w.push_back(Want{x.name, x.bytes, x.dst});
  ArenaPlanner p({"decode"});
  for (const Want& x : w) p.add(x.name, "decode", x.bytes, PhaseMask{1});
  arena_ = std::make_unique<cuda::DeviceArena>(ctx_, p.finish());
  for (const Want& x : w) *x.dst = arena_->get_bytes(x.name, x.bytes);
  for (DrafterLayer& d : dlayers_) {  // q, k, v rows of the block GEMM's one weight array
    d.wq = d.wqkv;
    d.wk = d.wq + QDd * H;
    d.wv = d.wk + KDd * H;
  }
}

void SpeculativeDecoderCuda::upload_drafter(const LoadedDrafter& drafter) {
  const DrafterLayout& L = drafter.layout;
  const float* P = drafter.params.data();
  const int64_t H = dcfg_.hidden_size, Id = dcfg_.intermediate_size, D = dcfg_.head_dim;
  const int64_t QDd = dcfg_.num_heads * D, KDd = dcfg_.num_kv_heads * D;
  cuda::PinnedUploader up(ctx_);
  auto bf16 = [&](uint16_t* dst, int64_t offset, int64_t n) {
    up.upload(dst, static_cast<size_t>(n) * 2, [P, offset](void* out, size_t off, size_t bytes) {
      auto* o = static_cast<uint16_t*>(out);
      const float* src = P + offset + static_cast<int64_t>(off / 2);
      for (size_t i = 0; i < bytes / 2; ++i) o[i] = f32_to_bf16_bits(src[i]);
    });
  };
  auto f32 = [&](float* dst, int64_t offset, int64_t n) {
    up.upload(dst, P + offset, static_cast<size_t>(n) * sizeof(float));
  };
  bf16(fc_, L.fc, H * dcfg_.n_taps() * H);
  f32(hidden_norm_, L.hidden_norm, H);
  f32(dnorm_, L.norm, H);
  for (size_t l = 0; l < dlayers_.size(); ++l) {
    const DrafterLayerOffsets& o = L.layers[l];
    const DrafterLayer& d = dlayers_[l];
    f32(d.in_norm, o.input_layernorm, H);
    f32(d.post_norm, o.post_attention_layernorm, H);
    f32(d.q_norm, o.q_norm, D);
    f32(d.k_norm, o.k_norm, D);
    bf16(d.wq, o.q_proj, QDd * H);
    bf16(d.wk, o.k_proj, KDd * H);
    bf16(d.wv, o.v_proj, KDd * H);
    bf16(d.wo, o.o_proj, H * QDd);
    DFLASH_CHECK(o.up_proj == o.gate_proj + Id * H,
                 "drafter layout: layer {} up_proj does not follow gate_proj", l);
    bf16(d.wgu, o.gate_proj, 2 * Id * H);  // [gate; up]
    bf16(d.wdown, o.down_proj, H * Id);
  }
  if (d2_) d2_->upload(up, L, P);
  const std::vector<double> f = rope_inv_freq(dcfg_.rope, D);
  const std::vector<float> ff(f.begin(), f.end());
  up.upload(dinv_freq_, ff.data(), ff.size() * sizeof(float));
  if (heads_) heads_->upload(up, drafter);
  up.finish();
}

void SpeculativeDecoderCuda::random_drafter(uint64_t seed) {
  const int64_t H = dcfg_.hidden_size, Id = dcfg_.intermediate_size, D = dcfg_.head_dim;
  const int64_t QDd = dcfg_.num_heads * D, KDd = dcfg_.num_kv_heads * D;
  const float bound = 0.02f * std::sqrt(3.0f);  // uniform with standard deviation 0.02
  uint64_t stream = seed;
  auto matrix = [&](uint16_t* w, int64_t n) {
    fill_uniform_cuda(ctx_, w, n, 0.0f, bound, ++stream);
  };
  auto ones = [&](float* w, int64_t n) { fill_uniform_cuda(ctx_, w, n, 1.0f, 0.0f, ++stream); };
  matrix(fc_, H * dcfg_.n_taps() * H);
  ones(hidden_norm_, H);
  ones(dnorm_, H);
  for (const DrafterLayer& d : dlayers_) {
    ones(d.in_norm, H);
    ones(d.post_norm, H);
    ones(d.q_norm, D);
    ones(d.k_norm, D);
    matrix(d.wq, QDd * H);
    matrix(d.wk, KDd * H);
    matrix(d.wv, KDd * H);
    matrix(d.wo, H * QDd);
    matrix(d.wgu, 2 * Id * H);
    matrix(d.wdown, H * Id);
  }
  if (d2_) d2_->randomize(ctx_, stream);
  const std::vector<double> f = rope_inv_freq(dcfg_.rope, D);
  const std::vector<float> ff(f.begin(), f.end());
  cuda::PinnedUploader up(ctx_);
  up.upload(dinv_freq_, ff.data(), ff.size() * sizeof(float));
  up.finish();
  if (heads_) heads_->randomize(ctx_, stream);
}

int SpeculativeDecoderCuda::verify_width(int K) const {
  return has_drafter_ ? DecodeHeadsCuda::verify_width(dcfg_, K) : K;
}

void SpeculativeDecoderCuda::set_sampling(const DecodeOptions& opts) {
  sampled_ = !opts.sampling.greedy();
  if (!sampled_) return;
  auto* sp = sparams_h_.as<SampleParamsDevice>();
  sp->inv_temperature = static_cast<float>(1.0 / opts.sampling.temperature);
  sp->top_k = static_cast<int32_t>(std::min<int64_t>(opts.sampling.top_k, tcfg_.vocab_size));
  sp->top_p = opts.sampling.top_p;
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(sparams_, sp, sizeof(SampleParamsDevice),
                                    cudaMemcpyHostToDevice, ctx_.stream()));
}

void SpeculativeDecoderCuda::pad_gemm_rows(int multiple) {
  DFLASH_CHECK(multiple >= 1 && multiple <= kMaxRowPad,
               "pad_gemm_rows: a multiple of {} rows is outside [1, {}]", multiple, kMaxRowPad);
  row_pad_ = multiple;
}

int64_t SpeculativeDecoderCuda::gemm_rows(int64_t rows) const {
  return round_up(rows, row_pad_);
}

// ---- device work ----

void SpeculativeDecoderCuda::target_logits(int64_t first_row, int64_t rows, int64_t gemm_rows) {
  const int64_t H = tcfg_.hidden_size, V = tcfg_.vocab_size;
  rmsnorm_fwd_cuda(ctx_, fnorm_, static_cast<float*>(nullptr), target_->residual() + first_row * H,
                   final_norm_, rows, H, tcfg_.rms_norm_eps);
  gemm_bf16_cuda(ctx_, logits_, DType::f32, V, fnorm_, H, false, target_->lm_head(), H, true,
                 gemm_rows, V, H);
}

void SpeculativeDecoderCuda::target_logits_argmax(int32_t* out, int64_t first_row, int64_t rows,
                                                  int64_t gemm_rows) {
  target_logits(first_row, rows, gemm_rows);
  argmax_rows_cuda(ctx_, out, logits_, rows, tcfg_.vocab_size);
}

// The drafter's context rows: ctx = hidden_norm(fc(taps)) → per layer k (k_norm, RoPE) and v
// into the drafter cache at slots_ (positions pos_), for rows [0, R) of taps_.
void SpeculativeDecoderCuda::drafter_extend(int64_t R) {
  const int64_t H = dcfg_.hidden_size, D = dcfg_.head_dim, NKV = dcfg_.num_kv_heads;
  const int64_t KDd = NKV * D, F = dcfg_.n_taps() * H;
  const double eps = dcfg_.rms_norm_eps;
  linear_fwd_cuda(ctx_, dctx_pre_, taps_, fc_, R, F, H);
  rmsnorm_fwd_cuda(ctx_, dhn_, static_cast<float*>(nullptr), dctx_pre_, hidden_norm_, R, H, eps);
  for (size_t l = 0; l < dlayers_.size(); ++l) {
    const DrafterLayer& d = dlayers_[l];
    linear_fwd_cuda(ctx_, dk_, dhn_, d.wk, R, H, KDd);
    rmsnorm_fwd_cuda(ctx_, dk_, static_cast<float*>(nullptr), dk_, d.k_norm, R * NKV, D, eps);
    rope_fwd_cuda(ctx_, dk_, dk_, pos_, dinv_freq_, dscaling_, R, NKV, D);
    linear_fwd_cuda(ctx_, dv_, dhn_, d.wv, R, H, KDd);
    kv_scatter_cuda(ctx_, dk_cache_[l], dk_, slots_, R, KDd);
    kv_scatter_cuda(ctx_, dv_cache_[l], dv_, slots_, R, KDd);
  }
}

// The drafter's block forward over [anchor, MASK × (K−1)] of requests [0, B) (block_), attending
// to each request's context rows and its own block (brange_), then its proposals into block_
// (DFlash2: the conv around each sublayer and the selector walk, infer/decoder_cuda_dflash2.hpp).
void SpeculativeDecoderCuda::draft_block(int B, int K) {
  const int64_t H = dcfg_.hidden_size, D = dcfg_.head_dim, V = dcfg_.vocab_size;
  const int64_t NH = dcfg_.num_heads, NKV = dcfg_.num_kv_heads, Id = dcfg_.intermediate_size;
  const int64_t QD = NH * D, KD = NKV * D, R = int64_t{B} * K;
  const double eps = dcfg_.rms_norm_eps;
  AttnParams ap{R, tcache_.rows, NH, NKV, D, 1.0 / std::sqrt(static_cast<double>(D))};
  QkvPrepare prep{R, NH, NKV, D, nullptr, nullptr, eps, pos_, dinv_freq_, dscaling_};
  // The layer projections as the target's in a step: decode_linear_cuda (row bits independent of
  // the row count) where the widths allow it, else cuBLASLt.
  const bool row_gemm = split_.row_gemm && H % 64 == 0 && QD % 64 == 0 && Id % 64 == 0;
  auto project = [&](uint16_t* y, const uint16_t* in, const uint16_t* w, int64_t IN, int64_t OUT) {
    if (row_gemm)
      decode_linear_cuda(ctx_, y, in, w, R, IN, OUT, false);
    else
      linear_fwd_cuda(ctx_, y, in, w, R, IN, OUT);
  };
  // y [R, H] f32 += in·Wᵀ.
  auto project_into = [&](float* y, const uint16_t* in, const uint16_t* w, int64_t IN) {
    if (row_gemm)
      decode_linear_cuda(ctx_, y, in, w, R, IN, H, true);
    else
      gemm_bf16_cuda(ctx_, y, DType::f32, H, in, IN, false, w, IN, true, R, H, IN, 1.0f, 1.0f);
  };
  // The residual stream h: dh_ += the sublayer's output; DFlash2 (d2_) writes h + post-conv(y)
  // into the other of dh_ and its second buffer (two sublayers a layer: each layer starts on dh_).
  float* h = dh_;
  auto sublayer_in = [&](size_t l, int sub) -> const uint16_t* {
    return d2_ ? d2_->pre(ctx_, static_cast<int64_t>(l), sub, dhn_, B, K) : dhn_;
  };
  auto sublayer_out = [&](size_t l, int sub, const uint16_t* in, const uint16_t* w, int64_t IN) {
    if (!d2_) {
      project_into(dh_, in, w, IN);
      return;
    }
    // y = 0 + in·Wᵀ: the residual projection's GEMM (beta 1), whose rows have the same bits at
    // every row count as the plain drafter's (file comment of decoder_cuda.hpp).
    DFLASH_CUDA_CHECK(
        cudaMemsetAsync(d2_->y(), 0, static_cast<size_t>(R * H) * sizeof(float), ctx_.stream()));
    project_into(d2_->y(), in, w, IN);
    float* next = h == dh_ ? d2_->residual2() : dh_;
    d2_->post(ctx_, static_cast<int64_t>(l), sub, next, h, B, K);
    h = next;
  };
  const int32_t* input = heads_ ? heads_->drafter_input(ctx_, block_, B, K, dcfg_.mask_token_id)
                                : block_;  // DSpark: [anchor, MASK…] from its K + 1 verify rows
  embedding_fwd_cuda(ctx_, dh_, target_->embed(), input, R, V, H);
  for (size_t l = 0; l < dlayers_.size(); ++l) {
    const DrafterLayer& d = dlayers_[l];
    rmsnorm_fwd_cuda(ctx_, dhn_, static_cast<float*>(nullptr), h, d.in_norm, R, H, eps);
    project(dqkv_, sublayer_in(l, 0), d.wqkv, H, QD + 2 * KD);
    // q/k norms and RoPE; the block's k/v rows sit after the context in the cache for this
    // forward only (the extend of the step overwrites them with the accepted context rows).
    prep.q_norm = d.q_norm;
    prep.k_norm = d.k_norm;
    qkv_prepare_cuda(ctx_, dq_, nullptr, dk_cache_[l], dv_cache_[l], slots_, dqkv_, prep);
    decode_attention_cuda(ctx_, do_, dq_, dk_cache_[l], dv_cache_[l], brange_, ap, split_.attn_part,
                          split_.max_keys);
    sublayer_out(l, 0, do_, d.wo, QD);
    rmsnorm_fwd_cuda(ctx_, dhn_, static_cast<float*>(nullptr), h, d.post_norm, R, H, eps);
    project(dgu_, sublayer_in(l, 1), d.wgu, H, 2 * Id);
    swiglu_fwd_cuda(ctx_, dact_, dgu_, dgu_ + Id, R, Id, 2 * Id);
    sublayer_out(l, 1, dact_, d.wdown, Id);
  }
  rmsnorm_fwd_cuda(ctx_, fnorm_, static_cast<float*>(nullptr), h, dnorm_, R, H, eps);
  gemm_bf16_cuda(ctx_, logits_, DType::f32, V, fnorm_, H, false, target_->lm_head(), H, true, R, V,
                 H);
  if (d2_) {  // the selector walk: proposals (and sampled, their q rows) from prev₁ = the anchor
    d2_->walk(ctx_, logits_, fnorm_, block_, q_, seeds_, steps_, status_, sparams_, B, K, sampled_);
    return;
  }
  if (heads_) {  // DSpark's or Domino's sequential head: the proposals slot by slot
    heads_->walk(ctx_, B, K,
                 HeadWalkIo{logits_, fnorm_, target_->embed(), block_, sampled_, q_, seeds_, steps_,
                            sparams_, status_});
    return;
  }
  if (!sampled_) {
    draft_propose_cuda(ctx_, block_, logits_, B, K, V);
    return;
  }
  sample_probs_cuda(ctx_, q_, logits_, R, V, K, sparams_, status_, K);
  sample_drafts_cuda(ctx_, block_, q_, seeds_, steps_, B, K, V);
}

void SpeculativeDecoderCuda::enqueue_step_eager(int B, int Kd, bool speculative) {
  // Kd: the drafter's block; K: the verify rows per request (Kd + 1 for DSpark, else Kd).
  const int K = speculative ? verify_width(Kd) : Kd;
  const int64_t R = int64_t{B} * K;
  decode_rows_cuda(ctx_, pos_, slots_, causal_, brange_, lens_, B, Kd, 0, stride_);
  if (speculative) draft_block(B, Kd);
  if (K != Kd) decode_rows_cuda(ctx_, pos_, slots_, causal_, nullptr, lens_, B, K, 0, stride_);
  const std::span<const int> taps =
      speculative ? std::span<const int>(taps_ids_) : std::span<const int>();
  const int64_t Rg = gemm_rows(R);
  target_->forward_cached(speculative ? taps_ : nullptr, block_, pos_, slots_, causal_, R, Rg, taps,
                          tcache_, &split_);
  if (sampled_) {
    target_logits(0, R, Rg);
    sample_probs_cuda(ctx_, logits_, logits_, R, tcfg_.vocab_size, 0, sparams_, status_, K);
  } else {
    target_logits_argmax(targ_, 0, R, Rg);
  }
  if (speculative) drafter_extend(R);
  if (sampled_)
    spec_sample_accept_cuda(ctx_, out_, lens_, block_, steps_, logits_, q_, seeds_, status_,
                            active_, B, K, tcfg_.vocab_size, dcfg_.mask_token_id);
  else
    greedy_accept_cuda(ctx_, out_, lens_, block_, targ_, active_, B, K, dcfg_.mask_token_id);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(out_h_.as<int32_t>(), out_,
                                    static_cast<size_t>(B) * (K + 1) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, ctx_.stream()));
}

void SpeculativeDecoderCuda::enqueue_step(int B, int K, bool speculative) {
  if (!use_graphs_) {
    enqueue_step_eager(B, K, speculative);
    return;
  }
  graphs_.run(std::make_tuple(B, K, speculative ? 1 : 0, row_pad_, split_.row_gemm, sampled_),
              ctx_.stream(), [&] { enqueue_step_eager(B, K, speculative); });
}

int32_t SpeculativeDecoderCuda::prefill(int b, std::span<const int32_t> prompt, int K,
                                        bool speculative, uint64_t seed) {
  const auto P = static_cast<int64_t>(prompt.size());
  std::memcpy(tokens_h_.as<int32_t>(), prompt.data(), prompt.size() * sizeof(int32_t));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(tokens_, tokens_h_.as<int32_t>(),
                                    prompt.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                    ctx_.stream()));
  // Rows of request b from an empty cache (lens read as 0 from zero_).
  decode_rows_cuda(ctx_, pos_, slots_, causal_, nullptr, zero_, 1, P, b, stride_);
  const std::span<const int> taps =
      speculative ? std::span<const int>(taps_ids_) : std::span<const int>();
  target_->forward_cached(speculative ? taps_ : nullptr, tokens_, pos_, slots_, causal_, P, P, taps,
                          tcache_);
  if (sampled_) {
    const int64_t V = tcfg_.vocab_size;
    target_logits(P - 1, 1, 1);
    DFLASH_CUDA_CHECK(cudaMemsetAsync(status_ + b, 0, sizeof(int32_t), ctx_.stream()));
    sample_probs_cuda(ctx_, logits_, logits_, 1, V, 0, sparams_, status_ + b, 1);
    sample_first_cuda(ctx_, first_, logits_, seeds_, steps_, status_, b, seed, V);
  } else {
    target_logits_argmax(first_, P - 1, 1, 1);
  }
  if (speculative) drafter_extend(P);
  decode_admit_cuda(ctx_, lens_, active_, block_, first_, b, speculative ? verify_width(K) : K, P,
                    dcfg_.mask_token_id);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(first_h_.as<int32_t>(), first_, sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
  return *first_h_.as<int32_t>();
}

// ---- host loop ----

void SpeculativeDecoderCuda::check_sample_status(int32_t value, int64_t request) const {
  if (value >= 0) return;
  DFLASH_CHECK(value != -kSampleStatusNan,
               "request {}: sampling met a NaN logit (the target's or the drafter's logits)",
               request);
  DFLASH_CHECK(value != -kSampleStatusNoFinite,
               "request {}: sampling met a logits row with no finite logit (the target's or the "
               "drafter's)",
               request);
  DFLASH_CHECK(false, "request {}: CUDA sampling returned the unknown status {}", request, -value);
}

int SpeculativeDecoderCuda::check_call(std::span<const std::vector<int32_t>> prompts,
                                       const DecodeOptions& opts, int batch_size,
                                       bool speculative) const {
  DFLASH_CHECK(batch_size >= 1, "batch size must be >= 1 (got {})", batch_size);
  DFLASH_CHECK(opts.max_new_tokens >= 1, "max_new_tokens must be >= 1 (got {})",
               opts.max_new_tokens);
  opts.sampling.validate();
  int K = 1;
  if (speculative) {
    K = opts.block_size == 0 ? dcfg_.block_size : opts.block_size;
    DFLASH_CHECK(K >= 2 && K <= dcfg_.block_size,
                 "block size {} is outside [2, {}] (the drafter was trained with block_size {})",
                 opts.block_size, dcfg_.block_size, dcfg_.block_size);
    if (d2_) d2_->check_block(K);
  }
  const int B = std::min<int>(batch_size, static_cast<int>(prompts.size()));
  DFLASH_CHECK(B <= limits_.max_batch,
               "batch size {} exceeds the {} requests the CUDA decoder was planned for", B,
               limits_.max_batch);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto P = static_cast<int64_t>(prompts[i].size());
    DFLASH_CHECK(P >= 1, "request {}: empty prompt", i);
    for (int32_t t : prompts[i])
      DFLASH_CHECK(t >= 0 && t < tcfg_.vocab_size,
                   "request {}: token {} is outside the vocabulary [0, {})", i, t,
                   tcfg_.vocab_size);
    DFLASH_CHECK(P <= limits_.max_prefill,
                 "request {}: prompt of {} tokens, the CUDA decoder was planned for {}", i, P,
                 limits_.max_prefill);
    DFLASH_CHECK(P + opts.max_new_tokens + K <= limits_.max_context,
                 "request {}: prompt {} + max_new_tokens {} + block {} tokens exceed the {} "
                 "tokens of context the CUDA decoder was planned for",
                 i, P, opts.max_new_tokens, K, limits_.max_context);
  }
  return K;
}

std::vector<DecodeResult> SpeculativeDecoderCuda::run(std::span<const std::vector<int32_t>> prompts,
                                                      const DecodeOptions& opts, int batch_size,
                                                      const BatchTokenCallback& on_tokens,
                                                      bool speculative) {
  const int K = check_call(prompts, opts, batch_size, speculative);
  std::vector<DecodeResult> results(prompts.size());
  if (prompts.empty()) return results;
  const int B = std::min<int>(batch_size, static_cast<int>(prompts.size()));
  // Sampling for this call only (bench_prefill and draft_logits are greedy): the settings go to
  // the device before the first prefill.
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{sampled_};
  set_sampling(opts);
  std::vector<Slot> slots(static_cast<size_t>(B));
  int32_t* active = active_h_.as<int32_t>();
  size_t next = 0;
  bool active_dirty = true;
  // Emits `toks` for the request in slot b; on its end, the slot takes the next request.
  auto finish = [&](int b) {
    Slot& s = slots[static_cast<size_t>(b)];
    DecodeResult& r = results[static_cast<size_t>(s.request)];
    r.decode_seconds = now_seconds() - s.t_first;
    s.request = -1;
    active[b] = 0;
    active_dirty = true;
  };
  auto emit = [&](int b, std::span<const int32_t> toks) {
    Slot& s = slots[static_cast<size_t>(b)];
    DecodeResult& r = results[static_cast<size_t>(s.request)];
    const size_t before = r.tokens.size();
    bool done = false;
    const size_t n = decode_result_append(r, toks, opts, done);
    if (on_tokens && n > 0)
      on_tokens(static_cast<size_t>(s.request), std::span<const int32_t>(r.tokens).subspan(before));
    return done;
  };
  auto admit = [&](int b) {
    while (next < prompts.size()) {
      Slot& s = slots[static_cast<size_t>(b)];
      s.request = static_cast<int64_t>(next++);
      s.t_start = now_seconds();
      const uint64_t seed = opts.seed + static_cast<uint64_t>(s.request);
      const int32_t first =
          prefill(b, prompts[static_cast<size_t>(s.request)], K, speculative, seed);
      check_sample_status(first, s.request);
      s.t_first = now_seconds();
      results[static_cast<size_t>(s.request)].prefill_seconds = s.t_first - s.t_start;
      active[b] = 1;
      active_dirty = true;
      if (!emit(b, std::span<const int32_t>(&first, 1))) return;
      finish(b);  // done on its first token: the slot takes the next request
    }
  };
  for (int b = 0; b < B; ++b) {
    active[b] = 0;
    admit(b);
  }
  const int32_t* out = out_h_.as<int32_t>();
  const int Kv = speculative ? verify_width(K) : K;  // verify rows per request
  for (;;) {
    if (std::none_of(active, active + B, [](int32_t a) { return a != 0; })) break;
    if (active_dirty) {
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(active_, active, static_cast<size_t>(B) * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, ctx_.stream()));
      active_dirty = false;
    }
    enqueue_step(B, K, speculative);
    ctx_.synchronize();
    for (int b = 0; b < B; ++b) {
      if (!active[b]) continue;
      const int32_t* o = out + static_cast<size_t>(b) * (Kv + 1);
      check_sample_status(o[0], slots[static_cast<size_t>(b)].request);
      DFLASH_CHECK(o[0] >= 1 && o[0] <= Kv, "CUDA decoder: step output count {} for slot {}", o[0],
                   b);
      if (speculative)
        results[static_cast<size_t>(slots[static_cast<size_t>(b)].request)]
            .accept_lengths.push_back(o[0]);
      if (!emit(b, std::span<const int32_t>(o + 1, static_cast<size_t>(o[0])))) continue;
      finish(b);
      admit(b);
    }
  }
  return results;
}

std::vector<DecodeResult> SpeculativeDecoderCuda::generate(
    std::span<const std::vector<int32_t>> prompts, const DecodeOptions& opts, int batch_size,
    const BatchTokenCallback& on_tokens) {
  check_drafter("generate");
  return run(prompts, opts, batch_size, on_tokens, true);
}

std::vector<DecodeResult> SpeculativeDecoderCuda::target_generate(
    std::span<const std::vector<int32_t>> prompts, const DecodeOptions& opts, int batch_size,
    const BatchTokenCallback& on_tokens) {
  return run(prompts, opts, batch_size, on_tokens, false);
}

// ---- bench hooks ----

void SpeculativeDecoderCuda::check_drafter(const char* what) const {
  DFLASH_CHECK(has_drafter_,
               "SpeculativeDecoderCuda::{}: this decoder was made without a drafter (target-only); "
               "speculative decoding needs one (target_generate decodes without)",
               what);
}

void SpeculativeDecoderCuda::bench_prefill(int B, std::span<const int32_t> prompt) {
  check_drafter("bench_prefill");
  DFLASH_CHECK(B >= 1 && B <= limits_.max_batch && !prompt.empty() &&
                   static_cast<int64_t>(prompt.size()) <= limits_.max_prefill,
               "bench_prefill: {} requests of {} tokens for limits of {} × {}", B, prompt.size(),
               limits_.max_batch, limits_.max_prefill);
  for (int b = 0; b < B; ++b) prefill(b, prompt, dcfg_.block_size, true, 0);
}

std::vector<float> SpeculativeDecoderCuda::draft_logits(std::span<const int32_t> prompt, int K,
                                                        int32_t& first) {
  check_drafter("draft_logits");
  DFLASH_CHECK(K >= 2 && K <= dcfg_.block_size && !prompt.empty() &&
                   static_cast<int64_t>(prompt.size()) <= limits_.max_prefill &&
                   static_cast<int64_t>(prompt.size()) + K <= limits_.max_context,
               "draft_logits: a prompt of {} tokens, block size {} (limits: prompt {}, context {}, "
               "block {})",
               prompt.size(), K, limits_.max_prefill, limits_.max_context, dcfg_.block_size);
  if (d2_) d2_->check_block(K);
  first = prefill(0, prompt, K, true, 0);
  decode_rows_cuda(ctx_, pos_, slots_, causal_, brange_, lens_, 1, K, 0, stride_);
  draft_block(1, K);
  std::vector<float> out(static_cast<size_t>(K * tcfg_.vocab_size));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(out.data(), logits_, out.size() * sizeof(float),
                                    cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.synchronize();
  return out;
}

SpeculativeDecoderCuda::DraftProbe SpeculativeDecoderCuda::draft_first_block(
    std::span<const int32_t> prompt, int K, const DecodeOptions& opts) {
  check_drafter("draft_first_block");
  DFLASH_CHECK(K >= 2 && K <= dcfg_.block_size && !prompt.empty() &&
                   static_cast<int64_t>(prompt.size()) <= limits_.max_prefill &&
                   static_cast<int64_t>(prompt.size()) + K <= limits_.max_context,
               "draft_first_block: a prompt of {} tokens, block size {} (limits: prompt {}, "
               "context {}, block {})",
               prompt.size(), K, limits_.max_prefill, limits_.max_context, dcfg_.block_size);
  if (d2_) d2_->check_block(K);
  opts.sampling.validate();
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{sampled_};
  set_sampling(opts);
  const int32_t first = prefill(0, prompt, K, true, opts.seed);
  check_sample_status(first, 0);
  decode_rows_cuda(ctx_, pos_, slots_, causal_, brange_, lens_, 1, K, 0, stride_);
  draft_block(1, K);
  const int64_t V = tcfg_.vocab_size, H = dcfg_.hidden_size;
  DraftProbe p;
  p.block.resize(static_cast<size_t>(K));
  p.logits.resize(static_cast<size_t>(K * V));
  std::vector<uint16_t> hf(static_cast<size_t>(K * H));
  p.q.resize(sampled_ ? static_cast<size_t>(K * V) : 0);
  auto fetch = [&](void* dst, const void* src, size_t bytes) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream()));
  };
  fetch(p.block.data(), block_, p.block.size() * sizeof(int32_t));
  fetch(p.logits.data(), logits_, p.logits.size() * sizeof(float));
  fetch(hf.data(), fnorm_, hf.size() * sizeof(uint16_t));
  if (sampled_) fetch(p.q.data(), q_, p.q.size() * sizeof(float));
  ctx_.synchronize();
  p.hf.resize(hf.size());
  for (size_t i = 0; i < hf.size(); ++i) p.hf[i] = bf16_bits_to_f32(hf[i]);
  return p;
}

void SpeculativeDecoderCuda::bench_enqueue(BenchPart part, int B, int K) {
  check_drafter("bench_enqueue");
  DFLASH_CHECK(!heads_,
               "bench_enqueue: the bench parts time DFlash blocks; a DSpark or Domino drafter's "
               "head walk is timed only inside decoding");
  DFLASH_CHECK(B >= 1 && B <= limits_.max_batch && K >= 1 && K <= dcfg_.block_size &&
                   (part == BenchPart::target_step || K >= 2),
               "bench_enqueue: B={} K={} for limits of {} requests, block size {}", B, K,
               limits_.max_batch, dcfg_.block_size);
  if (d2_ && part != BenchPart::target_step) d2_->check_block(K);
  auto work = [this, part, B, K] {
    const int64_t R = int64_t{B} * K;
    decode_rows_cuda(ctx_, pos_, slots_, causal_, brange_, lens_, B, K, 0, stride_);
    if (part != BenchPart::target_step) draft_block(B, K);
    if (part == BenchPart::draft) return;
    const bool taps = part == BenchPart::spec_step;
    const int64_t Rg = gemm_rows(R);
    target_->forward_cached(taps ? taps_ : nullptr, block_, pos_, slots_, causal_, R, Rg,
                            taps ? std::span<const int>(taps_ids_) : std::span<const int>(),
                            tcache_, &split_);
    target_logits_argmax(targ_, 0, R, Rg);
    if (taps) drafter_extend(R);
  };
  if (!use_graphs_) {
    work();
    return;
  }
  graphs_.run(
      std::make_tuple(B, K, 2 + static_cast<int>(part), row_pad_, split_.row_gemm, sampled_),
      ctx_.stream(), work);
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
