#include "core/tensor.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

#include "core/error.hpp"

#ifdef DFLASH_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace dflash {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    const std::string n = s.substr(5);
    if (!n.empty() && n.find_first_not_of("0123456789") == std::string::npos && n.size() < 6) {
      return cuda(std::stoi(n));
    }
  }
  fail("invalid device '{}' (expected 'cpu' or 'cuda:N')", s);
}

std::shared_ptr<Storage> Storage::allocate(size_t bytes, Device dev) {
  auto s = std::shared_ptr<Storage>(new Storage());
  s->bytes_ = bytes;
  s->device_ = dev;
  s->owning_ = true;
  if (bytes == 0) return s;
  if (dev.is_cpu()) {
    size_t rounded = (bytes + 63) / 64 * 64;
    s->data_ = std::aligned_alloc(64, rounded);
    DFLASH_CHECK(s->data_ != nullptr, "out of host memory allocating {} bytes", bytes);
  } else {
#ifdef DFLASH_HAVE_CUDA
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(dev.index);
    cudaError_t e = cudaMalloc(&s->data_, bytes);
    cudaSetDevice(prev);
    DFLASH_CHECK(e == cudaSuccess, "cudaMalloc of {} bytes on {} failed: {}", bytes, dev.str(),
                 cudaGetErrorString(e));
#else
    fail("device {} requested but this dflash was built without CUDA (DFLASH_CUDA=OFF)",
         dev.str());
#endif
  }
  return s;
}

std::shared_ptr<Storage> Storage::wrap(void* data, size_t bytes, Device dev,
                                       std::shared_ptr<void> keepalive) {
  auto s = std::shared_ptr<Storage>(new Storage());
  s->data_ = data;
  s->bytes_ = bytes;
  s->device_ = dev;
  s->owning_ = false;
  s->keepalive_ = std::move(keepalive);
  return s;
}

Storage::~Storage() {
  if (!owning_ || data_ == nullptr) return;
  if (device_.is_cpu()) {
    std::free(data_);
  } else {
#ifdef DFLASH_HAVE_CUDA
    cudaFree(data_);
#endif
  }
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= shape[i];
  }
  return st;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device dev) {
  for (int64_t d : shape) DFLASH_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape));
  Tensor t;
  t.storage_ = Storage::allocate(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), dev);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device dev) {
  Tensor t = empty(shape, dtype, dev);
  t.zero_();
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device dev,
                         std::shared_ptr<void> keepalive) {
  Tensor t;
  t.storage_ = Storage::wrap(data, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), dev,
                             std::move(keepalive));
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::from_f32(const std::vector<float>& values, const Shape& shape) {
  DFLASH_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
               "from_f32: {} values do not fill shape {}", values.size(), shape_str(shape));
  Tensor t = empty(shape, DType::f32);
  if (!values.empty()) std::memcpy(t.raw(), values.data(), values.size() * 4);
  return t;
}

int64_t Tensor::dim(int i) const {
  int r = rank();
  if (i < 0) i += r;
  DFLASH_CHECK(i >= 0 && i < r, "dimension {} out of range for a tensor of rank {}", i, r);
  return shape_[i];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_) || numel() <= 1; }

