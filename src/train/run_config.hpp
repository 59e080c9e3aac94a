// dflash.cpp — the run configuration of `dflash train` (YAML), its defaults, overrides and
// validation.
//
// Invariants: a RunConfig is always complete and validated (every key has a value the trainer can
// use, or construction threw naming the key); unknown keys and unknown override paths are errors;
// values that must come from the user (e.g. a mask token id for an unknown model family) have no
// default. `to_yaml` writes the resolved config (config.resolved.yaml) that parses back to the same
// RunConfig.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "model/objective.hpp"

namespace dflash {

/// `model` section.
struct ModelSection {
  std::string target;                     ///< HF target folder (config.json, safetensors, tokenizer)
  int drafter_layers = 1;                 ///< drafter decoder layers
  std::optional<int> intermediate_size;   ///< default: the target's
  std::optional<int> num_attention_heads; ///< default: the target's
  std::optional<int> num_key_value_heads; ///< default: the target's
  std::optional<int> head_dim;            ///< default: the target's
  std::optional<int> mask_token_id;       ///< default: the target family's reserved id, if known
  std::vector<int> target_layer_ids;      ///< empty: the DESIGN.md §1 default rule
};

/// `data` section.
struct DataSection {
  std::string train_file;            ///< .jsonl, .jsonl.xz or .jsonl.zst
  std::string template_name;         ///< "" = detect from the target folder
  int max_length = 2048;             ///< tokens per conversation (longer ones are truncated)
  int token_budget = 8192;           ///< tokens per packed row
  int rows_per_step = 1;             ///< packed rows per drafter replica and optimizer step
  /// Training blocks per packed row: the batcher packs a row only while Σ over its documents of
  /// min(num_anchors, candidate anchors) stays ≤ this, so device memory can be planned for
  /// rows_per_step·block_budget blocks and no anchor is ever dropped. Unset in a config file:
  /// ceil(num_anchors·token_budget / max_length), the blocks of a row of full-length documents
  /// (the reference trainer's batch × anchors); resolved by from_yaml. A value ≥ token_budget
  /// never binds.
  std::optional<int> block_budget;
  /// Pack each window's conversations longest first (least padding, but each step then holds
  /// conversations of similar length); false: first-fit in shuffled order (random mixes).
  bool sort_by_length = false;
  std::string cache_dir;             ///< "" = <output_dir>/cache
  bool skip_invalid = false;         ///< skip (and count) invalid records instead of stopping
};

/// `training` section.
struct TrainingSection {
  int epochs = 1;                    ///< used when max_steps is 0
  int64_t max_steps = 0;             ///< 0 = run `epochs` epochs
  double lr = 6e-4;
  double warmup_ratio = 0.04;
  double min_lr_ratio = 0.0;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  double clip_grad_norm = 1.0;       ///< 0 = no clipping
  int num_anchors = 512;             ///< per document
  int block_size = 16;
  double gamma = 7.0;  ///< ≤ 0: all slot weights 1 (dflash only)
  /// dflash | dpace | dpace-cumulative-confidence-only | dpace-continuation-value-only
  /// (OBJECTIVES.md §1.1; LossType), on either backend.
  std::string loss_type = "dflash";
  double dpace_alpha = 0.5;  ///< D-PACE smoothing α of s_k = (1−α)q_k + α, in [0, 1]
  /// dflash | dspark | domino (ObjectiveKind). loss_type selects among the dflash objective's
  /// losses; dspark and domino take loss_type dflash only and the keys below (OBJECTIVES.md §1.3, SpecForge's
  /// names and defaults), which a dflash run refuses.
  std::string objective = "dflash";
  int markov_rank = 0;                         ///< r of the Markov head; 0: none
  std::string markov_head_type = "vanilla";    ///< vanilla | gated | rnn (MarkovHeadType)
  /// The confidence head; unset: on when dspark_confidence_head_alpha > 0.
  std::optional<bool> enable_confidence_head;
  bool confidence_head_with_markov = false;    ///< its input is [h; W1[prev]] instead of h
  double dspark_ce_loss_alpha = 0.1;           ///< αce
  double dspark_l1_loss_alpha = 0.9;           ///< αl1
  double dspark_confidence_head_alpha = 1.0;   ///< αconf
  /// objective dflash2 (OBJECTIVES.md §1.4; the export's dflash_config keys of the same names,
  /// which a run of another objective refuses). The four sizes have no default: a dflash2 run
  /// must set them (the public recipes use 2, 16, 256 and 16).
  int conv_kernel_size = 0;              ///< T taps, in [1, block_size]
  int conv_group_size = 0;               ///< channels per group; divides the hidden size
  int selector_rank = 0;                 ///< r >= 1
  int selector_top_k = 0;                ///< K candidates per slot, in [1, vocab]
  double output_multiplier = 1.0;        ///< m > 0 of the unary logits softcap(m·U)
  double final_logit_softcapping = 0.0;  ///< c >= 0 (0: no softcap)
  /// α of the selector's CE and its schedule (SpecForge's names and defaults): 0 for the first
  /// warmup_ratio of the steps, then a linear ramp over ramp_ratio of them
  /// (dflash2_selector_alpha).
  double dflash2_selector_loss_alpha = 1.0;
  double dflash2_selector_warmup_ratio = 0.0;   ///< in [0, 1]
  double dflash2_selector_ramp_ratio = 0.0;     ///< in [0, 1]
  bool dflash2_selector_stop_gradient = false;  ///< the selector's CE does not reach the drafter
  // Domino (objective domino; OBJECTIVES.md §1.2, SpecForge's dflash_config and training keys),
  // refused by the other objectives:
  std::optional<int64_t> emb_dim;         ///< E of embed_proj; required by domino
  std::optional<int64_t> gru_hidden_dim;  ///< G of the GRU; required by domino
  int pure_draft_prefix_len = 0;          ///< P: the first P proposals are base-only
  bool shift_label = false;               ///< slot k predicts x[a+k+1]
  double lambda_base_start = 1.0;         ///< λ0 of the base-loss weight λ(t)
  double lambda_base_decay_ratio = 0.5;   ///< λ decays to 0 over ⌊max_steps·ratio⌋ steps
  uint64_t seed = 0;
  int64_t save_interval = 0;         ///< 0 = only at the end
  int keep_last = 3;                 ///< complete checkpoints kept
  int64_t log_interval = 10;
  int64_t eval_interval = 0;         ///< 0 = no periodic eval
  int max_consecutive_skips = 10;    ///< non-finite steps in a row before the run stops
  std::string export_dtype = "bf16"; ///< drafter weights in checkpoints: bf16 or f32
  /// cuda backend: what the drafter's backward does with the activations the forward computes
  /// beyond what it must save (model/step_plan.hpp): "always" recomputes them, "never" keeps them
  /// (more memory; the run stops when that plan does not fit), "auto" keeps them when the memory
  /// plan with them fits runtime.device_memory_gib, else recomputes. Same results either way.
  std::string recompute = "auto";
};

/// `runtime` section: the backend and the topology of the pipeline (train/topology.hpp).
struct RuntimeSection {
  std::string backend = "cpu";       ///< "cpu" or "cuda"
  /// cuda backend, one GPU: the device of the single target worker and the single drafter worker
  /// (colocated). Used only when target_devices and drafter_devices are empty.
  std::vector<int> devices = {0};
  /// cuda backend: one entry per target worker, its GPU (e.g. [0,1,2,3,4]); empty: `devices`.
  std::vector<int> target_devices;
  /// cuda backend: one entry per drafter worker (replica), its GPU (e.g. [5,6,7]); a GPU may be
  /// listed twice (two replicas on one GPU). Empty: `devices`.
  std::vector<int> drafter_devices;
  /// cuda backend: allow a GPU to appear in both target_devices and drafter_devices.
  bool colocated = false;
  int target_workers = 1;            ///< cpu backend: target worker threads
  int drafter_workers = 1;           ///< cpu backend: drafter worker threads (replicas)
  int queue_depth = 2;               ///< feature batches queued per drafter worker
  double stall_timeout_s = 300;      ///< a worker making no progress this long stops the run
  int threads = 0;                   ///< CPU threads, 0 = all cores
  /// cuda backend: capture each step shape once as CUDA graphs and replay them (false: enqueue the
  /// step op by op). Results are identical either way; the train log says which path runs.
  bool cuda_graphs = true;
  /// cuda backend: the target's causal prefill in training, "cudnn" (cuDNN's fused attention,
  /// one graph per power-of-two bucket of a step's documents) or "kernels" (the project's
  /// attention kernels). cudnn cannot run sliding-window or attention-sink targets: such a run
  /// stops naming this key, never falls back.
  std::string target_prefill = "cudnn";
  /// Device memory the cuda backend may plan for, in GiB (2^30 bytes); 139 = one H200. Training
  /// refuses to start when its memory plan (train/memory_plan.hpp) needs more.
  double device_memory_gib = 139.0;
};

/// runtime.target_prefill: where the CUDA target's causal prefill runs in training.
enum class TargetPrefill { cudnn, kernels };
/// "cudnn" -> cudnn, "kernels" -> kernels; throws dflash::Error naming runtime.target_prefill for
/// anything else.
TargetPrefill target_prefill_of(const std::string& name);
/// The key's value of `p` ("cudnn" or "kernels").
const char* target_prefill_name(TargetPrefill p);

/// The whole configuration of one training run.
struct RunConfig {
  ModelSection model;
  DataSection data;
  TrainingSection training;
  RuntimeSection runtime;
  std::string output_dir;

