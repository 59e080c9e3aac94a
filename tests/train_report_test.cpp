// What a training run reports (src/train/train_report.hpp), on its own: a log interval with
// skipped steps reports them by reason and takes loss, accuracy, τ and gradient norm over the
// applied steps only (none at all when every step was skipped, never 0); metrics.jsonl is cut back
// to the step a run continues from, keeping the newest attempt's records and dropping a torn line;
// the device-time and host-wait figures of a backend that measures them reach metrics.jsonl
// (s_device = target + drafter + optimizer device time, s_host_wait), a backend that does not
// measure them leaves the keys out (never 0), and the accumulator round-trips through JSON, also
// from checkpoints written before these fields existed.
#include "train/train_report.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int kK = 4;

// An applied step: 2 blocks, slot 1 right in one, slots 2 and 3 never supervised.
DrafterStepResult applied_step(double grad_norm) {
  DrafterStepResult r;
  r.metrics = ObjectiveMetrics(kK);
  r.metrics.loss_weighted_sum = 3.0;
  r.metrics.weight_sum = 2.0;
  r.metrics.slot_correct = {0, 1, 0, 0};
  r.metrics.slot_count = {0, 2, 0, 0};
  r.metrics.accept_len_sum = 3;
  r.metrics.blocks = 2;
  r.grad_norm = grad_norm;
  return r;
}

DrafterStepResult skipped_step(StepSkip why) {
  DrafterStepResult r;
  r.metrics = ObjectiveMetrics(kK);
  r.metrics.loss_weighted_sum = std::numeric_limits<double>::infinity();
  r.metrics.weight_sum = 1.0;
  r.skip = why;
  return r;
}

// Step numbers of a metrics.jsonl text, and the "attempt" field each record carries.
std::vector<std::pair<int64_t, int64_t>> steps_and_attempts(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    out.emplace_back(j.at("step"), j.at("attempt"));
  }
  return out;
}

std::string record(int64_t step, int64_t attempt) {
  return json{{"step", step}, {"attempt", attempt}}.dump() + "\n";
}

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

