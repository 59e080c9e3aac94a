// dflash.cpp — the DFlash drafter's training step on the CUDA backend (the same model and objective
// as drafter_train_step in src/model/drafter.hpp, over a whole packed step at once; the inputs are
// a DrafterBatch staged by drafter_batch_stage, src/model/drafter_batch.hpp). A drafter with DSpark
// heads runs the DSpark head (model/dspark_head_cuda.hpp) in place of the fused LM-head CE, a
// drafter with the Domino head the Domino head (model/domino_head_cuda.hpp). A
// DFlash2 drafter runs its grouped dynamic causal conv around every attention and MLP sublayer of
// the block stream (ops/dflash2_conv.hpp, as drafter.cpp's block_forward) and its candidate
// selector and loss (model/dflash2_head_cuda.hpp); with ū = U (output_multiplier 1, no softcap)
// the base CE is the fused CE's, so an identity-start DFlash2 drafter at α_sel = 0 steps with
// plain DFlash's bits.
//
// Numerics (DESIGN.md §3): fp32 master weights, AdamW moments and gradients; a bf16 copy of the
// weights feeds every GEMM (bf16 in, fp32 accumulate); the residual stream, norm statistics,
// softmax and the loss are fp32; activations saved for the backward are bf16 except the residual
// stream and the pre-norm context (fp32). What is saved and what the backward recomputes (with
// the forward's kernels on the forward's inputs, so with the same bits): model/step_plan.hpp.
//
// Invariants: one DrafterCuda belongs to one CudaContext (one thread). Every buffer is a
// "drafter.*" buffer of a memory plan (plan_drafter_step) in a DeviceArena, sized for `max_ctx`
// context rows and `max_block_rows` block rows, so a step allocates nothing from the driver;
// buffers the plan lets share memory are used in disjoint phases of the step (the phase sets of
// plan_drafter_step follow the order of work in forward_backward). The step's work is enqueued on
// the context's stream in a fixed order (graph-capturable). Parameter gradients are zeroed at the
// start of forward_backward and accumulate over the step; activation gradients are overwritten.
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/context.hpp"
#include "model/drafter.hpp"
#include "model/step_plan.hpp"
#include "ops/adamw.hpp"

namespace dflash {

/// Device pointers of one step's inputs (all on ctx's device): the uploaded image of a
/// DrafterBatch written by drafter_batch_stage (same names, same layout).
struct DrafterCudaInputs {
  int64_t T = 0;                         ///< context rows
  int64_t NK = 0;                        ///< block rows (multiple of K)
  const uint16_t* features = nullptr;    ///< [T, n_taps·H] bf16 target taps
  const int32_t* pos = nullptr;          ///< [T + NK] positions: context rows, then block rows
  const int32_t* block_tokens = nullptr; ///< [NK]
  const AttnRange* ranges = nullptr;     ///< [NK] query key ranges over [ctx T ; blocks NK]
  const int32_t* labels = nullptr;       ///< [NK], each in [0, V)
  const float* weights = nullptr;        ///< [NK] loss weights (0 for slot 0 and padding)
  /// The loss. dflash: Σ weights·CE. D-PACE: `weights` is the mask m_k of each row, and the step
  /// weighs each supervised row by dpace_weights_cuda of the rows' own CE (w held constant);
  /// dflash2 with a D-PACE loss type: the CE of the unary logits, and the same weight on the row's
  /// selector term (dflash2_head_cuda).
  /// dspark (a drafter with DSpark heads): the DSpark loss of dspark_head_cuda, its teacher the
  /// final-norm rows [T, H] that follow the taps in `features` (drafter_feature_cols).
  Objective objective;
  /// DSpark only: the DsparkRowIndex arrays of the step (model/dspark_head_cuda.hpp), [NK] each
  /// and w1_seg [NK + 1].
  const int32_t *dspark_prev = nullptr, *dspark_teacher_pos = nullptr;
  const int32_t *dspark_w1_order = nullptr, *dspark_w1_seg = nullptr;
  /// Domino only (objective domino, a drafter with the Domino head; the loss of
  /// domino_head_cuda): DominoRowIndex::gru_tok [NK] and the step's λ [1] (DominoRowIndex::lambda;
  /// on the device, so that a captured graph reads each step's).
  const int32_t* domino_gru_tok = nullptr;
  const double* domino_lambda = nullptr;
  /// DFlash2 only: the predecessor token of each block row [NK] (dflash2_prev_tokens,
  /// model/dflash2_head_cuda.hpp) and the step's α_sel [1] (dflash2_selector_alpha; on the device,
  /// so that a captured graph reads each step's; the objective's dflash2_selector_alpha is not
  /// read).
  const int32_t* dflash2_prev = nullptr;
  const double* dflash2_alpha = nullptr;
};

/// Drafter weights, optimizer state and the activation workspace on one GPU.
class DrafterCuda {
 public:
  /// Takes every buffer from `arena` (the buffers of plan_drafter_step for these capacities and
  /// `ce_chunk_rows`), or from an arena of its own when `arena` is null. `embed` and `lm_head` are
  /// the target's frozen bf16 tables [V, H] on the same device (they must outlive this object).
  /// `activations`: whether the backward recomputes or keeps the forward's activations
  /// (model/step_plan.hpp; the arena must be planned with the same choice). Both give the same
  /// bits. Throws dflash::Error for head_dim other than 64/128, non-positive capacities, or an
  /// arena whose plan lacks a buffer or plans one too small (naming it).
  DrafterCuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
              int64_t max_ctx, int64_t max_block_rows, const uint16_t* embed,
              const uint16_t* lm_head, cuda::DeviceArena* arena = nullptr,
              int64_t ce_chunk_rows = kDrafterCeChunkRows,
              DrafterActivations activations = DrafterActivations::recompute);

