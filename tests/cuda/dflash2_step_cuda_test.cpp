// DFlash2 in DrafterCuda (src/model/drafter_cuda.cpp: the conv in the block stream, the selector
// head of model/dflash2_head_cuda.hpp): at the identity start (β = e₀, W_kp = 0) and α_sel = 0 a
// DFlash2 drafter's CUDA step is plain DFlash's bit for bit (loss, Σw, argmax, every shared
// parameter's gradient), with the activations recomputed and kept; with random conv and selector
// tensors the whole CUDA step follows the CPU's drafter_train_step (α_sel > 0 with ū = U, and
// with m ≠ 1, a softcap and stop_gradient), gives the same bits on a second run and with kept
// activations; the same with each D-PACE loss type as the base (the identity start then equals
// plain D-PACE bit for bit). Weights, tables and features are rounded to bf16 first, as in
// train_step_cuda_test.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "model/dflash2_head_cuda.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_cuda.hpp"
#include "model/objective.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

size_t sz(int64_t n) {
  return static_cast<size_t>(n);
}

// The drafter of train_step_cuda_test.cpp; with `T` > 0 a DFlash2 drafter with conv taps T and
// groups of `group` channels (selector rank 4, top 8; ū = softcap(m·U)).
DrafterConfig config(int T = 0, int group = 0, double m = 1.0, double cap = 0.0) {
  DrafterConfig c;
  c.hidden_size = 128;
  c.intermediate_size = 160;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 301;
  c.rope.theta = 10000.0;
  c.block_size = 4;
  c.mask_token_id = 300;
  c.target_layer_ids = {0, 2};
  c.num_target_layers = 3;
  if (T > 0) c.dflash2 = {true, T, group, 4, 64, m, cap};  // about a fifth of golds in the top-64
  c.validate();
  return c;
}

// Three rows of 61 slots (documents and padding), tokens uniform, loss mask on ~70 % of them.
struct HostRows {
  std::vector<std::vector<int32_t>> tokens, offsets;
  std::vector<std::vector<Anchor>> anchors;
  std::vector<BlockTargets> targets;
  int64_t L = 61;
};

// `gamma` the targets' slot decay (0 for the D-PACE losses: their static weights are the mask).
HostRows make_rows(int64_t V, int K, uint32_t seed, double gamma = 7.0) {
  HostRows b;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V) - 2);
  std::bernoulli_distribution bit(0.7);
  Rng arng(seed);
  for (const std::vector<int>& docs : {std::vector<int>{1, 30, 17}, {61}, {5, 12}}) {
    std::vector<int32_t> t, off{0};
    std::vector<uint8_t> m;
    for (int n : docs) {
      for (int i = 0; i < n; ++i) {
        t.push_back(tok(rng));
        m.push_back(bit(rng) ? 1 : 0);
      }
      off.push_back(static_cast<int32_t>(t.size()));
    }
    b.anchors.push_back(sample_anchors(m, off, 6, arng));
    b.targets.push_back(block_targets(t, m, off, b.anchors.back(), K, gamma));
    b.tokens.push_back(std::move(t));
    b.offsets.push_back(std::move(off));
  }
  return b;
}

DrafterBatch batch_of(const HostRows& b, int K, const Objective& obj, size_t first = 0,
                      size_t last = SIZE_MAX) {
  DrafterBatch d(K);
  d.objective = obj;
  for (size_t r = first; r < std::min(last, b.tokens.size()); ++r) {
    d.append_row(b.tokens[r], b.offsets[r], b.anchors[r], b.targets[r]);
  }
  d.row_length = b.L;
  return d;
}

Objective objective_of(const DrafterConfig& c, double alpha = 0.0, bool stop = false,
                       LossType loss = LossType::dflash) {
  Objective o;
  o.loss = loss;
  o.dpace_alpha = 0.3;
  if (!c.dflash2.enabled) return o;
  o.kind = ObjectiveKind::dflash2;
  o.dflash2_selector_alpha = alpha;
  o.dflash2_stop_gradient = stop;
  return o;
}

