// dflash.cpp — speculative decoding on the CUDA backend: the Decoder contract (infer/decoder.hpp)
// with the target, the drafter, their KV caches, acceptance (greedy or exact speculative sampling)
// and rollback on the GPU.
//
// One step of a batch of B requests with block size K (speculative.hpp describes it for one
// request; here every request of the batch takes it at once, each with its own length):
//   rows:    positions lens[b] + j, cache slots and key ranges of the B·K rows (ops/decode.hpp);
//   draft:   the drafter's block [anchor, MASK × (K−1)] over its context cache → proposals written
//            into the block (greedy: argmax; sampling: drawn from the processed rows q_k; a DFlash2
//            drafter: its conv around each sublayer, then the selector walk over slots 1..K−1,
//            infer/decoder_cuda_dflash2.hpp);
//   verify:  the target over [anchor, d_1 … d_{K−1}] with its KV cache (causal), the taps of its
//            tap layers, final norm and LM head of the K rows, argmax (sampling: the processed
//            distributions p_k, in place of the logits);
//   extend:  the drafter's context cache gets the K rows' projected taps at their positions;
//   accept:  greedy_accept_cuda (sampling: spec_sample_accept_cuda, the rejection rule of
//            ops/sample.hpp): n accepted, the bonus, lens[b] += n + 1 (rollback is the length:
//            rows past it are overwritten by the next step), the next block [bonus, MASK…];
//   copy:    the B·(K+1) ints of the step's output (count and tokens) to pinned host memory, the
//            step's only host transfer.
// Target-only decoding is the same step with K = 1 and no draft/extend.
// A DSpark or Domino drafter's proposals come from its sequential head, walked slot by slot on the
// device after the block forward (infer/decoder_cuda_heads.hpp); DSpark drafts all K slots, so its
// verify block is [anchor, d_0 … d_{K−1}]: K + 1 rows per request for the rows, verify, extend,
// accept and copy parts (the drafter's rows stay K), an acceptance length in [1, K + 1].
// A request is admitted into a free batch slot with its own prefill (the prompt through the target
// with the causal attention over its empty cache, the first token by argmax or drawn from p, the
// prompt's taps into the drafter's cache); the others' state stays on the device untouched.
// Sampling: request i's random numbers are philox_uniform(opts.seed + i, its step, slot, purpose)
// (core/philox.hpp, ops/sample.hpp): its output depends on neither batch_size nor the other
// requests, and a rerun with the same seed gives the same tokens (the kernels sum in a fixed
// order). The same seed does not give the CPU backend's tokens (another generator; the
// distribution is the same).
//
// Invariants: all device memory (target weights and activations, drafter weights, both KV caches
// for max_batch × max_context tokens, the step's buffers) is planned and allocated at
// construction (sampling's q rows too: max_batch × verify rows × V floats, the verify rows the
// block size, + 1 for DSpark; a DSpark or Domino head's f32 weights and one-row-per-request
// scratch; made without a drafter, the plan holds the target's part only, block size 1); a step
// allocates nothing. Each (B, K, speculative, sampled) step is captured once as a CUDA graph and
// replayed (use_graphs(false) runs the same launches eagerly); the sampling settings live in device
// memory, so one graph serves every temperature, top-k and top-p. The target's attention in a step
// is the split-key decode attention (ops/decode_fused.hpp), whose rows do not depend on the other
// rows of the launch, and the drafter's sees the same key tiles in any batch slot (its cache rows
// start on a key tile), so a request's output does not depend on batch_size as long as cuBLASLt's
// GEMM gives a row the same bits for any row count (true on the H200 for the tiny fixture at 1 to
// 32 rows; docs/design-notes.md); greedy speculative output equals greedy target-only output of
// this class (bit for bit on the H200, tests/cuda/decoder_cuda_test).
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <memory>
#include <span>
#include <tuple>
#include <vector>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/graph.hpp"
#include "backend/cuda/pinned.hpp"
#include "infer/decoder.hpp"
#include "infer/decoder_cuda_dflash2.hpp"
#include "infer/decoder_cuda_heads.hpp"
#include "model/target_cuda.hpp"
#include "ops/sample.hpp"