  /// Copies master weights and AdamW moments (layout.total values each) to the device and
  /// refreshes the bf16 copy. Synchronous.
  void upload_state(std::span<const float> params, std::span<const float> m,
                    std::span<const float> v);
  /// Copies master weights and moments back to the host. Synchronous.
  void download_state(std::span<float> params, std::span<float> m, std::span<float> v);

  /// Random master weights on the device (linear weights uniform with standard deviation 0.02,
  /// norm weights 1; ops/fill.hpp, from `seed`), zero moments, bf16 copy refreshed: for
  /// benchmarks without a checkpoint. Synchronous.
  void randomize_state(uint64_t seed);

  /// Events forward_backward records for per-phase timing (null: none): after the layers'
  /// forward, and after the head (final norm, fused CE, the final norm's backward).
  struct PhaseEvents {
    cudaEvent_t after_forward = nullptr, after_head = nullptr;
  };
  /// Sets them; never while the stream is captured into a graph (the events would become
  /// capture dependencies instead of timestamps).
  void set_phase_events(const PhaseEvents& e) { phase_events_ = e; }

  /// Copies the gradients of the last forward_backward (layout.total values) to the host; for
  /// tests. Synchronous.
  void download_grads(std::span<float> grads);

  /// Forward and backward of one step: zeroes the gradients, then accumulates d(Σ w·CE)·grad_scale
  /// (DSpark, Domino: d(numerator)·grad_scale, dspark_head_cuda, domino_head_cuda) into them (use
  /// grad_scale = 1/DrafterBatch::loss_normaliser of the step: 1/Σw for dflash, 1/sequences for
  /// D-PACE), and the global gradient sum of squares. D-PACE: one fused CE pass with weights m_k
  /// gives each row's CE and unit-weight gradient; dpace_weights_cuda turns the CE into the weights
  /// and rows_scale_cuda scales each row's gradient by its weight (DFlash2: inside
  /// dflash2_head_cuda, its selector's row pieces too). Outputs stay on the device until
  /// fetch_results. Enqueue only.
  void forward_backward(const DrafterCudaInputs& in, double grad_scale);

  /// Results of the last forward_backward copied to the host (synchronises the stream).
  struct Results {
    double loss_sum = 0;   ///< Σ w·CE (w: the static weights, or D-PACE's)
    double weight_sum = 0; ///< Σ w
    double grad_norm = 0;  ///< global L2 norm of the scaled gradient (before clipping)
    std::vector<int32_t> argmax;  ///< [NK] drafter argmax per block row
    /// DSpark only: Σ w·CE, Σ w·L1, Σ w·BCE, Σ w·acc (loss_sum is Σ w·(αce·CE + αl1·L1 +
    /// αconf·BCE)); 0 for the other objectives.
    double dspark_ce_sum = 0, dspark_l1_sum = 0, dspark_bce_sum = 0, dspark_acc_sum = 0;
    /// Domino only: Σ w·CE(F) and Σ w·CE(U) (loss_sum is Σ w·((1−λ)·CE(F) + λ·CE(U))); 0 for
    /// the other objectives.
    double domino_final_ce_sum = 0, domino_base_ce_sum = 0;
    /// DFlash2 only: Σ w·CE(ū), Σ w·CE_sel, Σ w over the rows whose gold is a candidate
    /// (loss_sum = base + α_sel·selector); 0 for the other objectives.
    double dflash2_base_sum = 0, dflash2_selector_sum = 0, dflash2_in_topk_weight = 0;
  };
  Results fetch_results(int64_t NK);

