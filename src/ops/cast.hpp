// dflash.cpp — element type conversion on the device (the CPU counterpart is
// dflash::convert_elements in core/dtype.hpp).
//
// Invariants: dst and src are contiguous device arrays of n elements; f32 -> bf16 rounds to
// nearest even and keeps NaN a quiet NaN of the same sign, exactly as f32_to_bf16_bits; bf16 -> f32
// is exact. dst must not overlap src unless they are the same type and pointer.
#pragma once

#include <cstdint>

namespace dflash {

#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}
/// dst = src converted; (D, S) ∈ {float, uint16_t (bf16 bits)}². Enqueued on ctx's stream.
template <typename D, typename S>
void cast_cuda(cuda::CudaContext& ctx, D* dst, const S* src, int64_t n);
#endif

}  // namespace dflash