namespace dflash {

/// What the device memory of a SpeculativeDecoderCuda is planned for.
struct DecoderCudaLimits {
  int max_batch = 1;        ///< requests in flight at once (≥ 1)
  int64_t max_context = 0;  ///< tokens per request: prompt + max_new_tokens + block size (≥ 2)
  int64_t max_prefill = 0;  ///< longest prompt (≥ 1)
};

/// The limits that fit `prompts` decoded with up to `max_new_tokens` tokens and block size
/// `block_size` (the trained one when speculative; 1 for target-only), `batch` in flight.
DecoderCudaLimits decoder_cuda_limits(std::span<const std::vector<int32_t>> prompts,
                                      int64_t max_new_tokens, int block_size, int batch);

/// Speculative and target-only decoding of a target with a DFlash drafter on one GPU, or
/// target-only decoding without one.
class SpeculativeDecoderCuda final : public Decoder {
 public:
  /// Uploads `target` (every layer) and `drafter` to ctx's device and allocates everything for
  /// `limits`. Throws dflash::Error when the drafter does not fit the target
  /// (drafter_check_target), for what the kernels cannot run (TargetCuda's errors; a drafter
  /// head_dim other than 64/128; a DFlash2 selector_top_k or selector_rank above the walk's 1024),
  /// bad limits, or when the device lacks the memory (naming the bytes asked and free).
  SpeculativeDecoderCuda(cuda::CudaContext& ctx, const TargetModel& target,
                         const LoadedDrafter& drafter, const DecoderCudaLimits& limits);
  /// Target-only: uploads `target` and allocates the target's cache and the K = 1 step for
  /// `limits`, nothing of a drafter. target_generate decodes as with a drafter (the same bits:
  /// the target-only step does not read the drafter); generate, draft_logits and the bench hooks
  /// throw dflash::Error (no drafter). Other errors as the constructor above.
  SpeculativeDecoderCuda(cuda::CudaContext& ctx, const TargetModel& target,
                         const DecoderCudaLimits& limits);
  /// The same with random weights made on the device from `seed` (no checkpoint; for the decode
  /// bench): the target of `target_cfg`'s shapes (TargetCuda's random constructor; final norm
  /// 1) and a drafter of `drafter_cfg`'s (matrices uniform with standard deviation 0.02, norms
  /// 1, as TargetCuda's random weights).
  SpeculativeDecoderCuda(cuda::CudaContext& ctx, const ModelConfig& target_cfg,
                         const DrafterConfig& drafter_cfg, uint64_t seed,
                         const DecoderCudaLimits& limits);
  ~SpeculativeDecoderCuda() override;

  /// Decoder::generate on the GPU, greedy or sampled (file comment). Throws dflash::Error, besides
  /// the contract's errors, for a decoder made without a drafter, batch_size above the limits'
  /// max_batch, a request whose prompt or context exceeds the limits (naming its index and sizes),
  /// and a sampled logits row with a NaN or no finite logit (naming the request).
  std::vector<DecodeResult> generate(std::span<const std::vector<int32_t>> prompts,
                                     const DecodeOptions& opts, int batch_size,
                                     const BatchTokenCallback& on_tokens = {}) override;
  /// Decoder::target_generate on the GPU (errors as generate).
  std::vector<DecodeResult> target_generate(std::span<const std::vector<int32_t>> prompts,
                                            const DecodeOptions& opts, int batch_size,
                                            const BatchTokenCallback& on_tokens = {}) override;
  const char* backend() const override { return "cuda"; }

  /// Capture steps as CUDA graphs (default) or launch them one by one (the same results).
  void use_graphs(bool on) { use_graphs_ = on; }
  /// Runs the target's projection GEMMs and LM head of a step on its row count rounded up to a
  /// multiple of `multiple` (1 to 16; default 1: none) — the padded rows change no real row
  /// (TargetCuda::forward_cached) — so that cuBLASLt runs the kernel it picks for that row count
  /// (bench/cuda/decode_cuda_bench measures both). Throws dflash::Error outside [1, 16]. Takes
  /// effect for the following steps (the padding is part of a graph's key).
  void pad_gemm_rows(int multiple);
  /// Runs the layer projections of a step's target and drafter forwards on decode_linear_cuda
  /// (a row's bits do not depend on the row count, the weights stream once per 128 rows) or, off
  /// (default), on cuBLASLt, which was faster on the H200 for the Qwen3-8B shapes at batch 1 and
  /// 8 (bench/cuda/decode_cuda_bench, docs/perf-runs-decoding.md). Part of a graph's key.
  void row_gemm(bool on) { split_.row_gemm = on; }
  /// Step graphs captured so far.
  size_t graphs_captured() const { return graphs_.size(); }
  /// Bytes of the decoder's own device plan (caches, drafter, step buffers; the target's weights
  /// and activations are TargetCuda's arena).
  uint64_t state_bytes() const { return arena_->bytes(); }

