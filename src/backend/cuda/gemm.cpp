// dflash.cpp — cuBLASLt GEMM wrapper with a per-context plan cache (see gemm.hpp).
//
// Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: we hand cuBLASLt B as its "A" and A
// as its "B", with m = N, n = M. A row-major matrix stored [r, c] (ld) is a column-major [c, r]
// (ld), so an operand that is not transposed in row-major terms is CUBLAS_OP_N here too.
// A new plan's algorithm: the matching entry of the measured table (restored from its words and
// checked, or an error naming the entry), else the heuristic's first answer (GemmPlan::source
// says which).
#include "backend/cuda/gemm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <iterator>

#include "core/error.hpp"

namespace dflash::cuda {

GemmPlan::~GemmPlan() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (op) cublasLtMatmulDescDestroy(op);
}

namespace {

#define LT_CHECK(call, what)                                                                  \
  do {                                                                                        \
    cublasStatus_t _s = (call);                                                               \
    DFLASH_CHECK(_s == CUBLAS_STATUS_SUCCESS, "cuBLASLt {} failed (status {}) for {}", #call, \
                 static_cast<int>(_s), what);                                                 \
  } while (0)

uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}

std::atomic<GemmPlanSource> g_plan_source{GemmPlanSource::table};

template <typename V>
V config_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  V v{};
  size_t written = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof v, &written);
  DFLASH_CHECK(s == CUBLAS_STATUS_SUCCESS && written == sizeof v,
               "cuBLASLt algorithm attribute {} unreadable (status {})", static_cast<int>(attr),
               static_cast<int>(s));
  return v;
}

int device_sm(int device) {
  int major = 0, minor = 0;
  DFLASH_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess,
      "cuda:{}: compute capability unreadable", device);
  return major * 10 + minor;
}

// The descriptors of `p` for its key (see the file comment for the operand swap).
void plan_descriptors(GemmPlan& p, const std::string& what) {
  const GemmShapeKey& k = p.key;
  const cudaDataType_t ct = k.out == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  LT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  const cublasOperation_t opa = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)),
           what);
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)),
           what);
  // Column-major shapes of the stored operands.
  const uint64_t a_rows = k.trans_b ? k.K : k.N, a_cols = k.trans_b ? k.N : k.K;
  const uint64_t b_rows = k.trans_a ? k.M : k.K, b_cols = k.trans_a ? k.K : k.M;
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, a_rows, a_cols, k.ldb), what);
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, b_rows, b_cols, k.lda), what);
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.c, ct, k.N, k.M, k.ldc), what);
}

// The table entry's algorithm for `p`, checked: its words restored, their attributes read back
// against the entry's, cublasLtMatmulAlgoCheck and the workspace it needs.
void plan_from_entry(CudaContext& ctx, GemmPlan& p, const GemmPlanEntry& e, size_t index) {
  const std::string label = gemm_plan_entry_label(e, index);
  static_assert(sizeof(p.algo.data) == sizeof(e.algo.words));
  std::copy(e.algo.words.begin(), e.algo.words.end(), p.algo.data);
  gemm_plan_entry_check(e, index, gemm_algo_config(p.algo));
  cublasLtMatmulHeuristicResult_t res{};
  const cublasStatus_t s =
      cublasLtMatmulAlgoCheck(ctx.cublaslt(), p.op, p.a, p.b, p.c, p.c, &p.algo, &res);
  DFLASH_CHECK(s == CUBLAS_STATUS_SUCCESS,
               "{}: cublasLtMatmulAlgoCheck refuses its algorithm (status {}; operand alignment "
               "A {} B {} C/D {} bytes): a wrong or stale entry, regenerate the table",
               label, static_cast<int>(s), p.align_a, p.align_b, p.align_c);
  DFLASH_CHECK(res.workspaceSize <= ctx.workspace_bytes(),
               "{}: its algorithm needs {} B of workspace, the context has {}", label,
               res.workspaceSize, ctx.workspace_bytes());
  p.source = label;
}

}  // namespace

