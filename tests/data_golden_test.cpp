// Token-level tests of the text pipeline with the real tiny-qwen3 tokenizer: the tokens and loss
// mask of the reference DFlash trainer's golden step (dflash-step.golden.safetensors, made by the
// public PyTorch implementation) must come out of our pipeline id for id and bit for bit; and the
// `dflash data prepare` command end to end.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/chat_template.hpp"
#include "data/conversation.hpp"
#include "data/dataset.hpp"
#include "data/jsonl.hpp"
#include "data/tokenizer.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using dflash::test::TempDir;

namespace {

// Minimal safetensors reader for the two tensors we need (I64 ids, F32 mask), row-major.
struct Golden {
  int64_t rows = 0, cols = 0;
  std::vector<int64_t> ids;
  std::vector<float> mask;
};

Golden read_golden() {
  std::string bytes =
      test::read_file(test::shared_dir() / "fixtures/dflash-step.golden.safetensors");
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  const char* data = bytes.data() + 8 + n;
  Golden g;
  const auto& ids = h.at("input_ids");
  const auto& mask = h.at("loss_mask");
  EXPECT_EQ(ids.at("dtype"), "I64");
  EXPECT_EQ(mask.at("dtype"), "F32");
  g.rows = ids.at("shape")[0];
  g.cols = ids.at("shape")[1];
  g.ids.resize(static_cast<size_t>(g.rows * g.cols));
  g.mask.resize(g.ids.size());
  std::memcpy(g.ids.data(), data + ids.at("data_offsets")[0].get<size_t>(), g.ids.size() * 8);
  std::memcpy(g.mask.data(), data + mask.at("data_offsets")[0].get<size_t>(), g.mask.size() * 4);
  return g;
}

// The eval records whose chatml rendering is each of the golden step's texts, in order.
std::vector<std::string> golden_records() {
  std::ifstream gf(test::shared_dir() / "fixtures/dflash-step.golden.json");
  auto golden = nlohmann::json::parse(gf);
  std::vector<std::string> texts = golden.at("texts").get<std::vector<std::string>>();
  std::vector<std::string> recs(texts.size());
  LineReader reader(test::shared_dir() / "data/eval_prompts.jsonl");
  std::string line;
  auto tmpl = ChatTemplate::from_name("chatml");
  while (reader.next(line)) {
    auto c = parse_conversation(line, "eval_prompts.jsonl", reader.line_number());
    auto text = render_chat(tmpl, c).text;
    for (size_t i = 0; i < texts.size(); ++i) {
      if (text == texts[i]) recs[i] = line;
    }
  }
  for (size_t i = 0; i < recs.size(); ++i) EXPECT_FALSE(recs[i].empty()) << "text " << i;
  return recs;
}

// Checks a document against golden row r: ids and mask equal on the document, padding after.
void expect_row(const Golden& g, int64_t r, std::span<const int32_t> toks,
                std::span<const uint8_t> mask) {
  ASSERT_LE(static_cast<int64_t>(toks.size()), g.cols);
  for (size_t j = 0; j < toks.size(); ++j) {
    const size_t at = static_cast<size_t>(r * g.cols) + j;
    ASSERT_EQ(toks[j], g.ids[at]) << "row " << r << " token " << j;
    ASSERT_EQ(static_cast<float>(mask[j]), g.mask[at]) << "row " << r << " token " << j;
  }
  for (int64_t j = static_cast<int64_t>(toks.size()); j < g.cols; ++j) {
    EXPECT_EQ(g.mask[static_cast<size_t>(r * g.cols + j)], 0.0f) << "row " << r << " pad " << j;
  }
}

}  // namespace

TEST(DataGolden, ReferenceTrainerTokensAndLossMaskBitForBit) {
  Golden g = read_golden();
  ASSERT_EQ(g.rows, 3);
  auto recs = golden_records();
  Tokenizer tok = Tokenizer::load(test::assets_dir() / "tiny-qwen3/tokenizer.json");
  EncodeFn enc = [&tok](std::string_view t, std::vector<std::pair<size_t, size_t>>* off) {
    return tok.encode(t, off);
  };
  auto tmpl = ChatTemplate::from_name("chatml");
  for (int64_t r = 0; r < g.rows; ++r) {
    auto c = parse_conversation(recs[static_cast<size_t>(r)], "eval", r + 1);
    TokenizedDoc d = tokenize_rendered(render_chat(tmpl, c), enc);
    expect_row(g, r, d.tokens, d.loss_mask);
  }

  // The same through prepare_dataset and its cache file.
  TempDir tmp;
  std::string data;
  for (const auto& rec : recs) data += rec + "\n";
  test::write_file(tmp / "g.jsonl", data);
  PrepareOptions o;
  o.data = tmp / "g.jsonl";
  o.cache = tmp / "g.dftok";
  o.chat_template = tmpl;
  o.max_length = 4096;
  o.encode = enc;
  o.tokenizer_hash = hash_file(test::assets_dir() / "tiny-qwen3/tokenizer.json");
  auto ds = prepare_dataset(o).dataset;
  ASSERT_EQ(ds.num_docs(), 3);
  for (int64_t r = 0; r < 3; ++r) expect_row(g, r, ds.doc_tokens(r), ds.doc_loss_mask(r));
}

TEST(DataGolden, PrepareCommandPrintsFiguresAndReusesTheCache) {
  TempDir tmp;
  auto recs = golden_records();
  std::string data;
  for (const auto& rec : recs) data += rec + "\n";
  test::write_file(tmp / "g.jsonl", data);
  std::vector<std::string> args = {"data",           "prepare",
                                   "--model",        (test::assets_dir() / "tiny-qwen3").string(),
                                   "--data",         (tmp / "g.jsonl").string(),
                                   "--cache",        (tmp / "g.dftok").string(),
                                   "--token-budget", "512"};
  auto r = test::run_dflash(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("template chatml"), std::string::npos) << r.out;  // detected
  EXPECT_NE(r.out.find("conversations kept             3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("built"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("padding waste"), std::string::npos) << r.out;
  auto r2 = test::run_dflash(args);
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  EXPECT_NE(r2.out.find("reused"), std::string::npos) << r2.out;
  // A bad record stops the command with file:line; --skip-invalid counts it.
  test::write_file(tmp / "g.jsonl", data + "{\"id\": \"x\"}\n");
  auto r3 = test::run_dflash(args);
  EXPECT_EQ(r3.exit_code, 1);
  EXPECT_NE(r3.err.find("g.jsonl:4"), std::string::npos) << r3.err;
  EXPECT_NE(r3.err.find("pass --skip-invalid"), std::string::npos) << r3.err;
  args.push_back("--skip-invalid");
  auto r4 = test::run_dflash(args);
  ASSERT_EQ(r4.exit_code, 0) << r4.err;
  EXPECT_NE(r4.out.find("missing_field=1"), std::string::npos) << r4.out;
}
