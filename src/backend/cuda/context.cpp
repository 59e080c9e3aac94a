// dflash.cpp — CudaContext and CachingAllocator (see context.hpp for the ownership rules).
#include "backend/cuda/context.hpp"

#include <cublasLt.h>

#include <algorithm>
#include <utility>

#include "backend/cuda/check.hpp"
#include "backend/cuda/gemm.hpp"
#include "core/arena_plan.hpp"
#include "core/error.hpp"

namespace dflash::cuda {

// ---------------------------------------------------------------- CachingAllocator

size_t CachingAllocator::size_class(size_t bytes) {
  constexpr size_t kSmall = 512, kSmallMax = 64u << 10, kPow2Max = 64u << 20, kLarge = 2u << 20;
  if (bytes <= kSmallMax) return (bytes + kSmall - 1) / kSmall * kSmall;
  if (bytes <= kPow2Max) {
    size_t c = kSmallMax;
    while (c < bytes) c <<= 1;
    return c;
  }
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

CachingAllocator::CachingAllocator(int device) : device_(device) {}

CachingAllocator::~CachingAllocator() {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  for (auto& [cls, list] : free_)
    for (void* p : list) cudaFree(p);
  for (auto& [p, cls] : live_) cudaFree(p);  // blocks still handed out die with the allocator
  cudaSetDevice(prev);
}

void CachingAllocator::use_pool(void* base, size_t bytes) {
  DFLASH_CHECK(base != nullptr && bytes > 0, "cuda:{}: empty scratch pool", device_);
  DFLASH_CHECK(pool_blocks_.empty(), "cuda:{}: scratch pool replaced while in use", device_);
  const auto* lo = static_cast<const char*>(base);
  for (const auto& [p, cls] : live_) {
    const auto* q = static_cast<const char*>(p);
    DFLASH_CHECK(q + cls <= lo || q >= lo + bytes,
                 "cuda:{}: the scratch pool overlaps a live block of this allocator", device_);
  }
  pool_ = static_cast<char*>(base);
  pool_bytes_ = bytes;
}

void* CachingAllocator::pool_allocate(size_t bytes) {
  const size_t begin = pool_blocks_.empty() ? 0 : pool_blocks_.back().end;
  const size_t end = begin + arena_round(bytes);
  DFLASH_CHECK(end <= pool_bytes_,
               "cuda:{}: the op scratch pool of {} bytes cannot hold {} more bytes ({} in use): "
               "the memory plan's 'workspace.op_scratch' is too small for this op",
               device_, pool_bytes_, bytes, begin);
  pool_blocks_.push_back(PoolBlock{begin, end, false});
  ++stats_.n_alloc;
  stats_.pool_peak = std::max(stats_.pool_peak, end);
  return pool_ + begin;
}

bool CachingAllocator::pool_deallocate(void* p) {
  auto* c = static_cast<char*>(p);
  if (pool_ == nullptr || c < pool_ || c >= pool_ + pool_bytes_) return false;
  const auto begin = static_cast<size_t>(c - pool_);
  for (auto it = pool_blocks_.rbegin(); it != pool_blocks_.rend(); ++it) {
    if (it->begin == begin && !it->freed) {
      it->freed = true;
      while (!pool_blocks_.empty() && pool_blocks_.back().freed) pool_blocks_.pop_back();
      return true;
    }
  }
  fail("cuda:{}: deallocate of a scratch pool address that is not a live block", device_);
}

void* CachingAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (pool_ != nullptr) return pool_allocate(bytes);
  const size_t cls = size_class(bytes);
  ++stats_.n_alloc;
  void* p = nullptr;
  auto it = free_.find(cls);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    ++stats_.n_hits;
  } else {
    DFLASH_CHECK(!frozen_,
                 "cuda:{}: caching allocator is frozen (after warm-up) but a block of {} bytes "
                 "(class {}) is not cached: the step loop would call cudaMalloc",
                 device_, bytes, cls);
    cudaError_t e = cudaMalloc(&p, cls);
    if (e != cudaSuccess) {
      cudaGetLastError();
      release_cached();  // give the cache back and retry once
      e = cudaMalloc(&p, cls);
    }
    DFLASH_CHECK(e == cudaSuccess, "cuda:{}: cudaMalloc of {} bytes failed: {} ({} reserved)",
                 device_, cls, cudaGetErrorString(e), stats_.bytes_reserved);
    ++stats_.n_cuda_malloc;
    stats_.bytes_reserved += cls;
  }
  live_.emplace(p, cls);
  stats_.bytes_in_use += cls;
  if (stats_.bytes_in_use > stats_.peak_in_use) stats_.peak_in_use = stats_.bytes_in_use;
  return p;
}

void CachingAllocator::deallocate(void* p) {
  if (p == nullptr) return;
  if (pool_deallocate(p)) return;
  auto it = live_.find(p);
  DFLASH_CHECK(it != live_.end(), "cuda:{}: deallocate of a pointer this allocator did not give",
               device_);
  const size_t cls = it->second;
  live_.erase(it);
  stats_.bytes_in_use -= cls;
  free_[cls].push_back(p);
}

void CachingAllocator::release_cached() {
  for (auto& [cls, list] : free_) {
    for (void* p : list) {
      cudaFree(p);
      stats_.bytes_reserved -= cls;
    }
    list.clear();
  }
}

// ---------------------------------------------------------------- DeviceBuffer

DeviceBuffer::DeviceBuffer(CachingAllocator* alloc, size_t bytes)
    : alloc_(alloc), ptr_(alloc->allocate(bytes)), bytes_(bytes) {}
DeviceBuffer::~DeviceBuffer() {
  if (alloc_ && ptr_) alloc_->deallocate(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : alloc_(std::exchange(o.alloc_, nullptr)),
      ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (alloc_ && ptr_) alloc_->deallocate(ptr_);
    alloc_ = std::exchange(o.alloc_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

// ---------------------------------------------------------------- CudaContext

CudaContext::CudaContext(int device, size_t workspace_bytes)
    : device_(device), workspace_bytes_(workspace_bytes) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  DFLASH_CHECK(e == cudaSuccess && device >= 0 && device < n,
               "CudaContext: device cuda:{} is not available ({} devices: {})", device, n,
               cudaGetErrorString(e));
  DFLASH_CUDA_CHECK(cudaSetDevice(device));
  DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cublasStatus_t s = cublasLtCreate(&lt_);
  DFLASH_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuda:{}: cublasLtCreate failed (status {})", device,
               static_cast<int>(s));
  alloc_ = std::make_unique<CachingAllocator>(device);
  if (workspace_bytes_ > 0) DFLASH_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

CudaContext::~CudaContext() {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  gemm_plans_.clear();
  for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  alloc_.reset();
  if (workspace_) cudaFree(workspace_);
  if (lt_) cublasLtDestroy(lt_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaContext::make_current() const { DFLASH_CUDA_CHECK(cudaSetDevice(device_)); }

void CudaContext::synchronize() const { DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

Tensor CudaContext::empty(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto buf = std::make_shared<DeviceBuffer>(alloc_.get(), bytes);
  return Tensor::from_blob(buf->data(), shape, dtype, Device::cuda(device_), buf);
}

cudaEvent_t CudaContext::new_event(bool timing) {
  cudaEvent_t ev = nullptr;
  DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault
                                                         : cudaEventDisableTiming));
  events_.push_back(ev);
  return ev;
}

}  // namespace dflash::cuda
