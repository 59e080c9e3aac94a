// The host side of DFlash2 on the CUDA backend, without a GPU: the predecessor index the selector
// head reads (dflash2_prev_tokens), the step plan's conv and selector buffers (plan_drafter_step,
// their sizes in both activation modes), and what the CUDA paths refuse of a DFlash2 drafter
// (cuda_drafter_unsupported: the selector's limits, nothing within them).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "model/dflash2_head_cuda.hpp"
#include "model/drafter_batch.hpp"
#include "model/step_plan.hpp"
#include "ops/dflash2_conv.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

size_t sz(int64_t n) {
  return static_cast<size_t>(n);
}

DrafterConfig config(int top_k = 8, int rank = 5) {
  DrafterConfig c;
  c.hidden_size = 96;
  c.intermediate_size = 160;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.vocab_size = 1301;
  c.rope.theta = 10000.0;
  c.block_size = 4;
  c.mask_token_id = 1300;
  c.target_layer_ids = {0};
  c.num_target_layers = 2;
  c.dflash2 = {true, 3, 32, rank, top_k, 1.0, 0.0};
  c.validate();
  return c;
}

DrafterBatch make_batch(const DrafterConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab_size) - 2);
  std::bernoulli_distribution bit(0.7);
  Rng arng(seed);
  DrafterBatch b(c.block_size);
  b.objective.kind = ObjectiveKind::dflash2;
  for (const std::vector<int>& docs : {std::vector<int>{1, 30, 17}, {61}}) {
    std::vector<int32_t> t, off{0};
    std::vector<uint8_t> mask;
    for (int n : docs) {
      for (int i = 0; i < n; ++i) {
        t.push_back(tok(rng));
        mask.push_back(bit(rng) ? 1 : 0);
      }
      off.push_back(static_cast<int32_t>(t.size()));
    }
    const std::vector<Anchor> a = sample_anchors(mask, off, 6, arng);
    b.append_row(t, off, a, block_targets(t, mask, off, a, c.block_size, 7.0));
  }
  b.row_length = 61;
  return b;
}

}  // namespace

TEST(Dflash2Plan, PredecessorsAreTheAnchorThenThePreviousLabel) {
  const DrafterConfig c = config();
  const DrafterBatch b = make_batch(c, 7);
  const int64_t K = c.block_size, NK = b.N() * K, V = c.vocab_size;
  const std::vector<int32_t> prev = dflash2_prev_tokens(b, NK + K, V);  // one padding block
  ASSERT_EQ(static_cast<int64_t>(prev.size()), NK + K);
  int64_t terms = 0;
  for (int64_t i = 0; i < NK + K; ++i) {
    const bool term = i < NK && i % K != 0 && b.targets.weights[sz(i)] != 0.0f;
    if (!term) {
      EXPECT_EQ(prev[sz(i)], V) << i;  // no selector term
      continue;
    }
    ++terms;
    const int32_t want =
        i % K == 1 ? b.tokens[sz(b.anchors[sz(i / K)].pos)] : b.targets.labels[sz(i - 1)];
    EXPECT_EQ(prev[sz(i)], want) << i;
  }
  EXPECT_GT(terms, b.N());
  EXPECT_THROW(dflash2_prev_tokens(b, NK - 1, V), Error);
  DrafterBatch other = b;
  other.objective.kind = ObjectiveKind::dflash;
  EXPECT_THROW(dflash2_prev_tokens(other, NK, V), Error);
}

TEST(Dflash2Plan, StepPlanHoldsTheConvAndSelectorBuffers) {
  const DrafterConfig c = config();
  const DrafterLayout layout(c);
  const int64_t NK = 64, H = c.hidden_size, W = 2 * 3 * (96 / 32);
  for (DrafterActivations acts : {DrafterActivations::recompute, DrafterActivations::keep}) {
    SCOPED_TRACE(drafter_activations_name(acts));
    ArenaPlanner p(step_phase_names());
    plan_drafter_step(p, c, layout, DrafterStepSizes{40, NK, 32, acts});
    const ArenaPlan plan = p.finish();
    for (int l = 0; l < c.num_layers; ++l) {
      for (const char* sub : {"attn_conv", "mlp_conv"}) {
        const std::string n = "drafter.layers." + std::to_string(l) + "." + sub + ".";
        EXPECT_EQ(plan.find(n + "delta").bytes, static_cast<uint64_t>(NK * W * 4));
        EXPECT_EQ(plan.find(n + "y").bytes, static_cast<uint64_t>(NK * H * 4));
        EXPECT_EQ(plan.try_find(n + "u") != nullptr, acts == DrafterActivations::keep);
      }
    }
    EXPECT_EQ(plan.try_find("drafter.attn_conv.u") != nullptr,
              acts == DrafterActivations::recompute);
    EXPECT_EQ(plan.find("drafter.conv.ddelta").bytes, static_cast<uint64_t>(NK * W * 2));
    EXPECT_EQ(plan.find("drafter.dflash2.rows").bytes, dflash2_head_cuda_rows_bytes(c, NK));
    EXPECT_EQ(plan.find("drafter.dflash2.workspace").bytes,
              dflash2_head_cuda_workspace_bytes(c, NK, 32));
    EXPECT_EQ(plan.find("drafter.dflash2.sums").bytes, 5 * sizeof(double));
  }
  // A plain drafter plans none of them.
  DrafterConfig plain = c;
  plain.dflash2 = {};
  ArenaPlanner p(step_phase_names());
  plan_drafter_step(p, plain, DrafterLayout(plain), DrafterStepSizes{40, NK, 32});
  const ArenaPlan plan = p.finish();
  EXPECT_EQ(plan.try_find("drafter.conv.dy"), nullptr);
  EXPECT_EQ(plan.try_find("drafter.dflash2.rows"), nullptr);
}

TEST(Dflash2Plan, CudaRefusalsNameWhatIsMissing) {
  EXPECT_TRUE(cuda_drafter_unsupported(config()).empty());
  const std::vector<std::string> big = cuda_drafter_unsupported(config(1025, 1025));
  ASSERT_EQ(big.size(), 2u);
  EXPECT_THAT(big[0], ::testing::HasSubstr("selector_top_k up to 1024"));
  EXPECT_THAT(big[1], ::testing::HasSubstr("selector_rank up to 1024"));
}
