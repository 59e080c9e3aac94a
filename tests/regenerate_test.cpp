// Tests of `dflash regenerate` (src/infer/regenerate.hpp, src/cli/cmd_regenerate.cpp) on the tiny
// fixture: the answers are the target's greedy continuations of the rendered conversation (checked
// turn by turn against greedy_generate), speculative decoding writes the same file, the output does
// not depend on the batch size or the window, a sampled run is reproduced by its seed, a resumed
// run after a truncated file writes the same bytes as an uninterrupted one, bad input records stop
// the run (naming file:line) or are skipped and counted, a bad output line is refused; the prompt
// bound of a planned decoder covers every prompt a run builds, a prompt over the bound stops the
// run (naming file:line) or skips its record (the others' bytes unchanged); `--backend cuda`
// without a GPU and `--max-context` on the cpu backend are clear errors.
#include "infer/regenerate.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "data/conversation.hpp"
#include "data/jsonl.hpp"
#include "infer/decoder_cpu.hpp"
#include "model/drafter_io.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

const fs::path& tiny_dir() {
  static const fs::path p = test::assets_dir() / "tiny-qwen3";
  return p;
}

const TargetModel& tiny() {
  static const TargetModel m = TargetModel::load(tiny_dir());
  return m;
}

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load(tiny_dir());
  return t;
}

const ChatTemplate& tmpl() {
  static const ChatTemplate t = resolve_chat_template(tiny_dir(), "");
  return t;
}

const LoadedDrafter& random_drafter() {
  static const TempDir dir;
  static const LoadedDrafter d = [] {
    DrafterSizes sizes;
    sizes.block_size = 4;
    sizes.intermediate_size = 256;
    test::save_random_drafter(dir / "drafter", tiny().config(), 1, sizes, 5);
    return drafter_load(dir / "drafter");
  }();
  return d;
}

// Input: the corpus's first 4 records, a two-turn record with a system message, a ShareGPT record
// ending with a user turn (an answer is added), and 2 more corpus records.
std::string input_text() {
  std::vector<std::string> corpus;
  LineReader r(test::shared_dir() / "data" / "train.jsonl.xz");
  std::string line;
  while (corpus.size() < 6 && r.next(line)) corpus.push_back(line);
  std::string s;
  for (int i = 0; i < 4; ++i) s += corpus[static_cast<size_t>(i)] + "\n";
  s += R"({"id": "multi-1", "source": "hand", "extra": [1, 2], "messages": [)"
       R"({"role": "system", "content": "You answer briefly."}, )"
       R"({"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "x"}, )"
       R"({"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "y"}]})"
       "\n";
  s += R"({"id": 77, "conversations": [{"from": "human", "value": "Define the word cat."}]})"
       "\n";
  s += corpus[4] + "\n" + corpus[5] + "\n";
  return s;
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t e = s.find('\n', pos);
    out.push_back(s.substr(pos, e - pos));
    pos = e == std::string::npos ? s.size() : e + 1;
  }
  return out;
}

// Tokens per answer: fewer in Debug and sanitizer builds (CPU time).
#ifdef NDEBUG
constexpr int64_t kMaxNew = 24;
#else
constexpr int64_t kMaxNew = 8;
#endif

RegenerateOptions options(double temperature, int batch_size, bool speculative) {
  RegenerateOptions o;
  o.decode.max_new_tokens = kMaxNew;
  o.decode.stop_ids = generation_eos_ids(tiny_dir(), tiny().config());
  o.decode.sampling.temperature = temperature;
  o.decode.seed = 99;
  o.batch_size = batch_size;
  o.speculative = speculative;
  return o;
}

RegenerateStats run(const fs::path& in, const fs::path& out, const RegenerateOptions& o) {
  DecoderCpu dec(tiny(), o.speculative ? &random_drafter() : nullptr);
  return regenerate(dec, tok(), tmpl(), in, out, o);
}

