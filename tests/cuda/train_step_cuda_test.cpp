// The CUDA training step against the CPU reference: TargetCuda's tap forward against
// TargetModel::forward_taps on the tiny Qwen3 fixture (packed rows with several documents and
// padding), and DrafterCuda's forward/backward over a packed step (a DrafterBatch staged as
// CudaTrainBackend stages it) against drafter_train_step summed over the rows (loss, Σw, every
// parameter gradient, the gradient norm and the argmax), plus an AdamW step, determinism of the
// whole GPU step, that sharing the memory plan's arena by phase changes no bit of a step, and that
// keeping the forward's activations for the backward instead of recomputing them changes none.
// Weights, tables and features are rounded to bf16 first so that the only
// differences are the GPU's bf16 activations and summation order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_cuda.hpp"
#include "model/drafter_io.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/dspark_head_cuda.hpp"
#include "model/objective.hpp"
#include "model/target.hpp"
#include "model/target_cuda.hpp"
#include "ops/loss_weights.hpp"
#include "train/memory_plan.hpp"
#include "train/optimizer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

// A batch of `rows` rows of `L` slots; row r holds documents of the given lengths (the rest is
// padding), tokens uniform in [0, V), loss mask on roughly 70 % of the tokens.
struct HostBatch {
  int64_t L = 0;
  std::vector<std::vector<int32_t>> tokens, offsets;
  std::vector<std::vector<uint8_t>> mask;
  std::vector<std::vector<Anchor>> anchors;
  std::vector<BlockTargets> targets;
};

HostBatch make_batch(const std::vector<std::vector<int>>& doc_lengths, int64_t L, int64_t V, int K,
                     int num_anchors, uint32_t seed, double gamma = 7.0, bool dspark = false,
                     const Objective& obj = {}) {
  HostBatch b;
  b.L = L;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V) - 1);
  std::bernoulli_distribution bit(0.7);
  Rng arng(seed);
  for (const auto& docs : doc_lengths) {
    std::vector<int32_t> t, off{0};
    std::vector<uint8_t> m;
    for (int n : docs) {
      for (int i = 0; i < n; ++i) {
        t.push_back(tok(rng));
        m.push_back(bit(rng) ? 1 : 0);
      }
      off.push_back(static_cast<int32_t>(t.size()));
    }
    b.anchors.push_back(sample_anchors(m, off, num_anchors, arng));
    const std::vector<Anchor>& a = b.anchors.back();
    b.targets.push_back(
        dspark         ? dspark_block_targets(t, m, off, a, K, gamma)
        : obj.domino() ? domino_block_targets(t, m, off, a, K, gamma, obj.domino_shift_label)
                       : block_targets(t, m, off, a, K, gamma));
    b.tokens.push_back(std::move(t));
    b.offsets.push_back(std::move(off));
    b.mask.push_back(std::move(m));
  }
  return b;
}

// Rows [first, last) of `b` as one DrafterBatch (block size K, loss `obj`).
DrafterBatch drafter_batch_of(const HostBatch& b, int K, size_t first = 0, size_t last = SIZE_MAX,
                              const Objective& obj = {}) {
  DrafterBatch d(K);
  d.objective = obj;
  for (size_t r = first; r < std::min(last, b.tokens.size()); ++r) {
    d.append_row(b.tokens[r], b.offsets[r], b.anchors[r], b.targets[r]);
  }
  d.row_length = b.L;
  return d;
}

// A DrafterBatch staged (drafter_batch_stage) into host arrays of T = rows·L context rows and NK
// block rows padded to a multiple of `multiple`, as CudaTrainBackend stages a step.
struct Staged {
  int64_t T = 0, NK = 0, N = 0;
  std::vector<int32_t> tokens, pos, block_tokens, labels;
  std::vector<AttnRange> context_ranges, block_ranges;
  std::vector<float> weights;
};

Staged stage(const DrafterBatch& d, int32_t mask_token_id, int64_t multiple) {
  Staged s;
  s.T = d.rows * d.row_length;
  s.N = d.N();
  s.NK = std::max<int64_t>(multiple, (d.N() * d.block_size + multiple - 1) / multiple * multiple);
  const auto T = static_cast<size_t>(s.T), NK = static_cast<size_t>(s.NK);
  s.tokens.resize(T);
  s.context_ranges.resize(T);
  s.pos.resize(T + NK);
  s.block_tokens.resize(NK);
  s.block_ranges.resize(NK);
  s.labels.resize(NK);
  s.weights.resize(NK);
  drafter_batch_stage(
      d, mask_token_id, 0,
      {s.tokens, s.context_ranges, s.pos, s.block_tokens, s.block_ranges, s.labels, s.weights});
  return s;
}

