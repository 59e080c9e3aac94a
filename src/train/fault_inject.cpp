// dflash.cpp — fault injection for the pipeline's failure tests (see fault_inject.hpp).
#include "train/fault_inject.hpp"

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <thread>
#include <vector>

#include "core/error.hpp"

namespace dflash {

namespace {

constexpr const char* kVar = "DFLASH_FAULT_INJECT";

int64_t parse_int(const std::string& field, const std::string& what, const std::string& text) {
  size_t used = 0;
  int64_t v = -1;
  try {
    v = std::stoll(field, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DFLASH_CHECK(used == field.size() && !field.empty() && v >= 0,
               "{}={}: {} must be a non-negative integer, got '{}'", kVar, text, what, field);
  return v;
}

}  // namespace

FaultSpec fault_spec_parse(const std::string& text) {
  std::vector<std::string> f;
  std::stringstream ss(text);
  for (std::string part; std::getline(ss, part, ':');) f.push_back(part);
  FaultSpec s;
  s.text = text;
  if (f.size() == 5 && f[0].rfind("rank", 0) == 0) {
    s.rank = static_cast<int>(parse_int(f[0].substr(4), "the rank", text));
    f.erase(f.begin());
  }
  DFLASH_CHECK(f.size() == 4,
               "{}={}: expected [rank<K>:]<target|drafter>:<worker>:<step>:<throw|hang|nan>", kVar,
               text);
  if (f[0] == "target") {
    s.stage = WorkerStage::target;
  } else if (f[0] == "drafter") {
    s.stage = WorkerStage::drafter;
  } else {
    fail("{}={}: the stage must be target or drafter, got '{}'", kVar, text, f[0]);
  }
  s.worker = static_cast<int>(parse_int(f[1], "the worker", text));
  s.step = parse_int(f[2], "the step", text);
  DFLASH_CHECK(s.step >= 1, "{}={}: steps count from 1", kVar, text);
  if (f[3] == "throw") {
    s.kind = FaultKind::throw_error;
  } else if (f[3] == "hang") {
    s.kind = FaultKind::hang;
  } else if (f[3] == "nan") {
    s.kind = FaultKind::nan;
  } else {
    fail("{}={}: the fault must be throw, hang or nan, got '{}'", kVar, text, f[3]);
  }
  return s;
}

std::optional<FaultSpec> fault_spec_from_env(const PipelineTopology& topology, int rank,
                                             int ranks) {
  const char* v = std::getenv(kVar);
  if (v == nullptr || *v == '\0') return std::nullopt;
  FaultSpec s = fault_spec_parse(v);
  DFLASH_CHECK(s.rank < ranks, "{}={}: the job has no rank {} (it has {} rank{})", kVar, s.text,
               s.rank, ranks, ranks == 1 ? "" : "s");
  if (s.rank != rank) return std::nullopt;
  const int n = topology.workers(s.stage);
  DFLASH_CHECK(s.worker < n, "{}={}: the run has no {} (it has {} {} worker{})", kVar, s.text,
               PipelineTopology::worker_name(s.stage, s.worker), n,
               s.stage == WorkerStage::target ? "target" : "drafter", n == 1 ? "" : "s");
  return s;
}

FaultInjector::FaultInjector(const std::optional<FaultSpec>& spec, WorkerStage stage, int worker) {
  if (spec && spec->stage == stage && spec->worker == worker) spec_ = spec;
}

std::optional<FaultKind> FaultInjector::at(int64_t step) {
  if (!spec_ || step < spec_->step) return std::nullopt;
  if (spec_->kind == FaultKind::nan) return FaultKind::nan;
  if (fired_) return std::nullopt;
  fired_ = true;
  return spec_->kind;
}

void FaultInjector::apply(FaultKind kind, int64_t step) const {
  if (kind == FaultKind::throw_error) {
    fail("fault injected at step {} ({}={})", step, kVar, spec_ ? spec_->text : "");
  }
  if (kind == FaultKind::hang) {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

}  // namespace dflash
