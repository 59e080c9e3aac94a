// dflash.cpp — the training memory plan (see memory_plan.hpp).
#include "train/memory_plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.hpp"
#include "model/step_plan.hpp"
#include "ops/attention.hpp"

namespace dflash {

int64_t padded_block_rows(int64_t blocks, int K) {
  const int64_t m = kBlockRowsMultiple;
  return std::max<int64_t>(m, (blocks + m - 1) / m * m) * K;
}

TrainStepCapacity train_step_capacity(const RunConfig& cfg) {
  TrainStepCapacity cap;
  const int64_t rows = cfg.data.rows_per_step, budget = cfg.data.token_budget;
  cap.ctx_rows = rows * budget;
  cap.blocks = rows * std::min<int64_t>(cfg.block_budget(), std::max<int64_t>(budget - 1, 1));
  return cap;
}

namespace {
// The DsparkRowIndex arrays of a DSpark step (model/dspark_head_cuda.hpp), staged as inputs.
void plan_dspark_inputs(ArenaPlanner& p, const DrafterConfig& drafter, uint64_t NK) {
  if (!drafter.dspark.enabled) return;
  const PhaseMask all = step_all_phases();
  for (const char* name : {kInputDsparkPrev, kInputDsparkTeacherPos, kInputDsparkW1Order}) {
    p.add(name, kGroupInputs, NK * 4, all);
  }
  p.add(kInputDsparkW1Seg, kGroupInputs, (NK + 1) * 4, all);
}
// The DominoRowIndex of a Domino step (model/domino_head_cuda.hpp), staged as inputs.
void plan_domino_inputs(ArenaPlanner& p, const DrafterConfig& drafter, uint64_t NK) {
  if (!drafter.domino.enabled) return;
  p.add(kInputDominoGruTok, kGroupInputs, NK * 4, step_all_phases());
  p.add(kInputDominoLambda, kGroupInputs, sizeof(double), step_all_phases());
}
// The predecessor tokens and α_sel of a DFlash2 step (model/dflash2_head_cuda.hpp), staged as
// inputs.
void plan_dflash2_inputs(ArenaPlanner& p, const DrafterConfig& drafter, uint64_t NK) {
  if (!drafter.dflash2.enabled) return;
  p.add(kInputDflash2Prev, kGroupInputs, NK * 4, step_all_phases());
  p.add(kInputDflash2Alpha, kGroupInputs, sizeof(double), step_all_phases());
}
}  // namespace

TrainMemoryPlan plan_train_memory(const ModelConfig& target, const DrafterConfig& drafter,
                                  const DrafterLayout& layout, const TrainStepCapacity& cap,
                                  double device_memory_gib, int64_t ce_chunk_rows,
                                  DrafterActivations activations) {
  DFLASH_CHECK(cap.ctx_rows > 0 && cap.blocks > 0,
               "memory plan: {} context rows and {} blocks per step", cap.ctx_rows, cap.blocks);
  DFLASH_CHECK(device_memory_gib > 0, "runtime.device_memory_gib must be > 0, got {}",
               device_memory_gib);
  TrainMemoryPlan plan;
  plan.activations = activations;
  plan.T = cap.ctx_rows;
  plan.NK = padded_block_rows(cap.blocks, drafter.block_size);
  plan.target_layers = target_layers_for_drafter(target, drafter);
  plan.device_bytes = static_cast<uint64_t>(std::floor(device_memory_gib * 1073741824.0));

  ArenaPlanner p(step_phase_names());
  plan_target_weights(p, target, plan.target_layers);
  if (drafter.dspark.enabled) {  // the teacher: the final norm after the last layer
    p.add(kTargetFinalNorm, kGroupTargetWeights, static_cast<uint64_t>(target.hidden_size) * 4,
          step_all_phases());
  }
  plan_target_activations(p, target, plan.target_layers, plan.T);
  const DrafterStepSizes sizes{plan.T, plan.NK, ce_chunk_rows, activations};
  plan_drafter_step(p, drafter, layout, sizes);
  plan_op_scratch(p, target, plan.target_layers, drafter, sizes);
  // Inputs of a step, staged from pinned host buffers (train/cuda_train.cpp).
  const auto T = static_cast<uint64_t>(plan.T), NK = static_cast<uint64_t>(plan.NK);
  const PhaseMask all = step_all_phases();
  p.add("inputs.tokens", kGroupInputs, T * 4, all);
  p.add("inputs.target_ranges", kGroupInputs, T * sizeof(AttnRange), all);
  p.add("inputs.pos", kGroupInputs, (T + NK) * 4, all);
  p.add("inputs.block_tokens", kGroupInputs, NK * 4, all);
  p.add("inputs.block_ranges", kGroupInputs, NK * sizeof(AttnRange), all);
  p.add("inputs.labels", kGroupInputs, NK * 4, all);
  p.add("inputs.weights", kGroupInputs, NK * 4, all);
  plan_dspark_inputs(p, drafter, NK);
  plan_domino_inputs(p, drafter, NK);
  plan_dflash2_inputs(p, drafter, NK);
  plan.arena = p.finish();
  return plan;
}

namespace {

// plan_target_forward_memory's buffers into `p` (phase `ph`) for a forward of `layers` layers
// whose features have `cols` columns; sets plan.T and target_layers.
void add_target_forward(ArenaPlanner& p, PhaseMask ph, TrainMemoryPlan& plan,
                        const ModelConfig& target, int64_t layers, int64_t cols,
                        int64_t max_tokens) {
  plan.T = max_tokens;
  plan.target_layers = layers;
  plan_target_weights(p, target, plan.target_layers, ph);
  plan_target_activations(p, target, plan.target_layers, plan.T);
  const auto T = static_cast<uint64_t>(plan.T);
  p.add(kTargetOnlyFeatures, kGroupTapFeatures, T * static_cast<uint64_t>(cols) * 2, ph);
  p.add("workspace.op_scratch", kGroupOpScratch,
        std::max(target_op_scratch_bytes(target, plan.target_layers), kArenaAlign), ph);
  p.add("inputs.tokens", kGroupInputs, T * 4, ph);
  p.add("inputs.target_ranges", kGroupInputs, T * sizeof(AttnRange), ph);
  p.add("inputs.pos", kGroupInputs, T * 4, ph);
}

uint64_t budget_bytes(double device_memory_gib) {
  DFLASH_CHECK(device_memory_gib > 0, "device memory must be > 0 GiB, got {}", device_memory_gib);
  return static_cast<uint64_t>(std::floor(device_memory_gib * 1073741824.0));
}

}  // namespace

TrainMemoryPlan plan_target_forward_memory(const ModelConfig& target, const std::vector<int>& taps,
                                           int64_t max_tokens, double device_memory_gib) {
  DFLASH_CHECK(max_tokens > 0, "memory plan: {} tokens per target forward", max_tokens);
  TrainMemoryPlan plan;
  plan.device_bytes = budget_bytes(device_memory_gib);
  ArenaPlanner p({step_phase_names()[kPhaseTarget]});
  add_target_forward(p, step_phases({kPhaseTarget}), plan, target,
                     target_layers_needed(target, taps),
                     static_cast<int64_t>(taps.size()) * target.hidden_size, max_tokens);
  plan.arena = p.finish();
  return plan;
}

int64_t target_feature_buffers(const PipelineTopology& topo) {
  return static_cast<int64_t>(topo.drafters()) * (topo.queue_depth + 1) + 1;
}

TrainMemoryPlan plan_target_worker_memory(const ModelConfig& target, const DrafterConfig& drafter,
                                          int64_t T, int64_t feature_buffers,
                                          double device_memory_gib) {
  DFLASH_CHECK(T > 0, "memory plan: {} tokens per target forward", T);
  DFLASH_CHECK(feature_buffers >= 1, "memory plan: {} feature buffers for a target worker",
               feature_buffers);
  TrainMemoryPlan plan;
  plan.device_bytes = budget_bytes(device_memory_gib);
  ArenaPlanner p({step_phase_names()[kPhaseTarget]});
  const PhaseMask ph = step_phases({kPhaseTarget});
  add_target_forward(p, ph, plan, target, target_layers_for_drafter(target, drafter),
                     drafter_feature_cols(drafter), T);
  if (drafter.dspark.enabled) {  // the teacher: the final norm after the last layer
    p.add(kTargetFinalNorm, kGroupTargetWeights, static_cast<uint64_t>(target.hidden_size) * 4, ph);
  }
  const uint64_t bytes =
      static_cast<uint64_t>(T) * static_cast<uint64_t>(drafter_feature_cols(drafter)) * 2;
  for (int64_t i = 0; i < feature_buffers; ++i) {
    p.add(fmt::format("taps.pool.{}", i), kGroupTapFeatures, bytes, ph);
  }
  plan.arena = p.finish();
  return plan;
}

TrainMemoryPlan plan_drafter_worker_memory(const ModelConfig& target, const DrafterConfig& drafter,
                                           const DrafterLayout& layout,
                                           const TrainStepCapacity& cap, double device_memory_gib,
                                           int64_t ce_chunk_rows, DrafterActivations activations) {
  DFLASH_CHECK(cap.ctx_rows > 0 && cap.blocks > 0,
               "memory plan: {} context rows and {} blocks per step", cap.ctx_rows, cap.blocks);
  TrainMemoryPlan plan;
  plan.activations = activations;
  plan.device_bytes = budget_bytes(device_memory_gib);
  plan.T = cap.ctx_rows;
  plan.NK = padded_block_rows(cap.blocks, drafter.block_size);
  plan.target_layers = 0;
  ArenaPlanner p(step_phase_names());
  const PhaseMask all = step_all_phases();
  const uint64_t table =
      static_cast<uint64_t>(target.vocab_size) * static_cast<uint64_t>(target.hidden_size) * 2;
  p.add(kDrafterWorkerEmbed, kGroupTargetWeights, table, all);
  if (!target.tie_word_embeddings) p.add(kDrafterWorkerLmHead, kGroupTargetWeights, table, all);
  const DrafterStepSizes sizes{plan.T, plan.NK, ce_chunk_rows, activations};
  plan_drafter_step(p, drafter, layout, sizes);
  plan_op_scratch(p, target, 0, drafter, sizes);
  const auto T = static_cast<uint64_t>(plan.T), NK = static_cast<uint64_t>(plan.NK);
  p.add("inputs.pos", kGroupInputs, (T + NK) * 4, all);
  p.add("inputs.block_tokens", kGroupInputs, NK * 4, all);
  p.add("inputs.block_ranges", kGroupInputs, NK * sizeof(AttnRange), all);
  p.add("inputs.labels", kGroupInputs, NK * 4, all);
  p.add("inputs.weights", kGroupInputs, NK * 4, all);
  plan_dspark_inputs(p, drafter, NK);
  plan_domino_inputs(p, drafter, NK);
  plan_dflash2_inputs(p, drafter, NK);
  plan.arena = p.finish();
  return plan;
}

std::vector<int> PipelineMemoryPlan::devices() const {
  std::set<int> d;
  for (const WorkerMemoryPlan& w : workers) d.insert(w.device);
  return {d.begin(), d.end()};
}

std::string cuda_unsupported_message(const ModelConfig& target, const DrafterConfig& drafter) {
  std::vector<std::string> all = cuda_target_unsupported(target);
  for (std::string& u : cuda_drafter_unsupported(drafter)) all.push_back(std::move(u));
  return fmt::format("{}", fmt::join(all, "; "));
}

uint64_t PipelineMemoryPlan::device_total(int device) const {
  uint64_t total = context_bytes;
  if (std::find(nccl_devices.begin(), nccl_devices.end(), device) != nccl_devices.end()) {
    total += nccl_bytes;
  }
  for (const WorkerMemoryPlan& w : workers) {
    if (w.device == device) {
      total += w.plan.arena.arena_bytes + w.plan.cublaslt_bytes + w.plan.cudnn_bytes;
    }
  }
  return total;
}

bool PipelineMemoryPlan::fits() const {
  for (int d : devices()) {
    if (device_total(d) > device_bytes) return false;
  }
  return true;
}

namespace {

// "drafter backward: keeps the forward's activations (<reason>)", or "recomputes ...".
std::string activations_line(DrafterActivations a, const std::string& reason) {
  return fmt::format("drafter backward: {} the forward's activations{}",
                     a == DrafterActivations::keep ? "keeps" : "recomputes",
                     reason.empty() ? std::string() : " (" + reason + ")");
}

// "target0, drafter0" on `device`.
std::string workers_on(const PipelineMemoryPlan& plan, int device) {
  std::string s;
  for (const WorkerMemoryPlan& w : plan.workers) {
    if (w.device == device) s += (s.empty() ? "" : ", ") + w.worker;
  }
  return s;
}

}  // namespace

std::string PipelineMemoryPlan::table() const {
  std::string s;
  for (const WorkerMemoryPlan& w : workers) {
    s += fmt::format("{} on GPU {}: {}\n", w.worker, w.device, w.plan.table(false));
  }
  s += activations_line(activations, activations_reason) + "\n";
  for (int d : devices()) {
    const uint64_t total = device_total(d);
    const bool nccl = std::find(nccl_devices.begin(), nccl_devices.end(), d) != nccl_devices.end();
    s += fmt::format(
        "GPU {}: {} (arenas, cuBLASLt workspaces, cuDNN prefills) + CUDA context {}{} = {} of {} "
        "(runtime.device_memory_gib): {}\n",
        d, workers_on(*this, d), format_bytes(context_bytes),
        nccl ? " + NCCL " + format_bytes(nccl_bytes) + " (estimate)" : "", format_bytes(total),
        format_bytes(device_bytes), total <= device_bytes ? "fits" : "DOES NOT FIT");
  }
  s.pop_back();
  return s;
}

PipelineMemoryPlan plan_pipeline_memory(const PipelineTopology& topo, const ModelConfig& target,
                                        const DrafterConfig& drafter, const DrafterLayout& layout,
                                        const TrainStepCapacity& cap, double device_memory_gib,
                                        DrafterActivations activations) {
  PipelineMemoryPlan out;
  out.device_bytes = budget_bytes(device_memory_gib);
  out.activations = activations;
  const int64_t buffers = target_feature_buffers(topo);
  for (int t = 0; t < topo.targets(); ++t) {
    out.workers.push_back(
        {PipelineTopology::worker_name(WorkerStage::target, t),
         topo.target_devices[static_cast<size_t>(t)],
         plan_target_worker_memory(target, drafter, cap.ctx_rows, buffers, device_memory_gib)});
  }
  for (int r = 0; r < topo.drafters(); ++r) {
    out.workers.push_back(
        {PipelineTopology::worker_name(WorkerStage::drafter, r),
         topo.drafter_devices[static_cast<size_t>(r)],
         plan_drafter_worker_memory(target, drafter, layout, cap, device_memory_gib,
                                    kDrafterCeChunkRows, activations)});
  }
  if (topo.uses_nccl()) out.nccl_devices = topo.drafter_devices;
  return out;
}

PipelineMemoryPlan plan_pipeline_memory(const RunConfig& cfg, const ModelConfig& target,
                                        const DrafterConfig& drafter, const DrafterLayout& layout) {
  return plan_with_recompute_policy<PipelineMemoryPlan>(
      cfg.training.recompute,
      [&](DrafterActivations a) {
        PipelineMemoryPlan p =
            plan_pipeline_memory(topology_of(cfg.runtime), target, drafter, layout,
                                 train_step_capacity(cfg), cfg.runtime.device_memory_gib, a);
        for (WorkerMemoryPlan& w : p.workers) {
          plan_target_prefill(w.plan, target_prefill_of(cfg.runtime.target_prefill));
        }
        return p;
      },
      [](const PipelineMemoryPlan& p) { return p.fits(); });
}

FittingBudget largest_fitting_pipeline_budget(const RunConfig& cfg, const ModelConfig& target,
                                              const DrafterConfig& drafter,
                                              const DrafterLayout& layout) {
  return largest_fitting_budget(cfg.data.token_budget, cfg.block_budget(),
                                [&](int64_t budget, int64_t blocks) {
                                  RunConfig c = cfg;
                                  c.data.token_budget = static_cast<int>(budget);
                                  c.data.block_budget = static_cast<int>(blocks);
                                  return plan_pipeline_memory(c, target, drafter, layout).fits();
                                });
}

std::string pipeline_shortfall_message(const PipelineMemoryPlan& plan, const FittingBudget& fit) {
  std::string s;
  for (int d : plan.devices()) {
    const uint64_t need = plan.device_total(d), have = plan.device_bytes;
    if (need <= have) continue;
    s += fmt::format(
        "{}the pipeline does not fit GPU {}: its workers {} need {} and "
        "runtime.device_memory_gib allows {} (short by {})",
        s.empty() ? "" : "; ", d, workers_on(plan, d), format_bytes(need), format_bytes(have),
        format_bytes(need - have));
  }
  if (fit.token_budget > 0) {
    s += fmt::format(
        "; the largest token budget that fits is data.token_budget={} with "
        "data.block_budget={}",
        fit.token_budget, fit.block_budget);
  } else {
    s += "; no token budget fits (the weights and optimizer state alone are too large)";
  }
  return s;
}

TrainMemoryPlan plan_train_memory(const RunConfig& cfg, const ModelConfig& target,
                                  const DrafterConfig& drafter, const DrafterLayout& layout) {
  return plan_with_recompute_policy<TrainMemoryPlan>(
      cfg.training.recompute,
      [&](DrafterActivations a) {
        TrainMemoryPlan p =
            plan_train_memory(target, drafter, layout, train_step_capacity(cfg),
                              cfg.runtime.device_memory_gib, kDrafterCeChunkRows, a);
        plan_target_prefill(p, target_prefill_of(cfg.runtime.target_prefill));
        return p;
      },
      [](const TrainMemoryPlan& p) { return p.fits(); });
}

void plan_target_prefill(TrainMemoryPlan& plan, TargetPrefill prefill) {
  const bool holds_target = plan.T > 0 && plan.target_layers > 0;
  plan.cudnn_bytes = holds_target && prefill == TargetPrefill::cudnn ? kCudnnPrefillBytes : 0;
}

void check_recompute_policy(const std::string& policy) {
  DFLASH_CHECK(policy == "auto" || policy == "always" || policy == "never",
               "training.recompute must be auto, always or never, got '{}'", policy);
}

FittingBudget largest_fitting_budget(int64_t token_budget, int64_t block_budget,
                                     const std::function<bool(int64_t, int64_t)>& fits) {
  auto blocks_at = [&](int64_t b) {
    return std::max<int64_t>(1, (block_budget * b + token_budget - 1) / token_budget);
  };
  // The plan grows with the budget: bisect over multiples of 8. Invariant: lo·8 fits (lo = 0:
  // none known), hi·8 does not.
  int64_t lo = 0, hi = token_budget / 8;
  if (hi > 0 && fits(hi * 8, blocks_at(hi * 8))) return {hi * 8, blocks_at(hi * 8)};
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid * 8, blocks_at(mid * 8)))
      lo = mid;
    else
      hi = mid;
  }
  return lo > 0 ? FittingBudget{lo * 8, blocks_at(lo * 8)} : FittingBudget{};
}

