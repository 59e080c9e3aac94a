#include "train/cuda_train.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstring>
#include <utility>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/graph.hpp"
#include "core/error.hpp"
#include "model/drafter_cuda.hpp"
#include "model/target_cuda.hpp"

namespace dflash {

namespace {

// Page-locked host memory (copies from it can be captured in a graph).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    DFLASH_CUDA_CHECK(cudaMallocHost(&p_, std::max<size_t>(bytes, 1)));
  }
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// One staged input: device buffer (from the arena) plus its pinned host twin.
struct Staged {
  void* dev = nullptr;
  PinnedBuffer host;
  template <typename T>
  void fill(const std::vector<T>& src) {
    const size_t bytes = src.size() * sizeof(T);
    DFLASH_CHECK(bytes <= host.bytes(), "CudaTrainBackend: {} bytes of input for a buffer of {}",
                 bytes, host.bytes());
    if (bytes) std::memcpy(host.as<void>(), src.data(), bytes);
  }
  // Enqueues the copy of elements [first, first+n) of T to the device.
  template <typename T>
  void upload(cudaStream_t s, int64_t first, int64_t n) const {
    if (n <= 0) return;
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(static_cast<T*>(dev) + first, host.as<T>() + first,
                                      static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice,
                                      s));
  }
};

Staged make_staged(cuda::DeviceArena& arena, const char* name, size_t bytes) {
  Staged st;
  st.dev = arena.get_bytes(name, bytes);
  st.host = PinnedBuffer(bytes);
  return st;
}

// total − free device memory of the current device.
uint64_t used_device_memory() {
  size_t free = 0, total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total - free;
}

}  // namespace

struct CudaTrainBackend::Inputs {
  Staged tokens, target_ranges, pos, block_tokens, block_ranges, labels, weights;
  cudaEvent_t start = nullptr, after_target = nullptr, end = nullptr;
  cuda::GraphCache<int64_t> target_graphs;                       // by T
  cuda::GraphCache<std::pair<int64_t, int64_t>> drafter_graphs;  // by (T, NK)
};

CudaTrainBackend::CudaTrainBackend(int device, const TargetModel& target, const DrafterConfig& cfg,
                                   const DrafterLayout& layout, const TrainMemoryPlan& plan,
                                   bool use_graphs)
    : taps_(cfg.target_layer_ids),
      max_ctx_(plan.T),
      max_rows_(plan.NK),
      use_graphs_(use_graphs),
      planned_context_bytes_(plan.context_bytes + plan.cublaslt_bytes) {
  const int n = cuda::device_count();
  DFLASH_CHECK(device >= 0 && device < n,
               "runtime.devices: CUDA device {} does not exist ({} visible)", device, n);
  description_ = fmt::format("cuda:{} {}, CUDA graphs {}", device,
                             cuda::device_description(device), use_graphs ? "on" : "off");
  ctx_ = std::make_unique<cuda::CudaContext>(device);
  context_bytes_ = used_device_memory();  // context, library handles, cuBLASLt workspace
  arena_ = std::make_unique<cuda::DeviceArena>(*ctx_, plan.arena);
  target_ = std::make_unique<TargetCuda>(*ctx_, target, plan.T, plan.target_layers, arena_.get());
  drafter_ = std::make_unique<DrafterCuda>(*ctx_, cfg, layout, plan.T, plan.NK, target_->embed(),
                                           target_->lm_head(), arena_.get());
  in_ = std::make_unique<Inputs>();
  const auto T = static_cast<size_t>(plan.T), NK = static_cast<size_t>(plan.NK);
  cuda::DeviceArena& a = *arena_;
  in_->tokens = make_staged(a, "inputs.tokens", T * sizeof(int32_t));
  in_->target_ranges = make_staged(a, "inputs.target_ranges", T * sizeof(AttnRange));
  in_->pos = make_staged(a, "inputs.pos", (T + NK) * sizeof(int32_t));
  in_->block_tokens = make_staged(a, "inputs.block_tokens", NK * sizeof(int32_t));
  in_->block_ranges = make_staged(a, "inputs.block_ranges", NK * sizeof(AttnRange));
  in_->labels = make_staged(a, "inputs.labels", NK * sizeof(int32_t));
  in_->weights = make_staged(a, "inputs.weights", NK * sizeof(float));
  const char* pool = "workspace.op_scratch";
  const uint64_t pool_bytes = a.planned_bytes(pool);
  ctx_->allocator().use_pool(a.get_bytes(pool, pool_bytes), pool_bytes);
  const std::vector<std::string> unused = a.untaken();
  DFLASH_CHECK(unused.empty(),
               "memory plan: {} planned buffers are not used by the CUDA step "
               "(e.g. '{}'): the plan and the code disagree",
               unused.size(), unused.empty() ? "" : unused.front());
  in_->start = ctx_->new_event(true);
  in_->after_target = ctx_->new_event(true);
  in_->end = ctx_->new_event(true);
}

