// dflash.cpp — warp-level tensor-core building blocks for the .cu kernels: the bf16 m16n8k16 MMA
// (fp32 accumulate), ldmatrix loads of 8×8 bf16 matrices from shared memory, cp.async 16-byte
// copies with zero fill, and the XOR swizzle of shared-memory tiles. The instructions come from
// CuTe's architecture atoms (CUTLASS 4.2 headers, unpacked by scripts/setup.sh); this header only
// names the register layouts, which the kernels index by hand.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16", 16-bit types). In a warp, lane
// l has group g = l / 4 and thread-in-group t = l % 4. A 32-bit register holds two bf16 values,
// the lower column index in the lower half.
//   A (16×16, row-major, M × K):  a[0] = (g, 2t..2t+1)  a[1] = (g+8, 2t..)  a[2] = (g, 2t+8..)
//                                 a[3] = (g+8, 2t+8..)
//   B (16×8, K × N):              b[0] = (k 2t..2t+1, n g)  b[1] = (k 2t+8.., n g)
//   C/D (16×8 fp32, M × N):       c[0], c[1] = (g, 2t), (g, 2t+1)   c[2], c[3] = (g+8, 2t..)
// So the C fragments of two adjacent n-tiles (keys 0..7 and 8..15) are, packed to bf16, exactly
// the A fragment of the next product over those 16 keys (FlashAttention-2's P·V without a trip
// through shared memory).
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i; register i of lane l receives
// row l / 4, columns 2(l % 4)..+1 of matrix i (with .trans: of its transpose).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

/// Declares the calling kernel's dynamic shared memory as `char name[]`, 128-byte aligned (a macro
/// so that the CPU warp emulator of tests/emu can supply its own).
#define DFLASH_DYNAMIC_SMEM(name) extern __shared__ __align__(128) char name[]

namespace dflash::cuda::mma {

/// d += a·b for one 16×8×16 tile: bf16 inputs, fp32 accumulators (layouts above).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1,
                                            d[0], d[1], d[2], d[3]);
}

/// Four 8×8 bf16 matrices from shared memory; `row` is this lane's row address (16-byte aligned).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* row) {
  cute::SM75_U32x4_LDSM_N::copy(*static_cast<const cute::uint128_t*>(row), r[0], r[1], r[2], r[3]);
}
/// Same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* row) {
  cute::SM75_U16x8_LDSM_T::copy(*static_cast<const cute::uint128_t*>(row), r[0], r[1], r[2], r[3]);
}

/// Asynchronous 16-byte global → shared copy; when `pred` is false nothing is read and the 16
/// bytes are zero-filled (`src` must still be a valid address expression, it is not dereferenced).
__device__ __forceinline__ void cp_async16(void* smem, const void* src, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
      *static_cast<const cute::uint128_t*>(src), *static_cast<cute::uint128_t*>(smem), pred);
}
/// Closes the current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() {
  cute::cp_async_fence();
}
/// Waits until at most N committed groups are still in flight (this thread's copies only: a
/// __syncthreads must follow before other threads read the data).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<N>();
}

/// Two fp32 values as one register of two bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

/// Byte offset of 16-byte chunk `chunk` of row `row` in a shared tile whose rows hold `D` bf16
/// (D/8 chunks, D = 64 or 128). The chunk index is XORed with row % 8, so the 8 rows that one
/// ldmatrix matrix reads (same logical chunk) fall into 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * (D * 2) + ((chunk ^ (row & 7)) << 4);
}

}  // namespace dflash::cuda::mma
