// dflash.cpp — make_cuda_decoder (see cuda_decoder.hpp).
#include "cli/cuda_decoder.hpp"

#include "core/error.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "infer/decoder_cuda.hpp"
#endif

namespace dflash::cli {

#ifdef DFLASH_HAVE_CUDA

namespace {

// The CUDA decoder together with the context it runs on.
class OwnedCudaDecoder final : public Decoder {
 public:
  OwnedCudaDecoder(const TargetModel& target, const LoadedDrafter& drafter,
                   const DecoderCudaLimits& limits)
      : ctx_(0), dec_(ctx_, target, drafter, limits) {}
  OwnedCudaDecoder(const TargetModel& target, const DecoderCudaLimits& limits)
      : ctx_(0), dec_(ctx_, target, limits) {}
  std::vector<DecodeResult> generate(std::span<const std::vector<int32_t>> prompts,
                                     const DecodeOptions& opts, int batch_size,
                                     const BatchTokenCallback& on_tokens) override {
    return dec_.generate(prompts, opts, batch_size, on_tokens);
  }
  std::vector<DecodeResult> target_generate(std::span<const std::vector<int32_t>> prompts,
                                            const DecodeOptions& opts, int batch_size,
                                            const BatchTokenCallback& on_tokens) override {
    return dec_.target_generate(prompts, opts, batch_size, on_tokens);
  }
  const char* backend() const override { return dec_.backend(); }

 private:
  cuda::CudaContext ctx_;
  SpeculativeDecoderCuda dec_;
};

}  // namespace

void check_cuda_backend() {
  DFLASH_CHECK(cuda::device_count() > 0,
               "--backend cuda: no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES); use "
               "--backend cpu");
}

std::unique_ptr<Decoder> make_cuda_decoder(const TargetModel& target, const LoadedDrafter& drafter,
                                           std::span<const std::vector<int32_t>> prompts,
                                           int64_t max_new_tokens, int batch_size) {
  check_cuda_backend();
  const DecoderCudaLimits limits =
      decoder_cuda_limits(prompts, max_new_tokens, drafter.config.block_size, batch_size);
  return std::make_unique<OwnedCudaDecoder>(target, drafter, limits);
}

std::unique_ptr<Decoder> make_cuda_decoder(const TargetModel& target, const LoadedDrafter* drafter,
                                           int64_t max_prompt, int64_t max_new_tokens,
                                           int batch_size) {
  check_cuda_backend();
  DecoderCudaLimits limits;
  limits.max_batch = batch_size;
  limits.max_prefill = max_prompt;
  limits.max_context = max_prompt + max_new_tokens + (drafter ? drafter->config.block_size : 1);
  if (drafter) return std::make_unique<OwnedCudaDecoder>(target, *drafter, limits);
  return std::make_unique<OwnedCudaDecoder>(target, limits);
}

#else

void check_cuda_backend() {
  throw Error(
      "--backend cuda: this dflash was built without CUDA (-DDFLASH_CUDA=OFF); use "
      "--backend cpu");
}

std::unique_ptr<Decoder> make_cuda_decoder(const TargetModel&, const LoadedDrafter&,
                                           std::span<const std::vector<int32_t>>, int64_t, int) {
  check_cuda_backend();
  return nullptr;
}

std::unique_ptr<Decoder> make_cuda_decoder(const TargetModel&, const LoadedDrafter*, int64_t,
                                           int64_t, int) {
  check_cuda_backend();
  return nullptr;
}

#endif

}  // namespace dflash::cli