TEST(TrainReport, IntervalFiguresCoverAppliedStepsAndSkipsAreCountedByReason) {
  IntervalMetrics iv(kK);
  const StepTimes t{0.1, 0.2, 0.3, 0.6};
  iv.add_step(applied_step(2.0), 100, 40, t);
  iv.add_step(skipped_step(StepSkip::non_finite), 100, 40, t);
  iv.add_step(skipped_step(StepSkip::no_supervised_slot), 100, 0, t);
  const json r = interval_record(iv, 3, 0, 1e-3, 5);
  EXPECT_DOUBLE_EQ(r.at("loss").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(r.at("tau").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(r.at("grad_norm").get<double>(), 2.0);  // the applied step's, not 2/3
  EXPECT_EQ(r.at("slot_accuracy"), json::parse("[0.5, null, null]"));
  EXPECT_EQ(r.at("interval_steps"), 3);
  EXPECT_EQ(r.at("interval_skipped"), 2);
  EXPECT_EQ(r.at("interval_skip_reasons"),
            json::parse(R"({"non_finite":1,"no_supervised_slot":1})"));
  EXPECT_EQ(r.at("skipped_steps"), 5);
  EXPECT_EQ(record_summary(r),
            "loss 1.5000, simulated τ 1.500 (interval ending at step 3); skipped 2 of 3 steps "
            "(no_supervised_slot 1, non_finite 1)");
  // The skip counts survive a checkpoint.
  const IntervalMetrics back = IntervalMetrics::from_json(iv.to_json(), "state.json", kK);
  EXPECT_EQ(back.skipped_non_finite, 1);
  EXPECT_EQ(back.skipped_no_supervised, 1);
  EXPECT_EQ(back.to_json(), iv.to_json());
}

TEST(TrainReport, AnIntervalOfSkippedStepsHasNoLossAccuracyTauOrGradNorm) {
  IntervalMetrics iv(kK);
  iv.add_step(skipped_step(StepSkip::non_finite), 100, 40, StepTimes{0, 0, 0, 1});
  iv.add_step(skipped_step(StepSkip::non_finite), 100, 40, StepTimes{0, 0, 0, 1});
  const json r = interval_record(iv, 8, 0, 1e-3, 2);
  for (const char* k : {"loss", "accuracy", "slot_accuracy", "tau", "grad_norm"}) {
    EXPECT_FALSE(r.contains(k)) << k;
  }
  EXPECT_EQ(r.at("interval_skip_reasons"), json::parse(R"({"non_finite":2})"));
  EXPECT_EQ(record_summary(r),
            "no loss or τ: all steps of the interval ending at step 8 were skipped (non_finite 2)");
}

TEST(TrainReport, MetricsResumeKeepsTheNewestAttemptUpToTheStepAndDropsATornLine) {
  test::TempDir tmp;
  RunDir rd(tmp / "run");
  TrainReport report(rd);
  // Attempt 1 logged steps 1-3, attempt 2 (resumed from step 1) steps 2-4, then died mid-append.
  test::write_file(rd.metrics_path(), record(1, 1) + record(2, 1) + record(3, 1) + record(2, 2) +
                                          record(3, 2) + record(4, 2) + "{\"step\": 5, \"att");
  const json last = report.metrics_resume_at(3);
  EXPECT_EQ(last.at("step"), 3);
  EXPECT_EQ(last.at("attempt"), 2);
  EXPECT_EQ(report.status().last, last);
  const std::vector<std::pair<int64_t, int64_t>> want = {{1, 1}, {2, 2}, {3, 2}};
  EXPECT_EQ(steps_and_attempts(test::read_file(rd.metrics_path())), want);
  const std::string log = test::read_file(tmp / "run" / "log.txt");
  EXPECT_NE(log.find("kept 3 records up to step 3; dropped 1 past it, 2 superseded by a later "
                     "attempt, and a torn last line"),
            std::string::npos)
      << log;
  // Nothing to drop: the file stays as it is.
  EXPECT_EQ(report.metrics_resume_at(3).at("step"), 3);
  EXPECT_EQ(steps_and_attempts(test::read_file(rd.metrics_path())), want);
  // No record at or before the step: none kept.
  EXPECT_TRUE(report.metrics_resume_at(0).is_null());
  EXPECT_EQ(test::read_file(rd.metrics_path()), "");
}

TEST(TrainReport, MetricsResumeNamesAMalformedLineAndRestartStartsANewFile) {
  test::TempDir tmp;
  RunDir rd(tmp / "run");
  TrainReport report(rd);
  test::write_file(rd.metrics_path(), record(1, 1) + "not json\n" + record(3, 1));
  try {
    report.metrics_resume_at(3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(rd.metrics_path().string() + ":2: not a metrics record"),
              std::string::npos)
        << e.what();
  }
  report.metrics_restart();
  EXPECT_FALSE(fs::exists(rd.metrics_path()));
  EXPECT_NE(test::read_file(tmp / "run" / "log.txt").find("removed 3 records"), std::string::npos);
}

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
  const IntervalMetrics back = IntervalMetrics::from_json(iv.to_json(), "state.json", 4);
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
  EXPECT_EQ(IntervalMetrics::from_json(old, "state.json", 4).to_json(), iv.to_json());
}

// Domino's two CE sums (ObjectiveMetrics) reach metrics.jsonl as means over Σw, survive a
// checkpoint, and stay out of the other objectives' records; a malformed entry is named.
TEST(TrainReport, DominoTermsReachTheRecordAsMeansOverTheWeights) {
  IntervalMetrics iv(kK);
  DrafterStepResult a = applied_step(1.0), b = applied_step(1.0);
  for (DrafterStepResult* r : {&a, &b}) {
    r->metrics.domino = true;
    r->metrics.domino_final_ce_sum = 3.0;
    r->metrics.domino_base_ce_sum = 5.0;
  }
  iv.add_step(a, 100, 40, StepTimes{0, 0, 0, 1});
  iv.add_step(b, 100, 40, StepTimes{0, 0, 0, 1});
  const json r = interval_record(iv, 2, 0, 1e-3, 0);
  EXPECT_DOUBLE_EQ(r.at("domino_ce_final").get<double>(), 1.5);  // Σ w·CE(F) 6 over Σ w 4
  EXPECT_DOUBLE_EQ(r.at("domino_ce_base").get<double>(), 2.5);
  const IntervalMetrics back = IntervalMetrics::from_json(iv.to_json(), "state.json", kK);
  EXPECT_EQ(back.to_json(), iv.to_json());
  for (const char* k : {"loss", "domino_ce_final", "domino_ce_base"}) {
    EXPECT_EQ(interval_record(back, 2, 0, 1e-3, 0).at(k), r.at(k)) << k;
  }
  IntervalMetrics plain(kK);
  plain.add_step(applied_step(1.0), 100, 40, StepTimes{0, 0, 0, 1});
  EXPECT_FALSE(plain.to_json().contains("domino_sums"));
  EXPECT_FALSE(interval_record(plain, 1, 0, 1e-3, 0).contains("domino_ce_final"));
  json bad = iv.to_json();
  bad["domino_sums"] = json::array({1.0});
  try {
    IntervalMetrics::from_json(bad, "state.json", kK);
    ADD_FAILURE() << "no error for a short domino_sums";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state.json: key 'domino_sums' must be a list of 2"),
              std::string::npos)
        << e.what();
  }
}

