#include "train/trainer.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/log.hpp"
#include "core/parallel.hpp"
#include "data/batcher.hpp"
#include "data/chat_template.hpp"
#include "data/dataset.hpp"
#include "data/tokenizer.hpp"
#include "model/drafter.hpp"
#include "model/drafter_io.hpp"
#include "model/json_util.hpp"
#include "model/safetensors.hpp"
#include "model/target.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"
#include "train/cuda_train.hpp"
#include "train/packed_step.hpp"
#include "train/run_dir.hpp"

namespace dflash {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::atomic<int> g_stop_signal{0};

#ifdef DFLASH_HAVE_CUDA
// Packed steps on a device pad their block rows to a multiple of this many blocks, so that few
// distinct shapes occur (GEMM plans are cached per shape).
constexpr int64_t kBlockRowsMultiple = 64;
// Document offsets of a row without tokens.
constexpr int32_t kEmptyOffsets[1] = {0};
#endif

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Resident set size in bytes (Linux /proc), 0 if unknown.
int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

// Metrics of one log interval.
struct IntervalMetrics {
  ObjectiveMetrics obj;
  double grad_norm_sum = 0;
  int64_t steps = 0, tokens = 0, supervised = 0;
  double t_data = 0, t_target = 0, t_drafter = 0, t_total = 0;
  double t_gpu_drafter = 0;  // device time of the drafter step (cuda backend; 0 on the cpu)

