// Tests of src/data/tokenizer: conformance with HF `tokenizers` ids on the real Qwen3 tokenizer
// (cases.jsonl, recorded with HF tokenizers 0.23), round trips, offsets, added-token flags on a
// hand-written tokenizer.json, invalid UTF-8 handling, thread safety, the CLI.
#include "data/tokenizer.hpp"

#include <gtest/gtest.h>
#include <utf8proc.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.hpp"
#include "data/utf8.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {


/// The real Qwen3 tokenizer, decompressed once into a temp dir for the whole test program.
const Tokenizer& qwen3() {
  static test::TempDir dir;
  static const Tokenizer tok = [] {
    test::write_file(
        dir / "tokenizer.json",
        test::xz_decompress(test::shared_dir() / "fixtures/qwen3-tokenizer/tokenizer.json.xz"));
    return Tokenizer::load(dir.path());
  }();
  return tok;
}

struct Case {
  std::string text, decoded;
  std::vector<int32_t> ids;
};
std::vector<Case> qwen3_cases() {
  std::ifstream f(test::shared_dir() / "fixtures/qwen3-tokenizer/cases.jsonl");
  std::vector<Case> cases;
  std::string line;
  while (std::getline(f, line)) {
    const json j = json::parse(line);
    cases.push_back({j["text"], j["decoded"], j["ids"].get<std::vector<int32_t>>()});
  }
  return cases;
}

/// Checks that offsets are monotone, character-aligned and cover `text` without gaps.
void expect_offsets_cover(const std::string& text,
                          const std::vector<std::pair<size_t, size_t>>& o) {
  if (text.empty()) {
    EXPECT_TRUE(o.empty());
    return;
  }
  ASSERT_FALSE(o.empty());
  EXPECT_EQ(o.front().first, 0u) << text;
  EXPECT_EQ(o.back().second, text.size()) << text;
  for (size_t k = 0; k < o.size(); ++k) {
    EXPECT_LE(o[k].first, o[k].second);
    EXPECT_LE(o[k].second, text.size());
    EXPECT_EQ(utf8::find_invalid(text.substr(o[k].first, o[k].second - o[k].first)),
              std::string::npos)
        << "token " << k << " not character-aligned in " << text;
    if (k > 0) {
      EXPECT_GE(o[k].first, o[k - 1].first);
      EXPECT_LE(o[k].first, o[k - 1].second) << "gap before token " << k << " in " << text;
    }
  }
}

}  // namespace

TEST(Tokenizer, Qwen3CasesMatchHf) {
  const auto cases = qwen3_cases();
  ASSERT_EQ(cases.size(), 160u);
  int exact = 0;
  for (const auto& c : cases) {
    const auto ids = qwen3().encode(c.text);
    EXPECT_EQ(ids, c.ids) << "text: " << c.text;
    exact += ids == c.ids;
    EXPECT_EQ(qwen3().decode(c.ids), c.decoded) << "ids of: " << c.text;
  }
  EXPECT_EQ(exact, 160);
}

TEST(Tokenizer, RoundTripAndOffsets) {
  std::vector<std::string> texts;
  for (const auto& c : qwen3_cases()) texts.push_back(c.text);
  texts.push_back(std::string(1000, 'a'));
  texts.push_back(std::string(129, ' ') + "x" + std::string(17, '\n'));
  texts.push_back(
      "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9 family, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 <|im_end|><|im_end|>");
  for (const auto& t : texts) {
    std::vector<std::pair<size_t, size_t>> offs;
    const auto ids = qwen3().encode(t, &offs);
    ASSERT_EQ(ids.size(), offs.size());
    // decode(encode(s)) == NFC(s) (the normalizer is NFC); == s for the NFC texts.
    utf8proc_uint8_t* nfc = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(t.c_str()));
    ASSERT_NE(nfc, nullptr);
    const std::string want(reinterpret_cast<const char*>(nfc));
    std::free(nfc);
    EXPECT_EQ(qwen3().decode(ids), want);
    expect_offsets_cover(t, offs);
  }
}

