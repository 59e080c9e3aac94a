// The cuDNN causal prefill (src/ops/attention_cudnn.hpp) vs the CPU reference (fp32 on the same
// bf16-rounded inputs) at odd shapes: document lengths that are multiples of no tile, one-row
// documents, GQA ratios 1 and 4, head_dim 64 and 128, more document slots than documents; guard
// bytes; deterministic (two runs, identical bits); replayed from a CUDA graph with the same bits;
// bad shapes and inputs rejected by name (host errors, device traps in a child process).
#include <gmock/gmock.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "backend/cuda/context.hpp"
#include "backend/cuda/graph.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "ops/attention_cudnn.hpp"
#include "util/attention_cases.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;

namespace {

/// Random bf16 q, k, v of a case, its CPU reference output and the device copies.
struct Inputs {
  AttnCase c;
  std::vector<uint16_t> q, k, v;
  std::vector<float> o_ref;
  DeviceGuarded<uint16_t> dq, dk, dv;
  DeviceGuarded<AttnRange> dr;
  Inputs(AttnCase cs, uint32_t seed)
      : c(std::move(cs)),
        q(to_bf16(randn(static_cast<size_t>(c.Tq * c.NH * c.D), seed))),
        k(to_bf16(randn(static_cast<size_t>(c.Tk * c.NKV * c.D), seed + 1))),
        v(to_bf16(randn(static_cast<size_t>(c.Tk * c.NKV * c.D), seed + 2))),
        o_ref(q.size()),
        dq(q),
        dk(k),
        dv(v),
        dr(c.ranges) {
    const AttnParams p{c.Tq, c.Tk, c.NH, c.NKV, c.D, 1.0 / std::sqrt(static_cast<double>(c.D))};
    attention_fwd_cpu(o_ref.data(), nullptr, from_bf16(q).data(), from_bf16(k).data(),
                      from_bf16(v).data(), c.ranges.data(), p);
  }
};

/// The graph shape of a case: its documents plus `spare_slots` empty slots, documents up to the
/// longest plus `spare_rows`.
CudnnPrefillShape shape_of(const AttnCase& c, int64_t spare_slots, int64_t spare_rows) {
  const std::vector<int32_t> off = attention_causal_varlen_docs(c.ranges.data(), c.Tq);
  int64_t longest = 0;
  for (size_t d = 0; d + 1 < off.size(); ++d)
    longest = std::max<int64_t>(longest, off[d + 1] - off[d]);
  return CudnnPrefillShape{
      static_cast<int64_t>(off.size()) - 1 + spare_slots, longest + spare_rows, c.NH, c.NKV, c.D,
      1.0 / std::sqrt(static_cast<double>(c.D))};
}

void run_case(const AttnCase& c, uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "T=" << c.Tq << " NH=" << c.NH << " NKV=" << c.NKV << " D=" << c.D);
  cuda::CudaContext ctx(0);
  Inputs in(c, seed);
  CudnnCausalPrefill pf(ctx, shape_of(c, 3, 5));
  DeviceGuarded<uint16_t> o(in.q.size());
  pf.set_documents(in.dr.get(), c.Tq);
  pf.forward(o.get(), in.dq.get(), in.dk.get(), in.dv.get());
  const std::vector<uint16_t> o1 = o.download();
  EXPECT_LT(rel_error(from_bf16(o1), in.o_ref), tol::kAttnBf16);
  EXPECT_TRUE(o.guard_intact());
  // Deterministic: a second run gives the same bits.
  pf.forward(o.get(), in.dq.get(), in.dk.get(), in.dv.get());
  EXPECT_TRUE(same_bits(o.download(), o1));
}

}  // namespace

TEST(AttentionCudnnCuda, CausalVarlenOddShapesGqaAndHeadDims) {
  DFLASH_REQUIRE_GPU();
  std::printf("cuDNN %lld loaded at run time\n",
              static_cast<long long>(CudnnCausalPrefill::cudnn_version()));
  run_case(attn_causal({1}, 1, 1, 64), 1);
  run_case(attn_causal({17}, 4, 1, 128), 2);              // GQA 4
  run_case(attn_causal({100, 29}, 4, 4, 64), 3);          // MHA, two documents
  run_case(attn_causal({65, 1, 63, 129}, 8, 2, 128), 4);  // GQA 4, a one-row document
  run_case(attn_causal({300, 1, 699}, 4, 1, 64), 5);      // GQA 4, long
  run_case(attn_causal({1000}, 2, 2, 128), 6);            // MHA, long
}

