// dflash.cpp — y = x·Wᵀ for a few rows of x (decoding: one token, a verified block), internal to
// the CPU backend; linear_fwd_cpu calls it for T ≤ kFewRowsMax.
//
// Why: a GEMM library packs W on every call, which for a handful of rows costs as much as the
// product, and bf16 weights would first be converted to an f32 copy. This kernel reads each
// weight row once, as stored (f32 or bf16), and reuses it for every row of x.
//
// Invariants: each y[t, o] is computed by the same sequence of operations whatever T is and
// whichever thread computes it: element i of the dot product goes to lane i mod 16, lanes
// accumulate in index order, and the 16 lanes are summed pairwise (8, 4, 2, 1). So a row computed
// alone (one decoded token) is bit-identical to the same row computed inside a block (speculative
// verification). The instruction set is chosen once per process from the CPU (AVX-512, AVX2+FMA
// or baseline SSE2 builds of the same code); the choice can change rounding (FMA), never the
// summation order.
#pragma once

#include <cstdint>

namespace dflash::cpu {

/// Largest row count that linear_fwd_cpu sends to few_rows_linear.
constexpr int64_t kFewRowsMax = 16;

/// y[T, OUT] = x[T, IN]·W[OUT, IN]ᵀ (overwritten), W f32. Parallel over blocks of outputs.
/// Sizes are checked by the caller (T ≥ 0, IN > 0, OUT > 0).
void few_rows_linear(float* y, const float* x, const float* w, int64_t T, int64_t IN, int64_t OUT);
/// Same with W as raw bf16 bits (converted to f32 in registers: exact).
void few_rows_linear(float* y, const float* x, const uint16_t* w_bf16, int64_t T, int64_t IN,
                     int64_t OUT);

}  // namespace dflash::cpu
