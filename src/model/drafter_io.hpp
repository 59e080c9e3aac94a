// dflash.cpp — the DFlash drafter's export format (DESIGN.md §1 "Export format") and the checks
// that tie a drafter to its target.
//
// A drafter folder holds `config.json` (a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
// `block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`) and
// `model.safetensors` with exactly the tensors of DrafterLayout under their export names (no
// embedding, no LM head). This is what SGLang, vLLM and the reference DFlash loader read.
//
// Invariants: a DrafterConfig returned here has passed DrafterConfig::validate(); the DFlash fields
// are never guessed (a missing `target_layer_ids`, `mask_token_id`, `block_size` or
// `num_target_layers` is an error naming the file and key); every error names the file and the key
// or tensor at fault. Writes are atomic per file (temporary file, fsync, rename).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "model/config.hpp"
#include "model/drafter.hpp"

namespace dflash {

class Tokenizer;
class SafetensorsCheckpoint;

/// The config.json object of a drafter (DESIGN.md §1): the Qwen3 fields (`hidden_size`,
/// `intermediate_size`, `num_hidden_layers`, heads, `head_dim`, `vocab_size`, `rms_norm_eps`,
/// `rope_theta`, `rope_scaling` (null for standard RoPE, else the HF dict of the linear/llama3/yarn
/// variant), `max_position_embeddings`, `tie_word_embeddings: false`, `attention_bias: false`,
/// `hidden_act: "silu"`, `layer_types`), `architectures: ["DFlashDraftModel"]`,
/// `model_type: "qwen3"`, top-level `block_size` and `num_target_layers`, and
/// `dflash_config: {mask_token_id, target_layer_ids}`. A DSpark drafter (cfg.dspark.enabled) is
/// written as SpecForge's DSpark export: `architectures: ["DSparkDraftModel"]` and dflash_config
/// also {projector_type: "dspark", attention_mode: gqa (fewer KV heads than heads) | mha,
/// markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov}. A DFlash2
/// drafter (cfg.dflash2.enabled) is written as OBJECTIVES.md §1.4's export: `architectures:
/// ["DFlash2DraftModel"]` and dflash_config also {block_size, conv_kernel_size, conv_group_size,
/// selector_rank, selector_top_k, output_multiplier, final_logit_softcapping (only when > 0)}; its
/// tensors are named as in DrafterLayout (layers.i.{attention,mlp}_conv.*, candidate_selector.*).
/// A Domino drafter (cfg.domino.enabled) is written as SpecForge's Domino export: `architectures:
/// ["DominoDraftModel"]` and dflash_config also {projector_type: "domino", emb_dim,
/// gru_hidden_dim, pure_draft_prefix_len, shift_label}. Throws dflash::Error if `cfg` is invalid.
nlohmann::json drafter_export_config(const DrafterConfig& cfg);

/// Parses a drafter config.json object; `source` names the file in errors. The Qwen3 fields are
/// read by model_config_from_json (the target's parser: same keys, same RoPE resolution); a
/// missing `model_type` is accepted only when `architectures` is ["DFlashDraftModel"] (then it is
/// qwen3), any other model type than qwen3 is an error. `block_size`, `mask_token_id`,
/// `target_layer_ids` and `num_target_layers` are each read at the top level or inside
/// `dflash_config`; both places may hold a key only with the same value (else an error naming
/// both), and a key in neither is an error. Attention biases, sliding-window layers and partial
/// rotary factors are refused (the drafter has none). `architectures` ["DSparkDraftModel"] or
/// dflash_config.projector_type "dspark" make a DSpark drafter (its heads' keys with SpecForge's
/// defaults; enable_confidence_head defaults to confidence_head_alpha > 0); DSpark keys on
/// another drafter are an error naming the key. `architectures` ["DFlash2DraftModel"] makes a
/// DFlash2 drafter: conv_kernel_size, conv_group_size, selector_rank and selector_top_k required,
/// output_multiplier (1) and final_logit_softcapping (none) optional; those four keys on another
/// drafter are an error naming the key. `architectures` ["DominoDraftModel"] or projector_type
/// "domino" make a Domino drafter (emb_dim and gru_hidden_dim required, pure_draft_prefix_len 0
/// and shift_label false by default); Domino keys on another drafter are an error naming the key.
DrafterConfig drafter_config_from_json(const nlohmann::json& j, const std::string& source);

/// Writes the drafter folder `dir` (created if needed): `model.safetensors` with every parameter
/// of `layout` under its export name in `export_dtype` (bf16: round to nearest even; f32: exact),
/// metadata {"format": "pt"}, then `config.json` (drafter_export_config plus `dtype` /
/// `torch_dtype`). Each file is replaced atomically. Throws dflash::Error for a dtype other than
/// bf16/f32, `params.size() != layout.total`, or an I/O error (naming the file).
void drafter_save(const std::filesystem::path& dir, const DrafterConfig& cfg,
                  const DrafterLayout& layout, std::span<const float> params,
                  DType export_dtype = DType::bf16);

/// A drafter read back from its folder.
struct LoadedDrafter {
  DrafterConfig config;
  DrafterLayout layout;
  std::vector<float> params;  ///< layout.total values, export order, converted to f32
};

/// Reads a drafter folder (config.json + model.safetensors, or a sharded index). Throws
/// dflash::Error naming the folder and the tensors when any DrafterLayout tensor is missing, has
/// another shape or a non-float dtype, or when the file holds tensors the layout does not know
/// (all of them listed); config errors as drafter_config_from_json.
LoadedDrafter drafter_load(const std::filesystem::path& dir);

/// Refuses a drafter that does not fit `target`: hidden size, vocab size (embedding / LM head
/// rows), num_target_layers (= target num_hidden_layers), tap ids (in [0, target layers)) and
/// mask_token_id (< target vocab). Throws dflash::Error naming the field and both values.
void drafter_check_target(const DrafterConfig& cfg, const ModelConfig& target);

/// Refuses a drafter whose mask_token_id is a token `tok` produces (an id below tok.vocab_size(),
/// a vocabulary or added token): its MASK slots would read as that token, and speculative decoding
/// would run at about one token per step. Throws dflash::Error naming `drafter` (the folder), the
/// id, its token and the ids the tokenizer leaves free, [tok.vocab_size(), cfg.vocab_size).
/// Training refuses the same ids (drafter_config_for_target).
void drafter_check_tokenizer(const DrafterConfig& cfg, const Tokenizer& tok,
                             const std::string& drafter);

/// The checks drafter_load makes on a drafter folder's weights, without reading them: every
/// DrafterLayout tensor of `cfg` is in `ckpt` with its shape and a float dtype, and `ckpt` holds no
/// other tensor. Throws dflash::Error naming `dir` and listing the tensors at fault.
void drafter_check_weights(const std::filesystem::path& dir, const DrafterConfig& cfg,
                           const SafetensorsCheckpoint& ckpt);

/// Optional drafter sizes; each absent one is taken from the target (block_size: 16).
struct DrafterSizes {
  std::optional<int64_t> intermediate_size;
  std::optional<int64_t> num_heads;
  std::optional<int64_t> num_kv_heads;
  std::optional<int64_t> head_dim;
  std::optional<int> block_size;
};

/// Qwen2/Qwen3 family's drafter mask id (DESIGN.md §1): the first id after the 151,643 BPE tokens
/// and their 26 added tokens.
inline constexpr int32_t kQwenMaskTokenId = 151669;

/// A new drafter config of `num_layers` layers for `target`: hidden size, vocab, rms_norm_eps,
/// RoPE and max_position_embeddings from the target; the sizes of `sizes` or the target's;
/// `target_layer_ids` given or default_target_layer_ids(target layers, num_layers).
/// mask_token_id: the given one, else kQwenMaskTokenId for a Qwen2/Qwen3 target with the Qwen BPE
/// (`<|endoftext|>` is id 151643) when target vocab_size > 151669 and the tokenizer's vocabulary
/// ends at or before 151669; no other default. The id must be < target vocab_size and, when `tok`
/// is given, >= tok->vocab_size() (an id the tokenizer never produces: neither a vocabulary nor an
/// added token). Without a tokenizer an explicit mask id is required. Throws dflash::Error saying
/// what to set (`mask_token_id`, with the free range) when no valid mask id is available, and for
/// any invalid size or tap.
DrafterConfig drafter_config_for_target(
    const ModelConfig& target, int num_layers, const DrafterSizes& sizes = {},
    std::optional<int> mask_token_id = std::nullopt,
    std::optional<std::vector<int>> target_layer_ids = std::nullopt,
    const Tokenizer* tok = nullptr);

}  // namespace dflash
