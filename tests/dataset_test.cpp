// Tests of src/data/dataset: loss masks from spans, the token cache (reuse and every rebuild
// trigger, truncation, zero-supervised documents, bad records) with a byte-level stand-in
// tokenizer (special tokens whole, every other byte one token), so each figure is checkable by
// hand.
#include "data/dataset.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "data/chat_template.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using dflash::test::TempDir;

namespace {

const char* const kSpecials[] = {"<|im_start|>", "<|im_end|>", "<think>", "</think>"};

// Special tokens get ids 0, 1 (ChatML) and 258, 259 (qwen3's think markers); any other byte b
// gets 2 + b.
std::vector<int32_t> byte_encode(std::string_view text,
                                 std::vector<std::pair<size_t, size_t>>* off) {
  std::vector<int32_t> ids;
  off->clear();
  size_t i = 0;
  while (i < text.size()) {
    bool special = false;
    for (int s = 0; s < 4; ++s) {
      std::string_view sp = kSpecials[s];
      if (text.substr(i, sp.size()) == sp) {
        ids.push_back(s < 2 ? s : 256 + s);
        off->emplace_back(i, i + sp.size());
        i += sp.size();
        special = true;
        break;
      }
    }
    if (special) continue;
    ids.push_back(2 + static_cast<unsigned char>(text[i]));
    off->emplace_back(i, i + 1);
    ++i;
  }
  return ids;
}

std::string record(const std::string& id, const std::string& q, const std::string& a) {
  return nlohmann::json{
      {"id", id},
      {"conversations",
       {{{"role", "user"}, {"content", q}}, {{"role", "assistant"}, {"content", a}}}}}
      .dump();
}

PrepareOptions options(const TempDir& tmp, const std::string& data_name = "d.jsonl") {
  PrepareOptions o;
  o.data = tmp / data_name;
  o.cache = tmp / "cache/d.tok";
  o.chat_template = ChatTemplate::from_name("chatml");
  o.max_length = 1000;
  o.encode = byte_encode;
  o.tokenizer_hash = 1234;
  o.threads = 3;
  return o;
}

// Tokens of the chatml rendering of (q, a) with byte_encode: "<|im_start|>user\n" = 1 + 5,
// q, "<|im_end|>\n<|im_start|>assistant\n" = 1 + 1 + 1 + 10, a, "<|im_end|>\n" = 2.
int64_t doc_len(const std::string& q, const std::string& a) {
  return 6 + static_cast<int64_t>(q.size()) + 13 + static_cast<int64_t>(a.size()) + 2;
}

}  // namespace

TEST(LossMask, TokenIsSupervisedIffInsideASpan) {
  std::vector<ByteSpan> spans = {{5, 10}, {20, 22}};
  std::vector<std::pair<size_t, size_t>> off = {
      {0, 5},    // before
      {4, 6},    // straddles the start
      {5, 7},    // inside
      {7, 10},   // inside, ends at the end
      {9, 11},   // straddles the end
      {10, 20},  // between
      {20, 22},  // exactly the second span
      {21, 21},  // empty range inside
      {22, 22},  // empty range at the end (outside)
      {22, 30},  // after
  };
  std::vector<uint8_t> want = {0, 0, 1, 1, 0, 0, 1, 1, 0, 0};
  EXPECT_EQ(loss_mask_from_spans(off, spans), want);
  EXPECT_EQ(loss_mask_from_spans(off, {}), std::vector<uint8_t>(off.size(), 0));
}

TEST(LossMask, MultiTurnChatmlMaskWithByteTokens) {
  Conversation c;
  c.messages = {
      {Role::user, "Q1"}, {Role::assistant, "A1"}, {Role::user, "Q"}, {Role::assistant, "B"}};
  auto doc = tokenize_rendered(render_chat(ChatTemplate::from_name("chatml"), c), byte_encode);
  // Per turn: header 1+k+1 tokens ("<|im_start|>", role bytes, "\n"), content, <|im_end|>, "\n".
  std::vector<uint8_t> want;
  auto turn = [&](const std::string& role, const std::string& content, bool sup) {
    want.insert(want.end(), 2 + role.size(), 0);
    want.insert(want.end(), content.size() + 2, sup ? 1 : 0);
  };
  turn("user", "Q1", false);
  turn("assistant", "A1", true);
  turn("user", "Q", false);
  turn("assistant", "B", true);
  EXPECT_EQ(doc.loss_mask, want);
  EXPECT_EQ(doc.tokens.size(), want.size());
  EXPECT_EQ(doc.tokens.back(), 2 + '\n');
  EXPECT_EQ(doc.tokens[doc.tokens.size() - 2], 1);  // <|im_end|>, supervised
}