template <typename T>
T* device_copy(cuda::CudaContext& ctx, std::vector<cuda::DeviceBuffer>& keep,
               const std::vector<T>& h) {
  keep.push_back(ctx.scratch(std::max<size_t>(h.size(), 1) * sizeof(T)));
  DFLASH_CUDA_CHECK(cudaMemcpy(keep.back().data(), h.data(), h.size() * sizeof(T),
                               cudaMemcpyHostToDevice));
  return keep.back().as<T>();
}

}  // namespace

TEST(TargetCuda, TapsMatchCpuOnPackedRows) {
  DFLASH_REQUIRE_GPU();
  const TargetModel target = TargetModel::load(assets_dir() / "tiny-qwen3");
  const int64_t H = target.hidden_size(), V = target.vocab_size();
  const std::vector<int> taps = {1, 3, 1};
  // Two rows of 97 slots: documents of 1, 40 and 30 tokens (26 padding), and one of 97 tokens.
  HostBatch b = make_batch({{1, 40, 30}, {97}}, 97, V, 4, 8, 11);
  const Staged s = stage(drafter_batch_of(b, 4), 8000, 16);
  cuda::CudaContext ctx(0);
  TargetCuda tc(ctx, target, s.T);
  std::vector<cuda::DeviceBuffer> keep;
  const int32_t* tokens = device_copy(ctx, keep, s.tokens);
  const int32_t* pos = device_copy(ctx, keep, s.pos);
  const AttnRange* ranges = device_copy(ctx, keep, s.context_ranges);
  const int64_t F = static_cast<int64_t>(taps.size()) * H;
  DeviceGuarded<uint16_t> out(static_cast<size_t>(s.T * F));
  tc.forward_taps(out.get(), tokens, pos, ranges, s.T, taps);
  ctx.synchronize();
  const std::vector<float> gpu = from_bf16(out.download());
  EXPECT_TRUE(out.guard_intact());
  int64_t t0 = 0;  // rows lie back to back in the packed context, padding after the last one
  for (size_t r = 0; r < b.tokens.size(); ++r) {
    const Tensor cpu = target.forward_taps(b.tokens[r], b.offsets[r], taps);
    const int64_t real = static_cast<int64_t>(b.tokens[r].size());
    std::vector<float> g(gpu.begin() + t0 * F, gpu.begin() + (t0 + real) * F);
    t0 += real;
    const double e = rel_error(g, cpu.to_f32_vector());
    EXPECT_LT(e, 2e-2) << "row " << r;
    std::printf("row %zu: tap relative error %.3g over %lld tokens\n", r, e,
                static_cast<long long>(real));
  }
}

