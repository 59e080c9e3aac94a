// Tests of a DSpark drafter outside training: its export (SpecForge's DSpark layout: architectures,
// dflash_config keys, tensor names) read back by drafter_load, and speculative decoding with it on
// the tiny fixture (every slot drafts, slot k's bias from the token drafted at k−1 with prev₀ = the
// anchor, greedy output equal to the target's own). The sampled path's exactness is checked by
// sampling_test's chi-square test, which runs a DSpark drafter too.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/eval.hpp"
#include "infer/sampling.hpp"
#include "infer/speculative.hpp"
#include "model/drafter_io.hpp"
#include "model/dspark_head.hpp"
#include "util/decode_fixture.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::TempDir;

// A seeded DSpark drafter for the tiny target, saved in the export format; its Markov projection
// scaled up so that the bias moves the argmax.
std::filesystem::path save_dspark_drafter(const TempDir& dir, DsparkHeads heads, int K,
                                          uint64_t seed) {
  return test::save_tiny_drafter(
      dir.path(), "dspark" + std::to_string(seed), K, seed,
      [&](DrafterConfig& c) { c.dspark = heads; },
      [&](const DrafterConfig& c, const DrafterLayout& layout, std::vector<float>& params) {
        if (layout.dspark.markov_w2 < 0) return;
        for (int64_t i = 0; i < c.vocab_size * heads.markov_rank; ++i) {
          params[layout.dspark.markov_w2 + i] *= 400.0f;
        }
      });
}

TEST(DSparkDecode, ExportIsSpecForgesLayoutAndLoadsBack) {
  TempDir dir;
  const DsparkHeads heads{true, 8, MarkovHeadType::rnn, true, true};
  const auto d = save_dspark_drafter(dir, heads, 5, 3);
  const nlohmann::json j = nlohmann::json::parse(test::read_file(d / "config.json"));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"DSparkDraftModel"}));
  const nlohmann::json& dc = j["dflash_config"];
  EXPECT_EQ(dc["projector_type"], "dspark");
  EXPECT_EQ(dc["attention_mode"], "gqa");  // the tiny target has 6 heads, 2 KV heads
  EXPECT_EQ(dc["markov_rank"], 8);
  EXPECT_EQ(dc["markov_head_type"], "rnn");
  EXPECT_EQ(dc["enable_confidence_head"], true);
  EXPECT_EQ(dc["confidence_head_with_markov"], true);
  const LoadedDrafter l = drafter_load(d);
  EXPECT_EQ(l.config.dspark, heads);
  EXPECT_EQ(l.layout.find("markov_head.joint_proj.weight").shape,
            (std::vector<int64_t>{24, 16 + 384}));
  EXPECT_EQ(l.layout.find("confidence_head.proj.weight").shape, (std::vector<int64_t>{1, 384 + 8}));
  // SpecForge's defaults when the keys are absent: vanilla, no confidence head unless
  // confidence_head_alpha > 0; a DSpark key on a DFlash config is refused by name.
  nlohmann::json k = j;
  k["dflash_config"].erase("markov_head_type");
  k["dflash_config"].erase("enable_confidence_head");
  k["dflash_config"].erase("confidence_head_with_markov");
  k["dflash_config"]["confidence_head_alpha"] = 1.0;
  const DrafterConfig def = drafter_config_from_json(k, "c.json");
  EXPECT_EQ(def.dspark, (DsparkHeads{true, 8, MarkovHeadType::vanilla, true, false}));
  nlohmann::json plain = j;
  plain["architectures"] = nlohmann::json::array({"DFlashDraftModel"});
  plain["dflash_config"].erase("projector_type");
  try {
    drafter_config_from_json(plain, "c.json");
    ADD_FAILURE() << "a DFlash config with markov_rank was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: key 'dflash_config.markov_rank' is set"),
              std::string::npos)
        << e.what();
  }
  plain["dflash_config"]["projector_type"] = "dflash2";
  plain["architectures"] = nlohmann::json::array({"DSparkDraftModel"});
  EXPECT_THROW(drafter_config_from_json(plain, "c.json"), Error);
}

