// The CUDA DSpark head (src/model/dspark_head_cuda) against the CPU reference dspark_head_step on
// the same bf16-rounded inputs: V not a multiple of any tile, Markov rank 0, 3, 5 and 8 of each
// head type (vanilla, gated, rnn), the confidence head with and without the Markov input, rows
// with weight 0 (masked slots, slots past a document's end and padding rows after the batch),
// chunks that do not divide the rows (the rnn head's rounded down to whole blocks); guard bytes;
// two runs giving the same bits; the rnn head refusing rows that are not whole blocks.
#include "model/dspark_head_cuda.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "model/drafter.hpp"
#include "model/dspark_head.hpp"
#include "util/head_problem.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

// Tolerances of the DSpark head (relative Frobenius error, tolerances.hpp's convention): the
// sums and row statistics are fp32 per row (the CPU's are double from fp32 logits); every
// gradient goes through the bf16 dD GEMMs, as the fused CE's d_hidden (tol::kCeGrad).
constexpr double kSums = 1e-4;
constexpr double kRowStats = 1e-4;
constexpr double kGrads = tol::kCeGrad;

struct Heads {
  int rank = 0;
  bool conf = false, conf_markov = false;
  MarkovHeadType type = MarkovHeadType::vanilla;
};

// A DSpark problem with every value already bf16 (so the CPU and the GPU read the same inputs):
// one row of three documents, anchors everywhere (some blocks run past their document's end),
// a masked token, `pad` padding rows after the batch's block rows.
struct Problem {
  DrafterConfig cfg;
  std::shared_ptr<DrafterLayout> layout;
  std::vector<float> params, head, hf, final_hidden;
  DrafterBatch batch{4};
  Objective obj;
  int64_t T = 0, NK = 0, R = 0;
};

Problem make_problem(uint32_t seed, Heads h, int64_t H, int64_t V, int64_t pad) {
  Problem p;
  Rng rng(seed);
  const int K = 4;
  p.cfg = head_test_config(H, V, K);
  p.cfg.dspark.enabled = true;
  p.cfg.dspark.markov_rank = h.rank;
  p.cfg.dspark.confidence_head = h.conf;
  p.cfg.dspark.confidence_with_markov = h.conf_markov;
  p.cfg.dspark.markov_type = h.type;
  p.cfg.validate();
  p.layout = std::make_shared<DrafterLayout>(p.cfg);
  p.params = head_test_params(*p.layout, rng);
  p.head = round_bf16(randn(static_cast<size_t>(V * H), seed + 1, 0.2f));
  const HeadTestRow row = head_test_row();
  p.T = row.T();
  std::vector<int32_t> tokens(static_cast<size_t>(p.T));
  // Few distinct tokens, so W1's rows collect several rows each.
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.below(11) * 7 % (V - 1));
  p.batch.objective.kind = ObjectiveKind::dspark;
  head_test_append_row(p.batch, tokens, row,
                       dspark_block_targets(tokens, row.mask, row.docs, row.anchors, K, 4.0));
  p.NK = p.batch.N() * K;
  p.R = p.NK + pad;
  p.hf = round_bf16(randn(static_cast<size_t>(p.R * H), seed + 2));
  p.final_hidden = round_bf16(randn(static_cast<size_t>(p.T * H), seed + 3));
  p.obj.kind = ObjectiveKind::dspark;
  p.obj.dspark_ce_alpha = 0.3;
  p.obj.dspark_l1_alpha = 0.9;
  p.obj.dspark_conf_alpha = 0.7;
  return p;
}

// What one GPU step gives back.
struct GpuOut {
  std::vector<float> grads, dhf;
  std::vector<double> sums;
  std::vector<int32_t> argmax;
  std::vector<float> acc, conf, ce;
};

