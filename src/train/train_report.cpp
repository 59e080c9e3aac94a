// dflash.cpp — log.txt, metrics.jsonl and status.json of a run (see train_report.hpp).
#include "train/train_report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_util.hpp"
#include "core/log.hpp"

namespace dflash {

namespace fs = std::filesystem;
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
  switch (r.skip) {
    case StepSkip::none:
      obj.merge(r.metrics);
      grad_norm_sum += r.grad_norm;
      break;
    case StepSkip::non_finite:
      skipped_non_finite += 1;
      break;
    case StepSkip::no_supervised_slot:
      skipped_no_supervised += 1;
      break;
  }
  steps += 1;
  tokens += step_tokens;
  supervised += step_supervised;
  t_data += t.data;
  t_target += t.target;
  t_drafter += t.drafter;
  t_gpu_drafter += r.drafter_device_s.value_or(0.0);
  t_gpu_optimizer += r.optimizer_device_s.value_or(0.0);
  t_host_wait += r.host_wait_s.value_or(0.0);
  t_total += t.total;
  t_checkpoint += t.checkpoint;
}

json IntervalMetrics::to_json() const {
  json j = {{"loss_weighted_sum", obj.loss_weighted_sum},
            {"weight_sum", obj.weight_sum},
            {"slot_correct", obj.slot_correct},
            {"slot_count", obj.slot_count},
            {"accept_len_sum", obj.accept_len_sum},
            {"blocks", obj.blocks},
            {"K", obj.K},
            {"grad_norm_sum", grad_norm_sum},
            {"steps", steps},
            {"skipped_non_finite", skipped_non_finite},
            {"skipped_no_supervised", skipped_no_supervised},
            {"tokens", tokens},
            {"supervised", supervised},
            {"t_data", t_data},
            {"t_target", t_target},
            {"t_drafter", t_drafter},
            {"t_gpu_drafter", t_gpu_drafter},
            {"t_gpu_optimizer", t_gpu_optimizer},
            {"t_host_wait", t_host_wait},
            {"t_checkpoint", t_checkpoint},
            {"t_total", t_total}};
  if (obj.dspark) {  // DSpark's term sums (ObjectiveMetrics)
    j["dspark_sums"] = {obj.dspark_ce_sum, obj.dspark_l1_sum, obj.dspark_bce_sum,
                        obj.dspark_acc_sum};
  }
  if (obj.domino) {  // Domino's term sums (ObjectiveMetrics)
    j["domino_sums"] = {obj.domino_final_ce_sum, obj.domino_base_ce_sum};
  }
  return j;
}

