// The multi-worker training pipeline (src/train/pipeline.hpp) and its parts: the ordered bounded
// queue, the in-process collective, the topology keys, fault-injection parsing, and the pipeline
// itself with small fake stages (order of the global batch sequence, replicas kept identical by
// the all-reduce, a worker's error, a stuck worker, a stop request). The runs of `dflash train`
// with several workers on the CPU backend are in pipeline_train_test.cpp.
#include "train/pipeline.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "core/error.hpp"
#include "train/collective.hpp"
#include "train/ordered_queue.hpp"
#include "train/run_config.hpp"
#include "train/topology.hpp"

using namespace dflash;

namespace {

template <typename F>
void expect_error(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error (expected one mentioning '" << part << "')";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// ------------------------------------------------------------------------------- fake stages

// Features of a fake target stage: the global batch index of their batch (NaN when poisoned).
struct FakeFeatures final : TargetFeatures {
  double value = 0;
};

struct FakeTarget final : TargetStage {
  explicit FakeTarget(int delay_ms) : delay_ms(delay_ms) {}
  std::unique_ptr<TargetFeatures> forward_taps(const DrafterBatch& b) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    auto f = std::make_unique<FakeFeatures>();
    f->value = static_cast<double>(b.index);
    return f;
  }
  void fill_nan(TargetFeatures& f) override { dynamic_cast<FakeFeatures&>(f).value = std::nan(""); }
  int delay_ms;  // each forward_taps sleeps this long
};

// A drafter with 4 parameters: the gradient of a batch is (index + 1 + replica-independent
// features) · (1, 2, 3, 4) / Σw of the step; update() all-reduces it (unless `no_reduce`) and
// applies p ← p − lr·g. The result's loss is the batch's global index (to check the order).
struct FakeDrafter final : DrafterStage {
  FakeDrafter(std::unique_ptr<Collective> c, bool no_reduce)
      : collective(std::move(c)), no_reduce(no_reduce) {}
  std::unique_ptr<Collective> collective;
  bool no_reduce;
  DrafterState state;
  std::vector<float> grad = std::vector<float>(4, 0.0f);
  StepQueue queue;

  void step(const DrafterBatch& b, const TargetFeatures& features) override {
    const double v = dynamic_cast<const FakeFeatures&>(features).value;
    DFLASH_CHECK(std::isnan(v) || v == static_cast<double>(b.index), "features of another batch");
    DrafterStepResult r;
    r.metrics = ObjectiveMetrics(2);
    r.metrics.loss_weighted_sum = v;
    r.metrics.weight_sum = b.weight_sum;
    for (int i = 0; i < 4; ++i) {
      grad[static_cast<size_t>(i)] = static_cast<float>(
          (v + 1.0) * (i + 1 + static_cast<double>(b.index % 3)) / b.loss_normaliser());
    }
    queue.stepped(std::move(r));
  }
  void update(double lr) override {
    DrafterStepResult r = queue.take_stepped();
    bool peer = false;
    if (collective && !no_reduce) {
      collective->all_reduce_sum(grad.data(), 4);
      peer = replicas_non_finite(*collective, r);
    }
    double sq = 0;
    for (float g : grad) sq += static_cast<double>(g) * g;
    r.grad_norm = no_reduce ? 1.0 : std::sqrt(sq);
    if (step_decide_update(r, 0.0, peer)) {
      state.updates += 1;
      for (size_t i = 0; i < 4; ++i) state.params[i] -= static_cast<float>(lr) * grad[i];
    }
    queue.finish(std::move(r));
  }
  DrafterStepResult result() override { return queue.pop(); }
  void save_state(DrafterState& out) override { out = state; }
  void load_state(const DrafterState& in) override { state = in; }
  void inject_nan() override { queue.poison_next(); }
};

DrafterState fake_initial() {
  DrafterState s;
  s.params = {1, 2, 3, 4};
  s.adam_m.assign(4, 0.0f);
  s.adam_v.assign(4, 0.0f);
  return s;
}

// A pipeline of fake stages: batch g of the global sequence has index g and Σw 1.
struct FakeRun {
  PipelineOptions opts;
  PipelineHooks hooks;
  DrafterState initial = fake_initial();
  std::shared_ptr<LocalCollectiveGroup> group;
  std::vector<PipelineStep> steps;  // as on_step saw them
  bool no_reduce = false;
  std::vector<int> target_delay_ms;  // per target worker (none: 0)

