// The CUDA Domino head (src/model/domino_head_cuda) against the CPU reference domino_head_step on
// the same bf16-rounded inputs: V not a multiple of any tile, odd E and G, both shift_label
// settings and pure_draft_prefix_len 0, 1 and 2, λ strictly inside (0, 1), rows with weight 0
// (a masked token, slots past a document's end and padding blocks after the batch), chunks that
// do not divide the rows; guard bytes; and two runs giving the same bits.
#include "model/domino_head_cuda.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "model/domino_head.hpp"
#include "model/drafter.hpp"
#include "util/head_problem.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

// Tolerances of the Domino head (relative Frobenius error, tolerances.hpp's convention). Both
// sides read the same bf16 weights, tables and hf; the GPU also rounds the GRU state g to bf16 at
// the GEMM inputs (HH and the head's [h; g]) where the CPU keeps it fp32, and its backward GEMMs
// read bf16 dU, dF, dA, dxi, dhh (as the fused CE's d_hidden, tol::kCeGrad).
constexpr double kSumU = 1e-4;  // Σ w·CE(U): the same bf16 GEMM inputs, fp32 softmax per row
constexpr double kSumF = 2e-3;  // Σ w·CE(F) and the loss: F reads the bf16-rounded state
constexpr double kDhf = 2e-2;   // dU·LMhead (kCeGrad) plus the head's dA·W1
constexpr double kHead = 3e-2;  // W1, W2: dF, dA bf16 and the bf16 state in dW1
constexpr double kGru = 3e-2;   // W_ih, W_hh: back through time on bf16 dxi, dhh and g

struct HeadOpts {
  bool shift = false;
  int prefix = 0;
  int64_t E = 7, G = 5;
};

// A Domino problem with every value already bf16 (so the CPU and the GPU read the same inputs):
// one row of three documents, anchors everywhere (some blocks run past their document's end), a
// masked token, `pad_blocks` padding blocks after the batch's block rows.
struct Problem {
  DrafterConfig cfg;
  std::shared_ptr<DrafterLayout> layout;
  std::vector<float> params, embed, head, hf;
  DrafterBatch batch{4};
  int64_t NK = 0, R = 0;
};

Problem make_problem(uint32_t seed, HeadOpts h, int K, int64_t H, int64_t V, int64_t pad_blocks) {
  Problem p;
  Rng rng(seed);
  p.cfg = head_test_config(H, V, K);
  p.cfg.domino.enabled = true;
  p.cfg.domino.emb_dim = h.E;
  p.cfg.domino.gru_hidden_dim = h.G;
  p.cfg.domino.pure_draft_prefix_len = h.prefix;
  p.cfg.domino.shift_label = h.shift;
  p.cfg.validate();
  p.layout = std::make_shared<DrafterLayout>(p.cfg);
  p.params = head_test_params(*p.layout, rng);
  p.embed = round_bf16(randn(static_cast<size_t>(V * H), seed + 1, 0.5f));
  p.head = round_bf16(randn(static_cast<size_t>(V * H), seed + 2, 0.2f));
  const HeadTestRow row = head_test_row();
  std::vector<int32_t> tokens(static_cast<size_t>(row.T()));
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V - 1)));
  p.batch = DrafterBatch(K);
  p.batch.objective.kind = ObjectiveKind::domino;
  p.batch.objective.domino_lambda = 0.3;
  p.batch.objective.domino_shift_label = h.shift;
  head_test_append_row(
      p.batch, tokens, row,
      domino_block_targets(tokens, row.mask, row.docs, row.anchors, K, 4.0, h.shift));
  p.NK = p.batch.N() * K;
  p.R = p.NK + pad_blocks * K;
  p.hf = round_bf16(randn(static_cast<size_t>(p.R * H), seed + 3));
  return p;
}

// What one GPU step gives back.
struct GpuOut {
  std::vector<float> grads, dhf, ce_f, ce_u;
  std::vector<double> sums;
  std::vector<int32_t> argmax;
};