IntervalMetrics IntervalMetrics::from_json(const json& j, const std::string& src, int block_size) {
  const int K = static_cast<int>(json_int(j, "K", src, block_size, block_size));
  IntervalMetrics m(K);
  m.obj.loss_weighted_sum = json_double(j, "loss_weighted_sum", src);
  m.obj.weight_sum = json_double(j, "weight_sum", src);
  // Sized by K (checked above), never by the file.
  auto read_counts = [&](const char* key, std::vector<int64_t>& dst) {
    const json& a = json_member(j, key, src);
    DFLASH_CHECK(a.is_array() && a.size() == static_cast<size_t>(K),
                 "{}: key '{}' must be a list of {} counts (one per block slot)", src, key, K);
    for (size_t k = 0; k < a.size(); ++k) {
      // An unsigned value above INT64_MAX reads as negative and is refused.
      DFLASH_CHECK(a[k].is_number_integer() && a[k].get<int64_t>() >= 0,
                   "{}: key '{}' must hold non-negative integers, got {}", src, key, a[k].dump());
      dst[k] = a[k].get<int64_t>();
    }
  };
  read_counts("slot_correct", m.obj.slot_correct);
  read_counts("slot_count", m.obj.slot_count);
  for (int k = 0; k < K; ++k) {
    DFLASH_CHECK(m.obj.slot_correct[k] <= m.obj.slot_count[k],
                 "{}: slot {} has more correct predictions ({}) than predictions ({})", src, k,
                 m.obj.slot_correct[k], m.obj.slot_count[k]);
  }
  m.obj.accept_len_sum = json_double(j, "accept_len_sum", src);
  m.obj.blocks = json_int(j, "blocks", src, 0);
  m.grad_norm_sum = json_double(j, "grad_norm_sum", src);
  m.steps = json_int(j, "steps", src, 0);
  // Absent in checkpoints written before skips were counted per interval; their reports took
  // every step of the interval as applied, and so does a resume from them.
  m.skipped_non_finite =
      j.contains("skipped_non_finite") ? json_int(j, "skipped_non_finite", src, 0, m.steps) : 0;
  m.skipped_no_supervised = j.contains("skipped_no_supervised")
                                ? json_int(j, "skipped_no_supervised", src, 0, m.steps)
                                : 0;
  DFLASH_CHECK(m.applied() >= 0, "{}: {} + {} skipped steps in an interval of {}", src,
               m.skipped_non_finite, m.skipped_no_supervised, m.steps);
  m.tokens = json_int(j, "tokens", src, 0);
  m.supervised = json_int(j, "supervised", src, 0);
  m.t_data = json_double(j, "t_data", src);
  m.t_target = json_double(j, "t_target", src);
  m.t_drafter = json_double(j, "t_drafter", src);
  // Absent in checkpoints written before the CUDA step.
  m.t_gpu_drafter = j.contains("t_gpu_drafter") ? json_double(j, "t_gpu_drafter", src) : 0.0;
  // Absent in checkpoints written before the memory plan.
  m.t_gpu_optimizer =
      j.contains("t_gpu_optimizer") ? json_double(j, "t_gpu_optimizer", src) : 0.0;
  m.t_host_wait = j.contains("t_host_wait") ? json_double(j, "t_host_wait", src) : 0.0;
  // Absent in checkpoints written before the pipeline measured it.
  m.t_checkpoint = j.contains("t_checkpoint") ? json_double(j, "t_checkpoint", src) : 0.0;
  m.t_total = json_double(j, "t_total", src);
  // DSpark's term sums (absent for the other objectives and in checkpoints written before).
  if (j.contains("dspark_sums")) {
    const json& d = j.at("dspark_sums");
    DFLASH_CHECK(d.is_array() && d.size() == 4 &&
                     std::all_of(d.begin(), d.end(), [](const json& v) { return v.is_number(); }),
                 "{}: key 'dspark_sums' must be a list of 4 numbers (Σw·CE, Σw·L1, Σw·BCE, "
                 "Σw·acc), got {}",
                 src, d.dump());
    m.obj.dspark = true;
    m.obj.dspark_ce_sum = d[0].get<double>();
    m.obj.dspark_l1_sum = d[1].get<double>();
    m.obj.dspark_bce_sum = d[2].get<double>();
    m.obj.dspark_acc_sum = d[3].get<double>();
  }
  // Domino's term sums (absent for the other objectives and in checkpoints written before).
  if (j.contains("domino_sums")) {
    const json& d = j.at("domino_sums");
    DFLASH_CHECK(d.is_array() && d.size() == 2 &&
                     std::all_of(d.begin(), d.end(), [](const json& v) { return v.is_number(); }),
                 "{}: key 'domino_sums' must be a list of 2 numbers (Σw·CE(F), Σw·CE(U)), got {}",
                 src, d.dump());
    m.obj.domino = true;
    m.obj.domino_final_ce_sum = d[0].get<double>();
    m.obj.domino_base_ce_sum = d[1].get<double>();
  }
  return m;
}