// The staged context's padding (drafter_batch_stage_context: documents of one row, here ONE of 73
// rows) against the staging before it (one one-token document per padding row, position 0): the
// taps of every real row keep their bits, with the kernels' prefill and with cuDNN's (one graph of
// 128 slots, what the one-token documents need, for both).
TEST(TargetCuda, ThePaddingDocumentChangesNoBitOfARealRow) {
  DFLASH_REQUIRE_GPU();
  const TargetModel target = TargetModel::load(assets_dir() / "tiny-qwen3");
  const int64_t H = target.hidden_size(), V = target.vocab_size();
  const std::vector<int> taps = {1, 3};
  const int64_t F = static_cast<int64_t>(taps.size()) * H;
  const HostBatch b = make_batch({{1, 40, 30}, {50}}, 97, V, 4, 8, 11);
  const DrafterBatch d = drafter_batch_of(b, 4);
  const int64_t T = d.T(), T_pad = d.rows * d.row_length;
  ASSERT_EQ(T_pad - T, 73);
  const auto n = static_cast<size_t>(T_pad);
  std::vector<int32_t> tokens(n), pos(n);
  std::vector<AttnRange> ranges(n);
  const int64_t docs = drafter_batch_stage_context(d, 0, tokens, pos, ranges);
  ASSERT_EQ(docs, d.n_docs() + 1);
  // Padding tokens of different ids (the staging writes one id; any ids are padding), so that the
  // two stagings' padding rows differ: rows of one repeated token give the same values whatever
  // they see, which would let a test that mixed up the stagings pass.
  for (int64_t t = T; t < T_pad; ++t) tokens[static_cast<size_t>(t)] = static_cast<int32_t>(t % V);
  std::vector<int32_t> old_pos = pos;
  std::vector<AttnRange> old_ranges = ranges;
  for (int64_t t = T; t < T_pad; ++t) {
    const auto t32 = static_cast<int32_t>(t);
    old_pos[static_cast<size_t>(t)] = 0;
    old_ranges[static_cast<size_t>(t)] = AttnRange{t32, t32 + 1, 0, 0};
  }
  cuda::CudaContext ctx(0);
  TargetCuda tc(ctx, target, T_pad);
  std::vector<cuda::DeviceBuffer> keep;
  const int32_t* tok_d = device_copy(ctx, keep, tokens);
  const int32_t* pos_d = device_copy(ctx, keep, pos);
  const int32_t* old_pos_d = device_copy(ctx, keep, old_pos);
  const AttnRange* ranges_d = device_copy(ctx, keep, ranges);
  const AttnRange* old_ranges_d = device_copy(ctx, keep, old_ranges);
  // The taps of all T_pad rows.
  auto run = [&](const int32_t* p, const AttnRange* r) {
    DeviceGuarded<uint16_t> out(static_cast<size_t>(T_pad * F));
    tc.forward_taps(out.get(), tok_d, p, r, T_pad, taps);
    ctx.synchronize();
    EXPECT_TRUE(out.guard_intact());
    return out.download();
  };
  auto real_rows = [&](std::vector<uint16_t> v) {
    v.resize(static_cast<size_t>(T * F));
    return v;
  };
  for (const bool cudnn : {false, true}) {
    if (cudnn) {  // one graph for both (128 slots: the one-token documents need them)
      tc.use_cudnn_prefill();
      tc.cudnn_prefill_select(TargetCuda::cudnn_prefill_bucket(d.n_docs() + T_pad - T),
                              d.row_length);
    }
    const std::vector<uint16_t> now = run(pos_d, ranges_d);
    const std::vector<uint16_t> before = run(old_pos_d, old_ranges_d);
    EXPECT_NE(now, before) << "the padding rows differ (the test compares two stagings)";
    EXPECT_TRUE(same_bits(real_rows(now), real_rows(before)))
        << (cudnn ? "cuDNN" : "kernels") << " prefill";
  }
  EXPECT_EQ(tc.cudnn_prefill_graphs(), 1);
  EXPECT_EQ(TargetCuda::cudnn_prefill_bucket(docs), 8);  // 4 documents + 1 padding
}

namespace {

// DrafterCuda's step with loss `obj` against drafter_train_step summed over the rows (loss, Σw,
// every parameter gradient, the norm, the argmax), determinism, and an AdamW step.
// `heads`: a DSpark drafter with these heads (obj must be dspark); its teacher rows follow the
// taps in the features. `domino`: a drafter with this Domino head (obj must be domino).
void expect_step_matches_cpu(const Objective& obj, const DsparkHeads& heads = {},
                             const DominoHead& domino = {}) {
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
  c.dspark = heads;
  c.domino = domino;
  c.validate();
  const DrafterLayout layout(c);
  const int64_t H = c.hidden_size, V = c.vocab_size, F = c.n_taps() * H;
  const int K = c.block_size;

  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, 5);
  for (const auto& p : layout.params) {  // non-trivial norm weights
    if (!p.is_norm) continue;
    const std::vector<float> r = randn(static_cast<size_t>(p.numel), 77 + p.offset, 0.2f);
    for (int64_t i = 0; i < p.numel; ++i) params[p.offset + i] = 1.0f + r[i];
  }
  params = round_bf16(params);
  const std::vector<float> embed = round_bf16(randn(static_cast<size_t>(V * H), 1, 1.0f));
  const std::vector<float> head = round_bf16(randn(static_cast<size_t>(V * H), 2, 0.1f));

  // Three rows of 61 slots with several documents and padding; up to 6 anchors per document.
  // D-PACE ignores γ: its static weights are the mask (drafter_batch_from_rows).
  HostBatch b = make_batch({{1, 30, 17}, {61}, {5, 12}}, 61, V, K, 6, 3, obj.dpace() ? 0.0 : 7.0,
                           heads.enabled, obj);
  const DrafterBatch whole = drafter_batch_of(b, K, 0, SIZE_MAX, obj);
  const Staged s = stage(whole, c.mask_token_id, 8 * K);
  ASSERT_GT(s.N, 8);
  ASSERT_GT(s.NK, s.N * K);  // padding blocks are exercised
  const std::vector<float> feats = round_bf16(randn(static_cast<size_t>(s.T * F), 9, 1.0f));
  // DSpark's teacher: the target's final-norm rows [T, H] (after the taps on the device).
  const std::vector<float> fin =
      heads.enabled ? round_bf16(randn(static_cast<size_t>(s.T * H), 10, 1.0f))
                    : std::vector<float>{};