FittingBudget largest_fitting_budget(const RunConfig& cfg, const ModelConfig& target,
                                     const DrafterConfig& drafter, const DrafterLayout& layout) {
  return largest_fitting_budget(cfg.data.token_budget, cfg.block_budget(),
                                [&](int64_t budget, int64_t blocks) {
                                  RunConfig c = cfg;
                                  c.data.token_budget = static_cast<int>(budget);
                                  c.data.block_budget = static_cast<int>(blocks);
                                  return plan_train_memory(c, target, drafter, layout).fits();
                                });
}

std::string plan_shortfall_message(const TrainMemoryPlan& plan, const FittingBudget& fit,
                                   const std::string& token_key, const std::string& block_key) {
  const uint64_t need = plan.total_bytes(), have = plan.device_bytes;
  std::string s = fmt::format(
      "the training step does not fit the device: it needs {} and runtime.device_memory_gib "
      "allows {} (short by {})",
      format_bytes(need), format_bytes(have), format_bytes(need - std::min(need, have)));
  if (fit.token_budget > 0) {
    s += fmt::format("; the largest token budget that fits is {}={} with {}={}", token_key,
                     fit.token_budget, block_key, fit.block_budget);
  } else {
    s += "; no token budget fits (the weights and optimizer state alone are too large)";
  }
  return s;
}

