// dflash.cpp — the frozen target on the CUDA backend: the tap forward of training (DESIGN.md §2,
// "target worker"), the same model as src/model/target.hpp computed with bf16 weights and bf16
// activations at GEMM inputs, fp32 residual stream, fp32 norm statistics, softmax and routing.
//
// Every family of the CPU target runs here: Llama/Mistral/Qwen2/Qwen3 (projection and MLP biases,
// every RoPE scaling, untied heads), sliding-window layers (their key ranges are the caller's
// causal ranges narrowed on the device by attention_window_ranges_cuda), Qwen3-MoE and gpt-oss
// (attention sinks; sparse blocks through the ops/moe.hpp pipeline: router GEMM, top-k routing,
// expert-sorted dispatch and grouped tensor-core GEMMs, no per-token loop, no host round trip).
//
// Invariants: one TargetCuda belongs to one CudaContext (one thread). The weights of the layers it
// runs (the first n_layers: none past the deepest tap it is built for) are uploaded once at
// construction through pinned staging buffers with asynchronous copies (bf16; f32 checkpoints are
// rounded to bf16; biases, norms and sinks f32; MXFP4 experts arrive dequantised to bf16 by
// TargetModel::load), one descriptor per layer. Weights and activations are the "target.*"
// buffers of a memory plan (model/step_plan.hpp: plan_target_weights, plan_target_activations)
// in a DeviceArena, sized for `max_tokens`, so forward_taps allocates nothing beyond the ops'
// scratch (ctx.scratch(): the plan's op scratch pool when the caller installed it) and is
// graph-capturable. All pointers taken and returned are device pointers. Unsupported shapes fail
// at construction naming the config field — never a silent fallback.
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/context.hpp"
#include "model/target.hpp"
#include "ops/attention.hpp"
#include "ops/attention_cudnn.hpp"

namespace dflash {

/// The per-layer KV caches of decoding on the device (owned by the caller, e.g.
/// SpeculativeDecoderCuda): k[l] and v[l] bf16 [rows, NKV·D], the normed and roped k rows and the
/// v rows of layer l, for every layer of the target. Which rows belong to which request is the
/// caller's layout (ops/decode.hpp).
struct TargetCacheCuda {
  std::vector<uint16_t*> k, v;
  int64_t rows = 0;
};

/// What forward_cached needs to run a decoding step's kernels (ops/decode_fused.hpp): the
/// split-key attention's workspace `attn_part`, f32 of decode_attention_work_floats(rows, NH, D,
/// max_keys) floats, enough for a forward of up to `rows` tokens each seeing at most `max_keys`
/// cache rows (a request's cache stride); with `row_gemm` the layer's projections run on
/// decode_linear_cuda (rows independent of the row count) where the shapes allow it (every
/// input width a multiple of 64), else (default: faster on the H200 at every measured batch,
/// docs/perf-runs.md) on cuBLASLt.
struct DecodeStepWork {
  float* attn_part = nullptr;
  int64_t rows = 0;
  int64_t max_keys = 0;
  bool row_gemm = false;
};

/// Device copy of a TargetModel and the workspace of its tap forward.
class TargetCuda {
 public:
  /// Uploads the weights of `model`'s layers [0, n_layers) (0 = all) to ctx's device, into
  /// `arena`'s buffers of plan_target_weights / plan_target_activations for up to `max_tokens`
  /// tokens per forward, or into an arena of its own when `arena` is null (then every buffer of
  /// that plan must be taken, else dflash::Error). Throws dflash::Error naming the config field
  /// for what the kernels cannot run: head_dim other than 64/128; for MoE targets hidden_size or
  /// the expert width not a multiple of 8, more than 1024 experts or top-k above 32; n_layers
  /// outside [0, num_hidden_layers]; and naming the tensor for a weight whose size differs from
  /// the plan's.
  TargetCuda(cuda::CudaContext& ctx, const TargetModel& model, int64_t max_tokens,
             int64_t n_layers = 0, cuda::DeviceArena* arena = nullptr);
  /// The same with random weights of `cfg`'s shapes filled on the device from `seed` (no
  /// checkpoint; for `dflash bench`): matrices, tables and MoE routers uniform with standard
  /// deviation 0.02 (HF's initializer_range), norm weights 1, biases and sinks 0 (ops/fill.hpp).
  /// Throws dflash::Error, besides the errors above, when the fills do not cover every byte of
  /// plan_target_weights (a planned tensor without a random fill).
  TargetCuda(cuda::CudaContext& ctx, const ModelConfig& cfg, uint64_t seed, int64_t max_tokens,
             int64_t n_layers = 0, cuda::DeviceArena* arena = nullptr);