  // CPU reference: one drafter_train_step per row (D-PACE's weights are per block, so the rows'
  // sum is the step), gradients scaled by 1/normaliser of the whole step (Σw or the documents).
  const double total_w = whole.loss_normaliser();
  ASSERT_GT(whole.weight_sum, 0);
  std::vector<float> cpu_grads(params.size(), 0.0f);
  DrafterTables<float> tables{embed.data(), head.data()};
  DrafterWorkspace<float> ws;
  double cpu_loss = 0, cpu_w = 0, cpu_ce = 0, cpu_l1 = 0, cpu_bce = 0, cpu_acc = 0;
  double cpu_final_ce = 0, cpu_base_ce = 0;  // Domino's terms
  std::vector<int32_t> cpu_argmax;
  int64_t t0 = 0;  // the row's first context row in the packed step
  for (size_t r = 0; r < b.tokens.size(); ++r) {
    const DrafterBatch row = drafter_batch_of(b, K, r, r + 1, obj);
    const float* row_features = feats.data() + t0 * F;
    const float* row_final = heads.enabled ? fin.data() + t0 * H : nullptr;
    t0 += row.T();
    if (row.N() == 0) continue;
    auto res = drafter_train_step<float>(c, layout, params.data(), cpu_grads.data(), tables, row,
                                         row_features, 1.0 / total_w, ws, row_final);
    cpu_loss += res.loss_sum;
    cpu_w += res.weight_sum;
    cpu_ce += res.dspark_ce_sum;
    cpu_l1 += res.dspark_l1_sum;
    cpu_bce += res.dspark_bce_sum;
    cpu_acc += res.dspark_acc_sum;
    cpu_final_ce += res.domino_final_ce_sum;
    cpu_base_ce += res.domino_base_ce_sum;
    cpu_argmax.insert(cpu_argmax.end(), res.argmax.begin(), res.argmax.end());
  }

  cuda::CudaContext ctx(0);
  std::vector<cuda::DeviceBuffer> keep;
  const uint16_t* d_embed = device_copy(ctx, keep, to_bf16(embed));
  const uint16_t* d_head = device_copy(ctx, keep, to_bf16(head));
  DrafterCuda dc(ctx, c, layout, s.T, s.NK, d_embed, d_head);
  const std::vector<float> zeros(params.size(), 0.0f);
  dc.upload_state(params, zeros, zeros);
  std::vector<float> all_features = feats;  // the taps, then DSpark's teacher rows
  all_features.insert(all_features.end(), fin.begin(), fin.end());
  const std::vector<uint16_t> feats_bf = to_bf16(all_features);
  DFLASH_CUDA_CHECK(cudaMemcpy(dc.features(), feats_bf.data(), feats_bf.size() * 2,
                               cudaMemcpyHostToDevice));
  DrafterCudaInputs in;
  in.T = s.T;
  in.NK = s.NK;
  in.features = dc.features();
  in.pos = device_copy(ctx, keep, s.pos);
  in.block_tokens = device_copy(ctx, keep, s.block_tokens);
  in.ranges = device_copy(ctx, keep, s.block_ranges);
  in.labels = device_copy(ctx, keep, s.labels);
  in.weights = device_copy(ctx, keep, s.weights);
  in.objective = obj;
  if (heads.enabled) {
    const DsparkRowIndex x = dspark_row_index(whole, s.NK, V);
    in.dspark_prev = device_copy(ctx, keep, x.prev);
    in.dspark_teacher_pos = device_copy(ctx, keep, x.teacher_pos);
    in.dspark_w1_order = device_copy(ctx, keep, x.w1_order);
    in.dspark_w1_seg = device_copy(ctx, keep, x.w1_seg);
  }
  if (domino.enabled) {
    const DominoRowIndex x = domino_row_index(c, whole, s.NK);
    in.domino_gru_tok = device_copy(ctx, keep, x.gru_tok);
    in.domino_lambda = device_copy(ctx, keep, std::vector<double>{x.lambda});
  }

  dc.forward_backward(in, 1.0 / total_w);
  const DrafterCuda::Results r1 = dc.fetch_results(s.NK);
  std::vector<float> gpu_grads(params.size());
  dc.download_grads(gpu_grads);

