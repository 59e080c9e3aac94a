// dflash.cpp — CUDA graphs of a stream's work, one per key (e.g. a step shape): the first run of a
// key captures the work into a graph, every run launches the key's graph.
//
// Invariants: capture uses cudaStreamCaptureModeRelaxed on the caller's stream (allocations are
// not expected during capture, but cuBLASLt's plan queries for a new shape must stay legal); a
// failed capture is ended and discarded before the error propagates, leaving the stream usable.
// The same enqueued work with the same arguments gives the same bits replayed or not. Not
// thread-safe (owned by the thread that owns the stream).
#pragma once

#include <cuda_runtime.h>

#include <map>

#include "backend/cuda/check.hpp"

namespace dflash::cuda {

/// Instantiated graphs by key.
template <typename Key>
class GraphCache {
 public:
  GraphCache() = default;
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;
  ~GraphCache() {
    for (auto& [k, g] : graphs_) cudaGraphExecDestroy(g);
  }

  /// Launches the graph of `key` on `s`, capturing `enqueue()` (which must enqueue its work on
  /// `s` only) into it first when the key is new.
  template <typename F>
  void run(const Key& key, cudaStream_t s, F&& enqueue) {
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

  /// Keys captured so far.
  size_t size() const { return graphs_.size(); }

 private:
  std::map<Key, cudaGraphExec_t> graphs_;
};

}  // namespace dflash::cuda
