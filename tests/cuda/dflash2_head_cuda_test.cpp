// DFlash2's selector and loss on CUDA (model/dflash2_head_cuda.hpp) against the CPU's
// dflash2_head_step on the same bf16-rounded hidden states and LM head: the five sums, argmax, dhf
// and the gradients of A, Bs and P_h, with and without output_multiplier and softcap, with and
// without stop_gradient; two runs give the same bits. (The predecessor index and the plan: the
// CPU test tests/dflash2_plan_test.cpp.)
#include "model/dflash2_head_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <random>

#include "backend/cuda/context.hpp"
#include "cuda/cuda_test_util.hpp"
#include "model/dflash2_selector.hpp"
#include "model/drafter_batch.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

size_t sz(int64_t n) {
  return static_cast<size_t>(n);
}

DrafterConfig config(double m, double cap) {
  DrafterConfig c;
  c.hidden_size = 96;
  c.intermediate_size = 160;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.vocab_size = 301;
  c.rope.theta = 10000.0;
  c.block_size = 4;
  c.mask_token_id = 300;
  c.target_layer_ids = {0};
  c.num_target_layers = 2;
  c.dflash2 = {true, 2, 32, 5, 64, m, cap};  // top-64 of 301: about a fifth of the golds are candidates
  c.validate();
  return c;
}

