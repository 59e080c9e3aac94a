// Tests of src/data/chat_template: byte-exact rendering of the built-in templates (expected strings
// derived by hand from the Jinja sources; the tiny model's against the HF golden prompts and the
// reference trainer's texts), supervised spans, and template detection.
#include "data/chat_template.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "data/conversation.hpp"
#include "data/jsonl.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {

Conversation conv(std::vector<std::pair<Role, std::string>> msgs) {
  Conversation c;
  c.id = "t";
  for (auto& [r, s] : msgs) c.messages.push_back({r, s});
  return c;
}

std::vector<std::string> supervised_texts(const RenderedChat& r) {
  std::vector<std::string> v;
  for (const auto& s : r.supervised) v.push_back(r.text.substr(s.begin, s.end - s.begin));
  return v;
}

const ChatTemplate kChatml = ChatTemplate::from_name("chatml");
const ChatTemplate kQwen3 = ChatTemplate::from_name("qwen3");
const ChatTemplate kQwen3Think = ChatTemplate::from_name("qwen3", true);
const ChatTemplate kLlama3 = ChatTemplate::from_name("llama3");

}  // namespace

// ------------------------------------------------------------------ chatml (tiny model)

TEST(ChatTemplate, ChatmlSingleTurn) {
  auto r = render_chat(kChatml, conv({{Role::user, "Hi"}, {Role::assistant, "Hello there"}}));
  EXPECT_EQ(r.text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there<|im_end|>\n");
  EXPECT_EQ(supervised_texts(r), (std::vector<std::string>{"Hello there<|im_end|>\n"}));
}

TEST(ChatTemplate, ChatmlMultiTurnWithSystemSupervisesEveryAssistantTurn) {
  auto r = render_chat(kChatml, conv({{Role::system, "Sys"},
                                      {Role::user, "Q1"},
                                      {Role::assistant, "A1"},
                                      {Role::user, "Q2"},
                                      {Role::assistant, "A2"}}));
  EXPECT_EQ(r.text,
            "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\nA2<|im_end|>\n");
  EXPECT_EQ(supervised_texts(r), (std::vector<std::string>{"A1<|im_end|>\n", "A2<|im_end|>\n"}));
  // Spans are sorted and disjoint.
  ASSERT_EQ(r.supervised.size(), 2u);
  EXPECT_LT(r.supervised[0].end, r.supervised[1].begin);
}

TEST(ChatTemplate, ChatmlGenerationPrompt) {
  auto r = render_chat(kChatml, conv({{Role::user, "Q"}}), true);
  EXPECT_EQ(r.text, "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_TRUE(r.supervised.empty());
}

// The 8 golden prompts of HF transformers (apply_chat_template with the tiny model's template),
// rebuilt from the eval records with the same ids.
TEST(ChatTemplate, TinyModelGoldenPromptsByteForByte) {
  auto shared = test::shared_dir();
  std::ifstream gf(shared / "fixtures/tiny-qwen3.golden.json");
  auto golden = nlohmann::json::parse(gf);
  std::map<std::string, std::string> want;
  for (const auto& p : golden.at("prompts")) want[p.at("id")] = p.at("prompt");
  ASSERT_EQ(want.size(), 8u);
  LineReader reader(shared / "data/eval_prompts.jsonl");
  std::string line;
  int checked = 0;
  while (reader.next(line)) {
    Conversation c = parse_conversation(line, "eval_prompts.jsonl", reader.line_number());
    auto it = want.find(c.id);
    if (it == want.end()) continue;
    ASSERT_EQ(c.messages.back().role, Role::assistant);
    c.messages.pop_back();  // the reference answer
    EXPECT_EQ(render_chat(kChatml, c, true).text, it->second) << c.id;
    ++checked;
  }
  EXPECT_EQ(checked, 8);
}

// The three training texts of the reference trainer's golden step are renderings of corpus
// conversations (held-out records of eval_prompts.jsonl): each must be the rendering of one.
TEST(ChatTemplate, ReferenceTrainerTextsAreRenderingsOfCorpusRecords) {
  auto shared = test::shared_dir();
  std::ifstream gf(shared / "fixtures/dflash-step.golden.json");
  auto golden = nlohmann::json::parse(gf);
  std::set<std::string> texts;
  for (const auto& t : golden.at("texts")) texts.insert(t.get<std::string>());
  ASSERT_EQ(texts.size(), 3u);
  std::set<std::string> found;
  for (const char* name : {"data/eval_prompts.jsonl", "data/train.jsonl.xz"}) {
    LineReader reader(shared / name);
    std::string line;
    while (reader.next(line) && found.size() < texts.size()) {
      Conversation c = parse_conversation(line, name, reader.line_number());
      std::string text = render_chat(kChatml, c).text;
      if (texts.count(text)) found.insert(text);
    }
  }
  EXPECT_EQ(found, texts);
}

// ------------------------------------------------------------------ qwen3

TEST(ChatTemplate, Qwen3NonThinkingSingleTurn) {
  auto r = render_chat(kQwen3, conv({{Role::user, "Hi"}, {Role::assistant, "Hello"}}));
  EXPECT_EQ(r.text,
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n");
  // The empty think block belongs to the header (the generation prompt supplies it).
  EXPECT_EQ(supervised_texts(r), (std::vector<std::string>{"Hello<|im_end|>\n"}));
}

TEST(ChatTemplate, Qwen3MultiTurnOnlyLastTurnGetsThinkBlock) {
  auto r = render_chat(kQwen3, conv({{Role::system, "S"},
                                     {Role::user, "Q1"},
                                     {Role::assistant, "<think>\nold reasoning\n</think>\n\nA1"},
                                     {Role::user, "Q2"},
                                     {Role::assistant, "\nA2"}}));
  // Jinja: history turns (index <= last user index) lose their reasoning; the last turn gets
  // '<think>\n' + '' + '\n</think>\n\n' + content.lstrip('\n').
  EXPECT_EQ(r.text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n");
  EXPECT_EQ(supervised_texts(r), (std::vector<std::string>{"A1<|im_end|>\n", "A2<|im_end|>\n"}));
}

TEST(ChatTemplate, Qwen3ReasoningInLastTurnIsKeptAndSupervised) {
  auto c = conv({{Role::user, "Q"}, {Role::assistant, "<think>\n\nr1\nr2\n\n</think>\n\n\nA"}});
  auto r = render_chat(kQwen3, c);
  EXPECT_EQ(r.text,
            "<|im_start|>user\nQ<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nr1\nr2\n</think>\n\nA<|im_end|>\n");
  // Non-empty reasoning is generated by the model: supervised from <think> on.
  EXPECT_EQ(supervised_texts(r),
            (std::vector<std::string>{"<think>\nr1\nr2\n</think>\n\nA<|im_end|>\n"}));
  // Thinking mode supervises the (empty) think block too.
  auto t = render_chat(kQwen3Think, conv({{Role::user, "Q"}, {Role::assistant, "A"}}));
  EXPECT_EQ(supervised_texts(t),
            (std::vector<std::string>{"<think>\n\n</think>\n\nA<|im_end|>\n"}));
}

TEST(ChatTemplate, Qwen3GenerationPrompt) {
  auto c = conv({{Role::user, "Q"}});
  EXPECT_EQ(render_chat(kQwen3, c, true).text,
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(render_chat(kQwen3Think, c, true).text,
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
}

// ------------------------------------------------------------------ llama3

TEST(ChatTemplate, Llama3MultiTurnTrimsContent) {
  auto r = render_chat(kLlama3, conv({{Role::system, "S "},
                                      {Role::user, "\n Q1"},
                                      {Role::assistant, " A1\n"},
                                      {Role::user, "Q2"},
                                      {Role::assistant, "A2\xe3\x80\x80"}}));  // U+3000 trimmed
  EXPECT_EQ(r.text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nQ1<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nA2<|eot_id|>");
  EXPECT_EQ(supervised_texts(r), (std::vector<std::string>{"A1<|eot_id|>", "A2<|eot_id|>"}));
  EXPECT_EQ(render_chat(kLlama3, conv({{Role::user, "Q"}}), true).text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, PythonStrip) {
  EXPECT_EQ(python_strip(" \t\na b\r\n"), "a b");
  EXPECT_EQ(python_strip("\xc2\xa0x\xe2\x80\x83"), "x");  // NBSP, EM SPACE
  EXPECT_EQ(python_strip("\xc3\xa9"), "\xc3\xa9");        // é is not whitespace
  EXPECT_EQ(python_strip("   "), "");
  EXPECT_EQ(python_strip(""), "");
}

// ------------------------------------------------------------------ names and detection

TEST(ChatTemplate, Names) {
  EXPECT_EQ(ChatTemplate::from_name("qwen").family, TemplateFamily::chatml);
  EXPECT_EQ(ChatTemplate::from_name("qwen3").name(), "qwen3");
  EXPECT_THROW(ChatTemplate::from_name("vicuna"), Error);
  EXPECT_THROW(ChatTemplate::from_name("chatml", true), Error);
  EXPECT_NE(kQwen3.fingerprint(), kQwen3Think.fingerprint());
  EXPECT_NE(kChatml.fingerprint(), kQwen3.fingerprint());
}

TEST(ChatTemplate, DetectsTinyAndQwen3Templates) {
  auto tiny = read_model_chat_template(test::assets_dir() / "tiny-qwen3");
  ASSERT_TRUE(tiny);
  EXPECT_EQ(detect_template_family(*tiny), TemplateFamily::chatml);
  EXPECT_EQ(resolve_chat_template(test::assets_dir() / "tiny-qwen3", "").name(), "chatml");
  // The real Qwen3 template lives in tokenizer_config.json.
  auto q3dir = test::shared_dir() / "fixtures/qwen3-tokenizer";
  auto q3 = read_model_chat_template(q3dir);
  ASSERT_TRUE(q3);
  EXPECT_EQ(detect_template_family(*q3), TemplateFamily::qwen3);
  auto t = resolve_chat_template(q3dir, "", true);
  EXPECT_EQ(t.family, TemplateFamily::qwen3);
  EXPECT_TRUE(t.enable_thinking);
  // An explicit name wins over detection.
  EXPECT_EQ(resolve_chat_template(q3dir, "chatml").family, TemplateFamily::chatml);
}

TEST(ChatTemplate, DetectsLlama3AndRefusesAmbiguousTemplates) {
  // Meta-Llama-3-8B-Instruct's template.
  const std::string llama3 =
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
      "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
      "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
      "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
      "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
  EXPECT_EQ(detect_template_family(llama3), TemplateFamily::llama3);
  // Llama 3.1 injects a dated system prompt: not what llama3 renders.
  EXPECT_EQ(detect_template_family(llama3 + "{{ 'Cutting Knowledge Date: December 2023' }}"),
            std::nullopt);
  // A ChatML template with a default system prompt is not the plain chatml one.
  EXPECT_EQ(detect_template_family("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system"
                                   "\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                                   "{% for message in messages %}{{'<|im_start|>' + "
                                   "message['role'] + '\n' + message['content'] + '<|im_end|>' + "
                                   "'\n'}}{% endfor %}"),
            std::nullopt);
  EXPECT_EQ(detect_template_family("{{ messages }}"), std::nullopt);

  test::TempDir tmp;
  // No template at all: an error that asks for --template.
  try {
    resolve_chat_template(tmp.path(), "");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--template"), std::string::npos) << e.what();
  }
  // An ambiguous template in tokenizer_config.json: the same.
  test::write_file(tmp / "tokenizer_config.json", R"({"chat_template": "{{ messages }}"})");
  try {
    resolve_chat_template(tmp.path(), "");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--template"), std::string::npos) << e.what();
  }
  // A list of named templates: the "default" one is read.
  test::write_file(tmp / "tokenizer_config.json",
                   nlohmann::json{{"chat_template",
                                   {{{"name", "tool_use"}, {"template", "x"}},
                                    {{"name", "default"}, {"template", llama3}}}}}
                       .dump());
  EXPECT_EQ(resolve_chat_template(tmp.path(), "").family, TemplateFamily::llama3);
}

TEST(ChatTemplate, MarkersAreTheSpecialTokensEachTemplateWrites) {
  Conversation conv;
  conv.messages = {{Role::system, "s"}, {Role::user, "u"}, {Role::assistant, "a"}};
  for (const char* name : {"chatml", "qwen3", "llama3"}) {
    const ChatTemplate t = ChatTemplate::from_name(name);
    const std::vector<std::string_view> markers = chat_template_markers(t);
    ASSERT_FALSE(markers.empty()) << name;
    // Every marker appears in a rendering (the generation prompt included) ...
    const std::string text = render_chat(t, conv, true).text;
    for (std::string_view m : markers) {
      EXPECT_NE(text.find(m), std::string::npos) << name << ": " << m << " in " << text;
    }
    // ... and the rendering holds no other "<|...|>" marker.
    for (size_t i = text.find("<|"); i != std::string::npos; i = text.find("<|", i + 1)) {
      const std::string_view m(text.data() + i, text.find("|>", i) + 2 - i);
      EXPECT_NE(std::find(markers.begin(), markers.end(), m), markers.end()) << name << ": " << m;
    }
  }
  EXPECT_EQ(chat_template_markers(ChatTemplate::from_name("qwen3")).size(), 4u);  // <think> too
}