TEST(Dataset, PrepareCountsReuseAndMmap) {
  TempDir tmp;
  std::string data = record("a", "Q", "Answer") + "\n\n" + record("b", "Why?", "Because.") + "\n";
  test::write_file(tmp / "d.jsonl", data);
  auto opts = options(tmp);
  auto r1 = prepare_dataset(opts);
  EXPECT_FALSE(r1.reused);
  const auto& ds = r1.dataset;
  ASSERT_EQ(ds.num_docs(), 2);
  EXPECT_EQ(ds.doc_length(0), doc_len("Q", "Answer"));
  EXPECT_EQ(ds.doc_length(1), doc_len("Why?", "Because."));
  EXPECT_EQ(ds.num_tokens(), doc_len("Q", "Answer") + doc_len("Why?", "Because."));
  EXPECT_EQ(ds.doc_source_line(0), 1);
  EXPECT_EQ(ds.doc_source_line(1), 3);  // the blank line 2 is not a record
  const auto& st = ds.stats();
  EXPECT_EQ(st.records, 2);
  EXPECT_EQ(st.conversations, 2);
  EXPECT_EQ(st.supervised_tokens, (6 + 2) + (8 + 2));
  EXPECT_EQ(st.truncated, 0);
  EXPECT_EQ(st.skipped_invalid, 0);
  // The mask of doc 1 ends with the answer's 8 bytes + <|im_end|> + "\n".
  auto m = ds.doc_loss_mask(1);
  int64_t tail = 0;
  for (size_t i = m.size(); i-- > 0 && m[i];) ++tail;
  EXPECT_EQ(tail, 10);
  EXPECT_EQ(ds.doc_tokens(0)[0], 0);  // <|im_start|>

  // Second run: reused, same contents.
  auto r2 = prepare_dataset(opts);
  EXPECT_TRUE(r2.reused) << r2.reason;
  ASSERT_EQ(r2.dataset.num_docs(), 2);
  auto t1 = r1.dataset.doc_tokens(1), t2 = r2.dataset.doc_tokens(1);
  EXPECT_TRUE(std::equal(t1.begin(), t1.end(), t2.begin(), t2.end()));
  EXPECT_EQ(r2.dataset.stats().supervised_tokens, st.supervised_tokens);
  EXPECT_EQ(r2.dataset.fingerprint(), r1.dataset.fingerprint());
  EXPECT_FALSE(r2.dataset.stats().report().empty());
}

TEST(Dataset, RebuildsWhenDataTokenizerTemplateOrMaxLengthChange) {
  TempDir tmp;
  test::write_file(tmp / "d.jsonl", record("a", "Q", "Answer") + "\n");
  auto opts = options(tmp);
  auto base = prepare_dataset(opts);
  ASSERT_FALSE(base.reused);
  auto expect_rebuild = [&](const PrepareOptions& o, const std::string& why) {
    auto r = prepare_dataset(o);
    EXPECT_FALSE(r.reused) << why;
    EXPECT_NE(r.reason.find(why), std::string::npos) << r.reason;
    EXPECT_NE(r.dataset.fingerprint(), base.dataset.fingerprint()) << why;
    // And back: the original options rebuild again (the cache holds the last build only).
    auto back = prepare_dataset(opts);
    EXPECT_FALSE(back.reused);
    EXPECT_EQ(back.dataset.fingerprint(), base.dataset.fingerprint());
  };
  {
    auto o = opts;
    o.tokenizer_hash = 999;
    expect_rebuild(o, "tokenizer");
  }
  {
    auto o = opts;
    o.chat_template = ChatTemplate::from_name("qwen3");
    expect_rebuild(o, "template");
  }
  {
    auto o = opts;
    o.max_length = 999;
    expect_rebuild(o, "max length");
  }
  // Data contents (same path).
  test::write_file(tmp / "d.jsonl", record("a", "Q", "Answer!") + "\n");
  auto r = prepare_dataset(opts);
  EXPECT_FALSE(r.reused);
  EXPECT_NE(r.reason.find("data"), std::string::npos) << r.reason;
  EXPECT_EQ(r.dataset.doc_length(0), doc_len("Q", "Answer!"));
  EXPECT_TRUE(prepare_dataset(opts).reused);
  // force.
  auto f = opts;
  f.force = true;
  EXPECT_FALSE(prepare_dataset(f).reused);
}