TEST(AttentionCudnnCuda, TheSameGraphServesOtherDocumentsAndReplaysInACudaGraph) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  // One graph (4 slots of up to 200 rows) for two different document splits of 300 rows.
  Inputs a(attn_causal({200, 100}, 8, 2, 128), 10), b(attn_causal({7, 193, 1, 99}, 8, 2, 128), 10);
  CudnnCausalPrefill pf(ctx, CudnnPrefillShape{4, 200, 8, 2, 128, 1.0 / std::sqrt(128.0)});
  DeviceGuarded<uint16_t> o(a.q.size());
  // Eager runs of both splits.
  pf.set_documents(a.dr.get(), 300);
  pf.forward(o.get(), a.dq.get(), a.dk.get(), a.dv.get());
  const std::vector<uint16_t> oa = o.download();
  EXPECT_LT(rel_error(from_bf16(oa), a.o_ref), tol::kAttnBf16);
  pf.set_documents(b.dr.get(), 300);
  pf.forward(o.get(), b.dq.get(), b.dk.get(), b.dv.get());
  const std::vector<uint16_t> ob = o.download();
  EXPECT_LT(rel_error(from_bf16(ob), b.o_ref), tol::kAttnBf16);
  // Captured once with split a's ranges array, replayed after that array was overwritten with
  // split b's ranges: same bits as the eager run of b (the documents are read on the device).
  DeviceGuarded<AttnRange> ranges(a.c.ranges);
  cuda::GraphCache<int> graphs;
  auto enqueue = [&] {
    pf.set_documents(ranges.get(), 300);
    pf.forward(o.get(), b.dq.get(), b.dk.get(), b.dv.get());
  };
  graphs.run(0, ctx.stream(), enqueue);
  ctx.synchronize();
  ranges.upload(b.c.ranges);
  graphs.run(0, ctx.stream(), enqueue);
  ctx.synchronize();
  EXPECT_TRUE(same_bits(o.download(), ob));
  EXPECT_TRUE(o.guard_intact());
}

TEST(AttentionCudnnCuda, RejectsBadShapesAndCallsOnTheHost) {
  DFLASH_REQUIRE_GPU();
  cuda::CudaContext ctx(0);
  EXPECT_THAT(
      [&] {
        CudnnCausalPrefill(ctx, CudnnPrefillShape{0, 16, 4, 2, 64, 0.125});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("0 document slots")));
  EXPECT_THAT(
      [&] {
        CudnnCausalPrefill(ctx, CudnnPrefillShape{2, 16, 6, 4, 64, 0.125});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("NH must be a multiple of NKV")));
  CudnnCausalPrefill pf(ctx, CudnnPrefillShape{2, 16, 4, 2, 64, 0.125});
  DeviceGuarded<uint16_t> x(16 * 4 * 64);
  EXPECT_THAT([&] { pf.forward(x.get(), x.get(), x.get(), x.get()); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("before set_documents")));
  DeviceGuarded<AttnRange> r(attn_causal({16}, 4, 2, 64).ranges);
  EXPECT_THAT([&] { pf.set_documents(r.get(), 0); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("set_documents of 0 rows")));
  pf.set_documents(r.get(), 16);
  EXPECT_THAT([&] { pf.forward(x.get() + 1, x.get(), x.get(), x.get()); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("16-byte aligned")));
}

// A device trap poisons the process's CUDA context: each bad input runs in a child process
// (threadsafe death tests re-run the binary), its device printf sent to stderr.
// The child exits with status 1 after printing the error the synchronisation threw (its objects
// are left alive: nothing is destroyed on a poisoned context); it returns, and the death test
// fails, when the kernel did not trap.
void run_documents_in_child(const AttnCase& c, const CudnnPrefillShape& shape) {
  dup2(2, 1);
  auto* ctx = new cuda::CudaContext(0);
  auto* pf = new CudnnCausalPrefill(*ctx, shape);
  auto* r = new DeviceGuarded<AttnRange>(c.ranges);
  pf->set_documents(r->get(), c.Tq);
  try {
    ctx->synchronize();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    std::_Exit(1);
  }
}

TEST(AttentionCudnnCudaDeathTest, BadDocumentsTrapOnTheDeviceNamingTheRow) {
  DFLASH_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const CudnnPrefillShape two_slots{2, 64, 4, 2, 64, 0.125};
  EXPECT_DEATH(run_documents_in_child(attn_causal({10, 10, 10}, 4, 2, 64), two_slots),
               "row 20 starts document 3; the graph has 2 document slots");
  EXPECT_DEATH(run_documents_in_child(attn_causal({10, 65}, 4, 2, 64), two_slots),
               "document 1 \\(rows 10..74\\) has 65 rows; the graph's longest is 64");
  AttnCase window = attn_causal({30}, 4, 2, 64);
  window.ranges[25].lo1 = 20;  // a sliding-window row: not causal varlen
  EXPECT_DEATH(run_documents_in_child(window, two_slots),
               "row 25 has range \\{20, 26, 0, 0\\}, not the causal varlen form");
}
