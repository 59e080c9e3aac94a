// The measured GEMM plan table (ops/gemm_plan_table.hpp) on the CPU: the committed table is
// valid, a lookup matches only the exact key, and validation and the read-back check name the bad
// entry. The device side (cublasLtMatmulAlgoCheck, the plans' results) is covered by the CUDA
// linear and train-step parity tests, which run through gemm_bf16.
#include "ops/gemm_plan_table.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"

using namespace dflash;

namespace {

GemmPlanEntry entry(const char* name, int64_t M) {
  GemmPlanEntry e;
  e.name = name;
  e.key = GemmShapeKey{90, 130100, M, 4096, 4096, 4096, 4096, 4096, false, true, DType::f32, true};
  e.algo.algo_id = 66;
  e.algo.tile = 29;
  e.algo.stages = 35;
  e.algo.custom = 1;
  e.algo.cluster_shape = 3;
  return e;
}

// The message of the dflash::Error `fn` throws ("" when it does not throw).
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(GemmPlanTable, CommittedTableIsValid) {
  const auto table = gemm_plan_table();
  EXPECT_NO_THROW(gemm_plan_table_validate(table));
  for (const GemmPlanEntry& e : table) {
    EXPECT_GT(e.measured_ms, 0.0) << e.name;
    // An entry other than the heuristic's first was kept only when it was measured faster.
    EXPECT_LE(e.measured_ms, e.heuristic_ms) << e.name;
    EXPECT_EQ(gemm_plan_table_find(table, e.key), &e) << e.name;
  }
}

TEST(GemmPlanTable, FindMatchesOnlyTheExactKey) {
  const std::vector<GemmPlanEntry> table = {entry("a", 32768), entry("b", 40960)};
  const GemmShapeKey k = table[1].key;
  EXPECT_EQ(gemm_plan_table_find(table, k), &table[1]);
  std::vector<GemmShapeKey> others(10, k);
  others[0].sm = 100;
  others[1].lt_version = 130000;
  others[2].M = 40961;
  others[3].K = 4095;
  others[4].lda = 4160;
  others[5].ldc = 4160;
  others[6].trans_a = true;
  others[7].trans_b = false;
  others[8].out = DType::bf16;
  others[9].accumulate = false;
  for (size_t i = 0; i < others.size(); ++i)
    EXPECT_EQ(gemm_plan_table_find(table, others[i]), nullptr) << "changed field " << i;
}

TEST(GemmPlanTable, ValidationNamesTheBadEntry) {
  std::vector<GemmPlanEntry> table = {entry("a", 32768), entry("b", 40960)};
  EXPECT_NO_THROW(gemm_plan_table_validate(table));
  auto fails_with = [&](const char* what) {
    const std::string msg = error_of([&] { gemm_plan_table_validate(table); });
    EXPECT_NE(msg.find("entry 1 'b'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  table[1].key.M = 32768;  // the same key as entry 0
  fails_with("same key as GEMM plan table entry 0 'a'");
  table[1] = entry("b", 40960);
  table[1].algo.split_k = 0;
  fails_with("split-K 0");
  table[1] = entry("b", 40960);
  table[1].algo.reduction = 1;  // CUBLASLT_REDUCTION_SCHEME_INPLACE: atomics
  fails_with("reduction scheme 1");
  table[1] = entry("b", 40960);
  table[1].key.lda = 100;
  fails_with("leading dimension");
  table[1] = entry("b", 40960);
  table[1].key.out = DType::i32;
  fails_with("f32 or bf16");
  table[1] = entry("b", 40960);
  table[1].name = "";
  EXPECT_NE(error_of([&] { gemm_plan_table_validate(table); }).find("no name"), std::string::npos);
}

TEST(GemmPlanTable, ReadBackMismatchNamesEntryAndAttribute) {
  const GemmPlanEntry e = entry("bwd v_proj dx (+=)", 40960);
  EXPECT_NO_THROW(gemm_plan_entry_check(e, 7, e.algo));
  GemmAlgoConfig other = e.algo;
  other.tile = 24;
  const std::string msg = error_of([&] { gemm_plan_entry_check(e, 7, other); });
  EXPECT_NE(msg.find("entry 7 'bwd v_proj dx (+=)'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("M=40960"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tile 24 where the entry names 29"), std::string::npos) << msg;
  other = e.algo;
  other.cluster_shape = 5;
  EXPECT_NE(error_of([&] { gemm_plan_entry_check(e, 7, other); }).find("cluster shape 5"),
            std::string::npos);
}
