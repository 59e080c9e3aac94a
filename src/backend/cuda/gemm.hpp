// dflash.cpp — GEMM through cuBLASLt: bf16 inputs, fp32 accumulation, bf16 or fp32 output,
// row-major operands with optional transposes.
//
// Invariants: every matrix is row-major with a leading dimension (elements between rows) ≥ its
// column count; the call runs in the context's stream and uses its workspace. Plans (descriptors,
// layouts and the heuristic's algorithm) are cached per context, keyed by sizes, transposes,
// leading dimensions, output dtype, beta ≠ 0, the pointers' alignment and the plan source, so a
// step loop chooses once per shape and allocates nothing. The algorithm comes from the committed
// table of measured plans (ops/gemm_plan_table.hpp) when an entry's key matches the call, else
// from the heuristic's first answer; never from timing at run time. Deterministic: the plan's
// algorithm is fixed and split-K reductions are restricted to the workspace schemes (no atomics),
// so the same inputs give the same bits.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/context.hpp"
#include "core/dtype.hpp"
#include "ops/gemm_plan_table.hpp"

namespace dflash::cuda {

/// One cached cuBLASLt plan (owned by CudaContext::gemm_plans()): the descriptors (cuBLASLt's "A"
/// is the caller's B and vice versa, gemm.cpp), the algorithm, the call's key, the operands'
/// alignment in bytes (the caller's A, B, and min(C, D)) and where the algorithm came from.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  GemmShapeKey key;
  uint32_t align_a = 0, align_b = 0, align_c = 0;
  /// "table entry N 'name'" (gemm_plan_entry_label) or "heuristic".
  std::string source;
  ~GemmPlan();
};

/// Where gemm_bf16 takes a new plan's algorithm from (process-wide; plans already cached keep
/// theirs, the cache key includes it): `table` (default) uses a matching entry of
/// gemm_plan_table() and the heuristic's first plan for shapes without one; `heuristic` ignores
/// the table (the path before the table, for before/after measurements: `dflash bench
/// --gemm-plans heuristic`).
enum class GemmPlanSource { table, heuristic };
void gemm_plan_source_set(GemmPlanSource s);
GemmPlanSource gemm_plan_source();
/// "table" or "heuristic"; gemm_plan_source_parse throws dflash::Error naming `what` otherwise.
const char* gemm_plan_source_name(GemmPlanSource s);
GemmPlanSource gemm_plan_source_parse(const std::string& name, const std::string& what);

/// The readable attributes and the words of a cuBLASLt algorithm.
GemmAlgoConfig gemm_algo_config(const cublasLtMatmulAlgo_t& algo);

/// The heuristic's first `max_count` answers for `plan`'s descriptors with gemm_bf16's
/// preferences (the context's workspace, the plan's alignments, deterministic reduction schemes
/// only), in its order; answers whose state is not success are dropped. Throws dflash::Error when
/// the heuristic call fails.
std::vector<cublasLtMatmulHeuristicResult_t> gemm_heuristic(CudaContext& ctx, const GemmPlan& plan,
                                                            int max_count);

/// D[M,N] = alpha·op(A)·op(B) + beta·C, all row-major: op(A) is [M,K] (A stored [M,K] with
/// leading dimension lda, or [K,M] when trans_a), op(B) is [K,N] (B stored [K,N], or [N,K] when
/// trans_b). A and B are bf16 (raw bits); D (`d`) and C are `c_dtype` (f32 or bf16) with the same
/// leading dimension ldc; accumulation and alpha/beta are fp32. C is `c_in` when given (read only,
/// same layout as D, must not overlap D: the residual stream y = x + A·B in the GEMM's epilogue
/// instead of a copy of x before an in-place update), else D itself (in place); C is not read when
/// beta = 0. M, N or K may be 1; M = 0 or N = 0 does nothing. Throws dflash::Error (naming the
/// sizes) on bad arguments or when cuBLASLt finds no algorithm, and (naming the entry) when a
/// matching table entry's algorithm reads back other attributes than the entry names, or
/// cublasLtMatmulAlgoCheck refuses it, or it needs more workspace than the context has.
void gemm_bf16(CudaContext& ctx, void* d, DType c_dtype, int64_t ldc, const uint16_t* a,
               int64_t lda, bool trans_a, const uint16_t* b, int64_t ldb, bool trans_b, int64_t M,
               int64_t N, int64_t K, float alpha = 1.0f, float beta = 0.0f,
               const void* c_in = nullptr);

}  // namespace dflash::cuda