  /// For `dflash bench`: the parts of a step, run on requests [0, B) whose caches hold what
  /// bench_prefill put there; nothing is accepted, so repeated runs see the same lengths.
  enum class BenchPart {
    target_step,  ///< verify of K rows (K = 1: the one-token step): target + LM head + argmax
    draft,        ///< the drafter's block forward + proposals
    spec_step,    ///< a whole speculative step, acceptance excluded
  };
  /// Prefills requests [0, B) with `prompt` each (lengths as a real prefill).
  void bench_prefill(int B, std::span<const int32_t> prompt);
  /// Enqueues `part` for (B, K) on the context's stream (graph when use_graphs) without waiting.
  void bench_enqueue(BenchPart part, int B, int K);
  cuda::CudaContext& context() { return ctx_; }

  /// For tests: prefills `prompt` into batch slot 0 (speculative, block size K) and returns the
  /// drafter's block logits [K, V] f32 of its first step (block [first token, MASK × (K−1)] at
  /// positions P..P+K−1 over the prompt's context rows), and the first token in `first` (a
  /// DFlash2 drafter's rows 1..K−1 hold ū = softcap(m·U), which its walk writes in place). Throws
  /// dflash::Error for a prompt outside the limits or K outside [2, trained block size] (DFlash2:
  /// below conv_kernel_size).
  std::vector<float> draft_logits(std::span<const int32_t> prompt, int K, int32_t& first);
  /// What draft_first_block returns: the state of the drafter's first block.
  struct DraftProbe {
    std::vector<int32_t> block;  ///< [K]: the first token, then the proposals
    std::vector<float> logits;   ///< [K, V] f32: the block logits, as draft_logits returns them
    std::vector<float> hf;       ///< [K, H]: the drafter's final-norm rows (bf16 values)
    std::vector<float> q;        ///< [K, V] f32: sampled, the q rows (row 0 unused); greedy: empty
  };
  /// For tests: prefills `prompt` into batch slot 0 (request seed opts.seed) and drafts its first
  /// block of size K as a step does, greedy or sampled as opts.sampling says. Throws dflash::Error
  /// as draft_logits, for a bad sampling setting, and for a first token the sampling could not
  /// draw.
  DraftProbe draft_first_block(std::span<const int32_t> prompt, int K, const DecodeOptions& opts);

  /// For tests: the first step of a DSpark or Domino drafter (infer/decoder_cuda_heads.hpp) on
  /// `prompt` in batch slot 0 with `opts` (block size, sampling; request seed opts.seed), drafted
  /// but not verified.
  struct DraftTrace {
    int32_t first = 0;               ///< the prefill's token (the anchor)
    std::vector<float> base_logits;  ///< U [K, V]: the drafter's block logits before the head
    std::vector<float> hidden;       ///< h [K, H]: its final-norm rows (bf16 values)
    std::vector<int32_t> proposals;  ///< the verify block after the anchor (K for DSpark, else K−1)
    std::vector<float> q;            ///< sampled: the proposals' q rows [proposals, V]
  };
  /// Throws dflash::Error for a drafter without such a head, or a prompt or block size outside
  /// the limits (as draft_logits).
  DraftTrace draft_trace(std::span<const int32_t> prompt, const DecodeOptions& opts);

 private:
  struct DrafterLayer {
    float *in_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
    // wqkv [(NH + 2·NKV)·D, H] = [Wq; Wk; Wv] (one block GEMM); wq, wk, wv point into it.
    uint16_t *wqkv = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    uint16_t *wgu = nullptr, *wdown = nullptr;  // [2I, H] = [gate; up], [H, I]
  };
  /// One request's host-side progress.
  struct Slot {
    int64_t request = -1;
    double t_start = 0, t_first = 0;  // seconds on the steady clock
  };

