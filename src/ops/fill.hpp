// dflash.cpp — reproducible pseudo-random fills, for benchmarks that need real-sized weights
// without a checkpoint (`dflash bench`).
//
// Formula (element i of n, seed s, all integer arithmetic modulo 2^64):
//     h = splitmix64(s ^ (i · 0xD1B54A32D192ED03)),  u = (h >> 40) · 2^-24  ∈ [0, 1)
//     y[i] = offset + bound · (2u − 1)                (fp32, no fused multiply-add; then rounded to
//                                                      bf16 for bf16 outputs)
// splitmix64 (Steele, Lea, Flood 2014): x += 0x9E3779B97F4A7C15; x = (x ^
// x>>30)·0xBF58476D1CE4E5B9; x = (x ^ x>>27)·0x94D049BB133111EB; x ^ x>>31. The CPU and CUDA
// versions give the same bits. A uniform fill of half-width bound has standard deviation bound/√3.
#pragma once

#include <cstdint>

namespace dflash {

/// y[0, n) as in the file comment; Y ∈ {float, uint16_t (bf16 bits)}.
template <typename Y>
void fill_uniform_cpu(Y* y, int64_t n, float offset, float bound, uint64_t seed);

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}
/// CUDA version (device array y), enqueued on ctx's stream.
template <typename Y>
void fill_uniform_cuda(cuda::CudaContext& ctx, Y* y, int64_t n, float offset, float bound,
                       uint64_t seed);
#endif

}  // namespace dflash
