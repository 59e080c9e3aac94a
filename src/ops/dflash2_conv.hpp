// dflash.cpp — DFlash2's grouped dynamic causal convolution on the CUDA backend: the contract of
// its pieces (../shared/OBJECTIVES.md §1.4; the fp32/fp64 CPU reference and how a drafter
// sublayer is wrapped: src/model/dflash2_conv.hpp). For block rows i = block·b + j (slot j) of
// one sublayer, x [rows, H], the conv of side σ (0 pre, 1 post) is
//   conv_σ(x)[i, c] = Σ_{t ≤ min(T−1, j)} (β_σ[t, c] + δ[i, σ, t, c/g])·x[i−t, c]
// with β_σ [T, H] (base_kernel + σ·T·H, f32 master weights) and δ [rows, 2, T, Gc] f32
// (δ = u·W_kpᵀ, a linear_fwd_cuda of the sublayer input u; Gc = H/g groups of g channels). A tap
// t > j would reach the previous block: taps are zero across block boundaries. Its gradient for
// dout [rows, H] (f32):
//   dx[k, c]        = Σ_{t ≤ T−1, (k mod b)+t < b} (β_σ[t, c] + δ[k+t, σ, t, c/g])·dout[k+t, c]
//   dδ[i, σ, t, G]  = Σ_{c ∈ G} dout[i, c]·x[i−t, c]          (t ≤ j; 0 for t > j)
//   dβ_σ[t, c]      = Σ_{i: t ≤ j} dout[i, c]·x[i−t, c]
//
// Invariants: fp32 arithmetic; x and out are f32 or bf16 (raw uint16_t bits), dout f32. Every
// sum runs in a fixed order (taps in order for out and dx, a warp's fixed butterfly over a group
// for dδ, row chunks of fixed size then the chunks in order for dβ): the same bits every run, no
// atomics. Outputs never alias inputs. `=` outputs are overwritten, `+=` ones accumulate, as each
// entry point says. Scratch comes from the context's caching allocator
// (dflash2_conv_bwd_cuda_scratch_bytes says how much, for a memory plan).
#pragma once

#include <cstdint>

#include "core/arena_plan.hpp"
#include "core/error.hpp"

namespace dflash {

/// Sizes of one conv: `rows` block rows (a multiple of `block`), H channels, `taps` T ≤ block,
/// `group` g channels per group (H % g == 0).
struct Dflash2ConvShape {
  int64_t rows = 0, H = 0, block = 0, taps = 0, group = 0;
  int64_t groups() const { return H / group; }                 ///< Gc
  int64_t delta_width() const { return 2 * taps * groups(); }  ///< 2·T·Gc, one row of δ
  /// Throws dflash::Error naming the size that is inconsistent.
  void check() const {
    DFLASH_CHECK(H > 0 && group > 0 && H % group == 0,
                 "conv_group_size {} must divide hidden_size {}", group, H);
    DFLASH_CHECK(taps >= 1 && taps <= block, "conv_kernel_size {} must be in [1, block_size {}]",
                 taps, block);
    DFLASH_CHECK(rows >= 0 && rows % block == 0,
                 "DFlash2 conv over {} rows, not a multiple of the block size {}", rows, block);
  }
};

/// Rows per chunk of the two-pass dβ of dflash2_conv_bwd_dbase_cuda: max(32, ceil(rows/64)).
constexpr int64_t dflash2_conv_cuda_dbase_rows_per_chunk(int64_t rows) {
  return (rows + 63) / 64 < 32 ? 32 : (rows + 63) / 64;
}
/// Number of those chunks (at most 64).
constexpr int64_t dflash2_conv_cuda_dbase_chunks(int64_t rows) {
  const int64_t per = dflash2_conv_cuda_dbase_rows_per_chunk(rows);
  return rows == 0 ? 0 : (rows + per - 1) / per;
}
/// Device scratch dflash2_conv_bwd_dbase_cuda takes from its context, in bytes: the partial sums
/// [chunks, T, H] f32, rounded to kArenaAlign (what a memory plan reserves for it).
constexpr uint64_t dflash2_conv_bwd_cuda_scratch_bytes(const Dflash2ConvShape& s) {
  return arena_round(static_cast<uint64_t>(dflash2_conv_cuda_dbase_chunks(s.rows) * s.taps * s.H) *
                     4);
}

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// out [rows, H] = residual + conv_side(x) (residual [rows, H] f32, or null for none). X, O ∈
/// {float, uint16_t (bf16 bits)}; a residual needs O = float. base_side [T, H] f32, delta
/// [rows, 2·T·Gc] f32, side 0 or 1. Throws dflash::Error on bad sizes, a null pointer or a residual
/// with a bf16 output.
template <typename X, typename O>
void dflash2_conv_fwd_cuda(cuda::CudaContext& ctx, O* out, const float* residual, const X* x,
                           const float* base_side, const float* delta, int side,
                           const Dflash2ConvShape& s);

/// dx [rows, H] = (accumulate: +=) the dx of the file header for dout [rows, H] f32. DX ∈ {float,
/// uint16_t (bf16 bits)}; accumulate needs DX = float. Throws dflash::Error on bad sizes, a null
/// pointer or accumulate into bf16.
template <typename DX>
void dflash2_conv_bwd_dx_cuda(cuda::CudaContext& ctx, DX* dx, bool accumulate, const float* dout,
                              const float* base_side, const float* delta, int side,
                              const Dflash2ConvShape& s);

/// The `side` half of ddelta [rows, 2·T·Gc] = dδ of the file header (the other half untouched);
/// DD ∈ {float, uint16_t (bf16 bits: the input of the kernel projection's backward GEMM)}, X the
/// type of the conv's input x [rows, H].
template <typename X, typename DD>
void dflash2_conv_bwd_ddelta_cuda(cuda::CudaContext& ctx, DD* ddelta, const float* dout, const X* x,
                                  int side, const Dflash2ConvShape& s);

/// dbase_side [T, H] f32 += dβ of the file header: partial sums over fixed row chunks
/// (dflash2_conv_cuda_dbase_rows_per_chunk), then the chunks in order.
template <typename X>
void dflash2_conv_bwd_dbase_cuda(cuda::CudaContext& ctx, float* dbase_side, const float* dout,
                                 const X* x, const Dflash2ConvShape& s);
#endif

}  // namespace dflash