TEST(Tokenizer, NormalizesNfcWithOffsetsOnOriginal) {
  // "e" + U+0301 composes to U+00E9 under NFC; both spellings give the same ids.
  const std::string decomposed = "caf\x65\xCC\x81 ok", composed = "caf\xC3\xA9 ok";
  std::vector<std::pair<size_t, size_t>> offs;
  const auto ids = qwen3().encode(decomposed, &offs);
  EXPECT_EQ(ids, qwen3().encode(composed));
  expect_offsets_cover(decomposed, offs);
  EXPECT_EQ(qwen3().decode(ids), composed);
}

TEST(Tokenizer, SpecialTokens) {
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.token_to_id("<|endoftext|>"), 151643);
  EXPECT_TRUE(t.is_special(151644));
  EXPECT_FALSE(t.is_special(9707));
  EXPECT_EQ(t.id_to_token(9707), "Hello");
  EXPECT_EQ(t.id_to_token(220), "\xC4\xA0");  // "Ġ", the byte-level space
  EXPECT_FALSE(t.token_to_id("no-such-token-xyz").has_value());
  EXPECT_GE(t.vocab_size(), 151669);
  const auto ids = t.encode("<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_EQ(t.decode(ids, /*skip_special=*/true), "user\nhi");
  EXPECT_THROW(t.decode({-1}), Error);
  EXPECT_THROW(t.decode({t.vocab_size()}), Error);
  EXPECT_THROW(t.id_to_token(t.vocab_size() + 5), Error);
}

TEST(Tokenizer, InvalidUtf8) {
  const Tokenizer& t = qwen3();
  // "ab" then a truncated 3-byte sequence (E2 82) then "c", then a lone continuation byte.
  const std::string bad = std::string("ab\xE2\x82") + "c\x80";
  try {
    t.encode(bad);
    FAIL() << "no error on invalid UTF-8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("byte offset 2"), std::string::npos) << e.what();
  }
  std::vector<std::pair<size_t, size_t>> offs;
  const auto ids = t.encode(bad, &offs, InvalidUtf8::replace);
  // The maximal invalid subpart E2 82 becomes one U+FFFD, the lone 80 another.
  EXPECT_EQ(t.decode(ids),
            "ab\xEF\xBF\xBD"
            "c\xEF\xBF\xBD");
  EXPECT_EQ(ids, t.encode("ab\xEF\xBF\xBD"
                          "c\xEF\xBF\xBD"));
  ASSERT_FALSE(offs.empty());
  EXPECT_EQ(offs.front().first, 0u);
  EXPECT_EQ(offs.back().second, bad.size());
  // Overlong encoding and surrogates are invalid too.
  EXPECT_THROW(t.encode("\xC0\xAF"), Error);
  EXPECT_THROW(t.encode("\xED\xA0\x80"), Error);
  // decode of ids that split a character yields U+FFFD.
  const auto e_ids = t.encode("\xF0\x9D\x94\x98");  // U+1D518, rare: several byte tokens
  ASSERT_GT(e_ids.size(), 1u);
  EXPECT_EQ(t.decode({e_ids[0]}), "\xEF\xBF\xBD");
}

TEST(Tokenizer, ThreadsGiveIdenticalResults) {
  const auto cases = qwen3_cases();
  std::vector<std::vector<int32_t>> want;
  for (const auto& c : cases) want.push_back(qwen3().encode(c.text));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> th;
  for (int w = 0; w < 4; ++w) {
    th.emplace_back([&, w] {
      for (int rep = 0; rep < 3; ++rep)
        for (size_t i = 0; i < cases.size(); ++i)
          bad[static_cast<size_t>(w)] += qwen3().encode(cases[i].text) != want[i];
    });
  }
  for (auto& t : th) t.join();
  for (int b : bad) EXPECT_EQ(b, 0);
}

// ------------------------------------------------------------ hand-written tokenizer.json