  /// The constructors' checks (drafter vs target, limits, head_dim); sets max_rows_.
  void check_setup();
  /// Throws dflash::Error naming `what` when the decoder was made without a drafter.
  void check_drafter(const char* what) const;
  /// Uploads the target's final norm weights (checked against hidden_size).
  void upload_final_norm(const TargetModel& target);
  /// The plan and the pinned mirrors (the target is already up).
  void init();
  void random_drafter(uint64_t seed);
  void plan_and_take();
  void upload_drafter(const LoadedDrafter& drafter);
  /// Throws the error of a negative step output or first token (−status, ops/sample.hpp) of
  /// `request`; no-op for value ≥ 0.
  void check_sample_status(int32_t value, int64_t request) const;
  /// sampled_ from opts and, when sampling, its settings to the device (sparams_).
  void set_sampling(const DecodeOptions& opts);
  /// Checks the options and the requests against the limits; returns K.
  int check_call(std::span<const std::vector<int32_t>> prompts, const DecodeOptions& opts,
                 int batch_size, bool speculative) const;
  std::vector<DecodeResult> run(std::span<const std::vector<int32_t>> prompts,
                                const DecodeOptions& opts, int batch_size,
                                const BatchTokenCallback& on_tokens, bool speculative);
  /// Prefill of `prompt` into batch slot b (block size K); returns the first token (sampled with
  /// request seed `seed` when sampled_; negative: −status).
  int32_t prefill(int b, std::span<const int32_t> prompt, int K, bool speculative, uint64_t seed);
  /// Enqueues one whole step of (B, K) (graph or eager).
  void enqueue_step(int B, int K, bool speculative);
  void enqueue_step_eager(int B, int K, bool speculative);
  /// Final norm and LM head (on `gemm_rows` ≥ rows rows) of `rows` target rows starting at
  /// residual row `first_row`, into logits_.
  void target_logits(int64_t first_row, int64_t rows, int64_t gemm_rows);
  /// target_logits, then their argmax into `out`.
  void target_logits_argmax(int32_t* out, int64_t first_row, int64_t rows, int64_t gemm_rows);
  /// `rows` rounded up to the padding multiple.
  int64_t gemm_rows(int64_t rows) const;
  void draft_block(int B, int K);
  void drafter_extend(int64_t R);
  /// Rows per request of a step's verify block of block size K (DecodeHeadsCuda::verify_width).
  int verify_width(int K) const;

  cuda::CudaContext& ctx_;
  ModelConfig tcfg_;
  DrafterConfig dcfg_;
  DecoderCudaLimits limits_;
  int64_t max_rows_ = 0;   // max(max_prefill, max_batch·trained K)
  int64_t stride_ = 0;     // cache rows per request: max_context rounded up to a key tile
  int64_t step_rows_ = 0;  // max_batch·trained K rounded up to 16 (the padded GEMM rows)
  int row_pad_ = 1;
  std::unique_ptr<TargetCuda> target_;
  std::unique_ptr<cuda::DeviceArena> arena_;
  std::vector<int> taps_ids_;
  TargetCacheCuda tcache_;
  std::vector<uint16_t*> dk_cache_, dv_cache_;
  float* final_norm_ = nullptr;
  uint16_t* fc_ = nullptr;
  float *hidden_norm_ = nullptr, *dnorm_ = nullptr, *dinv_freq_ = nullptr;
  float dscaling_ = 1.0f;
  std::vector<DrafterLayer> dlayers_;
  std::unique_ptr<DecodeHeadsCuda> heads_;  // a DSpark or Domino drafter's head, else null
  // Step buffers (device).
  int32_t *tokens_ = nullptr, *block_ = nullptr, *pos_ = nullptr, *slots_ = nullptr;
  AttnRange *causal_ = nullptr, *brange_ = nullptr;
  int32_t *lens_ = nullptr, *active_ = nullptr, *targ_ = nullptr, *out_ = nullptr;
  int32_t *first_ = nullptr, *zero_ = nullptr;
  uint16_t *taps_ = nullptr, *fnorm_ = nullptr;
  // The split-key attention workspace of the steps (target and drafter block; step_rows_ rows).
  DecodeStepWork split_;
  float* logits_ = nullptr;
  float *dh_ = nullptr, *dctx_pre_ = nullptr;
  // Sampling (ops/sample.hpp): q rows [max_batch·Kmax, V], per-request seeds, steps, status.
  float* q_ = nullptr;
  uint64_t* seeds_ = nullptr;
  int32_t *steps_ = nullptr, *status_ = nullptr;
  SampleParamsDevice* sparams_ = nullptr;
  uint16_t *dhn_ = nullptr, *dq_ = nullptr, *dk_ = nullptr, *dv_ = nullptr, *do_ = nullptr;
  uint16_t *dgu_ = nullptr, *dact_ = nullptr, *dqkv_ = nullptr;
  // Pinned host mirrors.
  cuda::PinnedBuffer out_h_, first_h_, active_h_, tokens_h_, sparams_h_;
  // DFlash2's conv and selector walk (infer/decoder_cuda_dflash2.hpp); null for other drafters.
  std::unique_ptr<Dflash2DecodeCuda> d2_;
  bool has_drafter_ = true;  // false: target-only (dcfg_ is block size 1, no layers, no taps)
  bool use_graphs_ = true;
  bool sampled_ = false;  // the call in progress samples (temperature > 0)
  // Keyed by (B, K, what: 0 target-only, 1 speculative, 2+ a BenchPart, GEMM row padding,
  // row_gemm, sampled).
  cuda::GraphCache<std::tuple<int, int, int, int, bool, bool>> graphs_;
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
