// Tests of the per-interval metrics (src/train/train_report): the device-time and host-wait
// figures of a backend that measures them reach metrics.jsonl (s_device = target + drafter +
// optimizer device time, s_host_wait), a backend that does not measure them leaves the keys out
// (never 0), and the accumulator round-trips through JSON, also from checkpoints written before
// these fields existed.
#include "train/train_report.hpp"

#include <gtest/gtest.h>

using namespace dflash;

namespace {
DrafterStepResult result(bool measured) {
  DrafterStepResult r;
  r.metrics = ObjectiveMetrics(4);
  r.grad_norm = 1.0;
  if (measured) {
    r.target_device_s = 0.5;
    r.drafter_device_s = 1.5;
    r.optimizer_device_s = 0.25;
    r.host_wait_s = 2.0;
  }
  return r;
}
}  // namespace

TEST(TrainReport, DeviceTimesAndHostWaitReachTheRecord) {
  IntervalMetrics iv(4);
  for (int i = 0; i < 2; ++i) {
    StepTimes t;
    t.target = 0.5;  // the trainer records the target's device time when the backend measured it
    t.drafter = 1.8;
    t.total = 2.35;
    iv.add_step(result(true), 100, 50, t);
  }
  const nlohmann::json r = interval_record(iv, 2, 0, 1e-3, 0);
  EXPECT_DOUBLE_EQ(r.at("s_per_step").get<double>(), 2.35);
  EXPECT_DOUBLE_EQ(r.at("s_drafter_gpu").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(r.at("s_optimizer_gpu").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(r.at("s_device").get<double>(), 2.25);
  EXPECT_DOUBLE_EQ(r.at("s_host_wait").get<double>(), 2.0);
  const IntervalMetrics back = IntervalMetrics::from_json(iv.to_json());
  EXPECT_EQ(back.to_json(), iv.to_json());
}

TEST(TrainReport, UnmeasuredFiguresAreLeftOutAndOldStateStillReads) {
  IntervalMetrics iv(4);
  StepTimes t;
  t.total = 1.0;
  iv.add_step(result(false), 100, 50, t);
  const nlohmann::json r = interval_record(iv, 1, 0, 1e-3, 0);
  EXPECT_FALSE(r.contains("s_drafter_gpu"));
  EXPECT_FALSE(r.contains("s_optimizer_gpu"));
  EXPECT_FALSE(r.contains("s_device"));
  EXPECT_FALSE(r.contains("s_host_wait"));
  nlohmann::json old = iv.to_json();
  old.erase("t_gpu_optimizer");
  old.erase("t_host_wait");
  EXPECT_EQ(IntervalMetrics::from_json(old).to_json(), iv.to_json());
}