// The target's greedy answer to `conv` (ending with a user turn), as regenerate must write it.
std::string greedy_answer(const Conversation& conv, int64_t max_new) {
  const auto ids = tok().encode(render_chat(tmpl(), conv, true).text);
  const auto stops = generation_eos_ids(tiny_dir(), tiny().config());
  auto out = greedy_generate(tiny(), ids, max_new, stops, true);
  if (!out.empty() && std::find(stops.begin(), stops.end(), out.back()) != stops.end())
    out.pop_back();
  return tok().decode(out);
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

TEST(Regenerate, GreedyAnswersAreTheTargetsTurnByTurn) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text());
  const RegenerateStats st = run(dir / "in.jsonl", dir / "out.jsonl", options(0, 3, false));
  EXPECT_EQ(st.input_records, 8);
  EXPECT_EQ(st.written, 8);
  EXPECT_EQ(st.already_done, 0);
  EXPECT_GT(st.new_tokens, 0);
  const auto in = lines_of(input_text());
  const auto out = lines_of(test::read_file(dir / "out.jsonl"));
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const Conversation a = parse_conversation(in[i], "in", 1, {.allow_trailing_user = true});
    const Conversation b = parse_conversation(out[i], "out", 1);
    EXPECT_EQ(b.id, a.id);
    EXPECT_EQ(b.source, a.source);
    // User and system turns kept; each assistant turn is the target's answer to what precedes.
    Conversation so_far;
    size_t k = 0;
    for (const Message& m : b.messages) {
      if (m.role == Role::assistant) {
        EXPECT_EQ(m.content, greedy_answer(so_far, kMaxNew)) << "record " << i << " message " << k;
      } else {
        ASSERT_LT(k, a.messages.size());
        EXPECT_EQ(m.role, a.messages[k].role);
        EXPECT_EQ(m.content, a.messages[k].content);
      }
      so_far.messages.push_back(m);
      ++k;
    }
    EXPECT_EQ(b.messages.size(), a.messages.size() + (i == 5 ? 1 : 0)) << i;
  }
  // The record's other fields and its message form are kept (key order too).
  const auto multi = nlohmann::ordered_json::parse(out[4]);
  EXPECT_EQ(multi["extra"], nlohmann::json({1, 2}));
  EXPECT_EQ(out[4].rfind(R"({"id":"multi-1","source":"hand","extra":[1,2],"messages":)", 0), 0u)
      << out[4];
  const auto added = nlohmann::json::parse(out[5]);
  EXPECT_EQ(added["id"], 77);
  EXPECT_EQ(added["conversations"][1]["from"], "gpt");
}

TEST(Regenerate, SameOutputForAnyBatchWindowOrDecoder) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text());
  run(dir / "in.jsonl", dir / "a.jsonl", options(0, 1, false));
  RegenerateOptions o = options(0, 4, true);  // speculative, batch 4, windows of 3 records
  o.window = 3;
  run(dir / "in.jsonl", dir / "b.jsonl", o);
  EXPECT_EQ(test::read_file(dir / "a.jsonl"), test::read_file(dir / "b.jsonl"));
  // Sampling: same seed, another batch size and window → the same bytes; another seed differs.
  o = options(1.0, 1, true);
  run(dir / "in.jsonl", dir / "s1.jsonl", o);
  o.batch_size = 3;
  o.window = 2;
  run(dir / "in.jsonl", dir / "s2.jsonl", o);
  EXPECT_EQ(test::read_file(dir / "s1.jsonl"), test::read_file(dir / "s2.jsonl"));
  o.decode.seed = 100;
  run(dir / "in.jsonl", dir / "s3.jsonl", o);
  EXPECT_NE(test::read_file(dir / "s1.jsonl"), test::read_file(dir / "s3.jsonl"));
}

TEST(Regenerate, ResumeAfterATruncatedFileWritesTheSameBytes) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text());
  const RegenerateOptions o = options(1.0, 2, false);
  run(dir / "in.jsonl", dir / "full.jsonl", o);
  const std::string full = test::read_file(dir / "full.jsonl");
  const auto lines = lines_of(full);
  ASSERT_EQ(lines.size(), 8u);
  // A crash after 3 records and half of the 4th (the multi-turn record comes later).
  std::string cut;
  for (int i = 0; i < 3; ++i) cut += lines[static_cast<size_t>(i)] + "\n";
  cut += lines[3].substr(0, lines[3].size() / 2);
  write_text(dir / "part.jsonl", cut);
  const RegenerateStats st = run(dir / "in.jsonl", dir / "part.jsonl", o);
  EXPECT_TRUE(st.repaired_tail);
  EXPECT_EQ(st.already_done, 3);
  EXPECT_EQ(st.written, 5);
  EXPECT_EQ(test::read_file(dir / "part.jsonl"), full);
  // A finished file: nothing to do, nothing changed.
  const RegenerateStats again = run(dir / "in.jsonl", dir / "part.jsonl", o);
  EXPECT_EQ(again.already_done, 8);
  EXPECT_EQ(again.written, 0);
  EXPECT_FALSE(again.repaired_tail);
  EXPECT_EQ(test::read_file(dir / "part.jsonl"), full);
  // A complete line that is no record is refused, naming the file and line.
  write_text(dir / "bad.jsonl", lines[0] + "\n{\"id\": 1}\n");
  const std::string e = error_of([&] { run(dir / "in.jsonl", dir / "bad.jsonl", o); });
  EXPECT_NE(e.find((dir / "bad.jsonl").string() + ":2"), std::string::npos) << e;
  EXPECT_EQ(test::read_file(dir / "bad.jsonl"), lines[0] + "\n{\"id\": 1}\n");
}

