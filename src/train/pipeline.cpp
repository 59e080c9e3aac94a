// dflash.cpp — the training pipeline (see pipeline.hpp): worker threads, the batch source, the
// coordinator's event loop, the stall watchdog and the stop sequence.
//
// Lifetimes: everything the workers touch lives in one Shared object that each worker thread holds
// through a shared_ptr, so a worker left behind (stuck in a device call, or hung by fault
// injection) never sees freed memory. Each worker creates and destroys its stage on its own thread;
// a target worker keeps its stage until the coordinator releases it, after every queue is drained
// and every drafter has left its step loop (features may refer to the target stage's memory).
#include "train/pipeline.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.hpp"
#include "core/log.hpp"
#include "train/ordered_queue.hpp"

namespace dflash {

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}
double ns_to_s(int64_t ns) {
  return static_cast<double>(ns) * 1e-9;
}

// ------------------------------------------------------------------------------------ workers

enum class Phase : int {
  starting,
  making_batch,
  target_forward,
  waiting_queue,
  waiting_features,
  drafter_step,
  update,
  saving_state,
  idle,
  stopped,
  failed,
};

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::starting:
      return "starting";
    case Phase::making_batch:
      return "making batch";
    case Phase::target_forward:
      return "target forward";
    case Phase::waiting_queue:
      return "waiting for queue space";
    case Phase::waiting_features:
      return "waiting for features";
    case Phase::drafter_step:
      return "drafter step";
    case Phase::update:
      return "update (all-reduce, AdamW)";
    case Phase::saving_state:
      return "saving state";
    case Phase::idle:
      return "finished";
    case Phase::stopped:
      return "stopped";
    case Phase::failed:
      return "failed";
  }
  return "?";
}

// Working phases count as busy and are watched for stalls; waiting phases are neither.
bool phase_works(Phase p) {
  return p == Phase::starting || p == Phase::making_batch || p == Phase::target_forward ||
         p == Phase::drafter_step || p == Phase::update || p == Phase::saving_state;
}

// One worker's status: written by its thread only, read by the coordinator (the phase, its start
// and the busy time under a mutex, so that they are read together; the rest atomics).
struct WorkerState {
  WorkerStage stage = WorkerStage::target;
  int index = 0;
  std::string name, device;
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> tokens{0};
  std::atomic<bool> has_memory{false};
  std::atomic<uint64_t> mem_used{0}, mem_total{0};
  std::atomic<bool> finished{false};  // the thread function returned

  Phase current() const {
    std::lock_guard<std::mutex> lk(mu_);
    return phase_;
  }
  int64_t phase_since() const {
    std::lock_guard<std::mutex> lk(mu_);
    return since_;
  }
  std::pair<Phase, int64_t> phase_and_since() const {
    std::lock_guard<std::mutex> lk(mu_);
    return {phase_, since_};
  }
  void set_phase(Phase p, int64_t t = now_ns()) {
    std::lock_guard<std::mutex> lk(mu_);
    if (phase_works(phase_)) busy_ += t - since_;
    since_ = t;
    phase_ = p;
  }
  // Busy nanoseconds up to `t` ≥ the last phase change.
  int64_t busy_until(int64_t t) const {
    std::lock_guard<std::mutex> lk(mu_);
    return busy_ + (phase_works(phase_) && t > since_ ? t - since_ : 0);
  }
  void set_memory(const std::optional<DeviceMemory>& m) {
    if (!m) return;
    mem_used.store(m->used);
    mem_total.store(m->total);
    has_memory.store(true);
  }

 private:
  mutable std::mutex mu_;
  Phase phase_ = Phase::starting;
  int64_t since_ = now_ns();
  int64_t busy_ = 0;
};

// A replica's input: one batch and its features.
struct FeatureItem {
  DrafterBatch batch;
  std::unique_ptr<TargetFeatures> features;
  std::string source;  // the target worker
  DataCursor cursor;   // after the item's step
  double data_s = 0, target_s = 0;
  std::optional<double> target_device_s;  // the forward's device time, when measured
};

// What workers tell the coordinator.
struct Event {
  enum class Kind { step_done, exited, final_done };
  Event(Kind k, int w) : kind(k), worker(w) {}
  Kind kind;
  int worker;        // index into Shared::workers (target workers first)
  int64_t step = 0;  // step_done: 0-based step
  DrafterStepResult result;
  int64_t tokens = 0, supervised = 0;
  std::string source;
  DataCursor cursor;
  double data_s = 0, target_s = 0, drafter_s = 0;
  std::optional<double> target_device_s;
  double save_s = 0;  // step_done: seconds replica 0 spent handing out its state (checkpoint)
  std::optional<DrafterState> state;
  std::optional<uint64_t> hash;
  std::string error;       // exited, final_done: the worker's error ("" none)
  std::string summary;     // final_done: the drafter stage's summary()
  int64_t last_done = -1;  // exited (drafters): the last 0-based step completed
};