std::string TrainMemoryPlan::table(bool device_totals) const {
  std::string s =
      fmt::format("memory plan: {} context rows, {}, {} target layers uploaded\n", T,
                  NK > 0 ? fmt::format("{} block rows", NK) : std::string("target forward only"),
                  target_layers);
  if (NK > 0) s += "  " + activations_line(activations, activations_reason) + "\n";
  for (const std::string& g : arena.groups()) {
    s += fmt::format("  {:<58} {:>12}\n", g, format_bytes(arena.group_bytes(g)));
  }
  const auto& names = arena.phase_names;
  const int peak = arena.peak_phase();
  s += fmt::format(
      "  {:<58} {:>12}  (live peak {} in phase '{}'; buffers of disjoint phases "
      "share)\n",
      "arena (one allocation)", format_bytes(arena.arena_bytes),
      format_bytes(arena.live_peak_bytes), names[static_cast<size_t>(peak)]);
  if (device_totals) {
    s += fmt::format("  {:<58} {:>12}  (measured on an H200; the train log gives this run's)\n",
                     "CUDA context, library handles", format_bytes(context_bytes));
  }
  s += fmt::format("  {:<58} {:>12}\n", "cuBLASLt workspace", format_bytes(cublaslt_bytes));
  if (cudnn_bytes > 0) {
    s += fmt::format("  {:<58} {:>12}  (72 MiB measured on an H200 for one graph, + margin)\n",
                     "cuDNN causal prefill (runtime.target_prefill cudnn)",
                     format_bytes(cudnn_bytes));
  }
  if (device_totals) {
    s += fmt::format("  {:<58} {:>12}  of {} (runtime.device_memory_gib): {}\n", "total",
                     format_bytes(total_bytes()), format_bytes(device_bytes),
                     fits() ? "fits" : "DOES NOT FIT");
  }
  s += "  live by phase:";
  for (size_t i = 0; i < names.size(); ++i) {
    s += fmt::format(" {} {}{}", names[i], format_bytes(arena.live_per_phase[i]),
                     i + 1 < names.size() ? "," : "\n");
  }
  s.pop_back();  // no trailing newline
  return s;
}

}  // namespace dflash
