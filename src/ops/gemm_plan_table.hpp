// dflash.cpp — the committed table of measured cuBLASLt GEMM plans, and its lookup and validation.
//
// The cuBLASLt heuristic's first plan is not the fastest one at 11 of the 25 GEMM shapes of a
// Qwen3-8B training step (docs/perf-runs.md, "The GEMMs at the step's shapes"). Choosing by
// timing at run time would make the algorithm, and with it the result's bits, depend on timing
// noise, so the choice is made once, off line: `gemm_bench` times the heuristic's candidates of
// every shape on the device and prints them in machine-readable lines, `tools/gemm_plan_table.py`
// keeps the fastest of each shape and writes src/ops/gemm_plan_table_data.cpp (how, on which device
// and by which command is written at the top of that file). gemm_bf16 (backend/cuda/gemm.hpp) uses
// an entry when everything in its key matches the call, else the heuristic's first plan as before.
//
// Invariants: an entry is keyed by everything that selects a plan: the device's SM version, the
// cuBLASLt version (an algorithm's opaque words are only meaningful to the version that wrote
// them: cublasLt.h, cublasLtMatmulAlgo_t), M, N, K, the three leading dimensions, the two
// transposes, the output dtype and whether C is read (beta ≠ 0). Inputs are always bf16, compute
// and scale fp32, the epilogue the default one (the table has no other). No two entries share a
// key. An entry that matches a call but whose plan does not survive the checks (its words read
// back other attributes than it names, or cublasLtMatmulAlgoCheck refuses it) is an error naming
// the entry: never a silent fall back to the heuristic.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "core/dtype.hpp"

namespace dflash {

/// Everything that selects a GEMM plan, in gemm_bf16's row-major terms: D[M,N] = op(A)·op(B)
/// (+ C), A stored [M,K] (lda) or [K,M] when trans_a, B stored [K,N] (ldb) or [N,K] when trans_b,
/// D and C [M,N] with ldc; `out` is D's and C's dtype (f32 or bf16); `accumulate` is beta ≠ 0.
struct GemmShapeKey {
  int sm = 0;               // compute capability major·10 + minor (90 for sm_90)
  uint64_t lt_version = 0;  // cublasLtGetVersion() of the library the plan was measured with
  int64_t M = 0, N = 0, K = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool trans_a = false, trans_b = false;
  DType out = DType::f32;
  bool accumulate = false;
  bool operator==(const GemmShapeKey&) const = default;
};

/// A cuBLASLt algorithm: its readable configuration attributes
/// (cublasLtMatmulAlgoConfigAttributes_t: CUBLASLT_ALGO_CONFIG_ID, TILE_ID, STAGES_ID, SPLITK_NUM,
/// REDUCTION_SCHEME, CTA_SWIZZLING, CUSTOM_OPTION, INNER_SHAPE_ID, CLUSTER_SHAPE_ID) and the opaque
/// cublasLtMatmulAlgo_t words the heuristic returned, which the same cuBLASLt version restores as
/// they are.
struct GemmAlgoConfig {
  int32_t algo_id = 0;
  uint32_t tile = 0, stages = 0;
  int32_t split_k = 1;
  uint32_t reduction = 0, swizzle = 0, custom = 0;
  uint32_t inner_shape = 0, cluster_shape = 0;
  std::array<uint64_t, 8> words{};
  /// Equality of the readable attributes only (the words are compared by the caller when needed).
  bool same_attributes(const GemmAlgoConfig& o) const;
};

/// One measured plan: `name` (the GEMM's role, e.g. "bwd v_proj dx (+=)"), its key, the algorithm,
/// and what gemm_bench measured (median ms of the chosen plan and of the heuristic's first).
struct GemmPlanEntry {
  const char* name = "";
  GemmShapeKey key;
  GemmAlgoConfig algo;
  double measured_ms = 0, heuristic_ms = 0;
};

/// "entry 3 'bwd v_proj dx (+=)' (sm 90, cuBLASLt 130000, M=… N=… K=… lda=… ldb=… ldc=… ta=… tb=…
/// out=f32 acc=1)": how errors name an entry.
std::string gemm_plan_entry_label(const GemmPlanEntry& e, size_t index);
/// The key's fields in one line ("sm 90, cuBLASLt …, M=… …"), for messages and reports.
std::string gemm_shape_key_string(const GemmShapeKey& k);
/// The algorithm's attributes in one line ("algo 66 tile 29 stages 34 splitK 1 …").
std::string gemm_algo_config_string(const GemmAlgoConfig& a);

/// Checks every entry of `table`: sizes ≥ 1, leading dimensions ≥ the stored widths, out f32 or
/// bf16, split-K ≥ 1, a non-empty name, the reduction scheme one of the deterministic ones (none,
/// compute type, output type: no atomics), and no two entries with the same key. Throws
/// dflash::Error naming the first bad entry (gemm_plan_entry_label) and what is wrong.
void gemm_plan_table_validate(std::span<const GemmPlanEntry> table);

/// The entry of `table` whose key equals `key`, or nullptr. Linear in the table's size (25 or so
/// entries, asked once per shape and context).
const GemmPlanEntry* gemm_plan_table_find(std::span<const GemmPlanEntry> table,
                                          const GemmShapeKey& key);

/// Compares the attributes an entry names with those its words read back as (`read_back`, from
/// cublasLtMatmulAlgoConfigGetAttribute on the restored algorithm). Throws dflash::Error naming
/// the entry and the first attribute that differs: the entry is wrong or stale.
void gemm_plan_entry_check(const GemmPlanEntry& e, size_t index, const GemmAlgoConfig& read_back);

/// The committed table (src/ops/gemm_plan_table_data.cpp); validated once, on first use, by
/// gemm_plan_table_validate (a bad committed entry throws there).
std::span<const GemmPlanEntry> gemm_plan_table();

}  // namespace dflash