  json to_json() const {
    json j = {{"loss_weighted_sum", obj.loss_weighted_sum}, {"weight_sum", obj.weight_sum},
              {"slot_correct", obj.slot_correct},           {"slot_count", obj.slot_count},
              {"accept_len_sum", obj.accept_len_sum},       {"blocks", obj.blocks},
              {"K", obj.K},                                 {"grad_norm_sum", grad_norm_sum},
              {"steps", steps},                             {"tokens", tokens},
              {"supervised", supervised},                   {"t_data", t_data},
              {"t_target", t_target},                       {"t_drafter", t_drafter},
              {"t_gpu_drafter", t_gpu_drafter},
              {"t_total", t_total}};
    return j;
  }
  // Reads back to_json(); `src` names the file in errors. K must be `block_size`.
  static IntervalMetrics from_json(const json& j, const std::string& src, int block_size) {
    IntervalMetrics m;
    const int K = static_cast<int>(json_int(j, "K", src, block_size, block_size));
    m.obj = ObjectiveMetrics(K);
    m.obj.loss_weighted_sum = json_double(j, "loss_weighted_sum", src);
    m.obj.weight_sum = json_double(j, "weight_sum", src);
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
    m.tokens = json_int(j, "tokens", src, 0);
    m.supervised = json_int(j, "supervised", src, 0);
    m.t_data = json_double(j, "t_data", src);
    m.t_target = json_double(j, "t_target", src);
    m.t_drafter = json_double(j, "t_drafter", src);
    m.t_gpu_drafter = j.contains("t_gpu_drafter") ? json_double(j, "t_gpu_drafter", src) : 0.0;
    m.t_total = json_double(j, "t_total", src);
    return m;
  }
};

// Everything a checkpoint restores besides the weights.
struct TrainerState {
  int64_t step = 0;  ///< optimizer steps done
  int64_t skipped = 0, consecutive_skips = 0;
  DataCursor cursor;
  IntervalMetrics interval;
  std::string config_yaml;
};

void write_checkpoint(RunDir& rd, const DrafterConfig& dcfg, const DrafterLayout& layout,
                      const std::vector<float>& params, const std::vector<float>& m,
                      const std::vector<float>& v, const TrainerState& st, DType export_dtype,
                      int keep_last) {
  const fs::path final_dir = rd.path() / RunDir::checkpoint_name(st.step);
  const fs::path tmp = rd.path() / (".tmp-" + RunDir::checkpoint_name(st.step));
  fs::remove_all(tmp);
  fs::remove_all(final_dir);  // an incomplete folder of the same step (a torn earlier write)
  fs::create_directories(tmp / "trainer_state");
  drafter_save(tmp, dcfg, layout, params, export_dtype);
  const int64_t n = layout.total;
  auto view = [n](const std::vector<float>& x) {
    return Tensor::from_blob(const_cast<float*>(x.data()), {n}, DType::f32);
  };
  safetensors_write(tmp / "trainer_state" / "optimizer.safetensors",
                    {{"master", view(params)}, {"adam_m", view(m)}, {"adam_v", view(v)}},
                    {{"format", "dflash-trainer-state-1"}});
  json sj = {{"format", "dflash-trainer-state-1"},
             {"step", st.step},
             {"skipped", st.skipped},
             {"consecutive_skips", st.consecutive_skips},
             {"data_cursor", st.cursor.to_json()},
             {"interval", st.interval.to_json()},
             {"config", st.config_yaml}};
  write_file_atomic(tmp / "trainer_state" / "state.json", sj.dump(1) + "\n");
  fsync_path(tmp / "trainer_state");
  fsync_path(tmp);
  // Test hook: die here (as on SIGKILL) while checkpoint STEP is half written.
  if (const char* crash = std::getenv("DFLASH_TEST_CRASH_IN_CHECKPOINT")) {
    if (std::to_string(st.step) == crash) std::_Exit(86);
  }
  fs::rename(tmp, final_dir);
  fsync_path(rd.path());
  write_file_atomic(final_dir / "COMPLETE", fmt::format("step {}\n", st.step));
  rd.prune_checkpoints(keep_last);
}

// The trainer state of a checkpoint's trainer_state/state.json text (what write_checkpoint wrote);
// `source` names the file in errors. Every value is checked: counts are in range, the metric
// accumulators have one entry per block slot of the saved config, which must parse.
TrainerState parse_trainer_state(std::string_view text, const std::string& source) {
  const json j = json_parse_strict(text, source);
  TrainerState st;
  const std::string format = json_string(j, "format", source);
  DFLASH_CHECK(format == "dflash-trainer-state-1",
               "{}: format '{}' is not one this dflash reads (dflash-trainer-state-1)", source,
               format);
  st.config_yaml = json_string(j, "config", source);
  const RunConfig saved = RunConfig::from_yaml(st.config_yaml, source + " (key 'config')");
  st.step = json_int(j, "step", source, 0);
  st.skipped = json_int(j, "skipped", source, 0, st.step);
  st.consecutive_skips = json_int(j, "consecutive_skips", source, 0, st.skipped);
  try {
    st.cursor = DataCursor::from_json(json_member(j, "data_cursor", source));
  } catch (const Error& e) {
    throw e.with_context(source);
  }
  st.interval = IntervalMetrics::from_json(json_member(j, "interval", source),
                                           source + " (key 'interval')", saved.training.block_size);
  return st;
}

// Reads the weights and AdamW moments of a complete checkpoint into params/m/v.
void read_checkpoint_tensors(const fs::path& dir, const DrafterLayout& layout,
                             std::vector<float>& params, std::vector<float>& m,
                             std::vector<float>& v) {
  SafetensorsFile f(dir / "trainer_state" / "optimizer.safetensors");
  auto load = [&](const char* name, std::vector<float>& out) {
    Tensor t = f.get_as(name, DType::f32);
    DFLASH_CHECK(t.numel() == layout.total, "{}: tensor '{}' has {} values, the drafter {}",
                 f.path().string(), name, t.numel(), layout.total);
    out.assign(t.data<float>(), t.data<float>() + layout.total);
  };
  load("master", params);
  load("adam_m", m);
  load("adam_v", v);
}

// Document offsets of row `r` of a batch (row-local, [0, ..., real tokens]).
std::vector<int32_t> row_doc_offsets(const Batch& b, int64_t r) {
  std::vector<int32_t> off = {0};
  for (int32_t d = b.row_doc_offsets[r]; d < b.row_doc_offsets[r + 1]; ++d) {
    const DocSlot& s = b.docs[static_cast<size_t>(d)];
    DFLASH_ASSERT(s.start == off.back());
    off.push_back(s.start + s.length);
  }
  return off;
}

}  // namespace