// The proposals of a step are the sequential argmax over all K slots: slot k's logits are the
// block's base logits plus the Markov bias of the token proposed at k−1 (prev₀ = the anchor).
TEST(DSparkDecode, EverySlotDraftsFromThePreviousDraft) {
  TempDir dir;
  for (MarkovHeadType type :
       {MarkovHeadType::vanilla, MarkovHeadType::gated, MarkovHeadType::rnn}) {
    const LoadedDrafter d =
        drafter_load(save_dspark_drafter(dir, DsparkHeads{true, 6, type, false, false}, 5, 7));
    test::HandDraft h = test::draft_one_block(d);
    ASSERT_EQ(h.proposals.size(), 5u) << markov_head_type_name(type);
    const int64_t V = d.config.vocab_size, H = d.config.hidden_size;
    DsparkSlotState st;
    int32_t prev = h.anchor;
    int changed = 0;
    for (int k = 0; k < 5; ++k) {
      std::vector<float> row(h.logits.begin() + k * V, h.logits.begin() + (k + 1) * V);
      const int32_t plain = argmax_row(row.data(), V);
      dspark_slot_logits(d.config, d.layout, d.params.data(), row.data(), h.ws.hf.data() + k * H,
                         prev, k, st);
      prev = argmax_row(row.data(), V);
      changed += prev != plain;
      EXPECT_EQ(h.proposals[k], prev) << markov_head_type_name(type) << " slot " << k;
    }
    EXPECT_GT(changed, 0) << "the Markov bias never moved the argmax: the test has no power";
  }
}

TEST(DSparkDecode, GreedyOutputIsTheTargetsOwn) {
  TempDir dir;
  const LoadedDrafter d = drafter_load(
      save_dspark_drafter(dir, DsparkHeads{true, 6, MarkovHeadType::rnn, true, true}, 4, 9));
  test::expect_greedy_decoding_lossless(d, 5, "dspark");  // K drafts + the bonus
}

// Oracle verification: K proposals (a DSpark block) that are the target's greedy continuation are
// all accepted, an acceptance length of K + 1.
TEST(DSparkDecode, AllKDraftsCanBeAccepted) {
  TempDir dir;
  const LoadedDrafter d = drafter_load(
      save_dspark_drafter(dir, DsparkHeads{true, 4, MarkovHeadType::vanilla, false, false}, 4, 5));
  const SpeculativeDecoder dec(test::tiny_qwen3_f32(), d);
  const Tokenizer tok = Tokenizer::load(test::tiny_qwen3_dir());
  const std::vector<int32_t> prompt = tok.encode("Once upon a time");
  DecodeOptions o;
  o.max_new_tokens = 10;
  const auto ref = greedy_generate(test::tiny_qwen3_f32(), prompt, 10, {}, true);
  SpecState s = dec.start(prompt, o);
  const std::vector<int32_t> prop(ref.begin() + 1, ref.begin() + 5);
  dec.verify(s, o, prop, {});
  EXPECT_EQ(s.result.accept_lengths.back(), 5);
  EXPECT_EQ(s.target_cache.length(), s.drafter_cache.len);
  EXPECT_EQ(s.result.tokens, std::vector<int32_t>(ref.begin(), ref.begin() + 6));
}

// --backend cuda takes a DSpark drafter (infer/decoder_cuda_heads.hpp): no refusal by its
// projector_type; without a GPU the command stops for want of the device.
TEST(DSparkDecode, CudaBackendTakesADSparkDrafter) {
  TempDir dir;
  const auto d =
      save_dspark_drafter(dir, DsparkHeads{true, 2, MarkovHeadType::vanilla, false, false}, 4, 2);
  test::expect_cuda_decoding_accepted(d, "projector_type: dspark");
}

}  // namespace
}  // namespace dflash
