// dflash.cpp — lookup and validation of the measured GEMM plan table (see gemm_plan_table.hpp).
// Invariant: nothing here calls cuBLASLt, so the CPU-only build and its unit tests cover it.
#include "ops/gemm_plan_table.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dflash {

namespace {

// cublasLtReductionScheme_t values without atomics: NONE 0, COMPUTE_TYPE 2, OUTPUT_TYPE 4
// (INPLACE 1 reduces through atomics; cublasLt.h).
constexpr uint32_t kDeterministicReductions[] = {0, 2, 4};

}  // namespace

bool GemmAlgoConfig::same_attributes(const GemmAlgoConfig& o) const {
  return algo_id == o.algo_id && tile == o.tile && stages == o.stages && split_k == o.split_k &&
         reduction == o.reduction && swizzle == o.swizzle && custom == o.custom &&
         inner_shape == o.inner_shape && cluster_shape == o.cluster_shape;
}

std::string gemm_shape_key_string(const GemmShapeKey& k) {
  return fmt::format(
      "sm {}, cuBLASLt {}, M={} N={} K={} lda={} ldb={} ldc={} ta={} tb={} out={} "
      "acc={}",
      k.sm, k.lt_version, k.M, k.N, k.K, k.lda, k.ldb, k.ldc, k.trans_a ? 1 : 0, k.trans_b ? 1 : 0,
      dtype_name(k.out), k.accumulate ? 1 : 0);
}

std::string gemm_algo_config_string(const GemmAlgoConfig& a) {
  return fmt::format(
      "algo {} tile {} stages {} splitK {} reduction {} swizzle {} custom {} "
      "inner {} cluster {}",
      a.algo_id, a.tile, a.stages, a.split_k, a.reduction, a.swizzle, a.custom, a.inner_shape,
      a.cluster_shape);
}

std::string gemm_plan_entry_label(const GemmPlanEntry& e, size_t index) {
  return fmt::format("GEMM plan table entry {} '{}' ({})", index, e.name ? e.name : "",
                     gemm_shape_key_string(e.key));
}

void gemm_plan_table_validate(std::span<const GemmPlanEntry> table) {
  for (size_t i = 0; i < table.size(); ++i) {
    const GemmPlanEntry& e = table[i];
    const GemmShapeKey& k = e.key;
    const std::string label = gemm_plan_entry_label(e, i);
    DFLASH_CHECK(e.name && e.name[0] != '\0', "{}: no name", label);
    DFLASH_CHECK(k.sm > 0 && k.lt_version > 0, "{}: no SM or cuBLASLt version", label);
    DFLASH_CHECK(k.M >= 1 && k.N >= 1 && k.K >= 1, "{}: sizes must be ≥ 1", label);
    const int64_t a_width = k.trans_a ? k.M : k.K, b_width = k.trans_b ? k.K : k.N;
    DFLASH_CHECK(k.lda >= a_width && k.ldb >= b_width && k.ldc >= k.N,
                 "{}: a leading dimension is below its stored width (A {}, B {}, D {})", label,
                 a_width, b_width, k.N);
    DFLASH_CHECK(k.out == DType::f32 || k.out == DType::bf16, "{}: output must be f32 or bf16",
                 label);
    DFLASH_CHECK(e.algo.split_k >= 1, "{}: split-K {} < 1", label, e.algo.split_k);
    bool deterministic = false;
    for (uint32_t r : kDeterministicReductions) deterministic |= e.algo.reduction == r;
    DFLASH_CHECK(deterministic,
                 "{}: reduction scheme {} is not one of none/compute type/output type (atomics "
                 "would make runs differ)",
                 label, e.algo.reduction);
    for (size_t j = 0; j < i; ++j)
      DFLASH_CHECK(!(table[j].key == k), "{}: same key as {}", label,
                   gemm_plan_entry_label(table[j], j));
  }
}

const GemmPlanEntry* gemm_plan_table_find(std::span<const GemmPlanEntry> table,
                                          const GemmShapeKey& key) {
  for (const GemmPlanEntry& e : table)
    if (e.key == key) return &e;
  return nullptr;
}

void gemm_plan_entry_check(const GemmPlanEntry& e, size_t index, const GemmAlgoConfig& read_back) {
  const GemmAlgoConfig& a = e.algo;
  struct Field {
    const char* name;
    int64_t want, got;
  };
  const Field fields[] = {
      {"algo id", a.algo_id, read_back.algo_id},
      {"tile", a.tile, read_back.tile},
      {"stages", a.stages, read_back.stages},
      {"split-K", a.split_k, read_back.split_k},
      {"reduction scheme", a.reduction, read_back.reduction},
      {"CTA swizzle", a.swizzle, read_back.swizzle},
      {"custom option", a.custom, read_back.custom},
      {"inner shape", a.inner_shape, read_back.inner_shape},
      {"cluster shape", a.cluster_shape, read_back.cluster_shape},
  };
  for (const Field& f : fields)
    DFLASH_CHECK(f.want == f.got,
                 "{}: its algorithm words read back {} {} where the entry names {} (a wrong or "
                 "stale entry: regenerate the table, docs/perf-runs.md)",
                 gemm_plan_entry_label(e, index), f.name, f.got, f.want);
}

}  // namespace dflash