json interval_record(const IntervalMetrics& iv, int64_t step, int64_t epoch, double lr,
                     int64_t skipped_total) {
  const auto steps = static_cast<double>(std::max<int64_t>(1, iv.steps));
  json r = {{"step", step}, {"epoch", epoch}, {"lr", lr}};
  // Loss, accuracy, τ and gradient norm exist only over applied steps: never 0 for "none".
  if (iv.applied() > 0) {
    json slot_acc = json::array();
    for (int k = 1; k < iv.obj.K; ++k) {
      const double a = iv.obj.slot_accuracy(k);
      slot_acc.push_back(std::isnan(a) ? json(nullptr) : json(a));
    }
    r["loss"] = iv.obj.loss();
    r["accuracy"] = iv.obj.accuracy();
    r["slot_accuracy"] = slot_acc;
    r["tau"] = iv.obj.tau();
    r["grad_norm"] = iv.grad_norm_sum / static_cast<double>(iv.applied());
    if (iv.obj.dspark && iv.obj.weight_sum > 0) {  // DSpark's terms, each Σ w·term / Σ w
      const double w = iv.obj.weight_sum;
      r["dspark_ce"] = iv.obj.dspark_ce_sum / w;
      r["dspark_l1"] = iv.obj.dspark_l1_sum / w;
      r["dspark_bce"] = iv.obj.dspark_bce_sum / w;
      r["dspark_acc"] = iv.obj.dspark_acc_sum / w;
    }
    if (iv.obj.domino && iv.obj.weight_sum > 0) {  // Domino's terms, each Σ w·CE / Σ w
      r["domino_ce_final"] = iv.obj.domino_final_ce_sum / iv.obj.weight_sum;
      r["domino_ce_base"] = iv.obj.domino_base_ce_sum / iv.obj.weight_sum;
    }
  }
  r["interval_steps"] = iv.steps;
  r["interval_skipped"] = iv.steps - iv.applied();
  if (iv.applied() < iv.steps) {
    json reasons = json::object();
    if (iv.skipped_non_finite > 0) reasons["non_finite"] = iv.skipped_non_finite;
    if (iv.skipped_no_supervised > 0) reasons["no_supervised_slot"] = iv.skipped_no_supervised;
    r["interval_skip_reasons"] = reasons;
  }
  r["skipped_steps"] = skipped_total;
  r["tokens_per_s"] = iv.t_total > 0 ? static_cast<double>(iv.tokens) / iv.t_total : 0.0;
  r["supervised_tokens_per_s"] =
      iv.t_total > 0 ? static_cast<double>(iv.supervised) / iv.t_total : 0.0;
  r["s_per_step"] = iv.t_total / steps;
  r["s_data"] = iv.t_data / steps;
  r["s_target"] = iv.t_target / steps;
  r["s_drafter"] = iv.t_drafter / steps;
  // Only backends that time the device report it (a CPU run has no such figure, not 0).
  if (iv.t_gpu_drafter > 0) r["s_drafter_gpu"] = iv.t_gpu_drafter / steps;
  if (iv.t_gpu_optimizer > 0) r["s_optimizer_gpu"] = iv.t_gpu_optimizer / steps;
  if (iv.t_gpu_drafter > 0 && iv.t_gpu_optimizer > 0) {
    // t_target holds the target's device time when the backend measured the drafter's.
    r["s_device"] = (iv.t_target + iv.t_gpu_drafter + iv.t_gpu_optimizer) / steps;
  }
  if (iv.t_host_wait > 0) r["s_host_wait"] = iv.t_host_wait / steps;
  // Seconds of the interval (not per step) spent handing out checkpoint state; s_per_step and
  // tokens_per_s exclude them.
  if (iv.t_checkpoint > 0) r["checkpoint_state_s"] = iv.t_checkpoint;
  r["rss_bytes"] = rss_bytes();
  return r;
}

namespace {

// "non_finite 2, no_supervised_slot 1" from a record's interval_skip_reasons.
std::string skip_reasons_text(const json& record) {
  std::vector<std::string> reasons;
  for (const auto& [reason, n] : record.at("interval_skip_reasons").items()) {
    reasons.push_back(fmt::format("{} {}", reason, n.get<int64_t>()));
  }
  return fmt::format("{}", fmt::join(reasons, ", "));
}

}  // namespace

