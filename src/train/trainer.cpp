// dflash.cpp — `dflash train` (see trainer.hpp): setup, the step loop, and the glue between the
// batcher, the backend's stages (train_backend.hpp), checkpoints (checkpoint.hpp) and the run's
// reports (train_report.hpp). Nothing here depends on which backend runs.
#include "train/trainer.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <optional>
#include <sstream>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/log.hpp"
#include "core/parallel.hpp"
#include "data/batcher.hpp"
#include "data/chat_template.hpp"
#include "data/dataset.hpp"
#include "data/tokenizer.hpp"
#include "model/dflash2_selector.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_io.hpp"
#include "model/objective.hpp"
#include "model/target.hpp"
#include "train/checkpoint.hpp"
#include "train/job.hpp"
#include "train/memory_plan.hpp"
#include "train/optimizer.hpp"
#include "train/pipeline.hpp"
#include "train/run_dir.hpp"
#include "train/topology.hpp"
#include "train/train_backend.hpp"
#include "train/train_report.hpp"

namespace dflash {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// ------------------------------------------------------------------------------------------ setup

TrainBackendOptions backend_options_of(const RunConfig& cfg) {
  TrainBackendOptions o;
  o.backend = cfg.runtime.backend;
  o.devices = cfg.runtime.devices;
  o.topology = topology_of(cfg.runtime);
  o.feature_buffers = target_feature_buffers(o.topology);
  o.cuda_graphs = cfg.runtime.cuda_graphs;
  o.target_prefill = target_prefill_of(cfg.runtime.target_prefill);
  o.max_context_tokens = static_cast<int64_t>(cfg.data.rows_per_step) * cfg.data.token_budget;
  o.max_blocks = train_step_capacity(cfg).blocks;
  o.device_memory_gib = cfg.runtime.device_memory_gib;
  o.adam = {cfg.training.beta1, cfg.training.beta2, cfg.training.adam_eps,
            cfg.training.weight_decay};
  o.clip_grad_norm = cfg.training.clip_grad_norm;
  return o;
}

// The tokenized training data (cached), as prepare_dataset gives it.
TokenDataset prepare_data(const RunConfig& cfg, const Tokenizer& tok, TrainReport& report) {
  const fs::path target_dir = cfg.model.target;
  PrepareOptions po;
  po.data = cfg.data.train_file;
  po.chat_template = resolve_chat_template(target_dir, cfg.data.template_name, false);
  po.max_length = cfg.data.max_length;
  // The job's run directory: every rank of an MPI job shares its cache folder (the cache is
  // written to a temporary file and renamed, so ranks building it at once do no harm).
  po.cache = run_cache_path(cfg.data.cache_dir, cfg.output_dir, po.data, target_dir,
                            po.chat_template, po.max_length);
  fs::create_directories(po.cache.parent_path());
  po.skip_invalid = cfg.data.skip_invalid;
  po.skip_invalid_hint =
      "set data.skip_invalid: true in the config or pass the override data.skip_invalid=true";
  po.threads = cfg.runtime.threads;
  po.encode = [&tok](std::string_view text, std::vector<std::pair<size_t, size_t>>* offsets) {
    return tok.encode(text, offsets);
  };
  po.tokenizer_hash = hash_file(target_dir / "tokenizer.json");
  po.tokenizer_file = (target_dir / "tokenizer.json").string();
  report.status().phase = "tokenizing";
  report.write_status();
  PrepareResult prep = prepare_dataset(po);
  report.log(prep.reused
                 ? fmt::format("data: reusing cache {}", po.cache.string())
                 : fmt::format("data: built cache {} ({})", po.cache.string(), prep.reason));
  report.log(data_counts_line(prep.dataset.stats(), cfg.data.max_length));
  report.status().data = data_counts_json(prep.dataset.stats());
  return std::move(prep.dataset);
}

// The batcher of the run: one batch per step, the global batch of rows_per_step rows for each of
// the `replicas` drafter replicas (make_step splits it by rows). With a block budget that can
// bind, it needs every document's block count (what sample_anchors will take from it).
Batcher make_batcher(const RunConfig& cfg, TokenDataset data, int replicas) {
  BatcherOptions bo;
  bo.token_budget = cfg.data.token_budget;
  bo.rows = static_cast<int64_t>(cfg.data.rows_per_step) * replicas;
  bo.sort_by_length = cfg.data.sort_by_length;
  bo.seed = cfg.training.seed;
  bo.block_budget = cfg.block_budget();
  if (bo.block_budget < bo.token_budget) {
    bo.doc_blocks.resize(static_cast<size_t>(data.num_docs()));
    for (int64_t d = 0; d < data.num_docs(); ++d) {
      bo.doc_blocks[static_cast<size_t>(d)] =
          document_blocks(data.doc_loss_mask(d), cfg.training.num_anchors);
    }
  }
  return Batcher(std::move(data), bo);
}

// The cuda backend's memory plan: the arena of every worker (train/cuda_stages.cpp allocates
// these same plans), logged and checked per GPU before anything is allocated on a device; its
// choice of drafter activations (training.recompute) goes into `opts`. Returns whether a plan was
// made.
bool check_memory_plan(const RunConfig& cfg, const ModelConfig& target, const DrafterConfig& d,
                       const DrafterLayout& layout, TrainReport& report,
                       TrainBackendOptions& opts) {
  if (cfg.runtime.backend != "cuda") return false;
  const std::string unsupported = cuda_unsupported_message(target, d);
  DFLASH_CHECK(unsupported.empty(), "runtime.backend cuda: {}", unsupported);
  const PipelineMemoryPlan plan = plan_pipeline_memory(cfg, target, d, layout);
  opts.drafter_activations = plan.activations;
  report.log(plan.table());
  DFLASH_CHECK(plan.fits(), "{}",
               pipeline_shortfall_message(
                   plan, largest_fitting_pipeline_budget(cfg, target, d, layout)));
  return true;
}

// Steps of the run: training.max_steps, else one per batch of the epochs (a batch is a step's
// global batch).
int64_t total_steps_of(const RunConfig& cfg, int64_t per_epoch) {
  if (cfg.training.max_steps > 0) return cfg.training.max_steps;
  return per_epoch * cfg.training.epochs;
}

// Pipeline figures of the log interval in progress (not checkpointed: after a resume they cover
// the steps this process ran).
struct PipelineInterval {
  double target_busy_s = 0, drafter_busy_s = 0, wall_s = 0;
  std::vector<double> queue_sum;
  int64_t steps = 0;
};

// Everything the step loop works with, built in declaration order by the constructor.
struct Session {
  const RunConfig& cfg;
  RunDir& rd;
  TrainReport& report;
  Job* job;   // the MPI job (null: one process)
  int rank;   // this process's rank in it (0 alone)
  int ranks;  // its processes (1 alone)
  // Shared with the target workers' stages, which may outlive a failed run (left behind).
  std::shared_ptr<const TargetModel> target;
  Tokenizer tok;
  DrafterConfig dcfg;
  DrafterLayout layout;
  PipelineTopology topo;
  TrainBackendOptions backend_opts;
  bool planned;  // the device memory plan was logged and fits (cuda backend)
  Batcher batcher;
  int64_t per_epoch;
  int64_t total_steps;
  LrSchedule sched;
  DrafterBatchOptions batch_opts;
  DType export_dtype;
  TrainerState st;
  std::string last_ckpt;  // newest complete checkpoint ("" none)
  int64_t last_ckpt_step = -1;
  PipelineInterval piv;
  // The newest status.json workers entry of this rank's own workers (JSON text): ranks > 0 send
  // it to rank 0 at the end; rank 0 starts the job's final list from it.
  std::string last_workers;