  /// Parses YAML text (`source` names the file in messages: "run.yaml:12: unknown key
  /// 'training.lrr'"), applies `overrides` ("section.key=value", YAML-typed values), validates.
  static RunConfig from_yaml(const std::string& yaml_text, const std::string& source,
                             const std::vector<std::string>& overrides = {});
  /// Reads and parses a YAML file (see from_yaml).
  static RunConfig load(const std::string& path, const std::vector<std::string>& overrides = {});
  /// The embedded default: a 1-layer drafter on the bundled tiny target and corpus, with paths
  /// relative to `assets_dir`, sized to finish in minutes on a laptop CPU.
  static RunConfig embedded_default(const std::string& assets_dir);

  /// Checks every value; throws dflash::Error naming the key ("training.lr must be > 0, got -1").
  void validate() const;
  /// YAML text of the resolved configuration (every key, defaults filled in).
  std::string to_yaml() const;
  /// data.block_budget, or its default when unset (see DataSection::block_budget).
  int64_t block_budget() const;

  /// The keys whose values differ from `other` and would change the model or the data order
  /// (everything except intervals, keep_last, runtime and output paths), as "key: old -> new".
  std::vector<std::string> resume_incompatibilities(const RunConfig& other) const;
  /// The keys whose values differ from `other` and change the shapes of the drafter's parameters
  /// (model.drafter_layers, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
  /// and model.target_layer_ids when the number of taps changes), as "key: old -> new".
  std::vector<std::string> shape_changes(const RunConfig& other) const;
};

/// The Objective of a `training` section (objective and loss_type parsed, dpace_alpha, the
/// DSpark alphas); throws dflash::Error naming training.loss_type or training.objective when it is
/// not one of their names, training.loss_type when a D-PACE loss is asked of objective dspark,
/// and the alpha that is negative or not finite.
Objective objective_of(const TrainingSection& training);

/// The DSpark heads of the drafter a `training` section trains (enabled false for dflash);
/// throws dflash::Error naming the key that is inconsistent (a DSpark key given to a dflash run,
/// markov_rank < 0, an unknown markov_head_type, gated/rnn or confidence_head_with_markov without
/// markov_rank, confidence_head_with_markov without the confidence head).
DsparkHeads dspark_heads_of(const TrainingSection& training);

/// The DFlash2 conv and selector of the drafter a `training` section trains (enabled false for
/// another objective); throws dflash::Error naming the key that is inconsistent (a DFlash2 key
/// given to a run of another objective, a size of dflash2 not set or out of range, a ratio outside
/// [0, 1], an alpha that is negative or not finite). Ranges that need the model (group size
/// dividing the hidden size, top-K at most the vocabulary) are DrafterConfig::validate's.
Dflash2Heads dflash2_heads_of(const TrainingSection& training);
/// The Domino head of the drafter a `training` section trains (enabled false for the other
/// objectives); throws dflash::Error naming the key: a Domino key given to another objective,
/// emb_dim or gru_hidden_dim missing or ≤ 0, pure_draft_prefix_len < 0 or leaving no corrected
/// slot in a block, lambda_base_start outside [0, 1], lambda_base_decay_ratio outside (0, 1].
DominoHead domino_head_of(const TrainingSection& training);

/// The resume-compatibility check of `dflash train --resume DIR`: `saved` is the configuration of
/// the checkpoint, `requested` the one the run would continue with. Throws dflash::Error naming
/// `dir` and listing every "key: old -> new" that changes the model or the data order
/// (resume_incompatibilities), unless `force`; keys that change the drafter's parameter shapes
/// (shape_changes) are refused even with `force`, since the checkpoint's tensors cannot take
/// another shape. Returns the differences accepted because of `force` (empty when none).
std::vector<std::string> resume_check(const RunConfig& saved, const RunConfig& requested,
                                      bool force, const std::string& dir);

}  // namespace dflash
