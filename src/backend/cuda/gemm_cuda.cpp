// dflash.cpp — the CUDA entry point of the general matrix product (contract: src/ops/gemm.hpp).
// It forwards every argument unchanged to the cuBLASLt wrapper (backend/cuda/gemm.hpp), which
// checks the sizes, leading dimensions, pointers and dtypes (errors name them), caches the plan
// per context and runs it on the context's stream: the same computation and bits as a direct call.
#include "backend/cuda/gemm.hpp"
#include "ops/gemm.hpp"

namespace dflash {

void gemm_bf16_cuda(cuda::CudaContext& ctx, void* d, DType c_dtype, int64_t ldc, const uint16_t* a,
                    int64_t lda, bool trans_a, const uint16_t* b, int64_t ldb, bool trans_b,
                    int64_t M, int64_t N, int64_t K, float alpha, float beta, const void* c_in) {
  cuda::gemm_bf16(ctx, d, c_dtype, ldc, a, lda, trans_a, b, ldb, trans_b, M, N, K, alpha, beta,
                  c_in);
}

}  // namespace dflash