  // D-PACE's Σw depends on the rows' CE, which the GPU's bf16 activations move a little.
  EXPECT_NEAR(r1.weight_sum, cpu_w, (obj.dpace() ? 1e-3 : 1e-6) * cpu_w);
  EXPECT_NEAR(r1.loss_sum, cpu_loss, 1e-2 * std::abs(cpu_loss));
  std::printf("loss sum cpu %.6f gpu %.6f; Σw %.4f\n", cpu_loss, r1.loss_sum, cpu_w);
  if (heads.enabled) {  // DSpark's terms (fp32 rows, double sums)
    EXPECT_NEAR(r1.dspark_ce_sum, cpu_ce, 1e-2 * std::abs(cpu_ce));
    EXPECT_NEAR(r1.dspark_l1_sum, cpu_l1, 1e-2 * std::abs(cpu_l1));
    EXPECT_NEAR(r1.dspark_bce_sum, cpu_bce, 1e-2 * std::abs(cpu_bce) + 1e-9);
    EXPECT_NEAR(r1.dspark_acc_sum, cpu_acc, 1e-2 * std::abs(cpu_acc));
  }
  if (domino.enabled) {  // Domino's two CE terms (fp32 rows, double sums)
    EXPECT_NEAR(r1.domino_final_ce_sum, cpu_final_ce, 1e-2 * std::abs(cpu_final_ce));
    EXPECT_NEAR(r1.domino_base_ce_sum, cpu_base_ce, 1e-2 * std::abs(cpu_base_ce));
    std::printf("Domino Σw·CE(F) cpu %.6f gpu %.6f; Σw·CE(U) cpu %.6f gpu %.6f\n", cpu_final_ce,
                r1.domino_final_ce_sum, cpu_base_ce, r1.domino_base_ce_sum);
  }
  for (const auto& p : layout.params) {
    std::vector<float> g(gpu_grads.begin() + p.offset, gpu_grads.begin() + p.offset + p.numel);
    std::vector<float> h(cpu_grads.begin() + p.offset, cpu_grads.begin() + p.offset + p.numel);
    const double e = rel_error(g, h);
    EXPECT_LT(e, 5e-2) << p.name;
    std::printf("%-40s grad relative error %.3g\n", p.name.c_str(), e);
  }
  const double cpu_norm = std::sqrt(sum_squares_cpu(cpu_grads.data(), layout.total));
  EXPECT_NEAR(r1.grad_norm, cpu_norm, 3e-2 * cpu_norm);
  // Argmax over the supervised block rows (the CPU step reports -1 for rows of weight 0, which
  // skip its LM head; padding rows follow the real ones).
  ASSERT_EQ(static_cast<int64_t>(cpu_argmax.size()), s.N * K);
  int64_t agree = 0, supervised = 0;
  for (int64_t i = 0; i < s.N * K; ++i) {
    if (cpu_argmax[static_cast<size_t>(i)] < 0) continue;
    ++supervised;
    agree += r1.argmax[static_cast<size_t>(i)] == cpu_argmax[static_cast<size_t>(i)];
  }
  ASSERT_GT(supervised, s.N);
  EXPECT_GE(agree, supervised * 9 / 10) << agree << " of " << supervised;

  // Determinism: the same step again gives the same bits.
  dc.forward_backward(in, 1.0 / total_w);
  const DrafterCuda::Results r2 = dc.fetch_results(s.NK);
  std::vector<float> gpu_grads2(params.size());
  dc.download_grads(gpu_grads2);
  EXPECT_EQ(r1.loss_sum, r2.loss_sum);
  EXPECT_TRUE(same_bits(gpu_grads, gpu_grads2));
  EXPECT_TRUE(same_bits(r1.argmax, r2.argmax));

  // AdamW on the device equals adamw_step_cpu on the device's gradients.
  AdamWConfig ac;
  ac.weight_decay = 0.01;
  dc.adamw(ac, 1e-3, 1, 0.5);
  std::vector<float> p_gpu(params.size()), m_gpu(params.size()), v_gpu(params.size());
  dc.download_state(p_gpu, m_gpu, v_gpu);
  std::vector<float> p_cpu = params, m_cpu(params.size(), 0.0f), v_cpu(params.size(), 0.0f);
  adamw_step_cpu(p_cpu.data(), m_cpu.data(), v_cpu.data(), gpu_grads2.data(), layout.total, ac,
                 1e-3, 1, 0.5);
  EXPECT_TRUE(same_bits(p_gpu, p_cpu));
  EXPECT_TRUE(same_bits(m_gpu, m_cpu));
  EXPECT_TRUE(same_bits(v_gpu, v_cpu));
}

}  // namespace

TEST(DrafterCuda, StepMatchesCpuReference) {
  DFLASH_REQUIRE_GPU();
  expect_step_matches_cpu(Objective{});
}

