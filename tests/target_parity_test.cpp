// Parity of the target model with HF transformers on the small random checkpoints made by
// tools/make_model_goldens.py (qwen2 with attention bias, llama with untied head and llama3 RoPE in
// the classic config keys, llama with yarn RoPE in `rope_parameters` and o/mlp biases, Qwen3-MoE
// with norm_topk_prob and a dense layer, Qwen3-MoE with sparse step 2 and a sliding window,
// gpt-oss with bf16 experts and with MXFP4 experts): every folder under tests/fixtures/models/
// holding config.json and golden.safetensors is checked — every layer's output, the final norm
// and the logits within 1e-4 relative (fp32 on both sides; only summation order differs), and
// the greedy tokens (plain loop and KV-cache loop) identical.
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/safetensors.hpp"
#include "model/target.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using dflash::test::rel_error;

namespace {

constexpr double kTol = 1e-4;

std::vector<std::filesystem::path> model_folders() {
  std::vector<std::filesystem::path> out;
  const auto root = test::source_dir() / "tests" / "fixtures" / "models";
  if (!std::filesystem::is_directory(root)) return out;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "config.json") &&
        std::filesystem::exists(e.path() / "golden.safetensors"))
      out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int32_t> ids_of(const SafetensorsFile& g, const std::string& name) {
  const Tensor t = g.get_as(name, DType::i32);
  const int32_t* p = t.data<int32_t>();
  return std::vector<int32_t>(p, p + t.numel());
}

std::vector<int> parse_layers(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}

}  // namespace

TEST(TargetParity, RandomCheckpointsMatchHf) {
  const auto folders = model_folders();
  if (folders.empty()) {
    GTEST_SKIP() << "no golden checkpoints under tests/fixtures/models: run "
                    "`python3 tools/make_model_goldens.py --out tests/fixtures/models` on the "
                    "device (PyTorch + transformers 5) and commit the result";
  }
  // Every family the CPU target supports has a committed golden; none may go missing silently.
  for (const char* want : {"qwen2-bias", "llama3-rope", "llama-yarn", "qwen3-moe",
                           "qwen3-moe-window", "gpt-oss", "gpt-oss-mxfp4"}) {
    EXPECT_TRUE(std::any_of(folders.begin(), folders.end(),
                            [&](const auto& d) { return d.filename() == want; }))
        << "missing fixture tests/fixtures/models/" << want;
  }
  for (const auto& dir : folders) {
    SCOPED_TRACE(dir.filename().string());
    const TargetModel m = TargetModel::load(dir);
    const SafetensorsFile g(dir / "golden.safetensors");
    ASSERT_TRUE(g.metadata().count("layers")) << "golden.safetensors lacks metadata 'layers'";
    const std::vector<int> layers = parse_layers(g.metadata().at("layers"));
    ASSERT_EQ(static_cast<int64_t>(layers.size()), m.num_layers());
    const int64_t H = m.hidden_size();
    double worst = 0;
    int prompts = 0;
    for (int i = 0; g.contains(fmt::format("p{}.input_ids", i)); ++i, ++prompts) {
      SCOPED_TRACE(fmt::format("prompt {}", i));
      const std::vector<int32_t> toks = ids_of(g, fmt::format("p{}.input_ids", i));
      const std::vector<int32_t> offs = {0, static_cast<int32_t>(toks.size())};
      ForwardOptions o;
      o.tap_layers = layers;
      o.final_norm = true;
      o.logits = LogitsRows::all;
      const ForwardResult r = m.forward(toks, offs, o);
      for (size_t k = 0; k < layers.size(); ++k) {
        const Tensor got =
            r.taps.slice(1, static_cast<int64_t>(k) * H, static_cast<int64_t>(k + 1) * H)
                .contiguous();
        const double e = rel_error(got, g.get(fmt::format("p{}.layer{}.out", i, layers[k])));
        EXPECT_LT(e, kTol) << "layer " << layers[k];
        worst = std::max(worst, e);
      }
      const double en = rel_error(r.final_norm, g.get(fmt::format("p{}.final_norm.out", i)));
      const double el = rel_error(r.logits, g.get(fmt::format("p{}.logits", i)));
      EXPECT_LT(en, kTol);
      EXPECT_LT(el, kTol);
      worst = std::max({worst, en, el});

      const std::vector<int32_t> want = ids_of(g, fmt::format("p{}.greedy", i));
      const int64_t n = static_cast<int64_t>(want.size());
      EXPECT_EQ(greedy_generate(m, toks, n, {}, true), want) << "KV-cache loop";
      EXPECT_EQ(greedy_generate(m, toks, n, {}, false), want) << "plain loop";
    }
    EXPECT_GT(prompts, 0) << "golden.safetensors holds no prompt";
    const auto& meta = g.metadata();
    std::printf("%s (%s, rope %s): worst relative error %.3g over %d prompts (HF %s, router gap "
                "%s)\n",
                dir.filename().string().c_str(), m.config().model_type.c_str(),
                std::string(rope_type_name(m.config().rope.type)).c_str(), worst, prompts,
                meta.count("transformers") ? meta.at("transformers").c_str() : "?",
                meta.count("min_router_gap") ? meta.at("min_router_gap").c_str() : "-");
  }
}