  FakeRun(int targets, int drafters, int64_t steps_to_run) {
    opts.topology.target_devices.assign(static_cast<size_t>(targets), -1);
    opts.topology.drafter_devices.assign(static_cast<size_t>(drafters), -1);
    opts.topology.stall_timeout_s = 30;
    opts.end_step = steps_to_run;
    opts.initial_state = &initial;
    opts.stop_grace_s = 4;
    opts.tick_s = 0.05;
    if (drafters > 1) {
      group = LocalCollectiveGroup::create(drafters);
      opts.collective = group;
    }
    hooks.make_step = [drafters](int64_t s) {
      StepInput in;
      for (int r = 0; r < drafters; ++r) {
        DrafterBatch b(2);
        b.index = s * drafters + r;
        b.weight_sum = 1.0;
        b.step_weight_sum = static_cast<double>(drafters);
        in.batches.push_back(std::move(b));
      }
      in.cursor.batch = (s + 1) * drafters;
      return in;
    };
    hooks.make_target = [this](int t) {
      const auto i = static_cast<size_t>(t);
      return std::make_unique<FakeTarget>(i < target_delay_ms.size() ? target_delay_ms[i] : 0);
    };
    hooks.make_drafter = [this](int r) {
      return std::make_unique<FakeDrafter>(group ? group->member(r) : nullptr, no_reduce);
    };
    hooks.lr = [](int64_t) { return 0.01; };
    hooks.checkpoint_after = [](int64_t n) { return n % 4 == 0; };
    hooks.on_step = [this](PipelineStep& p) { steps.push_back(std::move(p)); };
  }
  PipelineOutcome run() {
    opts.first_step = 0;
    return pipeline_run(opts, hooks);
  }
};

}  // namespace

// ------------------------------------------------------------------------------ ordered queue

