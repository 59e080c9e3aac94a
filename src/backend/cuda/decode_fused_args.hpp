// dflash.cpp — the argument blocks and constants of the fused decoding kernels
// (backend/cuda/decode_fused.cuh), shared by the kernels, their launchers and the host entry
// points (plain C++: no device code here). Pointers are device pointers.
#pragma once

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash::cuda::decode_fused {

constexpr int kSplitKeys = 32;        // = kDecodeSplitKeys (ops/decode_fused.hpp): one key per lane
constexpr int kPrepLanes = 4;         // lanes per head of qkv_prepare (16-byte vectors each)
constexpr int kPrepMaxThreads = 256;  // more heads than kPrepMaxThreads / 4 take several rounds
constexpr int kPrepMinCtas = 3;       // __launch_bounds__: ≤ 80 registers, no spills (sm_90a)

/// Threads of qkv_prepare's CTA (one token) for `nheads` heads: kPrepLanes per head, whole warps,
/// at most kPrepMaxThreads.
constexpr int qkv_prep_threads(int nheads) {
  const int t = (kPrepLanes * nheads + 31) / 32 * 32;
  return t < kPrepMaxThreads ? t : kPrepMaxThreads;
}
constexpr int kCombineWarps = 8;

struct QkvPrepArgs {
  uint16_t* q_out;
  const int32_t* q_rows;  // null: row t
  uint16_t* k_out;
  uint16_t* v_out;
  const int32_t* kv_rows;  // null: row t
  const uint16_t* qkv;
  const float* q_norm;  // null: no norm (then k_norm is null too)
  const float* k_norm;
  const int32_t* pos;
  const float* inv_freq;
  float rope_scaling;
  float eps;
  int64_t T;
  int NH, NKV;
};

struct DecodeAttnArgs {
  const uint16_t* q;  // [T, NH, D]
  const uint16_t* k;  // [Tk, NKV, D]
  const uint16_t* v;
  const AttnRange* ranges;  // [T]
  const float* sinks;       // [NH] or null
  float* part_o;            // [T, NH, S, D]
  float* part_ml;           // [T, NH, S, 2]: max, sum
  uint16_t* o;              // [T, NH, D]
  float scale;
  int64_t T;
  int NH, NKV, S, rows_per_cta;
};

constexpr int kGemmChunk = 64;    // k values per warp step of decode_linear (4 mma k-steps)
constexpr int kGemmWarps = 4;     // warps of a decode_linear CTA: contiguous quarters of K
constexpr int kGemmMaxTiles = 8;  // 16-row tiles of one launch (128 rows)
constexpr int kGemmUnroll = 4;    // chunks whose weights a warp loads before using them

// y[M, N] (=, or += when accumulate) x[M, K] · w[N, K]ᵀ; y f32 or bf16 bits.
struct DecodeLinearArgs {
  void* y;
  const uint16_t* x;
  const uint16_t* w;
  int64_t M, N, K;
};

}  // namespace dflash::cuda::decode_fused