TEST(Dataset, TemplateMarkersMustBeTokensOfTheTokenizer) {
  TempDir tmp;
  test::write_file(tmp / "d.jsonl", record("a", "Q", "Answer") + "\n");
  auto opts = options(tmp);
  opts.tokenizer_file = "tok/tokenizer.json";
  opts.chat_template = ChatTemplate::from_name("llama3");
  try {
    prepare_dataset(opts);
    ADD_FAILURE() << "llama3 markers accepted by a ChatML tokenizer";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("chat template 'llama3'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tok/tokenizer.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("<|begin_of_text|> (17 tokens)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("<|eot_id|> (10 tokens)"), std::string::npos) << msg;
  }
  EXPECT_FALSE(std::filesystem::exists(opts.cache));
  // Markers the stand-in tokenizer holds pass (chatml, qwen3).
  for (const char* name : {"chatml", "qwen3"}) {
    EXPECT_NO_THROW(check_template_tokens(ChatTemplate::from_name(name), byte_encode, "t")) << name;
  }
}

TEST(Dataset, CacheFileNameCoversEveryInputOfTheKey) {
  const auto chatml = ChatTemplate::from_name("chatml");
  const auto base = cache_path_in("c", "data/x.jsonl", "models/m", chatml, 512);
  EXPECT_EQ(base.parent_path(), std::filesystem::path("c"));
  EXPECT_EQ(base.filename().string().rfind("x.jsonl-", 0), 0u) << base;
  EXPECT_EQ(base.extension(), ".dftok");
  EXPECT_EQ(cache_path_in("c", "data/x.jsonl", "models/m", chatml, 512), base);  // stable
  EXPECT_NE(cache_path_in("c", "data/x.jsonl", "models/m", chatml, 256), base);
  EXPECT_NE(cache_path_in("c", "data/x.jsonl", "models/m", ChatTemplate::from_name("qwen3"), 512),
            base);
  EXPECT_NE(cache_path_in("c", "data/x.jsonl", "models/other", chatml, 512), base);
  EXPECT_NE(cache_path_in("c", "other/x.jsonl", "models/m", chatml, 512), base);
  // A run's cache: data.cache_dir, else <output_dir>/cache.
  EXPECT_EQ(run_cache_path("", "runs/r", "data/x.jsonl", "models/m", chatml, 512),
            cache_path_in("runs/r/cache", "data/x.jsonl", "models/m", chatml, 512));
  EXPECT_EQ(run_cache_path("shared", "runs/r", "data/x.jsonl", "models/m", chatml, 512),
            cache_path_in("shared", "data/x.jsonl", "models/m", chatml, 512));
}

TEST(Dataset, DamagedCacheIsRebuiltAndOpenRefusesIt) {
  TempDir tmp;
  test::write_file(tmp / "d.jsonl", record("a", "Q", "Answer") + "\n");
  auto opts = options(tmp);
  prepare_dataset(opts);
  std::string bytes = test::read_file(opts.cache);
  // Cut the sections off: the header still matches but the file is incomplete.
  test::write_file(opts.cache, bytes.substr(0, bytes.size() - 40));
  EXPECT_THROW(TokenDataset::open(opts.cache), Error);
  auto r = prepare_dataset(opts);
  EXPECT_FALSE(r.reused);
  EXPECT_NE(r.reason.find("damaged"), std::string::npos) << r.reason;
  test::write_file(opts.cache, "garbage");
  r = prepare_dataset(opts);
  EXPECT_FALSE(r.reused);
  EXPECT_EQ(r.dataset.num_docs(), 1);
}

