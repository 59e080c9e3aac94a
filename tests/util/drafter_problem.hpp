// dflash.cpp — the small random drafter problem the objective tests share (drafter_test,
// dspark_test, domino_test, dflash2_test): one config shape, one way to draw parameters, tables and
// a row of documents, one training step, and the float32-against-float64 check of a step.
//
// Invariants: everything is drawn from the caller's Rng in a fixed order (same seed, same problem);
// the problem owns its buffers; nothing here asserts about an objective, only about steps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/rng.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "model/objective.hpp"

namespace dflash::test {

/// The drafter the objective tests share: hidden H, vocabulary V (mask id V − 1), block K,
/// `layers` layers of NH query and NKV key/value heads of dim D, intermediate 24, RMSNorm ε 1e-6,
/// RoPE θ 10⁴, tapping layers {0, 2} of a 3-layer target. Not validated: the caller adds its
/// objective's keys, then draw_drafter_problem validates.
DrafterConfig small_drafter_config(int K, int H = 16, int V = 23, int layers = 2, int NH = 4,
                                   int NKV = 2, int D = 8);

/// A small random problem: the drafter's parameters and the target's tables and features, and one
/// row of tokens [T] split into documents `doc_offsets` (starts, then T), with loss mask and
/// anchors. `obj` is the objective a batch made from it carries.
template <typename S>
struct DrafterProblem {
  DrafterConfig cfg;
  std::shared_ptr<DrafterLayout> layout;
  std::vector<S> params;    ///< [layout.total]
  std::vector<S> embed;     ///< [V, H] the target's embedding
  std::vector<S> head;      ///< [V, H] the target's LM head
  std::vector<S> features;  ///< [T, taps·H] the target's hidden states at the taps
  std::vector<int32_t> tokens, doc_offsets;
  std::vector<uint8_t> mask;  ///< [T] the loss mask
  std::vector<Anchor> anchors;
  Objective obj;
  int64_t T = 0;

  DrafterTables<S> tables() const { return {embed.data(), head.data()}; }
  /// The problem as a one-row batch with the given block targets (from the objective's
  /// *_block_targets over this problem's row), `obj` as its objective and weight_sum = Σ weights.
  DrafterBatch batch(BlockTargets targets) const;
};

/// What draw_drafter_problem draws besides the parameters.
struct ProblemRow {
  /// Document starts then T; the last document may have no anchor (padding).
  std::vector<int32_t> doc_offsets = {0, 11, 20, 22};
  /// Positions whose loss mask is 0 (all others 1) when mask_keep ≥ 1, else each position is kept
  /// with probability mask_keep (drawn with its token).
  std::vector<int64_t> holes = {8};
  double mask_keep = 1.0;
};

/// Validates `cfg` (throws dflash::Error as DrafterConfig::validate does) and draws a problem
/// from `rng`: parameters (norm weights 1 + 0.1·N(0,1), all others 0.3·N(0,1), except those for
/// which `keep(info)` holds, which take `init`'s value at the same offset: e.g. an identity start),
/// embed N(0,1), head 0.5·N(0,1), features N(0,1), tokens uniform in [0, V − 1) (never the mask
/// id). `anchors` are taken as given.
template <typename S>
DrafterProblem<S> draw_drafter_problem(Rng& rng, DrafterConfig cfg, std::vector<Anchor> anchors,
                                       const ProblemRow& row = {},
                                       const std::function<bool(const ParamInfo&)>& keep = {},
                                       const std::vector<float>& init = {});

/// One drafter_train_step over `b` with the problem's parameters, tables and features, gradients
/// (when `grads` is not null, += scaled by 1/b.loss_normaliser(): 1/Σw, or 1/sequences for the
/// D-PACE losses) into grads [layout.total]; `target_final`
/// [T, H] the target's final-norm hidden states (DSpark's teacher), else null.
template <typename S>
DrafterTrainResult drafter_problem_step(const DrafterProblem<S>& p, const DrafterBatch& b,
                                        std::vector<S>* grads, const S* target_final = nullptr);

/// Expects a float32 step (rf, gf) to agree with the float64 step (rd, gd) of the same problem:
/// loss sums within `loss_rel` relative, the same argmax, and gradients within `grad_rel` in
/// relative L2 norm.
void expect_float32_step_agrees(const DrafterTrainResult& rd, const std::vector<double>& gd,
                                const DrafterTrainResult& rf, const std::vector<float>& gf,
                                double loss_rel = 1e-4, double grad_rel = 1e-4);

}  // namespace dflash::test
