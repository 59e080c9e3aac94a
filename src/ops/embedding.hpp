// dflash.cpp — embedding lookup (gather rows of a table), as torch.nn.Embedding.
//
// Invariants: table [V, H] row-major (f32, f64 or raw bf16 bits), ids int32 [T], y [T, H] in the
// compute type. Every id must satisfy 0 ≤ id < V, else dflash::Error naming the id and its
// position (checked before anything is written). Backward: the table gradient ACCUMULATES (+=)
// (it is a parameter gradient); rows are scattered in token order, so repeated ids sum
// deterministically. The target's tables are frozen; the backward exists for completeness.
#pragma once

#include <cstdint>

namespace dflash {

/// y[t, :] = table[ids[t], :]. Throws dflash::Error for an id outside [0, V).
void embedding_fwd_cpu(float* y, const float* table, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H);
void embedding_fwd_cpu(double* y, const double* table, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H);
/// bf16 table (raw bits) gathered into fp32 (exact conversion).
void embedding_fwd_cpu(float* y, const uint16_t* table_bf16, const int32_t* ids, int64_t T,
                       int64_t V, int64_t H);

/// dtable[ids[t], :] += dy[t, :] for t = 0..T-1 in order. Throws for an id outside [0, V).
void embedding_bwd_cpu(float* dtable, const float* dy, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H);
void embedding_bwd_cpu(double* dtable, const double* dy, const int32_t* ids, int64_t T, int64_t V,
                       int64_t H);


#ifdef DFLASH_HAVE_CUDA
namespace cuda {
class CudaContext;
}

/// CUDA gather (src/backend/cuda/embedding_cuda.cpp): device pointers, enqueued on ctx's stream.
/// Y, W ∈ {float, uint16_t (bf16 bits)}. Ids are NOT range-checked on the host (they live on the
/// device; validate them where they are made): a row whose id is outside [0, V) becomes NaN, never
/// an out-of-bounds read. No backward on CUDA (the target's tables are frozen).
template <typename Y, typename W>
void embedding_fwd_cuda(cuda::CudaContext& ctx, Y* y, const W* table, const int32_t* ids,
                        int64_t T, int64_t V, int64_t H);
#endif

}  // namespace dflash