// What the coordinator asks a drafter after its loop.
struct FinalCommand {
  bool save = false;  // send the state
  bool hash = false;  // send the state's hash
};

struct Shared {
  Shared(const PipelineOptions& o, const PipelineHooks& h) : opts(o), hooks(h) {}
  const PipelineOptions opts;
  const PipelineHooks hooks;
  std::vector<std::unique_ptr<WorkerState>> workers;               // targets, then drafters
  std::vector<std::unique_ptr<OrderedQueue<FeatureItem>>> queues;  // per replica

  // Stopping: drafters start no step ≥ stop_before; the source makes none.
  std::atomic<int64_t> stop_before{0};
  std::atomic<bool> failing{false};
  std::mutex ctl;
  std::condition_variable ctl_cv;
  std::vector<int64_t> started;                    // per replica: last step begun (ctl)
  int64_t polled_through = 0;  // hooks.begin_after_poll: last step accounted, news polled (ctl)
  std::vector<std::optional<FinalCommand>> final;  // per replica (ctl)
  bool released = false;                           // target workers may go (ctl)

  // The batch source (src).
  std::mutex src;
  int64_t src_step = 0;
  int src_replica = 0;
  std::optional<StepInput> src_group;

  // Events to the coordinator.
  std::mutex ev;
  std::condition_variable ev_cv;
  std::deque<Event> events;

  int targets() const { return opts.topology.targets(); }
  int drafters() const { return opts.topology.drafters(); }
  WorkerState& drafter(int r) { return *workers[static_cast<size_t>(targets() + r)]; }

  void post(Event e) {
    {
      std::lock_guard<std::mutex> lk(ev);
      events.push_back(std::move(e));
    }
    ev_cv.notify_all();
  }
};

// One batch handed to a target worker.
struct SourceItem {
  int64_t step = 0;
  int replica = 0;
  DrafterBatch batch;
  DataCursor cursor;
  double data_s = 0;
};

// The next batch of the global sequence, or nothing when the run ends or stops.
std::optional<SourceItem> source_take(Shared& sh) {
  std::lock_guard<std::mutex> lk(sh.src);
  const int D = sh.drafters();
  if (sh.src_group && sh.src_replica == D) {
    sh.src_group.reset();
    sh.src_replica = 0;
    ++sh.src_step;
  }
  if (sh.failing.load() || sh.src_step >= sh.opts.end_step ||
      sh.src_step >= sh.stop_before.load()) {
    return std::nullopt;
  }
  if (!sh.src_group) {
    const int64_t t0 = now_ns();
    sh.src_group = sh.hooks.make_step(sh.src_step);
    sh.src_group->data_s = ns_to_s(now_ns() - t0);
    DFLASH_CHECK(static_cast<int>(sh.src_group->batches.size()) == D,
                 "step {}: {} batches for {} drafter replicas", sh.src_step + 1,
                 sh.src_group->batches.size(), D);
  }
  SourceItem it;
  it.step = sh.src_step;
  it.replica = sh.src_replica;
  it.batch = std::move(sh.src_group->batches[static_cast<size_t>(sh.src_replica)]);
  it.cursor = sh.src_group->cursor;
  it.data_s = sh.src_replica == 0 ? sh.src_group->data_s : 0.0;
  ++sh.src_replica;
  return it;
}

// "drafter1 (cpu) failed at step 4: ..."; "stopped" when the run was already failing (the error
// is a consequence, e.g. an aborted collective).
std::string with_worker(const Shared& sh, const WorkerState& w, const std::string& error) {
  const char* what = sh.failing.load() ? "stopped" : "failed";
  const int64_t step = w.step.load();
  return step > 0 ? fmt::format("{} ({}) {} at step {}: {}", w.name, w.device, what, step, error)
                  : fmt::format("{} ({}) {} while starting: {}", w.name, w.device, what, error);
}