GpuOut run_gpu(const Problem& p, int64_t chunk_rows) {
  cuda::CudaContext ctx(0);
  const DsparkRowIndex idx = dspark_row_index(p.batch, p.R, p.cfg.vocab_size);
  const HeadTestTargets targets = head_test_targets(p.batch, p.R);
  DeviceGuarded<float> params(p.params), grads(p.params.size()), w(targets.weights);
  DeviceGuarded<uint16_t> wbf(to_bf16(p.params)), head(to_bf16(p.head)), hf(to_bf16(p.hf)),
      fin(to_bf16(p.final_hidden));
  DeviceGuarded<int32_t> lab(targets.labels), prev(idx.prev), tpos(idx.teacher_pos),
      order(idx.w1_order), seg(idx.w1_seg), argmax(static_cast<size_t>(p.R));
  DeviceGuarded<float> dhf(static_cast<size_t>(p.R * p.cfg.hidden_size));
  DeviceGuarded<double> sums(6);
  const uint64_t ws_bytes = dspark_head_cuda_workspace_bytes(p.cfg, p.R, chunk_rows);
  const uint64_t rows_bytes = dspark_head_cuda_rows_bytes(p.cfg, p.R);
  DeviceGuarded<uint8_t> ws(ws_bytes), rows(rows_bytes);
  grads.upload(std::vector<float>(p.params.size(), 0.0f));
  DsparkCudaArgs a;
  a.R = p.R;
  a.params = params.get();
  a.weights_bf16 = wbf.get();
  a.grads = grads.get();
  a.lm_head = head.get();
  a.hf = hf.get();
  a.target_final = fin.get();
  a.labels = lab.get();
  a.weights = w.get();
  a.prev = prev.get();
  a.teacher_pos = tpos.get();
  a.w1_order = order.get();
  a.w1_seg = seg.get();
  a.dhf = dhf.get();
  a.argmax = argmax.get();
  a.sums = sums.get();
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  a.rows = rows.get();
  a.rows_bytes = rows_bytes;
  a.grad_scale = 1.0 / p.batch.weight_sum;
  a.chunk_rows = chunk_rows;
  dspark_head_cuda(ctx, p.cfg, *p.layout, p.obj, a);
  ctx.synchronize();
  GpuOut o;
  o.grads = grads.download();
  o.dhf = dhf.download();
  o.sums = sums.download();
  o.argmax = argmax.download();
  const auto rb = rows.download();
  const DsparkRowsView v = dspark_rows_view(p.cfg, rb.data(), p.R);
  o.acc.assign(v.acc, v.acc + p.R);
  o.conf.assign(v.conf, v.conf + p.R);
  o.ce.assign(v.ce, v.ce + p.R);
  EXPECT_TRUE(grads.guard_intact() && dhf.guard_intact() && argmax.guard_intact() &&
              sums.guard_intact() && ws.guard_intact() && rows.guard_intact());
  return o;
}

