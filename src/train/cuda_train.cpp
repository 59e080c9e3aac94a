#include "train/cuda_train.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "core/error.hpp"
#include "model/drafter_cuda.hpp"
#include "model/target_cuda.hpp"

namespace dflash {

struct CudaTrainBackend::Inputs {
  cuda::DeviceBuffer tokens, target_ranges, pos, block_tokens, block_ranges, labels, weights;
  cudaEvent_t start = nullptr, after_target = nullptr, end = nullptr;
};

namespace {
template <typename T>
void upload(cuda::CudaContext& ctx, const cuda::DeviceBuffer& dst, const std::vector<T>& src) {
  const size_t bytes = src.size() * sizeof(T);
  DFLASH_CHECK(bytes <= dst.bytes(), "CudaTrainBackend: {} bytes of input for a buffer of {}",
               bytes, dst.bytes());
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyHostToDevice, ctx.stream()));
}
}  // namespace

CudaTrainBackend::CudaTrainBackend(int device, const TargetModel& target,
                                   const DrafterConfig& cfg, const DrafterLayout& layout,
                                   int64_t max_ctx)
    : taps_(cfg.target_layer_ids), max_ctx_(max_ctx), max_rows_(max_ctx * cfg.block_size) {
  const int n = cuda::device_count();
  DFLASH_CHECK(device >= 0 && device < n,
               "runtime.devices: CUDA device {} does not exist ({} visible)", device, n);
  // The step is enqueued op by op (no CUDA graph capture yet): say so, never leave it implicit.
  description_ = fmt::format("cuda:{} {}, CUDA graphs off", device,
                             cuda::device_description(device));
  ctx_ = std::make_unique<cuda::CudaContext>(device);
  target_ = std::make_unique<TargetCuda>(*ctx_, target, max_ctx);
  drafter_ = std::make_unique<DrafterCuda>(*ctx_, cfg, layout, max_ctx, max_rows_,
                                           target_->embed(), target_->lm_head());
  in_ = std::make_unique<Inputs>();
  const auto T = static_cast<size_t>(max_ctx), NK = static_cast<size_t>(max_rows_);
  in_->tokens = ctx_->scratch(T * sizeof(int32_t));
  in_->target_ranges = ctx_->scratch(T * sizeof(AttnRange));
  in_->pos = ctx_->scratch((T + NK) * sizeof(int32_t));
  in_->block_tokens = ctx_->scratch(NK * sizeof(int32_t));
  in_->block_ranges = ctx_->scratch(NK * sizeof(AttnRange));
  in_->labels = ctx_->scratch(NK * sizeof(int32_t));
  in_->weights = ctx_->scratch(NK * sizeof(float));
  in_->start = ctx_->new_event(true);
  in_->after_target = ctx_->new_event(true);
  in_->end = ctx_->new_event(true);
}

CudaTrainBackend::~CudaTrainBackend() = default;

CudaTrainBackend::StepResult CudaTrainBackend::step(const PackedStep& s, double grad_scale) {
  DFLASH_CHECK(s.T > 0 && s.T <= max_ctx_ && s.NK > 0 && s.NK <= max_rows_,
               "CudaTrainBackend: packed step of {} tokens and {} block rows exceeds the planned "
               "{} and {}", s.T, s.NK, max_ctx_, max_rows_);
  cuda::CudaContext& ctx = *ctx_;
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->start, ctx.stream()));
  upload(ctx, in_->tokens, s.tokens);
  upload(ctx, in_->target_ranges, s.target_ranges);
  upload(ctx, in_->pos, s.pos);
  upload(ctx, in_->block_tokens, s.block_tokens);
  upload(ctx, in_->block_ranges, s.block_ranges);
  upload(ctx, in_->labels, s.labels);
  upload(ctx, in_->weights, s.weights);
  target_->forward_taps(drafter_->features(), in_->tokens.as<int32_t>(), in_->pos.as<int32_t>(),
                        in_->target_ranges.as<AttnRange>(), s.T, taps_);
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->after_target, ctx.stream()));
  DrafterCudaInputs di;
  di.T = s.T;
  di.NK = s.NK;
  di.features = drafter_->features();
  di.pos = in_->pos.as<int32_t>();
  di.block_tokens = in_->block_tokens.as<int32_t>();
  di.ranges = in_->block_ranges.as<AttnRange>();
  di.labels = in_->labels.as<int32_t>();
  di.weights = in_->weights.as<float>();
  drafter_->forward_backward(di, grad_scale);
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->end, ctx.stream()));
  DrafterCuda::Results r = drafter_->fetch_results(s.NK);
  StepResult out;
  out.loss_sum = r.loss_sum;
  out.weight_sum = r.weight_sum;
  out.grad_norm = r.grad_norm;
  out.argmax = std::move(r.argmax);
  float ms_t = 0, ms_d = 0;
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms_t, in_->start, in_->after_target));
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms_d, in_->after_target, in_->end));
  out.target_s = ms_t * 1e-3;
  out.drafter_s = ms_d * 1e-3;
  return out;
}

void CudaTrainBackend::adamw(const AdamWConfig& cfg, double lr, int64_t step, double grad_scale) {
  drafter_->adamw(cfg, lr, step, grad_scale);
}

void CudaTrainBackend::upload_state(std::span<const float> params, std::span<const float> m,
                                    std::span<const float> v) {
  drafter_->upload_state(params, m, v);
}

void CudaTrainBackend::download_state(std::span<float> params, std::span<float> m,
                                      std::span<float> v) {
  drafter_->download_state(params, m, v);
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
