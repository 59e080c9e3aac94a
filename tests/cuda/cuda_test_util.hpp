// dflash.cpp — helpers of the CUDA op tests: skip without a GPU, device buffers with a guard region
// after the payload (poisoned payload, patterned guard, checked after the op), bf16 helpers and
// random data. Header-only; included by tests/cuda/*_cuda_test.cpp.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/check.hpp"
#include "backend/cuda/device.hpp"
#include "core/dtype.hpp"

/// Skips the current test when no CUDA device is visible.
#define DFLASH_REQUIRE_GPU() \
  if (::dflash::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

namespace dflash::test {

/// A device array of n T's followed by `guard` bytes. The payload starts poisoned with 0xFF bytes
/// (NaN for floats, -1 for integers) so unwritten outputs show; the guard holds a fixed pattern
/// that guard_intact() checks.
template <typename T>
class DeviceGuarded {
 public:
  explicit DeviceGuarded(size_t n, size_t guard = 256) : n_(n), guard_(guard) {
    DFLASH_CUDA_CHECK(cudaMalloc(&p_, bytes() + guard_));
    DFLASH_CUDA_CHECK(cudaMemset(p_, 0xFF, bytes()));
    std::vector<uint8_t> g = pattern();
    DFLASH_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(p_) + bytes(), g.data(), guard_,
                                 cudaMemcpyHostToDevice));
    // The ops run in non-blocking streams, which do not wait for the legacy stream's memset and
    // pageable copies: finish them first.
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
  }
  explicit DeviceGuarded(const std::vector<T>& host, size_t guard = 256)
      : DeviceGuarded(host.size(), guard) {
    upload(host);
  }
  ~DeviceGuarded() { cudaFree(p_); }
  DeviceGuarded(const DeviceGuarded&) = delete;
  DeviceGuarded& operator=(const DeviceGuarded&) = delete;

  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  void upload(const std::vector<T>& h) {
    EXPECT_EQ(h.size(), n_);
    if (n_) DFLASH_CUDA_CHECK(cudaMemcpy(p_, h.data(), bytes(), cudaMemcpyHostToDevice));
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());  // see the constructor
  }
  std::vector<T> download() const {
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n_);
    if (n_) DFLASH_CUDA_CHECK(cudaMemcpy(h.data(), p_, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
  bool guard_intact() const {
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> g(guard_);
    DFLASH_CUDA_CHECK(cudaMemcpy(g.data(), static_cast<uint8_t*>(p_) + bytes(), guard_,
                                 cudaMemcpyDeviceToHost));
    return g == pattern();
  }

 private:
  std::vector<uint8_t> pattern() const {
    std::vector<uint8_t> g(guard_);
    for (size_t i = 0; i < guard_; ++i) g[i] = static_cast<uint8_t>(0xA5 ^ (i * 7));
    return g;
  }
  size_t n_, guard_;
  void* p_ = nullptr;
};

/// n normal(0, sd) floats from a seeded generator.
inline std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}
/// bf16 bits of each value (round to nearest even).
inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = f32_to_bf16_bits(v[i]);
  return r;
}
/// Widens bf16 bits to floats (exact).
inline std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_bits_to_f32(v[i]);
  return r;
}
/// Rounds each value to bf16 and back.
inline std::vector<float> round_bf16(const std::vector<float>& v) { return from_bf16(to_bf16(v)); }
/// True when the two arrays hold the same bits.
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace dflash::test