void target_main(std::shared_ptr<Shared> sh, int t) {
  WorkerState& w = *sh->workers[static_cast<size_t>(t)];
  std::unique_ptr<TargetStage> stage;
  std::string error;
  try {
    stage = sh->hooks.make_target(t);
    w.set_memory(stage->device_memory());
    FaultInjector faults(sh->opts.fault, WorkerStage::target, t);
    for (;;) {
      w.set_phase(Phase::making_batch);
      std::optional<SourceItem> it = source_take(*sh);
      if (!it) break;
      w.step.store(it->step + 1);
      w.set_phase(Phase::target_forward);
      const std::optional<FaultKind> fault = faults.at(it->step + 1);
      if (fault && *fault != FaultKind::nan) faults.apply(*fault, it->step + 1);
      const int64_t t0 = now_ns();
      FeatureItem item;
      item.features = stage->forward_taps(it->batch);
      if (fault == FaultKind::nan) stage->fill_nan(*item.features);
      item.target_s = ns_to_s(now_ns() - t0);
      item.target_device_s = item.features->device_s;
      w.tokens.fetch_add(it->batch.T());
      w.set_memory(stage->device_memory());
      item.batch = std::move(it->batch);
      item.source = w.name;
      item.cursor = it->cursor;
      item.data_s = it->data_s;
      w.set_phase(Phase::waiting_queue);
      if (!sh->queues[static_cast<size_t>(it->replica)]->put(it->step, std::move(item))) break;
    }
  } catch (const std::exception& e) {
    error = with_worker(*sh, w, e.what());
  }
  w.set_phase(error.empty() ? Phase::idle : Phase::failed);
  Event done(Event::Kind::exited, t);
  done.error = error;
  sh->post(std::move(done));
  {
    std::unique_lock<std::mutex> lk(sh->ctl);
    sh->ctl_cv.wait(lk, [&] { return sh->released; });
  }
  stage.reset();
  w.finished.store(true);
  sh->ev_cv.notify_all();
}

// Registers replica r as starting step s; false when the run stops before s.
bool drafter_begin_step(Shared& sh, int r, int64_t s) {
  std::unique_lock<std::mutex> lk(sh.ctl);
  if (sh.hooks.begin_after_poll) {
    sh.ctl_cv.wait(lk, [&] { return sh.polled_through >= s - 1 || s >= sh.stop_before.load(); });
  }
  if (s >= sh.stop_before.load()) return false;
  sh.started[static_cast<size_t>(r)] = s;
  sh.drafter(r).step.store(s + 1);
  return true;
}

// One step of replica r: its result event (the state attached when asked).
Event drafter_run_step(Shared& sh, int r, int64_t s, DrafterStage& stage, FeatureItem& item,
                       FaultInjector& faults) {
  WorkerState& w = sh.drafter(r);
  w.set_phase(Phase::drafter_step);
  const std::optional<FaultKind> fault = faults.at(s + 1);
  if (fault == FaultKind::nan) {
    stage.inject_nan();
  } else if (fault) {
    faults.apply(*fault, s + 1);
  }
  const int64_t t0 = now_ns();
  stage.step(item.batch, *item.features);
  item.features.reset();
  w.set_phase(Phase::update);
  stage.update(sh.hooks.lr(s));
  Event e(Event::Kind::step_done, sh.targets() + r);
  e.result = stage.result();
  e.drafter_s = ns_to_s(now_ns() - t0);
  if (r == 0 && sh.hooks.checkpoint_after(s + 1)) {
    w.set_phase(Phase::saving_state);
    const int64_t t_save = now_ns();
    e.state.emplace();
    stage.save_state(*e.state);
    e.save_s = ns_to_s(now_ns() - t_save);
  }
  e.step = s;
  e.tokens = item.batch.T();
  e.supervised = item.batch.n_supervised;
  e.source = item.source;
  e.cursor = item.cursor;
  e.data_s = item.data_s;
  e.target_s = item.target_s;
  e.target_device_s = item.target_device_s;
  w.tokens.fetch_add(item.batch.T());
  w.set_memory(stage.device_memory());
  return e;
}

// After the loop: the coordinator's last request (state and/or hash), then the stage goes.
void drafter_final_service(Shared& sh, int r, DrafterStage* stage) {
  WorkerState& w = sh.drafter(r);
  FinalCommand cmd;
  {
    std::unique_lock<std::mutex> lk(sh.ctl);
    sh.ctl_cv.wait(lk, [&] { return sh.final[static_cast<size_t>(r)].has_value(); });
    cmd = *sh.final[static_cast<size_t>(r)];
  }
  Event e(Event::Kind::final_done, sh.targets() + r);
  if (stage) e.summary = stage->summary();
  if (stage && (cmd.save || cmd.hash)) {
    const Phase before = w.current();
    w.set_phase(Phase::saving_state);
    try {
      DrafterState st;
      stage->save_state(st);
      if (cmd.hash) e.hash = drafter_state_hash(st);
      if (cmd.save) e.state = std::move(st);
    } catch (const std::exception& ex) {
      e.error = ex.what();
    }
    w.set_phase(before);
  }
  sh.post(std::move(e));
}

