// dflash.cpp — DeviceArena and PinnedUploader (see arena.hpp).
#include "backend/cuda/arena.hpp"

#include <cstring>

#include "backend/cuda/check.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"

namespace dflash::cuda {

DeviceArena::DeviceArena(CudaContext& ctx, ArenaPlan plan)
    : device_(ctx.device()), plan_(std::move(plan)), taken_(plan_.buffers.size(), false) {
  ctx.make_current();
  if (plan_.arena_bytes == 0) return;
  const cudaError_t e = cudaMalloc(&base_, plan_.arena_bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    fail("cuda:{}: cannot allocate the memory plan's arena of {} ({}; {} free of {})", device_,
         format_bytes(plan_.arena_bytes), cudaGetErrorString(e), format_bytes(free),
         format_bytes(total));
  }
}

DeviceArena::~DeviceArena() {
  if (base_) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    cudaFree(base_);
    cudaSetDevice(prev);
  }
}

void* DeviceArena::get_bytes(std::string_view name, uint64_t bytes) {
  for (size_t i = 0; i < plan_.buffers.size(); ++i) {
    const PlanBuffer& b = plan_.buffers[i];
    if (b.name != name) continue;
    DFLASH_CHECK(bytes <= b.bytes,
                 "memory plan: buffer '{}' is planned for {} bytes but {} are needed (the plan "
                 "and the code that uses it disagree)",
                 name, b.bytes, bytes);
    taken_[i] = true;
    return static_cast<char*>(base_) + b.offset;
  }
  fail("memory plan: no buffer named '{}' (the plan and the code that uses it disagree)", name);
}

uint64_t DeviceArena::planned_bytes(std::string_view name) const {
  return plan_.find(name).bytes;
}

std::vector<std::string> DeviceArena::untaken() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < plan_.buffers.size(); ++i) {
    if (!taken_[i]) out.push_back(plan_.buffers[i].name);
  }
  return out;
}

PinnedUploader::PinnedUploader(CudaContext& ctx, size_t chunk_bytes, int n_buffers)
    : ctx_(ctx), chunk_(chunk_bytes) {
  DFLASH_CHECK(chunk_bytes > 0 && n_buffers > 0, "PinnedUploader: {} buffers of {} bytes",
               n_buffers, chunk_bytes);
  for (int i = 0; i < n_buffers; ++i) {
    void* p = nullptr;
    DFLASH_CUDA_CHECK(cudaMallocHost(&p, chunk_bytes));
    host_.push_back(p);
    done_.push_back(ctx.new_event(false));
  }
}

PinnedUploader::~PinnedUploader() {
  // Copies may still read the staging buffers: wait before freeing them.
  cudaStreamSynchronize(ctx_.stream());
  for (void* p : host_) cudaFreeHost(p);
}

void PinnedUploader::upload(void* dst, size_t bytes, const Fill& fill) {
  for (size_t off = 0; off < bytes; off += chunk_) {
    const size_t n = std::min(chunk_, bytes - off);
    const size_t i = next_;
    next_ = (next_ + 1) % host_.size();
    // The copy that last read this staging buffer must be done before it is refilled.
    DFLASH_CUDA_CHECK(cudaEventSynchronize(done_[i]));
    fill(host_[i], off, n);
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, host_[i], n,
                                      cudaMemcpyHostToDevice, ctx_.stream()));
    DFLASH_CUDA_CHECK(cudaEventRecord(done_[i], ctx_.stream()));
    total_ += n;
  }
}

void PinnedUploader::upload(void* dst, const void* src, size_t bytes) {
  const auto* s = static_cast<const char*>(src);
  upload(dst, bytes, [s](void* out, size_t off, size_t n) {
    // Split over threads: reading a memory-mapped file is bound by page faults per thread.
    constexpr int64_t kPiece = int64_t{1} << 20;
    const auto pieces = static_cast<int64_t>((n + kPiece - 1) / kPiece);
    parallel_for(pieces, [&](int64_t b, int64_t e) {
      const size_t lo = static_cast<size_t>(b * kPiece);
      const size_t hi = std::min(n, static_cast<size_t>(e * kPiece));
      std::memcpy(static_cast<char*>(out) + lo, s + off + lo, hi - lo);
    });
  });
}

void PinnedUploader::finish() {
  ctx_.synchronize();
}

}  // namespace dflash::cuda
