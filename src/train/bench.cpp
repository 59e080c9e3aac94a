// dflash.cpp — `dflash bench` (see bench.hpp).
#include "train/bench.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "model/dflash2_head_cuda.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/drafter_batch.hpp"
#include "model/drafter_io.hpp"
#include "model/dspark_head_cuda.hpp"
#include "model/objective.hpp"
#include "model/presets.hpp"
#include "model/step_plan.hpp"
#include "train/optimizer.hpp"
#include "train/run_config.hpp"

#ifdef DFLASH_HAVE_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/gemm.hpp"
#include "backend/cuda/graph.hpp"
#include "model/drafter_cuda.hpp"
#include "model/target_cuda.hpp"
#include "ops/adamw.hpp"
#include "ops/attention.hpp"
#include "ops/attention_cudnn.hpp"
#include "ops/cast.hpp"
#include "ops/cross_entropy.hpp"
#include "ops/decode_fused.hpp"
#include "ops/fill.hpp"
#include "ops/linear.hpp"
#include "ops/rmsnorm.hpp"
#include "ops/swiglu.hpp"
#include "train/target_prefill_cuda.hpp"
#endif

namespace dflash {

namespace {

// "-" for what was not measured.
std::string num(double v, const char* f = "{:.1f}") {
  return std::isnan(v) ? std::string("-") : fmt::format(fmt::runtime(f), v);
}
nlohmann::json jnum(double v) {
  return std::isnan(v) ? nlohmann::json() : nlohmann::json(v);
}

}  // namespace

BenchSetup bench_setup(const BenchOptions& o) {
  DFLASH_CHECK(o.token_budget > 0 && o.rows > 0, "bench: --token-budget and --rows must be > 0");
  DFLASH_CHECK(o.doc_length >= 2 && o.doc_length <= o.token_budget,
               "bench: --doc-length {} must be in [2, --token-budget {}]", o.doc_length,
               o.token_budget);
  DFLASH_CHECK(o.anchors > 0, "bench: --anchors must be > 0 (got {})", o.anchors);
  DFLASH_CHECK(o.block_size >= 2 && o.block_size <= 64, "bench: --block-size must be in [2, 64]");
  DFLASH_CHECK(o.drafter_layers > 0, "bench: --drafter-layers must be > 0");
  DFLASH_CHECK(o.steps >= 1 && o.warmup >= 0 && o.kernel_reps >= 1,
               "bench: --steps and --kernel-reps must be >= 1, --warmup >= 0");
  BenchSetup s;
  std::optional<int> mask = o.mask_token_id;
  if (o.config_json.empty()) {
    const ModelPreset& p = model_preset(o.preset);
    s.model_name = p.name + " (" + p.hf_name + " shapes)";
    s.target = p.config;
    if (!mask) mask = p.mask_token_id;
  } else {
    s.model_name = o.config_json;
    s.target = model_config_load(o.config_json);
    DFLASH_CHECK(mask.has_value(), "bench: --mask-token-id is required with --config ({})",
                 o.config_json);
  }
  DrafterSizes sizes;
  sizes.block_size = o.block_size;
  s.drafter = drafter_config_for_target(s.target, o.drafter_layers, sizes, mask);
  if (o.objective.dspark()) {
    DFLASH_CHECK(o.markov_rank >= 0, "bench: --markov-rank must be >= 0 (got {})", o.markov_rank);
    s.drafter.dspark.enabled = true;
    s.drafter.dspark.markov_rank = o.markov_rank;
    s.drafter.dspark.markov_type = o.markov_type;
    s.drafter.dspark.confidence_head = o.objective.dspark_conf_alpha > 0;
    s.drafter.validate();
  }
  if (o.objective.domino()) {
    s.drafter.domino = {true, o.domino_emb_dim, o.domino_gru_dim, o.domino_prefix_len,
                        o.objective.domino_shift_label};
    s.drafter.validate();
  }
  if (o.objective.dflash2()) {
    s.drafter.dflash2 = {true,
                         o.dflash2_conv_kernel_size,
                         o.dflash2_conv_group_size,
                         o.dflash2_selector_rank,
                         o.dflash2_selector_top_k,
                         1.0,
                         0.0};
    s.drafter.validate();  // names the size out of range
  }
  s.docs_per_row = o.token_budget / o.doc_length;
  const int64_t per_doc = std::min<int64_t>(o.anchors, o.doc_length - 1);
  s.blocks = o.rows * s.docs_per_row * per_doc;
  s.tokens = o.rows * s.docs_per_row * o.doc_length;
  s.capacity = TrainStepCapacity{o.rows * o.token_budget, s.blocks};
  return s;
}

TrainMemoryPlan bench_plan(const BenchSetup& s, const BenchOptions& o) {
  const TargetPrefill prefill = target_prefill_of(o.prefill);
  if (o.target_only) {
    TrainMemoryPlan p = plan_target_forward_memory(s.target, s.drafter.target_layer_ids,
                                                   o.rows * o.token_budget, o.device_memory_gib);
    plan_target_prefill(p, prefill);
    return p;
  }
  const DrafterLayout layout(s.drafter);
  return plan_with_recompute_policy<TrainMemoryPlan>(
      o.recompute,
      [&](DrafterActivations a) {
        TrainMemoryPlan p = plan_train_memory(s.target, s.drafter, layout, s.capacity,
                                              o.device_memory_gib, kDrafterCeChunkRows, a);
        plan_target_prefill(p, prefill);
        return p;
      },
      [](const TrainMemoryPlan& p) { return p.fits(); });
}

std::string bench_shortfall_message(const BenchSetup& s, const BenchOptions& o) {
  const DrafterLayout layout(s.drafter);
  const int64_t blocks_per_row = s.blocks / o.rows;
  const FittingBudget fit =
      largest_fitting_budget(o.token_budget, blocks_per_row, [&](int64_t budget, int64_t blocks) {
        if (o.target_only) {  // bench_plan at this budget
          BenchOptions at = o;
          at.token_budget = budget;
          return bench_plan(s, at).fits();
        }
        BenchSetup at = s;
        at.capacity = TrainStepCapacity{o.rows * budget, o.rows * blocks};
        return bench_plan(at, o).fits();
      });
  if (!o.target_only) {
    return plan_shortfall_message(bench_plan(s, o), fit, "--token-budget", "blocks per row");
  }
  const TrainMemoryPlan plan = bench_plan(s, o);
  const uint64_t need = plan.total_bytes(), have = plan.device_bytes;
  return fmt::format(
      "the target forward does not fit the device: it needs {} and --device-memory-gib allows {} "
      "(short by {}); {}",
      format_bytes(need), format_bytes(have), format_bytes(need - std::min(need, have)),
      fit.token_budget > 0
          ? fmt::format("the largest token budget that fits is --token-budget={}", fit.token_budget)
          : std::string("no token budget fits (the target weights alone are too large)"));
}

namespace {

double gib(double bytes) {
  return bytes / 1073741824.0;
}
// v rounded to `digits` decimals (NaN stays NaN).
double rounded(double v, int digits) {
  const double f = std::pow(10.0, digits);
  return std::round(v * f) / f;
}

// The target forward's figures in the form of tools/hf_target_forward.py's lines: rows = documents
// (each attends only to itself, as HF's batch rows), seq = their length, the median device time
// with graphs off; peak_gib = device memory in use beside the CUDA context (as torch's
// max_memory_allocated, which counts only its own allocations).
nlohmann::json target_forward_json(const BenchReport& r) {
  const BenchPhase& p = r.phases.front();
  const double tf = p.flops / (p.ms * 1e-3) / 1e12;
  return {{"timing", "dflash taps"},
          {"rows", r.documents},
          {"seq", r.doc_length},
          {"runs", r.steps},
          {"median_ms", jnum(rounded(p.ms, 2))},
          {"tokens_per_s", jnum(std::round(static_cast<double>(r.tokens_per_step) / p.ms * 1e3))},
          {"tflops_per_s", jnum(rounded(tf, 1))},
          {"pct_of_825", jnum(rounded(tf / 825 * 100, 1))},
          {"graphs_on_median_ms", jnum(rounded(r.device_ms_on, 2))},
          {"peak_gib", jnum(rounded(gib(r.used_bytes - r.context_bytes), 2))},
          {"in_use_gib", jnum(rounded(gib(r.used_bytes), 2))},
          {"plan_gib", jnum(rounded(gib(r.planned_bytes), 2))}};
}

// "GEMM plans (--gemm-plans S): N shapes, A from the measured table, B from the heuristic", then
// one line per plan.
std::string gemm_plans_table(const BenchReport& r) {
  if (r.gemm_plans.empty()) return {};
  int64_t from_table = 0;
  for (const BenchGemmPlan& g : r.gemm_plans) from_table += g.source != "heuristic";
  std::string t = fmt::format(
      "GEMM plans of the step (--gemm-plans {}): {} shapes, {} from the measured table, {} from "
      "the heuristic\n",
      r.gemm_plan_source, r.gemm_plans.size(), from_table,
      static_cast<int64_t>(r.gemm_plans.size()) - from_table);
  for (const BenchGemmPlan& g : r.gemm_plans) t += fmt::format("  {}: {}\n", g.shape, g.source);
  return t;
}

// The table of `dflash bench --target-only`.
std::string target_bench_table(const BenchReport& r) {
  std::string t = r.header + "\n";
  t += fmt::format("{:<30} {:>10} {:>10} {:>10} {:>9} {:>10}\n", "target forward", "ms", "TFLOP",
                   "TFLOP/s", "% of 825", "tokens/s");
  const double flops = r.phases.front().flops;
  for (auto [name, ms] : {std::pair{"device time, graphs off", r.phases.front().ms},
                          std::pair{"device time, graphs on", r.device_ms_on},
                          std::pair{"wall time, graphs off", r.step_ms_off},
                          std::pair{"wall time, graphs on", r.step_ms_on}}) {
    const double tf = flops / (ms * 1e-3) / 1e12;
    t += fmt::format("{:<30} {:>10} {:>10.1f} {:>10} {:>9} {:>10}\n", name, num(ms, "{:.2f}"),
                     flops / 1e12, num(tf, "{:.0f}"), num(tf / 825 * 100, "{:.1f}"),
                     num(static_cast<double>(r.tokens_per_step) / (ms * 1e-3), "{:.0f}"));
  }
  t += fmt::format(
      "memory: plan total {} GiB (arena {} GiB); measured in use after the forwards {} GiB, of "
      "which context and handles {} GiB\n",
      num(gib(r.planned_bytes), "{:.2f}"), num(gib(r.arena_bytes), "{:.2f}"),
      num(gib(r.used_bytes), "{:.2f}"), num(gib(r.context_bytes), "{:.2f}"));
  t += gemm_plans_table(r);
  t += "as tools/hf_target_forward.py prints: " + target_forward_json(r).dump();
  return t;
}

}  // namespace

std::string bench_table(const BenchReport& r) {
  if (r.target_only) return target_bench_table(r);
  std::string t = r.header + "\n";
  t += fmt::format("{:<26} {:>10} {:>10} {:>10} {:>9}\n", "phase (graphs off)", "ms", "TFLOP",
                   "TFLOP/s", "% of 825");
  for (const BenchPhase& p : r.phases) {
    if (p.bytes > 0) {
      const double gbs = p.bytes / (p.ms * 1e-3) / 1e9;
      t += fmt::format(
          "{:<26} {:>10} {:>10} {:>10} {:>9}  ({:.1f} GB moved: {} GB/s, {} % of "
          "4300)\n",
          p.name, num(p.ms, "{:.2f}"), "-", "-", "-", p.bytes / 1e9, num(gbs, "{:.0f}"),
          num(gbs / (kPeakCopyBytesPerS / 1e9) * 100, "{:.1f}"));
      continue;
    }
    const double tf = p.flops / (p.ms * 1e-3) / 1e12;
    t += fmt::format("{:<26} {:>10} {:>10.1f} {:>10} {:>9}\n", p.name, num(p.ms, "{:.2f}"),
                     p.flops / 1e12, num(tf, "{:.0f}"), num(tf / 825 * 100, "{:.1f}"));
  }
  t += fmt::format(
      "{:<26} {:>10}  (anchors, targets and packing {} ms; copies into pinned "
      "buffers {} ms; the rest is waiting for read-backs and launching)\n",
      "host (wall - device)", num(r.host_ms_off, "{:.2f}"), num(r.host_pack_ms, "{:.2f}"),
      num(r.host_stage_ms, "{:.2f}"));
  t += fmt::format("step, graphs off: wall {} ms, device {} ms, host {} ms\n",
                   num(r.step_ms_off, "{:.2f}"), num(r.device_ms_off, "{:.2f}"),
                   num(r.host_ms_off, "{:.2f}"));
  t += fmt::format("step, graphs on:  wall {} ms, device {} ms, host {} ms\n",
                   num(r.step_ms_on, "{:.2f}"), num(r.device_ms_on, "{:.2f}"),
                   num(r.host_ms_on, "{:.2f}"));
  const double best = std::isnan(r.step_ms_on) ? r.step_ms_off : r.step_ms_on;
  t += fmt::format("tokens per step {}, {} tokens/s (wall, {})\n", r.tokens_per_step,
                   num(static_cast<double>(r.tokens_per_step) / (best * 1e-3), "{:.0f}"),
                   std::isnan(r.step_ms_on) ? "graphs off" : "graphs on");
  t += fmt::format(
      "memory: plan total {} GiB (arena {} GiB); measured in use after the steps {} "
      "GiB, of which context and handles {} GiB\n",
      num(r.planned_bytes / 1073741824.0, "{:.2f}"), num(r.arena_bytes / 1073741824.0, "{:.2f}"),
      num(r.used_bytes / 1073741824.0, "{:.2f}"), num(r.context_bytes / 1073741824.0, "{:.2f}"));
  t += gemm_plans_table(r);
  t += fmt::format("{:<24} {:<34} {:>9} {:>9} {:>9} {:>8}\n", "kernel", "shape", "ms", "floor ms",
                   "TFLOP/s", "% floor");
  for (const BenchKernel& k : r.kernels) {
    const double tf = k.flops / (k.ms * 1e-3) / 1e12;
    t += fmt::format("{:<24} {:<34} {:>9} {:>9.3f} {:>9} {:>8}\n", k.name, k.shape,
                     num(k.ms, "{:.3f}"), k.floor_ms, num(tf, "{:.0f}"),
                     num(k.floor_ms / k.ms * 100, "{:.1f}"));
  }
  t.pop_back();
  return t;
}

nlohmann::json bench_json(const BenchReport& r) {
  nlohmann::json j;
  j["header"] = r.header;
  j["drafter_activations"] = r.activations;
  j["loss_type"] = r.loss_type;
  for (const BenchPhase& p : r.phases) {
    j["phases"].push_back({{"name", p.name},
                           {"ms", jnum(p.ms)},
                           {"flops", p.flops},
                           {"bytes", p.bytes},
                           {"tflops_per_s", jnum(p.flops / (p.ms * 1e-3) / 1e12)}});
  }
  j["graphs_off"] = {{"wall_ms", jnum(r.step_ms_off)},
                     {"device_ms", jnum(r.device_ms_off)},
                     {"host_ms", jnum(r.host_ms_off)},
                     {"host_pack_ms", jnum(r.host_pack_ms)},
                     {"host_stage_ms", jnum(r.host_stage_ms)}};
  j["graphs_on"] = {{"wall_ms", jnum(r.step_ms_on)},
                    {"device_ms", jnum(r.device_ms_on)},
                    {"host_ms", jnum(r.host_ms_on)}};
  j["tokens_per_step"] = r.tokens_per_step;
  j["target_only"] = r.target_only;
  j["gemm_plan_source"] = r.gemm_plan_source;
  j["gemm_plans"] = nlohmann::json::array();
  for (const BenchGemmPlan& g : r.gemm_plans)
    j["gemm_plans"].push_back({{"shape", g.shape}, {"source", g.source}});
  if (r.target_only && !r.phases.empty()) j["target_forward"] = target_forward_json(r);
  j["memory"] = {{"plan_total_bytes", jnum(r.planned_bytes)},
                 {"plan_arena_bytes", jnum(r.arena_bytes)},
                 {"measured_in_use_bytes", jnum(r.used_bytes)},
                 {"measured_context_bytes", jnum(r.context_bytes)}};
  for (const BenchKernel& k : r.kernels) {
    j["kernels"].push_back({{"name", k.name},
                            {"shape", k.shape},
                            {"ms", jnum(k.ms)},
                            {"flops", k.flops},
                            {"floor_ms", k.floor_ms}});
  }
  return j;
}

#ifndef DFLASH_HAVE_CUDA

BenchReport run_bench(const BenchOptions&) {
  fail(
      "dflash bench runs on a GPU: this dflash was built without the CUDA backend (configure "
      "with -DDFLASH_CUDA=ON); --plan works without one");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The host side of one step: the rows' tokens are fixed, anchors are drawn afresh each step.
struct HostBatch {
  std::vector<std::vector<int32_t> > tokens, offsets;
  std::vector<std::vector<uint8_t> > mask;
  std::vector<std::vector<Anchor> > anchors;
  std::vector<BlockTargets> targets;
};

HostBatch make_rows(const BenchSetup& s, const BenchOptions& o) {
  HostBatch b;
  Rng rng(derive_seed(o.seed, {0x62656e6368ull /* "bench" */}));
  for (int64_t r = 0; r < o.rows; ++r) {
    std::vector<int32_t> t, off{0};
    for (int64_t d = 0; d < s.docs_per_row; ++d) {
      for (int64_t i = 0; i < o.doc_length; ++i) {
        t.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(s.target.vocab_size))));
      }
      off.push_back(static_cast<int32_t>(t.size()));
    }
    b.mask.emplace_back(t.size(), uint8_t{1});
    b.tokens.push_back(std::move(t));
    b.offsets.push_back(std::move(off));
  }
  b.anchors.resize(b.tokens.size());
  b.targets.resize(b.tokens.size());
  return b;
}

