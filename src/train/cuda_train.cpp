#include "train/cuda_train.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <utility>

#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
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

// One staged input: device buffer plus its pinned host twin.
struct Staged {
  cuda::DeviceBuffer dev;
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
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dev.as<T>() + first, host.as<T>() + first,
                                      static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice,
                                      s));
  }
};

Staged make_staged(cuda::CudaContext& ctx, size_t bytes) {
  Staged st;
  st.dev = ctx.scratch(bytes);
  st.host = PinnedBuffer(bytes);
  return st;
}

}  // namespace

struct CudaTrainBackend::Inputs {
  Staged tokens, target_ranges, pos, block_tokens, block_ranges, labels, weights;
  cudaEvent_t start = nullptr, after_target = nullptr, end = nullptr;
  std::map<int64_t, cudaGraphExec_t> target_graphs;                        // by T
  std::map<std::pair<int64_t, int64_t>, cudaGraphExec_t> drafter_graphs;  // by (T, NK)
  ~Inputs() {
    for (auto& [k, g] : target_graphs) cudaGraphExecDestroy(g);
    for (auto& [k, g] : drafter_graphs) cudaGraphExecDestroy(g);
  }
};

namespace {

// Replays the graph of `key`, capturing `enqueue` into it first when there is none.
template <typename Key, typename F>
void replay(std::map<Key, cudaGraphExec_t>& graphs, const Key& key, cudaStream_t s, F&& enqueue) {
  auto it = graphs.find(key);
  if (it == graphs.end()) {
    // Relaxed: the caching allocator may still call cudaMalloc the first time a size is needed.
    DFLASH_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    try {
      enqueue();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(s, &broken);
      if (broken) cudaGraphDestroy(broken);
      throw;
    }
    cudaGraph_t graph = nullptr;
    DFLASH_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    DFLASH_CUDA_CHECK(e);
    it = graphs.emplace(key, exec).first;
  }
  DFLASH_CUDA_CHECK(cudaGraphLaunch(it->second, s));
}

}  // namespace

CudaTrainBackend::CudaTrainBackend(int device, const TargetModel& target,
                                   const DrafterConfig& cfg, const DrafterLayout& layout,
                                   int64_t max_ctx, bool use_graphs)
    : taps_(cfg.target_layer_ids),
      max_ctx_(max_ctx),
      max_rows_(max_ctx * cfg.block_size),
      use_graphs_(use_graphs) {
  const int n = cuda::device_count();
  DFLASH_CHECK(device >= 0 && device < n,
               "runtime.devices: CUDA device {} does not exist ({} visible)", device, n);
  description_ = fmt::format("cuda:{} {}, CUDA graphs {}", device,
                             cuda::device_description(device), use_graphs ? "on" : "off");
  ctx_ = std::make_unique<cuda::CudaContext>(device);
  target_ = std::make_unique<TargetCuda>(*ctx_, target, max_ctx);
  drafter_ = std::make_unique<DrafterCuda>(*ctx_, cfg, layout, max_ctx, max_rows_,
                                           target_->embed(), target_->lm_head());
  in_ = std::make_unique<Inputs>();
  const auto T = static_cast<size_t>(max_ctx), NK = static_cast<size_t>(max_rows_);
  in_->tokens = make_staged(*ctx_, T * sizeof(int32_t));
  in_->target_ranges = make_staged(*ctx_, T * sizeof(AttnRange));
  in_->pos = make_staged(*ctx_, (T + NK) * sizeof(int32_t));
  in_->block_tokens = make_staged(*ctx_, NK * sizeof(int32_t));
  in_->block_ranges = make_staged(*ctx_, NK * sizeof(AttnRange));
  in_->labels = make_staged(*ctx_, NK * sizeof(int32_t));
  in_->weights = make_staged(*ctx_, NK * sizeof(float));
  in_->start = ctx_->new_event(true);
  in_->after_target = ctx_->new_event(true);
  in_->end = ctx_->new_event(true);
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
  target_->forward_taps(drafter_->features(), in_->tokens.dev.as<int32_t>(),
                        in_->pos.dev.as<int32_t>(), in_->target_ranges.dev.as<AttnRange>(), T,
                        taps_);
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
  di.pos = in_->pos.dev.as<int32_t>();
  di.block_tokens = in_->block_tokens.dev.as<int32_t>();
  di.ranges = in_->block_ranges.dev.as<AttnRange>();
  di.labels = in_->labels.dev.as<int32_t>();
  di.weights = in_->weights.dev.as<float>();
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
    replay(in_->target_graphs, T, st, [&] { enqueue_target(T); });
  } else {
    enqueue_target(T);
  }
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->after_target, st));
  if (use_graphs_) {
    replay(in_->drafter_graphs, std::pair<int64_t, int64_t>(T, NK), st,
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