void check_parity(const Problem& p, int64_t chunk_rows) {
  SCOPED_TRACE(::testing::Message()
               << markov_head_type_name(p.cfg.dspark.markov_type)
               << " r=" << p.cfg.dspark.markov_rank << " conf=" << p.cfg.dspark.confidence_head
               << " markov_conf=" << p.cfg.dspark.confidence_with_markov
               << " V=" << p.cfg.vocab_size << " chunk=" << chunk_rows);
  const int64_t H = p.cfg.hidden_size, V = p.cfg.vocab_size, r = p.cfg.dspark.markov_rank;
  // CPU reference.
  std::vector<float> grads(p.params.size(), 0.0f), dhf(static_cast<size_t>(p.NK * H));
  std::vector<int32_t> argmax(static_cast<size_t>(p.NK));
  DsparkWorkspace<float> ws;
  const DsparkSums ref = dspark_head_step<float>(
      p.cfg, *p.layout, p.params.data(), grads.data(), p.head.data(), p.batch, p.hf.data(),
      p.final_hidden.data(), 1.0 / p.batch.weight_sum, dhf.data(), argmax.data(), p.obj, ws);
  const std::vector<float> logits = dspark_block_logits<float>(
      p.cfg, *p.layout, p.params.data(), p.head.data(), p.batch, p.hf.data(), ws);
  const GpuOut g = run_gpu(p, chunk_rows);
  ASSERT_GT(ref.weight_sum, 0.0);
  EXPECT_NEAR(g.sums[1], ref.weight_sum, 1e-12 * ref.weight_sum);
  EXPECT_NEAR(g.sums[0], ref.loss_sum, kSums * std::abs(ref.loss_sum));
  EXPECT_NEAR(g.sums[2], ref.ce_sum, kSums * std::abs(ref.ce_sum));
  EXPECT_NEAR(g.sums[3], ref.l1_sum, kSums * std::abs(ref.l1_sum));
  EXPECT_NEAR(g.sums[4], ref.bce_sum, kSums * std::abs(ref.bce_sum) + 1e-12);
  EXPECT_NEAR(g.sums[5], ref.acc_sum, kSums * std::abs(ref.acc_sum));
  // Rows: acc and the confidence logit; argmax where the CPU's top two are apart.
  std::vector<float> acc_ref, acc_gpu, conf_ref, conf_gpu;
  int compared = 0;
  for (int64_t i = 0; i < p.R; ++i) {
    const auto k = static_cast<size_t>(i);
    const bool sup = i < p.NK && p.batch.targets.weights[k] != 0.0f;
    if (!sup) {
      EXPECT_EQ(g.argmax[k], -1) << "row " << i;
      EXPECT_TRUE(std::isnan(g.acc[k])) << "row " << i;
      continue;
    }
    acc_ref.push_back(static_cast<float>(ref.acc[k]));
    acc_gpu.push_back(g.acc[k]);
    if (p.cfg.dspark.confidence_head) {
      conf_ref.push_back(static_cast<float>(ref.conf[k]));
      conf_gpu.push_back(g.conf[k]);
    } else {
      EXPECT_TRUE(std::isnan(g.conf[k])) << "row " << i;
    }
    if (!head_test_top_two_apart(logits, i, V, 1e-3f)) continue;
    ++compared;
    EXPECT_EQ(g.argmax[k], argmax[k]) << "row " << i;
  }
  EXPECT_GT(compared, static_cast<int>(acc_ref.size()) / 2);
  EXPECT_LT(rel_error(acc_gpu, acc_ref), kRowStats);
  if (p.cfg.dspark.confidence_head) {
    EXPECT_LT(rel_error(conf_gpu, conf_ref), kRowStats);
  }
  // dhf: the batch's rows, then exact zeros on the padding rows.
  EXPECT_LT(rel_error(head_test_slice(g.dhf, 0, p.NK * H), dhf), kGrads);
  ASSERT_NO_FATAL_FAILURE(head_test_expect_zero_from(g.dhf, p.NK * H, "dhf"));
  // Parameter gradients: the heads' tensors; every other parameter untouched (0).
  const DsparkOffsets& o = p.layout->dspark;
  std::vector<std::pair<int64_t, int64_t>> heads;
  if (r > 0) {
    heads.push_back({o.markov_w1, V * r});
    heads.push_back({o.markov_w2, V * r});
  }
  if (o.gate_w >= 0) {
    heads.push_back({o.gate_w, r * (H + r)});
    heads.push_back({o.gate_b, r});
  }
  if (o.joint_w >= 0) {
    heads.push_back({o.joint_w, 3 * r * (2 * r + H)});
    heads.push_back({o.joint_b, 3 * r});
  }
  if (p.cfg.dspark.confidence_head) {
    heads.push_back({o.conf_w, p.cfg.dspark.confidence_in(H)});
    heads.push_back({o.conf_b, 1});
  }
  std::vector<uint8_t> is_head(p.params.size(), 0);
  for (auto [off, n] : heads) {
    SCOPED_TRACE(::testing::Message() << "parameter at offset " << off);
    EXPECT_LT(rel_error(head_test_slice(g.grads, off, n), head_test_slice(grads, off, n)), kGrads);
    std::fill_n(is_head.begin() + off, n, 1);
  }
  ASSERT_NO_FATAL_FAILURE(head_test_expect_untouched_zero(g.grads, is_head));
}

}  // namespace