namespace {

/// A byte-level BPE with the 256 byte tokens, merges "h e" -> "he", "he l" -> "hel",
/// "Ġ w" -> "Ġw", and added tokens exercising every flag. Ids: bytes 0..255 in alphabet order,
/// then merges' results (256..258), then the added tokens (259..262, as HF assigns them).
std::string tiny_tokenizer_json(bool normalized_mask = false) {
  // GPT-2 bytes_to_unicode.
  std::vector<std::string> byte_str(256);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    std::string s;
    utf8::append(s, printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++));
    byte_str[static_cast<size_t>(b)] = s;
  }
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_str[static_cast<size_t>(b)]] = b;
  vocab["he"] = 256;
  vocab["hel"] = 257;
  vocab["\xC4\xA0w"] = 258;  // "Ġw"
  json j;
  j["version"] = "1.0";
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", false},
                        {"trim_offsets", false},
                        {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"},
                {"vocab", vocab},
                {"merges", json::array({json::array({"h", "e"}), json::array({"he", "l"}),
                                        json::array({"\xC4\xA0", "w"})})}};
  auto added = [](int id, const char* c, bool sw, bool l, bool r, bool norm, bool special) {
    return json{{"id", id},    {"content", c},       {"single_word", sw}, {"lstrip", l},
                {"rstrip", r}, {"normalized", norm}, {"special", special}};
  };
  j["added_tokens"] = json::array({
      added(259, "[CLS]", false, false, false, false, true),
      added(260, "<mask>", false, true, true, normalized_mask, false),
      added(261, "ony", true, false, false, false, false),
      added(262, "[CLS]x", false, false, false, false, true),
  });
  return j.dump();
}

}  // namespace

TEST(Tokenizer, AddedTokenFlags) {
  test::TempDir dir;
  test::write_file(dir / "tokenizer.json", tiny_tokenizer_json());
  const Tokenizer t = Tokenizer::load(dir / "tokenizer.json");
  std::vector<std::pair<size_t, size_t>> offs;
  // lstrip/rstrip: "<mask>" swallows the whitespace around it (HF find_matches).
  //   "a  <mask>\t b" -> "a" | "  <mask>\t " | "b"
  auto ids = t.encode("a  <mask>\t b", &offs);
  EXPECT_EQ(ids, (std::vector<int32_t>{'a', 260, 'b'}));
  EXPECT_EQ(offs, (std::vector<std::pair<size_t, size_t>>{{0, 1}, {1, 11}, {11, 12}}));
  // single_word: "ony" only matches between non-word characters.
  EXPECT_EQ(t.encode("ony"), (std::vector<int32_t>{261}));
  EXPECT_EQ(t.encode("(ony)"), (std::vector<int32_t>{'(', 261, ')'}));
  const auto anthony = t.encode("Anthony");
  EXPECT_EQ(std::count(anthony.begin(), anthony.end(), 261), 0);
  EXPECT_EQ(t.decode(anthony), "Anthony");
  // Longest match first: "[CLS]x" beats "[CLS]".
  EXPECT_EQ(t.encode("[CLS]x[CLS]"), (std::vector<int32_t>{262, 259}));
  // BPE merges by rank and the GPT-2 split regex (ByteLevel use_regex): "hello world".
  ids = t.encode("hello world", &offs);
  EXPECT_EQ(ids, (std::vector<int32_t>{257, 'l', 'o', 258, 'o', 'r', 'l', 'd'}));
  EXPECT_EQ(offs.front(), (std::pair<size_t, size_t>{0, 3}));
  EXPECT_EQ(offs[3], (std::pair<size_t, size_t>{5, 7}));
  EXPECT_EQ(t.decode(ids), "hello world");
  // Special flags and decode.
  EXPECT_TRUE(t.is_special(259));
  EXPECT_FALSE(t.is_special(260));
  EXPECT_EQ(t.decode({259, 'a', 260}, true), "a<mask>");
  // Ids in the file that disagree with HF's assignment (next free id after the vocabulary, or
  // the vocabulary's own id for a known content) are overridden as HF does.
  json j = json::parse(tiny_tokenizer_json());
  j["added_tokens"][0]["id"] = 500;
  j["added_tokens"].push_back({{"id", 7}, {"content", "he"}, {"special", true}});
  test::write_file(dir / "tokenizer.json", j.dump());
  const Tokenizer t2 = Tokenizer::load(dir / "tokenizer.json");
  EXPECT_EQ(t2.token_to_id("[CLS]"), 259);
  EXPECT_EQ(t2.encode("[CLS]he"), (std::vector<int32_t>{259, 256}));
  EXPECT_TRUE(t2.is_special(256));
}

