// The step contract (src/train/train_backend.hpp) on the CPU backend, with the tiny Qwen3 target:
// the stages compute what the model functions compute (target forward_taps, drafter_train_step,
// sum_squares_cpu, clip_scale, adamw_step_cpu), the drafter stage owns the skip decision and the
// AdamW update count, results come out in step order even when taken one step late, state goes
// out and back in unchanged, and every misuse is a clear error. Also: the factory names
// runtime.backend / runtime.devices when a backend cannot run here.
#include "train/train_backend.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.hpp"
#include "model/drafter_io.hpp"
#include "model/objective.hpp"
#include "model/target.hpp"
#include "util/test_util.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/device.hpp"
#endif

using namespace dflash;

namespace {

const TargetModel& tiny_target() {
  static const TargetModel t = TargetModel::load(test::assets_dir() / "tiny-qwen3");
  return t;
}

DrafterConfig tiny_drafter() {
  DrafterSizes sizes;
  sizes.intermediate_size = 64;
  sizes.block_size = 4;
  return drafter_config_for_target(tiny_target().config(), 1, sizes, 8000, std::vector<int>{1, 3});
}

// A two-row batch of random tokens (ids below 8000), several documents, 3 anchors per document.
DrafterBatch make_batch(uint64_t seed, bool supervised = true) {
  Rng rng(seed);
  DrafterBatch b(4);
  for (const std::vector<int>& docs : {std::vector<int>{19, 11}, std::vector<int>{26}}) {
    std::vector<int32_t> tokens, offsets{0};
    std::vector<uint8_t> mask;
    for (int n : docs) {
      for (int i = 0; i < n; ++i) {
        tokens.push_back(static_cast<int32_t>(rng.below(8000)));
        mask.push_back(supervised && rng.below(5) != 0 ? 1 : 0);
      }
      offsets.push_back(static_cast<int32_t>(tokens.size()));
    }
    std::vector<Anchor> anchors;
    for (size_t d = 0; d + 1 < offsets.size(); ++d) {
      for (int32_t p : {offsets[d] + 1, offsets[d] + 5, offsets[d + 1] - 3}) {
        anchors.push_back({p, static_cast<int32_t>(d)});
      }
    }
    b.append_row(tokens, offsets, anchors, block_targets(tokens, mask, offsets, anchors, 4, 7.0));
  }
  return b;
}

DrafterState initial_state(const DrafterLayout& layout, uint64_t seed) {
  DrafterState s;
  const auto n = static_cast<size_t>(layout.total);
  s.params.resize(n);
  drafter_init(s.params, layout, seed);
  s.adam_m.assign(n, 0.0f);
  s.adam_v.assign(n, 0.0f);
  return s;
}

TrainBackendOptions cpu_options() {
  TrainBackendOptions o;
  o.backend = "cpu";
  o.adam.weight_decay = 0.01;
  o.clip_grad_norm = 0.05;  // small enough to clip
  return o;
}

template <typename F>
void expect_error(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error (expected one mentioning '" << part << "')";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(TrainBackend, CpuStagesComputeTheStepAndOwnTheUpdate) {
  const DrafterConfig cfg = tiny_drafter();
  const DrafterLayout layout(cfg);
  TrainBackend be = train_backend_create(cpu_options(), tiny_target(), cfg, layout);
  EXPECT_NE(be.description.find("cpu"), std::string::npos);
  const DrafterState s0 = initial_state(layout, 7);
  be.drafter->load_state(s0);
  const DrafterBatch batch = make_batch(1);
  ASSERT_GT(batch.weight_sum, 0);

  const auto features = be.target->forward_taps(batch);
  be.drafter->step(batch, *features);
  be.drafter->update(1e-3);
  const DrafterStepResult r = be.drafter->result();

  // The same step by hand from the model functions.
  const Tensor taps =
      tiny_target().forward_taps(batch.tokens, batch.doc_offsets, std::vector<int>{1, 3});
  const std::vector<float> embed = tiny_target().embedding_f32();
  DrafterWorkspace<float> ws;
  std::vector<float> grads(s0.params.size(), 0.0f);
  const DrafterTrainResult ref = drafter_train_step<float>(
      cfg, layout, s0.params.data(), grads.data(), DrafterTables<float>{embed.data(), embed.data()},
      batch, taps.data<float>(), 1.0 / batch.weight_sum, ws);
  EXPECT_EQ(r.skip, StepSkip::none);
  EXPECT_EQ(r.metrics.loss_weighted_sum, ref.loss_sum);
  EXPECT_EQ(r.metrics.weight_sum, ref.weight_sum);
  ObjectiveMetrics m(4);
  accumulate_metrics(m, batch.targets, ref.argmax, {});
  EXPECT_EQ(r.metrics.blocks, batch.N());
  EXPECT_EQ(r.metrics.accept_len_sum, m.accept_len_sum);
  EXPECT_EQ(r.metrics.slot_correct, m.slot_correct);
  const double norm = std::sqrt(sum_squares_cpu(grads.data(), layout.total));
  EXPECT_EQ(r.grad_norm, norm);
  EXPECT_EQ(r.clip, clip_scale(norm, 0.05));
  EXPECT_LT(r.clip, 1.0);
  EXPECT_FALSE(r.target_device_s.has_value());  // the CPU backend measures no device time
  EXPECT_FALSE(r.drafter_device_s.has_value());

  DrafterState after;
  be.drafter->save_state(after);
  EXPECT_EQ(after.updates, 1);
  DrafterState want = s0;
  AdamWConfig adam;
  adam.weight_decay = 0.01;
  adamw_step_cpu(want.params.data(), want.adam_m.data(), want.adam_v.data(), grads.data(),
                 layout.total, adam, 1e-3, 1, r.clip);
  EXPECT_EQ(after.params, want.params);
  EXPECT_EQ(after.adam_m, want.adam_m);
  EXPECT_EQ(after.adam_v, want.adam_v);
}

TEST(TrainBackend, SkippedStepsChangeNothingAndDoNotCountAsUpdates) {
  const DrafterConfig cfg = tiny_drafter();
  const DrafterLayout layout(cfg);
  TrainBackend be = train_backend_create(cpu_options(), tiny_target(), cfg, layout);
  DrafterState s0 = initial_state(layout, 3);
  s0.updates = 5;
  be.drafter->load_state(s0);
  // No supervised slot: nothing is computed.
  const DrafterBatch empty = make_batch(2, false);
  ASSERT_EQ(empty.weight_sum, 0.0);
  be.drafter->step(empty, *be.target->forward_taps(empty));
  be.drafter->update(1e-3);
  const DrafterStepResult r1 = be.drafter->result();
  EXPECT_EQ(r1.skip, StepSkip::no_supervised_slot);
  EXPECT_TRUE(std::isnan(r1.grad_norm));  // not computed, not 0
  // A non-finite weight: the loss is NaN, the update is skipped.
  DrafterState bad = s0;
  bad.params[static_cast<size_t>(layout.norm)] = std::numeric_limits<float>::quiet_NaN();
  be.drafter->load_state(bad);
  const DrafterBatch batch = make_batch(1);
  be.drafter->step(batch, *be.target->forward_taps(batch));
  be.drafter->update(1e-3);
  const DrafterStepResult r2 = be.drafter->result();
  EXPECT_EQ(r2.skip, StepSkip::non_finite);
  DrafterState after;
  be.drafter->save_state(after);
  EXPECT_EQ(after.updates, 5);
  ASSERT_EQ(after.params.size(), bad.params.size());  // bit equality (the NaN included)
  EXPECT_EQ(std::memcmp(after.params.data(), bad.params.data(), bad.params.size() * 4), 0);
  EXPECT_EQ(after.adam_m, bad.adam_m);
}

TEST(TrainBackend, ResultsComeInStepOrderWhenTakenOneStepLate) {
  const DrafterConfig cfg = tiny_drafter();
  const DrafterLayout layout(cfg);
  const DrafterBatch b1 = make_batch(1), b2 = make_batch(2);
  // In lock step.
  TrainBackend a = train_backend_create(cpu_options(), tiny_target(), cfg, layout);
  a.drafter->load_state(initial_state(layout, 9));
  std::vector<DrafterStepResult> sync;
  for (const DrafterBatch* b : {&b1, &b2}) {
    a.drafter->step(*b, *a.target->forward_taps(*b));
    a.drafter->update(2e-3);
    sync.push_back(a.drafter->result());
  }
  // Step 2 issued before step 1's result is taken.
  TrainBackend c = train_backend_create(cpu_options(), tiny_target(), cfg, layout);
  c.drafter->load_state(initial_state(layout, 9));
  c.drafter->step(b1, *c.target->forward_taps(b1));
  c.drafter->update(2e-3);
  c.drafter->step(b2, *c.target->forward_taps(b2));
  c.drafter->update(2e-3);
  const DrafterStepResult l1 = c.drafter->result(), l2 = c.drafter->result();
  EXPECT_EQ(l1.metrics.loss_weighted_sum, sync[0].metrics.loss_weighted_sum);
  EXPECT_EQ(l2.metrics.loss_weighted_sum, sync[1].metrics.loss_weighted_sum);
  EXPECT_EQ(l2.grad_norm, sync[1].grad_norm);
  DrafterState sa, sc;
  a.drafter->save_state(sa);
  c.drafter->save_state(sc);
  EXPECT_EQ(sa.params, sc.params);
  EXPECT_EQ(sc.updates, 2);
}

TEST(TrainBackend, MisuseIsAClearError) {
  const DrafterConfig cfg = tiny_drafter();
  const DrafterLayout layout(cfg);
  TrainBackend a = train_backend_create(cpu_options(), tiny_target(), cfg, layout);
  TrainBackend b = train_backend_create(cpu_options(), tiny_target(), cfg, layout);
  a.drafter->load_state(initial_state(layout, 1));
  const DrafterBatch batch = make_batch(1), other = make_batch(2);
  expect_error([&] { a.drafter->update(1e-3); }, "update() without a step()");
  expect_error([&] { a.drafter->result(); }, "result() without an updated step");
  const auto fa = a.target->forward_taps(batch);
  struct ForeignFeatures final : TargetFeatures {};
  expect_error([&] { b.drafter->step(batch, ForeignFeatures()); }, "another backend");
  expect_error([&] { a.drafter->step(other, *fa); }, "features");
  ForeignFeatures foreign;
  expect_error([&] { a.target->fill_nan(foreign); }, "another stage");
  a.drafter->step(batch, *fa);
  expect_error([&] { a.drafter->step(batch, *fa); }, "twice without update()");
  DrafterState st;
  expect_error([&] { a.drafter->save_state(st); }, "between step() and update()");
  a.drafter->update(1e-3);
  a.drafter->save_state(st);
  st.adam_m.pop_back();
  expect_error([&] { a.drafter->load_state(st); }, "adam_m");
  DrafterBatch wrong_k(8);
  expect_error([&] { a.drafter->step(wrong_k, *a.target->forward_taps(wrong_k)); }, "block size");
}

TEST(TrainBackend, FactoryNamesTheKeyWhenABackendCannotRunHere) {
  TrainBackendOptions o;
  o.backend = "tpu";
  expect_error([&] { train_backend_check(o); }, "runtime.backend 'tpu'");
  o.backend = "cuda";
#ifdef DFLASH_HAVE_CUDA
  o.devices = {0, 1};
  expect_error([&] { train_backend_check(o); }, "runtime.devices lists 2 devices");
  o.devices = {cuda::device_count()};  // one past the last visible device
  expect_error([&] { train_backend_check(o); }, "runtime.devices: CUDA device");
#else
  expect_error([&] { train_backend_check(o); }, "built without the CUDA backend");
  const DrafterConfig cfg = tiny_drafter();
  expect_error([&] { train_backend_create(o, tiny_target(), cfg, DrafterLayout(cfg)); },
               "built without the CUDA backend");
#endif
}