  /// Outputs of decoder layers `layer_ids` (each in [0, num_layers)) concatenated into `taps`
  /// bf16 [T, n_taps·H] (tap i in columns [i·H, (i+1)·H)). `tokens` [T] int32 ids, `pos` [T] int32
  /// positions (restarting at 0 per document), `ranges` [T] the causal key ranges of each token
  /// (its document's start up to itself; see attention_causal_varlen_ranges); sliding layers narrow
  /// them to the config's window. Runs no layer after the deepest tap (which must be an uploaded
  /// layer). Enqueued on ctx's stream; nothing is copied to the host.
  void forward_taps(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                    const AttnRange* ranges, int64_t T, std::span<const int> layer_ids);

  /// forward_taps over every layer, then the final norm: `final_out` bf16 [T, H] =
  /// RMSNorm(last layer's output) with `final_norm` f32 [H] (the caller's copy of the target's
  /// final-norm weight; this class does not hold it). DSpark's teacher rows. Throws
  /// dflash::Error as forward_taps, when not every layer was uploaded, or for null pointers.
  void forward_taps_final(uint16_t* taps, uint16_t* final_out, const float* final_norm,
                          const int32_t* tokens, const int32_t* pos, const AttnRange* ranges,
                          int64_t T, std::span<const int> layer_ids);