  Session(const RunConfig& c, RunDir& r, TrainReport& rep, Job* j)
      : cfg(c),
        rd(r),
        report(rep),
        job(j),
        rank(j ? j->rank() : 0),
        ranks(j ? j->size() : 1),
        target(std::make_shared<const TargetModel>(TargetModel::load(c.model.target))),
        tok(Tokenizer::load(c.model.target)),
        dcfg(drafter_config_for_run(c, target->config(), &tok)),
        layout(dcfg),
        topo(topology_of(c.runtime)),
        backend_opts(backend_options_of(c)),
        planned(check_memory_plan(c, target->config(), dcfg, layout, rep, backend_opts)),
        batcher(make_batcher(c, prepare_data(c, tok, rep), topo.drafters() * ranks)),
        per_epoch(batcher.batches_in_epoch(0)),
        total_steps(total_steps_of(c, per_epoch)),
        batch_opts{c.training.block_size, c.training.num_anchors, c.training.gamma, c.training.seed,
                   objective_of(c.training)},
        export_dtype(dtype_from_name(c.training.export_dtype)) {
    st.interval = IntervalMetrics(c.training.block_size);
    sched.base_lr = c.training.lr;
    sched.total_steps = total_steps;
    sched.warmup_steps = static_cast<int64_t>(
        std::llround(c.training.warmup_ratio * static_cast<double>(total_steps)));
    sched.min_lr_ratio = c.training.min_lr_ratio;
    piv.queue_sum.assign(static_cast<size_t>(topo.drafters()), 0.0);
    if (ranks > 1) topo.name_prefix = fmt::format("rank{}/", rank);
  }
  /// G: the drafter replicas of the whole job (a step's global batch has G shares).
  int replicas() const { return topo.drafters() * ranks; }
  /// "2 ranks × cpu: ..." for an MPI job, the topology alone otherwise.
  std::string describe() const {
    return ranks > 1 ? fmt::format("{} ranks × ({})", ranks, topo.describe()) : topo.describe();
  }
};

// Refuses to resume with another number of drafter replicas (the global batch of a step has
// rows_per_step rows per replica) unless forced. Returns whether the count changed.
bool check_resume_topology(Session& s, const RunConfig& saved, const TrainOptions& opts) {
  const int64_t was_ranks = s.st.ranks, now_ranks = s.ranks;
  const int64_t was = topology_of(saved.runtime).drafters() * was_ranks, now = s.replicas();
  if (was_ranks != now_ranks) {
    if (!opts.force) {
      fail(
          "--resume {}: the checkpoint was trained by a job of {} rank{} (mpirun -np) and this "
          "one has {}; a step's global batch has rows_per_step rows per drafter replica of every "
          "rank, so this would change the run (use --force to continue anyway)",
          s.cfg.output_dir, was_ranks, was_ranks == 1 ? "" : "s", now_ranks);
    }
    s.report.log(fmt::format("--force: continuing with {} rank{} (the checkpoint had {})",
                             now_ranks, now_ranks == 1 ? "" : "s", was_ranks));
  }
  if (was == now) return was_ranks != now_ranks;
  if (!opts.force) {
    fail(
        "--resume {}: the checkpoint was trained with {} drafter replica{} and this run has {} "
        "({}); a step's global batch has rows_per_step rows per replica, so this would change "
        "the run (use --force to continue anyway)",
        s.cfg.output_dir, was, was == 1 ? "" : "s", now, s.topo.drafter_key);
  }
  s.report.log(fmt::format(
      "--force: continuing with {} drafter replicas (the checkpoint had {}); each step's global "
      "batch now has {} row{}",
      now, was, static_cast<int64_t>(s.cfg.data.rows_per_step) * now,
      s.cfg.data.rows_per_step * now == 1 ? "" : "s"));
  return true;
}

// A forced resume cannot replay the old data plan: the position in the new plan of the epoch
// with as many rows consumed as the checkpoint's cursor (rounded up to a whole batch; capped at
// the epoch's end).
DataCursor forced_cursor(Session& s, const RunConfig& saved) {
  const int64_t old_rows = static_cast<int64_t>(saved.data.rows_per_step) *
                           topology_of(saved.runtime).drafters() * s.st.ranks;
  const int64_t new_rows = static_cast<int64_t>(s.cfg.data.rows_per_step) * s.replicas();
  DataCursor c = s.batcher.cursor();
  c.epoch = s.st.cursor.epoch;
  c.batch = std::min((s.st.cursor.batch * old_rows + new_rows - 1) / new_rows,
                     s.batcher.batches_in_epoch(s.st.cursor.epoch));
  return c;
}

// Continues from the newest complete checkpoint (checking that the configuration still fits it),
// or initialises a fresh drafter; writes config.resolved.yaml. Returns the initial state.
DrafterState restore_or_init(Session& s, const TrainOptions& opts, const fs::path& checkpoint) {
  DrafterState ds;
  if (!checkpoint.empty()) {
    // The configurations are compared before any tensor is read: a changed drafter size is
    // reported as the keys that changed, not as a tensor of the wrong size.
    s.st = checkpoint_read_state(checkpoint);
    const RunConfig saved =
        RunConfig::from_yaml(s.st.config_yaml, (checkpoint / "trainer_state/state.json").string());
    const auto diffs = resume_check(saved, s.cfg, opts.force, s.cfg.output_dir);
    const bool replicas_changed = check_resume_topology(s, saved, opts);
    checkpoint_read_drafter(checkpoint, s.layout, s.st, ds);
    if (diffs.empty() && !replicas_changed) {
      s.batcher.restore(s.st.cursor);
    } else {
      const DataCursor c = forced_cursor(s, saved);
      s.batcher.restore(c);
      s.report.log(fmt::format(
          "--force: resuming despite {}; the data order continues at epoch {} batch {} of the "
          "new plan (the rows the checkpoint had consumed, rounded up to a whole batch)",
          diffs.empty() ? "another replica count" : "changed keys", c.epoch, c.batch));
      if (s.st.interval.obj.K != s.cfg.training.block_size) {
        // The open log interval counted slots of the old block size: it starts afresh.
        s.st.interval = IntervalMetrics(s.cfg.training.block_size);
      }
    }
    s.report.log(fmt::format("resumed from {} (step {})", checkpoint.string(), s.st.step));
    s.last_ckpt = checkpoint.string();
    s.last_ckpt_step = s.st.step;
    s.report.metrics_resume_at(s.st.step);
  } else {
    s.report.metrics_restart();
    const auto n = static_cast<size_t>(s.layout.total);
    ds.params.resize(n);
    ds.adam_m.assign(n, 0.0f);
    ds.adam_v.assign(n, 0.0f);
    drafter_init(ds.params, s.layout, s.cfg.training.seed);
  }
  s.st.config_yaml = s.cfg.to_yaml();
  s.st.ranks = s.ranks;
  write_file_atomic(s.rd.path() / "config.resolved.yaml", s.st.config_yaml);
  return ds;
}

// -------------------------------------------------------------------------------------- the loop

// The inputs of one step: the next global batch of the sequence, rows_per_step rows for each
// drafter replica in row order, normalised together (docs/design-notes.md). D replicas of R rows
// thus see exactly the rows, anchors and targets of one replica of D·R rows.
// In an MPI job the global batch has G = ranks × drafters shares: every rank builds all of them
// (for the step's Σw, summed in global replica order) and keeps its own, global replicas
// [rank·drafters, (rank+1)·drafters).
// Domino's λ is that of the optimizer step (step = the steps taken before it, SpecForge's
// global_step) over the run's total_steps.
StepInput make_step(Session& s, int64_t step) {
  StepInput in;
  DrafterBatchOptions opts = s.batch_opts;
  if (opts.objective.domino()) {
    opts.objective.domino_lambda =
        domino_lambda(step, s.total_steps, s.cfg.training.lambda_base_start,
                      s.cfg.training.lambda_base_decay_ratio);
  }
  double weight_sum = 0;
  int64_t documents = 0;
  const Batch global = s.batcher.next();
  const int64_t rows = s.cfg.data.rows_per_step;
  const int local = s.topo.drafters(), first = s.rank * local;
  for (int g = 0; g < s.replicas(); ++g) {
    DrafterBatch b = drafter_batch_from_rows(global, g * rows, (g + 1) * rows, opts);
    if (b.objective.dflash2()) {  // the selector's weight at this step (dflash2_selector_alpha)
      const TrainingSection& t = s.cfg.training;
      b.objective.dflash2_selector_alpha =
          dflash2_selector_alpha(t.dflash2_selector_loss_alpha, t.dflash2_selector_warmup_ratio,
                                 t.dflash2_selector_ramp_ratio, step, s.total_steps);
    }
    weight_sum += b.weight_sum;
    documents += b.n_docs();
    if (g >= first && g < first + local) in.batches.push_back(std::move(b));
  }
  if (s.replicas() > 1) {
    for (DrafterBatch& b : in.batches) {
      b.step_weight_sum = weight_sum;
      b.step_documents = documents;
    }
  }
  in.cursor = s.batcher.cursor();
  return in;
}

// A replica's step as an MPI job's rank k > 0 sends it to rank 0.
ReplicaStepFigures figures_of(const DrafterStepResult& r, int64_t tokens, int64_t supervised) {
  ReplicaStepFigures f;
  f.grad_norm = r.grad_norm;
  f.skip = static_cast<int>(r.skip);
  f.tokens = tokens;
  f.supervised = supervised;
  f.metrics = r.metrics;
  return f;
}

// The replicas' results as one: metrics summed in global replica order (this process's replicas,
// then, on an MPI job's rank 0, those of ranks 1, 2, ... in `remote`); grad norm, clip and skip
// are the step's (equal on every replica, checked by the pipeline and on_step). Names the
// replicas whose loss was not finite.
DrafterStepResult merge_results(const Session& s, const PipelineStep& p,
                                const std::vector<ReplicaStepFigures>& remote,
                                std::string& non_finite) {
  DrafterStepResult r = p.results[0];
  for (size_t i = 1; i < p.results.size(); ++i) r.metrics.merge(p.results[i].metrics);
  for (const ReplicaStepFigures& f : remote) r.metrics.merge(f.metrics);
  for (size_t i = 0; i < p.results.size(); ++i) {
    if (std::isfinite(p.results[i].metrics.loss_weighted_sum)) continue;
    non_finite += fmt::format("{}{}drafter{} (features from {})", non_finite.empty() ? "" : ", ",
                              s.topo.name_prefix, i, p.feature_source[i]);
  }
  const int local = s.topo.drafters();
  for (size_t i = 0; i < remote.size(); ++i) {
    if (std::isfinite(remote[i].metrics.loss_weighted_sum)) continue;
    non_finite += fmt::format("{}rank{}/drafter{}", non_finite.empty() ? "" : ", ",
                              1 + static_cast<int>(i) / local, static_cast<int>(i) % local);
  }
  return r;
}

// Counts a finished step into the trainer state; stops the run after too many skips in a row.
// Returns the step's merged result.
DrafterStepResult account_step(Session& s, const PipelineStep& p,
                               const std::vector<ReplicaStepFigures>& remote) {
  TrainerState& st = s.st;
  std::string non_finite;
  const DrafterStepResult r = merge_results(s, p, remote, non_finite);
  if (r.skipped()) {
    // Checked before the state changes: a run stopped here keeps the state of the step before.
    const int64_t streak = st.consecutive_skips + 1;
    const std::string where = non_finite.empty() ? "" : "; non-finite loss on " + non_finite;
    s.report.log(r.skip == StepSkip::no_supervised_slot
                     ? fmt::format("step {}: skipped (no supervised slot)", st.step + 1)
                     : fmt::format("step {}: skipped (non-finite; loss {}, grad norm {}{})",
                                   st.step + 1, r.metrics.loss_weighted_sum, r.grad_norm, where));
    DFLASH_CHECK(streak < s.cfg.training.max_consecutive_skips,
                 "{} steps in a row were skipped (non-finite loss or gradient{}); stopping "
                 "(training.max_consecutive_skips = {})",
                 streak, where, s.cfg.training.max_consecutive_skips);
    st.skipped += 1;
    st.consecutive_skips = streak;
  } else {
    st.consecutive_skips = 0;
  }
  st.step += 1;
  StepTimes t;
  t.data = p.data_s;
  // Per batch; the device time when the target stages measured it (what s_device adds up).
  t.target = p.target_device_s.value_or(p.target_s) / static_cast<double>(p.results.size());
  t.drafter = p.drafter_s;
  // The state download of a checkpoint step is not step time: it is reported as s_checkpoint.
  t.total = std::max(0.0, p.wall_s - p.save_s);
  t.checkpoint = p.save_s;
  int64_t tokens = 0, supervised = 0;
  for (size_t i = 0; i < p.tokens.size(); ++i) {
    tokens += p.tokens[i];
    supervised += p.supervised[i];
  }
  for (const ReplicaStepFigures& f : remote) {
    tokens += f.tokens;
    supervised += f.supervised;
  }
  st.interval.add_step(r, tokens, supervised, t);
  st.cursor = p.cursor;
  PipelineInterval& pv = s.piv;
  pv.target_busy_s += p.target_busy_s;
  pv.drafter_busy_s += p.drafter_busy_s;
  pv.wall_s += p.wall_s;
  for (size_t i = 0; i < p.queue_held.size(); ++i) pv.queue_sum[i] += p.queue_held[i];
  pv.steps += 1;
  return r;
}

// Writes the metrics record of the interval that ends at this step and starts a new one.
void finish_interval(Session& s, double eta_s, TrainResult& result) {
  TrainerState& st = s.st;
  json record =
      interval_record(st.interval, st.step, st.cursor.epoch, s.sched.at(st.step - 1), st.skipped);
  const PipelineInterval& pv = s.piv;
  if (pv.wall_s > 0) {
    record["target_busy"] = pv.target_busy_s / (pv.wall_s * s.topo.targets());
    record["drafter_busy"] = pv.drafter_busy_s / (pv.wall_s * s.topo.drafters());
    std::vector<double> depth;
    for (double q : pv.queue_sum) depth.push_back(q / static_cast<double>(pv.steps));
    record["queue_depth"] = depth;
  }
  s.report.interval(record, s.total_steps, eta_s);
  result.last_metrics = record;
  st.interval = IntervalMetrics(s.dcfg.block_size);
  s.piv = PipelineInterval{};
  s.piv.queue_sum.assign(static_cast<size_t>(s.topo.drafters()), 0.0);
}

void save_checkpoint(Session& s, const DrafterState& ds) {
  s.report.status().phase = "checkpointing";
  s.report.write_status();
  s.last_ckpt =
      checkpoint_write(s.rd, s.dcfg, s.layout, ds, s.st, s.export_dtype, s.cfg.training.keep_last)
          .string();
  s.last_ckpt_step = s.st.step;
  s.report.log(fmt::format("checkpoint {}", s.last_ckpt));
  s.report.status().phase = "training";
  s.report.status().checkpoint = s.last_ckpt;
  s.report.write_status();
}

// status.json's entry of each worker.
json workers_json(const std::vector<WorkerInfo>& workers) {
  json out = json::array();
  for (const WorkerInfo& w : workers) {
    json j = {{"name", w.name},       {"stage", w.stage}, {"device", w.device}, {"phase", w.phase},
              {"phase_s", w.phase_s}, {"step", w.step},   {"busy", w.busy}};
    if (w.tokens_per_s) j["tokens_per_s"] = *w.tokens_per_s;
    if (w.queue_held) {
      j["queue_depth"] = *w.queue_held;
      j["queue_capacity"] = w.queue_capacity;
    }
    if (w.memory) {
      j["memory_used_bytes"] = w.memory->used;
      j["memory_total_bytes"] = w.memory->total;
    }
    out.push_back(std::move(j));
  }
  return out;
}

// Rank 0 of an MPI job: the other ranks' figures of step p (in rank order), checked to agree
// with this rank's skip decision and gradient norm bit for bit.
std::vector<ReplicaStepFigures> receive_remote_step(Session& s, const PipelineStep& p) {
  std::vector<ReplicaStepFigures> remote =
      s.job->receive_step(p.steps_done - 1, s.topo.drafters(), s.cfg.runtime.stall_timeout_s);
  const DrafterStepResult& mine = p.results[0];
  for (size_t i = 0; i < remote.size(); ++i) {
    const ReplicaStepFigures& f = remote[i];
    const bool same_norm =
        (std::isnan(mine.grad_norm) && std::isnan(f.grad_norm)) || mine.grad_norm == f.grad_norm;
    DFLASH_CHECK(f.skip == static_cast<int>(mine.skip) && same_norm,
                 "step {}: drafter replicas disagree (rank0/drafter0: skip {}, grad norm {}; "
                 "rank{}/drafter{}: skip {}, grad norm {})",
                 p.steps_done, static_cast<int>(mine.skip), mine.grad_norm,
                 1 + static_cast<int>(i) / s.topo.drafters(),
                 static_cast<int>(i) % s.topo.drafters(), f.skip, f.grad_norm);
  }
  return remote;
}

// Rank 0: the workers of the other ranks (their newest status snapshots, JSON arrays) after its
// own in status.json.
void append_remote_workers(json& workers, const std::vector<std::string>& snapshots) {
  for (const std::string& text : snapshots) {
    if (text.empty()) continue;
    for (json& w : json::parse(text)) workers.push_back(std::move(w));
  }
}

// The hooks of an MPI job's rank k > 0: it counts its steps (data cursor, skip streak) and sends
// each step's figures and its status to rank 0, which logs, reports and checkpoints for the job.
// Signals are rank 0's to act on (it announces the stop step); a failure here is reported to
// rank 0 at once.
void hooks_of_rank(Session& s, PipelineHooks& h) {
  Job* job = s.job;
  h.on_step = [&s, job](PipelineStep& p) {
    std::vector<ReplicaStepFigures> figures;
    for (size_t i = 0; i < p.results.size(); ++i) {
      figures.push_back(figures_of(p.results[i], p.tokens[i], p.supervised[i]));
    }
    job->send_step(p.steps_done - 1, figures);
    account_step(s, p, {});
  };
  h.on_tick = [&s, job](const std::vector<WorkerInfo>& w) {
    s.last_workers = workers_json(w).dump();
    job->send_status(s.last_workers);
  };
  h.stop_requested = [] { return false; };
  h.begin_after_poll = true;
  h.poll_job = [job]() -> std::optional<JobNews> {
    const auto stop = job->stop_announced();
    if (!stop) return std::nullopt;
    JobNews n;
    n.stop_before = *stop;
    return n;
  };
  const std::string name = job->name();
  h.on_failure = [job, name](const std::string& error) {
    job->report_failure(error.rfind(name + "/", 0) == 0 ? error : name + ": " + error);
  };
}

// What the pipeline calls back into the trainer.
PipelineHooks hooks_of(Session& s, int64_t end_step,
                       std::shared_ptr<CollectiveGroup> group, TrainResult& result) {
  PipelineHooks h;
  h.make_step = [&s](int64_t step) { return make_step(s, step); };
  const TrainBackendOptions bo = s.backend_opts;
  const PipelineTopology topo = s.topo;
  const std::shared_ptr<const TargetModel> target = s.target;
  const DrafterConfig dcfg = s.dcfg;
  const DrafterLayout layout = s.layout;
  h.make_target = [bo, topo, target, dcfg](int t) {
    return target_stage_create(bo, topo.target_devices[static_cast<size_t>(t)], *target, dcfg);
  };
  h.make_drafter = [bo, topo, target, dcfg, layout, group](int r) {
    return drafter_stage_create(bo, topo.drafter_devices[static_cast<size_t>(r)], *target, dcfg,
                                layout, group, r);
  };
  const LrSchedule sched = s.sched;
  h.lr = [sched](int64_t step) { return sched.at(step); };
  const int64_t every = s.cfg.training.save_interval;
  const bool writes = s.rank == 0;  // an MPI job's rank 0 alone checkpoints
  h.checkpoint_after = [every, end_step, writes](int64_t n) {
    return writes && (n == end_step || (every > 0 && n % every == 0));
  };
  if (s.rank > 0) {
    hooks_of_rank(s, h);
    return h;
  }
  // On a non-terminal the line per log interval (finish_interval) is the progress; the bar adds
  // its final line only.
  ProgressOptions progress;
  progress.plain_lines = false;
  auto bar = std::make_shared<ProgressBar>("train", s.total_steps, "steps", progress);
  bar->advance(s.st.step);
  const auto run_start = Clock::now();
  const int64_t first = s.st.step;
  h.on_step = [&s, &result, bar, run_start, first](PipelineStep& p) {
    std::vector<ReplicaStepFigures> remote;
    if (s.job) remote = receive_remote_step(s, p);
    const DrafterStepResult r = account_step(s, p, remote);
    bar->set_suffix(
        r.skipped() ? std::string(r.skip == StepSkip::non_finite ? "skipped (non-finite)"
                                                                 : "skipped (no supervised slot)")
                    : fmt::format("loss {:.3f} τ {:.2f}", r.metrics.loss(), r.metrics.tau()));
    bar->advance(1);
    if (s.st.step % s.cfg.training.log_interval == 0 || s.st.step == s.total_steps) {
      const double eta = seconds_since(run_start) / static_cast<double>(s.st.step - first) *
                         static_cast<double>(s.total_steps - s.st.step);
      finish_interval(s, eta, result);
    }
    if (p.state) save_checkpoint(s, *p.state);
  };
  h.on_tick = [&s](const std::vector<WorkerInfo>& w) {
    json workers = workers_json(w);
    if (s.job) {
      s.last_workers = workers.dump();
      append_remote_workers(workers, s.job->statuses());
    }
    s.report.status().workers = std::move(workers);
    s.report.write_status();
  };
  h.stop_requested = [] { return g_stop_signal.load() != 0; };
  if (s.job) {
    Job* job = s.job;
    h.poll_job = [job]() -> std::optional<JobNews> {
      const auto f = job->peer_failure();
      if (!f) return std::nullopt;
      JobNews n;
      n.failed_rank = f->first;
      n.failure = f->second;
      return n;
    };
    // Another rank may have started one step more than this one's furthest (it cannot pass a
    // step's all-reduce without rank 0), never two: stopping before furthest + 2 leaves every
    // rank's started step to finish.
    h.stop_step = [job](int64_t furthest) {
      job->announce_stop(furthest + 2);
      return furthest + 2;
    };
  }
  return h;
}

// Writes the checkpoint of the last step when the pipeline handed back a state no checkpoint
// holds yet ("when it can": a failed run keeps its last complete checkpoint if this fails).
void save_final_state(Session& s, PipelineOutcome& o) {
  if (!o.final_state || s.last_ckpt_step == s.st.step) return;
  try {
    save_checkpoint(s, *o.final_state);
  } catch (const Error& e) {
    if (o.end != PipelineOutcome::End::failed) throw;
    s.report.log(fmt::format("no checkpoint of step {}: {}", s.st.step, e.what()));
  }
}

// The end of an MPI job's run, every rank: rank 0 gathers each rank's step count, replica state
// hashes and last workers, checks that every replica of the job ended in the same state after
// the same step, writes the workers into status.json, and tells every rank the verdict. Throws
// dflash::Error (on every rank) when they differ.
void job_agree_end(Session& s, const PipelineOutcome& o) {
  const json mine = {{"step", s.st.step}, {"hashes", o.replica_hashes}};
  const std::string text = mine.dump() + "\n" + s.last_workers;
  const std::vector<std::string> all = s.job->gather(text, s.cfg.runtime.stall_timeout_s);
  std::string verdict;
  if (s.rank == 0) {
    // Rank 0's own workers, then each rank's final ones (not the mid-run snapshots that the
    // last tick's status.json holds: a rank's workers would be listed twice, once stale).
    json workers = s.last_workers.empty() ? json::array() : json::parse(s.last_workers);
    for (size_t k = 1; k < all.size() && verdict.empty(); ++k) {
      const size_t nl = all[k].find('\n');
      const json theirs = json::parse(all[k].substr(0, nl));
      if (theirs["step"] != s.st.step || theirs["hashes"] != mine["hashes"]) {
        verdict = fmt::format(
            "the drafter replicas of the job differ after the run: rank 0 ended at step {} with "
            "state hashes {}, rank {} at step {} with {}",
            s.st.step, mine["hashes"].dump(), k, theirs["step"].dump(), theirs["hashes"].dump());
      }
      if (nl != std::string::npos && nl + 1 < all[k].size()) {
        append_remote_workers(workers, {all[k].substr(nl + 1)});
      }
    }
    s.report.status().workers = std::move(workers);
    s.report.write_status();
  }
  verdict = s.job->broadcast(verdict);
  DFLASH_CHECK(verdict.empty(), "{}", verdict);
}

// The start of an MPI job's run, every rank, before the first step: rank 0 checks that every
// rank resolved the same configuration, data plan and initial drafter state (a node reading
// another file, or another version of it, would train on other data), and tells every rank the
// verdict. Throws dflash::Error (on every rank) naming the first rank and figure that differ.
// The first line where two resolved configurations (RunConfig::to_yaml) differ, with its section:
// "its configuration has 'training: lr: 0.002', rank 0's 'training: lr: 0.0006'".
std::string config_difference(const std::string& theirs, const std::string& mine) {
  std::istringstream a(theirs), b(mine);
  std::string la, lb, section_a, section_b;
  for (;;) {
    const bool more_a = static_cast<bool>(std::getline(a, la));
    const bool more_b = static_cast<bool>(std::getline(b, lb));
    if (!more_a && !more_b) return "";
    if (!la.empty() && la[0] != ' ') section_a = la;
    if (!lb.empty() && lb[0] != ' ') section_b = lb;
    if (more_a && more_b && la == lb) continue;
    auto where = [](const std::string& section, const std::string& line, bool more) {
      if (!more) return std::string("(nothing)");
      return line.empty() || line[0] != ' ' ? fmt::format("'{}'", line)
                                            : fmt::format("'{} {}'", section, line.substr(2));
    };
    return fmt::format("configuration has {}, rank 0's {}", where(section_a, la, more_a),
                       where(section_b, lb, more_b));
  }
}

void job_agree_start(Session& s, const DrafterState& initial) {
  RunConfig c = s.cfg;
  c.output_dir = "";  // the same folder may be mounted under other paths
  const std::vector<std::string> mine = {
      c.to_yaml(), fmt::format("initial drafter state hash {:016x}", drafter_state_hash(initial)),
      fmt::format("first step {}, data cursor {}", s.st.step, s.batcher.cursor().to_json().dump()),
      fmt::format("{} steps, {} batches per epoch", s.total_steps, s.per_epoch),
      fmt::format("{} drafter workers", s.topo.drafters())};
  const std::vector<std::string> all = s.job->gather(json(mine).dump(), 0);
  std::string verdict;
  for (size_t k = 1; k < all.size() && verdict.empty(); ++k) {
    const std::vector<std::string> theirs = json::parse(all[k]);
    for (size_t i = 0; i < mine.size() && verdict.empty(); ++i) {
      if (theirs.at(i) == mine[i]) continue;
      verdict = fmt::format(
          "rank {} does not match rank 0: its {} (every rank must run the same configuration, "
          "data files, target and drafter_workers; a resume needs the run directory shared by "
          "every node)",
          k,
          i == 0 ? config_difference(theirs[i], mine[i])
                 : fmt::format("{}, rank 0's {}", theirs[i], mine[i]));
    }
  }
  verdict = s.job->broadcast(verdict);
  DFLASH_CHECK(verdict.empty(), "{}", verdict);
  s.report.log(fmt::format("MPI job: rank {} of {}, global drafter replicas [{}, {}) of {}", s.rank,
                           s.ranks, s.rank * s.topo.drafters(), (s.rank + 1) * s.topo.drafters(),
                           s.replicas()));
}

TrainResult train_loop(Session& s, const TrainOptions& opts, const DrafterState& initial) {
  TrainResult result;
  result.last_metrics = s.report.status().last;  // a resumed run's newest kept record
  const int64_t first = s.st.step;
  const int64_t end =
      opts.halt_at_step > first ? std::min(s.total_steps, opts.halt_at_step) : s.total_steps;
  PipelineOptions po;
  po.topology = s.topo;
  po.first_step = first;
  po.end_step = std::max(first, end);
  po.initial_state = &initial;
  po.fault = fault_spec_from_env(s.topo, s.rank, s.ranks);
  po.collective = collective_group_create(s.cfg.runtime.backend, s.topo.drafter_devices, s.job);
  if (po.collective) s.report.log(fmt::format("collective: {}", po.collective->kind()));
  if (s.batch_opts.objective.dspark()) {
    const Objective& o = s.batch_opts.objective;
    const DsparkHeads& h = s.dcfg.dspark;
    s.report.log(fmt::format(
        "objective: dspark, Σ w·({}·CE + {}·L1 + {}·BCE) / Σ w, w = prefix mask · exp(-k/{}); "
        "Markov head {} (rank {}), confidence head {}{}",
        o.dspark_ce_alpha, o.dspark_l1_alpha, o.dspark_conf_alpha, s.cfg.training.gamma,
        h.markov_rank > 0 ? markov_head_type_name(h.markov_type) : "none", h.markov_rank,
        h.confidence_head ? "on" : "off", h.confidence_with_markov ? " (with the Markov input)" : ""));
  }
  if (s.batch_opts.objective.dflash2()) {
    const TrainingSection& t = s.cfg.training;
    const Dflash2Heads& h = s.dcfg.dflash2;
    s.report.log(fmt::format(
        "objective: dflash2, Σ w·(CE(ū) + α_sel·CE_sel) / {}, ū = softcap({}·U, {}); conv {} taps "
        "in groups of {}, selector rank {} over the top {}; α_sel {} after {} of the steps, "
        "ramp {}{}",
        s.batch_opts.objective.dpace() ? "sequences (w: D-PACE's of CE(ū))" : "Σ w",
        h.output_multiplier, h.final_logit_softcapping, h.conv_kernel_size, h.conv_group_size,
        h.selector_rank, h.selector_top_k, t.dflash2_selector_loss_alpha,
        t.dflash2_selector_warmup_ratio, t.dflash2_selector_ramp_ratio,
        t.dflash2_selector_stop_gradient ? ", stop_gradient" : ""));
  }
  if (s.batch_opts.objective.domino()) {
    const DominoHead& h = s.dcfg.domino;
    const TrainingSection& t = s.cfg.training;
    s.report.log(fmt::format(
        "objective: domino, (1-λ)·Σ w·CE(F) / Σ w + λ·Σ w·CE(U) / Σ w, λ from {} to 0 over {} of "
        "{} steps; GRU state {}, embed_proj {}, pure_draft_prefix_len {}, shift_label {}",
        t.lambda_base_start, t.lambda_base_decay_ratio, s.total_steps, h.gru_hidden_dim,
        h.emb_dim, h.pure_draft_prefix_len, h.shift_label));
  }
  if (s.batch_opts.objective.dpace()) {
    s.report.log(fmt::format(
        "loss: {} (alpha {}): Σ w·CE divided by the step's sequences "
        "(documents); training.gamma is ignored",
        loss_type_name(s.batch_opts.objective.loss), s.batch_opts.objective.dpace_alpha));
  }
  if (po.fault) {
    s.report.log(fmt::format("fault injection: DFLASH_FAULT_INJECT={}", po.fault->text));
  }
  const PipelineHooks hooks = hooks_of(s, po.end_step, po.collective, result);
  PipelineOutcome o = pipeline_run(po, hooks);
  for (const std::string& line : o.summaries) s.report.log(line);
  if (s.rank == 0) save_final_state(s, o);
  result.steps_done = s.st.step;
  result.skipped_steps = s.st.skipped;
  result.last_checkpoint = s.last_ckpt;
  if (o.end == PipelineOutcome::End::failed) {
    fail("{}{}", o.error,
         s.rank > 0 ? std::string()  // rank 0 checkpoints for the job
         : s.last_ckpt.empty()
             ? std::string("; no checkpoint was written")
             : fmt::format("; the last complete checkpoint is {} (resume with --resume {})",
                           s.last_ckpt, s.rd.path().string()));
  }
  if (s.job) job_agree_end(s, o);
  if (s.replicas() > 1 && s.rank == 0 && !o.replica_hashes.empty()) {
    s.report.log(
        fmt::format("the {} drafter replicas are bit-identical after step {} (state "
                    "hash {:016x})",
                    s.replicas(), s.st.step, o.replica_hashes[0]));
  }
  if (s.st.step < s.total_steps) {
    result.interrupted = true;
    const int sig = g_stop_signal.load();
    const bool halted = opts.halt_at_step > 0 && s.st.step == opts.halt_at_step;
    s.report.log(sig ? fmt::format("stopped by signal {} after step {}; resume with --resume {}",
                                   sig, s.st.step, s.cfg.output_dir)
                 : halted
                     ? fmt::format("halted after step {} (--halt-at-step)", s.st.step)
                     : fmt::format("stopped after step {} (rank 0 stopped the job); resume with "
                                   "--resume {}",
                                   s.st.step, s.cfg.output_dir));
  }
  return result;
}

// The checkpoint a resume continues from: the newest that verifies. Newer ones that fail are set
// aside (checkpoint_set_aside), each logged with its reason.
fs::path resume_checkpoint(const RunDir& rd, TrainReport& report) {
  ResumePoint rp;
  try {
    rp = checkpoint_select(rd.path());
  } catch (const Error& e) {
    throw e.with_context("--resume");
  }
  for (const CheckpointRejection& r : rp.rejected) {
    const fs::path aside = checkpoint_set_aside(r.dir);
    report.log(fmt::format("--resume: skipping {} ({}); moved it to {}", r.dir.filename().string(),
                           r.reason, aside.string()));
  }
  if (rp.check == CheckpointCheck::legacy_marker) {
    report.log(
        fmt::format("--resume: {} was written before checkpoints carried file digests; its "
                    "files are not verified",
                    rp.dir.string()));
  }
  return rp.dir;
}

}  // namespace