// The D-PACE losses on the device (one CE pass, weights from the rows' CE, the rows' gradients
// scaled) against the CPU step, for each variant.
// The DSpark objective's whole drafter step (vanilla Markov head of rank 3, the confidence head
// with the Markov input; rank 0 without a confidence head; the rnn head of rank 3 with the
// confidence head on the Markov input; the gated head of rank 4 without a confidence head)
// against the CPU step.
TEST(DrafterCuda, DsparkStepMatchesCpuReference) {
  DFLASH_REQUIRE_GPU();
  Objective obj;
  obj.kind = ObjectiveKind::dspark;
  obj.dspark_ce_alpha = 0.3;
  obj.dspark_l1_alpha = 0.9;
  obj.dspark_conf_alpha = 0.7;
  DsparkHeads heads;
  heads.enabled = true;
  heads.markov_rank = 3;
  heads.confidence_head = true;
  heads.confidence_with_markov = true;
  expect_step_matches_cpu(obj, heads);
  heads.markov_type = MarkovHeadType::rnn;
  std::printf("markov_head_type rnn\n");
  expect_step_matches_cpu(obj, heads);
  heads.markov_rank = 0;
  heads.markov_type = MarkovHeadType::vanilla;
  heads.confidence_head = false;
  heads.confidence_with_markov = false;
  obj.dspark_conf_alpha = 0.0;
  expect_step_matches_cpu(obj, heads);
  heads.markov_rank = 4;
  heads.markov_type = MarkovHeadType::gated;
  std::printf("markov_head_type gated\n");
  expect_step_matches_cpu(obj, heads);
}

// The Domino objective's whole drafter step against the CPU step: shift_label false with P 0 and
// odd E, G; shift_label true with P 1; λ strictly inside (0, 1).
TEST(DrafterCuda, DominoStepMatchesCpuReference) {
  DFLASH_REQUIRE_GPU();
  Objective obj;
  obj.kind = ObjectiveKind::domino;
  obj.domino_lambda = 0.3;
  DominoHead h{true, 33, 17, 0, false};
  expect_step_matches_cpu(obj, {}, h);
  obj.domino_lambda = 0.7;
  obj.domino_shift_label = true;
  h = DominoHead{true, 16, 9, 1, true};
  expect_step_matches_cpu(obj, {}, h);
}

TEST(DrafterCuda, DPaceStepMatchesCpuReference) {
  DFLASH_REQUIRE_GPU();
  for (LossType loss : {LossType::dpace, LossType::dpace_cumulative_confidence_only,
                        LossType::dpace_continuation_value_only}) {
    SCOPED_TRACE(loss_type_name(loss));
    std::printf("loss_type %s\n", loss_type_name(loss));
    expect_step_matches_cpu(Objective{loss, 0.3});
  }
}

// The device D-PACE weights against the CPU op on random CE values with masked rows (a block
// size that fills no warp evenly, blocks beyond one per thread), and the row scaling.
TEST(LossWeightsCuda, DPaceWeightsAndRowScalingMatchTheCpu) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  const int64_t N = 700, K = 13, H = 37;
  std::vector<float> ce = randn(static_cast<size_t>(N * K), 5, 1.0f), mask(ce.size());
  for (size_t i = 0; i < ce.size(); ++i) {
    ce[i] = std::abs(ce[i]) * 3.0f;
    mask[i] = (i % static_cast<size_t>(K)) != 0 && (i * 7919) % 5 != 0 ? 1.0f : 0.0f;
  }
  const std::vector<float> x = randn(static_cast<size_t>(N * K * H), 6, 1.0f);
  std::vector<cuda::DeviceBuffer> keep;
  for (LossType loss : {LossType::dpace, LossType::dpace_cumulative_confidence_only,
                        LossType::dpace_continuation_value_only}) {
    SCOPED_TRACE(loss_type_name(loss));
    const Objective obj{loss, 0.25};
    std::vector<float> w_cpu = ce;
    double sums_cpu[2];
    dpace_weights_cpu(w_cpu.data(), sums_cpu, mask.data(), N, K, obj);
    float* d_w = device_copy(ctx, keep, ce);
    const float* d_mask = device_copy(ctx, keep, mask);
    double* d_sums = device_copy(ctx, keep, std::vector<double>(2, -1.0));
    dpace_weights_cuda(ctx, d_w, d_sums, d_mask, N, K, obj);
    float* d_x = device_copy(ctx, keep, x);
    rows_scale_cuda(ctx, d_x, d_w, N * K, H);
    std::vector<float> w_gpu(ce.size()), x_gpu(x.size());
    double sums_gpu[2];
    DFLASH_CUDA_CHECK(cudaMemcpy(w_gpu.data(), d_w, w_gpu.size() * 4, cudaMemcpyDeviceToHost));
    DFLASH_CUDA_CHECK(cudaMemcpy(x_gpu.data(), d_x, x_gpu.size() * 4, cudaMemcpyDeviceToHost));
    DFLASH_CUDA_CHECK(cudaMemcpy(sums_gpu, d_sums, sizeof sums_gpu, cudaMemcpyDeviceToHost));
    // The same double formula: the weights agree to within an ulp or so (device exp).
    EXPECT_LT(rel_error(w_gpu, w_cpu), 1e-6);
    for (size_t i = 0; i < ce.size(); ++i) {
      if (mask[i] == 0.0f) {
        EXPECT_EQ(w_gpu[i], 0.0f) << i;
      }
    }
    EXPECT_NEAR(sums_gpu[0], sums_cpu[0], 1e-9 * std::abs(sums_cpu[0]));
    EXPECT_NEAR(sums_gpu[1], sums_cpu[1], 1e-9 * std::abs(sums_cpu[1]));
    std::vector<float> x_cpu = x;
    rows_scale_cpu(x_cpu.data(), w_gpu.data(), N * K, H);
    EXPECT_TRUE(same_bits(x_gpu, x_cpu));
  }
}