  /// Decoding forward over KV caches (the causal attention of a prefill or of a verified block):
  /// every layer runs; its k/v rows of the T tokens are first written to cache rows `slots` [T]
  /// (kv_scatter_cuda), then the T queries attend to the cache rows of their `ranges` [T] (the
  /// request's committed rows and the new rows up to their own; decode_rows_cuda makes them).
  /// `tokens`, `pos` [T] as forward_taps; the taps of `layer_ids` go to `taps` bf16 [T, n_taps·H]
  /// (may be null when layer_ids is empty). The cuBLASLt projection GEMMs run `gemm_rows` rows
  /// (in [T, max_tokens]): rows [T, gemm_rows) compute garbage from whatever the workspace holds
  /// and change no row < T (padding to a row count where cuBLASLt's kernel is faster, or the
  /// same for every batch size); decode_linear_cuda (split->row_gemm) runs T rows. Afterwards
  /// residual() holds the last layer's output
  /// [T, H] f32 (before the final norm, which this class does not hold). All device pointers;
  /// enqueued on ctx's stream, allocates nothing: graph-capturable. Throws dflash::Error when
  /// not all of the target's layers were uploaded, the cache lacks layers, T is outside
  /// [1, max_tokens] or a tap is outside the layers or `split` holds fewer than T rows. With
  /// `split` (may be null) the attention is decode_attention_cuda (keys split across CTAs; a
  /// row's bits do not depend on T or on the other rows: the decoding steps), else the
  /// tensor-core attention_fwd_cuda (the prefill). Either way the layer's q/k/v come from one
  /// GEMM over [Wq; Wk; Wv] and one qkv_prepare_cuda (norms, RoPE, cache writes).
  void forward_cached(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                      const int32_t* slots, const AttnRange* ranges, int64_t T, int64_t gemm_rows,
                      std::span<const int> layer_ids, const TargetCacheCuda& cache,
                      const DecodeStepWork* split = nullptr);
  /// The residual stream f32 [max_tokens, H] (rows [0, T) of the last forward).
  const float* residual() const { return x_; }
  /// The config of the model.
  const ModelConfig& config() const { return cfg_; }
  /// Tokens a forward may hold.
  int64_t max_tokens() const { return max_tokens_; }
  /// From now on forward_taps and forward_taps_final run the causal prefill of every layer on
  /// cuDNN's fused attention (ops/attention_cudnn.hpp) instead of attention_fwd_cuda, with the
  /// graph cudnn_prefill_select picks; forward_cached keeps its kernels. Creates the cuDNN handle
  /// the graphs share (outside the arena: the memory plan's cudnn_bytes). Throws dflash::Error
  /// when a layer has a sliding window or attention sinks (the cuDNN graph computes neither: the
  /// config field is named) or when cuDNN cannot create its handle (its reason).
  void use_cudnn_prefill();
  /// use_cudnn_prefill(), then cudnn_prefill_select(max_docs, max_doc_len): one graph of exactly
  /// `max_docs` document slots (the bench's and the tests' fixed split).
  void use_cudnn_prefill(int64_t max_docs, int64_t max_doc_len);
  /// The document slots of the cuDNN graph that serves a forward of `n_docs` documents: the
  /// smallest power of two ≥ n_docs (so that a run builds few graphs). Throws dflash::Error for
  /// n_docs < 1.
  static int64_t cudnn_prefill_bucket(int64_t n_docs);
  /// Makes the next forwards use the cuDNN graph of `slots` document slots of at most
  /// `max_doc_len` rows, building it the first time this shape is asked for (one graph per shape,
  /// kept; its index arrays and workspace cudaMalloc'ed outside the arena, planned in
  /// cudnn_bytes). Building is not graph-capturable: select before capturing a forward, and key
  /// the captured graph by the selection. A forward with more documents than `slots` or a longer
  /// one traps on the device (attention_cudnn.hpp). Throws dflash::Error before
  /// use_cudnn_prefill, or when cuDNN cannot build the graph (its reason).
  void cudnn_prefill_select(int64_t slots, int64_t max_doc_len);
  /// True after use_cudnn_prefill.
  bool cudnn_prefill() const { return cudnn_handle_ != nullptr; }
  /// cuDNN graphs built so far, and the bytes of their workspaces and index arrays.
  int64_t cudnn_prefill_graphs() const { return static_cast<int64_t>(cudnn_graphs_.size()); }
  int64_t cudnn_prefill_bytes() const;

  /// The embedding table and LM head on the device, bf16 [V, H] (the same array when tied).
  const uint16_t* embed() const { return embed_; }
  const uint16_t* lm_head() const { return tied_ ? embed_ : head_; }
  /// Layers uploaded (the deepest usable tap + 1).
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  /// Weight bytes uploaded at construction and the seconds it took (host reads included).
  uint64_t upload_bytes() const { return upload_bytes_; }
  double upload_seconds() const { return upload_s_; }

