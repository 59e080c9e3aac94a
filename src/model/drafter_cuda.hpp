// dflash.cpp — the DFlash drafter's training step on the CUDA backend (the same model and objective
// as drafter_train_step in src/model/drafter.hpp, over a whole packed step at once; the inputs are
// a DrafterBatch staged by drafter_batch_stage, src/model/drafter_batch.hpp).
//
// Numerics (DESIGN.md §3): fp32 master weights, AdamW moments and gradients; a bf16 copy of the
// weights feeds every GEMM (bf16 in, fp32 accumulate); the residual stream, norm statistics,
// softmax and the loss are fp32; activations saved for the backward are bf16 except the residual
// stream and the pre-norm context (fp32).
//
// Invariants: one DrafterCuda belongs to one CudaContext (one thread). Every buffer is sized at
// construction for `max_ctx` context rows and `max_block_rows` block rows, so a step allocates
// nothing from the driver; the step's work is enqueued on the context's stream in a fixed order
// (graph-capturable). Parameter gradients are zeroed at the start of forward_backward and
// accumulate over the step; activation gradients are overwritten.
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>
#include <span>
#include <vector>

#include "backend/cuda/context.hpp"
#include "model/drafter.hpp"
#include "train/optimizer.hpp"

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
};

/// Drafter weights, optimizer state and the activation workspace on one GPU.
class DrafterCuda {
 public:
  /// Plans every buffer. `embed` and `lm_head` are the target's frozen bf16 tables [V, H] on the
  /// same device (they must outlive this object). Throws dflash::Error for head_dim other than
  /// 64/128 or non-positive capacities.
  DrafterCuda(cuda::CudaContext& ctx, const DrafterConfig& cfg, const DrafterLayout& layout,
              int64_t max_ctx, int64_t max_block_rows, const uint16_t* embed,
              const uint16_t* lm_head);

  /// Copies master weights and AdamW moments (layout.total values each) to the device and
  /// refreshes the bf16 copy. Synchronous.
  void upload_state(std::span<const float> params, std::span<const float> m,
                    std::span<const float> v);
  /// Copies master weights and moments back to the host. Synchronous.
  void download_state(std::span<float> params, std::span<float> m, std::span<float> v);

  /// Copies the gradients of the last forward_backward (layout.total values) to the host; for
  /// tests. Synchronous.
  void download_grads(std::span<float> grads);

  /// Forward and backward of one step: zeroes the gradients, then accumulates d(Σ w·CE)·grad_scale
  /// into them (use grad_scale = 1/Σw of the step), and the global gradient sum of squares.
  /// Outputs stay on the device until fetch_results. Enqueue only.
  void forward_backward(const DrafterCudaInputs& in, double grad_scale);

  /// Results of the last forward_backward copied to the host (synchronises the stream).
  struct Results {
    double loss_sum = 0;   ///< Σ w·CE
    double weight_sum = 0; ///< Σ w
    double grad_norm = 0;  ///< global L2 norm of the scaled gradient (before clipping)
    std::vector<int32_t> argmax;  ///< [NK] drafter argmax per block row
  };
  Results fetch_results(int64_t NK);

  /// AdamW on the master weights with gradient multiplier `grad_scale` (the clip factor), then the
  /// bf16 copy is refreshed. Same per-element math as adamw_step_cpu. Enqueue only.
  void adamw(const AdamWConfig& cfg, double lr, int64_t step, double grad_scale);

  /// The feature buffer [max_ctx, n_taps·H] bf16 that the target's tap forward writes.
  uint16_t* features() { return features_.as<uint16_t>(); }

  /// The parameter gradients [layout.total] f32 on the device (what the replicas all-reduce).
  float* grads() { return grads_.as<float>(); }
  /// Global L2 norm of the gradient array as it is now (after an all-reduce, say): the same
  /// two-pass device reduction as forward_backward's, read back (synchronises the stream).
  double grad_norm();

 private:
  struct LayerBuf {
    cuda::DeviceBuffer kvin, q_raw, q, k_raw, k, v, o, lse, h_mid, hn2, gu, act, h_out;
  };
  cuda::CudaContext& ctx_;
  DrafterConfig cfg_;
  DrafterLayout layout_;
  int64_t max_ctx_, max_rows_;
  const uint16_t* embed_;
  const uint16_t* head_;
  float rope_scaling_;
  cuda::DeviceBuffer params_, grads_, m_, v_, wbf_, segs_, inv_freq_;
  cuda::DeviceBuffer sumsq_, sums_, clip_, features_;
  cuda::DeviceBuffer ctx_pre_, dctx_, dctx_pre_, dctx_bf_, h0_, hf_, d_hf_, lse_ce_, argmax_;
  cuda::DeviceBuffer dh_, dh_bf_, dtmp_, d_act_, d_gu_, dhn2_, d_o_, dq_, dq_raw_, dk_, dk_raw_,
      dv_, dx_;
  std::vector<LayerBuf> layers_;
};

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
