// dflash.cpp — named target shapes for `dflash bench` and the memory plan: the HF config.json of
// public models (sizes only; no weights), one table row per model, so adding a preset is adding a
// row.
//
// Invariants: every preset parses with model_config_from_json (the same loader as a model folder's
// config.json) and names the mask token id its drafters use.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace dflash {

/// One preset.
struct ModelPreset {
  std::string name;       ///< e.g. "qwen3-8b"
  std::string hf_name;    ///< the public model whose config it copies, e.g. "Qwen/Qwen3-8B"
  ModelConfig config;     ///< parsed config.json
  int mask_token_id = 0;  ///< DFlash mask id for drafters of this target
};

/// Every preset, in table order.
const std::vector<ModelPreset>& model_presets();
/// The preset called `name`; throws dflash::Error listing the known names when there is none.
const ModelPreset& model_preset(std::string_view name);

}  // namespace dflash
