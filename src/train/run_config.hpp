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
  int rows_per_step = 1;             ///< packed rows per optimizer step
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
  double gamma = 7.0;                ///< ≤ 0: all slot weights 1
  uint64_t seed = 0;
  int64_t save_interval = 0;         ///< 0 = only at the end
  int keep_last = 3;                 ///< complete checkpoints kept
  int64_t log_interval = 10;
  int64_t eval_interval = 0;         ///< 0 = no periodic eval
  int max_consecutive_skips = 10;    ///< non-finite steps in a row before the run stops
  std::string export_dtype = "bf16"; ///< drafter weights in checkpoints: bf16 or f32
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
};

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
  /// The keys whose values differ from `other` and would change the model or the data order
  /// (everything except intervals, keep_last, runtime and output paths), as "key: old -> new".
  std::vector<std::string> resume_incompatibilities(const RunConfig& other) const;
};

}  // namespace dflash
