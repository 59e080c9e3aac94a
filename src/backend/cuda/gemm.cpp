// dflash.cpp — cuBLASLt GEMM wrapper with a per-context plan cache (see gemm.hpp).
//
// Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: we hand cuBLASLt B as its "A" and A
// as its "B", with m = N, n = M. A row-major matrix stored [r, c] (ld) is a column-major [c, r]
// (ld), so an operand that is not transposed in row-major terms is CUBLAS_OP_N here too.
#include "backend/cuda/gemm.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.hpp"

namespace dflash::cuda {

GemmPlan::~GemmPlan() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (op) cublasLtMatmulDescDestroy(op);
}

namespace {

#define LT_CHECK(call, what)                                                               \
  do {                                                                                     \
    cublasStatus_t _s = (call);                                                            \
    DFLASH_CHECK(_s == CUBLAS_STATUS_SUCCESS, "cuBLASLt {} failed (status {}) for {}", #call, \
                 static_cast<int>(_s), what);                                              \
  } while (0)

uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}

}  // namespace

void gemm_bf16(CudaContext& ctx, void* d, DType c_dtype, int64_t ldc, const uint16_t* a,
               int64_t lda, bool trans_a, const uint16_t* b, int64_t ldb, bool trans_b, int64_t M,
               int64_t N, int64_t K, float alpha, float beta, const void* c_in) {
  const std::string what =
      fmt::format("gemm M={} N={} K={} lda={} ldb={} ldc={} ta={} tb={} out={}", M, N, K, lda, ldb,
                  ldc, trans_a, trans_b, dtype_name(c_dtype));
  DFLASH_CHECK(M >= 0 && N >= 0 && K >= 1, "bad sizes: {}", what);
  DFLASH_CHECK(c_dtype == DType::f32 || c_dtype == DType::bf16,
               "gemm output must be f32 or bf16: {}", what);
  if (M == 0 || N == 0) return;
  DFLASH_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
               "leading dimension too small: {}", what);
  DFLASH_CHECK(a && b && d, "null pointer: {}", what);
  const void* c = c_in ? c_in : d;
  if (c != d) {  // C must not overlap D (cuBLASLt reads C while it writes D)
    const size_t elem = c_dtype == DType::f32 ? 4 : 2;
    const size_t span = (static_cast<size_t>(M - 1) * ldc + N) * elem;
    const auto cu = reinterpret_cast<uintptr_t>(c), du = reinterpret_cast<uintptr_t>(d);
    DFLASH_CHECK(cu + span <= du || du + span <= cu, "C overlaps D (not in place): {}", what);
  }
  const uint32_t al_a = alignment_of(a), al_b = alignment_of(b),
                 al_c = std::min(alignment_of(c), alignment_of(d));
  const std::string key = fmt::format("{}|{}|{}|{}|{}|{}", what, beta != 0.0f, al_a, al_b, al_c,
                                      ctx.workspace_bytes());
  auto& plans = ctx.gemm_plans();
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto plan = std::make_unique<GemmPlan>();
    const cudaDataType_t ct = c_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
    LT_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
    // cuBLASLt "A" = our B, "B" = our A (see the file comment).
    const cublasOperation_t opa = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opb = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                            sizeof(opa)),
             what);
    LT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                            sizeof(opb)),
             what);
    // Column-major shapes of the stored operands.
    const uint64_t a_rows = trans_b ? K : N, a_cols = trans_b ? N : K;
    const uint64_t b_rows = trans_a ? M : K, b_cols = trans_a ? K : M;
    LT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, a_rows, a_cols, ldb), what);
    LT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, b_rows, b_cols, lda), what);
    LT_CHECK(cublasLtMatrixLayoutCreate(&plan->c, ct, N, M, ldc), what);

    cublasLtMatmulPreference_t pref = nullptr;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), what);
    const uint64_t ws = ctx.workspace_bytes();
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                         sizeof(ws));
    // Our "A" is the caller's B and vice versa.
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b,
                                         sizeof(al_b));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a,
                                         sizeof(al_a));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                         sizeof(al_c));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                         sizeof(al_c));
    // Deterministic results: no split-K reduction through atomics.
    const uint32_t schemes =
        CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                         &schemes, sizeof(schemes));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(
        ctx.cublaslt(), plan->op, plan->a, plan->b, plan->c, plan->c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    DFLASH_CHECK(s == CUBLAS_STATUS_SUCCESS && found > 0,
                 "cuBLASLt found no algorithm (status {}) for {}", static_cast<int>(s), what);
    plan->algo = res.algo;
    it = plans.emplace(key, std::move(plan)).first;
  }
  const GemmPlan& p = *it->second;
  LT_CHECK(cublasLtMatmul(ctx.cublaslt(), p.op, &alpha, b, p.a, a, p.b, &beta, c, p.c, d, p.c,
                          &p.algo, ctx.workspace(), ctx.workspace_bytes(), ctx.stream()),
           what);
}

}  // namespace dflash::cuda
