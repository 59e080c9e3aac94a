// dflash.cpp — DFlash2's grouped dynamic causal convolution around a drafter sublayer
// (../shared/OBJECTIVES.md §1.4; the public DFlash2 reference `GroupedDynamicCausalConv`, read to
// learn the tensor layout). For the block rows of one sublayer (row i = block·b + j, slot j):
//   u [rows, H]          the sublayer input (after its RMSNorm)
//   δ = u·W_kpᵀ          [rows, 2, T, Gc]  (kernel_projection.weight W_kp [2·T·Gc, H])
//   pre:  ũ[i,c] = Σ_{t ≤ min(T−1, j)} (β[0,t,c] + δ[i,0,t,c/g])·u[i−t, c]
//   y = Sublayer(ũ)
//   post: o[i,c] = Σ_{t ≤ min(T−1, j)} (β[1,t,c] + δ[i,1,t,c/g])·y[i−t, c]
// with β = base_kernel [2, T, H], g = conv_group_size (channels per group), Gc = H/g groups, and
// the residual adds o. δ¹ of the post-conv also comes from u. A tap t > j would reach the previous
// block: taps are zero across block boundaries (the position is taken modulo b), so block rows
// never mix blocks and slot j depends only on slots ≤ j of its block. The context K/V rows are
// not convolved. Identity: β[:,0] = 1, β[:,t>0] = 0, W_kp = 0 gives ũ = u and o = y exactly.
//
// Invariants: outputs never alias inputs; `=` outputs are overwritten, `+=` ones accumulate;
// loops run in index order (the same bits every run). Templated on the scalar (float, double).
#pragma once

#include <cstdint>
#include <vector>

#include "ops/dflash2_conv.hpp"  // Dflash2ConvShape

namespace dflash {

/// out [rows, H] = side `side` (0 pre, 1 post) of the conv over x [rows, H] with base
/// β_side [T, H] (base_kernel + side·T·H) and δ [rows, 2·T·Gc] (the formula of the file header).
template <typename S>
void dflash2_conv_fwd(S* out, const S* x, const S* base_side, const S* delta, int side,
                      const Dflash2ConvShape& s);

/// Backward of dflash2_conv_fwd for dout [rows, H]: dx [rows, H] +=, dbase_side [T, H] +=,
/// ddelta [rows, 2·T·Gc] += (its `side` half only). Any output may be null (skipped).
template <typename S>
void dflash2_conv_bwd(S* dx, S* dbase_side, S* ddelta, const S* dout, const S* x,
                      const S* base_side, const S* delta, int side, const Dflash2ConvShape& s);

/// What the forward keeps of one convolved sublayer for the backward.
template <typename S>
struct Dflash2ConvActs {
  std::vector<S> u;      ///< [rows, H] the sublayer input before the pre-conv
  std::vector<S> delta;  ///< [rows, 2·T·Gc]
  std::vector<S> y;      ///< [rows, H] the sublayer output before the post-conv
};

/// Pre-conv in place: on entry hn [rows, H] holds u, on return ũ; saves u and δ = u·W_kpᵀ in `a`.
/// base [2, T, H], w_kp [2·T·Gc, H].
template <typename S>
void dflash2_conv_pre(S* hn, Dflash2ConvActs<S>& a, const S* base, const S* w_kp,
                      const Dflash2ConvShape& s);

/// Post-conv in place: on entry y [rows, H] holds the sublayer output, on return o; saves y in `a`
/// (δ from the matching dflash2_conv_pre).
template <typename S>
void dflash2_conv_post(S* y, Dflash2ConvActs<S>& a, const S* base, const Dflash2ConvShape& s);

/// Backward of the post-conv: dy [rows, H] = ∂/∂y of dout [rows, H]; dbase [2, T, H] +=;
/// ddelta [rows, 2·T·Gc] is overwritten with ∂/∂δ¹ (δ⁰'s half zeroed).
template <typename S>
void dflash2_conv_post_bwd(S* dy, S* dbase, std::vector<S>& ddelta, const S* dout,
                           const Dflash2ConvActs<S>& a, const S* base, const Dflash2ConvShape& s);

/// Backward of the pre-conv: du [rows, H] = ∂/∂u of dũ [rows, H] through the taps and through δ
/// (both halves: ddelta holds ∂/∂δ¹ from dflash2_conv_post_bwd, to which ∂/∂δ⁰ is added);
/// dbase [2, T, H] +=, dw_kp [2·T·Gc, H] +=. `dtmp` is scratch.
template <typename S>
void dflash2_conv_pre_bwd(S* du, S* dbase, S* dw_kp, std::vector<S>& ddelta, std::vector<S>& dtmp,
                          const S* dutilde, const Dflash2ConvActs<S>& a, const S* base,
                          const S* w_kp, const Dflash2ConvShape& s);

}  // namespace dflash
