// dflash.cpp — the set-up the CUDA head tests share (tests/cuda/domino_head_cuda_test.cpp,
// dspark_head_cuda_test.cpp; CPU code, so it builds without CUDA): the drafter config of a head
// problem, its bf16-rounded parameters, the packed row of three documents with its mask and
// anchors, the batch made from it, the per-row labels and weights padded past the batch, and
// the checks both tests run on the GPU's outputs.
//
// Invariants: parameters are drawn from the caller's Rng before anything else the caller draws
// from it (same seed, same problem as before this helper existed); nothing here asserts about a
// head, only about rows and gradients that must be exactly 0.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "model/objective.hpp"

namespace dflash::test {

/// The drafter of the head tests: one layer, hidden H, vocabulary V (mask id V − 1), block K, 2
/// query heads of dim 64 over 1 key/value head, intermediate 32, RMSNorm ε 1e-6, RoPE θ 10⁴,
/// tapping layer 0 of a 2-layer target. Not validated: the caller sets its head's keys first.
DrafterConfig head_test_config(int64_t H, int64_t V, int K);

/// The drafter's parameters [layout.total]: 0.3·N(0, 1) from `rng` in offset order, each
/// rounded to bf16 (round to nearest even) so that the CPU and the GPU read the same values.
std::vector<float> head_test_params(const DrafterLayout& layout, Rng& rng);

/// The packed row of the head tests: documents [0, 29), [29, 47), [47, 53); the loss mask 1 but
/// at token 9; anchors every 2nd position of the first document, every 3rd of the second and one
/// at 48 (blocks of K ≥ 4 run past their document's end).
struct HeadTestRow {
  std::vector<int32_t> docs;  ///< document starts, then T
  std::vector<uint8_t> mask;  ///< [T]
  std::vector<Anchor> anchors;
  int64_t T() const { return docs.back(); }
};
HeadTestRow head_test_row();

/// Appends `row` with `tokens` [T] and their block targets to `batch`, sets batch.weight_sum =
/// Σ targets.weights (index order) and validates the batch (throws dflash::Error as
/// DrafterBatch::validate does).
void head_test_append_row(DrafterBatch& batch, const std::vector<int32_t>& tokens,
                          const HeadTestRow& row, BlockTargets targets);

/// The step's per-row labels and weights over R ≥ batch rows: the batch's, then label −5 and
/// weight 0 on the padding rows after it.
struct HeadTestTargets {
  std::vector<int32_t> labels;  ///< [R]
  std::vector<float> weights;   ///< [R]
};
HeadTestTargets head_test_targets(const DrafterBatch& batch, int64_t R);

/// v[offset, offset + n) as a new vector.
std::vector<float> head_test_slice(const std::vector<float>& v, int64_t offset, int64_t n);

/// Whether row `row` of `logits` [rows, V] has its largest value at least `margin` above the
/// second largest (not less apart: a NaN difference counts as apart), i.e. whether its argmax is
/// the same under any rounding smaller than the margin.
bool head_test_top_two_apart(const std::vector<float>& logits, int64_t row, int64_t V,
                             float margin);

/// Fatal failure (gtest ASSERT) at the first element of v[from, end) that is not exactly 0, naming
/// `what` and its index; wrap the call in ASSERT_NO_FATAL_FAILURE to stop the test there.
void head_test_expect_zero_from(const std::vector<float>& v, int64_t from, const char* what);

/// Fatal failure at the first element of `grads` whose `touched` entry is 0 and whose value is not
/// exactly 0 ("parameter element j"): a head's step writes only its own tensors' gradients.
void head_test_expect_untouched_zero(const std::vector<float>& grads,
                                     const std::vector<uint8_t>& touched);

}  // namespace dflash::test