uint64_t CudaTrainBackend::device_memory_used() const {
  ctx_->make_current();
  return used_device_memory();
}

std::string CudaTrainBackend::memory_report() const {
  const double gb = static_cast<double>(target_->upload_bytes()) / 1e9;
  const double s = target_->upload_seconds();
  return fmt::format(
      "device memory: context, handles and cuBLASLt workspace {} (planned {}), arena {}, in use "
      "now {}; target weights {:.2f} GB uploaded in {:.2f} s ({:.2f} GB/s)",
      format_bytes(context_bytes_), format_bytes(planned_context_bytes_),
      format_bytes(arena_->bytes()), format_bytes(device_memory_used()), gb, s,
      s > 0 ? gb / s : 0.0);
}

CudaTrainBackend::~CudaTrainBackend() = default;

int64_t CudaTrainBackend::graphs_captured() const {
  return static_cast<int64_t>(in_->target_graphs.size() + in_->drafter_graphs.size());
}

void CudaTrainBackend::enqueue_target(int64_t T) {
  cudaStream_t s = ctx_->stream();
  in_->tokens.upload<int32_t>(s, 0, T);
  in_->target_ranges.upload<AttnRange>(s, 0, T);
  in_->pos.upload<int32_t>(s, 0, T);
  target_->forward_taps(drafter_->features(), static_cast<int32_t*>(in_->tokens.dev),
                        static_cast<int32_t*>(in_->pos.dev),
                        static_cast<AttnRange*>(in_->target_ranges.dev), T, taps_);
}

void CudaTrainBackend::enqueue_drafter(int64_t T, int64_t NK) {
  cudaStream_t s = ctx_->stream();
  in_->pos.upload<int32_t>(s, T, NK);
  in_->block_tokens.upload<int32_t>(s, 0, NK);
  in_->block_ranges.upload<AttnRange>(s, 0, NK);
  in_->labels.upload<int32_t>(s, 0, NK);
  in_->weights.upload<float>(s, 0, NK);
  DrafterCudaInputs di;
  di.T = T;
  di.NK = NK;
  di.features = drafter_->features();
  di.pos = static_cast<int32_t*>(in_->pos.dev);
  di.block_tokens = static_cast<int32_t*>(in_->block_tokens.dev);
  di.ranges = static_cast<AttnRange*>(in_->block_ranges.dev);
  di.labels = static_cast<int32_t*>(in_->labels.dev);
  di.weights = static_cast<float*>(in_->weights.dev);
  drafter_->forward_backward(di, 1.0);  // unscaled: the step's 1/Σw is applied by adamw()
}

CudaTrainBackend::StepResult CudaTrainBackend::step(const PackedStep& s, double grad_scale) {
  DFLASH_CHECK(s.T > 0 && s.T <= max_ctx_ && s.NK > 0 && s.NK <= max_rows_,
               "CudaTrainBackend: packed step of {} tokens and {} block rows exceeds the planned "
               "{} and {}", s.T, s.NK, max_ctx_, max_rows_);
  DFLASH_CHECK(std::isfinite(grad_scale), "CudaTrainBackend: grad_scale {} is not finite",
               grad_scale);
  in_->tokens.fill(s.tokens);
  in_->target_ranges.fill(s.target_ranges);
  in_->pos.fill(s.pos);
  in_->block_tokens.fill(s.block_tokens);
  in_->block_ranges.fill(s.block_ranges);
  in_->labels.fill(s.labels);
  in_->weights.fill(s.weights);
  cudaStream_t st = ctx_->stream();
  const int64_t T = s.T, NK = s.NK;
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->start, st));
  if (use_graphs_) {
    in_->target_graphs.run(T, st, [&] { enqueue_target(T); });
  } else {
    enqueue_target(T);
  }
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->after_target, st));
  if (use_graphs_) {
    in_->drafter_graphs.run(std::pair<int64_t, int64_t>(T, NK), st,
                            [&] { enqueue_drafter(T, NK); });
  } else {
    enqueue_drafter(T, NK);
  }
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->end, st));
  DrafterCuda::Results r = drafter_->fetch_results(NK);
  pending_scale_ = grad_scale;
  StepResult out;
  out.loss_sum = r.loss_sum;
  out.weight_sum = r.weight_sum;
  out.grad_norm = r.grad_norm * grad_scale;
  out.argmax = std::move(r.argmax);
  float ms_t = 0, ms_d = 0;
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms_t, in_->start, in_->after_target));
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms_d, in_->after_target, in_->end));
  out.target_s = ms_t * 1e-3;
  out.drafter_s = ms_d * 1e-3;
  return out;
}

void CudaTrainBackend::adamw(const AdamWConfig& cfg, double lr, int64_t step, double clip) {
  drafter_->adamw(cfg, lr, step, clip * pending_scale_);
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
