// dflash.cpp — helpers of the checked CUDA entry points (the backend/cuda/*_cuda.cpp files): the
// DType tag of an element type and pointer alignment tests. Host-only; internal to the backend.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/dtype.hpp"

namespace dflash::cuda {

/// The DType of a CUDA op's element type: float → f32, uint16_t (bf16 bits) → bf16.
template <typename T>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>,
                "CUDA ops take float or uint16_t (bf16 bits)");
  return std::is_same_v<T, float> ? DType::f32 : DType::bf16;
}

/// True when p is a multiple of 4 bytes (the CUDA-core attention kernels' 2×bf16 loads).
inline bool aligned4(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 3u) == 0;
}
/// True when p is a multiple of 16 bytes (the tensor-core kernels' cp.async/ldmatrix rows).
inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace dflash::cuda