// Rows of documents with a ~70 % loss mask and up to 6 anchors each, as one dflash2 batch.
DrafterBatch make_batch(const DrafterConfig& c, const Objective& obj, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab_size) - 2);
  std::bernoulli_distribution bit(0.7);
  Rng arng(seed);
  DrafterBatch b(c.block_size);
  b.objective = obj;
  for (const std::vector<int>& docs : {std::vector<int>{1, 30, 17}, {61}, {5, 12}}) {
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

template <typename T>
T* device_copy(cuda::CudaContext& ctx, std::vector<cuda::DeviceBuffer>& keep,
               const std::vector<T>& h) {
  keep.push_back(ctx.scratch(std::max<size_t>(h.size(), 1) * sizeof(T)));
  DFLASH_CUDA_CHECK(
      cudaMemcpy(keep.back().data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return keep.back().as<T>();
}

template <typename T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
  DFLASH_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

void run(double m, double cap, bool stop, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "m=" << m << " cap=" << cap << " stop=" << stop);
  const DrafterConfig c = config(m, cap);
  const DrafterLayout layout(c);
  Objective obj;
  obj.kind = ObjectiveKind::dflash2;
  obj.dflash2_selector_alpha = 0.7;
  obj.dflash2_stop_gradient = stop;
  const DrafterBatch b = make_batch(c, obj, seed);
  const int64_t R = b.N() * c.block_size, H = c.hidden_size, V = c.vocab_size;
  std::vector<float> params(sz(layout.total));
  const std::vector<float> noise = randn(params.size(), seed + 1, 0.3f);
  for (size_t k = 0; k < params.size(); ++k) params[k] = noise[k];
  const std::vector<float> hf = round_bf16(randn(sz(R * H), seed + 2, 1.0f));
  const std::vector<float> head = round_bf16(randn(sz(V * H), seed + 3, 0.3f));
  const double gs = 1.0 / b.weight_sum;
  // CPU.
  std::vector<float> cpu_grads(params.size(), 0.0f), cpu_dhf(sz(R * H));
  std::vector<int32_t> cpu_argmax(sz(R));
  Dflash2Workspace<float> ws;
  const Dflash2Sums cs =
      dflash2_head_step<float>(c, layout, params.data(), cpu_grads.data(), head.data(), b,
                               hf.data(), gs, cpu_dhf.data(), cpu_argmax.data(), ws);
  ASSERT_GT(cs.in_topk_weight, 0.0);
  ASSERT_LT(cs.in_topk_weight, cs.weight_sum);  // some golds outside the candidates
  // CUDA.
  cuda::CudaContext ctx(0);
  std::vector<cuda::DeviceBuffer> keep;
  const std::vector<float> zeros(params.size(), 0.0f);
  Dflash2CudaArgs a;
  a.R = R;
  a.params = device_copy(ctx, keep, params);
  a.lm_head = device_copy(ctx, keep, to_bf16(head));
  a.hf = device_copy(ctx, keep, to_bf16(hf));
  a.labels = device_copy(ctx, keep, b.targets.labels);
  a.weights = device_copy(ctx, keep, b.targets.weights);
  a.prev = device_copy(ctx, keep, dflash2_prev_tokens(b, R, V));
  a.alpha = device_copy(ctx, keep, std::vector<double>{obj.dflash2_selector_alpha});
  a.dhf = device_copy(ctx, keep, std::vector<float>(sz(R * H), 0.0f));
  a.argmax = device_copy(ctx, keep, std::vector<int32_t>(sz(R), 0));
  a.sums = device_copy(ctx, keep, std::vector<double>(5, 0.0));
  a.chunk_rows = 16;  // several chunks
  a.workspace_bytes = dflash2_head_cuda_workspace_bytes(c, R, a.chunk_rows);
  a.rows_bytes = dflash2_head_cuda_rows_bytes(c, R);
  keep.push_back(ctx.scratch(a.workspace_bytes));
  a.workspace = keep.back().data();
  keep.push_back(ctx.scratch(a.rows_bytes));
  a.rows = keep.back().data();
  a.grad_scale = gs;
  std::vector<float> grads[2];
  std::vector<float> dhf[2];
  for (int k = 0; k < 2; ++k) {
    float* g = device_copy(ctx, keep, zeros);
    a.grads = g;
    dflash2_head_cuda(ctx, c, layout, obj, a);
    grads[k] = download(g, params.size());
    dhf[k] = download(a.dhf, sz(R * H));
  }
  EXPECT_TRUE(same_bits(grads[0], grads[1]));
  EXPECT_TRUE(same_bits(dhf[0], dhf[1]));
  const std::vector<double> sums = download(a.sums, 5);
  EXPECT_NEAR(sums[0], cs.base_sum, 1e-4 * cs.base_sum);
  EXPECT_NEAR(sums[1], cs.weight_sum, 1e-9 * cs.weight_sum);
  EXPECT_NEAR(sums[2], cs.selector_sum, 1e-3 * cs.selector_sum);
  EXPECT_NEAR(sums[3], cs.in_topk_weight, 1e-6 * cs.in_topk_weight);
  EXPECT_NEAR(sums[4], cs.loss_sum, 1e-4 * cs.loss_sum);
  const std::vector<int32_t> argmax = download(a.argmax, sz(R));
  for (int64_t i = 0; i < R; ++i) {  // supervised rows (the CPU also fills counted rows of w 0)
    if (b.targets.weights[sz(i)] != 0.0f) {
      EXPECT_EQ(argmax[sz(i)], cpu_argmax[sz(i)]) << i;
    }
  }
  EXPECT_LT(rel_error(dhf[0], cpu_dhf), 1e-2);
  const Dflash2Offsets& o = layout.dflash2;
  const int64_t Vr = V * c.dflash2.selector_rank;
  for (auto [name, off, n] : {std::tuple{"A", o.predecessor, Vr},
                              {"Bs", o.successor, Vr},
                              {"P_h", o.hidden_proj, c.dflash2.selector_rank * H}}) {
    const std::vector<float> g(grads[0].begin() + off, grads[0].begin() + off + n);
    const std::vector<float> h(cpu_grads.begin() + off, cpu_grads.begin() + off + n);
    EXPECT_LT(rel_error(g, h), 1e-3) << name;
    EXPECT_TRUE(std::any_of(h.begin(), h.end(), [](float x) { return x != 0.0f; })) << name;
  }
}

}  // namespace

TEST(Dflash2HeadCuda, MatchesCpuSelectorStep) {
  DFLASH_REQUIRE_GPU();
  run(1.0, 0.0, false, 3);
  run(0.8, 5.0, false, 4);
  run(1.0, 0.0, true, 5);
}