TEST(Regenerate, BadRecordsStopTheRunOrAreSkipped) {
  TempDir dir;
  auto in = lines_of(input_text());
  in[2] = R"({"id": "broken", "conversations": [{"role": "assistant", "content": "hi"}]})";
  in.push_back(in[0]);  // a repeated id, line 9
  std::string text;
  for (const auto& l : in) text += l + "\n";
  write_text(dir / "in.jsonl", text);
  const RegenerateOptions o = options(0, 2, false);
  std::string e = error_of([&] { run(dir / "in.jsonl", dir / "out.jsonl", o); });
  EXPECT_NE(e.find((dir / "in.jsonl").string() + ":3"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "out.jsonl"));  // checked before anything is decoded
  RegenerateOptions skip = o;
  skip.skip_invalid = true;
  const RegenerateStats st = run(dir / "in.jsonl", dir / "out.jsonl", skip);
  EXPECT_EQ(st.input_records, 9);
  EXPECT_EQ(st.invalid, 2);
  EXPECT_EQ(st.written, 7);
  EXPECT_EQ(lines_of(test::read_file(dir / "out.jsonl")).size(), 7u);
  // The repeated id alone: named with both lines.
  in[2] = lines_of(input_text())[2];
  text.clear();
  for (const auto& l : in) text += l + "\n";
  write_text(dir / "in2.jsonl", text);
  e = error_of([&] { run(dir / "in2.jsonl", dir / "out2.jsonl", o); });
  EXPECT_NE(e.find((dir / "in2.jsonl").string() + ":9: id: '"), std::string::npos) << e;
  EXPECT_NE(e.find("on line 1 too"), std::string::npos) << e;
  // A missing input, and an output that is the input.
  e = error_of([&] { run(dir / "none.jsonl", dir / "out3.jsonl", o); });
  EXPECT_NE(e.find("none.jsonl: no such file"), std::string::npos) << e;
  e = error_of([&] { run(dir / "in2.jsonl", dir / "in2.jsonl", o); });
  EXPECT_NE(e.find("is the input file"), std::string::npos) << e;
}

// The token count of every prompt a regeneration of `out_text` (regenerate's output) built: per
// record line (1-based, input order: every record written) the prompt of each user turn, rendered
// with the answers written.
std::vector<std::vector<int64_t>> prompt_sizes(const std::string& out_text) {
  std::vector<std::vector<int64_t>> sizes;
  for (const std::string& line : lines_of(out_text)) {
    const Conversation c = parse_conversation(line, "out", 1);
    Conversation prefix;
    sizes.emplace_back();
    for (const Message& m : c.messages) {
      prefix.messages.push_back(m);
      if (m.role != Role::user) continue;
      const auto n =
          static_cast<int64_t>(tok().encode(render_chat(tmpl(), prefix, true).text).size());
      sizes.back().push_back(n);
    }
  }
  return sizes;
}

TEST(Regenerate, PromptBoundCoversEveryPromptOfARun) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text());
  const int64_t bound = regenerate_prompt_bound(tok(), tmpl(), dir / "in.jsonl", kMaxNew);
  for (const bool speculative : {false, true}) {
    run(dir / "in.jsonl", dir / "out.jsonl", options(0, 2, speculative));
    for (const auto& rec : prompt_sizes(test::read_file(dir / "out.jsonl")))
      for (const int64_t n : rec) EXPECT_LE(n, bound);
    fs::remove(dir / "out.jsonl");
  }
  // The formula on the two-turn record alone: its last prompt rendered with an empty first
  // answer, plus one answer's budget.
  const std::string multi = lines_of(input_text())[4];
  write_text(dir / "multi.jsonl", multi + "\n");
  Conversation c = parse_conversation(multi, "multi", 1);
  c.messages.pop_back();
  c.messages[2].content.clear();
  const auto empty = static_cast<int64_t>(tok().encode(render_chat(tmpl(), c, true).text).size());
  EXPECT_EQ(regenerate_prompt_bound(tok(), tmpl(), dir / "multi.jsonl", kMaxNew),
            empty + kMaxNew + kMaxNew / 4 + kRegenerateTurnSlack);
  EXPECT_NE(error_of([&] {
              regenerate_prompt_bound(tok(), tmpl(), dir / "none.jsonl", 8);
            }).find("none.jsonl: no such file"),
            std::string::npos);
}

