// dflash.cpp — tensors and buffers.
//
// A Tensor is a typed, strided view of a Storage (a byte buffer on one device). Several tensors may
// share one Storage (views); a Storage either owns its bytes (freed with the last reference) or wraps
// memory owned elsewhere (an mmap'd file, a caller's array) and frees nothing.
// Invariants: shape and strides have the same rank; strides are in elements, not bytes; a view never
// reaches outside its storage (checked when a view is made).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace dflash {

/// Where bytes live: the host, or CUDA device `index`.
struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int i) { return {Kind::cuda, i}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device&) const = default;
  /// "cpu" or "cuda:N".
  std::string str() const;
  /// Parses "cpu" or "cuda:N" (also "cuda" = "cuda:0"); throws dflash::Error otherwise.
  static Device parse(const std::string& s);
};

/// A byte buffer on one device. Owning buffers free their bytes with `deleter` on destruction.
class Storage {
 public:
  /// Allocates `bytes` on `dev` (64-byte aligned on the host; cudaMalloc on a CUDA device, which
  /// throws dflash::Error in a build without CUDA). The bytes are uninitialised.
  static std::shared_ptr<Storage> allocate(size_t bytes, Device dev);
  /// Wraps memory owned elsewhere; `keepalive` (may be null) is held as long as the storage lives,
  /// e.g. the mmap of a safetensors file.
  static std::shared_ptr<Storage> wrap(void* data, size_t bytes, Device dev,
                                       std::shared_ptr<void> keepalive = nullptr);

  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool owning() const { return owning_; }

 private:
  Storage() = default;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  bool owning_ = false;
  std::shared_ptr<void> keepalive_;
};

using Shape = std::vector<int64_t>;

/// "[a, b, c]".
std::string shape_str(const Shape& s);
/// Product of the dimensions (1 for rank 0).
int64_t shape_numel(const Shape& s);

/// A strided view of typed elements in a Storage.
class Tensor {
 public:
  Tensor() = default;

  /// A new contiguous owning tensor; contents uninitialised.
  static Tensor empty(const Shape& shape, DType dtype, Device dev = Device::cpu());
  /// A new contiguous owning tensor filled with zeros.
  static Tensor zeros(const Shape& shape, DType dtype, Device dev = Device::cpu());
  /// A contiguous non-owning view of `data` (which must outlive the tensor unless `keepalive`
  /// holds it).
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device dev = Device::cpu(),
                          std::shared_ptr<void> keepalive = nullptr);
  /// A new CPU f32 tensor holding `values` with the given shape (numel must match).
  static Tensor from_f32(const std::vector<float>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim(int i) const;  ///< Size of dimension i; negative i counts from the end.
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  int64_t offset_elements() const { return offset_; }

  /// Pointer to the first element.
  void* raw() const;
  /// Typed pointer to the first element (no type check beyond size; use the right T).
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }

  /// Same storage, new shape; requires a contiguous tensor and the same numel. One dimension may
  /// be -1 (inferred). Throws dflash::Error on mismatch.
  Tensor view(const Shape& shape) const;
  /// Same storage, dimension `d` restricted to [start, end).
  Tensor slice(int d, int64_t start, int64_t end) const;
  /// Same storage, index `i` of dimension `d` removed.
  Tensor select(int d, int64_t i) const;
  /// A contiguous copy (on the same device).
  Tensor contiguous() const;
  /// A CPU copy converted to `dtype` (contiguous). CPU tensors only for now.
  Tensor to(DType dtype) const;
  /// Copies `src` into this tensor (same shape; dtypes may differ on the CPU).
  void copy_from(const Tensor& src);
  /// Fills with zeros.
  void zero_();

  /// Element `i` (flat, logical row-major order) as double; CPU only. For tests and debugging.
  double item_f64(int64_t flat_index) const;
  /// Sets element `i` from a double (rounded to the tensor's dtype); CPU only.
  void set_f64(int64_t flat_index, double v);
  /// All elements as f32 (CPU only), in logical row-major order.
  std::vector<float> to_f32_vector() const;

  /// "bf16[6, 384] cpu".
  std::string str() const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // elements
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::f32;
  int64_t flat_to_offset(int64_t flat) const;
};

/// Contiguous row-major strides for `shape`.
Shape contiguous_strides(const Shape& shape);

}  // namespace dflash
