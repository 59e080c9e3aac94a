// dflash.cpp — per-device CUDA context: one stream, one cuBLASLt handle and workspace, a caching
// allocator and the GEMM plan cache, owned by ONE thread.
//
// Invariants:
//   * A CudaContext is used by the thread that created it (or one it was handed to); nothing in it
//     is locked. Two threads driving two contexts share nothing mutable: there is no global state
//     in the CUDA backend (kernels read only their arguments).
//   * All work of the context runs in its one stream, in order. Memory returned to the caching
//     allocator is therefore reusable at once by later work of the same stream (stream order),
//     which also holds inside a captured graph.
//   * The caching allocator calls cudaMalloc only on a miss; after `freeze()` (end of warm-up) a
//     miss throws dflash::Error instead, so "no cudaMalloc in the step loop" is enforced.
//   * The constructor makes the device current for the calling thread; every entry point assumes
//     the owning thread keeps it current (make_current() restores it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.hpp"

struct cublasLtContext;

namespace dflash::cuda {

/// Counters of a CachingAllocator (bytes are rounded to the size class).
struct AllocatorStats {
  size_t bytes_in_use = 0;    ///< handed out and not yet returned
  size_t bytes_reserved = 0;  ///< obtained from cudaMalloc (in use + cached)
  size_t peak_in_use = 0;
  int64_t n_cuda_malloc = 0;  ///< cudaMalloc calls made
  int64_t n_alloc = 0;        ///< allocate() calls
  int64_t n_hits = 0;         ///< allocate() calls served from a free list
  size_t pool_peak = 0;       ///< highest byte of the scratch pool used (see use_pool)
};

/// Device memory with size-class free lists. Classes: multiples of 512 B up to 64 KiB, then powers
/// of two up to 64 MiB, then multiples of 2 MiB. Every block is at least 256-byte aligned. Not
/// thread-safe (owned by one CudaContext). Blocks are freed to the driver only by release_cached()
/// or the destructor.
class CachingAllocator {
 public:
  explicit CachingAllocator(int device);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block of at least `bytes` (0 gives nullptr). Throws dflash::Error when cudaMalloc fails or
  /// when the allocator is frozen and no cached block fits.
  void* allocate(size_t bytes);
  /// Returns a block from allocate() to its free list (nullptr is ignored; an unknown pointer
  /// throws).
  void deallocate(void* p);
  /// After this, a miss throws instead of calling cudaMalloc (end of warm-up). unfreeze() undoes.
  void freeze() { frozen_ = true; }
  void unfreeze() { frozen_ = false; }
  bool frozen() const { return frozen_; }
  /// cudaFree of every cached (free) block.
  void release_cached();
  /// From now on allocate() serves every request from the device range [base, base + bytes) as a
  /// stack: each block kArenaAlign-aligned above the highest live one; a freed block's bytes are
  /// reused once every block above it is freed too (ops free their scratch in reverse order). A
  /// request that does not fit throws dflash::Error naming the pool size; nothing calls cudaMalloc.
  /// Blocks handed out before keep going back to their free lists. The range stays owned by the
  /// caller (e.g. a DeviceArena buffer), must outlive the allocator's use of it, and must not
  /// overlap a live block of this allocator (dflash::Error).
  void use_pool(void* base, size_t bytes);
  const AllocatorStats& stats() const { return stats_; }
  /// The size class `bytes` is rounded to.
  static size_t size_class(size_t bytes);

 private:
  int device_;
  bool frozen_ = false;
  AllocatorStats stats_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> cached blocks
  std::unordered_map<void*, size_t> live_;     // block -> size class
  struct PoolBlock {
    size_t begin = 0, end = 0;  // byte range in the pool
    bool freed = false;
  };
  char* pool_ = nullptr;
  size_t pool_bytes_ = 0;
  std::vector<PoolBlock> pool_blocks_;  // live pool blocks, by address
  void* pool_allocate(size_t bytes);
  bool pool_deallocate(void* p);
};

class CudaContext;

/// A block of a context's caching allocator, returned to it on destruction (move-only).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(CachingAllocator* alloc, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  CachingAllocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct GemmPlan;  // gemm.cpp: cuBLASLt descriptors and the chosen algorithm of one GEMM shape

/// Everything one thread needs to drive one GPU.
class CudaContext {
 public:
  /// Creates the stream (non-blocking), the cuBLASLt handle, a `workspace_bytes` cuBLASLt
  /// workspace and the allocator on device `device`, and makes the device current. Throws
  /// dflash::Error (naming the device) on any CUDA failure.
  explicit CudaContext(int device, size_t workspace_bytes = 32u << 20);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  cublasLtContext* cublaslt() const { return lt_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  CachingAllocator& allocator() { return *alloc_; }
  /// cudaSetDevice(device()) for the calling thread.
  void make_current() const;
  /// Waits for all work queued in the stream; throws on an asynchronous CUDA error.
  void synchronize() const;

  /// A scratch buffer from the caching allocator (returned when the DeviceBuffer dies).
  DeviceBuffer scratch(size_t bytes) { return DeviceBuffer(alloc_.get(), bytes); }
  /// A contiguous Tensor on this device whose bytes come from the caching allocator (they return
  /// to it when the last view of the tensor dies; the context must outlive the tensor).
  Tensor empty(const Shape& shape, DType dtype);

  /// An event owned by the context (destroyed with it); `timing` enables cudaEventElapsedTime.
  cudaEvent_t new_event(bool timing = false);

  /// GEMM plans keyed by shape (gemm.cpp); owned here so that each context has its own.
  std::unordered_map<std::string, std::unique_ptr<GemmPlan>>& gemm_plans() { return gemm_plans_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cublasLtContext* lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::unique_ptr<CachingAllocator> alloc_;
  std::vector<cudaEvent_t> events_;
  std::unordered_map<std::string, std::unique_ptr<GemmPlan>> gemm_plans_;
};

}  // namespace dflash::cuda