// One step staged as CudaTrainBackend stages it (drafter_batch_stage into the step's fixed shape).
struct StagedStep {
  int64_t T = 0, NK = 0, N = 0;
  double loss_normaliser = 0;  // DrafterBatch::loss_normaliser: Σw (dflash) or the documents
  std::vector<int32_t> tokens, pos, block_tokens, labels;
  std::vector<AttnRange> context_ranges, block_ranges;
  std::vector<float> weights;
  DsparkRowIndex dspark;              // DSpark only: the step's row index
  DominoRowIndex domino;              // Domino only: the step's row index
  std::vector<int32_t> dflash2_prev;  // DFlash2 only: the predecessor tokens [NK]
};

// Samples anchors for step `step`, builds its DrafterBatch and stages it (what the trainer and the
// backend do per step).
StagedStep stage_bench_step(HostBatch& b, const BenchSetup& s, const BenchOptions& o,
                            int64_t step) {
  DrafterBatch d(o.block_size);
  d.objective = o.objective;
  DrafterBatchOptions rule;  // the trainer's slot weights: γ = 7 decay, or D-PACE's mask
  rule.block_size = o.block_size;
  rule.objective = o.objective;
  for (size_t r = 0; r < b.tokens.size(); ++r) {
    Rng rng(derive_seed(o.seed, {static_cast<uint64_t>(step), static_cast<uint64_t>(r)}));
    b.anchors[r] = sample_anchors(b.mask[r], b.offsets[r], o.anchors, rng);
    b.targets[r] = drafter_row_targets(rule, b.tokens[r], b.mask[r], b.offsets[r], b.anchors[r]);
    d.append_row(b.tokens[r], b.offsets[r], b.anchors[r], b.targets[r]);
  }
  d.row_length = o.token_budget;
  StagedStep st;
  st.T = d.rows * d.row_length;
  st.N = d.N();
  st.NK = padded_block_rows(d.N(), o.block_size);
  st.loss_normaliser = d.loss_normaliser();
  const auto T = static_cast<size_t>(st.T), NK = static_cast<size_t>(st.NK);
  st.tokens.resize(T);
  st.context_ranges.resize(T);
  st.pos.resize(T + NK);
  st.block_tokens.resize(NK);
  st.block_ranges.resize(NK);
  st.labels.resize(NK);
  st.weights.resize(NK);
  drafter_batch_stage(d, s.drafter.mask_token_id, 0,
                      {st.tokens, st.context_ranges, st.pos, st.block_tokens, st.block_ranges,
                       st.labels, st.weights});
  if (o.objective.dspark()) st.dspark = dspark_row_index(d, st.NK, s.drafter.vocab_size);
  if (o.objective.domino()) st.domino = domino_row_index(s.drafter, d, st.NK);
  if (o.objective.dflash2()) {
    st.dflash2_prev = dflash2_prev_tokens(d, st.NK, s.drafter.vocab_size);
  }
  return st;
}

