// Tests of the DFlash drafter (src/model/drafter): the public reference trainer's step (golden),
// float64 finite differences of the whole drafter + loss, the visibility rule, and the agreement of
// the training and inference layouts.
#include "model/drafter.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "model/safetensors.hpp"
#include "util/drafter_problem.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

// A small random problem (test::DrafterProblem) with its block targets; the trailing two padding
// tokens form one more document without anchors (no block sees them).
template <typename S>
struct Problem : test::DrafterProblem<S> {
  explicit Problem(test::DrafterProblem<S> base) : test::DrafterProblem<S>(std::move(base)) {}
  BlockTargets targets;

  DrafterBatch batch() const {
    DrafterBatch b(this->cfg.block_size);
    b.append_row(this->tokens, this->doc_offsets, this->anchors, targets);
    return b;
  }
};

template <typename S>
Problem<S> make_problem(uint64_t seed, int layers, int NH, int NKV, int D, int K, double gamma,
                        std::vector<int32_t> docs, std::vector<Anchor> anchors, int H = 16,
                        int V = 23) {
  test::ProblemRow row;
  row.doc_offsets = std::move(docs);
  row.doc_offsets.push_back(row.doc_offsets.back() + 2);  // two padding tokens at the end
  row.mask_keep = 0.8;
  Rng rng(seed);
  Problem<S> p(test::draw_drafter_problem<S>(
      rng, test::small_drafter_config(K, H, V, layers, NH, NKV, D), std::move(anchors), row));
  p.targets = block_targets(p.tokens, p.mask, p.doc_offsets, p.anchors, K, gamma);
  return p;
}

template <typename S>
double loss_of(const Problem<S>& p, std::vector<S>* grads) {
  const DrafterTrainResult r = test::drafter_problem_step(p, p.batch(), grads);
  return r.loss_sum / r.weight_sum;
}

}  // namespace