GpuOut run_gpu(const Problem& p, int64_t chunk_rows) {
  cuda::CudaContext ctx(0);
  const DominoRowIndex idx = domino_row_index(p.cfg, p.batch, p.R);
  const HeadTestTargets targets = head_test_targets(p.batch, p.R);
  DeviceGuarded<float> grads(p.params.size()), w(targets.weights);
  DeviceGuarded<uint16_t> wbf(to_bf16(p.params)), emb(to_bf16(p.embed)), head(to_bf16(p.head)),
      hf(to_bf16(p.hf));
  DeviceGuarded<int32_t> lab(targets.labels), tok(idx.gru_tok), argmax(static_cast<size_t>(p.R));
  DeviceGuarded<float> dhf(static_cast<size_t>(p.R * p.cfg.hidden_size));
  DeviceGuarded<double> sums(4), lambda(std::vector<double>{idx.lambda});
  const uint64_t ws_bytes = domino_head_cuda_workspace_bytes(p.cfg, p.R, chunk_rows);
  const uint64_t rows_bytes = domino_head_cuda_rows_bytes(p.R);
  DeviceGuarded<uint8_t> ws(ws_bytes), rows(rows_bytes);
  grads.upload(std::vector<float>(p.params.size(), 0.0f));
  DominoCudaArgs a;
  a.R = p.R;
  a.weights_bf16 = wbf.get();
  a.grads = grads.get();
  a.embed = emb.get();
  a.lm_head = head.get();
  a.hf = hf.get();
  a.labels = lab.get();
  a.weights = w.get();
  a.gru_tok = tok.get();
  a.lambda = lambda.get();
  a.dhf = dhf.get();
  a.argmax = argmax.get();
  a.sums = sums.get();
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  a.rows = rows.get();
  a.rows_bytes = rows_bytes;
  a.grad_scale = 1.0 / p.batch.weight_sum;
  a.chunk_rows = chunk_rows;
  domino_head_cuda(ctx, p.cfg, *p.layout, p.batch.objective, a);
  ctx.synchronize();
  GpuOut o;
  o.grads = grads.download();
  o.dhf = dhf.download();
  o.sums = sums.download();
  o.argmax = argmax.download();
  const auto rb = rows.download();
  const DominoRowsView v = domino_rows_view(rb.data(), p.R);
  o.ce_f.assign(v.ce_f, v.ce_f + p.R);
  o.ce_u.assign(v.ce_u, v.ce_u + p.R);
  EXPECT_TRUE(grads.guard_intact() && dhf.guard_intact() && argmax.guard_intact() &&
              sums.guard_intact() && ws.guard_intact() && rows.guard_intact());
  return o;
}

// Relative error of `got` against `want`, printed (the measured figures of the tolerance table)
// and checked against `tol`.
void expect_close(const char* what, const std::vector<float>& got, const std::vector<float>& want,
                  double tol) {
  const double e = rel_error(got, want);
  std::printf("  %-8s rel error %.3g (tolerance %.3g)\n", what, e, tol);
  EXPECT_LT(e, tol) << what;
}
void expect_sum(const char* what, double got, double want, double tol) {
  const double e = std::abs(got - want) / std::max(std::abs(want), 1e-30);
  std::printf("  %-8s rel error %.3g (tolerance %.3g)\n", what, e, tol);
  EXPECT_LT(e, tol) << what << ": " << got << " vs " << want;
}