// FLOPs of the DSpark head over `rows` block rows: three [rows, H]·[H, V] GEMMs (the draft logits,
// the teacher's, dhf) and three of rank r (the Markov bias, dE, dW2); a gated or rnn head adds
// the bias GEMM of z_lo and its own three GEMMs over [rows, X]·[X, A] (gated X = H + r, A = r;
// rnn X = 2r + H, A = 3r; model/dspark_head_cuda.hpp); 2 per multiply-add.
double dspark_head_flops(const DrafterConfig& d, int64_t rows) {
  const double n = static_cast<double>(rows), V = static_cast<double>(d.vocab_size);
  const double H = static_cast<double>(d.hidden_size), r = d.dspark.markov_rank;
  double f = 6.0 * n * V * (H + r);
  if (r > 0 && d.dspark.markov_type == MarkovHeadType::gated)
    f += 2 * n * V * r + 6 * n * r * (H + r);
  if (r > 0 && d.dspark.markov_type == MarkovHeadType::rnn) {
    f += 2 * n * V * r + 6 * n * 3 * r * (2 * r + H);
  }
  return f;
}

// FLOPs of the Domino head over `rows` block rows (domino_head_cuda's GEMMs, 2 per multiply-add):
// [H, V] twice (U, dhf) and [E, V] three times (F, dZ, dW2); [H+G, E] three times (A, its dX and
// dW1); the GRU's [H, 3G] twice (XI, dW_ih) and [G, 3G] three times (HH, dprev, dW_hh).
double domino_head_flops(const DrafterConfig& d, int64_t rows) {
  const double n = static_cast<double>(rows), V = static_cast<double>(d.vocab_size);
  const double H = static_cast<double>(d.hidden_size), E = static_cast<double>(d.domino.emb_dim);
  const double G = static_cast<double>(d.domino.gru_hidden_dim);
  return 2.0 * n * (2 * V * H + 3 * V * E + 3 * E * (H + G) + 6 * G * H + 9 * G * G);
}

// FLOPs of DFlash2's selector head over `rows` block rows (dflash2_head_cuda with ū = U, the fused
// CE computing the base): [H, V] twice (U again, dhf += dl·LM head), and P_h [r, H] three times
// (P_h·h, its ∂h, dP_h); the K scores and their gradients (O(K·r) a row) are left out.
double dflash2_head_flops(const DrafterConfig& d, int64_t rows) {
  const double n = static_cast<double>(rows), V = static_cast<double>(d.vocab_size);
  const double H = static_cast<double>(d.hidden_size), r = d.dflash2.selector_rank;
  return 2.0 * n * (2 * V * H + 3 * r * H);
}

// FLOPs of DFlash2's kernel projections over `rows` block rows, forward (one GEMM δ = u·W_kpᵀ of
// [H] → [2·T·Gc] per sublayer, two sublayers a layer) or backward (twice that: du and dW_kp). The
// convs themselves (O(T·H) a row) are left out.
double dflash2_conv_flops(const DrafterConfig& d, int64_t rows, bool backward) {
  if (!d.dflash2.enabled) return 0;
  const double H = static_cast<double>(d.hidden_size);
  const double width = 2.0 * d.dflash2.conv_kernel_size * (H / d.dflash2.conv_group_size);
  const double fwd = 2.0 * static_cast<double>(rows) * H * width * 2 * d.num_layers;
  return backward ? 2 * fwd : fwd;
}

// The head phase's name and FLOPs in the bench table: the objective's head, else the fused CE's
// (DFlash2: the fused CE's base and the selector head).
std::pair<const char*, double> head_phase(const DrafterConfig& d, int64_t rows, double ce_flops) {
  if (d.dspark.enabled) return {"DSpark head (+ final norm)", dspark_head_flops(d, rows)};
  if (d.domino.enabled) return {"Domino head (+ final norm)", domino_head_flops(d, rows)};
  if (d.dflash2.enabled) {
    return {"LM-head CE + DFlash2 selector (+ final norm)", ce_flops + dflash2_head_flops(d, rows)};
  }
  return {"LM-head CE (+ final norm)", ce_flops};
}

// Keys the real block rows see (context prefix + own block) and the causal keys of real tokens.
double drafter_visible_keys(const StagedStep& p, int K) {
  double n = 0;
  for (int64_t q = 0; q < p.N * K; ++q) {
    const AttnRange& r = p.block_ranges[static_cast<size_t>(q)];
    n += (r.hi1 - r.lo1) + (r.hi2 - r.lo2);
  }
  return n;
}
double causal_visible_keys(const BenchSetup& s, const BenchOptions& o) {
  const double L = static_cast<double>(o.doc_length);
  return static_cast<double>(o.rows * s.docs_per_row) * L * (L + 1) / 2;
}

uint64_t used_device_memory() {
  size_t free = 0, total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total - free;
}

