#include "core/dtype.hpp"

#include <cmath>
#include <limits>

#include "core/error.hpp"

namespace dflash {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::boolean: return 1;
    case DType::u8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::boolean: return "bool";
    case DType::u8: return "u8";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::boolean: return "BOOL";
    case DType::u8: return "U8";
  }
  return "?";
}

bool dtype_from_safetensors_name(std::string_view n, DType* out) {
  if (n == "F32") *out = DType::f32;
  else if (n == "BF16") *out = DType::bf16;
  else if (n == "F16") *out = DType::f16;
  else if (n == "I32") *out = DType::i32;
  else if (n == "I64") *out = DType::i64;
  else if (n == "BOOL") *out = DType::boolean;
  else if (n == "U8") *out = DType::u8;
  else return false;
  return true;
}

DType dtype_from_name(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "fp32") return DType::f32;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "f16" || n == "float16" || n == "fp16") return DType::f16;
  if (n == "i32" || n == "int32") return DType::i32;
  if (n == "i64" || n == "int64") return DType::i64;
  if (n == "bool") return DType::boolean;
  if (n == "u8" || n == "uint8") return DType::u8;
  fail("unknown dtype '{}' (expected one of f32, bf16, f16, i32, i64, bool)", n);
}

bool dtype_is_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t absu = u & 0x7fffffffu;
  if (absu >= 0x7f800000u) {  // Inf or NaN
    return sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u : 0u);
  }
  if (absu >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520 -> Inf
  if (absu < 0x38800000u) {                         // result is subnormal or zero
    if (absu < 0x33000000u) return sign;            // < 2^-25 rounds to 0
    uint32_t e = absu >> 23;
    uint32_t man = (absu & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (112 - e) ... exponent offset to subnormal
    // value = man * 2^(e-150); subnormal unit = 2^-24 -> q = man >> (126 - e)
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t r = absu + 0xfffu + ((absu >> 13) & 1u);
  return sign | static_cast<uint16_t>(((r >> 13) - (112u << 10)) & 0x7fffu);
}

namespace {
double load_as_double(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::boolean: return static_cast<const uint8_t*>(p)[i] ? 1.0 : 0.0;
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}
}  // namespace

void convert_elements(void* dst, DType dt, const void* src, DType st, size_t n) {
  if (dt == st) {
    std::memcpy(dst, src, n * dtype_size(dt));
    return;
  }
  if (st == DType::i64 && dt == DType::i32) {
    auto* s = static_cast<const int64_t*>(src);
    auto* d = static_cast<int32_t*>(dst);
    for (size_t i = 0; i < n; ++i) {
      DFLASH_CHECK(s[i] >= std::numeric_limits<int32_t>::min() &&
                       s[i] <= std::numeric_limits<int32_t>::max(),
                   "value {} at element {} does not fit in i32", s[i], i);
      d[i] = static_cast<int32_t>(s[i]);
    }
    return;
  }
  if (st == DType::i32 && dt == DType::i64) {
    auto* s = static_cast<const int32_t*>(src);
    auto* d = static_cast<int64_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    // f32 as the intermediate for float->float (exact for bf16/f16 sources), double otherwise.
    double v = load_as_double(src, st, i);
    switch (dt) {
      case DType::f32: static_cast<float*>(dst)[i] = static_cast<float>(v); break;
      case DType::bf16:
        static_cast<uint16_t*>(dst)[i] = f32_to_bf16_bits(static_cast<float>(v));
        break;
      case DType::f16:
        static_cast<uint16_t*>(dst)[i] = f32_to_f16_bits(static_cast<float>(v));
        break;
      case DType::i32: static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v); break;
      case DType::i64: static_cast<int64_t*>(dst)[i] = static_cast<int64_t>(v); break;
      case DType::boolean: static_cast<uint8_t*>(dst)[i] = v != 0.0 ? 1 : 0; break;
      case DType::u8: static_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(v); break;
    }
  }
}

}  // namespace dflash
