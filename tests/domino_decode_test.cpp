// Tests of a Domino drafter outside training: its export (SpecForge's Domino layout: architectures,
// dflash_config keys, tensor names) read back by drafter_load, and speculative decoding with it on
// the tiny fixture (one backbone pass, then the GRU rollout fed the anchor and each drafted token,
// the first pure_draft_prefix_len proposals base-only; greedy output equal to the target's own).
// The sampled path's exactness is checked by sampling_test's chi-square test, which runs a Domino
// drafter too.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/eval.hpp"
#include "infer/sampling.hpp"
#include "infer/speculative.hpp"
#include "model/domino_head.hpp"
#include "model/drafter_io.hpp"
#include "model/safetensors.hpp"
#include "util/decode_fixture.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::TempDir;

// A seeded Domino drafter for the tiny target, saved in the export format; W2 scaled up so that
// the correction moves the argmax.
std::filesystem::path save_domino_drafter(const TempDir& dir, DominoHead head, int K,
                                          uint64_t seed) {
  return test::save_tiny_drafter(
      dir.path(), "domino" + std::to_string(seed), K, seed,
      [&](DrafterConfig& c) { c.domino = head; },
      [&](const DrafterConfig& c, const DrafterLayout& layout, std::vector<float>& params) {
        for (int64_t i = 0; i < c.vocab_size * head.emb_dim; ++i)
          params[layout.domino.proj2 + i] *= 400.0f;
        for (int64_t i = 0; i < head.emb_dim * (c.hidden_size + head.gru_hidden_dim); ++i) {
          params[layout.domino.proj1 + i] *= 20.0f;
        }
        for (int64_t i = 0; i < 3 * head.gru_hidden_dim * c.hidden_size; ++i) {
          params[layout.domino.gru_ih + i] *= 20.0f;
        }
      });
}

TEST(DominoDecode, ExportIsSpecForgesLayoutAndLoadsBack) {
  TempDir dir;
  const DominoHead head{true, 12, 20, 1, true};
  const auto d = save_domino_drafter(dir, head, 5, 3);
  const nlohmann::json j = nlohmann::json::parse(test::read_file(d / "config.json"));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"DominoDraftModel"}));
  const nlohmann::json& dc = j["dflash_config"];
  EXPECT_EQ(dc["projector_type"], "domino");
  EXPECT_EQ(dc["emb_dim"], 12);
  EXPECT_EQ(dc["gru_hidden_dim"], 20);
  EXPECT_EQ(dc["pure_draft_prefix_len"], 1);
  EXPECT_EQ(dc["shift_label"], true);
  SafetensorsCheckpoint ckpt(d);
  EXPECT_EQ(ckpt.info("prefix_gru.weight_ih_l0").shape, (std::vector<int64_t>{60, 384}));
  EXPECT_EQ(ckpt.info("prefix_gru.weight_hh_l0").shape, (std::vector<int64_t>{60, 20}));
  EXPECT_EQ(ckpt.info("embed_proj.0.weight").shape, (std::vector<int64_t>{12, 384 + 20}));
  EXPECT_EQ(ckpt.info("embed_proj.2.weight").shape, (std::vector<int64_t>{8192, 12}));
  const LoadedDrafter l = drafter_load(d);
  EXPECT_EQ(l.config.domino, head);
  // SpecForge's defaults when the optional keys are absent; the required ones name themselves; a
  // Domino key on a DFlash config is refused by name.
  nlohmann::json k = j;
  k["dflash_config"].erase("pure_draft_prefix_len");
  k["dflash_config"].erase("shift_label");
  EXPECT_EQ(drafter_config_from_json(k, "c.json").domino, (DominoHead{true, 12, 20, 0, false}));
  auto error_of = [](const nlohmann::json& c) {
    try {
      drafter_config_from_json(c, "c.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json no_g = j;
  no_g["dflash_config"].erase("gru_hidden_dim");
  EXPECT_NE(error_of(no_g).find("c.json: missing required key 'dflash_config.gru_hidden_dim'"),
            std::string::npos)
      << error_of(no_g);
  nlohmann::json plain = j;
  plain["architectures"] = nlohmann::json::array({"DFlashDraftModel"});
  plain["dflash_config"].erase("projector_type");
  EXPECT_NE(error_of(plain).find("c.json: key 'dflash_config.emb_dim' is set"), std::string::npos)
      << error_of(plain);
  plain["dflash_config"]["projector_type"] = "dspark";
  plain["architectures"] = nlohmann::json::array({"DominoDraftModel"});
  EXPECT_NE(error_of(plain).find("'architectures' names DominoDraftModel"), std::string::npos)
      << error_of(plain);
}

// The proposals of a step are the sequential argmax: proposal j from slot j+1 (slot j with
// shift_label), corrected by the GRU state after the anchor and proposals 0..j−1, the first P
// base-only.
TEST(DominoDecode, ProposalsFollowTheGruRollout) {
  TempDir dir;
  for (bool shift : {false, true}) {
    const DominoHead head{true, 12, 20, 1, shift};
    const LoadedDrafter d = drafter_load(save_domino_drafter(dir, head, 6, shift ? 8 : 7));
    test::HandDraft h = test::draft_one_block(d);
    ASSERT_EQ(h.proposals.size(), 5u);
    const int64_t V = d.config.vocab_size, H = d.config.hidden_size;
    DominoSlotState st;
    domino_block_start(d.config, st);
    int32_t prev = h.anchor;
    int changed = 0;
    for (int j = 0; j < 5; ++j) {
      const int k = shift ? j : j + 1;
      std::vector<float> row(h.logits.begin() + k * V, h.logits.begin() + (k + 1) * V);
      const int32_t plain = argmax_row(row.data(), V);
      domino_feed(d.config, d.layout, d.params.data(), h.embed.data(), prev, st);
      domino_slot_logits(d.config, d.layout, d.params.data(), row.data(), h.ws.hf.data() + k * H, k,
                         st);
      prev = argmax_row(row.data(), V);
      if (j == 0) {
        EXPECT_EQ(prev, plain) << "the first P = 1 proposal is base-only";
      }
      changed += prev != plain;
      EXPECT_EQ(h.proposals[j], prev) << "shift " << shift << " proposal " << j;
    }
    EXPECT_GT(changed, 0) << "the correction never moved the argmax: the test has no power";
  }
}

TEST(DominoDecode, GreedyOutputIsTheTargetsOwn) {
  TempDir dir;
  for (bool shift : {false, true}) {
    const LoadedDrafter d =
        drafter_load(save_domino_drafter(dir, DominoHead{true, 8, 16, 0, shift}, 4, 9));
    test::expect_greedy_decoding_lossless(d, 4, shift ? "shift" : "no shift");  // K−1 + bonus
  }
}

// --backend cuda takes a Domino drafter (infer/decoder_cuda_heads.hpp): no refusal by its
// projector_type; without a GPU the command stops for want of the device.
TEST(DominoDecode, CudaBackendTakesADominoDrafter) {
  TempDir dir;
  const auto d = save_domino_drafter(dir, DominoHead{true, 4, 8, 0, false}, 4, 2);
  test::expect_cuda_decoding_accepted(d, "projector_type: domino");
}

}  // namespace
}  // namespace dflash
