// dflash.cpp — the emulator's stand-in for src/backend/cuda/mma.cuh: the same functions, computed
// on the CPU from the PTX ISA's definitions (fragment layouts in the real header). mma: fp32
// accumulation in k order on bf16 inputs widened exactly; ldmatrix: the rows the lanes point at,
// read when all 32 lanes have arrived; cp.async: queued until the covering wait.
#pragma once

#include <cstdint>
#include <cstring>

#include "backend/cuda/common.cuh"
#include "core/dtype.hpp"
#include "cuda_emu.hpp"

#define DFLASH_DYNAMIC_SMEM(name) char* name = ::emu::dynamic_smem()

namespace dflash::cuda::mma {

namespace detail {
inline float lo(uint32_t r) {
  return dflash::bf16_bits_to_f32(static_cast<uint16_t>(r & 0xffffu));
}
inline float hi(uint32_t r) {
  return dflash::bf16_bits_to_f32(static_cast<uint16_t>(r >> 16));
}
struct MmaLane {
  uint32_t a[4], b[2];
  float c[4];
};
}  // namespace detail

inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using namespace detail;
  MmaLane mine{{a[0], a[1], a[2], a[3]}, {b0, b1}, {d[0], d[1], d[2], d[3]}};
  MmaLane all[32];
  ::emu::warp_exchange(&mine, sizeof(MmaLane), all);
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const MmaLane& x = all[l];
    A[g][2 * t] = lo(x.a[0]), A[g][2 * t + 1] = hi(x.a[0]);
    A[g + 8][2 * t] = lo(x.a[1]), A[g + 8][2 * t + 1] = hi(x.a[1]);
    A[g][2 * t + 8] = lo(x.a[2]), A[g][2 * t + 9] = hi(x.a[2]);
    A[g + 8][2 * t + 8] = lo(x.a[3]), A[g + 8][2 * t + 9] = hi(x.a[3]);
    B[2 * t][g] = lo(x.b[0]), B[2 * t + 1][g] = hi(x.b[0]);
    B[2 * t + 8][g] = lo(x.b[1]), B[2 * t + 9][g] = hi(x.b[1]);
    C[g][2 * t] = x.c[0], C[g][2 * t + 1] = x.c[1];
    C[g + 8][2 * t] = x.c[2], C[g + 8][2 * t + 1] = x.c[3];
  }
  const int lane = static_cast<int>(::emu::thread_idx().x % 32), g = lane / 4, t = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    float s = C[rows[e]][cols[e]];
    for (int k = 0; k < 16; ++k) s += A[rows[e]][k] * B[k][cols[e]];
    d[e] = s;
  }
}

inline void ldsm_x4(uint32_t (&r)[4], const void* row) {
  const char* all[32];
  ::emu::warp_exchange(&row, sizeof(row), all);
  const int lane = static_cast<int>(::emu::thread_idx().x % 32);
  for (int i = 0; i < 4; ++i) std::memcpy(&r[i], all[8 * i + lane / 4] + 4 * (lane % 4), 4);
}

inline void ldsm_x4_t(uint32_t (&r)[4], const void* row) {
  const char* all[32];
  ::emu::warp_exchange(&row, sizeof(row), all);
  const int lane = static_cast<int>(::emu::thread_idx().x % 32);
  for (int i = 0; i < 4; ++i) {
    uint16_t lo16, hi16;  // elements (2(l%4), l/4) and (2(l%4)+1, l/4) of matrix i
    std::memcpy(&lo16, all[8 * i + 2 * (lane % 4)] + 2 * (lane / 4), 2);
    std::memcpy(&hi16, all[8 * i + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
    r[i] = static_cast<uint32_t>(lo16) | (static_cast<uint32_t>(hi16) << 16);
  }
}

inline void cp_async16(void* smem, const void* src, bool pred) {
  ::emu::cp_async16(smem, src, pred);
}
inline void cp_async_commit() {
  ::emu::cp_async_commit();
}
template <int N>
inline void cp_async_wait() {
  ::emu::cp_async_wait(N);
}

inline uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(dflash::f32_to_bf16_bits(lo)) |
         (static_cast<uint32_t>(dflash::f32_to_bf16_bits(hi)) << 16);
}

template <int D>
inline int swz(int row, int chunk) {
  return row * (D * 2) + ((chunk ^ (row & 7)) << 4);
}

}  // namespace dflash::cuda::mma
