// dflash.cpp — UTF-8 validation, decoding and lossy repair.
//
// Invariants: validity follows the Unicode standard (no overlongs, no surrogates, nothing above
// U+10FFFF). Repair replaces each *maximal invalid subpart* with one U+FFFD, which is what Rust's
// String::from_utf8_lossy (used by HF tokenizers' decoders) and the WHATWG decoder do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::utf8 {

/// Length of the valid UTF-8 sequence starting at s[i] (1..4), or 0 if the bytes at i do not
/// start one. When 0, `*bad_len` (if given) receives the length of the maximal invalid subpart
/// (>= 1) that a lossy decoder replaces with one U+FFFD.
inline size_t sequence_length(std::string_view s, size_t i, size_t* bad_len = nullptr) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    if (bad_len) *bad_len = 1;
    return 0;
  }
  for (size_t k = 1; k < need; ++k) {
    const size_t j = i + k;
    const uint8_t l = (k == 1) ? lo : 0x80, h = (k == 1) ? hi : 0xBF;
    if (j >= s.size() || b(j) < l || b(j) > h) {
      if (bad_len) *bad_len = k;
      return 0;
    }
  }
  return need;
}

/// Byte offset of the first invalid UTF-8 sequence in `s`, or npos if `s` is valid.
inline size_t find_invalid(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const size_t len = sequence_length(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

/// Decodes the code point of the valid sequence at s[i] (caller guarantees validity) and its
/// length.
inline char32_t decode(std::string_view s, size_t i, size_t* len) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[k])); };
  const uint32_t c = b(i);
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return ((c & 0x1F) << 6) | (b(i + 1) & 0x3F);
  }
  if (c < 0xF0) {
    *len = 3;
    return ((c & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
  }
  *len = 4;
  return ((c & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) |
         (b(i + 3) & 0x3F);
}

/// Appends the UTF-8 encoding of `cp` to `out`.
inline void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// `s` with every maximal invalid subpart replaced by U+FFFD (Rust from_utf8_lossy semantics).
inline std::string make_valid(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    const size_t len = sequence_length(s, i, &bad);
    if (len) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

}  // namespace dflash::utf8