// The memory plan lets buffers of disjoint phases share bytes. If a phase set in model/step_plan
// were wrong, a buffer would be overwritten while still live and the step's results would change:
// the same step in the shared arena and in one where every buffer has its own bytes must agree
// bit for bit (target forward, drafter forward/backward, op scratch from the plan's pool).
TEST(TrainStepCuda, SharingTheArenaByPhaseChangesNoBit) {
  DFLASH_REQUIRE_GPU();
  const TargetModel target = TargetModel::load(assets_dir() / "tiny-qwen3");
  const ModelConfig& tc = target.config();
  DrafterSizes sizes;
  sizes.intermediate_size = 160;
  sizes.block_size = 4;
  const DrafterConfig c = drafter_config_for_target(tc, 2, sizes, 8000, std::vector<int>{1, 3});
  const DrafterLayout layout(c);
  HostBatch b = make_batch({{1, 40, 30}, {97}, {20, 20, 20}}, 97, tc.vocab_size, 4, 8, 5);
  const Staged s = stage(drafter_batch_of(b, 4), 8000, 16);
  const TrainMemoryPlan plan = plan_train_memory(tc, c, layout, TrainStepCapacity{s.T, s.N}, 139.0);
  ASSERT_GE(plan.NK, s.NK);
  double total_w = 0;
  for (float w : s.weights) total_w += w;
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, 9);
  const std::vector<float> zeros(params.size(), 0.0f);

  struct Out {
    DrafterCuda::Results r;
    std::vector<float> grads;
  };
  auto run = [&](const ArenaPlan& ap) {
    cuda::CudaContext ctx(0);
    cuda::DeviceArena arena(ctx, ap);
    TargetCuda tcu(ctx, target, plan.T, plan.target_layers, &arena);
    DrafterCuda dc(ctx, c, layout, plan.T, plan.NK, tcu.embed(), tcu.lm_head(), &arena);
    dc.upload_state(params, zeros, zeros);
    const uint64_t pool = arena.planned_bytes("workspace.op_scratch");
    ctx.allocator().use_pool(arena.get_bytes("workspace.op_scratch", pool), pool);
    auto put = [&](const char* name, const auto& v) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      T* d = arena.get<T>(name, static_cast<int64_t>(v.size()));
      DFLASH_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
      return d;
    };
    const int32_t* tokens = put("inputs.tokens", s.tokens);
    const AttnRange* tranges = put("inputs.target_ranges", s.context_ranges);
    DrafterCudaInputs in;
    in.T = s.T;
    in.NK = s.NK;
    in.features = dc.features();
    in.pos = put("inputs.pos", s.pos);
    in.block_tokens = put("inputs.block_tokens", s.block_tokens);
    in.ranges = put("inputs.block_ranges", s.block_ranges);
    in.labels = put("inputs.labels", s.labels);
    in.weights = put("inputs.weights", s.weights);
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());  // the pageable copies, before the ops' stream
    tcu.forward_taps(dc.features(), tokens, in.pos, tranges, s.T, c.target_layer_ids);
    dc.forward_backward(in, 1.0 / total_w);
    Out o;
    o.r = dc.fetch_results(s.NK);
    o.grads.resize(params.size());
    dc.download_grads(o.grads);
    return o;
  };
  const ArenaPlan unshared = arena_plan_without_sharing(plan.arena);
  ASSERT_LT(plan.arena.arena_bytes, unshared.arena_bytes);  // something does share
  const Out a = run(plan.arena), u = run(unshared);
  EXPECT_GT(a.r.weight_sum, 0);
  EXPECT_TRUE(std::isfinite(a.r.loss_sum));
  EXPECT_EQ(a.r.loss_sum, u.r.loss_sum);
  EXPECT_EQ(a.r.grad_norm, u.r.grad_norm);
  EXPECT_TRUE(same_bits(a.grads, u.grads));
  EXPECT_TRUE(same_bits(a.r.argmax, u.r.argmax));
}