TEST(Tokenizer, RejectsUnsupported) {
  test::TempDir dir;
  json j = json::parse(tiny_tokenizer_json());
  j["model"]["type"] = "WordPiece";
  test::write_file(dir / "tokenizer.json", j.dump());
  try {
    Tokenizer::load(dir.path());
    FAIL() << "WordPiece accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.type"), std::string::npos) << e.what();
  }
  j = json::parse(tiny_tokenizer_json());
  j["normalizer"] = {{"type", "Lowercase"}};
  test::write_file(dir / "tokenizer.json", j.dump());
  EXPECT_THROW(Tokenizer::load(dir.path()), Error);
  j = json::parse(tiny_tokenizer_json());
  j["model"]["merges"].push_back(json::array({"zz", "q"}));
  test::write_file(dir / "tokenizer.json", j.dump());
  EXPECT_THROW(Tokenizer::load(dir.path()), Error);
  EXPECT_THROW(Tokenizer::load(dir / "missing.json"), Error);
}

TEST(Tokenizer, TokenIdsMustBeIntegersBelowTheBound) {
  // Tables are sized by the largest id: an id of 2^30 (or a float, or one that does not fit an
  // int32) would have allocated gigabytes or been truncated.
  test::TempDir dir;
  for (const json& bad :
       {json(int64_t{1} << 30), json(1e300), json(int64_t{1} << 40), json(-3), json(5.5)}) {
    json j = json::parse(tiny_tokenizer_json());
    j["model"]["vocab"]["zz"] = bad;
    test::write_file(dir / "tokenizer.json", j.dump());
    try {
      Tokenizer::load(dir.path());
      ADD_FAILURE() << "id " << bad.dump() << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("model.vocab['zz'] must be a token id in [0, 16777216)"),
                std::string::npos)
          << e.what();
    }
  }
  json j = json::parse(tiny_tokenizer_json());
  j["added_tokens"][0]["id"] = "7";
  test::write_file(dir / "tokenizer.json", j.dump());
  EXPECT_THROW(Tokenizer::load(dir.path()), Error);
}

TEST(Tokenizer, TinyModelTokenizerLoads) {
  const Tokenizer t = Tokenizer::load(test::assets_dir() / "tiny-qwen3");
  EXPECT_EQ(t.vocab_size(), 8000);
  EXPECT_EQ(t.token_to_id("<|im_start|>"), 1);
  const std::string s = "<|im_start|>user\nWhat is 87 + 47?<|im_end|>\n";
  EXPECT_EQ(t.decode(t.encode(s)), s);
}

TEST(TokenizeCli, EncodeDecodeAndErrors) {
  const std::string model = (test::assets_dir() / "tiny-qwen3").string();
  auto r =
      test::run_dflash({"tokenize", "--model", model, "--verbose"}, "hello world\n<|im_end|>\n");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream out(r.out);
  std::string l1, l2;
  std::getline(out, l1);
  std::getline(out, l2);
  const json j1 = json::parse(l1), j2 = json::parse(l2);
  const Tokenizer t = Tokenizer::load(model);
  EXPECT_EQ(j1["ids"].get<std::vector<int32_t>>(), t.encode("hello world"));
  EXPECT_EQ(j1["tokens"].size(), j1["ids"].size());
  EXPECT_EQ(j2["ids"], json::array({2}));
  // --decode, plain ids.
  r = test::run_dflash({"tokenize", "--model", model, "--decode"}, j1["ids"].dump() + "\n");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["text"], "hello world");
  // --jsonl with record ids; an invalid UTF-8 line names the line.
  r = test::run_dflash(
      {"tokenize", "--model", model, "--jsonl"},
      "{\"id\": \"r1\", \"text\": \"hi\"}\n{\"id\": \"r2\", \"text\": \"\xFF\"}\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("UTF-8"), std::string::npos) << r.err;
  r = test::run_dflash({"tokenize", "--model", model}, "ok\nbad \xC3(\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("byte offset 4"), std::string::npos) << r.err;
  r = test::run_dflash({"tokenize", "--model", model, "--replace-invalid"}, "bad \xC3(\n");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["ids"].get<std::vector<int32_t>>(), t.encode("bad \xEF\xBF\xBD("));
}
