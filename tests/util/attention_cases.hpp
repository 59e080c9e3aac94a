// dflash.cpp — attention test cases shared by the CUDA op test (tests/cuda/attention_cuda_test.cpp)
// and the emulated tensor-core kernels' test (tests/emu/attention_tc_emu_test.cpp): sizes, one
// AttnRange per query row, and key rows nobody sees (the tests fill them with NaN).
#pragma once

#include <cstdint>
#include <vector>

#include "ops/attention.hpp"

namespace dflash::test {

/// One attention problem: q [Tq, NH, D], k/v [Tk, NKV, D], a range per query row.
struct AttnCase {
  int64_t Tq, Tk, NH, NKV, D;
  std::vector<AttnRange> ranges;
  std::vector<int64_t> nan_keys;  // key rows no query sees: filled with NaN
};

/// Causal varlen over documents of the given lengths.
inline AttnCase attn_causal(const std::vector<int32_t>& lens, int64_t NH, int64_t NKV, int64_t D) {
  std::vector<int32_t> off{0};
  for (int32_t l : lens) off.push_back(off.back() + l);
  const int64_t T = off.back();
  return AttnCase{
      T,   T, NH,
      NKV, D, attention_causal_varlen_ranges(off.data(), static_cast<int64_t>(lens.size()), T),
      {}};
}

/// The drafter's layout (DESIGN.md §1, src/train/packed_step.hpp): T context rows of documents
/// `docs` (lengths), then blocks of K query rows; block b at anchor anchors[b] (a context row)
/// sees [doc_start, anchor) and its own K keys T + bK..; `inert` padding blocks see only
/// themselves.
inline AttnCase attn_dflash_blocks(const std::vector<int32_t>& docs,
                                   const std::vector<int32_t>& anchors, int64_t inert, int64_t K,
                                   int64_t NH, int64_t NKV, int64_t D) {
  std::vector<int32_t> start;  // document start of each context row
  int32_t T = 0;
  for (int32_t len : docs) {
    for (int32_t i = 0; i < len; ++i) start.push_back(T);
    T += len;
  }
  const int64_t N = static_cast<int64_t>(anchors.size()) + inert;
  AttnCase c{N * K, T + N * K, NH, NKV, D, {}, {}};
  for (int64_t b = 0; b < N; ++b) {
    const auto own = static_cast<int32_t>(T + b * K);
    const bool real = b < static_cast<int64_t>(anchors.size());
    const int32_t a = real ? anchors[static_cast<size_t>(b)] : 0;
    const int32_t ds = real ? start[static_cast<size_t>(a)] : 0;
    for (int64_t s = 0; s < K; ++s)
      c.ranges.push_back(AttnRange{ds, a, own, static_cast<int32_t>(own + K)});
  }
  return c;
}

/// The DFlash pattern with block size 7 (blocks of both documents share a 16-row query tile)
/// over T = 129 context rows; keys 41..59 and 128 are seen by nobody.
inline AttnCase attn_dflash_mixed_tiles(int64_t D, int64_t K) {
  const int64_t T = 129;
  const std::vector<int32_t> anchors{5, 40, 41, 70, 120, 128};
  const std::vector<int32_t> doc_start{0, 0, 0, 60, 60, 60};
  const int64_t N = static_cast<int64_t>(anchors.size());
  AttnCase c{N * K, T + N * K, 4, 1, D, {}, {}};
  for (int64_t b = 0; b < N; ++b)
    for (int64_t s = 0; s < K; ++s)
      c.ranges.push_back(AttnRange{doc_start[static_cast<size_t>(b)],
                                   anchors[static_cast<size_t>(b)], static_cast<int32_t>(T + b * K),
                                   static_cast<int32_t>(T + (b + 1) * K)});
  for (int64_t j = 41; j < 60; ++j) c.nan_keys.push_back(j);
  c.nan_keys.push_back(128);
  return c;
}

/// Ranges that start mid-tile, with the second range before the first (Tq = 23, Tk = 201).
inline AttnCase attn_second_range_first(int64_t NH, int64_t NKV, int64_t D) {
  AttnCase c{23, 201, NH, NKV, D, {}, {}};
  for (int32_t t = 0; t < 23; ++t) c.ranges.push_back(AttnRange{70 + 3 * t, 140 + 2 * t, t, t + 5});
  return c;
}

/// Every other row sees nothing (o = 0, lse = −inf, no gradient).
inline AttnCase attn_empty_rows() {
  AttnCase c{5, 40, 2, 1, 64, {}, {}};
  for (int32_t t = 0; t < 5; ++t)
    c.ranges.push_back(t % 2 ? AttnRange{0, 0, 0, 0} : AttnRange{t, t + 7, 20, 23});
  return c;
}

}  // namespace dflash::test
