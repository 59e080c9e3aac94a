// dflash.cpp — device memory from a memory plan (core/arena_plan.hpp), and host-to-device uploads
// through pinned staging buffers.
//
// Invariants:
//   * A DeviceArena is one cudaMalloc of exactly plan.arena_bytes; get() hands out the planned
//     buffer of a name and refuses a request larger than planned (naming the buffer), so code that
//     uses an arena cannot write past what the plan reserved, and buffers that the plan lets
//     overlap are used only in disjoint phases of the step (the planner's contract).
//   * A PinnedUploader copies in the context's stream, in order; the host fills one staging buffer
//     while the copies of the others run. finish() waits for every copy; nothing it staged may be
//     read on the device by another stream before that.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/cuda/context.hpp"
#include "core/arena_plan.hpp"

namespace dflash::cuda {

/// The device memory of one ArenaPlan.
class DeviceArena {
 public:
  /// Allocates plan.arena_bytes on ctx's device. Throws dflash::Error naming the size, the free and
  /// total device memory when cudaMalloc fails.
  DeviceArena(CudaContext& ctx, ArenaPlan plan);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  /// The buffer `name` for `count` elements of T. Throws dflash::Error when the plan has no such
  /// buffer or planned fewer than count·sizeof(T) bytes.
  template <typename T>
  T* get(std::string_view name, int64_t count) {
    return static_cast<T*>(get_bytes(name, static_cast<uint64_t>(count) * sizeof(T)));
  }
  /// The buffer `name`, checked to hold `bytes`.
  void* get_bytes(std::string_view name, uint64_t bytes);
  /// Planned size of buffer `name` (throws when absent).
  uint64_t planned_bytes(std::string_view name) const;
  const ArenaPlan& plan() const { return plan_; }
  uint64_t bytes() const { return plan_.arena_bytes; }
  /// Planned buffers nobody has asked for (a plan that lists more than the code uses is wrong).
  std::vector<std::string> untaken() const;

 private:
  int device_;
  ArenaPlan plan_;
  void* base_ = nullptr;
  std::vector<bool> taken_;
};

/// Host → device copies through a ring of page-locked staging buffers (see the file invariants).
class PinnedUploader {
 public:
  /// `n_buffers` staging buffers of `chunk_bytes` each.
  explicit PinnedUploader(CudaContext& ctx, size_t chunk_bytes = size_t{64} << 20,
                          int n_buffers = 3);
  ~PinnedUploader();
  PinnedUploader(const PinnedUploader&) = delete;
  PinnedUploader& operator=(const PinnedUploader&) = delete;

  /// Fills host bytes [offset, offset + n) of the upload into `out` (a staging buffer).
  using Fill = std::function<void(void* out, size_t offset, size_t n)>;
  /// Enqueues device dst[0, bytes) = the bytes `fill` produces, chunk by chunk (the fill of a
  /// chunk runs on the calling thread, split over the CPU threads of core/parallel).
  void upload(void* dst, size_t bytes, const Fill& fill);
  /// Enqueues device dst[0, bytes) = host src[0, bytes).
  void upload(void* dst, const void* src, size_t bytes);
  /// Waits for every copy enqueued so far.
  void finish();
  /// Bytes uploaded so far.
  uint64_t bytes() const { return total_; }

 private:
  CudaContext& ctx_;
  size_t chunk_;
  std::vector<void*> host_;
  std::vector<cudaEvent_t> done_;
  size_t next_ = 0;
  uint64_t total_ = 0;
};

}  // namespace dflash::cuda