// Device memory outside the arena, for the kernels timed alone.
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) { DFLASH_CUDA_CHECK(cudaMalloc(&p_, bytes)); }
  ~DeviceMemory() { cudaFree(p_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

// One step input: its arena buffer and a pinned host twin.
struct Staged {
  void* dev = nullptr;
  void* host = nullptr;
  size_t bytes = 0;
  Staged(cuda::DeviceArena& a, const char* name, size_t n) : bytes(n) {
    dev = a.get_bytes(name, n);
    DFLASH_CUDA_CHECK(cudaMallocHost(&host, std::max<size_t>(n, 1)));
  }
  ~Staged() { cudaFreeHost(host); }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  template <typename T>
  void fill(const std::vector<T>& v) {
    DFLASH_CHECK(v.size() * sizeof(T) <= bytes, "bench: input of {} bytes for {}",
                 v.size() * sizeof(T), bytes);
    std::memcpy(host, v.data(), v.size() * sizeof(T));
  }
  // Enqueues the copy of elements [first, first + n) of T.
  template <typename T>
  void upload(cudaStream_t s, int64_t first, int64_t n) const {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(static_cast<T*>(dev) + first, static_cast<T*>(host) + first,
                                      static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice,
                                      s));
  }
};

// Median device time of `fn` over `reps` runs after 2 warm-up runs.
template <typename F>
double time_kernel(cuda::CudaContext& ctx, int reps, F&& fn) {
  cudaEvent_t a = ctx.new_event(true), b = ctx.new_event(true);
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    DFLASH_CUDA_CHECK(cudaEventRecord(a, ctx.stream()));
    fn();
    DFLASH_CUDA_CHECK(cudaEventRecord(b, ctx.stream()));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  return median(ms);
}

float elapsed(cudaEvent_t a, cudaEvent_t b) {
  float t = 0;
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
  return t;
}

// The context's GEMM plans into r (sorted by shape): which ones the measured table chose.
void collect_gemm_plans(cuda::CudaContext& ctx, const BenchOptions& o, BenchReport& r) {
  r.gemm_plan_source = o.gemm_plans;
  for (const auto& [key, plan] : ctx.gemm_plans())
    r.gemm_plans.push_back({gemm_shape_key_string(plan->key), plan->source});
  std::sort(r.gemm_plans.begin(), r.gemm_plans.end(),
            [](const BenchGemmPlan& a, const BenchGemmPlan& b) { return a.shape < b.shape; });
}

/// The ops of one dense target layer as TargetCuda::run_layers runs them, each timed alone on T
/// rows of random inputs at the target's shapes (rows "target ..."): the two RMSNorms (one row:
/// the same op and shape), the fused q|k|v GEMM, qkv_prepare (q/k RMSNorm, RoPE, the k/v copy),
/// o_proj accumulated into the fp32 residual, the fused gate|up GEMM, SwiGLU and down_proj
/// accumulated. GEMM floors at kPeakBf16Flops; the others at the bytes they must move over
/// kPeakCopyBytesPerS (flops NAN). `pos` [T] device positions. Their sum, times the layers, against
/// the target forward phase says what the attention and the launches leave.
std::vector<BenchKernel> target_layer_rows(cuda::CudaContext& ctx, const BenchOptions& o,
                                           const ModelConfig& c, int64_t T, const int32_t* pos) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  const int64_t QD = NH * D, KD = NKV * D, QKV = QD + 2 * KD;
  auto z = [](int64_t n) { return static_cast<size_t>(n); };
  DeviceMemory x(z(T * H * 4)), hn(z(T * H * 2)), qkv(z(T * QKV * 2)), q(z(T * QD * 2)),
      k(z(T * KD * 2)), v(z(T * KD * 2)), gu(z(T * 2 * I * 2)), act(z(T * I * 2)),
      wqkv(z(QKV * H * 2)), wo(z(H * QD * 2)), wgu(z(2 * I * H * 2)), wdown(z(H * I * 2)),
      norm(z(std::max(H, D) * 4)), inv_freq(z(D / 2 * 4));
  int seed = 41;
  for (auto [p, n] : {std::pair{hn.as<uint16_t>(), T * H},
                      {qkv.as<uint16_t>(), T * QKV},
                      {gu.as<uint16_t>(), T * 2 * I},
                      {act.as<uint16_t>(), T * I},
                      {wqkv.as<uint16_t>(), QKV * H},
                      {wo.as<uint16_t>(), H * QD},
                      {wgu.as<uint16_t>(), 2 * I * H},
                      {wdown.as<uint16_t>(), H * I}})
    fill_uniform_cuda(ctx, p, n, 0.0f, 0.02f, static_cast<uint64_t>(seed++));
  fill_uniform_cuda(ctx, x.as<float>(), T * H, 0.0f, 1.0f, 51);
  fill_uniform_cuda(ctx, norm.as<float>(), std::max(H, D), 1.0f, 0.0f, 52);
  fill_uniform_cuda(ctx, inv_freq.as<float>(), D / 2, 0.01f, 0.01f, 53);
  const double t = static_cast<double>(T);
  auto gemm = [&](const char* name, int64_t in, int64_t out, auto&& fn) {
    const double flops = 2.0 * t * static_cast<double>(in * out);
    BenchKernel r{name, fmt::format("{}x{}x{}", T, out, in), NAN, flops,
                  flops / kPeakBf16Flops * 1e3};
    r.ms = time_kernel(ctx, o.kernel_reps, fn);
    return r;
  };
  auto pass = [&](const char* name, std::string shape, double bytes, auto&& fn) {
    BenchKernel r{name, std::move(shape), NAN, NAN, bytes / kPeakCopyBytesPerS * 1e3};
    r.ms = time_kernel(ctx, o.kernel_reps, fn);
    return r;
  };
  const double eps = c.rms_norm_eps;
  QkvPrepare prep{
      T, NH, NKV, D, norm.as<float>(), norm.as<float>(), eps, pos, inv_freq.as<float>(), 1.0f};
  std::vector<BenchKernel> rows;
  rows.push_back(
      pass("target RMSNorm (x2)", fmt::format("{}x{} f32 -> bf16", T, H), t * H * 6, [&] {
        rmsnorm_fwd_cuda(ctx, hn.as<uint16_t>(), static_cast<float*>(nullptr), x.as<const float>(),
                         norm.as<const float>(), T, H, eps);
      }));
  rows.push_back(gemm("target q|k|v GEMM", H, QKV, [&] {
    linear_fwd_cuda(ctx, qkv.as<uint16_t>(), hn.as<const uint16_t>(), wqkv.as<const uint16_t>(), T,
                    H, QKV);
  }));
  rows.push_back(
      pass("target qkv_prepare", fmt::format("{}x{} (q/k-norm, RoPE)", T, QKV), t * QKV * 4, [&] {
        qkv_prepare_cuda(ctx, q.as<uint16_t>(), nullptr, k.as<uint16_t>(), v.as<uint16_t>(),
                         nullptr, qkv.as<const uint16_t>(), prep);
      }));
  rows.push_back(gemm("target o GEMM (+= x)", QD, H, [&] {
    linear_fwd_acc_cuda(ctx, x.as<float>(), q.as<const uint16_t>(), wo.as<const uint16_t>(), T, QD,
                        H);
  }));
  rows.push_back(gemm("target gate|up GEMM", H, 2 * I, [&] {
    linear_fwd_cuda(ctx, gu.as<uint16_t>(), hn.as<const uint16_t>(), wgu.as<const uint16_t>(), T, H,
                    2 * I);
  }));
  rows.push_back(pass("target SwiGLU", fmt::format("{}x{} bf16", T, I), t * I * 6, [&] {
    swiglu_fwd_cuda(ctx, act.as<uint16_t>(), gu.as<const uint16_t>(), gu.as<const uint16_t>() + I,
                    T, I, 2 * I);
  }));
  rows.push_back(gemm("target down GEMM (+= x)", I, H, [&] {
    linear_fwd_acc_cuda(ctx, x.as<float>(), act.as<const uint16_t>(), wdown.as<const uint16_t>(), T,
                        I, H);
  }));
  return rows;
}

/// The documents of a staged step: {count, longest} (every bench step has the same split).
std::pair<int64_t, int64_t> bench_documents(const StagedStep& packed) {
  const std::vector<int32_t> off =
      attention_causal_varlen_docs(packed.context_ranges.data(), packed.T);
  int64_t longest = 0;
  for (size_t d = 0; d + 1 < off.size(); ++d)
    longest = std::max<int64_t>(longest, off[d + 1] - off[d]);
  return {static_cast<int64_t>(off.size()) - 1, longest};
}

/// --prefill cudnn: the target's causal prefill on cuDNN as the trainer runs it
/// (train/target_prefill_cuda.hpp): the graph of the power-of-two bucket of `packed`'s documents,
/// of rows up to --token-budget.
void bench_use_prefill(TargetCuda& target, const BenchOptions& o, const StagedStep& packed) {
  if (target_prefill_of(o.prefill) != TargetPrefill::cudnn) return;
  const auto [docs, longest] = bench_documents(packed);
  DFLASH_CHECK(longest <= o.token_budget, "bench: a document of {} rows in rows of {}", longest,
               o.token_budget);
  cuda_target_use_cudnn(target);
  (void)cuda_target_prefill_select(target, docs, o.token_budget);
}

// `dflash bench --target-only`: the target's tap forward alone, in the plan of that forward
// (bench_plan), on the inputs of the full bench's first step (same tokens, positions and document
// ranges). Each forward is timed with device events (median over o.steps after o.warmup) and by
// the wall clock around enqueue and synchronize, with graphs off and on.
BenchReport run_target_bench(const BenchOptions& o, const BenchSetup& s,
                             const TrainMemoryPlan& plan) {
  BenchReport r;
  r.target_only = true;
  cuda::CudaContext ctx(o.device);
  r.context_bytes = static_cast<double>(used_device_memory());
  cuda::DeviceArena arena(ctx, plan.arena);
  TargetCuda target(ctx, s.target, o.seed + 1, plan.T, plan.target_layers, &arena);
  const std::vector<int>& taps = s.drafter.target_layer_ids;
  auto* features = arena.get<uint16_t>(
      kTargetOnlyFeatures, plan.T * static_cast<int64_t>(taps.size()) * s.target.hidden_size);
  const auto T = static_cast<size_t>(plan.T);
  Staged tokens(arena, "inputs.tokens", T * 4), tranges(arena, "inputs.target_ranges", T * 16);
  Staged pos(arena, "inputs.pos", T * 4);
  const uint64_t pool = arena.planned_bytes("workspace.op_scratch");
  ctx.allocator().use_pool(arena.get_bytes("workspace.op_scratch", pool), pool);
  const std::vector<std::string> unused = arena.untaken();
  DFLASH_CHECK(unused.empty(), "bench: planned buffer '{}' is not used (plan and code disagree)",
               unused.empty() ? "" : unused.front());
  HostBatch batch = make_rows(s, o);
  const StagedStep packed = stage_bench_step(batch, s, o, 0);
  DFLASH_CHECK(packed.T == plan.T, "bench: {} staged tokens for a plan of {}", packed.T, plan.T);
  bench_use_prefill(target, o, packed);
  tokens.fill(packed.tokens);
  tranges.fill(packed.context_ranges);
  pos.fill(std::vector<int32_t>(packed.pos.begin(), packed.pos.begin() + plan.T));
  cudaStream_t st = ctx.stream();
  tokens.upload<int32_t>(st, 0, plan.T);
  tranges.upload<AttnRange>(st, 0, plan.T);
  pos.upload<int32_t>(st, 0, plan.T);
  ctx.synchronize();
  r.planned_bytes = static_cast<double>(plan.total_bytes());
  r.arena_bytes = static_cast<double>(plan.arena.arena_bytes);
  r.tokens_per_step = s.tokens;
  r.documents = o.rows * s.docs_per_row;
  r.doc_length = o.doc_length;
  r.steps = o.steps;
  r.header = fmt::format(
      "dflash bench --target-only: {}, random weights; taps [{}] (a {}-layer drafter's): {} of {} "
      "layers; {} row(s) x {} tokens ({} documents of {} per row); causal prefill: {}; {}",
      s.model_name, fmt::join(taps, ", "), s.drafter.num_layers, plan.target_layers,
      s.target.num_hidden_layers, o.rows, o.token_budget, s.docs_per_row, o.doc_length, o.prefill,
      cuda::device_description(o.device));

  cudaEvent_t ev0 = ctx.new_event(true), ev1 = ctx.new_event(true);
  cuda::GraphCache<int64_t> graphs;
  auto enqueue = [&] {
    target.forward_taps(features, static_cast<int32_t*>(tokens.dev), static_cast<int32_t*>(pos.dev),
                        static_cast<AttnRange*>(tranges.dev), plan.T, taps);
  };
  // Medians of {wall, device} ms per forward.
  auto measure = [&](bool use_graphs) {
    std::vector<double> wall, device;
    for (int i = 0; i < o.warmup + o.steps; ++i) {
      const auto w0 = Clock::now();
      DFLASH_CUDA_CHECK(cudaEventRecord(ev0, st));
      if (use_graphs) {
        graphs.run(plan.T, st, enqueue);
      } else {
        enqueue();
      }
      DFLASH_CUDA_CHECK(cudaEventRecord(ev1, st));
      DFLASH_CUDA_CHECK(cudaEventSynchronize(ev1));
      if (i < o.warmup) continue;
      wall.push_back(std::chrono::duration<double, std::milli>(Clock::now() - w0).count());
      device.push_back(elapsed(ev0, ev1));
    }
    return std::pair{median(wall), median(device)};
  };
  const double flops =
      target_forward_flops(s.target, plan.target_layers, plan.T, causal_visible_keys(s, o));
  r.phases = {{"target forward", NAN, flops, 0}};
  if (o.graphs_off) {
    const auto [wall, device] = measure(false);
    r.phases.front().ms = device;
    r.step_ms_off = wall;
    r.device_ms_off = device;
    r.host_ms_off = wall - device;
  }
  if (o.graphs_on) {
    const auto [wall, device] = measure(true);
    r.step_ms_on = wall;
    r.device_ms_on = device;
    r.host_ms_on = wall - device;
  }
  r.used_bytes = static_cast<double>(used_device_memory());
  collect_gemm_plans(ctx, o, r);
  ctx.synchronize();
  return r;
}

}  // namespace