std::string record_summary(const json& record) {
  const auto step = record.at("step").get<int64_t>();
  if (!record.contains("loss")) {
    return fmt::format(
        "no loss or τ: all steps of the interval ending at step {} were skipped ({})", step,
        skip_reasons_text(record));
  }
  std::string out =
      fmt::format("loss {:.4f}, simulated τ {:.3f} (interval ending at step {})",
                  record.at("loss").get<double>(), record.at("tau").get<double>(), step);
  // Records written before skips were counted per interval have no interval fields.
  const auto skipped = record.value("interval_skipped", int64_t{0});
  if (skipped > 0) {
    out += fmt::format("; skipped {} of {} steps ({})", skipped,
                       record.at("interval_steps").get<int64_t>(), skip_reasons_text(record));
  }
  return out;
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
  if (!topology.empty()) j["topology"] = topology;
  if (!workers.is_null()) j["workers"] = workers;
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
  std::string line = fmt::format("step {}/{}", step, total_steps);
  if (record.contains("loss")) {
    line += fmt::format(" loss {:.4f} acc {:.3f} τ {:.3f}", record.at("loss").get<double>(),
                        record.at("accuracy").get<double>(), record.at("tau").get<double>());
  }
  line += fmt::format(" lr {:.2e}", record.at("lr").get<double>());
  if (record.contains("grad_norm")) {
    line += fmt::format(" grad {:.3f}", record.at("grad_norm").get<double>());
  }
  line += fmt::format(" {:.0f} tok/s", record.at("tokens_per_s").get<double>());
  const auto skipped = record.at("interval_skipped").get<int64_t>();
  if (skipped > 0) {
    line += fmt::format(" | skipped {} of {} steps ({}){}", skipped,
                        record.at("interval_steps").get<int64_t>(), skip_reasons_text(record),
                        record.contains("loss") ? "" : ": no loss, accuracy or τ");
  }
  log(line);
  status_.phase = "training";
  status_.step = step;
  status_.total_steps = total_steps;
  status_.eta_s = eta_s;
  status_.last = record;
  write_status();
}

void TrainReport::metrics_restart() {
  const fs::path p = rd_.metrics_path();
  if (!fs::exists(p)) return;
  const std::string text = read_file_text(p);
  const auto records = std::count(text.begin(), text.end(), '\n');
  std::error_code ec;
  fs::remove(p, ec);
  DFLASH_CHECK(!ec, "cannot remove '{}': {}", p.string(), ec.message());
  log(
      fmt::format("metrics.jsonl: removed {} records of an earlier attempt that stopped before its "
                  "first checkpoint",
                  records));
}

json TrainReport::metrics_resume_at(int64_t step) {
  const fs::path p = rd_.metrics_path();
  status_.last = nullptr;
  if (!fs::exists(p)) return nullptr;
  const std::string text = read_file_text(p);
  if (text.empty()) return nullptr;
  std::vector<std::pair<int64_t, std::string_view>> kept;  // (step, line) in file order
  int64_t past = 0, superseded = 0, line_no = 0;
  size_t pos = 0;
  bool torn = false;
  while (pos < text.size()) {
    const size_t nl = std::min(text.find('\n', pos), text.size());
    const std::string_view line(text.data() + pos, nl - pos);
    const bool last_unterminated = nl == text.size();
    pos = nl + 1;
    ++line_no;
    int64_t s = 0;
    try {
      s = json::parse(line).at("step").get<int64_t>();
    } catch (const json::exception& e) {
      if (last_unterminated) {  // an append cut short by a kill
        torn = true;
        break;
      }
      fail("{}:{}: not a metrics record: {}", p.string(), line_no, e.what());
    }
    // A step at or before the last kept one begins a later attempt, which supersedes the
    // earlier attempt's records from that step on.
    while (!kept.empty() && kept.back().first >= s) {
      kept.pop_back();
      ++superseded;
    }
    if (s > step) {
      ++past;
    } else {
      kept.emplace_back(s, line);
    }
  }
  const bool dropped = past > 0 || superseded > 0 || torn;
  if (dropped || text.back() != '\n') {
    std::string out;
    for (const auto& [s, line] : kept) (out += line) += '\n';
    write_file_atomic(p, out);
  }
  if (dropped) {
    log(
        fmt::format("metrics.jsonl: kept {} records up to step {}; dropped {} past it, {} "
                    "superseded by a later attempt{}",
                    kept.size(), step, past, superseded, torn ? ", and a torn last line" : ""));
  }
  if (!kept.empty()) status_.last = json::parse(kept.back().second);
  return status_.last;
}

}  // namespace dflash