void* Tensor::raw() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  DFLASH_CHECK(is_contiguous(), "view of a non-contiguous tensor {}", str());
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      DFLASH_CHECK(infer < 0, "view: more than one -1 in {}", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    DFLASH_CHECK(known > 0 && numel() % known == 0, "view: cannot infer {} from {} elements",
                 shape_str(shape), numel());
    s[infer] = numel() / known;
  }
  DFLASH_CHECK(shape_numel(s) == numel(), "view: shape {} does not match {} elements of {}",
               shape_str(s), numel(), str());
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::slice(int d, int64_t start, int64_t end) const {
  int r = rank();
  if (d < 0) d += r;
  DFLASH_CHECK(d >= 0 && d < r, "slice: dimension {} out of range for {}", d, str());
  DFLASH_CHECK(0 <= start && start <= end && end <= shape_[d],
               "slice: range [{}, {}) outside dimension {} of size {}", start, end, d, shape_[d]);
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::select(int d, int64_t i) const {
  int r = rank();
  if (d < 0) d += r;
  DFLASH_CHECK(d >= 0 && d < r, "select: dimension {} out of range for {}", d, str());
  DFLASH_CHECK(0 <= i && i < shape_[d], "select: index {} outside dimension {} of size {}", i, d,
               shape_[d]);
  Tensor t = *this;
  t.offset_ += i * strides_[d];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

int64_t Tensor::flat_to_offset(int64_t flat) const {
  int64_t off = 0;
  for (int i = rank() - 1; i >= 0; --i) {
    int64_t idx = flat % shape_[i];
    flat /= shape_[i];
    off += idx * strides_[i];
  }
  return off;
}

Tensor Tensor::contiguous() const {
  DFLASH_CHECK(device().is_cpu() || is_contiguous(),
               "contiguous(): strided copies of device tensors are not supported ({})", str());
  if (is_contiguous()) {
    Tensor t = empty(shape_, dtype_, device());
    t.copy_from(*this);
    return t;
  }
  Tensor t = empty(shape_, dtype_);
  const size_t es = dtype_size(dtype_);
  const char* base = static_cast<const char*>(raw());
  char* dst = static_cast<char*>(t.raw());
  for (int64_t i = 0, n = numel(); i < n; ++i) {
    std::memcpy(dst + i * es, base + flat_to_offset(i) * static_cast<int64_t>(es), es);
  }
  return t;
}

Tensor Tensor::to(DType dtype) const {
  DFLASH_CHECK(device().is_cpu(), "to({}): tensor {} is not on the CPU", dtype_name(dtype), str());
  Tensor src = is_contiguous() ? *this : contiguous();
  Tensor t = empty(shape_, dtype);
  convert_elements(t.raw(), dtype, src.raw(), dtype_, static_cast<size_t>(numel()));
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  DFLASH_CHECK(src.shape() == shape_, "copy_from: shape {} into {}", shape_str(src.shape()),
               shape_str(shape_));
  if (device().is_cpu() && src.device().is_cpu()) {
    if (is_contiguous() && src.is_contiguous()) {
      convert_elements(raw(), dtype_, src.raw(), src.dtype(), static_cast<size_t>(numel()));
      return;
    }
    Tensor s = src.is_contiguous() ? src : src.contiguous();
    Tensor c = s.to(dtype_);
    const size_t es = dtype_size(dtype_);
    char* base = static_cast<char*>(raw());
    const char* from = static_cast<const char*>(c.raw());
    for (int64_t i = 0, n = numel(); i < n; ++i) {
      std::memcpy(base + flat_to_offset(i) * static_cast<int64_t>(es), from + i * es, es);
    }
    return;
  }
#ifdef DFLASH_HAVE_CUDA
  DFLASH_CHECK(src.dtype() == dtype_, "copy_from across devices needs equal dtypes ({} <- {})",
               dtype_name(dtype_), dtype_name(src.dtype()));
  DFLASH_CHECK(is_contiguous() && src.is_contiguous(),
               "copy_from across devices needs contiguous tensors");
  cudaError_t e = cudaMemcpy(raw(), src.raw(), nbytes(), cudaMemcpyDefault);
  DFLASH_CHECK(e == cudaSuccess, "cudaMemcpy {} <- {} failed: {}", str(), src.str(),
               cudaGetErrorString(e));
#else
  fail("copy_from: device tensors need a CUDA build");
#endif
}

void Tensor::zero_() {
  if (numel() == 0) return;
  if (device().is_cpu()) {
    if (is_contiguous()) {
      std::memset(raw(), 0, nbytes());
    } else {
      for (int64_t i = 0, n = numel(); i < n; ++i) set_f64(i, 0.0);
    }
    return;
  }
#ifdef DFLASH_HAVE_CUDA
  DFLASH_CHECK(is_contiguous(), "zero_ of a strided device tensor");
  cudaError_t e = cudaMemset(raw(), 0, nbytes());
  DFLASH_CHECK(e == cudaSuccess, "cudaMemset failed: {}", cudaGetErrorString(e));
#endif
}

double Tensor::item_f64(int64_t flat) const {
  DFLASH_CHECK(device().is_cpu(), "item_f64 on device tensor {}", str());
  DFLASH_CHECK(flat >= 0 && flat < numel(), "item_f64: index {} out of range ({} elements)", flat,
               numel());
  const char* p = static_cast<const char*>(raw()) +
                  flat_to_offset(flat) * static_cast<int64_t>(dtype_size(dtype_));
  float f;
  switch (dtype_) {
    case DType::i64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
    default:
      convert_elements(&f, DType::f32, p, dtype_, 1);
      return f;
  }
}

void Tensor::set_f64(int64_t flat, double v) {
  DFLASH_CHECK(device().is_cpu(), "set_f64 on device tensor {}", str());
  DFLASH_CHECK(flat >= 0 && flat < numel(), "set_f64: index {} out of range ({} elements)", flat,
               numel());
  char* p = static_cast<char*>(raw()) + flat_to_offset(flat) * static_cast<int64_t>(dtype_size(dtype_));
  if (dtype_ == DType::i64) {
    int64_t x = static_cast<int64_t>(v);
    std::memcpy(p, &x, 8);
    return;
  }
  float f = static_cast<float>(v);
  convert_elements(p, dtype_, &f, DType::f32, 1);
}

std::vector<float> Tensor::to_f32_vector() const {
  Tensor c = to(DType::f32);
  std::vector<float> out(static_cast<size_t>(c.numel()));
  if (!out.empty()) std::memcpy(out.data(), c.raw(), out.size() * 4);
  return out;
}

std::string Tensor::str() const {
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_str(shape_), device().str());
}

}  // namespace dflash