void check_parity(const Problem& p, int64_t chunk_rows) {
  const DominoHead& dm = p.cfg.domino;
  std::printf("shift_label %d P %d E %ld G %ld K %d V %ld chunk %ld\n", dm.shift_label,
              dm.pure_draft_prefix_len, static_cast<long>(dm.emb_dim),
              static_cast<long>(dm.gru_hidden_dim), p.cfg.block_size,
              static_cast<long>(p.cfg.vocab_size), static_cast<long>(chunk_rows));
  SCOPED_TRACE(::testing::Message()
               << "shift=" << dm.shift_label << " P=" << dm.pure_draft_prefix_len
               << " E=" << dm.emb_dim << " G=" << dm.gru_hidden_dim << " K=" << p.cfg.block_size
               << " V=" << p.cfg.vocab_size << " chunk=" << chunk_rows);
  const int64_t H = p.cfg.hidden_size, V = p.cfg.vocab_size;
  // CPU reference.
  std::vector<float> grads(p.params.size(), 0.0f), dhf(static_cast<size_t>(p.NK * H));
  std::vector<int32_t> argmax(static_cast<size_t>(p.NK));
  DominoWorkspace<float> ws;
  const DrafterTables<float> tables{p.embed.data(), p.head.data()};
  const DominoSums ref =
      domino_head_step<float>(p.cfg, *p.layout, p.params.data(), grads.data(), tables, p.batch,
                              p.hf.data(), 1.0 / p.batch.weight_sum, dhf.data(), argmax.data(), ws);
  const std::vector<float> logits = domino_block_logits<float>(p.cfg, *p.layout, p.params.data(),
                                                               tables, p.batch, p.hf.data(), ws);
  const GpuOut g = run_gpu(p, chunk_rows);
  ASSERT_GT(ref.weight_sum, 0.0);
  EXPECT_NEAR(g.sums[1], ref.weight_sum, 1e-12 * ref.weight_sum);
  expect_sum("loss", g.sums[0], ref.loss_sum, kSumF);
  expect_sum("ce_f", g.sums[2], ref.final_ce_sum, kSumF);
  expect_sum("ce_u", g.sums[3], ref.base_ce_sum, kSumU);
  // Rows: argmax F where the CPU's top two are apart; −1 and CE 0 on unsupervised rows.
  int compared = 0, supervised = 0;
  for (int64_t i = 0; i < p.R; ++i) {
    const auto k = static_cast<size_t>(i);
    const bool sup = i < p.NK && p.batch.targets.weights[k] != 0.0f;
    if (!sup) {
      EXPECT_EQ(g.argmax[k], -1) << "row " << i;
      EXPECT_EQ(g.ce_f[k], 0.0f) << "row " << i;
      continue;
    }
    ++supervised;
    if (!head_test_top_two_apart(logits, i, V, 1e-2f)) continue;
    ++compared;
    EXPECT_EQ(g.argmax[k], argmax[k]) << "row " << i;
  }
  EXPECT_GT(compared, supervised / 2);
  // dhf: the batch's rows, then exact zeros on the padding rows.
  expect_close("dhf", head_test_slice(g.dhf, 0, p.NK * H), dhf, kDhf);
  ASSERT_NO_FATAL_FAILURE(head_test_expect_zero_from(g.dhf, p.NK * H, "dhf"));
  // Parameter gradients: the head's tensors; every other parameter untouched (0).
  const DominoOffsets& o = p.layout->domino;
  const int64_t G = dm.gru_hidden_dim, E = dm.emb_dim;
  struct Tensor {
    const char* name;
    int64_t offset, numel;
    double tol;
  };
  const Tensor heads[] = {{"W_ih", o.gru_ih, 3 * G * H, kGru},
                          {"W_hh", o.gru_hh, 3 * G * G, kGru},
                          {"W1", o.proj1, E * (H + G), kHead},
                          {"W2", o.proj2, V * E, kHead}};
  std::vector<uint8_t> is_head(p.params.size(), 0);
  for (const Tensor& t : heads) {
    const std::vector<float> want = head_test_slice(grads, t.offset, t.numel);
    double norm = 0;
    for (float x : want) norm += static_cast<double>(x) * x;
    EXPECT_GT(norm, 0.0) << t.name << ": the CPU gradient is 0 (the test would not see it)";
    expect_close(t.name, head_test_slice(g.grads, t.offset, t.numel), want, t.tol);
    std::fill_n(is_head.begin() + t.offset, t.numel, 1);
  }
  ASSERT_NO_FATAL_FAILURE(head_test_expect_untouched_zero(g.grads, is_head));
}

}  // namespace

TEST(DominoHeadCuda, MatchesTheCpuStep) {
  DFLASH_REQUIRE_GPU();
  // shift_label false / true, P 0..2, odd E and G, odd K, V off every tile, several chunks.
  check_parity(make_problem(1, {false, 0, 7, 5}, 4, 64, 1003, 2), 10);
  check_parity(make_problem(2, {true, 1, 7, 5}, 4, 64, 1003, 2), 10);
  check_parity(make_problem(3, {false, 1, 33, 17}, 5, 64, 517, 1), 64);
  check_parity(make_problem(4, {true, 2, 16, 9}, 5, 128, 3001, 0), 7);
  check_parity(make_problem(5, {true, 0, 9, 31}, 4, 64, 1000, 3), 1024);
}

TEST(DominoHeadCuda, TwoRunsGiveTheSameBits) {
  DFLASH_REQUIRE_GPU();
  const Problem p = make_problem(6, {true, 1, 7, 5}, 4, 64, 1003, 2);
  const GpuOut a = run_gpu(p, 12), b = run_gpu(p, 12);
  EXPECT_TRUE(same_bits(a.grads, b.grads));
  EXPECT_TRUE(same_bits(a.dhf, b.dhf));
  EXPECT_TRUE(same_bits(a.sums, b.sums));
  EXPECT_TRUE(same_bits(a.argmax, b.argmax));
  EXPECT_TRUE(same_bits(a.ce_f, b.ce_f));
  EXPECT_TRUE(same_bits(a.ce_u, b.ce_u));
}

TEST(DominoHeadCuda, RefusesABatchOfAnotherShiftLabel) {
  DFLASH_REQUIRE_GPU();
  Problem p = make_problem(7, {false, 0, 7, 5}, 4, 64, 517, 0);
  p.batch.objective.domino_shift_label = true;
  try {
    run_gpu(p, 16);
    ADD_FAILURE() << "no error for a batch of another shift_label";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shift_label"), std::string::npos) << e.what();
  }
}
