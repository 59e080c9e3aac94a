// dflash.cpp — the target's causal varlen prefill through cuDNN's fused attention (SDPA).
//
// Computes the same function as attention_fwd_cuda (src/ops/attention.hpp) for causal attention
// over packed documents: o [T, NH, D] = softmax(scale·q·kᵀ over the row's document prefix)·v,
// q, o [T, NH, D] and k, v [T, NKV, D] bf16 row-major, GQA (query head h reads key/value head
// h / (NH/NKV)), no lse (the target is frozen: forward only).
//
// Invariants:
// - One cuDNN graph per CudnnCausalPrefill, built in its constructor for a fixed shape (B document
//   slots, documents of at most S rows, NH, NKV, D, scale): the cuDNN "BSHD" layout with ragged
//   offsets, the padding mask (per-slot lengths, empty slots allowed) and the top-left causal mask.
//   Replaying it is one enqueue on the context's stream, capturable in a CUDA graph.
// - The documents come from the same causal key ranges every attention op takes: set_documents
//   derives, on the device, each document's first row, length and the ragged element offsets of
//   q/o and k/v. A range that is not of the causal varlen form {doc_start, t+1, 0, 0}, more
//   documents than B or a document longer than S stops the kernel with a device-side trap (the
//   stream's next synchronisation throws; the message names the row), never a partial result.
// - No fallback: a shape cuDNN cannot run throws dflash::Error from the constructor with cuDNN's
//   reason and the runtime cuDNN version.
// - cuDNN's fused-attention forward reduces in a fixed order: two runs give identical bits (a test
//   says so).
// Library: cuDNN 9 (the backend library, from the CUDA installation) through the cudnn-frontend
// header library (scripts/setup.sh unpacks the pinned nvidia-cudnn-frontend wheel's headers into
// .deps/); docs/design-notes.md and the README's library table say why.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ops/attention.hpp"

#ifdef DFLASH_HAVE_CUDA
struct cudnnContext;  // cudnn.h: cudnnHandle_t is a cudnnContext*
#endif

namespace dflash {

/// The fixed shape of a cuDNN causal prefill graph.
struct CudnnPrefillShape {
  int64_t max_docs = 0;     ///< B: document slots (≥ the documents of any forward)
  int64_t max_doc_len = 0;  ///< S: rows of the longest document of any forward
  int64_t NH = 0;           ///< query heads
  int64_t NKV = 0;          ///< key/value heads (NH % NKV == 0)
  int64_t D = 0;            ///< head dimension (what cuDNN accepts: multiples of 8 up to 256)
  double scale = 0;         ///< multiplies q·k (usually 1/sqrt(D))
};

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// One cuDNN handle (cudnnCreate on a context's device, cudnnDestroy with the object), shared by
/// the CudnnCausalPrefill graphs of one context (TargetCuda's document buckets). Throws
/// dflash::Error with cuDNN's message when cudnnCreate fails (e.g. no cuDNN for this GPU).
class CudnnHandle {
 public:
  explicit CudnnHandle(cuda::CudaContext& ctx);
  ~CudnnHandle();
  CudnnHandle(const CudnnHandle&) = delete;
  CudnnHandle& operator=(const CudnnHandle&) = delete;
  /// The cudnnHandle_t (a cudnnContext*).
  ::cudnnContext* get() const { return handle_; }

 private:
  ::cudnnContext* handle_ = nullptr;
};

/// A cuDNN fused-attention graph for the causal varlen prefill of one fixed shape, with its
/// device index arrays (slot lengths, ragged offsets; (4B + 3)·4 bytes) and cuDNN workspace, both
/// cudaMalloc'ed by the constructor (outside any arena; sizes: index_bytes(), workspace_bytes()).
/// Not thread-safe; bound to one context (its device and stream).
class CudnnCausalPrefill {
 public:
  /// Builds the graph on ctx's device with `handle` (a handle of ctx's device; null: a handle of
  /// its own). Throws dflash::Error on bad sizes (naming them) or when cuDNN has no engine for the
  /// shape (cuDNN's message and its version).
  CudnnCausalPrefill(cuda::CudaContext& ctx, const CudnnPrefillShape& shape,
                     std::shared_ptr<CudnnHandle> handle = nullptr);
  ~CudnnCausalPrefill();
  CudnnCausalPrefill(const CudnnCausalPrefill&) = delete;
  CudnnCausalPrefill& operator=(const CudnnCausalPrefill&) = delete;

  /// Enqueues the kernel that reads `ranges` [T] (DEVICE, causal varlen form) and writes the
  /// document slots used by every later forward() until the next call. Graph-capturable.
  /// Throws dflash::Error when T < 1 or T·NH·D ≥ 2³¹ (int32 ragged offsets); device-side trap as
  /// the file comment says.
  void set_documents(const AttnRange* ranges, int64_t T);
  /// o [T, NH, D] = causal attention of q [T, NH, D] over k, v [T, NKV, D] (bf16 bits, DEVICE,
  /// 16-byte aligned), T and the documents of the last set_documents; o is overwritten, rows of
  /// every document written. Graph-capturable. Throws dflash::Error on null or misaligned
  /// pointers, before set_documents, or when cuDNN's execution fails (its message).
  void forward(uint16_t* o, const uint16_t* q, const uint16_t* k, const uint16_t* v);

  const CudnnPrefillShape& shape() const;
  /// Bytes of cuDNN workspace the graph asked for.
  int64_t workspace_bytes() const;
  /// Bytes of the device index arrays: (4·max_docs + 3)·4.
  int64_t index_bytes() const;
  /// The cuDNN library version loaded at run time (e.g. 91900 for 9.19.0).
  static int64_t cudnn_version();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
#endif

}  // namespace dflash
