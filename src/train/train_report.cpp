// dflash.cpp — log.txt, metrics.jsonl and status.json of a run (see train_report.hpp).
#include "train/train_report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/log.hpp"

namespace dflash {

using json = nlohmann::json;

int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

// ------------------------------------------------------------------------------ interval metrics

void IntervalMetrics::add_step(const DrafterStepResult& r, int64_t step_tokens,
                               int64_t step_supervised, const StepTimes& t) {
  if (!r.skipped()) {
    obj.merge(r.metrics);
    grad_norm_sum += r.grad_norm;
  }
  steps += 1;
  tokens += step_tokens;
  supervised += step_supervised;
  t_data += t.data;
  t_target += t.target;
  t_drafter += t.drafter;
  t_gpu_drafter += r.drafter_device_s.value_or(0.0);
  t_total += t.total;
}

json IntervalMetrics::to_json() const {
  return {{"loss_weighted_sum", obj.loss_weighted_sum},
          {"weight_sum", obj.weight_sum},
          {"slot_correct", obj.slot_correct},
          {"slot_count", obj.slot_count},
          {"accept_len_sum", obj.accept_len_sum},
          {"blocks", obj.blocks},
          {"K", obj.K},
          {"grad_norm_sum", grad_norm_sum},
          {"steps", steps},
          {"tokens", tokens},
          {"supervised", supervised},
          {"t_data", t_data},
          {"t_target", t_target},
          {"t_drafter", t_drafter},
          {"t_gpu_drafter", t_gpu_drafter},
          {"t_total", t_total}};
}

IntervalMetrics IntervalMetrics::from_json(const json& j) {
  try {
    IntervalMetrics m(j.at("K").get<int>());
    m.obj.loss_weighted_sum = j.at("loss_weighted_sum");
    m.obj.weight_sum = j.at("weight_sum");
    m.obj.slot_correct = j.at("slot_correct").get<std::vector<int64_t>>();
    m.obj.slot_count = j.at("slot_count").get<std::vector<int64_t>>();
    m.obj.accept_len_sum = j.at("accept_len_sum");
    m.obj.blocks = j.at("blocks");
    m.grad_norm_sum = j.at("grad_norm_sum");
    m.steps = j.at("steps");
    m.tokens = j.at("tokens");
    m.supervised = j.at("supervised");
    m.t_data = j.at("t_data");
    m.t_target = j.at("t_target");
    m.t_drafter = j.at("t_drafter");
    m.t_gpu_drafter = j.value("t_gpu_drafter", 0.0);  // absent in checkpoints before the CUDA step
    m.t_total = j.at("t_total");
    return m;
  } catch (const json::exception& e) {
    fail("interval metrics: {}", e.what());
  }
}

json interval_record(const IntervalMetrics& iv, int64_t step, int64_t epoch, double lr,
                     int64_t skipped_total) {
  const auto steps = static_cast<double>(std::max<int64_t>(1, iv.steps));
  std::vector<double> slot_acc;
  for (int k = 1; k < iv.obj.K; ++k) {
    const double a = iv.obj.slot_accuracy(k);
    slot_acc.push_back(std::isnan(a) ? 0.0 : a);
  }
  json r = {
      {"step", step},
      {"epoch", epoch},
      {"lr", lr},
      {"loss", iv.obj.loss()},
      {"accuracy", iv.obj.accuracy()},
      {"slot_accuracy", slot_acc},
      {"tau", iv.obj.tau()},
      {"grad_norm", iv.grad_norm_sum / steps},
      {"skipped_steps", skipped_total},
      {"tokens_per_s", iv.t_total > 0 ? static_cast<double>(iv.tokens) / iv.t_total : 0.0},
      {"supervised_tokens_per_s",
       iv.t_total > 0 ? static_cast<double>(iv.supervised) / iv.t_total : 0.0},
      {"s_per_step", iv.t_total / steps},
      {"s_data", iv.t_data / steps},
      {"s_target", iv.t_target / steps},
      {"s_drafter", iv.t_drafter / steps},
  };
  // Only backends that time the device report it (a CPU run has no such figure, not 0).
  if (iv.t_gpu_drafter > 0) r["s_drafter_gpu"] = iv.t_gpu_drafter / steps;
  r["rss_bytes"] = rss_bytes();
  return r;
}

// ------------------------------------------------------------------------------------------ data

json data_counts_json(const DatasetStats& st) {
  return {{"records", st.records},
          {"conversations", st.conversations},
          {"tokens", st.tokens},
          {"supervised_tokens", st.supervised_tokens},
          {"skipped_invalid", st.skipped_invalid},
          {"invalid_by_kind", st.invalid_by_kind},
          {"truncated", st.truncated},
          {"truncated_tokens", st.truncated_tokens},
          {"zero_supervised", st.zero_supervised}};
}

std::string data_counts_line(const DatasetStats& st, int64_t max_length) {
  std::vector<std::string> kinds;
  for (const auto& [kind, n] : st.invalid_by_kind) kinds.push_back(fmt::format("{} {}", kind, n));
  return fmt::format(
      "data: {} records, {} conversations kept ({} tokens, {} supervised); {} invalid records "
      "skipped{}; {} truncated to max_length {} ({} tokens cut); {} left out without a "
      "supervised token",
      st.records, st.conversations, st.tokens, st.supervised_tokens, st.skipped_invalid,
      kinds.empty() ? "" : fmt::format(" ({})", fmt::join(kinds, ", ")), st.truncated, max_length,
      st.truncated_tokens, st.zero_supervised);
}

// ----------------------------------------------------------------------------------------- status

json TrainStatus::to_json() const {
  json j = {{"phase", phase}, {"pid", ::getpid()}};
  if (step) j["step"] = *step;
  if (total_steps) j["total_steps"] = *total_steps;
  if (eta_s) j["eta_s"] = *eta_s;
  if (!last.is_null()) j["last"] = last;
  if (!data.is_null()) j["data"] = data;
  if (!checkpoint.empty()) j["checkpoint"] = checkpoint;
  if (!error.empty()) j["error"] = error;
  return j;
}

TrainReport::TrainReport(RunDir& rd) : rd_(rd), log_(rd.path() / "log.txt", std::ios::app) {
  DFLASH_CHECK(log_.good(), "cannot open '{}' for appending", (rd.path() / "log.txt").string());
  status_.phase = "loading";
  write_status();
}

void TrainReport::log(const std::string& msg) {
  spdlog::info("{}", msg);
  log_ << msg << "\n";
  log_.flush();
}

void TrainReport::log_error(const std::string& msg) {
  log_ << "error: " << msg << "\n";
  log_.flush();
}

void TrainReport::write_status() {
  rd_.write_status(status_.to_json());
}

void TrainReport::interval(const json& record, int64_t total_steps, double eta_s) {
  rd_.append_metrics(record);
  const int64_t step = record.at("step").get<int64_t>();
  log(fmt::format("step {}/{} loss {:.4f} acc {:.3f} τ {:.3f} lr {:.2e} grad {:.3f} {:.0f} tok/s",
                  step, total_steps, record.at("loss").get<double>(),
                  record.at("accuracy").get<double>(), record.at("tau").get<double>(),
                  record.at("lr").get<double>(), record.at("grad_norm").get<double>(),
                  record.at("tokens_per_s").get<double>()));
  status_.phase = "training";
  status_.step = step;
  status_.total_steps = total_steps;
  status_.eta_s = eta_s;
  status_.last = record;
  write_status();
}

}  // namespace dflash
