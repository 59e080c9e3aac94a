// dflash.cpp — the objective tests' shared drafter problem (drafter_problem.hpp).
#include "util/drafter_problem.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace dflash::test {

DrafterConfig small_drafter_config(int K, int H, int V, int layers, int NH, int NKV, int D) {
  DrafterConfig c;
  c.hidden_size = H;
  c.intermediate_size = 24;
  c.num_layers = layers;
  c.num_heads = NH;
  c.num_kv_heads = NKV;
  c.head_dim = D;
  c.vocab_size = V;
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 10000.0;
  c.block_size = K;
  c.mask_token_id = V - 1;
  c.target_layer_ids = {0, 2};
  c.num_target_layers = 3;
  return c;
}

template <typename S>
DrafterBatch DrafterProblem<S>::batch(BlockTargets targets) const {
  DrafterBatch b(cfg.block_size);
  b.objective = obj;
  b.append_row(tokens, doc_offsets, anchors, std::move(targets));
  b.weight_sum = 0;
  for (float w : b.targets.weights) b.weight_sum += w;
  b.validate();
  return b;
}

template <typename S>
DrafterProblem<S> draw_drafter_problem(Rng& rng, DrafterConfig cfg, std::vector<Anchor> anchors,
                                       const ProblemRow& row,
                                       const std::function<bool(const ParamInfo&)>& keep,
                                       const std::vector<float>& init) {
  DrafterProblem<S> p;
  cfg.validate();
  p.cfg = std::move(cfg);
  p.layout = std::make_shared<DrafterLayout>(p.cfg);
  p.params.resize(p.layout->total);
  for (const ParamInfo& info : p.layout->params) {
    const bool kept = keep && keep(info);
    for (int64_t i = 0; i < info.numel; ++i) {
      p.params[info.offset + i] =
          kept ? static_cast<S>(init.at(info.offset + i))
               : static_cast<S>(info.is_norm ? 1.0 + 0.1 * rng.normal() : 0.3 * rng.normal());
    }
  }
  const int64_t H = p.cfg.hidden_size, V = p.cfg.vocab_size;
  auto draw = [&](std::vector<S>& v, int64_t n, double sd) {
    v.resize(n);
    for (auto& x : v) x = static_cast<S>(sd * rng.normal());
  };
  draw(p.embed, V * H, 1.0);
  draw(p.head, V * H, 0.5);
  p.doc_offsets = row.doc_offsets;
  p.T = p.doc_offsets.back();
  const auto taps = static_cast<int64_t>(p.cfg.target_layer_ids.size());
  draw(p.features, p.T * taps * H, 1.0);
  p.tokens.resize(p.T);
  p.mask.assign(p.T, 1);
  for (int64_t t = 0; t < p.T; ++t) {
    p.tokens[t] = static_cast<int32_t>(rng.below(V - 1));
    if (row.mask_keep < 1.0) p.mask[t] = rng.uniform() < row.mask_keep ? 1 : 0;
  }
  if (row.mask_keep >= 1.0) {
    for (int64_t t : row.holes) p.mask.at(t) = 0;
  }
  p.anchors = std::move(anchors);
  return p;
}

template <typename S>
DrafterTrainResult drafter_problem_step(const DrafterProblem<S>& p, const DrafterBatch& b,
                                        std::vector<S>* grads, const S* target_final) {
  auto ws = std::make_unique<DrafterWorkspace<S>>();
  return drafter_train_step<S>(p.cfg, *p.layout, p.params.data(), grads ? grads->data() : nullptr,
                               p.tables(), b, p.features.data(), 1.0 / b.loss_normaliser(), *ws,
                               target_final);
}

void expect_float32_step_agrees(const DrafterTrainResult& rd, const std::vector<double>& gd,
                                const DrafterTrainResult& rf, const std::vector<float>& gf,
                                double loss_rel, double grad_rel) {
  EXPECT_NEAR(rf.loss_sum, rd.loss_sum, loss_rel * std::abs(rd.loss_sum));
  EXPECT_EQ(rf.argmax, rd.argmax);
  ASSERT_EQ(gf.size(), gd.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < gd.size(); ++i) {
    num += (gf[i] - gd[i]) * (gf[i] - gd[i]);
    den += gd[i] * gd[i];
  }
  EXPECT_GT(den, 0.0) << "no gradient: the comparison has no power";
  EXPECT_LT(std::sqrt(num / den), grad_rel);
}

#define DFLASH_DRAFTER_PROBLEM(S)                                               \
  template struct DrafterProblem<S>;                                            \
  template DrafterProblem<S> draw_drafter_problem<S>(                           \
      Rng&, DrafterConfig, std::vector<Anchor>, const ProblemRow&,              \
      const std::function<bool(const ParamInfo&)>&, const std::vector<float>&); \
  template DrafterTrainResult drafter_problem_step<S>(                          \
      const DrafterProblem<S>&, const DrafterBatch&, std::vector<S>*, const S*);
DFLASH_DRAFTER_PROBLEM(float)
DFLASH_DRAFTER_PROBLEM(double)
#undef DFLASH_DRAFTER_PROBLEM

}  // namespace dflash::test
