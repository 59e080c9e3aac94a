// dflash.cpp — element types and the bf16/f16 conversions.
//
// bf16 is the upper half of an IEEE-754 binary32; f32 -> bf16 rounds to nearest, ties to even
// (the rounding of PyTorch's `.to(torch.bfloat16)`), NaN stays NaN (quiet), ±Inf stays ±Inf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dflash {

/// Element type of a tensor. `boolean` is one byte per element (0 or 1), as in safetensors BOOL;
/// `u8` is an unsigned byte (safetensors U8, e.g. masks written by PyTorch).
enum class DType : uint8_t { f32, bf16, f16, i32, i64, boolean, u8 };

/// Size of one element in bytes.
size_t dtype_size(DType t);
/// Short lower-case name: "f32", "bf16", "f16", "i32", "i64", "bool", "u8".
std::string_view dtype_name(DType t);
/// The safetensors header name: "F32", "BF16", "F16", "I32", "I64", "BOOL", "U8".
std::string_view dtype_safetensors_name(DType t);
/// Parses a safetensors dtype name; returns false when the name is not one of the seven above.
bool dtype_from_safetensors_name(std::string_view name, DType* out);
/// Parses a short name ("f32", "bf16", "float32", "bfloat16", …); throws dflash::Error naming it.
DType dtype_from_name(std::string_view name);
/// True for f32, bf16, f16.
bool dtype_is_float(DType t);

/// bf16 storage type (raw bits).
struct bf16 {
  uint16_t bits;
};

/// f32 -> bf16, round to nearest even; NaN maps to a quiet NaN with the same sign.
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  }
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
/// bf16 -> f32 (exact).
inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// Rounds an f32 to the nearest bf16 value and returns it as f32 (the "bf16 round trip").
inline float round_to_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }

/// IEEE binary16 -> f32 (exact; subnormals, Inf and NaN preserved).
float f16_bits_to_f32(uint16_t h);
/// f32 -> IEEE binary16, round to nearest even; overflow gives ±Inf, NaN stays NaN.
uint16_t f32_to_f16_bits(float f);

/// Converts `n` elements from `src` (type `st`) to `dst` (type `dt`) on the CPU. Float<->float
/// conversions round as above; float->int truncates toward zero; int->int narrows with a check
/// (throws dflash::Error if a value does not fit).
void convert_elements(void* dst, DType dt, const void* src, DType st, size_t n);

}  // namespace dflash