void drafter_main(std::shared_ptr<Shared> sh, int r) {
  WorkerState& w = sh->drafter(r);
  const int id = sh->targets() + r;
  std::unique_ptr<DrafterStage> stage;
  std::string error;
  int64_t last_done = -1;
  try {
    stage = sh->hooks.make_drafter(r);
    stage->load_state(*sh->opts.initial_state);
    w.set_memory(stage->device_memory());
    FaultInjector faults(sh->opts.fault, WorkerStage::drafter, r);
    for (int64_t s = sh->opts.first_step; s < sh->opts.end_step; ++s) {
      if (!drafter_begin_step(*sh, r, s)) break;
      w.set_phase(Phase::waiting_features);
      std::optional<FeatureItem> item = sh->queues[static_cast<size_t>(r)]->take();
      if (!item) break;
      sh->post(drafter_run_step(*sh, r, s, *stage, *item, faults));
      last_done = s;
    }
  } catch (const std::exception& e) {
    error = with_worker(*sh, w, e.what());
  }
  w.set_phase(error.empty() ? Phase::idle : Phase::failed);
  Event done(Event::Kind::exited, id);
  done.error = error;
  done.last_done = last_done;
  sh->post(std::move(done));
  drafter_final_service(*sh, r, stage.get());
  stage.reset();
  w.finished.store(true);
  sh->ev_cv.notify_all();
}

// -------------------------------------------------------------------------------- coordinator

class Coordinator {
 public:
  explicit Coordinator(std::shared_ptr<Shared> sh) : sh_(std::move(sh)) {
    const size_t n = sh_->workers.size();
    exited_.assign(n, false);
    exit_error_.assign(n, "");
    last_done_.assign(n, -1);
    prev_busy_.assign(n, 0);
    prev_tokens_.assign(n, 0);
    next_step_ = sh_->opts.first_step;
    out_.steps_done = next_step_;
    last_state_step_ = next_step_;
  }

  PipelineOutcome run(std::vector<std::thread>& threads);

 private:
  void handle(Event& e);
  void account_ready_steps();
  PipelineStep assemble(int64_t s, std::vector<Event>& evs);
  void fail(const std::string& worker, const std::string& error);
  // Stops before step `before` (a signal: the hooks' stop_step, else the step after the furthest
  // one started).
  void request_stop(std::optional<int64_t> before = std::nullopt);
  // The job's news, at most every 50 ms unless `force`.
  void poll_job(bool force = false);
  void watchdog();
  void tick(bool force);
  bool drafters_out() const;
  void wait_events(double seconds, const std::function<bool()>& done);
  void shutdown(std::vector<std::thread>& threads);
  std::string phases_report() const;

  std::shared_ptr<Shared> sh_;
  PipelineOutcome out_;
  bool failing_ = false, stopping_ = false;
  bool hook_failed_ = false;        // on_step threw: account no further step
  std::vector<std::string> stuck_;  // workers the watchdog named
  int64_t stop_start_ns_ = 0;
  std::vector<bool> exited_;
  std::vector<std::string> exit_error_;
  std::vector<int64_t> last_done_;
  std::map<int64_t, std::vector<std::optional<Event>>> pending_;  // step -> per replica
  std::map<int, Event> final_done_;                               // replica -> event
  int64_t next_step_ = 0, last_state_step_ = 0;
  int64_t last_step_ns_ = now_ns(), last_tick_ns_ = 0, start_ns_ = now_ns(), last_poll_ns_ = 0;
  std::vector<int64_t> prev_busy_, prev_tokens_;
  int64_t prev_tick_ns_ = now_ns();
  bool ticked_ = false;
};

void Coordinator::fail(const std::string& worker, const std::string& error) {
  if (failing_) {
    spdlog::warn("while stopping: {}", error);
    return;
  }
  failing_ = true;
  stop_start_ns_ = now_ns();
  out_.end = PipelineOutcome::End::failed;
  out_.failed_worker = worker;
  out_.error = error;
  spdlog::error("{}; stopping every worker", error);
  if (sh_->hooks.on_failure) {
    try {
      sh_->hooks.on_failure(error);
    } catch (const std::exception& e) {
      spdlog::warn("could not report the failure to the other ranks: {}", e.what());
    }
  }
  sh_->failing.store(true);
  {
    std::lock_guard<std::mutex> lk(sh_->ctl);
    sh_->stop_before.store(std::numeric_limits<int64_t>::min());
  }
  sh_->ctl_cv.notify_all();
  if (sh_->opts.collective) sh_->opts.collective->abort("the run is stopping after a failure");
  for (auto& q : sh_->queues) q->close();
}