// A cache file of `opts` with `edit` applied to its header (JSON) and data (the bytes after it).
std::string edited_cache(const PrepareOptions& opts,
                         const std::function<void(nlohmann::json&, std::string&)>& edit) {
  const std::string bytes = test::read_file(opts.cache);
  uint64_t json_len = 0;
  std::memcpy(&json_len, bytes.data() + 8, 8);
  nlohmann::json h = nlohmann::json::parse(bytes.substr(16, json_len));
  const size_t data_start = (16 + json_len + 63) / 64 * 64;
  std::string data = bytes.substr(data_start);
  edit(h, data);
  std::string js = h.dump();
  std::string out = bytes.substr(0, 8);
  const uint64_t n = js.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out += js;
  out.resize((out.size() + 63) / 64 * 64, '\0');
  return out + data;
}

std::string open_error(const std::filesystem::path& p) {
  try {
    TokenDataset::open(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Dataset, OpenRefusesOutOfRangeValuesAndOverflowingSections) {
  TempDir tmp;
  test::write_file(tmp / "d.jsonl", record("a", "Q", "Answer") + "\n");
  auto opts = options(tmp);
  prepare_dataset(opts);
  const std::filesystem::path bad = tmp / "bad.dftok";
  auto section = [](const nlohmann::json& h, const char* name) {
    return h["sections"][name]["offset"].get<size_t>();
  };
  // A loss mask of 7 would weight a slot 7 times (found by the token_cache fuzz harness).
  test::write_file(bad, edited_cache(opts, [&](nlohmann::json& h, std::string& d) {
                     d[section(h, "loss_mask") + 3] = 7;
                   }));
  EXPECT_NE(open_error(bad).find("token 3 has id"), std::string::npos) << open_error(bad);
  EXPECT_NE(open_error(bad).find("loss mask 7"), std::string::npos) << open_error(bad);
  test::write_file(bad, edited_cache(opts, [&](nlohmann::json& h, std::string& d) {
                     const int32_t neg = -5;
                     std::memcpy(&d[section(h, "tokens") + 8], &neg, 4);
                   }));
  EXPECT_NE(open_error(bad).find("token 2 has id -5"), std::string::npos) << open_error(bad);
  // Counts and offsets that would overflow the section bounds are refused, not wrapped.
  test::write_file(bad, edited_cache(opts, [](nlohmann::json& h, std::string&) {
                     h["n_tokens"] = int64_t{1} << 62;
                   }));
  EXPECT_NE(open_error(bad).find("n_tokens"), std::string::npos) << open_error(bad);
  test::write_file(bad, edited_cache(opts, [](nlohmann::json& h, std::string&) {
                     h["sections"]["tokens"]["offset"] = -64;
                   }));
  EXPECT_NE(open_error(bad).find("offset"), std::string::npos) << open_error(bad);
  test::write_file(bad, edited_cache(opts, [](nlohmann::json& h, std::string&) {
                     h["stats"]["hist_count"] = nlohmann::json::array();
                   }));
  EXPECT_NE(open_error(bad).find("histogram"), std::string::npos) << open_error(bad);
  test::write_file(bad, edited_cache(opts, [](nlohmann::json& h, std::string&) {
                     h["key"]["data_hash"] = "not-hex-at-all!!";
                   }));
  EXPECT_NE(open_error(bad).find("16 hex digits"), std::string::npos) << open_error(bad);
  test::write_file(bad, edited_cache(opts, [](nlohmann::json&, std::string&) {}));
  EXPECT_EQ(open_error(bad), "(no error)");
}

TEST(Dataset, TruncationIsCountedNeverDropped) {
  TempDir tmp;
  std::string longa(200, 'x');
  test::write_file(tmp / "d.jsonl", record("a", "Q", "A") + "\n" + record("b", "Q", longa) + "\n");
  auto opts = options(tmp);
  opts.max_length = 50;
  auto r = prepare_dataset(opts);
  ASSERT_EQ(r.dataset.num_docs(), 2);
  EXPECT_EQ(r.dataset.doc_length(0), doc_len("Q", "A"));
  EXPECT_EQ(r.dataset.doc_length(1), 50);
  const auto& st = r.dataset.stats();
  EXPECT_EQ(st.truncated, 1);
  EXPECT_EQ(st.truncated_tokens, doc_len("Q", longa) - 50);
  EXPECT_EQ(st.max_length, 50);
  // Doc 1 keeps 50 - (6 + 1 + 13) = 30 supervised bytes of the answer.
  EXPECT_EQ(st.supervised_tokens, 3 + 30);
  // Histogram: bins up to 16, 32, 50 (the max length caps the last bin).
  EXPECT_EQ(st.hist_upper, (std::vector<int64_t>{16, 32, 50}));
  EXPECT_EQ(st.hist_count, (std::vector<int64_t>{0, 1, 1}));
}

TEST(Dataset, ZeroSupervisedDocumentsAreCountedAndAnEmptyResultIsAnError) {
  TempDir tmp;
  std::string longq(100, 'q');
  // Doc b's answer lies entirely past max_length: no supervised token left.
  test::write_file(tmp / "d.jsonl", record("a", "Q", "A") + "\n" + record("b", longq, "A") + "\n");
  auto opts = options(tmp);
  opts.max_length = 60;
  auto r = prepare_dataset(opts);
  EXPECT_EQ(r.dataset.num_docs(), 1);
  EXPECT_EQ(r.dataset.stats().zero_supervised, 1);
  ASSERT_EQ(r.dataset.stats().zero_supervised_examples.size(), 1u);
  EXPECT_NE(r.dataset.stats().zero_supervised_examples[0].find("d.jsonl:2 (id b)"),
            std::string::npos);
  // Only such documents: nothing to train on.
  test::write_file(tmp / "d.jsonl", record("b", longq, "A") + "\n");
  try {
    prepare_dataset(opts);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing to train on"), std::string::npos) << e.what();
  }
  // The failed build left the previous cache alone (not one for the new data).
  auto key = read_cache_key(opts.cache);
  ASSERT_TRUE(key);
  EXPECT_NE(key->data_hash, hash_file(opts.data));
}

TEST(Dataset, BadRecordsStopTheRunUnlessSkipped) {
  TempDir tmp;
  std::string data = record("a", "Q", "A") + "\n" + "{not json\n" + record("c", "Q", "A") + "\n" +
                     R"({"id": "d", "messages": [{"role": "user", "content": "Q"}, )"
                     R"({"role": "robot", "content": "A"}]})"
                     "\n" +
                     R"({"id": "e", "messages": [{"role": "user", "content": "Q"}]})"
                     "\n";
  test::write_file(tmp / "d.jsonl", data);
  auto opts = options(tmp);
  opts.skip_invalid_hint = "set THE SWITCH";  // the caller's words for turning skipping on
  try {
    prepare_dataset(opts);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("d.jsonl:2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("; to skip and count bad records, set THE SWITCH"), std::string::npos)
        << msg;
  }
  opts.skip_invalid = true;
  auto r = prepare_dataset(opts);
  const auto& st = r.dataset.stats();
  EXPECT_EQ(st.records, 5);
  EXPECT_EQ(st.conversations, 2);
  EXPECT_EQ(st.skipped_invalid, 3);
  EXPECT_EQ(st.invalid_by_kind.at("invalid_json"), 1);
  EXPECT_EQ(st.invalid_by_kind.at("unknown_role"), 1);
  EXPECT_EQ(st.invalid_by_kind.at("wrong_alternation"), 1);
  ASSERT_EQ(st.invalid_examples.size(), 3u);
  EXPECT_NE(st.invalid_examples[1].find("d.jsonl:4"), std::string::npos);
  EXPECT_EQ(r.dataset.doc_source_line(1), 3);
}

TEST(Dataset, ParallelBuildEqualsSerialBuild) {
  TempDir tmp;
  std::string data;
  for (int i = 0; i < 20000; ++i) {
    std::string q = fmt::format("Q{}", i * 7919 % 1000);
    data += record(std::to_string(i), q, std::string(static_cast<size_t>(1 + i % 37), 'a'));
    data += '\n';
  }
  test::write_file(tmp / "d.jsonl", data);
  auto o1 = options(tmp);
  o1.threads = 1;
  auto o4 = options(tmp);
  o4.threads = 4;
  o4.cache = tmp / "cache/d4.tok";
  auto a = prepare_dataset(o1).dataset;
  auto b = prepare_dataset(o4).dataset;
  ASSERT_EQ(a.num_docs(), 20000);
  ASSERT_EQ(a.num_docs(), b.num_docs());
  EXPECT_EQ(test::read_file(o1.cache), test::read_file(o4.cache));
}