void trainer_state_check(std::string_view text, const std::string& source) {
  (void)parse_trainer_state(text, source);
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
#ifdef DFLASH_HAVE_CUDA
  DFLASH_CHECK(cfg.runtime.backend == "cpu" || cfg.runtime.backend == "cuda",
               "runtime.backend '{}' is not known (cpu or cuda)", cfg.runtime.backend);
#else
  DFLASH_CHECK(cfg.runtime.backend == "cpu",
               "runtime.backend '{}' is not available: this dflash was built without the CUDA "
               "backend (configure with -DDFLASH_CUDA=ON), so it trains on the cpu backend only",
               cfg.runtime.backend);
#endif
  if (cfg.runtime.threads > 0) set_parallel_threads(cfg.runtime.threads);

  RunDir rd(cfg.output_dir);
  auto complete = RunDir::complete_checkpoints(rd.path());
  if (resuming) {
    DFLASH_CHECK(!complete.empty(), "--resume {}: no complete checkpoint to resume from",
                 rd.path().string());
  } else {
    DFLASH_CHECK(complete.empty(),
                 "run directory '{}' already holds checkpoints: use --resume to continue it, or "
                 "choose another output_dir", rd.path().string());
  }
  auto log_file = std::make_shared<std::ofstream>(rd.path() / "log.txt", std::ios::app);
  auto log = [&](const std::string& msg) {
    spdlog::info("{}", msg);
    *log_file << msg << "\n";
    log_file->flush();
  };
  json status = {{"phase", "loading"}, {"pid", ::getpid()}};
  rd.write_status(status);

  try {
    // ---- target, tokenizer, data
    const fs::path target_dir = cfg.model.target;
    TargetModel target = TargetModel::load(target_dir);
    const ModelConfig& tcfg = target.config();
    Tokenizer tok = Tokenizer::load(target_dir);
    DrafterSizes sizes;
    if (cfg.model.intermediate_size) sizes.intermediate_size = *cfg.model.intermediate_size;
    if (cfg.model.num_attention_heads) sizes.num_heads = *cfg.model.num_attention_heads;
    if (cfg.model.num_key_value_heads) sizes.num_kv_heads = *cfg.model.num_key_value_heads;
    if (cfg.model.head_dim) sizes.head_dim = *cfg.model.head_dim;
    sizes.block_size = cfg.training.block_size;
    std::optional<std::vector<int>> taps;
    if (!cfg.model.target_layer_ids.empty()) taps = cfg.model.target_layer_ids;
    DrafterConfig dcfg = drafter_config_for_target(tcfg, cfg.model.drafter_layers, sizes,
                                                   cfg.model.mask_token_id, taps, &tok);
    DrafterLayout layout(dcfg);

    PrepareOptions po;
    po.data = cfg.data.train_file;
    po.chat_template = resolve_chat_template(target_dir, cfg.data.template_name, false);
    po.max_length = cfg.data.max_length;
    po.cache = run_cache_path(cfg.data.cache_dir, rd.path(), po.data, target_dir, po.chat_template,
                              po.max_length);
    fs::create_directories(po.cache.parent_path());
    po.skip_invalid = cfg.data.skip_invalid;
    po.threads = cfg.runtime.threads;
    po.encode = [&tok](std::string_view text, std::vector<std::pair<size_t, size_t>>* offsets) {
      return tok.encode(text, offsets);
    };
    po.tokenizer_hash = hash_file(target_dir / "tokenizer.json");
    po.tokenizer_file = (target_dir / "tokenizer.json").string();
    status["phase"] = "tokenizing";
    rd.write_status(status);
    PrepareResult prep = prepare_dataset(po);
    log(prep.reused ? fmt::format("data: reusing cache {}", po.cache.string())
                    : fmt::format("data: built cache {} ({})", po.cache.string(), prep.reason));

    BatcherOptions bo;
    bo.token_budget = cfg.data.token_budget;
    bo.rows = cfg.data.rows_per_step;
    bo.sort_by_length = cfg.data.sort_by_length;
    bo.seed = cfg.training.seed;
    Batcher batcher(prep.dataset, bo);
    const int64_t per_epoch = batcher.batches_in_epoch(0);
    const int64_t total_steps =
        cfg.training.max_steps > 0 ? cfg.training.max_steps : per_epoch * cfg.training.epochs;
    LrSchedule sched;
    sched.base_lr = cfg.training.lr;
    sched.total_steps = total_steps;
    sched.warmup_steps =
        static_cast<int64_t>(std::llround(cfg.training.warmup_ratio * static_cast<double>(total_steps)));
    sched.min_lr_ratio = cfg.training.min_lr_ratio;
    AdamWConfig adam{cfg.training.beta1, cfg.training.beta2, cfg.training.adam_eps,
                     cfg.training.weight_decay};

    // ---- weights and state
    std::vector<float> params(layout.total), m(layout.total, 0.0f), v(layout.total, 0.0f);
    std::vector<float> grads(layout.total, 0.0f);
    TrainerState st;
    st.interval.obj = ObjectiveMetrics(dcfg.block_size);
    if (resuming) {
      const auto& [cstep, cdir] = complete.back();
      // The configurations are compared before any tensor is read: a changed drafter size is
      // reported as the keys that changed, not as a tensor of the wrong size.
      const fs::path state_file = cdir / "trainer_state" / "state.json";
      st = parse_trainer_state(read_file_text(state_file), state_file.string());
      const RunConfig saved = RunConfig::from_yaml(st.config_yaml, state_file.string());
      const auto diffs = resume_check(saved, cfg, opts.force, rd.path().string());
      read_checkpoint_tensors(cdir, layout, params, m, v);
      if (diffs.empty()) {
        batcher.restore(st.cursor);
      } else {
        // Forced: the old data plan cannot be replayed; continue at the same epoch and batch
        // index of the new plan.
        DataCursor c = batcher.cursor();
        c.epoch = st.cursor.epoch;
        c.batch = std::min(st.cursor.batch, batcher.batches_in_epoch(st.cursor.epoch));
        batcher.restore(c);
        log(fmt::format("--force: resuming despite changed keys; the data order continues at "
                        "epoch {} batch {} of the new plan", c.epoch, c.batch));
        if (st.interval.obj.K != dcfg.block_size) {
          // The open log interval counted slots of the old block size: it starts afresh.
          st.interval = IntervalMetrics();
          st.interval.obj = ObjectiveMetrics(dcfg.block_size);
        }
      }
      log(fmt::format("resumed from {} (step {})", cdir.string(), cstep));
    } else {
      drafter_init(params, layout, cfg.training.seed);
    }
    st.config_yaml = cfg.to_yaml();
    write_file_atomic(rd.path() / "config.resolved.yaml", st.config_yaml);

    // Backend: the CPU reference path, or target + drafter on one GPU.
    const bool use_cuda = cfg.runtime.backend == "cuda";
    // f32 copies of the frozen tables for the CPU drafter step only (the cuda backend keeps its
    // own bf16 copies on the device).
    const std::vector<float> embed = use_cuda ? std::vector<float>() : target.embedding_f32();
    const std::vector<float> head_copy = use_cuda || tcfg.tie_word_embeddings
                                             ? std::vector<float>()
                                             : target.lm_head_f32();
    DrafterTables<float> tables{embed.data(), tcfg.tie_word_embeddings ? embed.data()
                                                                       : head_copy.data()};
    DrafterWorkspace<float> ws;
    std::string backend_desc = fmt::format("cpu, {} threads", parallel_threads());
#ifdef DFLASH_HAVE_CUDA
    std::unique_ptr<CudaTrainBackend> gpu;
    if (use_cuda) {
      DFLASH_CHECK(cfg.runtime.devices.size() == 1,
                   "runtime.devices lists {} devices; this build trains on exactly one GPU",
                   cfg.runtime.devices.size());
      const int64_t max_ctx = cfg.data.rows_per_step * cfg.data.token_budget;
      gpu = std::make_unique<CudaTrainBackend>(cfg.runtime.devices[0], target, dcfg, layout,
                                               max_ctx, cfg.runtime.cuda_graphs);
      gpu->upload_state(params, m, v);
      backend_desc = gpu->description();
    }
#else
    DFLASH_CHECK(!use_cuda, "runtime.backend is 'cuda' but this dflash was built without the CUDA "
                 "backend (configure with -DDFLASH_CUDA=ON)");
#endif
    const DType export_dtype = dtype_from_name(cfg.training.export_dtype);
    log(fmt::format("train: target {} ({} layers, hidden {}), drafter {} layers ({} parameters), "
                    "taps [{}], mask id {}, block {}, {} steps ({} batches/epoch), backend {}",
                    target_dir.string(), tcfg.num_hidden_layers, tcfg.hidden_size,
                    dcfg.num_layers, layout.total, fmt::join(dcfg.target_layer_ids, ","),
                    dcfg.mask_token_id, dcfg.block_size, total_steps, per_epoch,
                    backend_desc));

    ProgressBar bar("train", total_steps, "steps");
    bar.advance(st.step);
    const auto run_start = Clock::now();
    int64_t steps_this_run = 0;
    TrainResult result;
    std::string last_ckpt = complete.empty() ? "" : complete.back().second.string();
    json last_metrics;

    while (st.step < total_steps) {
      const auto t0 = Clock::now();
      Batch batch = batcher.next();
      const double t_data = seconds_since(t0);

      // Target features and targets of every row.
      const int64_t R = batch.tokens.dim(0), L = batch.row_length;
      struct RowWork {
        std::vector<int32_t> offsets;
        std::vector<Anchor> anchors;
        BlockTargets targets;
        Tensor features;
        int64_t real = 0;
      };
      std::vector<RowWork> rows(static_cast<size_t>(R));
      double total_w = 0;
      double t_target = 0, t_gpu_drafter = 0;
      for (int64_t r = 0; r < R; ++r) {
        RowWork& w = rows[static_cast<size_t>(r)];
        w.offsets = row_doc_offsets(batch, r);
        w.real = w.offsets.back();
        if (w.real == 0) continue;
        const int32_t* tok_row = batch.tokens.data<int32_t>() + r * L;
        const uint8_t* mask_row = batch.loss_mask.data<uint8_t>() + r * L;
        Rng rng(derive_seed(cfg.training.seed,
                            {static_cast<uint64_t>(batch.epoch), static_cast<uint64_t>(batch.index),
                             static_cast<uint64_t>(r)}));
        std::span<const uint8_t> mask(mask_row, static_cast<size_t>(w.real));
        std::span<const int32_t> toks(tok_row, static_cast<size_t>(w.real));
        w.anchors = sample_anchors(mask, w.offsets, cfg.training.num_anchors, rng);
        w.targets = block_targets(toks, mask, w.offsets, w.anchors, dcfg.block_size,
                                  cfg.training.gamma);
        for (float x : w.targets.weights) total_w += x;
        if (use_cuda) continue;
        const auto tt = Clock::now();
        w.features = target.forward_taps(toks, w.offsets, dcfg.target_layer_ids);
        t_target += seconds_since(tt);
      }

      // Drafter forward/backward.
      const auto td = Clock::now();
      std::fill(grads.begin(), grads.end(), 0.0f);
      ObjectiveMetrics step_metrics(dcfg.block_size);
      double loss_sum = 0, weight_sum = 0;
      double gnorm = 0;
#ifdef DFLASH_HAVE_CUDA
      if (use_cuda && total_w > 0) {
        std::vector<PackedRowInput> prow(static_cast<size_t>(R));
        for (int64_t r = 0; r < R; ++r) {
          const RowWork& w = rows[static_cast<size_t>(r)];
          PackedRowInput& p = prow[static_cast<size_t>(r)];
          p.tokens = std::span<const int32_t>(batch.tokens.data<int32_t>() + r * L,
                                              static_cast<size_t>(w.real));
          p.doc_offsets = w.offsets.empty() ? std::span<const int32_t>(kEmptyOffsets)
                                            : std::span<const int32_t>(w.offsets);
          p.anchors = w.anchors;
          p.targets = &w.targets;
        }
        const PackedStep packed = pack_step(prow, L, dcfg.block_size, dcfg.mask_token_id, 0,
                                            kBlockRowsMultiple * dcfg.block_size);
        CudaTrainBackend::StepResult res = gpu->step(packed, 1.0 / total_w);
        loss_sum = res.loss_sum;
        weight_sum = res.weight_sum;
        gnorm = res.grad_norm;
        t_target = res.target_s;
        t_gpu_drafter = res.drafter_s;
        for (int64_t r = 0; r < R; ++r) {
          const RowWork& w = rows[static_cast<size_t>(r)];
          const auto b0 = static_cast<size_t>(packed.row_block_start[static_cast<size_t>(r)]);
          const size_t n = w.anchors.size() * static_cast<size_t>(dcfg.block_size);
          accumulate_metrics(step_metrics, w.targets,
                             std::span<const int32_t>(res.argmax.data() +
                                                          b0 * static_cast<size_t>(dcfg.block_size),
                                                      n),
                             {});
        }
      }
#endif
      if (!use_cuda && total_w > 0) {
        for (auto& w : rows) {
          if (w.anchors.empty()) continue;
          DrafterRow<float> row;
          row.features = w.features.data<float>();
          row.tokens = batch.tokens.data<int32_t>() + (&w - rows.data()) * L;
          row.T = w.real;
          row.doc_offsets = w.offsets;
          row.anchors = w.anchors;
          row.targets = &w.targets;
          auto res = drafter_train_row<float>(dcfg, layout, params.data(), grads.data(), tables,
                                              row, 1.0 / total_w, ws);
          loss_sum += res.loss_sum;
          weight_sum += res.weight_sum;
          accumulate_metrics(step_metrics, w.targets, res.argmax, {});
        }
      }
      step_metrics.loss_weighted_sum = loss_sum;
      step_metrics.weight_sum = weight_sum;
      if (!use_cuda) gnorm = std::sqrt(sum_squares_cpu(grads.data(), layout.total));
      const bool finite = std::isfinite(loss_sum) && std::isfinite(gnorm);
      if (!finite || total_w <= 0) {
        st.skipped += 1;
        st.consecutive_skips += 1;
        log(fmt::format("step {}: skipped ({}; loss {}, grad norm {})", st.step + 1,
                        total_w <= 0 ? "no supervised slot" : "non-finite", loss_sum, gnorm));
        DFLASH_CHECK(st.consecutive_skips < cfg.training.max_consecutive_skips,
                     "{} steps in a row were skipped (non-finite loss or gradient); stopping "
                     "(training.max_consecutive_skips = {})", st.consecutive_skips,
                     cfg.training.max_consecutive_skips);
      } else {
        st.consecutive_skips = 0;
        const double lr = sched.at(st.step);
        const int64_t adam_step = st.step + 1 - st.skipped;
        const double clip = clip_scale(gnorm, cfg.training.clip_grad_norm);
#ifdef DFLASH_HAVE_CUDA
        if (use_cuda) gpu->adamw(adam, lr, adam_step, clip);
#endif
        if (!use_cuda) {
          adamw_step_cpu(params.data(), m.data(), v.data(), grads.data(), layout.total, adam, lr,
                         adam_step, clip);
        }
        st.interval.obj.merge(step_metrics);
        st.interval.grad_norm_sum += gnorm;
      }
      const double t_drafter = seconds_since(td);
      st.step += 1;
      ++steps_this_run;
      st.interval.steps += 1;
      st.interval.tokens += batch.n_tokens;
      st.interval.supervised += batch.n_supervised;
      st.interval.t_data += t_data;
      st.interval.t_target += t_target;
      st.interval.t_drafter += t_drafter;
      st.interval.t_gpu_drafter += t_gpu_drafter;
      st.interval.t_total += seconds_since(t0);
      st.cursor = batcher.cursor();
      bar.set_suffix(fmt::format("loss {:.3f} τ {:.2f}", step_metrics.loss(), step_metrics.tau()));
      bar.advance(1);

      const bool last = st.step == total_steps;
      if (st.step % cfg.training.log_interval == 0 || last) {
        const IntervalMetrics& iv = st.interval;
        const double per_step = iv.t_total / std::max<int64_t>(1, iv.steps);
        std::vector<double> slot_acc;
        for (int k = 1; k < dcfg.block_size; ++k) {
          const double a = iv.obj.slot_accuracy(k);
          slot_acc.push_back(std::isnan(a) ? 0.0 : a);
        }
        last_metrics = {
            {"step", st.step},
            {"epoch", st.cursor.epoch},
            {"lr", sched.at(st.step - 1)},
            {"loss", iv.obj.loss()},
            {"accuracy", iv.obj.accuracy()},
            {"slot_accuracy", slot_acc},
            {"tau", iv.obj.tau()},
            {"grad_norm", iv.grad_norm_sum / std::max<int64_t>(1, iv.steps)},
            {"skipped_steps", st.skipped},
            {"tokens_per_s", iv.t_total > 0 ? iv.tokens / iv.t_total : 0.0},
            {"supervised_tokens_per_s", iv.t_total > 0 ? iv.supervised / iv.t_total : 0.0},
            {"s_per_step", per_step},
            {"s_data", iv.t_data / std::max<int64_t>(1, iv.steps)},
            {"s_target", iv.t_target / std::max<int64_t>(1, iv.steps)},
            {"s_drafter", iv.t_drafter / std::max<int64_t>(1, iv.steps)},
            {"s_drafter_gpu", iv.t_gpu_drafter / std::max<int64_t>(1, iv.steps)},
            {"rss_bytes", rss_bytes()},
        };
        rd.append_metrics(last_metrics);
        log(fmt::format("step {}/{} loss {:.4f} acc {:.3f} τ {:.3f} lr {:.2e} grad {:.3f} "
                        "{:.0f} tok/s", st.step, total_steps, iv.obj.loss(), iv.obj.accuracy(),
                        iv.obj.tau(), sched.at(st.step - 1),
                        iv.grad_norm_sum / std::max<int64_t>(1, iv.steps),
                        last_metrics["tokens_per_s"].get<double>()));
        result.final_loss = iv.obj.loss();
        result.final_tau = iv.obj.tau();
        st.interval = IntervalMetrics();
        st.interval.obj = ObjectiveMetrics(dcfg.block_size);
        const double elapsed = seconds_since(run_start);
        status = {{"phase", "training"},
                  {"pid", ::getpid()},
                  {"step", st.step},
                  {"total_steps", total_steps},
                  {"eta_s", elapsed / static_cast<double>(steps_this_run) *
                                static_cast<double>(total_steps - st.step)},
                  {"last", last_metrics},
                  {"checkpoint", last_ckpt}};
        rd.write_status(status);
      }
      const bool stop = g_stop_signal.load() != 0 ||
                        (opts.halt_at_step > 0 && st.step == opts.halt_at_step);
      const bool save = last || stop ||
                        (cfg.training.save_interval > 0 && st.step % cfg.training.save_interval == 0);
      if (save) {
        status["phase"] = "checkpointing";
        rd.write_status(status);
#ifdef DFLASH_HAVE_CUDA
        if (use_cuda) gpu->download_state(params, m, v);
#endif
        write_checkpoint(rd, dcfg, layout, params, m, v, st, export_dtype,
                         cfg.training.keep_last);
        last_ckpt = (rd.path() / RunDir::checkpoint_name(st.step)).string();
        log(fmt::format("checkpoint {}", last_ckpt));
        status["phase"] = "training";
        status["checkpoint"] = last_ckpt;
        rd.write_status(status);
      }
      if (stop && !last) {
        result.interrupted = true;
        const int sig = g_stop_signal.load();
        log(sig ? fmt::format("stopped by signal {} after step {}; resume with --resume {}", sig,
                              st.step, rd.path().string())
                : fmt::format("halted after step {} (--halt-at-step)", st.step));
        break;
      }
    }
    bar.finish();
#ifdef DFLASH_HAVE_CUDA
    if (use_cuda) {
      log(fmt::format("cuda: {} step shapes captured as CUDA graphs (0 = graphs off)",
                      gpu->graphs_captured()));
    }
#endif
    result.steps_done = st.step;
    result.skipped_steps = st.skipped;
    result.last_checkpoint = last_ckpt;
    status["phase"] = result.interrupted ? "interrupted" : "done";
    status["step"] = st.step;
    status["checkpoint"] = last_ckpt;
    rd.write_status(status);
    return result;
  } catch (const Error& e) {
    status["phase"] = "failed";
    status["error"] = e.what();
    try {
      rd.write_status(status);
    } catch (...) {
    }
    *log_file << "error: " << e.what() << "\n";
    throw;
  }
}

}  // namespace dflash