// The drafter's backward either recomputes the activations the forward computes beyond what it
// saves, or keeps them from the forward (training.recompute, model/step_plan.hpp). Recomputing
// runs the forward's kernels on the forward's inputs, so both must give the same bits: loss,
// gradient norm, every parameter gradient and the argmax; and the keep plan's phase sets must hold
// (the same step in an arena where every buffer has its own bytes agrees too).
TEST(TrainStepCuda, KeepingTheForwardActivationsChangesNoBit) {
  DFLASH_REQUIRE_GPU();
  const TargetModel target = TargetModel::load(assets_dir() / "tiny-qwen3");
  const ModelConfig& tc = target.config();
  DrafterSizes sizes;
  sizes.intermediate_size = 160;
  sizes.block_size = 4;
  const DrafterConfig c = drafter_config_for_target(tc, 3, sizes, 8000, std::vector<int>{1, 3});
  const DrafterLayout layout(c);
  HostBatch b = make_batch({{1, 40, 30}, {97}, {20, 20, 20}}, 97, tc.vocab_size, 4, 8, 5);
  const Staged s = stage(drafter_batch_of(b, 4), 8000, 16);
  const TrainStepCapacity cap{s.T, s.N};
  double total_w = 0;
  for (float w : s.weights) total_w += w;
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, 11);
  const std::vector<float> zeros(params.size(), 0.0f);

  struct Out {
    DrafterCuda::Results r;
    std::vector<float> grads;
  };
  auto run = [&](const TrainMemoryPlan& plan, const ArenaPlan& ap) {
    cuda::CudaContext ctx(0);
    cuda::DeviceArena arena(ctx, ap);
    TargetCuda tcu(ctx, target, plan.T, plan.target_layers, &arena);
    DrafterCuda dc(ctx, c, layout, plan.T, plan.NK, tcu.embed(), tcu.lm_head(), &arena,
                   kDrafterCeChunkRows, plan.activations);
    dc.upload_state(params, zeros, zeros);
    const uint64_t pool = arena.planned_bytes("workspace.op_scratch");
    ctx.allocator().use_pool(arena.get_bytes("workspace.op_scratch", pool), pool);
    auto put = [&](const char* name, const auto& v) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      T* d = arena.get<T>(name, static_cast<int64_t>(v.size()));
      DFLASH_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
      return d;
    };
    const int32_t* tokens = put("inputs.tokens", s.tokens);
    const AttnRange* tranges = put("inputs.target_ranges", s.context_ranges);
    DrafterCudaInputs in;
    in.T = s.T;
    in.NK = s.NK;
    in.features = dc.features();
    in.pos = put("inputs.pos", s.pos);
    in.block_tokens = put("inputs.block_tokens", s.block_tokens);
    in.ranges = put("inputs.block_ranges", s.block_ranges);
    in.labels = put("inputs.labels", s.labels);
    in.weights = put("inputs.weights", s.weights);
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());  // the pageable copies, before the ops' stream
    tcu.forward_taps(dc.features(), tokens, in.pos, tranges, s.T, c.target_layer_ids);
    dc.forward_backward(in, 1.0 / total_w);
    Out o;
    o.r = dc.fetch_results(s.NK);
    o.grads.resize(params.size());
    dc.download_grads(o.grads);
    return o;
  };
  const TrainMemoryPlan recompute = plan_train_memory(
      tc, c, layout, cap, 139.0, kDrafterCeChunkRows, DrafterActivations::recompute);
  const TrainMemoryPlan keep =
      plan_train_memory(tc, c, layout, cap, 139.0, kDrafterCeChunkRows, DrafterActivations::keep);
  ASSERT_GE(recompute.NK, s.NK);
  ASSERT_NE(keep.arena.try_find("drafter.layers.2.act"), nullptr);
  const Out r = run(recompute, recompute.arena);
  const Out k = run(keep, keep.arena);
  const Out u = run(keep, arena_plan_without_sharing(keep.arena));
  EXPECT_GT(r.r.weight_sum, 0);
  EXPECT_TRUE(std::isfinite(r.r.loss_sum));
  for (const Out* o : {&k, &u}) {
    EXPECT_EQ(o->r.loss_sum, r.r.loss_sum);
    EXPECT_EQ(o->r.weight_sum, r.r.weight_sum);
    EXPECT_EQ(o->r.grad_norm, r.r.grad_norm);
    EXPECT_TRUE(same_bits(o->grads, r.grads));
    EXPECT_TRUE(same_bits(o->r.argmax, r.r.argmax));
  }
}
