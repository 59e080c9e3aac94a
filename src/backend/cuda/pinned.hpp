// dflash.cpp — page-locked host buffers, for the host side of the training stages
// (src/train/cuda_stages.cpp). No fmt here (includable anywhere).
//
// Invariants: a PinnedBuffer owns its cudaMallocHost block (copies from it are asynchronous and can
// be captured in a graph; it must outlive every copy enqueued from it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "backend/cuda/check.hpp"

namespace dflash::cuda {

/// Page-locked host memory of `bytes` bytes (move-only).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    DFLASH_CUDA_CHECK(cudaMallocHost(&p_, bytes > 0 ? bytes : 1));
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

}  // namespace dflash::cuda
