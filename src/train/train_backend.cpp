// dflash.cpp — the backend factory and the bookkeeping shared by drafter stages (see
// train_backend.hpp).
#include "train/train_backend.hpp"

#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "train/job.hpp"

namespace dflash {

TrainBackend train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                  const DrafterConfig& cfg, const DrafterLayout& layout) {
  train_backend_check(opts);
  if (opts.backend == "cpu") return cpu_train_backend_create(opts, target, cfg, layout);
  if (opts.backend == "cuda") {
    return cuda_train_backend_create(opts, target, cfg, layout);
  }
  fail("runtime.backend '{}' is not known (cpu or cuda)", opts.backend);
}

void train_backend_check(const TrainBackendOptions& opts) {
  if (opts.backend == "cpu") return;
  if (opts.backend == "cuda") return cuda_train_backend_check(opts);
  fail("runtime.backend '{}' is not known (cpu or cuda)", opts.backend);
}

std::unique_ptr<TargetStage> target_stage_create(const TrainBackendOptions& opts, int device,
                                                 const TargetModel& target,
                                                 const DrafterConfig& cfg) {
  if (opts.backend == "cpu") return cpu_target_stage_create(target, cfg);
  if (opts.backend == "cuda") {
    return cuda_target_stage_create(opts, device, target, cfg);
  }
  fail("runtime.backend '{}' is not known (cpu or cuda)", opts.backend);
}

std::unique_ptr<DrafterStage> drafter_stage_create(const TrainBackendOptions& opts, int device,
                                                   const TargetModel& target,
                                                   const DrafterConfig& cfg,
                                                   const DrafterLayout& layout,
                                                   const std::shared_ptr<CollectiveGroup>& group,
                                                   int replica) {
  if (opts.backend == "cpu") {
    std::unique_ptr<Collective> member;
    if (group) member = group->host_member(replica);
    return cpu_drafter_stage_create(opts, target, cfg, layout, std::move(member));
  }
  if (opts.backend == "cuda") {
    return cuda_drafter_stage_create(opts, device, target, cfg, layout, group, replica);
  }
  fail("runtime.backend '{}' is not known (cpu or cuda)", opts.backend);
}

std::shared_ptr<CollectiveGroup> collective_group_create(const std::string& backend,
                                                         const std::vector<int>& devices,
                                                         Job* job) {
  if (job != nullptr && job->size() > 1) {
    const int local = static_cast<int>(devices.size());
    if (backend == "cpu") return job->host_collective(local);
    if (backend == "cuda") {
      const std::string id = job->broadcast(job->rank() == 0 ? nccl_unique_id() : std::string());
      return nccl_collective_group_create(devices, job->size() * local, job->rank() * local, id);
    }
    fail("runtime.backend '{}' is not known (cpu or cuda)", backend);
  }
  if (devices.size() <= 1) return nullptr;
  if (backend == "cpu") return LocalCollectiveGroup::create(static_cast<int>(devices.size()));
  if (backend == "cuda") return cuda_collective_group_create(devices);
  fail("runtime.backend '{}' is not known (cpu or cuda)", backend);
}

std::string train_backend_describe(const TrainBackendOptions& opts) {
  if (opts.backend == "cuda") return cuda_backend_describe(opts);
  return fmt::format("{}, {} threads per worker", opts.backend, parallel_threads());
}

void StepQueue::stepped(DrafterStepResult r) {
  DFLASH_CHECK(!waiting_, "drafter stage: step() called twice without update() in between");
  if (poison_next_) r.metrics.loss_weighted_sum = std::numeric_limits<double>::quiet_NaN();
  poison_next_ = false;
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

bool replicas_non_finite(Collective& collective, const DrafterStepResult& r) {
  double non_finite[1] = {std::isfinite(r.metrics.loss_weighted_sum) ? 0.0 : 1.0};
  collective.all_reduce_sum_host(non_finite);
  return non_finite[0] != 0.0;
}

bool step_decide_update(DrafterStepResult& r, double clip_grad_norm, bool peer_non_finite) {
  if (r.skipped()) return false;
  if (peer_non_finite || !std::isfinite(r.metrics.loss_weighted_sum) ||
      !std::isfinite(r.grad_norm)) {
    r.skip = StepSkip::non_finite;
    return false;
  }
  r.clip = clip_scale(r.grad_norm, clip_grad_norm);
  return true;
}

}  // namespace dflash