  /// AdamW on the master weights with gradient multiplier `grad_scale` (the clip factor); the same
  /// pass refreshes the bf16 copy (the segment names it). Same per-element math as
  /// adamw_step_cpu. Enqueue only.
  void adamw(const AdamWConfig& cfg, double lr, int64_t step, double grad_scale);

  /// The feature buffer [max_ctx, n_taps·H] bf16 that the target's tap forward writes.
  uint16_t* features() { return features_; }

  /// The parameter gradients [layout.total] f32 on the device (what the replicas all-reduce).
  float* grads() { return grads_; }
  /// Global L2 norm of the gradient array as it is now (after an all-reduce, say): the same
  /// two-pass device reduction as forward_backward's, read back (synchronises the stream).
  double grad_norm();

 private:
  // Saved activations of one layer (see model/step_plan.hpp), and where its kvin [ctx ;
  // norm(x_in)], q, k (after norm + RoPE), hn2 = norm(h_mid) and act = SwiGLU(gu) live: the
  // layer's own buffers when kept, the buffers shared by every layer when recomputed.
  // DFlash2's conv around one sublayer (model/dflash2_conv.hpp): δ [NK, 2·T·Gc] f32, the
  // sublayer output y [NK, H] f32 before the post-conv, and its input u [NK, H] bf16 before the
  // pre-conv (the layer's own when kept, one per sublayer kind when recomputed). All null for a
  // drafter without DFlash2.
  struct ConvBuf {
    float *delta = nullptr, *y = nullptr;
    uint16_t* u = nullptr;
  };
  struct LayerBuf {
    uint16_t *q_raw, *k_raw, *v, *o, *gu;
    float *lse, *h_mid, *h_out;
    uint16_t *kvin, *q, *k, *hn2, *act;
    ConvBuf attn_conv, mlp_conv;
  };
  cuda::CudaContext& ctx_;
  DrafterConfig cfg_;
  DrafterLayout layout_;
  int64_t max_ctx_, max_rows_, ce_chunk_rows_;
  DrafterActivations activations_;
  const uint16_t* embed_;
  const uint16_t* head_;
  float rope_scaling_;
  std::unique_ptr<cuda::DeviceArena> own_arena_;
  // State and results.
  float *params_, *grads_, *m_, *v_, *inv_freq_, *clip_;
  uint16_t* wbf_;
  AdamWSegment* segs_;
  double *sumsq_, *sums_;
  int32_t* argmax_;
  // Step buffers (per-layer buffers: LayerBuf).
  uint16_t *features_, *hf_;
  float *ctx_pre_, *h0_, *d_hf_, *row_w_;
  void* ce_ws_ = nullptr;
  uint64_t ce_ws_bytes_ = 0;
  // DSpark's head (model/dspark_head_cuda.hpp): chunk workspace, row buffers, sums [6].
  void *dspark_ws_ = nullptr, *dspark_rows_ = nullptr;
  uint64_t dspark_ws_bytes_ = 0, dspark_rows_bytes_ = 0;
  double* dspark_sums_ = nullptr;
  // Domino's head (model/domino_head_cuda.hpp): chunk workspace, row buffers, sums [4].
  void *domino_ws_ = nullptr, *domino_rows_ = nullptr;
  uint64_t domino_ws_bytes_ = 0, domino_rows_bytes_ = 0;
  double* domino_sums_ = nullptr;
  // DFlash2's selector head (model/dflash2_head_cuda.hpp): chunk workspace, row buffers, sums
  // [5], and where the last step read α_sel on the device (fetch_results' loss = base +
  // α_sel·selector: the staged input stays at its place across graph replays).
  void *dflash2_ws_ = nullptr, *dflash2_rows_ = nullptr;
  uint64_t dflash2_ws_bytes_ = 0, dflash2_rows_bytes_ = 0;
  double* dflash2_sums_ = nullptr;
  const double* dflash2_alpha_ = nullptr;
  // Backward scratch.
  float *dh_, *dhn2_, *dx_, *dctx_, *dctx_pre_;
  uint16_t *dh_bf_, *d_act_, *d_gu_, *d_o_, *dq_, *dq_raw_, *dk_, *dk_raw_, *dv_, *dctx_bf_;
  // DFlash2's conv backward: dy [NK, H] bf16, dδ [NK, 2·T·Gc] bf16, du [NK, H] f32.
  uint16_t *conv_dy_ = nullptr, *conv_ddelta_ = nullptr;
  float* conv_du_ = nullptr;
  std::vector<LayerBuf> layers_;
  PhaseEvents phase_events_;
  void take_buffers(cuda::DeviceArena& a);
  void take_conv_buffers(cuda::DeviceArena& a);
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