void Coordinator::request_stop(std::optional<int64_t> before) {
  if (stopping_ || failing_) return;
  stopping_ = true;
  stop_start_ns_ = now_ns();
  std::lock_guard<std::mutex> lk(sh_->ctl);
  const int64_t furthest = *std::max_element(sh_->started.begin(), sh_->started.end());
  if (!before) before = sh_->hooks.stop_step ? sh_->hooks.stop_step(furthest) : furthest + 1;
  sh_->stop_before.store(std::max(*before, sh_->opts.first_step));
  sh_->ctl_cv.notify_all();  // (under ctl) replicas waiting in drafter_begin_step re-check
}

void Coordinator::poll_job(bool force) {
  if (!sh_->hooks.poll_job || failing_) return;
  const int64_t t = now_ns();
  if (!force && ns_to_s(t - last_poll_ns_) < 0.05) return;
  last_poll_ns_ = t;
  std::optional<JobNews> news;
  try {
    news = sh_->hooks.poll_job();
  } catch (const std::exception& e) {
    fail("job", e.what());
    return;
  }
  if (!news) return;
  if (news->failed_rank >= 0) {
    fail(fmt::format("rank{}", news->failed_rank), news->failure);
  } else if (news->stop_before) {
    request_stop(news->stop_before);
  }
}

void Coordinator::handle(Event& e) {
  const auto w = static_cast<size_t>(e.worker);
  switch (e.kind) {
    case Event::Kind::step_done: {
      auto& slot = pending_[e.step];
      slot.resize(static_cast<size_t>(sh_->drafters()));
      slot[static_cast<size_t>(e.worker - sh_->targets())] = std::move(e);
      account_ready_steps();
      break;
    }
    case Event::Kind::exited:
      exited_[w] = true;
      exit_error_[w] = e.error;
      last_done_[w] = e.last_done;
      if (!e.error.empty()) fail(sh_->workers[w]->name, e.error);
      break;
    case Event::Kind::final_done:
      final_done_.insert_or_assign(e.worker - sh_->targets(), std::move(e));
      break;
  }
}

PipelineStep Coordinator::assemble(int64_t s, std::vector<Event>& evs) {
  PipelineStep p;
  p.steps_done = s + 1;
  const int64_t t = now_ns();
  p.wall_s = ns_to_s(t - last_step_ns_);
  last_step_ns_ = t;
  bool target_device_measured = true;
  double target_device_s = 0;
  for (Event& e : evs) {
    target_device_measured = target_device_measured && e.target_device_s.has_value();
    target_device_s += e.target_device_s.value_or(0.0);
    p.save_s += e.save_s;
    p.results.push_back(std::move(e.result));
    p.tokens.push_back(e.tokens);
    p.supervised.push_back(e.supervised);
    p.feature_source.push_back(e.source);
    p.data_s += e.data_s;
    p.target_s += e.target_s;
    p.drafter_s = std::max(p.drafter_s, e.drafter_s);
    p.cursor = e.cursor;
    if (e.state) p.state = std::move(e.state);
  }
  if (target_device_measured && !evs.empty()) p.target_device_s = target_device_s;
  for (size_t i = 0; i < sh_->workers.size(); ++i) {
    const int64_t busy = sh_->workers[i]->busy_until(t);
    const double d = ns_to_s(busy - prev_busy_[i]);
    prev_busy_[i] = busy;
    (sh_->workers[i]->stage == WorkerStage::target ? p.target_busy_s : p.drafter_busy_s) += d;
  }
  for (auto& q : sh_->queues) p.queue_held.push_back(q->held());
  return p;
}

// Every replica applied the same update: the same skip decision and the same global gradient
// norm, bit for bit. The message names the first replica that differs from drafter0.
std::optional<std::string> replicas_disagree(const PipelineStep& p) {
  const auto& a = p.results[0];
  for (size_t r = 1; r < p.results.size(); ++r) {
    const auto& b = p.results[r];
    const bool same_norm =
        (std::isnan(a.grad_norm) && std::isnan(b.grad_norm)) || a.grad_norm == b.grad_norm;
    if (a.skip != b.skip || !same_norm) {
      return fmt::format(
          "step {}: drafter replicas disagree (drafter0: skip {}, grad norm {}; drafter{}: skip "
          "{}, grad norm {})",
          p.steps_done, static_cast<int>(a.skip), a.grad_norm, r, static_cast<int>(b.skip),
          b.grad_norm);
    }
  }
  return std::nullopt;
}