// DSpark's term sums (ObjectiveMetrics) reach metrics.jsonl as means over Σw, survive a
// checkpoint, and stay out of the other objectives' records; a malformed entry is named.
TEST(TrainReport, DsparkTermsReachTheRecordAsMeansOverTheWeights) {
  IntervalMetrics iv(kK);
  DrafterStepResult a = applied_step(1.0), b = applied_step(1.0);
  for (DrafterStepResult* r : {&a, &b}) {
    r->metrics.dspark = true;
    r->metrics.dspark_ce_sum = 4.0;
    r->metrics.dspark_l1_sum = 1.0;
    r->metrics.dspark_bce_sum = 0.5;
    r->metrics.dspark_acc_sum = 1.5;
  }
  iv.add_step(a, 100, 40, StepTimes{0, 0, 0, 1});
  iv.add_step(b, 100, 40, StepTimes{0, 0, 0, 1});
  const json r = interval_record(iv, 2, 0, 1e-3, 0);
  EXPECT_DOUBLE_EQ(r.at("dspark_ce").get<double>(), 2.0);  // Σ w·CE 8 over Σ w 4
  EXPECT_DOUBLE_EQ(r.at("dspark_l1").get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(r.at("dspark_bce").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(r.at("dspark_acc").get<double>(), 0.75);
  const IntervalMetrics back = IntervalMetrics::from_json(iv.to_json(), "state.json", kK);
  EXPECT_EQ(back.to_json(), iv.to_json());
  const json rb = interval_record(back, 2, 0, 1e-3, 0);
  for (const char* k : {"loss", "dspark_ce", "dspark_l1", "dspark_bce", "dspark_acc"}) {
    EXPECT_EQ(rb.at(k), r.at(k)) << k;
  }
  IntervalMetrics plain(kK);
  plain.add_step(applied_step(1.0), 100, 40, StepTimes{0, 0, 0, 1});
  EXPECT_FALSE(plain.to_json().contains("dspark_sums"));
  for (const char* k : {"dspark_ce", "dspark_l1", "dspark_bce", "dspark_acc"}) {
    EXPECT_FALSE(interval_record(plain, 1, 0, 1e-3, 0).contains(k)) << k;
  }
  json bad = iv.to_json();
  bad["dspark_sums"] = json::array({1.0, 2.0});
  try {
    IntervalMetrics::from_json(bad, "state.json", kK);
    ADD_FAILURE() << "no error for a short dspark_sums";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state.json: key 'dspark_sums' must be a list of 4"),
              std::string::npos)
        << e.what();
  }
}