void gemm_plan_source_set(GemmPlanSource s) {
  g_plan_source.store(s);
}
GemmPlanSource gemm_plan_source() {
  return g_plan_source.load();
}

const char* gemm_plan_source_name(GemmPlanSource s) {
  return s == GemmPlanSource::table ? "table" : "heuristic";
}

GemmPlanSource gemm_plan_source_parse(const std::string& name, const std::string& what) {
  if (name == "table") return GemmPlanSource::table;
  if (name == "heuristic") return GemmPlanSource::heuristic;
  fail("{}: '{}' is not a GEMM plan source (table or heuristic)", what, name);
}

GemmAlgoConfig gemm_algo_config(const cublasLtMatmulAlgo_t& algo) {
  GemmAlgoConfig c;
  c.algo_id = config_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID);
  c.tile = config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
  c.stages = config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID);
  c.split_k = config_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  c.reduction = config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  c.swizzle = config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  c.custom = config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
  c.inner_shape = config_attr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID);
  c.cluster_shape = config_attr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  std::copy(std::begin(algo.data), std::end(algo.data), c.words.begin());
  return c;
}

std::vector<cublasLtMatmulHeuristicResult_t> gemm_heuristic(CudaContext& ctx, const GemmPlan& plan,
                                                            int max_count) {
  const std::string what = gemm_shape_key_string(plan.key);
  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), what);
  const uint64_t ws = ctx.workspace_bytes();
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  // Our "A" is the caller's B and vice versa.
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                       &plan.align_b, sizeof(plan.align_b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                       &plan.align_a, sizeof(plan.align_a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                       &plan.align_c, sizeof(plan.align_c));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                       &plan.align_c, sizeof(plan.align_c));
  // Deterministic results: no split-K reduction through atomics.
  const uint32_t schemes =
      CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                       sizeof(schemes));
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(std::max(max_count, 1)));
  int found = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), plan.op, plan.a, plan.b, plan.c, plan.c, pref,
                                     static_cast<int>(res.size()), res.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  DFLASH_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt heuristic failed (status {}) for {}",
               static_cast<int>(s), what);
  res.resize(static_cast<size_t>(found));
  std::erase_if(res, [](const auto& r) { return r.state != CUBLAS_STATUS_SUCCESS; });
  return res;
}

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
  const GemmPlanSource source = gemm_plan_source();
  const std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}", what, beta != 0.0f, al_a, al_b, al_c,
                                      ctx.workspace_bytes(), gemm_plan_source_name(source));
  auto& plans = ctx.gemm_plans();
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto plan = std::make_unique<GemmPlan>();
    plan->key = GemmShapeKey{device_sm(ctx.device()),
                             cublasLtGetVersion(),
                             M,
                             N,
                             K,
                             lda,
                             ldb,
                             ldc,
                             trans_a,
                             trans_b,
                             c_dtype,
                             beta != 0.0f};
    plan->align_a = al_a;
    plan->align_b = al_b;
    plan->align_c = al_c;
    plan_descriptors(*plan, what);
    const std::span<const GemmPlanEntry> table = gemm_plan_table();
    const GemmPlanEntry* entry =
        source == GemmPlanSource::table ? gemm_plan_table_find(table, plan->key) : nullptr;
    if (entry) {
      plan_from_entry(ctx, *plan, *entry, static_cast<size_t>(entry - table.data()));
    } else {
      const auto res = gemm_heuristic(ctx, *plan, 1);
      DFLASH_CHECK(!res.empty(), "cuBLASLt found no algorithm for {}", what);
      plan->algo = res[0].algo;
      plan->source = "heuristic";
    }
    it = plans.emplace(key, std::move(plan)).first;
  }
  const GemmPlan& p = *it->second;
  LT_CHECK(cublasLtMatmul(ctx.cublaslt(), p.op, &alpha, b, p.a, a, p.b, &beta, c, p.c, d, p.c,
                          &p.algo, ctx.workspace(), ctx.workspace_bytes(), ctx.stream()),
           what);
}

}  // namespace dflash::cuda