void Coordinator::account_ready_steps() {
  for (;;) {
    auto it = pending_.find(next_step_);
    if (it == pending_.end()) return;
    const bool complete = std::all_of(it->second.begin(), it->second.end(),
                                      [](const std::optional<Event>& e) { return e.has_value(); });
    if (!complete || hook_failed_) return;
    std::vector<Event> evs;
    for (auto& e : it->second) evs.push_back(std::move(*e));
    pending_.erase(it);
    PipelineStep p = assemble(next_step_, evs);
    if (const auto why = replicas_disagree(p)) {
      hook_failed_ = true;
      fail("drafter replicas", *why);
      return;
    }
    try {
      const bool has_state = p.state.has_value();
      sh_->hooks.on_step(p);
      ++next_step_;
      out_.steps_done = next_step_;
      if (has_state) last_state_step_ = next_step_;
      if (sh_->hooks.begin_after_poll) {
        poll_job(/*force=*/true);
        {
          std::lock_guard<std::mutex> lk(sh_->ctl);
          sh_->polled_through = next_step_ - 1;
        }
        sh_->ctl_cv.notify_all();
      }
    } catch (const std::exception& e) {
      hook_failed_ = true;
      fail("trainer", e.what());
      return;
    }
  }
}

std::string Coordinator::phases_report() const {
  const int64_t t = now_ns();
  std::string s;
  for (const auto& w : sh_->workers) {
    const auto [phase, since] = w->phase_and_since();
    s += fmt::format("\n  {} ({}): {} for {:.1f} s, step {}", w->name, w->device, phase_name(phase),
                     ns_to_s(t - since), w->step.load());
  }
  return s;
}

void Coordinator::watchdog() {
  if (failing_) return;
  const double limit = sh_->opts.topology.stall_timeout_s;
  const int64_t t = now_ns();
  const WorkerState* stuck = nullptr;
  int64_t newest_change = 0;
  for (size_t i = 0; i < sh_->workers.size(); ++i) {
    const WorkerState& w = *sh_->workers[i];
    if (exited_[i]) continue;
    const auto [phase, since] = w.phase_and_since();
    newest_change = std::max(newest_change, since);
    // The working phase stalled the longest is the cause; later stalls (a replica blocked in the
    // all-reduce on the stuck worker's batch) are its consequences.
    if (phase_works(phase) && ns_to_s(t - since) > limit &&
        (!stuck || since < stuck->phase_since())) {
      stuck = &w;
    }
  }
  // Nobody working and nobody changing phase: the pipeline waits on itself.
  const bool all_waiting = newest_change > 0 && ns_to_s(t - newest_change) > limit;
  if (!stuck && !all_waiting) return;
  if (!stuck) {
    for (size_t i = 0; i < sh_->workers.size(); ++i) {
      if (exited_[i]) continue;
      if (!stuck || sh_->workers[i]->phase_since() < stuck->phase_since()) {
        stuck = sh_->workers[i].get();
      }
    }
  }
  stuck_.push_back(stuck->name);
  const auto [phase, since] = stuck->phase_and_since();
  fail("watchdog",
       fmt::format("{} ({}) is stuck: no progress for {:.1f} s in phase '{}' at step {} "
                   "(runtime.stall_timeout_s = {}); every worker's last phase:{}",
                   stuck->name, stuck->device, ns_to_s(t - since), phase_name(phase),
                   stuck->step.load(), limit, phases_report()));
}

void Coordinator::tick(bool force) {
  const int64_t t = now_ns();
  if (!force && ns_to_s(t - last_tick_ns_) < sh_->opts.tick_s) return;
  last_tick_ns_ = t;
  if (!sh_->hooks.on_tick) return;
  std::vector<WorkerInfo> infos;
  const double dt = ns_to_s(t - prev_tick_ns_);
  for (size_t i = 0; i < sh_->workers.size(); ++i) {
    const WorkerState& w = *sh_->workers[i];
    WorkerInfo info;
    info.name = w.name;
    info.stage = w.stage == WorkerStage::target ? "target" : "drafter";
    info.device = w.device;
    const auto [phase, since] = w.phase_and_since();
    info.phase = phase_name(phase);
    info.phase_s = ns_to_s(t - since);
    info.step = w.step.load();
    const int64_t tokens = w.tokens.load();
    // A finished, stopped or failed worker has no current rate (absent, not 0).
    const bool ended = phase == Phase::idle || phase == Phase::stopped || phase == Phase::failed;
    if (dt > 0 && ticked_ && !ended) {
      info.tokens_per_s = static_cast<double>(tokens - prev_tokens_[i]) / dt;
    }
    prev_tokens_[i] = tokens;
    info.busy = ns_to_s(w.busy_until(t)) / std::max(1e-9, ns_to_s(t - start_ns_));
    if (w.stage == WorkerStage::drafter) {
      const auto& q = *sh_->queues[static_cast<size_t>(w.index)];
      info.queue_held = q.held();
      info.queue_capacity = q.capacity();
    }
    if (w.has_memory.load()) info.memory = DeviceMemory{w.mem_used.load(), w.mem_total.load()};
    infos.push_back(std::move(info));
  }
  prev_tick_ns_ = t;
  ticked_ = true;
  try {
    sh_->hooks.on_tick(infos);
  } catch (const std::exception& e) {
    fail("trainer", e.what());
  }
}

