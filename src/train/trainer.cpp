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

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/log.hpp"
#include "core/parallel.hpp"
#include "data/batcher.hpp"
#include "data/chat_template.hpp"
#include "data/dataset.hpp"
#include "data/tokenizer.hpp"
#include "model/drafter.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_io.hpp"
#include "model/target.hpp"
#include "train/checkpoint.hpp"
#include "train/memory_plan.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"
#include "train/run_dir.hpp"
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
  o.cuda_graphs = cfg.runtime.cuda_graphs;
  o.max_context_tokens = static_cast<int64_t>(cfg.data.rows_per_step) * cfg.data.token_budget;
  o.max_blocks = train_step_capacity(cfg).blocks;
  o.device_memory_gib = cfg.runtime.device_memory_gib;
  o.adam = {cfg.training.beta1, cfg.training.beta2, cfg.training.adam_eps,
            cfg.training.weight_decay};
  o.clip_grad_norm = cfg.training.clip_grad_norm;
  return o;
}

// The tokenized training data (cached), as prepare_dataset gives it.
TokenDataset prepare_data(const RunConfig& cfg, const RunDir& rd, const Tokenizer& tok,
                          TrainReport& report) {
  const fs::path target_dir = cfg.model.target;
  PrepareOptions po;
  po.data = cfg.data.train_file;
  po.chat_template = resolve_chat_template(target_dir, cfg.data.template_name, false);
  po.max_length = cfg.data.max_length;
  po.cache = run_cache_path(cfg.data.cache_dir, rd.path(), po.data, target_dir, po.chat_template,
                            po.max_length);
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

// The batcher of the run; with a block budget that can bind, it needs every document's block
// count (what sample_anchors will take from it).
Batcher make_batcher(const RunConfig& cfg, TokenDataset data) {
  BatcherOptions bo;
  bo.token_budget = cfg.data.token_budget;
  bo.rows = cfg.data.rows_per_step;
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

// The cuda backend's memory plan, logged and checked before anything is allocated on the device
// (the backend allocates this same plan). Returns whether a plan was made.
bool check_memory_plan(const RunConfig& cfg, const ModelConfig& target, const DrafterConfig& d,
                       const DrafterLayout& layout, TrainReport& report) {
  if (cfg.runtime.backend != "cuda") return false;
  const TrainMemoryPlan plan = plan_train_memory(cfg, target, d, layout);
  report.log(plan.table());
  DFLASH_CHECK(plan.fits(), "{}",
               plan_shortfall_message(plan, largest_fitting_budget(cfg, target, d, layout)));
  return true;
}

// Everything the step loop works with, built in declaration order by the constructor.
struct Session {
  const RunConfig& cfg;
  RunDir& rd;
  TrainReport& report;
  TargetModel target;
  Tokenizer tok;
  DrafterConfig dcfg;
  DrafterLayout layout;
  bool planned;          // the device memory plan was logged and fits (cuda backend)
  TrainBackend backend;  // before the data: a backend that cannot start fails before tokenizing
  Batcher batcher;
  int64_t per_epoch;
  int64_t total_steps;
  LrSchedule sched;
  DrafterBatchOptions batch_opts;
  DType export_dtype;
  TrainerState st;
  std::string last_ckpt;  // newest complete checkpoint ("" none)

  Session(const RunConfig& c, RunDir& r, TrainReport& rep)
      : cfg(c),
        rd(r),
        report(rep),
        target(TargetModel::load(c.model.target)),
        tok(Tokenizer::load(c.model.target)),
        dcfg(drafter_config_for_run(c, target.config(), &tok)),
        layout(dcfg),
        planned(check_memory_plan(c, target.config(), dcfg, layout, rep)),
        backend(train_backend_create(backend_options_of(c), target, dcfg, layout)),
        batcher(make_batcher(c, prepare_data(c, r, tok, rep))),
        per_epoch(batcher.batches_in_epoch(0)),
        total_steps(c.training.max_steps > 0 ? c.training.max_steps
                                             : per_epoch * c.training.epochs),
        batch_opts{c.training.block_size, c.training.num_anchors, c.training.gamma,
                   c.training.seed},
        export_dtype(dtype_from_name(c.training.export_dtype)) {
    st.interval = IntervalMetrics(c.training.block_size);
    sched.base_lr = c.training.lr;
    sched.total_steps = total_steps;
    sched.warmup_steps = static_cast<int64_t>(
        std::llround(c.training.warmup_ratio * static_cast<double>(total_steps)));
    sched.min_lr_ratio = c.training.min_lr_ratio;
  }
};

// Continues from the newest complete checkpoint (checking that the configuration still fits it),
// or initialises a fresh drafter; hands the weights to the backend and writes config.resolved.yaml.
void restore_or_init(Session& s, const TrainOptions& opts, const fs::path& checkpoint) {
  DrafterState ds;
  if (!checkpoint.empty()) {
    // The configurations are compared before any tensor is read: a changed drafter size is
    // reported as the keys that changed, not as a tensor of the wrong size.
    s.st = checkpoint_read_state(checkpoint);
    const RunConfig saved =
        RunConfig::from_yaml(s.st.config_yaml, (checkpoint / "trainer_state/state.json").string());
    const auto diffs = resume_check(saved, s.cfg, opts.force, s.rd.path().string());
    checkpoint_read_drafter(checkpoint, s.layout, s.st, ds);
    if (diffs.empty()) {
      s.batcher.restore(s.st.cursor);
    } else {
      // Forced: the old data plan cannot be replayed; continue at the same epoch and batch
      // index of the new plan.
      DataCursor c = s.batcher.cursor();
      c.epoch = s.st.cursor.epoch;
      c.batch = std::min(s.st.cursor.batch, s.batcher.batches_in_epoch(s.st.cursor.epoch));
      s.batcher.restore(c);
      s.report.log(
          fmt::format("--force: resuming despite changed keys; the data order continues "
                      "at epoch {} batch {} of the new plan",
                      c.epoch, c.batch));
      if (s.st.interval.obj.K != s.cfg.training.block_size) {
        // The open log interval counted slots of the old block size: it starts afresh.
        s.st.interval = IntervalMetrics(s.cfg.training.block_size);
      }
    }
    s.report.log(fmt::format("resumed from {} (step {})", checkpoint.string(), s.st.step));
    s.last_ckpt = checkpoint.string();
    s.report.metrics_resume_at(s.st.step);
  } else {
    s.report.metrics_restart();
    const auto n = static_cast<size_t>(s.layout.total);
    ds.params.resize(n);
    ds.adam_m.assign(n, 0.0f);
    ds.adam_v.assign(n, 0.0f);
    drafter_init(ds.params, s.layout, s.cfg.training.seed);
  }
  s.backend.drafter->load_state(ds);
  s.st.config_yaml = s.cfg.to_yaml();
  write_file_atomic(s.rd.path() / "config.resolved.yaml", s.st.config_yaml);
}

// -------------------------------------------------------------------------------------- the loop

// Counts a finished step into the trainer state; stops the run after too many skips in a row.
void account_step(Session& s, const DrafterStepResult& r, const DrafterBatch& batch,
                  const StepTimes& t) {
  TrainerState& st = s.st;
  if (r.skipped()) {
    st.skipped += 1;
    st.consecutive_skips += 1;
    s.report.log(r.skip == StepSkip::no_supervised_slot
                     ? fmt::format("step {}: skipped (no supervised slot)", st.step + 1)
                     : fmt::format("step {}: skipped (non-finite; loss {}, grad norm {})",
                                   st.step + 1, r.metrics.loss_weighted_sum, r.grad_norm));
    DFLASH_CHECK(st.consecutive_skips < s.cfg.training.max_consecutive_skips,
                 "{} steps in a row were skipped (non-finite loss or gradient); stopping "
                 "(training.max_consecutive_skips = {})",
                 st.consecutive_skips, s.cfg.training.max_consecutive_skips);
  } else {
    st.consecutive_skips = 0;
  }
  st.step += 1;
  st.interval.add_step(r, batch.T(), batch.n_supervised, t);
  st.cursor = s.batcher.cursor();
}

// Writes the metrics record of the interval that ends at this step and starts a new one.
void finish_interval(Session& s, double eta_s, TrainResult& result) {
  TrainerState& st = s.st;
  const json record =
      interval_record(st.interval, st.step, st.cursor.epoch, s.sched.at(st.step - 1), st.skipped);
  s.report.interval(record, s.total_steps, eta_s);
  result.last_metrics = record;
  st.interval = IntervalMetrics(s.dcfg.block_size);
}

void save_checkpoint(Session& s) {
  s.report.status().phase = "checkpointing";
  s.report.write_status();
  DrafterState ds;
  s.backend.drafter->save_state(ds);
  s.last_ckpt =
      checkpoint_write(s.rd, s.dcfg, s.layout, ds, s.st, s.export_dtype, s.cfg.training.keep_last)
          .string();
  s.report.log(fmt::format("checkpoint {}", s.last_ckpt));
  s.report.status().phase = "training";
  s.report.status().checkpoint = s.last_ckpt;
  s.report.write_status();
}

// One step through the stages; `t` gets its times.
DrafterStepResult run_step(Session& s, StepTimes& t) {
  const auto t0 = Clock::now();
  const DrafterBatch batch = drafter_batch_from_batch(s.batcher.next(), s.batch_opts);
  t.data = seconds_since(t0);
  const auto tt = Clock::now();
  const std::unique_ptr<TargetFeatures> features = s.backend.target->forward_taps(batch);
  t.target = seconds_since(tt);
  const auto td = Clock::now();
  s.backend.drafter->step(batch, *features);
  s.backend.drafter->update(s.sched.at(s.st.step));
  DrafterStepResult r = s.backend.drafter->result();
  t.drafter = seconds_since(td);
  if (r.target_device_s) t.target = *r.target_device_s;  // enqueued: its device time is the cost
  t.total = seconds_since(t0);
  account_step(s, r, batch, t);
  return r;
}

TrainResult train_loop(Session& s, const TrainOptions& opts) {
  TrainerState& st = s.st;
  ProgressBar bar("train", s.total_steps, "steps");
  bar.advance(st.step);
  const auto run_start = Clock::now();
  int64_t steps_this_run = 0;
  TrainResult result;
  result.last_metrics = s.report.status().last;  // a resumed run's newest kept record
  while (st.step < s.total_steps) {
    StepTimes t;
    const DrafterStepResult r = run_step(s, t);
    ++steps_this_run;
    bar.set_suffix(
        r.skipped() ? std::string(r.skip == StepSkip::non_finite ? "skipped (non-finite)"
                                                                 : "skipped (no supervised slot)")
                    : fmt::format("loss {:.3f} τ {:.2f}", r.metrics.loss(), r.metrics.tau()));
    bar.advance(1);
    const bool last = st.step == s.total_steps;
    if (st.step % s.cfg.training.log_interval == 0 || last) {
      const double eta = seconds_since(run_start) / static_cast<double>(steps_this_run) *
                         static_cast<double>(s.total_steps - st.step);
      finish_interval(s, eta, result);
    }
    const bool stop =
        g_stop_signal.load() != 0 || (opts.halt_at_step > 0 && st.step == opts.halt_at_step);
    const int64_t every = s.cfg.training.save_interval;
    if (last || stop || (every > 0 && st.step % every == 0)) save_checkpoint(s);
    if (stop && !last) {
      result.interrupted = true;
      const int sig = g_stop_signal.load();
      s.report.log(sig ? fmt::format("stopped by signal {} after step {}; resume with --resume {}",
                                     sig, st.step, s.rd.path().string())
                       : fmt::format("halted after step {} (--halt-at-step)", st.step));
      break;
    }
  }
  bar.finish();
  const std::string summary = s.backend.drafter->summary();
  if (!summary.empty()) s.report.log(summary);
  result.steps_done = st.step;
  result.skipped_steps = st.skipped;
  result.last_checkpoint = s.last_ckpt;
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
  return drafter_config_for_target(target, cfg.model.drafter_layers, sizes, cfg.model.mask_token_id,
                                   taps, tok);
}

std::string print_train_memory_plan(const RunConfig& cfg) {
  const fs::path target_dir = cfg.model.target;
  const ModelConfig tcfg = model_config_load(target_dir);
  std::optional<Tokenizer> tok;
  if (fs::exists(target_dir / "tokenizer.json")) tok = Tokenizer::load(target_dir);
  const DrafterConfig dcfg = drafter_config_for_run(cfg, tcfg, tok ? &*tok : nullptr);
  const DrafterLayout layout(dcfg);
  const TrainMemoryPlan plan = plan_train_memory(cfg, tcfg, dcfg, layout);
  fmt::print(
      "cuda backend, one device: target {} ({} layers, hidden {}), drafter {} layers "
      "({} parameters), {} row(s) x {} tokens, block budget {} per row, block size {}\n"
      "{}\n",
      target_dir.string(), tcfg.num_hidden_layers, tcfg.hidden_size, dcfg.num_layers, layout.total,
      cfg.data.rows_per_step, cfg.data.token_budget, cfg.block_budget(), dcfg.block_size,
      plan.table());
  return plan.fits()
             ? std::string()
             : plan_shortfall_message(plan, largest_fitting_budget(cfg, tcfg, dcfg, layout));
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

  RunDir rd(cfg.output_dir);
  DFLASH_CHECK(resuming || RunDir::complete_checkpoints(rd.path()).empty(),
               "run directory '{}' already holds checkpoints: use --resume to continue it, or "
               "choose another output_dir",
               rd.path().string());
  TrainReport report(rd);
  try {
    const fs::path checkpoint = resuming ? resume_checkpoint(rd, report) : fs::path();
    Session s(cfg, rd, report);
    if (!s.backend.memory_report.empty()) report.log(s.backend.memory_report);
    restore_or_init(s, opts, checkpoint);
    report.status().phase = "training";
    report.status().checkpoint = s.last_ckpt;
    report.status().step = s.st.step;
    report.status().total_steps = s.total_steps;
    report.write_status();
    report.log(
        fmt::format("train: target {} ({} layers, hidden {}), drafter {} layers ({} "
                    "parameters), taps [{}], mask id {}, block {}, {} steps ({} "
                    "batches/epoch), backend {}",
                    cfg.model.target, s.target.config().num_hidden_layers,
                    s.target.config().hidden_size, s.dcfg.num_layers, s.layout.total,
                    fmt::join(s.dcfg.target_layer_ids, ","), s.dcfg.mask_token_id,
                    s.dcfg.block_size, s.total_steps, s.per_epoch, s.backend.description));
    if (s.st.step >= s.total_steps) {
      report.log(fmt::format("the run finished at step {} of {}: nothing to do", s.st.step,
                             s.total_steps));
    }
    TrainResult result = train_loop(s, opts);
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
