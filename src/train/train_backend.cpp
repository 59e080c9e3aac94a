// dflash.cpp — the backend factory and the bookkeeping shared by drafter stages (see
// train_backend.hpp).
#include "train/train_backend.hpp"

#include <cmath>

#include "core/error.hpp"

namespace dflash {

TrainBackend train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                  const DrafterConfig& cfg, const DrafterLayout& layout) {
  train_backend_check(opts);
  if (opts.backend == "cpu") return cpu_train_backend_create(opts, target, cfg, layout);
  if (opts.backend == "cuda") return cuda_train_backend_create(opts, target, cfg, layout);
  fail("runtime.backend '{}' is not known (cpu or cuda)", opts.backend);
}

void train_backend_check(const TrainBackendOptions& opts) {
  if (opts.backend == "cpu") return;
  if (opts.backend == "cuda") return cuda_train_backend_check(opts);
  fail("runtime.backend '{}' is not known (cpu or cuda)", opts.backend);
}

void StepQueue::stepped(DrafterStepResult r) {
  DFLASH_CHECK(!waiting_, "drafter stage: step() called twice without update() in between");
  waiting_ = std::move(r);
}

DrafterStepResult StepQueue::take_stepped() {
  DFLASH_CHECK(waiting_.has_value(), "drafter stage: update() without a step() to finish");
  DrafterStepResult r = std::move(*waiting_);
  waiting_.reset();
  return r;
}

DrafterStepResult StepQueue::pop() {
  DFLASH_CHECK(!done_.empty(), "drafter stage: result() without an updated step to report");
  DrafterStepResult r = std::move(done_.front());
  done_.pop_front();
  return r;
}

void drafter_state_check(const DrafterState& s, int64_t total) {
  const auto n = static_cast<size_t>(total);
  DFLASH_CHECK(s.params.size() == n, "drafter state: {} master weights for {} parameters",
               s.params.size(), n);
  DFLASH_CHECK(s.adam_m.size() == n, "drafter state: {} first moments (adam_m) for {} parameters",
               s.adam_m.size(), n);
  DFLASH_CHECK(s.adam_v.size() == n, "drafter state: {} second moments (adam_v) for {} parameters",
               s.adam_v.size(), n);
  DFLASH_CHECK(s.updates >= 0, "drafter state: negative update count {}", s.updates);
}

bool step_decide_update(DrafterStepResult& r, double clip_grad_norm) {
  if (r.skipped()) return false;
  if (!std::isfinite(r.metrics.loss_weighted_sum) || !std::isfinite(r.grad_norm)) {
    r.skip = StepSkip::non_finite;
    return false;
  }
  r.clip = clip_scale(r.grad_norm, clip_grad_norm);
  return true;
}

}  // namespace dflash
