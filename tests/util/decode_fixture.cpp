// dflash.cpp — the objective decode tests' shared pieces (decode_fixture.hpp).
#include "util/decode_fixture.hpp"

#include <gtest/gtest.h>

#include "data/chat_template.hpp"
#include "data/tokenizer.hpp"
#include "infer/eval.hpp"
#include "infer/speculative.hpp"
#include "util/test_util.hpp"

namespace dflash::test {

std::filesystem::path save_tiny_drafter(
    const std::filesystem::path& dir, const std::string& name, int K, uint64_t seed,
    const std::function<void(DrafterConfig&)>& set_heads,
    const std::function<void(const DrafterConfig&, const DrafterLayout&, std::vector<float>&)>&
        shape) {
  DrafterSizes sizes;
  sizes.block_size = K;
  sizes.intermediate_size = 128;
  DrafterConfig c = drafter_config_for_target(tiny_qwen3_f32().config(), 1, sizes, 8000);
  set_heads(c);
  const DrafterLayout layout(c);
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, seed);
  if (shape) shape(c, layout, params);
  const auto d = dir / name;
  drafter_save(d, c, layout, params, DType::f32);
  return d;
}

HandDraft draft_one_block(const LoadedDrafter& d) {
  const SpeculativeDecoder dec(tiny_qwen3_f32(), d);
  const Tokenizer tok = Tokenizer::load(tiny_qwen3_dir());
  DecodeOptions o;
  o.max_new_tokens = 12;
  SpecState s = dec.start(tok.encode("The history of the river"), o);
  HandDraft h;
  h.anchor = s.anchor;
  DrafterCache cache = s.drafter_cache;
  dec.step(s, o);
  h.proposals = s.last_proposals;
  h.embed = tiny_qwen3_f32().embedding_f32();
  const DrafterTables<float> tables{h.embed.data(), h.embed.data()};  // tied head
  const std::span<const float> U =
      drafter_draft_block(cache, d.config, d.layout, d.params.data(), tables, h.anchor, h.ws);
  h.logits.assign(U.begin(), U.end());
  return h;
}

void expect_greedy_decoding_lossless(const LoadedDrafter& d, int max_accept,
                                     const std::string& what) {
  const SpeculativeDecoder dec(tiny_qwen3_f32(), d);
  const Tokenizer tok = Tokenizer::load(tiny_qwen3_dir());
  const ChatTemplate tmpl = resolve_chat_template(tiny_qwen3_dir(), "");
  const std::vector<EvalPrompt> prompts =
      load_eval_prompts(assets_dir() / "data" / "eval_prompts.jsonl", tmpl, tok, 0, 1);
  ASSERT_EQ(prompts.size(), 4u);
  DecodeOptions o;
  o.max_new_tokens = 24;
  o.stop_ids = generation_eos_ids(tiny_qwen3_dir(), tiny_qwen3_f32().config());
  for (const EvalPrompt& p : prompts) {
    const auto ref =
        greedy_generate(tiny_qwen3_f32(), p.tokens, o.max_new_tokens, o.stop_ids, true);
    const DecodeResult r = dec.generate(p.tokens, o);
    EXPECT_EQ(r.tokens, ref) << what << ": " << p.id;
    for (int a : r.accept_lengths) {
      EXPECT_GE(a, 1) << what;
      EXPECT_LE(a, max_accept) << what;
    }
  }
}

}  // namespace dflash::test