BenchReport run_bench(const BenchOptions& o) {
  const BenchSetup s = bench_setup(o);
  const DrafterLayout layout(s.drafter);
  const TrainMemoryPlan plan = bench_plan(s, o);
  DFLASH_CHECK(plan.fits(), "{}", bench_shortfall_message(s, o));
  BenchReport r;
  const int n_dev = cuda::device_count();
  DFLASH_CHECK(o.device >= 0 && o.device < n_dev, "bench: --device {}: {} CUDA devices visible",
               o.device, n_dev);
  cuda::gemm_plan_source_set(cuda::gemm_plan_source_parse(o.gemm_plans, "bench: --gemm-plans"));
  if (o.target_only) return run_target_bench(o, s, plan);
  cuda::CudaContext ctx(o.device);
  r.context_bytes = static_cast<double>(used_device_memory());
  cuda::DeviceArena arena(ctx, plan.arena);
  TargetCuda target(ctx, s.target, o.seed + 1, plan.T, plan.target_layers, &arena);
  DrafterCuda drafter(ctx, s.drafter, layout, plan.T, plan.NK, target.embed(), target.lm_head(),
                      &arena, kDrafterCeChunkRows, plan.activations);
  drafter.randomize_state(o.seed + 2);
  const auto T = static_cast<size_t>(plan.T), NK = static_cast<size_t>(plan.NK);
  Staged tokens(arena, "inputs.tokens", T * 4), tranges(arena, "inputs.target_ranges", T * 16);
  Staged pos(arena, "inputs.pos", (T + NK) * 4), btok(arena, "inputs.block_tokens", NK * 4);
  Staged branges(arena, "inputs.block_ranges", NK * 16), labels(arena, "inputs.labels", NK * 4);
  Staged weights(arena, "inputs.weights", NK * 4);
  // DSpark: its row index, and the target's final norm (random weights: 1, as every norm's).
  const bool dspark = s.drafter.dspark.enabled;
  std::vector<std::unique_ptr<Staged> > dsp;
  float* final_norm = nullptr;
  if (dspark) {
    for (const char* name : {kInputDsparkPrev, kInputDsparkTeacherPos, kInputDsparkW1Order}) {
      dsp.push_back(std::make_unique<Staged>(arena, name, NK * 4));
    }
    dsp.push_back(std::make_unique<Staged>(arena, kInputDsparkW1Seg, (NK + 1) * 4));
    final_norm = arena.get<float>(kTargetFinalNorm, s.target.hidden_size);
    fill_uniform_cuda(ctx, final_norm, s.target.hidden_size, 1.0f, 0.0f, o.seed + 3);
  }
  // Domino: its row index and λ.
  const bool domino = s.drafter.domino.enabled;
  std::unique_ptr<Staged> dm_tok, dm_lambda;
  if (domino) {
    dm_tok = std::make_unique<Staged>(arena, kInputDominoGruTok, NK * 4);
    dm_lambda = std::make_unique<Staged>(arena, kInputDominoLambda, sizeof(double));
  }
  // DFlash2: the predecessor tokens and α_sel.
  const bool dflash2 = s.drafter.dflash2.enabled;
  std::unique_ptr<Staged> d2_prev, d2_alpha;
  if (dflash2) {
    d2_prev = std::make_unique<Staged>(arena, kInputDflash2Prev, NK * 4);
    d2_alpha = std::make_unique<Staged>(arena, kInputDflash2Alpha, sizeof(double));
  }
  const uint64_t pool = arena.planned_bytes("workspace.op_scratch");
  ctx.allocator().use_pool(arena.get_bytes("workspace.op_scratch", pool), pool);
  const std::vector<std::string> unused = arena.untaken();
  DFLASH_CHECK(unused.empty(), "bench: planned buffer '{}' is not used (plan and code disagree)",
               unused.empty() ? "" : unused.front());
  r.planned_bytes = static_cast<double>(plan.total_bytes());
  r.arena_bytes = static_cast<double>(plan.arena.arena_bytes);
  r.tokens_per_step = s.tokens;
  r.activations = drafter_activations_name(plan.activations);
  r.loss_type = o.objective.dpace() ? fmt::format("{} (alpha {})", loss_type_name(o.objective.loss),
                                                  o.objective.dpace_alpha)
                                    : std::string(loss_type_name(o.objective.loss));
  if (dspark) {
    r.loss_type =
        fmt::format("dspark (markov_rank {} {}, confidence head {})", s.drafter.dspark.markov_rank,
                    markov_head_type_name(s.drafter.dspark.markov_type),
                    s.drafter.dspark.confidence_head ? "on" : "off");
  }
  if (domino) {
    const DominoHead& h = s.drafter.domino;
    r.loss_type = fmt::format(
        "domino (emb_dim {}, gru_hidden_dim {}, pure_draft_prefix_len {}, shift_label {}, "
        "lambda {})",
        h.emb_dim, h.gru_hidden_dim, h.pure_draft_prefix_len, h.shift_label,
        o.objective.domino_lambda);
  }
  if (dflash2) {
    const Dflash2Heads& h = s.drafter.dflash2;
    r.loss_type = fmt::format(
        "dflash2 (conv_kernel_size {}, conv_group_size {}, selector_rank {}, selector_top_k {}, "
        "alpha_sel {}, base loss {})",
        h.conv_kernel_size, h.conv_group_size, h.selector_rank, h.selector_top_k,
        o.objective.dflash2_selector_alpha, r.loss_type);
  }
  r.documents = o.rows * s.docs_per_row;
  r.doc_length = o.doc_length;
  r.steps = o.steps;
  r.header = fmt::format(
      "dflash bench: {}, random weights; drafter {} layers, taps [{}], block {}; {} row(s) x {} "
      "tokens ({} documents of {} per row), {} anchors per document: {} blocks ({} block rows); "
      "loss {}; the backward {} the forward's activations ({}); causal prefill: {}; {}",
      s.model_name, s.drafter.num_layers, fmt::join(s.drafter.target_layer_ids, ","), o.block_size,
      o.rows, o.token_budget, s.docs_per_row, o.doc_length, o.anchors, s.blocks, plan.NK,
      r.loss_type, plan.activations == DrafterActivations::keep ? "keeps" : "recomputes",
      plan.activations_reason, o.prefill, cuda::device_description(o.device));

  cudaStream_t st = ctx.stream();
  HostBatch batch = make_rows(s, o);
  bench_use_prefill(target, o, stage_bench_step(batch, s, o, 0));
  StagedStep packed;
  auto enqueue_target = [&](int64_t t) {
    tokens.upload<int32_t>(st, 0, t);
    tranges.upload<AttnRange>(st, 0, t);
    pos.upload<int32_t>(st, 0, t);
    const auto* tk = static_cast<int32_t*>(tokens.dev);
    const auto* ps = static_cast<int32_t*>(pos.dev);
    const auto* rg = static_cast<AttnRange*>(tranges.dev);
    if (dspark) {  // the taps, then the teacher's final-norm rows
      uint16_t* f = drafter.features();
      target.forward_taps_final(f, f + t * s.drafter.n_taps() * s.drafter.hidden_size, final_norm,
                                tk, ps, rg, t, s.drafter.target_layer_ids);
    } else {
      target.forward_taps(drafter.features(), tk, ps, rg, t, s.drafter.target_layer_ids);
    }
  };
  auto enqueue_drafter = [&](int64_t t, int64_t nk) {
    pos.upload<int32_t>(st, t, nk);
    btok.upload<int32_t>(st, 0, nk);
    branges.upload<AttnRange>(st, 0, nk);
    labels.upload<int32_t>(st, 0, nk);
    weights.upload<float>(st, 0, nk);
    DrafterCudaInputs in;
    in.T = t;
    in.NK = nk;
    in.features = drafter.features();
    in.pos = static_cast<int32_t*>(pos.dev);
    in.block_tokens = static_cast<int32_t*>(btok.dev);
    in.ranges = static_cast<AttnRange*>(branges.dev);
    in.labels = static_cast<int32_t*>(labels.dev);
    in.weights = static_cast<float*>(weights.dev);
    in.objective = o.objective;
    if (dspark) {
      for (size_t i = 0; i < dsp.size(); ++i) dsp[i]->upload<int32_t>(st, 0, i == 3 ? nk + 1 : nk);
      in.dspark_prev = static_cast<int32_t*>(dsp[0]->dev);
      in.dspark_teacher_pos = static_cast<int32_t*>(dsp[1]->dev);
      in.dspark_w1_order = static_cast<int32_t*>(dsp[2]->dev);
      in.dspark_w1_seg = static_cast<int32_t*>(dsp[3]->dev);
    }
    if (domino) {
      dm_tok->upload<int32_t>(st, 0, nk);
      dm_lambda->upload<double>(st, 0, 1);
      in.domino_gru_tok = static_cast<int32_t*>(dm_tok->dev);
      in.domino_lambda = static_cast<double*>(dm_lambda->dev);
    }
    if (dflash2) {
      d2_prev->upload<int32_t>(st, 0, nk);
      d2_alpha->upload<double>(st, 0, 1);
      in.dflash2_prev = static_cast<int32_t*>(d2_prev->dev);
      in.dflash2_alpha = static_cast<double*>(d2_alpha->dev);
    }
    drafter.forward_backward(in, 1.0);
  };
  enum Ev { kStart, kTarget, kForward, kHead, kBackward, kOptStart, kOptEnd, kNumEv };
  std::vector<cudaEvent_t> ev;
  for (int i = 0; i < kNumEv; ++i) ev.push_back(ctx.new_event(true));
  cuda::GraphCache<int64_t> target_graphs;
  cuda::GraphCache<std::pair<int64_t, int64_t> > drafter_graphs;
  int64_t step_no = 0;
  AdamWConfig adam;

  // One training step as the trainer runs it; returns {wall ms, per-phase device ms...}.
  auto run_step = [&](bool graphs) {
    const auto w0 = Clock::now();
    packed = stage_bench_step(batch, s, o, step_no);
    const auto w1 = Clock::now();
    tokens.fill(packed.tokens);
    tranges.fill(packed.context_ranges);
    pos.fill(packed.pos);
    btok.fill(packed.block_tokens);
    branges.fill(packed.block_ranges);
    labels.fill(packed.labels);
    weights.fill(packed.weights);
    if (dspark) {
      dsp[0]->fill(packed.dspark.prev);
      dsp[1]->fill(packed.dspark.teacher_pos);
      dsp[2]->fill(packed.dspark.w1_order);
      dsp[3]->fill(packed.dspark.w1_seg);
    }
    if (domino) {
      dm_tok->fill(packed.domino.gru_tok);
      dm_lambda->fill(std::vector<double>{packed.domino.lambda});
    }
    if (dflash2) {
      d2_prev->fill(packed.dflash2_prev);
      d2_alpha->fill(std::vector<double>{o.objective.dflash2_selector_alpha});
    }
    const double total_w = packed.loss_normaliser;
    const auto w2 = Clock::now();
    const int64_t t = packed.T, nk = packed.NK;
    drafter.set_phase_events(graphs ? DrafterCuda::PhaseEvents{}
                                    : DrafterCuda::PhaseEvents{ev[kForward], ev[kHead]});
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[kStart], st));
    if (graphs) {
      target_graphs.run(t, st, [&] { enqueue_target(t); });
    } else {
      enqueue_target(t);
    }
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[kTarget], st));
    if (graphs) {
      drafter_graphs.run({t, nk}, st, [&] { enqueue_drafter(t, nk); });
    } else {
      enqueue_drafter(t, nk);
    }
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[kBackward], st));
    const DrafterCuda::Results res = drafter.fetch_results(nk);
    const double scale = 1.0 / total_w;
    const double clip = clip_scale(res.grad_norm * scale, 1.0);
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[kOptStart], st));
    drafter.adamw(adam, 6e-4, ++step_no, clip * scale);
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[kOptEnd], st));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(ev[kOptEnd]));
    const double wall = std::chrono::duration<double, std::milli>(Clock::now() - w0).count();
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::vector<double> out = {wall,
                               elapsed(ev[kStart], ev[kTarget]),
                               graphs ? NAN : elapsed(ev[kTarget], ev[kForward]),
                               graphs ? NAN : elapsed(ev[kForward], ev[kHead]),
                               graphs ? NAN : elapsed(ev[kHead], ev[kBackward]),
                               elapsed(ev[kTarget], ev[kBackward]),
                               elapsed(ev[kOptStart], ev[kOptEnd]),
                               ms(w0, w1),
                               ms(w1, w2)};
    return out;
  };
  enum Col { kWall, kTgt, kFwd, kHd, kBwd, kDrafter, kOpt, kPack, kStage, kNumCol };
  auto measure = [&](bool graphs) {
    for (int i = 0; i < o.warmup; ++i) run_step(graphs);
    std::vector<std::vector<double> > cols(kNumCol);
    std::vector<double> device, host;
    for (int i = 0; i < o.steps; ++i) {
      const std::vector<double> v = run_step(graphs);
      for (int c = 0; c < kNumCol; ++c)
        cols[static_cast<size_t>(c)].push_back(v[static_cast<size_t>(c)]);
      const double d = v[kTgt] + v[kDrafter] + v[kOpt];
      device.push_back(d);
      host.push_back(v[kWall] - d);
    }
    std::vector<double> med;
    for (auto& c : cols) med.push_back(median(c));
    med.push_back(median(device));
    med.push_back(median(host));
    return med;  // kNumCol columns, then device, host
  };

  if (o.graphs_off) {
    const std::vector<double> m = measure(false);
    const double visible = drafter_visible_keys(packed, o.block_size);
    const DrafterFlops fv = drafter_step_flops(s.drafter, packed.T, packed.NK, visible);
    const double tgt_flops =
        target_forward_flops(s.target, plan.target_layers, packed.T, causal_visible_keys(s, o));
    r.phases = {
        {"target forward", m[kTgt], tgt_flops, 0},
        {"drafter forward", m[kFwd],
         fv.fwd_gemm + fv.attn_fwd + dflash2_conv_flops(s.drafter, packed.NK, false), 0},
        {head_phase(s.drafter, packed.NK, fv.head).first, m[kHd],
         head_phase(s.drafter, packed.NK, fv.head).second, 0},
        {"drafter backward", m[kBwd],
         fv.bwd_gemm + fv.attn_bwd + dflash2_conv_flops(s.drafter, packed.NK, true), 0},
        {"optimizer (AdamW, bf16)", m[kOpt], 0, 30.0 * static_cast<double>(layout.total)},
    };
    r.step_ms_off = m[kWall];
    r.device_ms_off = m[kNumCol];
    r.host_ms_off = m[kNumCol + 1];
    r.host_pack_ms = m[kPack];
    r.host_stage_ms = m[kStage];
  }
  if (o.graphs_on) {
    const std::vector<double> m = measure(true);
    r.step_ms_on = m[kWall];
    r.device_ms_on = m[kNumCol];
    r.host_ms_on = m[kNumCol + 1];
  }
  r.used_bytes = static_cast<double>(used_device_memory());
  collect_gemm_plans(ctx, o, r);

  // ---- kernels alone, on random inputs of the step's shapes (outside the arena).
  drafter.set_phase_events({});
  const DrafterConfig& d = s.drafter;
  const int64_t Tq = packed.NK, Tk = packed.T + packed.NK;
  const int64_t QD = d.num_heads * d.head_dim, KD = d.num_kv_heads * d.head_dim;
  DeviceMemory q(Tq * QD * 2), k(Tk * KD * 2), v(Tk * KD * 2), out(Tq * QD * 2),
      lse(d.num_heads * Tq * 4), dq(Tq * QD * 2), dk(Tk * KD * 2), dv(Tk * KD * 2),
      dout(Tq * QD * 2);
  fill_uniform_cuda(ctx, q.as<uint16_t>(), Tq * QD, 0.0f, 1.0f, 11);
  fill_uniform_cuda(ctx, k.as<uint16_t>(), Tk * KD, 0.0f, 1.0f, 12);
  fill_uniform_cuda(ctx, v.as<uint16_t>(), Tk * KD, 0.0f, 1.0f, 13);
  fill_uniform_cuda(ctx, dout.as<uint16_t>(), Tq * QD, 0.0f, 1.0f, 14);
  const AttnParams ap{Tq,          Tk,
                      d.num_heads, d.num_kv_heads,
                      d.head_dim,  1.0 / std::sqrt(static_cast<double>(d.head_dim))};
  const auto* br = static_cast<const AttnRange*>(branges.dev);
  const double attn_flops =
      drafter_step_flops(d, packed.T, packed.NK, drafter_visible_keys(packed, o.block_size))
          .attn_fwd /
      static_cast<double>(d.num_layers);
  const std::string dshape =
      fmt::format("q {}x{}x{}, kv {}x{}", Tq, d.num_heads, d.head_dim, Tk, d.num_kv_heads);
  // The families timed: the default (automatic: kAttnHopperKernels on sm_90, else mma.sync)
  // first, then mma.sync for comparison, on the same inputs. Rows name the family that ran.
  const AttnCudaKernels fam0 = attention_kernels_cuda(ctx, AttnCudaKernels::automatic);
  std::vector<AttnCudaKernels> fams{fam0};
  if (fam0 != AttnCudaKernels::tensor_core) fams.push_back(AttnCudaKernels::tensor_core);
  auto fam_name = [](AttnCudaKernels k) {
    return k == AttnCudaKernels::wgmma ? "wgmma" : "mma.sync";
  };
  // Causal prefill of the target (one layer), on its own q/k/v shapes.
  const ModelConfig& tc = s.target;
  const int64_t TT = packed.T, TQD = tc.num_attention_heads * tc.head_dim;
  const int64_t TKD = tc.num_key_value_heads * tc.head_dim;
  DeviceMemory tq(TT * TQD * 2), tk(TT * TKD * 2), tv(TT * TKD * 2), to(TT * TQD * 2);
  fill_uniform_cuda(ctx, tq.as<uint16_t>(), TT * TQD, 0.0f, 1.0f, 21);
  fill_uniform_cuda(ctx, tk.as<uint16_t>(), TT * TKD, 0.0f, 1.0f, 22);
  fill_uniform_cuda(ctx, tv.as<uint16_t>(), TT * TKD, 0.0f, 1.0f, 23);
  const AttnParams tp{TT,
                      TT,
                      tc.num_attention_heads,
                      tc.num_key_value_heads,
                      tc.head_dim,
                      1.0 / std::sqrt(static_cast<double>(tc.head_dim))};
  const double pf_flops =
      4.0 * static_cast<double>(tc.head_dim * tc.num_attention_heads) * causal_visible_keys(s, o);
  const std::string pshape = fmt::format("{} tokens, docs of {}, {}x{}", TT, o.doc_length,
                                         tc.num_attention_heads, tc.head_dim);
  std::vector<BenchKernel> fwd_rows, bwd_rows, pf_rows;
  for (AttnCudaKernels fam : fams) {
    AttnParams apf = ap, tpf = tp;
    apf.kernels = tpf.kernels = fam;
    BenchKernel af{fmt::format("DFlash attn fwd {}", fam_name(fam)), dshape, NAN, attn_flops,
                   attn_flops / kPeakBf16Flops * 1e3};
    af.ms = time_kernel(ctx, o.kernel_reps, [&] {
      attention_fwd_cuda(ctx, out.as<uint16_t>(), lse.as<float>(), q.as<uint16_t>(),
                         k.as<uint16_t>(), v.as<uint16_t>(), br, apf);
    });
    BenchKernel ab{fmt::format("DFlash attn bwd {}", fam_name(fam)), dshape, NAN, 2.5 * attn_flops,
                   2.5 * attn_flops / kPeakBf16Flops * 1e3};
    ab.ms = time_kernel(ctx, o.kernel_reps, [&] {
      attention_bwd_cuda(ctx, dq.as<uint16_t>(), dk.as<uint16_t>(), dv.as<uint16_t>(),
                         dout.as<uint16_t>(), q.as<uint16_t>(), k.as<uint16_t>(), v.as<uint16_t>(),
                         out.as<uint16_t>(), lse.as<float>(), br, apf);
    });
    BenchKernel pf{fmt::format("causal prefill {}", fam_name(fam)), pshape, NAN, pf_flops,
                   pf_flops / kPeakBf16Flops * 1e3};
    pf.ms = time_kernel(ctx, o.kernel_reps, [&] {
      attention_fwd_cuda(ctx, to.as<uint16_t>(), nullptr, tq.as<uint16_t>(), tk.as<uint16_t>(),
                         tv.as<uint16_t>(), static_cast<const AttnRange*>(tranges.dev), tpf);
    });
    fwd_rows.push_back(af);
    bwd_rows.push_back(ab);
    pf_rows.push_back(pf);
  }
  {
    // The same prefill on cuDNN's fused attention (ops/attention_cudnn.hpp), its graph sized for
    // the step's documents; the index kernel reading the ranges (once per target forward, not
    // per layer) runs before the timed forwards.
    // A graph cuDNN cannot build leaves the row out and says why on stderr (the other rows stand).
    const auto [docs, longest] = bench_documents(packed);
    try {
      CudnnCausalPrefill cp(ctx, CudnnPrefillShape{docs, longest, tc.num_attention_heads,
                                                   tc.num_key_value_heads, tc.head_dim, tp.scale});
      cp.set_documents(static_cast<const AttnRange*>(tranges.dev), TT);
      BenchKernel pf{"causal prefill cudnn", pshape, NAN, pf_flops,
                     pf_flops / kPeakBf16Flops * 1e3};
      pf.ms = time_kernel(ctx, o.kernel_reps, [&] {
        cp.forward(to.as<uint16_t>(), tq.as<uint16_t>(), tk.as<uint16_t>(), tv.as<uint16_t>());
      });
      pf_rows.push_back(pf);
    } catch (const Error& e) {
      fmt::print(stderr, "bench: the causal prefill cudnn row was not timed: {}\n", e.what());
    }
  }
  r.kernels = fwd_rows;
  r.kernels.insert(r.kernels.end(), bwd_rows.begin(), bwd_rows.end());
  r.kernels.insert(r.kernels.end(), pf_rows.begin(), pf_rows.end());
  if (tc.intermediate_size > 0 && tc.num_experts == 0)  // a dense target's layer, op by op
    for (BenchKernel& k : target_layer_rows(ctx, o, tc, TT, static_cast<const int32_t*>(pos.dev)))
      r.kernels.push_back(std::move(k));
  const int64_t H = d.hidden_size, V = d.vocab_size;
  if (d.dspark.enabled) {
    // The DSpark head with its gradients over the step's block rows (dspark_head_cuda: logits,
    // teacher logits, the Markov bias, the row kernel and the backward GEMMs), random weights,
    // the step's labels, weights, row index and teacher rows.
    DeviceMemory hid(Tq * H * 2), dhid(Tq * H * 4), amax(Tq * 4), sums(6 * 8);
    DeviceMemory pw(layout.total * 4), pb(layout.total * 2), pg(layout.total * 4);
    fill_uniform_cuda(ctx, hid.as<uint16_t>(), Tq * H, 0.0f, 1.0f, 31);
    fill_uniform_cuda(ctx, pw.as<float>(), layout.total, 0.0f, 0.02f, 32);
    fill_uniform_cuda(ctx, pb.as<uint16_t>(), layout.total, 0.0f, 0.02f, 33);
    DsparkCudaArgs da;
    da.R = Tq;
    da.params = pw.as<float>();
    da.weights_bf16 = pb.as<uint16_t>();
    da.grads = pg.as<float>();
    da.lm_head = target.lm_head();
    da.hf = hid.as<uint16_t>();
    da.target_final = drafter.features() + packed.T * d.n_taps() * H;
    da.labels = static_cast<const int32_t*>(labels.dev);
    da.weights = static_cast<const float*>(weights.dev);
    da.prev = static_cast<const int32_t*>(dsp[0]->dev);
    da.teacher_pos = static_cast<const int32_t*>(dsp[1]->dev);
    da.w1_order = static_cast<const int32_t*>(dsp[2]->dev);
    da.w1_seg = static_cast<const int32_t*>(dsp[3]->dev);
    da.dhf = dhid.as<float>();
    da.argmax = amax.as<int32_t>();
    da.sums = sums.as<double>();
    da.workspace_bytes = dspark_head_cuda_workspace_bytes(d, Tq, kDrafterCeChunkRows);
    da.workspace = arena.get_bytes("drafter.dspark.workspace", da.workspace_bytes);
    da.rows_bytes = dspark_head_cuda_rows_bytes(d, Tq);
    da.rows = arena.get_bytes("drafter.dspark.rows", da.rows_bytes);  // idle outside the head
    da.grad_scale = 1.0;
    da.chunk_rows = kDrafterCeChunkRows;
    const double head_flops = dspark_head_flops(d, Tq);
    BenchKernel dk_head{"DSpark head + grads",
                        fmt::format("{} rows, H {}, V {}, r {}", Tq, H, V, d.dspark.markov_rank),
                        NAN, head_flops, head_flops / kPeakBf16Flops * 1e3};
    dk_head.ms =
        time_kernel(ctx, o.kernel_reps, [&] { dspark_head_cuda(ctx, d, layout, o.objective, da); });
    r.kernels.push_back(dk_head);
  } else if (d.domino.enabled) {
    // The Domino head with its gradients over the step's block rows (domino_head_cuda), random
    // weights and hidden states, the step's labels, weights and row index.
    DeviceMemory hid(Tq * H * 2), dhid(Tq * H * 4), amax(Tq * 4), sums(4 * 8);
    DeviceMemory pb(layout.total * 2), pg(layout.total * 4);
    fill_uniform_cuda(ctx, hid.as<uint16_t>(), Tq * H, 0.0f, 1.0f, 31);
    fill_uniform_cuda(ctx, pb.as<uint16_t>(), layout.total, 0.0f, 0.02f, 33);
    DominoCudaArgs da;
    da.R = Tq;
    da.weights_bf16 = pb.as<uint16_t>();
    da.grads = pg.as<float>();
    da.embed = target.embed();
    da.lm_head = target.lm_head();
    da.hf = hid.as<uint16_t>();
    da.labels = static_cast<const int32_t*>(labels.dev);
    da.weights = static_cast<const float*>(weights.dev);
    da.gru_tok = static_cast<const int32_t*>(dm_tok->dev);
    da.lambda = static_cast<const double*>(dm_lambda->dev);
    da.dhf = dhid.as<float>();
    da.argmax = amax.as<int32_t>();
    da.sums = sums.as<double>();
    da.workspace_bytes = domino_head_cuda_workspace_bytes(d, Tq, kDrafterCeChunkRows);
    da.workspace = arena.get_bytes("drafter.domino.workspace", da.workspace_bytes);
    da.rows_bytes = domino_head_cuda_rows_bytes(Tq);
    da.rows = arena.get_bytes("drafter.domino.rows", da.rows_bytes);  // idle outside the head
    da.grad_scale = 1.0;
    da.chunk_rows = kDrafterCeChunkRows;
    const double head_flops = domino_head_flops(d, Tq);
    BenchKernel dk_head{"Domino head + grads",
                        fmt::format("{} rows, H {}, V {}, E {}, G {}", Tq, H, V, d.domino.emb_dim,
                                    d.domino.gru_hidden_dim),
                        NAN, head_flops, head_flops / kPeakBf16Flops * 1e3};
    dk_head.ms =
        time_kernel(ctx, o.kernel_reps, [&] { domino_head_cuda(ctx, d, layout, o.objective, da); });
    r.kernels.push_back(dk_head);
  } else {
    // The fused LM-head CE with its input gradient, over the step's block rows.
    DeviceMemory hid(Tq * H * 2), dhid(Tq * H * 4), amax(Tq * 4), sums(16);
    fill_uniform_cuda(ctx, hid.as<uint16_t>(), Tq * H, 0.0f, 1.0f, 31);
    // The drafter's parameters: without an objective head the anchor slots are skipped.
    const FusedCeParams cp = drafter_ce_params(d, Tq, kDrafterCeChunkRows);
    const uint64_t ws_bytes = cross_entropy_fused_cuda_workspace_bytes(cp, true, false);
    void* ws = arena.get_bytes("drafter.ce_workspace", ws_bytes);  // idle outside the head phase
    const int64_t head_rows = fused_ce_head_rows(cp);
    const double ce_flops = 4.0 * static_cast<double>(head_rows * H) * static_cast<double>(V);
    const std::string rows =
        head_rows == Tq ? fmt::format("{} rows", Tq) : fmt::format("{} of {} rows", head_rows, Tq);
    BenchKernel ce{"fused LM-head CE + grad", fmt::format("{}, H {}, V {}", rows, H, V), NAN,
                   ce_flops, ce_flops / kPeakBf16Flops * 1e3};
    ce.ms = time_kernel(ctx, o.kernel_reps, [&] {
      cross_entropy_fused_cuda(ctx, dhid.as<float>(), nullptr, amax.as<int32_t>(), nullptr,
                               sums.as<double>(), hid.as<uint16_t>(), target.lm_head(),
                               static_cast<const int32_t*>(labels.dev),
                               static_cast<const float*>(weights.dev), cp, ws, ws_bytes);
    });
    r.kernels.push_back(ce);
  }
  if (d.dflash2.enabled) {
    // DFlash2's selector with its gradients over the step's block rows (dflash2_head_cuda with
    // ū = U: the fused CE row above times the base CE), random hidden states and selector
    // weights, the step's labels, weights, predecessor tokens and α_sel.
    DeviceMemory hid(Tq * H * 2), dhid(Tq * H * 4), sums(5 * 8);
    DeviceMemory pp(layout.total * 4), pg(layout.total * 4);
    fill_uniform_cuda(ctx, hid.as<uint16_t>(), Tq * H, 0.0f, 1.0f, 31);
    fill_uniform_cuda(ctx, pp.as<float>(), layout.total, 0.0f, 0.02f, 35);
    Dflash2CudaArgs da;
    da.R = Tq;
    da.params = pp.as<float>();
    da.grads = pg.as<float>();
    da.lm_head = target.lm_head();
    da.hf = hid.as<uint16_t>();
    da.labels = static_cast<const int32_t*>(labels.dev);
    da.weights = static_cast<const float*>(weights.dev);
    da.prev = static_cast<const int32_t*>(d2_prev->dev);
    da.alpha = static_cast<const double*>(d2_alpha->dev);
    da.dhf = dhid.as<float>();
    da.base_in_head = false;
    da.sums = sums.as<double>();
    da.workspace_bytes = dflash2_head_cuda_workspace_bytes(d, Tq, kDrafterCeChunkRows);
    da.workspace = arena.get_bytes("drafter.dflash2.workspace", da.workspace_bytes);
    da.rows_bytes = dflash2_head_cuda_rows_bytes(d, Tq);
    da.rows = arena.get_bytes("drafter.dflash2.rows", da.rows_bytes);  // idle outside the head
    da.grad_scale = 1.0;
    da.chunk_rows = kDrafterCeChunkRows;
    // A D-PACE base: the rows' CE in (random, then each repetition's weights: the time does not
    // depend on the values), their weights and the base's sums out, the scaling of the row pieces.
    DeviceMemory dpace_w(static_cast<size_t>(o.objective.dpace() ? Tq * 4 : 4)), dpace_sums(2 * 8);
    if (o.objective.dpace()) {
      fill_uniform_cuda(ctx, dpace_w.as<float>(), Tq, 2.0f, 2.0f, 37);  // CE in [0, 4)
      da.dpace_w = dpace_w.as<float>();
      da.dpace_sums = dpace_sums.as<double>();
    }
    const double sel_flops = dflash2_head_flops(d, Tq);
    BenchKernel dk_sel{"DFlash2 selector + grads",
                       fmt::format("{} rows, H {}, V {}, r {}, top-{}", Tq, H, V,
                                   d.dflash2.selector_rank, d.dflash2.selector_top_k),
                       NAN, sel_flops, sel_flops / kPeakBf16Flops * 1e3};
    dk_sel.ms = time_kernel(ctx, o.kernel_reps,
                            [&] { dflash2_head_cuda(ctx, d, layout, o.objective, da); });
    r.kernels.push_back(dk_sel);
  }
  // AdamW over min(P, 2^28) parameters on zeroed state (the time does not depend on the values):
  // the step's single pass that also writes the bf16 copy, against the path before the fusion
  // (AdamW, then cast_cuda re-reading the fp32 parameters). Floor: the 30 bytes per parameter the
  // fused pass must move (read p, m, v, g; write p, m, v, bf16 p) at kPeakCopyBytesPerS.
  const int64_t n_opt = std::min<int64_t>(layout.total, int64_t{1} << 28);
  const auto n_opt_z = static_cast<size_t>(n_opt);
  DeviceMemory op(n_opt_z * 4), om(n_opt_z * 4), ov(n_opt_z * 4), og(n_opt_z * 4), obf(n_opt_z * 2),
      oseg(2 * sizeof(AdamWSegment));
  for (const DeviceMemory* m : {&op, &om, &ov, &og})
    DFLASH_CUDA_CHECK(cudaMemsetAsync(m->as<float>(), 0, n_opt_z * 4, ctx.stream()));
  const AdamWSegment oseg_host[2] = {
      {op.as<float>(), om.as<float>(), ov.as<float>(), og.as<float>(), n_opt, obf.as<uint16_t>()},
      {op.as<float>(), om.as<float>(), ov.as<float>(), og.as<float>(), n_opt, nullptr}};
  DFLASH_CUDA_CHECK(
      cudaMemcpy(oseg.as<AdamWSegment>(), oseg_host, sizeof oseg_host, cudaMemcpyHostToDevice));
  const double opt_floor_ms = 30.0 * static_cast<double>(n_opt) / kPeakCopyBytesPerS * 1e3;
  BenchKernel opt_fused{"AdamW + bf16 copy", fmt::format("{} params, one pass", n_opt), NAN, NAN,
                        opt_floor_ms};
  opt_fused.ms = time_kernel(ctx, o.kernel_reps, [&] {
    adamw_step_cuda(ctx, oseg.as<AdamWSegment>(), 1, n_opt, adam, 6e-4, 1, nullptr, nullptr);
  });
  BenchKernel opt_split{"AdamW, then cast (old)", fmt::format("{} params, two passes", n_opt), NAN,
                        NAN, opt_floor_ms};
  opt_split.ms = time_kernel(ctx, o.kernel_reps, [&] {
    adamw_step_cuda(ctx, oseg.as<AdamWSegment>() + 1, 1, n_opt, adam, 6e-4, 1, nullptr, nullptr);
    cast_cuda(ctx, obf.as<uint16_t>(), op.as<const float>(), n_opt);
  });
  r.kernels.push_back(opt_fused);
  r.kernels.push_back(opt_split);
  ctx.synchronize();
  return r;
}

#endif  // DFLASH_HAVE_CUDA

}  // namespace dflash
