// dflash.cpp — page-locked host buffers and a cache of captured CUDA graphs, for the host side of
// the training stages (src/train/cuda_stages.cpp). No fmt here (includable anywhere).
//
// Invariants: a PinnedBuffer owns its cudaMallocHost block (copies from it are asynchronous and can
// be captured in a graph; it must outlive every copy enqueued from it). A GraphCache belongs to the
// thread that drives its stream; a graph is captured once per key and replayed after, so the work
// of a key must enqueue the same operations on the same buffers every time.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
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

/// Executable graphs by key (e.g. a step shape).
template <typename Key>
class GraphCache {
 public:
  GraphCache() = default;
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;
  ~GraphCache() {
    for (auto& kv : graphs_) cudaGraphExecDestroy(kv.second);
  }
  /// Launches the graph of `key` on `s`, first capturing `enqueue()` into it when there is none
  /// (relaxed capture: a caching allocator may still call cudaMalloc the first time). Throws
  /// dflash::Error on a CUDA error; a failed capture leaves no graph behind.
  template <typename F>
  void launch(const Key& key, cudaStream_t s, F&& enqueue) {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
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
      it = graphs_.emplace(key, exec).first;
    }
    DFLASH_CUDA_CHECK(cudaGraphLaunch(it->second, s));
  }
  /// Graphs captured so far.
  size_t size() const { return graphs_.size(); }

 private:
  std::map<Key, cudaGraphExec_t> graphs_;
};

}  // namespace dflash::cuda