bool Coordinator::drafters_out() const {
  for (int r = 0; r < sh_->drafters(); ++r) {
    const auto i = static_cast<size_t>(sh_->targets() + r);
    const bool stuck =
        std::find(stuck_.begin(), stuck_.end(), sh_->workers[i]->name) != stuck_.end();
    if (!exited_[i] && !stuck) return false;
  }
  return true;
}

void Coordinator::wait_events(double seconds, const std::function<bool()>& done) {
  const int64_t until = now_ns() + static_cast<int64_t>(seconds * 1e9);
  while (!done() && now_ns() < until) {
    std::deque<Event> batch;
    {
      std::unique_lock<std::mutex> lk(sh_->ev);
      sh_->ev_cv.wait_for(lk, std::chrono::milliseconds(50), [&] { return !sh_->events.empty(); });
      batch.swap(sh_->events);
    }
    for (Event& e : batch) handle(e);
    poll_job();
    if (!failing_ && sh_->hooks.stop_requested && sh_->hooks.stop_requested()) request_stop();
  }
}

PipelineOutcome Coordinator::run(std::vector<std::thread>& threads) {
  // A stopping run waits for its drafters at most half the grace period (a drafter stuck in a
  // device call never comes back); the rest is for their states and the target workers.
  auto waited_enough = [&] {
    return failing_ && ns_to_s(now_ns() - stop_start_ns_) > sh_->opts.stop_grace_s / 2;
  };
  while (!drafters_out() && !waited_enough()) {
    wait_events(0.1, [] { return false; });
    watchdog();
    tick(false);
  }
  if (!failing_ && stopping_) out_.end = PipelineOutcome::End::stopped;
  shutdown(threads);
  return out_;
}

void Coordinator::shutdown(std::vector<std::thread>& threads) {
  const double grace = sh_->opts.stop_grace_s;
  const int64_t t0 = stop_start_ns_ ? stop_start_ns_ : now_ns();
  auto left = [&] { return std::max(0.5, grace - ns_to_s(now_ns() - t0)); };
  for (auto& q : sh_->queues) {
    q->close();
    q->clear();
  }
  // The state after the last step, when no checkpoint has it, and each replica's hash.
  const bool clean = !failing_;
  const bool need_state = out_.steps_done > last_state_step_;
  // Who gives it: a replica that left its loop, preferably right after steps_done and without an
  // error of its own. A replica that ran further (the trainer failed on a step it had finished)
  // still holds the state of steps_done if it applied no update since, which the caller checks
  // with the update count (checkpoint_write).
  int saver = -1;
  for (int pass = 0; pass < 4 && need_state && saver < 0; ++pass) {
    for (int r = 0; r < sh_->drafters() && saver < 0; ++r) {
      const auto i = static_cast<size_t>(sh_->targets() + r);
      const bool at_step = last_done_[i] + 1 == out_.steps_done;
      const bool sound = exit_error_[i].empty();
      const bool ok = pass == 0 ? at_step && sound : pass == 1 ? at_step : pass == 2 ? sound : true;
      if (exited_[i] && ok) saver = r;
    }
  }
  std::vector<int> asked;
  {
    std::lock_guard<std::mutex> lk(sh_->ctl);
    for (int r = 0; r < sh_->drafters(); ++r) {
      FinalCommand c;
      c.save = r == saver;
      c.hash = clean;
      sh_->final[static_cast<size_t>(r)] = c;
      if (exited_[static_cast<size_t>(sh_->targets() + r)]) asked.push_back(r);
    }
  }
  sh_->ctl_cv.notify_all();
  wait_events(clean ? std::max(grace, sh_->opts.topology.stall_timeout_s) : left(), [&] {
    return std::all_of(asked.begin(), asked.end(), [&](int r) { return final_done_.count(r); });
  });
  for (const auto& [r, e] : final_done_) {
    if (!e.summary.empty()) out_.summaries.push_back(fmt::format("drafter{}: {}", r, e.summary));
  }
  if (saver >= 0 && final_done_.count(saver) && final_done_.at(saver).state) {
    out_.final_state = std::move(final_done_.at(saver).state);
  } else if (saver >= 0) {
    spdlog::warn("drafter{} could not give its state after step {}{}", saver, out_.steps_done,
                 final_done_.count(saver) ? ": " + final_done_.at(saver).error : "");
  }
  if (clean) {
    for (int r : asked) {
      const auto it = final_done_.find(r);
      if (it == final_done_.end() || !it->second.hash) {
        fail(fmt::format("drafter{}", r),
             fmt::format("drafter{} could not hash its final state: {}", r,
                         it == final_done_.end() ? "no answer" : it->second.error));
        break;
      }
      out_.replica_hashes.push_back(*it->second.hash);
    }
    if (!failing_ && std::adjacent_find(out_.replica_hashes.begin(), out_.replica_hashes.end(),
                                        std::not_equal_to<>()) != out_.replica_hashes.end()) {
      fail("drafter replicas",
           fmt::format("the drafter replicas' states differ after step {} (hashes {:016x})",
                       out_.steps_done, fmt::join(out_.replica_hashes, ", ")));
    }
  }
  {
    std::lock_guard<std::mutex> lk(sh_->ctl);
    sh_->released = true;
  }
  sh_->ctl_cv.notify_all();
  // Workers the watchdog named stuck are not waited for.
  auto all_finished = [&] {
    return std::all_of(sh_->workers.begin(), sh_->workers.end(), [&](const auto& w) {
      return w->finished.load() || std::find(stuck_.begin(), stuck_.end(), w->name) != stuck_.end();
    });
  };
  wait_events(clean ? std::max(grace, sh_->opts.topology.stall_timeout_s) : left(), all_finished);
  for (size_t i = 0; i < threads.size(); ++i) {
    if (sh_->workers[i]->finished.load()) {
      threads[i].join();
    } else {
      out_.abandoned.push_back(sh_->workers[i]->name);
      threads[i].detach();
    }
  }
  if (!out_.abandoned.empty()) {
    spdlog::error("left behind (did not stop within {:.0f} s): {}", grace,
                  fmt::join(out_.abandoned, ", "));
    if (out_.end != PipelineOutcome::End::failed) {
      fail("watchdog", fmt::format("{} did not stop", fmt::join(out_.abandoned, ", ")));
    }
  }
  tick(true);  // the workers' last phases
}

}  // namespace