DrafterConfig drafter_config_for_run(const RunConfig& cfg, const ModelConfig& target,
                                     const Tokenizer* tok) {
  DrafterSizes sizes;
  if (cfg.model.intermediate_size) sizes.intermediate_size = *cfg.model.intermediate_size;
  if (cfg.model.num_attention_heads) sizes.num_heads = *cfg.model.num_attention_heads;
  if (cfg.model.num_key_value_heads) sizes.num_kv_heads = *cfg.model.num_key_value_heads;
  if (cfg.model.head_dim) sizes.head_dim = *cfg.model.head_dim;
  sizes.block_size = cfg.training.block_size;
  std::optional<std::vector<int>> taps;
  if (!cfg.model.target_layer_ids.empty()) taps = cfg.model.target_layer_ids;
  DrafterConfig c = drafter_config_for_target(target, cfg.model.drafter_layers, sizes,
                                              cfg.model.mask_token_id, taps, tok);
  c.dspark = dspark_heads_of(cfg.training);
  c.dflash2 = dflash2_heads_of(cfg.training);
  c.domino = domino_head_of(cfg.training);
  c.validate();
  return c;
}

std::string print_train_memory_plan(const RunConfig& cfg) {
  const fs::path target_dir = cfg.model.target;
  const ModelConfig tcfg = model_config_load(target_dir);
  std::optional<Tokenizer> tok;
  if (fs::exists(target_dir / "tokenizer.json")) tok = Tokenizer::load(target_dir);
  const DrafterConfig dcfg = drafter_config_for_run(cfg, tcfg, tok ? &*tok : nullptr);
  const DrafterLayout layout(dcfg);
  const PipelineMemoryPlan plan = plan_pipeline_memory(cfg, tcfg, dcfg, layout);
  const std::string unsupported = cuda_unsupported_message(tcfg, dcfg);
  fmt::print(
      "{}; target {} ({} layers, hidden {}), drafter {} layers "
      "({} parameters), {} row(s) x {} tokens, block budget {} per row, block size {}\n"
      "{}\n",
      topology_of(cfg.runtime).describe(), target_dir.string(), tcfg.num_hidden_layers,
      tcfg.hidden_size, dcfg.num_layers, layout.total, cfg.data.rows_per_step,
      cfg.data.token_budget, cfg.block_budget(), dcfg.block_size, plan.table());
  if (!unsupported.empty()) return "the CUDA backend cannot run this model: " + unsupported;
  return plan.fits() ? std::string()
                     : pipeline_shortfall_message(
                           plan, largest_fitting_pipeline_budget(cfg, tcfg, dcfg, layout));
}

