// dflash.cpp — SwiGLU activation of the Qwen3/Llama MLP: y = silu(gate) ⊙ up,
// silu(g) = g·sigmoid(g) (HF `ACT2FN["silu"]`, `Qwen3MLP.forward`).
//
// Invariants: y [T, I] contiguous; gate and up are [T, I] with row stride `ld_in` (≥ I), so they
// can be two halves of one fused [T, 2I] projection (gate = p, up = p + I, ld_in = 2I) or two
// separate [T, I] arrays (ld_in = I). Backward: dgate and dup (activation gradients, same layout
// and stride as gate/up) are OVERWRITTEN.
#pragma once

#include <cstdint>

namespace dflash {

/// y[t,i] = silu(gate[t,i]) · up[t,i].
void swiglu_fwd_cpu(float* y, const float* gate, const float* up, int64_t T, int64_t I,
                    int64_t ld_in);
void swiglu_fwd_cpu(double* y, const double* gate, const double* up, int64_t T, int64_t I,
                    int64_t ld_in);

/// dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))), dup = dy·silu(g) (both overwritten, row stride ld_in).
void swiglu_bwd_cpu(float* dgate, float* dup, const float* dy, const float* gate, const float* up,
                    int64_t T, int64_t I, int64_t ld_in);
void swiglu_bwd_cpu(double* dgate, double* dup, const double* dy, const double* gate,
                    const double* up, int64_t T, int64_t I, int64_t ld_in);


#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA forward, T ∈ {float, uint16_t (bf16 bits)}, fp32 arithmetic.
template <typename T>
void swiglu_fwd_cuda(cuda::CudaContext& ctx, T* y, const T* gate, const T* up, int64_t Tn,
                     int64_t I, int64_t ld_in);
/// CUDA backward; dgate/dup overwritten (row stride ld_in; may alias gate/up).
template <typename T>
void swiglu_bwd_cuda(cuda::CudaContext& ctx, T* dgate, T* dup, const T* dy, const T* gate,
                     const T* up, int64_t Tn, int64_t I, int64_t ld_in);
#endif

}  // namespace dflash