TEST(Regenerate, PromptOverTheBoundStopsTheRunOrSkipsTheRecord) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text());
  const RegenerateOptions unbounded = options(0.7, 3, false);
  run(dir / "in.jsonl", dir / "free.jsonl", unbounded);
  const std::string all = test::read_file(dir / "free.jsonl");
  const std::vector<std::string> all_lines = lines_of(all);
  // The bound: one token less than the longest prompt; the records that built a longer one fail.
  const auto sizes = prompt_sizes(all);
  int64_t longest = 0;
  for (const auto& rec : sizes)
    longest = std::max(longest, *std::max_element(rec.begin(), rec.end()));
  RegenerateOptions bounded = unbounded;
  bounded.max_prompt_tokens = longest - 1;
  std::vector<size_t> over;
  std::string kept;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (*std::max_element(sizes[i].begin(), sizes[i].end()) > bounded.max_prompt_tokens)
      over.push_back(i);
    else
      kept += all_lines[i] + "\n";
  }
  ASSERT_EQ(all_lines.size(), 8u);  // every record written: line i of OUT is line i + 1 of IN
  ASSERT_FALSE(over.empty());
  const std::string e = error_of([&] { run(dir / "in.jsonl", dir / "stop.jsonl", bounded); });
  bool named = false;
  for (size_t i : over)
    named |= e.find(fmt::format("{}:{}: record ", (dir / "in.jsonl").string(), i + 1)) !=
             std::string::npos;
  EXPECT_TRUE(named) << e;
  EXPECT_NE(e.find(fmt::format("over the {} the decoder was planned for", longest - 1)),
            std::string::npos)
      << e;
  bounded.skip_invalid = true;
  const RegenerateStats st = run(dir / "in.jsonl", dir / "skip.jsonl", bounded);
  EXPECT_EQ(st.invalid, static_cast<int64_t>(over.size()));
  EXPECT_EQ(st.written, static_cast<int64_t>(8 - over.size()));
  EXPECT_EQ(test::read_file(dir / "skip.jsonl"), kept);  // the others' bytes, none cut
}

TEST(Regenerate, CliBackendErrors) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text());
  const std::vector<std::string> base = {"regenerate",
                                         "--target",
                                         tiny_dir().string(),
                                         "--data",
                                         (dir / "in.jsonl").string(),
                                         "--out",
                                         (dir / "o.jsonl").string()};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return test::run_dflash(args);
  };
  auto r = with({"--max-context", "512"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--max-context plans the cuda backend's memory"), std::string::npos)
      << r.err;
  if (!test::gpu_visible()) {
    r = with({"--backend", "cuda"});
    EXPECT_EQ(r.exit_code, 1);
#ifdef DFLASH_HAVE_CUDA
    EXPECT_NE(r.err.find("--backend cuda: no CUDA device is visible"), std::string::npos) << r.err;
#else
    EXPECT_NE(r.err.find("--backend cuda: this dflash was built without CUDA"), std::string::npos)
        << r.err;
#endif
    EXPECT_EQ(r.err.find("regenerate: cuda plan"), std::string::npos) << r.err;  // before anything
  }
  r = with({"--backend", "tpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(fs::exists(dir / "o.jsonl"));
}

TEST(Regenerate, Cli) {
  TempDir dir;
  write_text(dir / "in.jsonl", input_text() + "not json\n");
  const std::string t = tiny_dir().string(), in = (dir / "in.jsonl").string();
  auto r = test::run_dflash({"regenerate", "--target", t, "--data", in, "--out",
                             (dir / "o.jsonl").string(), "--max-new-tokens", "8"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(in + ":9"), std::string::npos) << r.err;
  r = test::run_dflash({"regenerate", "--target", t, "--data", in, "--out",
                        (dir / "o.jsonl").string(), "--max-new-tokens", "8", "--skip-invalid",
                        "--batch-size", "3", "--temperature", "0.7", "--seed", "5"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* key :
       {"input records: 9\n", "invalid skipped: 1\n", "written: 8\n", "records/s: ", "tokens/s: "})
    EXPECT_NE(r.out.find(key), std::string::npos) << key << "\n" << r.out;
  EXPECT_NE(r.err.find("regenerate"), std::string::npos) << r.err;  // progress on stderr
  r = test::run_dflash({"regenerate", "--target", t, "--data", in, "--out",
                        (dir / "p.jsonl").string(), "--thinking", "on"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--thinking on: the chatml template"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace dflash