 private:
  /// A sparse block on the device: E experts of width EI, stacked.
  struct Moe {
    uint16_t* router = nullptr;                 // bf16 [E, H]
    float* router_bias = nullptr;               // f32 [E] or null
    uint16_t *wgu = nullptr, *wdown = nullptr;  // bf16 [E, 2·EI, H] ([gate; up]), [E, H, EI]
    const uint16_t** gu_ptrs = nullptr;         // device array of E pointers into wgu
    const uint16_t** down_ptrs = nullptr;       // device array of E pointers into wdown
    float *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;  // [E·EI], [E·EI], [E·H]
  };
  /// One decoder layer's device weights; null for what the architecture lacks.
  struct Layer {
    // wqkv bf16 [(NH + 2·NKV)·D, H] = [Wq; Wk; Wv]; wq, wk, wv point into it (rows of q, k, v).
    uint16_t *wqkv = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    // f32 biases; bqkv = [bq; bk; bv] (bq, bk, bv point into it).
    float *bqkv = nullptr, *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr;
    float *in_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;  // f32
    float* sinks = nullptr;  // f32 [NH] (gpt-oss)
    // Dense MLP: bf16 [2I, H] = [gate; up], [H, I]; f32 biases [2I], [H].
    uint16_t *wgu = nullptr, *wdown = nullptr;
    float *bgu = nullptr, *bdown = nullptr;
    bool sliding = false;
    bool is_moe = false;
    Moe moe;
  };
  cuda::CudaContext& ctx_;
  ModelConfig cfg_;
  int64_t max_tokens_;
  float rope_scaling_;
  bool tied_;
  std::unique_ptr<cuda::DeviceArena> own_arena_;
  uint16_t *embed_ = nullptr, *head_ = nullptr;
  float* inv_freq_ = nullptr;
  std::vector<Layer> layers_;
  float* x_ = nullptr;
  uint16_t *hn_ = nullptr, *qkv_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr,
           *o_ = nullptr;
  uint16_t *gu_ = nullptr, *act_ = nullptr, *tap_ = nullptr;  // gu_/act_ null without dense layers
  AttnRange* win_ = nullptr;  // window ranges; null without sliding layers
  // use_cudnn_prefill's handle (null: the prefill runs attention_fwd_cuda), its graphs by
  // (slots, longest document) and the one cudnn_prefill_select chose (null: none yet).
  std::shared_ptr<CudnnHandle> cudnn_handle_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<CudnnCausalPrefill>> cudnn_graphs_;
  CudnnCausalPrefill* cudnn_ = nullptr;
  /// MoE workspace (all null without MoE layers): R = max_tokens · top-k rows.
  struct MoeWork {
    float* logits = nullptr;                                                          // [T, E]
    int32_t *ids = nullptr, *perm = nullptr, *slot = nullptr, *row_expert = nullptr;  // [R]
    int32_t* offsets = nullptr;                                                       // [E+1]
    float* weights = nullptr;                                                         // [R]
    uint16_t *xs = nullptr, *gu = nullptr, *act = nullptr;  // [R, H], [R, 2·EI], [R, EI] bf16
    float* ys = nullptr;                                    // [R, H]
  } mw_;
  uint64_t upload_bytes_ = 0;
  double upload_s_ = 0;
  // Constructor steps: checks and the arena (a plan of its own when `arena` is null), the weight
  // pointers of layers [0, n_layers), the activations; with an own arena, that every planned
  // buffer was taken.
  cuda::DeviceArena& setup(int64_t n_layers, cuda::DeviceArena* arena);
  void take_weights(cuda::DeviceArena& arena);
  void take_activations(cuda::DeviceArena& arena);
  void check_all_taken() const;
  void upload_weights(const TargetModel& model);
  void random_weights(uint64_t seed);
  /// Writes the per-expert pointer arrays of every MoE layer (pointers into its stacked weights).
  void upload_expert_pointers(cuda::PinnedUploader& up);
  void moe_forward(const Moe& m, float* x, const uint16_t* hn, int64_t T);
  /// Layers [0, n_run) over T tokens, the taps of `layer_ids` to `taps`; with `cache`, each
  /// layer's k/v rows go to cache rows `slots` and the attention reads the cache (forward_cached),
  /// else the T rows attend to each other (forward_taps).
  /// The projection GEMMs run Tg ≥ T rows (forward_cached's gemm_rows); `split` as
  /// forward_cached's.
  void run_layers(uint16_t* taps, const int32_t* tokens, const int32_t* pos,
                  const AttnRange* ranges, int64_t T, int64_t Tg, std::span<const int> layer_ids,
                  int64_t n_run, const TargetCacheCuda* cache, const int32_t* slots,
                  const DecodeStepWork* split);
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