// Parameters: drafter_init's (DFlash2's identity start), then the base tensors random (norm
// weights around 1) and, with `random_conv`, the conv and selector tensors too (β around e₀,
// W_kp small, Bs no longer 0).
std::vector<float> params_of(const DrafterLayout& layout, bool random_conv) {
  std::vector<float> p(sz(layout.total));
  drafter_init(p, layout, 5);
  for (const auto& info : layout.params) {
    const bool conv = info.name.find("_conv.") != std::string::npos;
    const bool selector = info.name.rfind("candidate_selector", 0) == 0;
    if ((conv || selector) && !random_conv) continue;
    const std::vector<float> r = randn(sz(info.numel), 77 + static_cast<uint32_t>(info.offset),
                                       conv       ? 0.05f
                                       : selector ? 0.3f
                                                  : 0.02f);
    for (int64_t i = 0; i < info.numel; ++i) {
      float& x = p[sz(info.offset + i)];
      x = info.is_norm || info.name.find("base_kernel") != std::string::npos ? x + 10 * r[sz(i)]
                                                                             : r[sz(i)];
    }
  }
  return round_bf16(p);
}

template <typename T>
T* device_copy(cuda::CudaContext& ctx, std::vector<cuda::DeviceBuffer>& keep,
               const std::vector<T>& h) {
  keep.push_back(ctx.scratch(std::max<size_t>(h.size(), 1) * sizeof(T)));
  DFLASH_CUDA_CHECK(
      cudaMemcpy(keep.back().data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return keep.back().as<T>();
}

// One packed step of `rows` on the device, staged as CudaTrainBackend stages it.
struct Step {
  cuda::CudaContext& ctx;
  std::vector<cuda::DeviceBuffer> keep;
  DrafterBatch whole;
  int64_t T = 0, NK = 0;
  std::vector<int32_t> pos, block_tokens, labels;
  std::vector<AttnRange> ranges;
  std::vector<float> weights, features, embed, head;

  Step(cuda::CudaContext& c, const DrafterConfig& cfg, const HostRows& rows, const Objective& obj)
      : ctx(c), whole(batch_of(rows, cfg.block_size, obj)) {
    const int K = cfg.block_size;
    T = whole.rows * whole.row_length;
    NK = (whole.N() * K + 8 * K - 1) / (8 * K) * (8 * K);
    std::vector<int32_t> tokens(sz(T));
    std::vector<AttnRange> ctx_ranges(sz(T));
    pos.resize(sz(T + NK));
    block_tokens.resize(sz(NK));
    ranges.resize(sz(NK));
    labels.resize(sz(NK));
    weights.resize(sz(NK));
    drafter_batch_stage(whole, cfg.mask_token_id, 0,
                        {tokens, ctx_ranges, pos, block_tokens, ranges, labels, weights});
    const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
    features = round_bf16(randn(sz(T * cfg.n_taps() * H), 9, 1.0f));
    embed = round_bf16(randn(sz(V * H), 1, 1.0f));
    head = round_bf16(randn(sz(V * H), 2, 0.1f));
  }

  struct Out {
    DrafterCuda::Results r;
    std::vector<float> grads;
  };
  // DrafterCuda's step for `params` (activations recomputed or kept), run `runs` times: each run
  // must give the bits of the first.
  Out run(const DrafterConfig& cfg, const DrafterLayout& layout, const std::vector<float>& params,
          DrafterActivations acts = DrafterActivations::recompute, int runs = 1) {
    const uint16_t* d_embed = device_copy(ctx, keep, to_bf16(embed));
    const uint16_t* d_head = device_copy(ctx, keep, to_bf16(head));
    DrafterCuda dc(ctx, cfg, layout, T, NK, d_embed, d_head, nullptr, kDrafterCeChunkRows, acts);
    const std::vector<float> zeros(params.size(), 0.0f);
    dc.upload_state(params, zeros, zeros);
    const std::vector<uint16_t> fb = to_bf16(features);
    DFLASH_CUDA_CHECK(cudaMemcpy(dc.features(), fb.data(), fb.size() * 2, cudaMemcpyHostToDevice));
    DrafterCudaInputs in;
    in.T = T;
    in.NK = NK;
    in.features = dc.features();
    in.pos = device_copy(ctx, keep, pos);
    in.block_tokens = device_copy(ctx, keep, block_tokens);
    in.ranges = device_copy(ctx, keep, ranges);
    in.labels = device_copy(ctx, keep, labels);
    in.weights = device_copy(ctx, keep, weights);
    in.objective = whole.objective;
    if (cfg.dflash2.enabled) {
      in.dflash2_prev = device_copy(ctx, keep, dflash2_prev_tokens(whole, NK, cfg.vocab_size));
      in.dflash2_alpha =
          device_copy(ctx, keep, std::vector<double>{whole.objective.dflash2_selector_alpha});
    }
    Out first;
    for (int k = 0; k < runs; ++k) {
      dc.forward_backward(in, 1.0 / whole.loss_normaliser());
      Out o{dc.fetch_results(NK), std::vector<float>(params.size())};
      dc.download_grads(o.grads);
      if (k == 0) {
        first = std::move(o);
        continue;
      }
      EXPECT_EQ(o.r.loss_sum, first.r.loss_sum) << "run " << k;
      EXPECT_TRUE(same_bits(o.grads, first.grads)) << "run " << k;
      EXPECT_TRUE(same_bits(o.r.argmax, first.r.argmax)) << "run " << k;
    }
    return first;
  }
};

std::vector<float> head_of(const std::vector<float>& v, int64_t n) {
  return {v.begin(), v.begin() + n};
}

}  // namespace

// With a D-PACE loss type the identity start at α_sel = 0 is plain D-PACE's step bit for bit too
// (the same fused CE, the same weights of the same CE, the head adding zeros before the scaling).
TEST(Dflash2Cuda, IdentityConvStepIsPlainDflashBitForBit) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const DrafterConfig c1 = config(), c2 = config(2, 32);
  const DrafterLayout l1(c1), l2(c2);
  const std::vector<float> p1 = params_of(l1, false), p2 = params_of(l2, false);
  ASSERT_EQ(l2.find("norm.weight").offset, l1.find("norm.weight").offset);
  ASSERT_TRUE(same_bits(head_of(p2, l1.total), p1));  // the shared tensors come first
  for (const LossType loss : {LossType::dflash, LossType::dpace}) {
    const HostRows rows =
        make_rows(c1.vocab_size, c1.block_size, 3, loss == LossType::dflash ? 7.0 : 0.0);
    Step step(ctx, c1, rows, objective_of(c1, 0.0, false, loss));
    for (DrafterActivations acts : {DrafterActivations::recompute, DrafterActivations::keep}) {
      SCOPED_TRACE(::testing::Message()
                   << drafter_activations_name(acts) << " " << loss_type_name(loss));
      step.whole.objective = objective_of(c1, 0.0, false, loss);
      const Step::Out a = step.run(c1, l1, p1, acts);
      step.whole.objective = objective_of(c2, 0.0, false, loss);  // α_sel = 0: it only measures
      const Step::Out b = step.run(c2, l2, p2, acts);
      EXPECT_EQ(b.r.loss_sum, a.r.loss_sum);
      EXPECT_EQ(b.r.weight_sum, a.r.weight_sum);
      EXPECT_TRUE(same_bits(b.r.argmax, a.r.argmax));
      EXPECT_TRUE(same_bits(head_of(b.grads, l1.total), a.grads));
      EXPECT_GT(b.r.dflash2_selector_sum, 0.0);
      EXPECT_EQ(b.r.dflash2_base_sum, a.r.loss_sum);
      // The conv's tensors learn (β from the first step, W_kp through dδ).
      for (const auto& info : l2.params) {
        if (info.name.find("_conv.") == std::string::npos) continue;
        const std::vector<float> g(b.grads.begin() + info.offset,
                                   b.grads.begin() + info.offset + info.numel);
        EXPECT_TRUE(std::any_of(g.begin(), g.end(), [](float x) { return x != 0.0f; }))
            << info.name;
      }
    }
  }
}