TEST(OrderedQueue, DeliversInSequenceOrderAndBoundsWhatItHolds) {
  OrderedQueue<int> q(5, 2);
  std::atomic<bool> far_put{false};
  // Item 7 is two past the consumer's next (5): it waits until 5 is taken.
  std::thread producer([&] {
    EXPECT_TRUE(q.put(6, 60));
    EXPECT_TRUE(q.put(7, 70));
    far_put = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(far_put.load());
  EXPECT_EQ(q.held(), 1);
  EXPECT_TRUE(q.put(5, 50));
  EXPECT_EQ(q.take(), 50);
  EXPECT_EQ(q.take(), 60);
  producer.join();
  EXPECT_TRUE(far_put.load());
  EXPECT_EQ(q.take(), 70);
  expect_error([&] { q.put(6, 1); }, "put after item 7 was taken");
}

TEST(OrderedQueue, CloseWakesABlockedConsumerAndProducer) {
  OrderedQueue<int> q(0, 1);
  std::optional<int> got = 1;
  bool put_ok = true;
  std::thread consumer([&] { got = q.take(); });
  ASSERT_TRUE(q.put(0, 1));
  consumer.join();
  std::thread blocked_producer([&] { put_ok = q.put(2, 3); });
  std::thread blocked_consumer([&] { got = q.take(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  q.close();
  blocked_producer.join();
  blocked_consumer.join();
  EXPECT_FALSE(put_ok);
  EXPECT_FALSE(got.has_value());
}

// ---------------------------------------------------------------------------------- collective

TEST(LocalCollective, EveryRankGetsTheRankOrderSumBitForBit) {
  constexpr int kRanks = 3;
  constexpr int64_t kN = 1001;  // not a multiple of the rank count
  auto group = LocalCollectiveGroup::create(kRanks);
  std::vector<std::vector<float>> data(kRanks);
  std::vector<double> host(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    for (int64_t i = 0; i < kN; ++i) {
      data[static_cast<size_t>(r)].push_back(1.0f / static_cast<float>(i + 1 + r * 7) + 1e4f * r);
    }
  }
  const std::vector<std::vector<float>> in = data;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto m = group->member(r);
      EXPECT_EQ(m->rank(), r);
      m->all_reduce_sum(data[static_cast<size_t>(r)].data(), kN);
      double v[1] = {0.5 * (r + 1)};
      m->all_reduce_sum_host(v);
      host[static_cast<size_t>(r)] = v[0];
    });
  }
  for (auto& t : threads) t.join();
  for (int64_t i = 0; i < kN; ++i) {
    const auto k = static_cast<size_t>(i);
    const float want = (in[0][k] + in[1][k]) + in[2][k];
    for (int r = 0; r < kRanks; ++r) ASSERT_EQ(data[static_cast<size_t>(r)][k], want) << i;
  }
  for (double v : host) EXPECT_EQ(v, 3.0);
  expect_error([&] { group->member(3); }, "rank 3 outside a group of 3");
  expect_error([&] { group->member(1); }, "taken twice");
}

TEST(LocalCollective, AbortWakesAWaitingRankAndFailsLaterCalls) {
  auto group = LocalCollectiveGroup::create(2);
  auto m0 = group->member(0);
  std::string error;
  std::thread waiter([&] {
    float x[1] = {1};
    try {
      m0->all_reduce_sum(x, 1);  // rank 1 never comes
    } catch (const Error& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  group->abort("drafter1 failed");
  waiter.join();
  EXPECT_NE(error.find("collective aborted: drafter1 failed"), std::string::npos) << error;
  float y[1] = {0};
  expect_error([&] { m0->all_reduce_sum(y, 1); }, "aborted");
}

// ----------------------------------------------------------------------------------- topology

TEST(Topology, KeysAreCheckedAndNamed) {
  auto cfg = [](const std::string& backend, const std::vector<std::string>& ov) {
    std::vector<std::string> all = {"runtime.backend=" + backend};
    all.insert(all.end(), ov.begin(), ov.end());
    return RunConfig::from_yaml("model: {target: t}\ndata: {train_file: d.jsonl}\noutput_dir: o\n",
                                "t.yaml", all);
  };
  const RunConfig c = cfg("cpu", {"runtime.target_workers=2", "runtime.drafter_workers=3"});
  const PipelineTopology t = topology_of(c.runtime);
  EXPECT_EQ(t.targets(), 2);
  EXPECT_EQ(t.drafters(), 3);
  EXPECT_EQ(t.device_name(WorkerStage::drafter, 2), "cpu");
  EXPECT_EQ(t.describe(), "cpu: 2 target workers, 3 drafter workers, queue depth 2");
  expect_error([&] { cfg("cpu", {"runtime.target_devices=[0]"}); }, "runtime.target_devices");
  expect_error([&] { cfg("cpu", {"runtime.colocated=true"}); }, "runtime.colocated");
  expect_error([&] { cfg("cpu", {"runtime.drafter_workers=0"}); }, "runtime.drafter_workers");
  expect_error([&] { cfg("cpu", {"runtime.queue_depth=0"}); }, "runtime.queue_depth");
  expect_error([&] { cfg("cpu", {"runtime.stall_timeout_s=0"}); }, "runtime.stall_timeout_s");
  expect_error([&] { cfg("cuda", {"runtime.drafter_workers=2"}); }, "runtime.drafter_workers");
  expect_error([&] { cfg("cuda", {"runtime.target_devices=[0]"}); }, "runtime.drafter_devices");
  expect_error(
      [&] {
        cfg("cuda", {"runtime.target_devices=[0,1]", "runtime.drafter_devices=[1]"});
      },
      "GPU 1 is in both");
  expect_error(
      [&] {
        cfg("cuda", {"runtime.target_devices=[0]", "runtime.drafter_devices=[1]",
                     "runtime.colocated=true"});
      },
      "no GPU is in both");
  expect_error([&] { cfg("cuda", {"runtime.devices=[0,1]"}); }, "runtime.devices lists 2");
  const RunConfig g = cfg("cuda", {"runtime.target_devices=[0]", "runtime.drafter_devices=[0,0]",
                                   "runtime.colocated=true"});
  const PipelineTopology gt = topology_of(g.runtime);
  EXPECT_TRUE(gt.drafters_share_a_device());
  EXPECT_EQ(gt.describe(),
            "cuda: target workers on GPUs [0], drafter workers on GPUs [0, 0] (colocated), queue "
            "depth 2");
  expect_error([&] { topology_check_devices(gt, 0); }, "runtime.target_devices: CUDA device 0");
  const PipelineTopology one = topology_of(cfg("cuda", {"runtime.devices=[3]"}).runtime);
  EXPECT_EQ(one.target_devices, std::vector<int>{3});
  expect_error([&] { topology_check_devices(one, 2); }, "runtime.devices: CUDA device 3");
}

TEST(FaultInject, SpecsAreParsedAndBadOnesNamed) {
  const FaultSpec s = fault_spec_parse("drafter:1:4:nan");
  EXPECT_EQ(s.stage, WorkerStage::drafter);
  EXPECT_EQ(s.worker, 1);
  EXPECT_EQ(s.step, 4);
  EXPECT_EQ(s.kind, FaultKind::nan);
  expect_error([] { fault_spec_parse("gpu:0:1:throw"); }, "target or drafter");
  expect_error([] { fault_spec_parse("target:x:1:throw"); }, "the worker");
  expect_error([] { fault_spec_parse("target:0:0:throw"); }, "steps count from 1");
  expect_error([] { fault_spec_parse("target:0:1:explode"); }, "throw, hang or nan");
  expect_error([] { fault_spec_parse("target:0:1"); }, "DFLASH_FAULT_INJECT");
  // An MPI job's rank (issue 15): rank<K>: in front; without it, rank 0.
  EXPECT_EQ(s.rank, 0);
  const FaultSpec r = fault_spec_parse("rank3:target:0:2:hang");
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.stage, WorkerStage::target);
  EXPECT_EQ(r.kind, FaultKind::hang);
  expect_error([] { fault_spec_parse("rankx:target:0:2:hang"); }, "the rank must be");
  expect_error([] { fault_spec_parse("node1:target:0:2:hang"); }, "[rank<K>:]");
  FaultInjector throw_once(fault_spec_parse("target:1:3:throw"), WorkerStage::target, 1);
  EXPECT_FALSE(throw_once.at(2));
  EXPECT_EQ(throw_once.at(5), FaultKind::throw_error);  // the first step ≥ 3 it sees
  EXPECT_FALSE(throw_once.at(6));
  FaultInjector streak(fault_spec_parse("drafter:0:2:nan"), WorkerStage::drafter, 0);
  EXPECT_FALSE(streak.at(1));
  EXPECT_EQ(streak.at(2), FaultKind::nan);
  EXPECT_EQ(streak.at(3), FaultKind::nan);
  FaultInjector other(fault_spec_parse("drafter:0:2:nan"), WorkerStage::drafter, 1);
  EXPECT_FALSE(other.at(3));
}

// ------------------------------------------------------------------------ pipeline, fake stages

TEST(Pipeline, ReplicasTakeTheGlobalSequenceInOrderAndStayIdentical) {
  FakeRun run(3, 2, 10);
  const PipelineOutcome o = run.run();
  ASSERT_EQ(o.end, PipelineOutcome::End::completed) << o.error;
  EXPECT_EQ(o.steps_done, 10);
  ASSERT_EQ(run.steps.size(), 10u);
  for (size_t s = 0; s < run.steps.size(); ++s) {
    const PipelineStep& p = run.steps[s];
    EXPECT_EQ(p.steps_done, static_cast<int64_t>(s) + 1);
    ASSERT_EQ(p.results.size(), 2u);
    for (int r = 0; r < 2; ++r) {  // replica r took batch 2s + r
      EXPECT_EQ(p.results[static_cast<size_t>(r)].metrics.loss_weighted_sum,
                static_cast<double>(2 * s + static_cast<size_t>(r)));
    }
    EXPECT_EQ(p.cursor.batch, 2 * static_cast<int64_t>(s) + 2);
    EXPECT_EQ(p.state.has_value(), (s + 1) % 4 == 0) << s;
  }
  ASSERT_EQ(o.replica_hashes.size(), 2u);
  EXPECT_EQ(o.replica_hashes[0], o.replica_hashes[1]);
  EXPECT_TRUE(o.abandoned.empty());
  EXPECT_TRUE(o.final_state.has_value());  // step 10 had no state attached
}

TEST(Pipeline, ReplicasThatSkipTheAllReduceDivergeAndTheRunFails) {
  FakeRun run(1, 2, 3);
  run.no_reduce = true;
  const PipelineOutcome o = run.run();
  EXPECT_EQ(o.end, PipelineOutcome::End::failed);
  EXPECT_NE(o.error.find("the drafter replicas' states differ after step 3"), std::string::npos)
      << o.error;
}

TEST(Pipeline, AWorkerErrorStopsEveryWorkerNamingIt) {
  for (const char* spec : {"drafter:1:4:throw", "target:0:4:throw"}) {
    // A target worker fires at the first batch of a step ≥ 4 that it computes: with a second
    // target worker that step depends on which worker takes which batch (on a loaded machine the
    // other one may take them all), so the target case has one target worker.
    FakeRun run(spec[0] == 't' ? 1 : 2, 2, 50);
    run.opts.fault = fault_spec_parse(spec);
    const auto t0 = std::chrono::steady_clock::now();
    const PipelineOutcome o = run.run();
    EXPECT_LT(seconds_since(t0), 5.0);
    ASSERT_EQ(o.end, PipelineOutcome::End::failed) << spec;
    const std::string who =
        std::string(spec).substr(0, std::string(spec).find(':')) + (spec[0] == 'd' ? "1" : "0");
    EXPECT_EQ(o.failed_worker, who);
    EXPECT_NE(o.error.find(who + " (cpu) failed at step "), std::string::npos) << o.error;
    EXPECT_NE(o.error.find("fault injected"), std::string::npos) << o.error;
    EXPECT_TRUE(o.abandoned.empty());
    EXPECT_LE(o.steps_done, 3);
    EXPECT_EQ(static_cast<int64_t>(run.steps.size()), o.steps_done);
    if (o.steps_done % 4 != 0) {  // the state of the last completed step comes back
      ASSERT_TRUE(o.final_state.has_value()) << spec;
      EXPECT_EQ(o.final_state->updates, o.steps_done);
    }
  }
}

TEST(Pipeline, AStuckWorkerIsNamedWithEveryWorkersPhaseAndLeftBehind) {
  FakeRun run(2, 1, 50);
  run.opts.fault = fault_spec_parse("target:1:3:hang");
  // target1 hangs at the first batch of a step ≥ 3 it computes: a slow target0 leaves it one
  // (a fast one could take every batch on a loaded machine, and the run would end cleanly).
  run.target_delay_ms = {20, 0};
  run.opts.topology.stall_timeout_s = 0.5;
  run.opts.stop_grace_s = 2;
  const auto t0 = std::chrono::steady_clock::now();
  const PipelineOutcome o = run.run();
  EXPECT_LT(seconds_since(t0), 0.5 + 2 + 2);
  ASSERT_EQ(o.end, PipelineOutcome::End::failed);
  EXPECT_EQ(o.failed_worker, "watchdog");
  EXPECT_NE(o.error.find("target1 (cpu) is stuck"), std::string::npos) << o.error;
  EXPECT_NE(o.error.find("phase 'target forward'"), std::string::npos) << o.error;
  for (const char* w : {"target0", "drafter0"}) {
    EXPECT_NE(o.error.find(std::string("\n  ") + w), std::string::npos) << o.error;
  }
  EXPECT_EQ(o.abandoned, std::vector<std::string>{"target1"});
  EXPECT_GE(o.steps_done, 2);
  if (o.steps_done % 4 != 0) {
    ASSERT_TRUE(o.final_state.has_value());
  }
}

TEST(Pipeline, AStopRequestLetsEveryReplicaFinishTheStartedStep) {
  FakeRun run(2, 3, 1000);
  std::atomic<bool> stop{false};
  run.hooks.stop_requested = [&] { return stop.load(); };
  run.hooks.on_step = [&](PipelineStep& p) {
    if (p.steps_done == 5) stop = true;
    run.steps.push_back(std::move(p));
  };
  const PipelineOutcome o = run.run();
  ASSERT_EQ(o.end, PipelineOutcome::End::stopped) << o.error;
  EXPECT_GE(o.steps_done, 5);
  EXPECT_LT(o.steps_done, 1000);
  ASSERT_EQ(o.replica_hashes.size(), 3u);
  EXPECT_EQ(o.replica_hashes[0], o.replica_hashes[2]);
  if (o.steps_done % 4 != 0) {
    ASSERT_TRUE(o.final_state.has_value());
    EXPECT_EQ(drafter_state_hash(*o.final_state), o.replica_hashes[0]);
  }
}

TEST(Pipeline, ANanStreakReachesTheTrainerAsNonFiniteSteps) {
  FakeRun run(2, 2, 6);
  run.opts.fault = fault_spec_parse("drafter:1:3:nan");
  const PipelineOutcome o = run.run();
  ASSERT_EQ(o.end, PipelineOutcome::End::completed) << o.error;
  for (const PipelineStep& p : run.steps) {
    for (const DrafterStepResult& r : p.results) {
      EXPECT_EQ(r.skip, p.steps_done >= 3 ? StepSkip::non_finite : StepSkip::none);
    }
    EXPECT_EQ(std::isnan(p.results[1].metrics.loss_weighted_sum), p.steps_done >= 3);
  }
  EXPECT_EQ(o.final_state->updates, 2);
}