uint64_t drafter_state_hash(const DrafterState& s) {
  uint64_t h = 1469598103934665603ull;
  auto add = [&h](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h ^= b[i];
      h *= 1099511628211ull;
    }
  };
  add(s.params.data(), s.params.size() * sizeof(float));
  add(s.adam_m.data(), s.adam_m.size() * sizeof(float));
  add(s.adam_v.data(), s.adam_v.size() * sizeof(float));
  add(&s.updates, sizeof s.updates);
  return h;
}

PipelineOutcome pipeline_run(const PipelineOptions& opts, const PipelineHooks& hooks) {
  const PipelineTopology& topo = opts.topology;
  DFLASH_CHECK(topo.targets() >= 1 && topo.drafters() >= 1,
               "pipeline: {} target and {} drafter workers (at least one of each)", topo.targets(),
               topo.drafters());
  DFLASH_CHECK(opts.initial_state != nullptr, "pipeline: no initial drafter state");
  DFLASH_CHECK(opts.first_step >= 0 && opts.first_step <= opts.end_step,
               "pipeline: steps [{}, {}) are not a range", opts.first_step, opts.end_step);
  DFLASH_CHECK(
      opts.collective ? opts.collective->local_size() == topo.drafters() : topo.drafters() == 1,
      "pipeline: {} drafter replicas need a collective group with that many members here",
      topo.drafters());
  DFLASH_CHECK(hooks.make_step && hooks.make_target && hooks.make_drafter && hooks.lr &&
                   hooks.checkpoint_after && hooks.on_step,
               "pipeline: a required hook is missing");
  auto sh = std::make_shared<Shared>(opts, hooks);
  for (WorkerStage stage : {WorkerStage::target, WorkerStage::drafter}) {
    for (int i = 0; i < topo.workers(stage); ++i) {
      auto w = std::make_unique<WorkerState>();
      w->stage = stage;
      w->index = i;
      w->name = topo.qualified_name(stage, i);
      w->device = topo.device_name(stage, i);
      w->step.store(opts.first_step);
      sh->workers.push_back(std::move(w));
    }
  }
  for (int r = 0; r < topo.drafters(); ++r) {
    sh->queues.push_back(
        std::make_unique<OrderedQueue<FeatureItem>>(opts.first_step, topo.queue_depth));
  }
  sh->stop_before.store(std::numeric_limits<int64_t>::max());
  sh->started.assign(static_cast<size_t>(topo.drafters()), opts.first_step - 1);
  sh->polled_through = opts.first_step - 1;
  sh->final.resize(static_cast<size_t>(topo.drafters()));
  sh->src_step = opts.first_step;
  std::vector<std::thread> threads;
  for (int t = 0; t < topo.targets(); ++t) threads.emplace_back(target_main, sh, t);
  for (int r = 0; r < topo.drafters(); ++r) threads.emplace_back(drafter_main, sh, r);
  Coordinator c(sh);
  return c.run(threads);
}

}  // namespace dflash
