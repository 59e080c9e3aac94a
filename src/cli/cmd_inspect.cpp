// `dflash inspect MODEL_DIR` (placeholder until the model files land in this issue).
#include "cli/commands.hpp"
#include "core/error.hpp"

namespace dflash::cli {

void add_inspect_command(CLI::App& app) {
  auto* sub = app.add_subcommand("inspect", "Describe a HF model folder");
  auto dir = std::make_shared<std::string>();
  sub->add_option("model_dir", *dir, "Folder with config.json and safetensors")->required();
  sub->callback([dir] { fail("inspect: not built yet ({})", *dir); });
}

}  // namespace dflash::cli