TEST(DsparkHeadCuda, MatchesTheCpuStep) {
  DFLASH_REQUIRE_GPU();
  check_parity(make_problem(1, {0, false, false}, 64, 1003, 8), 10);
  check_parity(make_problem(2, {3, true, true}, 64, 1003, 8), 10);
  check_parity(make_problem(3, {0, true, false}, 72, 517, 4), 64);
  check_parity(make_problem(4, {8, true, false}, 128, 3001, 0), 7);
  check_parity(make_problem(5, {8, false, false}, 64, 1000, 12), 1024);
}

// The gated head σ(Wg·[h ; e] + bg) ⊙ e: odd V and H + r, several chunks, padding rows.
TEST(DsparkHeadCuda, GatedHeadMatchesTheCpuStep) {
  DFLASH_REQUIRE_GPU();
  const MarkovHeadType g = MarkovHeadType::gated;
  check_parity(make_problem(11, {3, true, true, g}, 64, 1003, 8), 10);
  check_parity(make_problem(12, {8, false, false, g}, 72, 517, 4), 7);
  check_parity(make_problem(13, {5, true, false, g}, 128, 3001, 0), 1024);
}

// The rnn head: its state runs through each block's slots (chunks of whole blocks: 10 → 8 and
// 7 → 4 rows at K = 4, and one chunk of all rows), padding blocks after the batch.
TEST(DsparkHeadCuda, RnnHeadMatchesTheCpuStep) {
  DFLASH_REQUIRE_GPU();
  const MarkovHeadType n = MarkovHeadType::rnn;
  check_parity(make_problem(21, {3, true, true, n}, 64, 1003, 8), 10);
  check_parity(make_problem(22, {8, true, false, n}, 128, 3001, 0), 7);
  check_parity(make_problem(23, {5, false, false, n}, 72, 1000, 12), 1024);
}

TEST(DsparkHeadCuda, TwoRunsGiveTheSameBits) {
  DFLASH_REQUIRE_GPU();
  for (MarkovHeadType t : {MarkovHeadType::vanilla, MarkovHeadType::gated, MarkovHeadType::rnn}) {
    SCOPED_TRACE(markov_head_type_name(t));
    const Problem p = make_problem(6, {3, true, true, t}, 64, 1003, 8);
    const GpuOut a = run_gpu(p, 12), b = run_gpu(p, 12);
    EXPECT_TRUE(same_bits(a.grads, b.grads));
    EXPECT_TRUE(same_bits(a.dhf, b.dhf));
    EXPECT_TRUE(same_bits(a.sums, b.sums));
    EXPECT_TRUE(same_bits(a.argmax, b.argmax));
    EXPECT_TRUE(same_bits(a.acc, b.acc));
    EXPECT_TRUE(same_bits(a.conf, b.conf));
    EXPECT_TRUE(same_bits(a.ce, b.ce));
  }
}

// The rnn head's state runs through whole blocks: rows that end inside a block are refused by
// name, not computed with a truncated block.
TEST(DsparkHeadCuda, RnnHeadRefusesRowsThatAreNotWholeBlocks) {
  DFLASH_REQUIRE_GPU();
  const Problem p = make_problem(7, {3, false, false, MarkovHeadType::rnn}, 64, 517, 2);
  try {
    run_gpu(p, 16);
    ADD_FAILURE() << "no error for " << p.R << " rows at block_size 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the rnn Markov head runs whole blocks"),
              std::string::npos)
        << e.what();
  }
}
