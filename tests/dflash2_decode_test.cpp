// Tests of a DFlash2 drafter outside training: its export (OBJECTIVES.md §1.4: architectures,
// dflash_config keys, tensor names) read back by drafter_load, and speculative decoding with it on
// the tiny fixture (slots 1..K−1 walk the selector from prev₁ = the anchor, greedy output equal to
// the target's own). The sampled path's exactness is checked by sampling_test's chi-square test,
// which runs a DFlash2 drafter too.
#include <gtest/gtest.h>

#include <functional>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/eval.hpp"
#include "infer/sampling.hpp"
#include "infer/speculative.hpp"
#include "model/dflash2_selector.hpp"
#include "model/drafter_io.hpp"
#include "util/decode_fixture.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::TempDir;

// A seeded DFlash2 drafter for the tiny target, saved in the export format. `shape`: the conv
// and the successor codebook get random values (scaled up so that the selector moves the walk off
// the per-slot argmax); otherwise drafter_init's identity start.
std::filesystem::path save_dflash2_drafter(const TempDir& dir, Dflash2Heads heads, int K,
                                           uint64_t seed, bool shape = true) {
  auto random_selector = [&](const DrafterConfig& c, const DrafterLayout& layout,
                             std::vector<float>& params) {
    Rng rng(seed + 1);
    const int64_t r = heads.selector_rank;
    for (int64_t i = 0; i < c.vocab_size * r; ++i) {
      params[layout.dflash2.successor + i] = static_cast<float>(rng.normal());
      params[layout.dflash2.predecessor + i] *= 50.0f;
    }
    for (int64_t i = 0; i < r * c.hidden_size; ++i) params[layout.dflash2.hidden_proj + i] *= 50.0f;
    const ParamInfo& kp = layout.find("layers.0.mlp_conv.kernel_projection.weight");
    for (int64_t i = 0; i < kp.numel; ++i) params[kp.offset + i] = 0.05f * rng.normal();
  };
  return test::save_tiny_drafter(
      dir.path(), "dflash2_" + std::to_string(seed), K, seed,
      [&](DrafterConfig& c) { c.dflash2 = heads; },
      shape ? std::function(random_selector) : nullptr);
}

const Dflash2Heads kHeads{true, 2, 16, 8, 6, 0.5, 20.0};

TEST(Dflash2Decode, ExportIsTheDflash2LayoutAndLoadsBack) {
  TempDir dir;
  const auto d = save_dflash2_drafter(dir, kHeads, 5, 3);
  const nlohmann::json j = nlohmann::json::parse(test::read_file(d / "config.json"));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"DFlash2DraftModel"}));
  const nlohmann::json& dc = j["dflash_config"];
  EXPECT_EQ(dc["block_size"], 5);
  EXPECT_EQ(dc["conv_kernel_size"], 2);
  EXPECT_EQ(dc["conv_group_size"], 16);
  EXPECT_EQ(dc["selector_rank"], 8);
  EXPECT_EQ(dc["selector_top_k"], 6);
  EXPECT_EQ(dc["output_multiplier"], 0.5);
  EXPECT_EQ(dc["final_logit_softcapping"], 20.0);
  const LoadedDrafter l = drafter_load(d);
  EXPECT_EQ(l.config.dflash2, kHeads);
  const int64_t H = 384, V = l.config.vocab_size;
  EXPECT_EQ(l.layout.find("layers.0.attention_conv.base_kernel").shape,
            (std::vector<int64_t>{2, 2, H}));
  EXPECT_EQ(l.layout.find("layers.0.mlp_conv.kernel_projection.weight").shape,
            (std::vector<int64_t>{2 * 2 * (H / 16), H}));
  EXPECT_EQ(l.layout.find("candidate_selector.predecessor_codebook").shape,
            (std::vector<int64_t>{V, 8}));
  EXPECT_EQ(l.layout.find("candidate_selector.successor_codebook").shape,
            (std::vector<int64_t>{V, 8}));
  EXPECT_EQ(l.layout.find("candidate_selector.hidden_projection.weight").shape,
            (std::vector<int64_t>{8, H}));
  // The optional keys' defaults (m = 1, no softcap); a missing required key or a DFlash2 key on
  // a DFlash config is refused by name.
  nlohmann::json k = j;
  k["dflash_config"].erase("output_multiplier");
  k["dflash_config"].erase("final_logit_softcapping");
  const DrafterConfig def = drafter_config_from_json(k, "c.json");
  EXPECT_EQ(def.dflash2.output_multiplier, 1.0);
  EXPECT_EQ(def.dflash2.final_logit_softcapping, 0.0);
  auto error_of = [](const nlohmann::json& x) {
    try {
      drafter_config_from_json(x, "c.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json missing = j;
  missing["dflash_config"].erase("selector_top_k");
  EXPECT_NE(error_of(missing).find("c.json: missing required key 'dflash_config.selector_top_k'"),
            std::string::npos)
      << error_of(missing);
  nlohmann::json plain = j;
  plain["architectures"] = nlohmann::json::array({"DFlashDraftModel"});
  EXPECT_NE(error_of(plain).find("c.json: key 'dflash_config.conv_kernel_size' is set (2) but "
                                 "'architectures' does not name DFlash2DraftModel"),
            std::string::npos)
      << error_of(plain);
  nlohmann::json bad = j;
  bad["dflash_config"]["conv_group_size"] = 7;
  EXPECT_NE(error_of(bad).find("conv_group_size 7 must be >= 1 and divide hidden_size 384"),
            std::string::npos)
      << error_of(bad);
}

// The proposals of a step are the selector's greedy walk over slots 1..K−1 from the anchor.
TEST(Dflash2Decode, TheWalkDraftsFromThePreviousDraft) {
  TempDir dir;
  const LoadedDrafter d = drafter_load(save_dflash2_drafter(dir, kHeads, 5, 7));
  const test::HandDraft h = test::draft_one_block(d);
  ASSERT_EQ(h.proposals.size(), 4u);
  const int64_t V = d.config.vocab_size, H = d.config.hidden_size;
  Dflash2SlotScores sc;
  int32_t prev = h.anchor;
  int changed = 0;
  for (int k = 1; k < 5; ++k) {
    const float* row = h.logits.data() + k * V;
    dflash2_slot_scores(d.config, d.layout, d.params.data(), row, h.ws.hf.data() + k * H, prev, sc);
    const int32_t plain = argmax_row(row, V);
    prev = dflash2_greedy(sc);
    changed += prev != plain;
    EXPECT_EQ(h.proposals[k - 1], prev) << "slot " << k;
  }
  EXPECT_GT(changed, 0)
      << "the selector never moved the walk off the argmax: the test has no power";
}

TEST(Dflash2Decode, GreedyOutputIsTheTargetsOwn) {
  TempDir dir;
  const LoadedDrafter d = drafter_load(save_dflash2_drafter(dir, kHeads, 4, 9));
  test::expect_greedy_decoding_lossless(d, 4, "dflash2");  // K−1 drafts + the bonus
}

// --backend cuda takes a DFlash2 drafter (infer/decoder_cuda_dflash2.hpp): no refusal by its
// architecture; without a GPU the command stops for want of the device.
TEST(Dflash2Decode, CudaBackendTakesADflash2Drafter) {
  TempDir dir;
  const auto d = save_dflash2_drafter(dir, kHeads, 4, 2);
  test::expect_cuda_decoding_accepted(d, "DFlash2DraftModel) is decoded by the cpu backend");
}

}  // namespace
}  // namespace dflash