TEST(Drafter, LayoutFollowsTheExportNames) {
  auto p = make_problem<float>(1, 2, 4, 2, 8, 4, 7.0, {0, 10}, {{2, 0}});
  const auto& L = *p.layout;
  EXPECT_EQ(L.params.front().name, "fc.weight");
  EXPECT_EQ(L.params.front().shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(L.params.back().name, "norm.weight");
  EXPECT_EQ(L.find("layers.1.self_attn.k_proj.weight").shape, (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(L.find("layers.0.mlp.down_proj.weight").shape, (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(L.params.size(), 2u + 2 * 11 + 1);
  EXPECT_THROW(L.find("lm_head.weight"), Error);
  // Named offsets resolve to the export names (the step code uses nothing else).
  EXPECT_EQ(L.fc, L.find("fc.weight").offset);
  EXPECT_EQ(L.hidden_norm, L.find("hidden_norm.weight").offset);
  EXPECT_EQ(L.norm, L.find("norm.weight").offset);
  ASSERT_EQ(L.layers.size(), 2u);
  for (int l = 0; l < 2; ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    const DrafterLayerOffsets& o = L.layers[static_cast<size_t>(l)];
    EXPECT_EQ(o.input_layernorm, L.find(pre + "input_layernorm.weight").offset);
    EXPECT_EQ(o.q_proj, L.find(pre + "self_attn.q_proj.weight").offset);
    EXPECT_EQ(o.k_proj, L.find(pre + "self_attn.k_proj.weight").offset);
    EXPECT_EQ(o.v_proj, L.find(pre + "self_attn.v_proj.weight").offset);
    EXPECT_EQ(o.o_proj, L.find(pre + "self_attn.o_proj.weight").offset);
    EXPECT_EQ(o.q_norm, L.find(pre + "self_attn.q_norm.weight").offset);
    EXPECT_EQ(o.k_norm, L.find(pre + "self_attn.k_norm.weight").offset);
    EXPECT_EQ(o.post_attention_layernorm, L.find(pre + "post_attention_layernorm.weight").offset);
    EXPECT_EQ(o.gate_proj, L.find(pre + "mlp.gate_proj.weight").offset);
    EXPECT_EQ(o.up_proj, L.find(pre + "mlp.up_proj.weight").offset);
    EXPECT_EQ(o.down_proj, L.find(pre + "mlp.down_proj.weight").offset);
    EXPECT_EQ(o.up_proj, o.gate_proj + 24 * 16);  // adjacent: one [2I, H] matrix
  }
  // Init: reproducible, norms 1, linear std ≈ 0.02.
  std::vector<float> a(L.total), b(L.total);
  drafter_init(a, L, 9);
  drafter_init(b, L, 9);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[L.find("norm.weight").offset], 1.0f);
  const auto& fc = L.find("fc.weight");
  double s2 = 0;
  for (int64_t i = 0; i < fc.numel; ++i) s2 += a[fc.offset + i] * a[fc.offset + i];
  EXPECT_NEAR(std::sqrt(s2 / fc.numel), 0.02, 0.003);
}

TEST(Drafter, ConfigValidationNamesTheField) {
  auto p = make_problem<float>(1, 1, 4, 2, 8, 4, 7.0, {0, 10}, {{2, 0}});
  DrafterConfig c = p.cfg;
  c.target_layer_ids = {0, 3};
  try {
    c.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 3 is outside the target's layers [0, 3)"),
              std::string::npos);
  }
  c = p.cfg;
  c.mask_token_id = 23;
  EXPECT_THROW(c.validate(), Error);
  c = p.cfg;
  c.num_kv_heads = 3;
  EXPECT_THROW(c.validate(), Error);
}

TEST(Drafter, LayoutOfCorruptSizesIsAnErrorNotAnOverflow) {
  auto p = make_problem<float>(1, 1, 4, 2, 8, 4, 7.0, {0, 10}, {{2, 0}});
  DrafterConfig c = p.cfg;
  c.hidden_size = int64_t{1} << 20;
  c.num_heads = c.num_kv_heads = int64_t{1} << 20;
  c.head_dim = int64_t{1} << 20;  // q_proj alone has 2^60 values; a few layers overflow int64
  c.num_layers = 64;
  try {
    DrafterLayout layout(c);
    FAIL() << "layout of " << layout.total << " parameters";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter count overflows"), std::string::npos)
        << e.what();
  }
}

// Whole drafter + loss against central finite differences in float64 (tiny dims, 2 layers,
// 3 blocks over 2 documents, GQA 2).
TEST(Drafter, GradientsMatchFiniteDifferencesInFloat64) {
  for (double gamma : {7.0, 0.0}) {
    auto p = make_problem<double>(3, 2, 4, 2, 8, 4, gamma, {0, 9, 17}, {{2, 0}, {4, 0}, {12, 1}});
    std::vector<double> g(p.layout->total, 0.0);
    loss_of(p, &g);
    Rng pick(11);
    double worst = 0;
    for (const auto& info : p.layout->params) {
      // A few coordinates of every parameter.
      for (int s = 0; s < 3; ++s) {
        const int64_t i = info.offset + static_cast<int64_t>(pick.below(info.numel));
        const double h = 1e-5, old = p.params[i];
        p.params[i] = old + h;
        const double lp = loss_of<double>(p, nullptr);
        p.params[i] = old - h;
        const double lm = loss_of<double>(p, nullptr);
        p.params[i] = old;
        const double fd = (lp - lm) / (2 * h);
        const double err = std::abs(fd - g[i]) / std::max(1e-6, std::abs(fd) + std::abs(g[i]));
        worst = std::max(worst, err);
        EXPECT_LT(err, 1e-5) << info.name << " fd " << fd << " analytic " << g[i];
      }
    }
    EXPECT_LT(worst, 1e-5);
  }
}

TEST(Drafter, Float32PathAgreesWithFloat64) {
  auto pd = make_problem<double>(5, 2, 6, 2, 8, 5, 7.0, {0, 12, 20}, {{1, 0}, {6, 0}, {13, 1}});
  auto pf = make_problem<float>(5, 2, 6, 2, 8, 5, 7.0, {0, 12, 20}, {{1, 0}, {6, 0}, {13, 1}});
  std::vector<double> gd(pd.layout->total, 0.0);
  std::vector<float> gf(pf.layout->total, 0.0f);
  const double ld = loss_of(pd, &gd), lf = loss_of(pf, &gf);
  EXPECT_NEAR(lf, ld, 1e-5 * std::abs(ld));
  std::vector<float> gd32(gd.begin(), gd.end());
  EXPECT_LT(test::rel_error(gf, gd32), 1e-4);
}

// Visibility: a block's logits depend only on context features of its own document strictly
// before its anchor, and on its own anchor token.
TEST(Drafter, VisibilityRuleIsExact) {
  auto p = make_problem<float>(7, 2, 4, 2, 8, 4, 7.0, {0, 10, 20}, {{3, 0}, {6, 0}, {14, 1}});
  DrafterWorkspace<float> ws;
  const int64_t KV = 4 * 23;
  auto base = drafter_block_logits(p.cfg, *p.layout, p.params.data(), p.tables(), p.batch(),
                                   p.features.data(), ws);
  auto block = [&](const std::vector<float>& l, int b) {
    return std::vector<float>(l.begin() + b * KV, l.begin() + (b + 1) * KV);
  };
  const int64_t F = 32;
  // NaN in the features at and after anchor 6 of doc 0 (positions 6..9): block 0 (anchor 3) and
  // block 1 (anchor 6) unchanged; also NaN in doc 1 leaves blocks 0 and 1 unchanged.
  {
    auto q = p;
    for (int64_t t = 6; t < 10; ++t)
      for (int64_t f = 0; f < F; ++f)
        q.features[t * F + f] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t f = 0; f < F; ++f) q.features[15 * F + f] = 1e3f;  // doc 1, after its anchor
    auto l = drafter_block_logits(q.cfg, *q.layout, q.params.data(), q.tables(), q.batch(),
                                  q.features.data(), ws);
    EXPECT_EQ(block(l, 0), block(base, 0));
    EXPECT_EQ(block(l, 1), block(base, 1));
    EXPECT_EQ(block(l, 2), block(base, 2));
  }
  // A feature before anchor 6 in doc 0 (position 4) changes block 1 but not block 0 (anchor 3) nor
  // block 2 (other document).
  {
    auto q = p;
    q.features[4 * F + 5] += 1.0f;
    auto l = drafter_block_logits(q.cfg, *q.layout, q.params.data(), q.tables(), q.batch(),
                                  q.features.data(), ws);
    EXPECT_EQ(block(l, 0), block(base, 0));
    EXPECT_NE(block(l, 1), block(base, 1));
    EXPECT_EQ(block(l, 2), block(base, 2));
  }
  // Tokens after an anchor change labels only, never logits; the anchor token changes its block.
  {
    auto q = p;
    q.tokens[4] = (q.tokens[4] + 1) % 22;  // after anchor 3, before anchor 6
    q.tokens[7] = (q.tokens[7] + 1) % 22;
    auto l = drafter_block_logits(q.cfg, *q.layout, q.params.data(), q.tables(), q.batch(),
                                  q.features.data(), ws);
    EXPECT_EQ(block(l, 0), block(base, 0));
    EXPECT_EQ(block(l, 1), block(base, 1));
    q.tokens[6] = (q.tokens[6] + 1) % 22;  // anchor of block 1
    l = drafter_block_logits(q.cfg, *q.layout, q.params.data(), q.tables(), q.batch(),
                             q.features.data(), ws);
    EXPECT_EQ(block(l, 0), block(base, 0));
    EXPECT_NE(block(l, 1), block(base, 1));
  }
  // Other blocks do not matter: block 1 alone gives the same logits. Its GEMMs have fewer rows,
  // and BLAS may block (and so round) a product of another shape differently (OpenBLAS's Haswell
  // and Zen SGEMM kernels do): equal up to f32 rounding, not bit for bit. A leak from another
  // block would change the logits by far more (the cases above check the same-shape rule exactly).
  {
    auto q = p;
    q.anchors = {{6, 0}};
    q.targets = block_targets(q.tokens, q.mask, q.doc_offsets, q.anchors, 4, 7.0);
    auto l = drafter_block_logits(q.cfg, *q.layout, q.params.data(), q.tables(), q.batch(),
                                  q.features.data(), ws);
    const std::vector<float> alone = block(l, 0), in_batch = block(base, 1);
    ASSERT_EQ(alone.size(), in_batch.size());
    for (size_t i = 0; i < alone.size(); ++i) {
      EXPECT_NEAR(alone[i], in_batch[i], 1e-5f * (1.0f + std::fabs(in_batch[i]))) << "logit " << i;
    }
  }
}

// The training step sends only the supervised rows to the LM head: its loss is Σ w·CE over the
// full logits of the training layout (computed here independently, in double), and its argmax is
// the logits' argmax on supervised slots and -1 on the others (slot 0, past the end, unmasked).
TEST(Drafter, TrainStepUsesExactlyTheSupervisedRows) {
  // Anchor 27 runs past the end of its document; the mask leaves some slots out.
  auto p =
      make_problem<float>(9, 1, 2, 1, 8, 6, 3.0, {0, 9, 30}, {{2, 0}, {4, 0}, {12, 1}, {27, 1}});
  DrafterWorkspace<float> ws;
  const auto logits = drafter_block_logits(p.cfg, *p.layout, p.params.data(), p.tables(), p.batch(),
                                           p.features.data(), ws);
  std::vector<float> grads(static_cast<size_t>(p.layout->total), 0.0f);
  const auto res = drafter_train_step<float>(p.cfg, *p.layout, p.params.data(), grads.data(),
                                             p.tables(), p.batch(), p.features.data(), 1.0, ws);
  const int64_t V = p.cfg.vocab_size, NK = static_cast<int64_t>(p.targets.labels.size());
  ASSERT_EQ(static_cast<int64_t>(res.argmax.size()), NK);
  double loss = 0, wsum = 0;
  int supervised = 0, skipped = 0;
  for (int64_t i = 0; i < NK; ++i) {
    const float* z = logits.data() + i * V;
    const auto am = static_cast<int32_t>(std::max_element(z, z + V) - z);
    if (!p.targets.counted[i]) {
      EXPECT_EQ(p.targets.weights[i], 0.0f);
      EXPECT_EQ(res.argmax[i], -1) << "slot " << i;
      ++skipped;
      continue;
    }
    ++supervised;
    EXPECT_EQ(res.argmax[i], am) << "slot " << i;
    double m = z[0], sum = 0;
    for (int64_t v = 1; v < V; ++v) m = std::max(m, static_cast<double>(z[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
    loss += p.targets.weights[i] * (m + std::log(sum) - z[p.targets.labels[i]]);
    wsum += p.targets.weights[i];
  }
  EXPECT_GT(supervised, 0);
  EXPECT_GT(skipped, 4);  // slot 0 of each block at least
  EXPECT_NEAR(res.weight_sum, wsum, 1e-6 * wsum);
  EXPECT_NEAR(res.loss_sum, loss, 1e-5 * loss);
}

// Training layout vs inference layout (KV cache filled with the same context) for one anchor.
TEST(Drafter, TrainingAndInferenceLayoutsAgree) {
  auto p = make_problem<float>(8, 2, 6, 3, 8, 6, 7.0, {0, 7, 30}, {{5, 0}, {19, 1}});
  DrafterWorkspace<float> ws;
  auto train = drafter_block_logits(p.cfg, *p.layout, p.params.data(), p.tables(), p.batch(),
                                    p.features.data(), ws);
  // Block 1: anchor 19 in doc [7, 30): context rows 7..18 at positions 0..11.
  DrafterCache cache;
  DrafterWorkspace<float> dws;
  drafter_cache_append(cache, p.cfg, *p.layout, p.params.data(), p.features.data() + 7 * 32, 5,
                       dws);
  drafter_cache_append(cache, p.cfg, *p.layout, p.params.data(), p.features.data() + 12 * 32, 7,
                       dws);
  ASSERT_EQ(cache.len, 12);
  const auto k_cached = cache.k, v_cached = cache.v;
  auto view =
      drafter_draft_block(cache, p.cfg, *p.layout, p.params.data(), p.tables(), p.tokens[19], dws);
  std::vector<float> inf(view.begin(), view.end());
  std::vector<float> tb(train.begin() + 6 * 23, train.end());
  EXPECT_LT(test::rel_error(inf, tb), 1e-5);
  // The draft borrows the cache's buffers and hands them back unchanged; drafting again with the
  // same (now warm) workspace gives the same bits.
  EXPECT_EQ(cache.len, 12);
  EXPECT_EQ(cache.k, k_cached);
  EXPECT_EQ(cache.v, v_cached);
  view =
      drafter_draft_block(cache, p.cfg, *p.layout, p.params.data(), p.tables(), p.tokens[19], dws);
  EXPECT_EQ(std::vector<float>(view.begin(), view.end()), inf);
  // Rolling back and re-appending gives the same cache.
  auto k_before = cache.k[1];
  cache.truncate(9);
  drafter_cache_append(cache, p.cfg, *p.layout, p.params.data(), p.features.data() + 16 * 32, 3,
                       dws);
  EXPECT_LT(test::rel_error(cache.k[1], k_before), 1e-6);
  EXPECT_THROW(cache.truncate(13), Error);
  // A cache whose layers disagree with its length is refused by name.
  cache.k[0].pop_back();
  std::string msg = "<no error>";
  try {
    drafter_draft_block(cache, p.cfg, *p.layout, p.params.data(), p.tables(), p.tokens[19], dws);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("drafter cache layer 0"), std::string::npos) << msg;
}

// The public reference trainer's step on tiny-qwen3 (../shared/fixtures/dflash-step.golden.*):
// loss and every parameter gradient within 1e-4 relative in fp32.
TEST(Drafter, ReproducesTheReferenceTrainingStep) {
  const auto dir = test::shared_dir() / "fixtures";
  SafetensorsFile g(dir / "dflash-step.golden.safetensors");
  const auto meta = nlohmann::json::parse(read_file_text(dir / "dflash-step.golden.json"));
  const auto& dc = meta["drafter_config"];
  DrafterConfig cfg;
  cfg.hidden_size = dc["hidden_size"];
  cfg.intermediate_size = dc["intermediate_size"];
  cfg.num_layers = dc["num_hidden_layers"];
  cfg.num_heads = dc["num_attention_heads"];
  cfg.num_kv_heads = dc["num_key_value_heads"];
  cfg.head_dim = dc["head_dim"];
  cfg.vocab_size = dc["vocab_size"];
  cfg.rms_norm_eps = dc["rms_norm_eps"];
  cfg.rope.theta = dc["rope_theta"];
  cfg.block_size = dc["block_size"];
  cfg.mask_token_id = dc["dflash_config"]["mask_token_id"];
  cfg.target_layer_ids = dc["dflash_config"]["target_layer_ids"].get<std::vector<int>>();
  cfg.num_target_layers = dc["num_target_layers"];
  cfg.validate();
  DrafterLayout layout(cfg);
  std::vector<float> params(layout.total), grads(layout.total, 0.0f);
  for (const auto& info : layout.params) {
    auto t = g.get_as("init." + info.name, DType::f32);
    ASSERT_EQ(t.numel(), info.numel) << info.name;
    std::copy_n(t.data<float>(), info.numel, params.begin() + info.offset);
  }
  SafetensorsCheckpoint target(test::assets_dir() / "tiny-qwen3");
  auto embed = target.get_as("model.embed_tokens.weight", DType::f32);  // tied: also the LM head
  DrafterTables<float> tables{embed.data<float>(), embed.data<float>()};

  auto ids = g.get_as("input_ids", DType::i32);
  auto lmask = g.get_as("loss_mask", DType::f32);
  auto feats = g.get_as("features", DType::f32);
  auto anchors_t = g.get_as("anchors", DType::i64);
  auto keep = g.get_as("anchor_keep", DType::u8);
  const int64_t R = ids.dim(0), T = ids.dim(1), NA = anchors_t.dim(1);
  struct RowData {
    std::vector<int32_t> tokens, offsets;
    std::vector<uint8_t> mask;
    std::vector<Anchor> anchors;
    BlockTargets targets;
  };
  std::vector<RowData> rows(R);
  double total_w = 0;
  for (int64_t r = 0; r < R; ++r) {
    auto& d = rows[r];
    d.tokens.assign(ids.data<int32_t>() + r * T, ids.data<int32_t>() + (r + 1) * T);
    d.mask.resize(T);
    for (int64_t t = 0; t < T; ++t) d.mask[t] = lmask.data<float>()[r * T + t] > 0.5f;
    d.offsets = {0, static_cast<int32_t>(T)};  // one conversation per row; padding is unsupervised
    for (int64_t a = 0; a < NA; ++a) {
      if (keep.data<uint8_t>()[r * NA + a]) {
        d.anchors.push_back({static_cast<int32_t>(anchors_t.data<int64_t>()[r * NA + a]), 0});
      }
    }
    d.targets = block_targets(d.tokens, d.mask, d.offsets, d.anchors, cfg.block_size, 7.0);
    for (float w : d.targets.weights) total_w += w;
  }
  // All rows as one packed DrafterBatch, as the trainer runs a step (features [R·T, F]).
  DrafterBatch batch(cfg.block_size);
  for (const RowData& d : rows) batch.append_row(d.tokens, d.offsets, d.anchors, d.targets);
  EXPECT_EQ(batch.weight_sum, total_w);
  DrafterWorkspace<float> ws;
  ObjectiveMetrics m(cfg.block_size);
  const auto res = drafter_train_step<float>(cfg, layout, params.data(), grads.data(), tables,
                                             batch, feats.data<float>(), 1.0 / total_w, ws);
  const double loss_sum = res.loss_sum, weight_sum = res.weight_sum;
  accumulate_metrics(m, batch.targets, res.argmax, {});
  const double golden_loss = meta["loss_value"];
  EXPECT_NEAR(loss_sum / weight_sum, golden_loss, 1e-4 * golden_loss);
  EXPECT_NEAR(m.accuracy(), meta["accuracy_value"].get<double>(), 1e-9);
  double worst = 0;
  for (const auto& info : layout.params) {
    auto ref = g.get_as("grad." + info.name, DType::f32);
    std::vector<float> ours(grads.begin() + info.offset, grads.begin() + info.offset + info.numel);
    const double err = test::rel_error(ours, ref.to_f32_vector());
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-4) << info.name;
  }
  RecordProperty("worst_grad_rel_error", std::to_string(worst));
  std::printf("golden step: loss %.6f (reference %.6f), worst gradient rel. error %.2e\n",
              loss_sum / weight_sum, golden_loss, worst);
}

// ------------------------------------------------------------------------------------- D-PACE

namespace {

// Per-slot CE [N·K] of the supervised slots of `b` from the drafter's logits (computed here from
// drafter_block_logits, not by the training step); 0 on unsupervised slots.
std::vector<double> slot_ce(const Problem<double>& p, const DrafterBatch& b) {
  DrafterWorkspace<double> ws;
  const auto logits = drafter_block_logits<double>(p.cfg, *p.layout, p.params.data(), p.tables(), b,
                                                   p.features.data(), ws);
  const int64_t V = p.cfg.vocab_size, NK = b.N() * b.block_size;
  std::vector<double> ce(static_cast<size_t>(NK), 0.0);
  for (int64_t i = 0; i < NK; ++i) {
    if (!b.targets.counted[i]) continue;
    const double* z = logits.data() + i * V;
    const double m = *std::max_element(z, z + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
    ce[i] = m + std::log(sum) - z[b.targets.labels[i]];
  }
  return ce;
}

// The D-PACE weights [N·K] of every block of `b` for the CE values `ce` (0 on unsupervised slots).
std::vector<double> block_weights(const DrafterBatch& b, const std::vector<double>& ce) {
  const size_t K = static_cast<size_t>(b.block_size);
  std::vector<double> w(ce.size(), 0.0);
  for (size_t i = 0; i < ce.size(); i += K) {
    std::span<double> out(w.data() + i, K);
    dpace_block_weights(out, std::span<const double>(ce.data() + i, K),
                        std::span<const uint8_t>(b.targets.counted.data() + i, K), b.objective);
    for (size_t k = 0; k < K; ++k) out[k] *= b.targets.counted[i + k];
  }
  return w;
}

// Σ w·CE / n with the weights `w` held fixed: the D-PACE loss as a function of the parameters
// when no gradient flows through the weights.
double frozen_loss(const Problem<double>& p, const DrafterBatch& b, const std::vector<double>& w) {
  const std::vector<double> ce = slot_ce(p, b);
  double sum = 0;
  for (size_t i = 0; i < ce.size(); ++i) sum += w[i] * ce[i];
  return sum / b.loss_normaliser();
}

}  // namespace

// OBJECTIVES.md §4: the D-PACE gradient is the gradient of Σ w·CE / (sequences) with the weights
// frozen at the step's values (finite differences in float64), for each variant; the step's loss
// equals that sum computed from the logits.
TEST(Drafter, DPaceGradientIsTheGradientWithTheWeightsFrozen) {
  for (LossType loss : {LossType::dpace, LossType::dpace_cumulative_confidence_only,
                        LossType::dpace_continuation_value_only}) {
    SCOPED_TRACE(loss_type_name(loss));
    auto p = make_problem<double>(3, 2, 4, 2, 8, 5, 0.0, {0, 9, 17}, {{2, 0}, {4, 0}, {12, 1}});
    DrafterBatch b = p.batch();
    b.objective = Objective{loss, 0.3};
    ASSERT_EQ(b.loss_normaliser(), 3.0);  // two documents and the padding document
    const std::vector<double> w0 = block_weights(b, slot_ce(p, b));
    std::vector<double> g(static_cast<size_t>(p.layout->total), 0.0);
    DrafterWorkspace<double> ws;
    const auto res =
        drafter_train_step<double>(p.cfg, *p.layout, p.params.data(), g.data(), p.tables(), b,
                                   p.features.data(), 1.0 / b.loss_normaliser(), ws);
    const double want = frozen_loss(p, b, w0);
    EXPECT_NEAR(res.loss_sum / b.loss_normaliser(), want, 1e-12 * want);
    double wsum = 0;
    for (double x : w0) wsum += x;
    EXPECT_NEAR(res.weight_sum, wsum, 1e-12 * wsum);
    Rng pick(11);
    for (const auto& info : p.layout->params) {
      for (int s = 0; s < 3; ++s) {
        const int64_t i = info.offset + static_cast<int64_t>(pick.below(info.numel));
        const double h = 1e-5, old = p.params[i];
        p.params[i] = old + h;
        const double lp = frozen_loss(p, b, w0);
        p.params[i] = old - h;
        const double lm = frozen_loss(p, b, w0);
        p.params[i] = old;
        const double fd = (lp - lm) / (2 * h);
        const double err = std::abs(fd - g[i]) / std::max(1e-6, std::abs(fd) + std::abs(g[i]));
        EXPECT_LT(err, 1e-5) << info.name << " fd " << fd << " analytic " << g[i];
      }
    }
  }
}

// α = 1 makes every s_k = 1: P ≡ 1 and w_k = R_k = the number of supervised slots at or after k.
// The loss is then Σ_k R_k·CE_k = Σ_j Σ_{k ≤ j} CE_k over supervised j and k, i.e. Σ_j −log Π_{k≤j}
// q_k: the negative log-probability, slots taken as independent, that each supervised prefix is
// accepted whole. A D-PACE step at α = 1 must equal a dflash step whose static weights are those
// counts, divided by the sequences.
TEST(Drafter, DPaceAtAlphaOneIsDFlashWeighedByTheSupervisedSlotsAhead) {
  auto p = make_problem<double>(4, 1, 4, 2, 8, 6, 0.0, {0, 11, 23}, {{1, 0}, {5, 0}, {13, 1}});
  DrafterBatch dp = p.batch();
  dp.objective = Objective{LossType::dpace, 1.0};
  DrafterBatch fixed = p.batch();  // dflash with weights R_k
  const int64_t K = fixed.block_size, N = fixed.N();
  int masked_inside = 0;
  for (int64_t blk = 0; blk < N; ++blk) {
    float ahead = 0;
    for (int64_t k = K - 1; k >= 0; --k) {
      const size_t i = static_cast<size_t>(blk * K + k);
      ahead += fixed.targets.counted[i];
      fixed.targets.weights[i] = fixed.targets.counted[i] ? ahead : 0.0f;
      masked_inside += k > 0 && !fixed.targets.counted[i] && ahead > 0;
    }
  }
  EXPECT_GT(masked_inside, 0);  // the mask has gaps inside blocks, not only at their ends
  const double scale = 1.0 / dp.loss_normaliser();
  std::vector<double> ga(static_cast<size_t>(p.layout->total), 0.0), gb = ga;
  DrafterWorkspace<double> ws;
  const auto ra = drafter_train_step<double>(p.cfg, *p.layout, p.params.data(), ga.data(),
                                             p.tables(), dp, p.features.data(), scale, ws);
  const auto rb = drafter_train_step<double>(p.cfg, *p.layout, p.params.data(), gb.data(),
                                             p.tables(), fixed, p.features.data(), scale, ws);
  EXPECT_NEAR(ra.loss_sum, rb.loss_sum, 1e-12 * rb.loss_sum);
  EXPECT_EQ(ra.weight_sum, rb.weight_sum);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ga.size(); ++i) {
    diff += (ga[i] - gb[i]) * (ga[i] - gb[i]);
    norm += gb[i] * gb[i];
  }
  EXPECT_GT(norm, 0.0);
  EXPECT_LT(std::sqrt(diff / norm), 1e-12);
}