// One DFlash2 setting of the whole-step comparison.
struct Case {
  int T, group;
  double m, cap, alpha;
  bool stop;
  LossType loss = LossType::dflash;
};

TEST(Dflash2Cuda, StepMatchesCpuReference) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  // T = 2 of 4 slots with 4 groups of 32 channels, ū = U (the fused CE's base); T = b with one
  // group of 128, m and a softcap (the head's base) and stop_gradient; each with the dflash loss
  // and a D-PACE one (the base's weights from the fused CE's or the head's CE, the selector's
  // per-slot weight the same).
  for (const Case& k :
       {Case{2, 32, 1.0, 0.0, 0.7, false}, Case{4, 128, 0.8, 5.0, 0.5, true},
        Case{2, 32, 1.0, 0.0, 0.7, false, LossType::dpace},
        Case{4, 128, 0.8, 5.0, 0.5, false, LossType::dpace},
        Case{4, 128, 0.8, 5.0, 0.5, true, LossType::dpace_continuation_value_only}}) {
    SCOPED_TRACE(::testing::Message()
                 << "T=" << k.T << " group=" << k.group << " m=" << k.m << " cap=" << k.cap
                 << " stop=" << k.stop << " loss " << loss_type_name(k.loss));
    const DrafterConfig c = config(k.T, k.group, k.m, k.cap);
    const DrafterLayout layout(c);
    const std::vector<float> params = params_of(layout, true);
    const bool dpace = k.loss != LossType::dflash;
    const HostRows rows = make_rows(c.vocab_size, c.block_size, 4, dpace ? 0.0 : 7.0);
    Step step(ctx, c, rows, objective_of(c, k.alpha, k.stop, k.loss));
    const Step::Out gpu = step.run(c, layout, params, DrafterActivations::recompute, 2);
    const Step::Out kept = step.run(c, layout, params, DrafterActivations::keep);
    EXPECT_EQ(kept.r.loss_sum, gpu.r.loss_sum);
    EXPECT_TRUE(same_bits(kept.grads, gpu.grads));
    // CPU: one drafter_train_step per row (no block spans two rows, so D-PACE's weights are the
    // whole step's), gradients scaled by the whole step's 1/Σw (1/sequences for D-PACE).
    std::vector<float> cpu_grads(params.size(), 0.0f);
    DrafterTables<float> tables{step.embed.data(), step.head.data()};
    DrafterWorkspace<float> ws;
    double cpu_loss = 0, cpu_w = 0, cpu_base = 0, cpu_sel = 0, cpu_hit = 0;
    const int64_t F = c.n_taps() * c.hidden_size;
    int64_t t0 = 0;
    for (size_t r = 0; r < rows.tokens.size(); ++r) {
      const DrafterBatch row = batch_of(rows, c.block_size, step.whole.objective, r, r + 1);
      const float* feats = step.features.data() + t0 * F;
      t0 += row.T();
      if (row.N() == 0) continue;
      const auto res =
          drafter_train_step<float>(c, layout, params.data(), cpu_grads.data(), tables, row, feats,
                                    1.0 / step.whole.loss_normaliser(), ws);
      cpu_loss += res.loss_sum;
      cpu_w += res.weight_sum;
      cpu_base += res.dflash2_base_sum;
      cpu_sel += res.dflash2_selector_sum;
      cpu_hit += res.dflash2_in_topk_weight;
    }
    // D-PACE's weights come from each side's own CE (bf16 activations on the GPU).
    EXPECT_NEAR(gpu.r.weight_sum, cpu_w, (dpace ? 1e-2 : 1e-6) * cpu_w);
    EXPECT_NEAR(gpu.r.loss_sum, cpu_loss, 1e-2 * std::abs(cpu_loss));
    ASSERT_GT(cpu_hit, 0.0);
    EXPECT_NEAR(gpu.r.dflash2_base_sum, cpu_base, 1e-2 * cpu_base);
    EXPECT_NEAR(gpu.r.dflash2_selector_sum, cpu_sel, 5e-2 * cpu_sel);
    EXPECT_NEAR(gpu.r.dflash2_in_topk_weight, cpu_hit, 5e-2 * cpu_w);
    std::printf("loss sum cpu %.6f gpu %.6f; selector sum cpu %.6f gpu %.6f\n", cpu_loss,
                gpu.r.loss_sum, cpu_sel, gpu.r.dflash2_selector_sum);
    for (const auto& p : layout.params) {
      const std::vector<float> g(gpu.grads.begin() + p.offset,
                                 gpu.grads.begin() + p.offset + p.numel);
      const std::vector<float> h(cpu_grads.begin() + p.offset,
                                 cpu_grads.begin() + p.offset + p.numel);
      // The selector's tensors follow the candidate sets, which the GPU's bf16 activations move
      // near the K-th logit: a looser bound.
      const bool selector = p.name.rfind("candidate_selector", 0) == 0;
      const double e = rel_error(g, h);
      EXPECT_LT(e, selector ? 1.5e-1 : 5e-2) << p.name;
      std::printf("%-50s grad relative error %.3g\n", p.name.c_str(), e);
    }
  }
}
