// `dflash bench`: the training step at real model shapes with random weights (train/bench.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <fstream>
#include <optional>

#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "model/objective.hpp"
#include "model/presets.hpp"
#include "model/step_plan.hpp"
#include "train/bench.hpp"
#include "train/run_config.hpp"

namespace dflash::cli {

namespace {

struct BenchArgs {
  BenchOptions o;
  std::string graphs = "both";
  std::string json;
  std::string loss_type = "dflash";
  std::string objective = "dflash";
  std::string markov_head_type = "vanilla";
  double dflash2_alpha = 1.0;  ///< --dflash2-alpha: α_sel of the timed steps
  bool dflash2_given = false;  ///< any --dflash2-* option on the command line (even a default)
  bool plan = false;
  int mask = -1;
};

void run_bench_command(BenchArgs& a) {
  DFLASH_CHECK(a.graphs == "both" || a.graphs == "on" || a.graphs == "off",
               "--graphs must be on, off or both (got '{}')", a.graphs);
  a.o.graphs_on = a.graphs != "off";
  a.o.graphs_off = a.graphs != "on";
  DFLASH_CHECK(a.o.gemm_plans == "table" || a.o.gemm_plans == "heuristic",
               "--gemm-plans must be table or heuristic (got '{}')", a.o.gemm_plans);
  if (a.mask >= 0) a.o.mask_token_id = a.mask;
  DFLASH_CHECK(a.o.recompute == "auto" || a.o.recompute == "always" || a.o.recompute == "never",
               "--recompute must be auto, always or never (got '{}')", a.o.recompute);
  const std::optional<LossType> loss = loss_type_parse(a.loss_type);
  DFLASH_CHECK(loss.has_value(),
               "--loss-type must be dflash, dpace, dpace-cumulative-confidence-only or "
               "dpace-continuation-value-only (got '{}')",
               a.loss_type);
  a.o.objective.loss = *loss;
  DFLASH_CHECK(a.objective == "dflash" || a.objective == "dspark" || a.objective == "domino" ||
                   a.objective == "dflash2",
               "--objective must be dflash, dspark, domino or dflash2 (got '{}')", a.objective);
  if (a.objective == "dspark") {  // training.objective dspark with its default alphas
    DFLASH_CHECK(a.loss_type == "dflash", "--objective dspark has its own loss: drop --loss-type");
    TrainingSection t;
    t.objective = "dspark";
    a.o.objective = objective_of(t);
  }
  const std::optional<MarkovHeadType> markov = markov_head_type_parse(a.markov_head_type);
  DFLASH_CHECK(markov.has_value(), "--markov-head-type must be vanilla, gated or rnn (got '{}')",
               a.markov_head_type);
  DFLASH_CHECK(a.objective == "dspark" || *markov == MarkovHeadType::vanilla,
               "--markov-head-type {} needs --objective dspark", a.markov_head_type);
  a.o.markov_type = *markov;
  if (a.objective == "domino") {  // training.objective domino with the bench's head sizes
    DFLASH_CHECK(a.loss_type == "dflash", "--objective domino has its own loss: drop --loss-type");
    TrainingSection t;
    t.objective = "domino";
    t.shift_label = a.o.domino_shift_label;
    a.o.objective = objective_of(t);
    a.o.objective.domino_lambda = 0.5;  // mid-run; the step's cost does not depend on λ
  }
  DFLASH_CHECK(a.objective == "dflash2" || !a.dflash2_given,
               "--dflash2-* options apply only to --objective dflash2 (got --objective {})",
               a.objective);
  if (a.objective == "dflash2") {  // training.objective dflash2 with the bench's sizes and α_sel
    DFLASH_CHECK(std::isfinite(a.dflash2_alpha) && a.dflash2_alpha >= 0,
                 "--dflash2-alpha must be a finite number >= 0 (got {})", a.dflash2_alpha);
    TrainingSection t;  // the base loss is --loss-type's (dflash or a D-PACE loss)
    t.objective = "dflash2";
    t.loss_type = a.loss_type;
    t.dpace_alpha = a.o.objective.dpace_alpha;
    a.o.objective = objective_of(t);
    a.o.objective.dflash2_selector_alpha = a.dflash2_alpha;
  }
  DFLASH_CHECK(a.o.objective.dpace_alpha >= 0 && a.o.objective.dpace_alpha <= 1,
               "--dpace-alpha must be in [0, 1] (got {})", a.o.objective.dpace_alpha);
  const BenchSetup s = bench_setup(a.o);
  std::vector<std::string> unsupported = cuda_target_unsupported(s.target);
  if (!a.o.target_only) {
    for (std::string& u : cuda_drafter_unsupported(s.drafter)) unsupported.push_back(std::move(u));
  }
  if (!unsupported.empty()) fail("{}", fmt::join(unsupported, "; "));
  const TrainMemoryPlan plan = bench_plan(s, a.o);
  if (a.plan && a.o.target_only) {
    fmt::print(
        "{}: the target forward alone, taps [{}] (a {}-layer drafter's), {} row(s) x {} "
        "tokens\n{}\n",
        s.model_name, fmt::join(s.drafter.target_layer_ids, ", "), s.drafter.num_layers, a.o.rows,
        a.o.token_budget, plan.table());
    if (!plan.fits()) fail("{}", bench_shortfall_message(s, a.o));
    return;
  }
  if (a.plan) {
    fmt::print("{}: drafter {} layers, {} row(s) x {} tokens, {} blocks\n{}\n", s.model_name,
               s.drafter.num_layers, a.o.rows, a.o.token_budget, s.blocks, plan.table());
    if (!plan.fits()) fail("{}", bench_shortfall_message(s, a.o));
    return;
  }
  const BenchReport r = run_bench(a.o);
  fmt::print("{}\n", bench_table(r));
  if (!a.json.empty()) {
    const std::string text = bench_json(r).dump(1) + "\n";
    if (a.json == "-") {
      fmt::print("{}", text);
    } else {
      write_file_atomic(a.json, text);
    }
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  std::string presets;
  for (const ModelPreset& p : model_presets()) presets += (presets.empty() ? "" : ", ") + p.name;
  auto* b = app.add_subcommand(
      "bench",
      "Time the training step phase by phase and its hot kernels at real model shapes "
      "(random weights made on the GPU, no checkpoint); --plan prints its memory plan");
  b->add_option("--preset", a->o.preset, "Target shapes: " + presets)->capture_default_str();
  b->add_option("--config", a->o.config_json, "An HF config.json (file or folder) instead");
  b->add_option("--drafter-layers", a->o.drafter_layers, "Drafter layers")->capture_default_str();
  b->add_option("--token-budget", a->o.token_budget, "Tokens per row")->capture_default_str();
  b->add_option("--rows", a->o.rows, "Rows per step")->capture_default_str();
  b->add_option("--doc-length", a->o.doc_length, "Tokens per document")->capture_default_str();
  b->add_option("--anchors", a->o.anchors, "Anchors per document")->capture_default_str();
  b->add_option("--block-size", a->o.block_size, "Block size")->capture_default_str();
  b->add_option("--mask-token-id", a->mask, "Mask token id (default: the preset's)");
  b->add_option("--steps", a->o.steps, "Timed steps per graph mode (medians)")
      ->capture_default_str();
  b->add_option("--warmup", a->o.warmup, "Untimed steps first")->capture_default_str();
  b->add_option("--loss-type", a->loss_type,
                "The loss, as training.loss_type: dflash, dpace, "
                "dpace-cumulative-confidence-only or dpace-continuation-value-only")
      ->capture_default_str();
  b->add_option("--objective", a->objective,
                "The objective, as training.objective: dflash, dspark (its default alphas; "
                "the Markov head of --markov-rank and --markov-head-type, the confidence head) "
                "domino (the head of --domino-*, λ 0.5) or dflash2 (the conv and selector of "
                "--dflash2-*, α_sel --dflash2-alpha)")
      ->capture_default_str();
  b->add_option("--markov-rank", a->o.markov_rank,
                "DSpark's Markov rank r, as training.markov_rank")
      ->capture_default_str();
  b->add_option("--markov-head-type", a->markov_head_type,
                "DSpark's Markov head, as training.markov_head_type: vanilla, gated or rnn")
      ->capture_default_str();
  b->add_option("--domino-emb-dim", a->o.domino_emb_dim,
                "Domino's E (embed_proj width), as training.emb_dim")
      ->capture_default_str();
  b->add_option("--domino-gru-dim", a->o.domino_gru_dim,
                "Domino's G (the GRU's state width), as training.gru_hidden_dim")
      ->capture_default_str();
  b->add_option("--domino-prefix-len", a->o.domino_prefix_len,
                "Domino's P, as training.pure_draft_prefix_len")
      ->capture_default_str();
  b->add_option("--domino-shift-label", a->o.domino_shift_label,
                "Domino's shift_label, as training.shift_label (true or false)")
      ->capture_default_str();
  b->add_option("--dflash2-conv-kernel-size", a->o.dflash2_conv_kernel_size,
                "DFlash2's conv taps T, as training.conv_kernel_size")
      ->capture_default_str();
  b->add_option("--dflash2-conv-group-size", a->o.dflash2_conv_group_size,
                "DFlash2's channels per conv group, as training.conv_group_size")
      ->capture_default_str();
  b->add_option("--dflash2-selector-rank", a->o.dflash2_selector_rank,
                "DFlash2's selector rank r, as training.selector_rank")
      ->capture_default_str();
  b->add_option("--dflash2-selector-top-k", a->o.dflash2_selector_top_k,
                "DFlash2's candidates K per slot, as training.selector_top_k")
      ->capture_default_str();
  b->add_option("--dflash2-alpha", a->dflash2_alpha,
                "DFlash2's α_sel (the selector CE's weight; the same kernels run at every α)")
      ->capture_default_str();
  b->add_option("--dpace-alpha", a->o.objective.dpace_alpha, "D-PACE's α, as training.dpace_alpha")
      ->capture_default_str();
  b->add_option("--kernel-reps", a->o.kernel_reps, "Timed runs per kernel")->capture_default_str();
  b->add_option("--graphs", a->graphs, "Time the step with CUDA graphs on, off or both")
      ->capture_default_str();
  b->add_option("--device", a->o.device, "CUDA device")->capture_default_str();
  b->add_option("--gemm-plans", a->o.gemm_plans,
                "cuBLASLt GEMM plans from the measured table (the heuristic's first for shapes "
                "it lacks) or from the heuristic alone (the table ignored)")
      ->capture_default_str();
  b->add_option("--prefill", a->o.prefill,
                "The target's causal prefill, as runtime.target_prefill: cuDNN's fused attention "
                "(the graph of the step's document bucket; the plan holds cuDNN's memory) or the "
                "project's attention kernels")
      ->check(CLI::IsMember({"kernels", "cudnn"}))
      ->capture_default_str();
  b->add_option("--recompute", a->o.recompute,
                "Drafter backward: recompute the forward's activations (always), keep them "
                "(never), or keep them when the plan fits (auto), as training.recompute")
      ->capture_default_str();
  b->add_option("--device-memory-gib", a->o.device_memory_gib, "Device memory for the plan")
      ->capture_default_str();
  b->add_option("--json", a->json, "Also write the figures as JSON to this file (- = stdout)");
  b->add_flag("--target-only", a->o.target_only,
              "Time the target's tap forward alone (the drafter's taps; weights up to the deepest "
              "tap), as tools/hf_target_forward.py times HF's");
  b->add_flag("--plan", a->plan,
              "Print the memory plan of the step and exit (0: fits, 1: does not); no GPU needed");
  b->callback([a, b] {
    for (const char* name :
         {"--dflash2-conv-kernel-size", "--dflash2-conv-group-size", "--dflash2-selector-rank",
          "--dflash2-selector-top-k", "--dflash2-alpha"}) {
      a->dflash2_given = a->dflash2_given || b->count(name) > 0;
    }
    run_bench_command(*a);
  });
}

}  // namespace dflash::cli