void install_train_signal_handlers() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

TrainResult train(const TrainOptions& opts) {
  g_stop_signal.store(0);
  RunConfig cfg = opts.config;
  const bool resuming = !opts.resume_dir.empty();
  if (resuming) cfg.output_dir = opts.resume_dir;
  train_backend_check(backend_options_of(cfg));
  if (cfg.runtime.threads > 0) set_parallel_threads(cfg.runtime.threads);

  Job* job = opts.job.get();
  const int rank = job ? job->rank() : 0;
  // An MPI job's rank k > 0 keeps its own log (and status) in <output_dir>/rank<k>; the run
  // directory itself is rank 0's.
  RunDir rd(rank == 0 ? fs::path(cfg.output_dir) : fs::path(cfg.output_dir) / job->name());
  DFLASH_CHECK(resuming || RunDir::complete_checkpoints(rd.path()).empty(),
               "run directory '{}' already holds checkpoints: use --resume to continue it, or "
               "choose another output_dir",
               rd.path().string());
  TrainReport report(rd);
  try {
    fs::path checkpoint = resuming && rank == 0 ? resume_checkpoint(rd, report) : fs::path();
    // Every rank resumes from the checkpoint rank 0 chose (the run directory is shared).
    if (job) checkpoint = job->broadcast(checkpoint.string());
    Session s(cfg, rd, report, job);
    const DrafterState initial = restore_or_init(s, opts, checkpoint);
    if (job) job_agree_start(s, initial);
    report.status().phase = "training";
    report.status().checkpoint = s.last_ckpt;
    report.status().topology = s.describe();
    report.status().step = s.st.step;
    report.status().total_steps = s.total_steps;
    report.write_status();
    report.log(fmt::format(
        "train: target {} ({} layers, hidden {}), drafter {} layers ({} "
        "parameters), taps [{}], mask id {}, block {}, {} steps ({} "
        "batches/epoch), {}; {}",
        cfg.model.target, s.target->config().num_hidden_layers, s.target->config().hidden_size,
        s.dcfg.num_layers, s.layout.total, fmt::join(s.dcfg.target_layer_ids, ","),
        s.dcfg.mask_token_id, s.dcfg.block_size, s.total_steps, s.per_epoch, s.describe(),
        train_backend_describe(s.backend_opts)));
    if (s.st.step >= s.total_steps) {
      report.log(fmt::format("the run finished at step {} of {}: nothing to do", s.st.step,
                             s.total_steps));
    }
    TrainResult result = train_loop(s, opts, initial);
    report.status().phase = result.interrupted ? "interrupted" : "done";
    report.status().step = result.steps_done;
    report.write_status();
    return result;
  } catch (const Error& e) {
    report.status().phase = "failed";
    report.status().error = e.what();
    try {
      report.write_status();
    } catch (...) {
    }
    report.log_error(e.what());
    throw;
  }
}

}  // namespace dflash
