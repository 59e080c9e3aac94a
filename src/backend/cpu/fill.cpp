// dflash.cpp — fill_uniform_cpu (formula in src/ops/fill.hpp).
#include "ops/fill.hpp"

#include <type_traits>

#include "core/dtype.hpp"

namespace dflash {

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

template <typename Y>
void fill_uniform_cpu(Y* y, int64_t n, float offset, float bound, uint64_t seed) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = splitmix64(seed ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    // Two roundings, as the device computes it (separate statements: never contracted to an FMA).
    const float t = bound * (2.0f * u - 1.0f);
    const float v = offset + t;
    if constexpr (std::is_same_v<Y, float>) {
      y[i] = v;
    } else {
      y[i] = f32_to_bf16_bits(v);
    }
  }
}

template void fill_uniform_cpu(float*, int64_t, float, float, uint64_t);
template void fill_uniform_cpu(uint16_t*, int64_t, float, float, uint64_t);

}  // namespace dflash
