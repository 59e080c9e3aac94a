// dflash.cpp — built-in chat templates (see chat_template.hpp for the rendering and mask rules).
#include "data/chat_template.hpp"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"

namespace dflash {

namespace {

// Bumped whenever a renderer's output changes, so that token caches are rebuilt.
constexpr int kRendererVersion = 1;

// Appends to a text while recording supervised spans.
struct Builder {
  RenderedChat out;
  size_t open = std::string::npos;
  void add(std::string_view s) { out.text.append(s); }
  void begin_supervised() { open = out.text.size(); }
  void end_supervised() {
    DFLASH_ASSERT(open != std::string::npos);
    if (out.text.size() > open) out.supervised.push_back({open, out.text.size()});
    open = std::string::npos;
  }
};

bool py_isspace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

// Decodes the code point starting at s[i] (well-formed UTF-8 assumed; a bad byte decodes to
// itself, which is never whitespace above 0x7f). Sets `len`.
uint32_t decode_at(std::string_view s, size_t i, size_t* len) {
  auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) n = 1;
  uint32_t c = n == 1 ? b : n == 2 ? (b & 0x1f) : n == 3 ? (b & 0x0f) : (b & 0x07);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  *len = n;
  return c;
}

std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

void render_chatml(Builder& b, const Conversation& conv) {
  for (const auto& m : conv.messages) {
    b.add("<|im_start|>");
    b.add(role_name(m.role));
    b.add("\n");
    if (m.role == Role::assistant) b.begin_supervised();
    b.add(m.content);
    b.add("<|im_end|>\n");
    if (m.role == Role::assistant) b.end_supervised();
  }
}

// Qwen3 (tokenizer_config.json of Qwen/Qwen3-*), without tools. See the Jinja source: the index of
// the last user query decides which assistant turns keep a think block.
void render_qwen3(Builder& b, const Conversation& conv, bool enable_thinking) {
  const auto& ms = conv.messages;
  size_t first = 0;
  if (!ms.empty() && ms[0].role == Role::system) {
    b.add("<|im_start|>system\n");
    b.add(ms[0].content);
    b.add("<|im_end|>\n");
    first = 1;
  }
  // ns.last_query_index: the last user message that is not a tool response.
  size_t last_query = ms.size() - 1;
  for (size_t k = ms.size(); k-- > 0;) {
    const std::string& c = ms[k].content;
    bool tool_response = c.starts_with("<tool_response>") && c.ends_with("</tool_response>");
    if (ms[k].role == Role::user && !tool_response) {
      last_query = k;
      break;
    }
  }
  for (size_t i = first; i < ms.size(); ++i) {
    const Message& m = ms[i];
    if (m.role != Role::assistant) {
      b.add("<|im_start|>");
      b.add(role_name(m.role));
      b.add("\n");
      b.add(m.content);
      b.add("<|im_end|>\n");
      continue;
    }
    std::string_view content = m.content;
    std::string_view reasoning;
    if (size_t close = content.find("</think>"); close != std::string_view::npos) {
      std::string_view all = m.content;
      // content.split('</think>')[-1].lstrip('\n')
      content = lstrip_nl(all.substr(all.rfind("</think>") + 8));
      // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
      std::string_view before = rstrip_nl(all.substr(0, close));
      if (size_t open = before.rfind("<think>"); open != std::string_view::npos) {
        before = before.substr(open + 7);
      }
      reasoning = lstrip_nl(before);
    }
    b.add("<|im_start|>assistant\n");
    bool last = (i + 1 == ms.size());
    if (i > last_query && (last || !reasoning.empty())) {
      // reasoning.strip('\n')
      std::string_view r = rstrip_nl(lstrip_nl(reasoning));
      bool header_block = r.empty() && !enable_thinking;
      if (!header_block) b.begin_supervised();
      b.add("<think>\n");
      b.add(r);
      b.add("\n</think>\n\n");
      if (header_block) b.begin_supervised();
      b.add(lstrip_nl(content));
    } else {
      b.begin_supervised();
      b.add(content);
    }
    b.add("<|im_end|>\n");
    b.end_supervised();
  }
}

// Llama 3 Instruct (Meta-Llama-3-8B-Instruct tokenizer_config.json).
void render_llama3(Builder& b, const Conversation& conv) {
  b.add("<|begin_of_text|>");
  for (const auto& m : conv.messages) {
    b.add("<|start_header_id|>");
    b.add(role_name(m.role));
    b.add("<|end_header_id|>\n\n");
    if (m.role == Role::assistant) b.begin_supervised();
    b.add(python_strip(m.content));
    b.add("<|eot_id|>");
    if (m.role == Role::assistant) b.end_supervised();
  }
}

// The plain ChatML template (the tiny model's chat_template.jinja), with literal newlines inside
// its string literals and with the "\n" escapes, which Jinja reads the same way.
const char* const kChatmlTemplates[] = {
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}",
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}",
};

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

}  // namespace

std::string_view python_strip(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t n;
    uint32_t c = decode_at(s, i, &n);
    if (!py_isspace(c)) break;
    i += n;
  }
  size_t j = s.size();
  while (j > i) {
    size_t k = j - 1;
    while (k > i && (static_cast<unsigned char>(s[k]) & 0xc0) == 0x80) --k;
    size_t n;
    uint32_t c = decode_at(s, k, &n);
    if (k + n != j || !py_isspace(c)) break;
    j = k;
  }
  return s.substr(i, j - i);
}

ChatTemplate ChatTemplate::from_name(std::string_view name, bool enable_thinking) {
  ChatTemplate t;
  t.enable_thinking = enable_thinking;
  if (name == "chatml" || name == "qwen") {
    t.family = TemplateFamily::chatml;
  } else if (name == "qwen3") {
    t.family = TemplateFamily::qwen3;
  } else if (name == "llama3") {
    t.family = TemplateFamily::llama3;
  } else {
    fail("unknown chat template '{}' (built-in templates: chatml (alias qwen), qwen3, llama3)",
         name);
  }
  DFLASH_CHECK(!enable_thinking || t.family == TemplateFamily::qwen3,
               "enable_thinking applies to the qwen3 template only (template is '{}')", name);
  return t;
}

std::string ChatTemplate::name() const {
  switch (family) {
    case TemplateFamily::chatml:
      return "chatml";
    case TemplateFamily::qwen3:
      return "qwen3";
    case TemplateFamily::llama3:
      return "llama3";
  }
  return "?";
}

std::string ChatTemplate::fingerprint() const {
  return fmt::format("{};enable_thinking={};renderer=v{}", name(), enable_thinking ? 1 : 0,
                     kRendererVersion);
}

std::vector<std::string_view> chat_template_markers(const ChatTemplate& t) {
  switch (t.family) {
    case TemplateFamily::chatml:
      return {"<|im_start|>", "<|im_end|>"};
    case TemplateFamily::qwen3:
      return {"<|im_start|>", "<|im_end|>", "<think>", "</think>"};
    case TemplateFamily::llama3:
      return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  }
  return {};
}

RenderedChat render_chat(const ChatTemplate& t, const Conversation& conv,
                         bool add_generation_prompt) {
  DFLASH_CHECK(!conv.messages.empty(), "render_chat: conversation '{}' has no messages", conv.id);
  Builder b;
  switch (t.family) {
    case TemplateFamily::chatml:
      render_chatml(b, conv);
      if (add_generation_prompt) b.add("<|im_start|>assistant\n");
      break;
    case TemplateFamily::qwen3:
      render_qwen3(b, conv, t.enable_thinking);
      if (add_generation_prompt) {
        b.add("<|im_start|>assistant\n");
        if (!t.enable_thinking) b.add("<think>\n\n</think>\n\n");
      }
      break;
    case TemplateFamily::llama3:
      render_llama3(b, conv);
      if (add_generation_prompt) b.add("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
  }
  return std::move(b.out);
}

std::optional<TemplateFamily> detect_template_family(std::string_view jinja) {
  const std::string_view body = python_strip(jinja);
  for (const char* known : kChatmlTemplates) {
    if (body == known) return TemplateFamily::chatml;
  }
  const bool chatml_markers = contains(jinja, "<|im_start|>") && contains(jinja, "<|im_end|>");
  if (chatml_markers && contains(jinja, "enable_thinking") && contains(jinja, "</think>") &&
      contains(jinja, "last_query_index")) {
    return TemplateFamily::qwen3;
  }
  const bool llama_markers = contains(jinja, "<|start_header_id|>") &&
                             contains(jinja, "<|end_header_id|>") && contains(jinja, "<|eot_id|>");
  // Llama 3.1+ templates inject a dated system prompt and tool text that llama3 does not render.
  if (llama_markers && !chatml_markers && !contains(jinja, "Cutting Knowledge") &&
      !contains(jinja, "tools")) {
    return TemplateFamily::llama3;
  }
  return std::nullopt;
}

std::optional<std::string> read_model_chat_template(const std::filesystem::path& model_dir) {
  auto jinja = model_dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja)) {
    std::ifstream f(jinja, std::ios::binary);
    DFLASH_CHECK(f.good(), "{}: cannot open", jinja.string());
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  auto cfg = model_dir / "tokenizer_config.json";
  if (!std::filesystem::exists(cfg)) return std::nullopt;
  std::ifstream f(cfg, std::ios::binary);
  DFLASH_CHECK(f.good(), "{}: cannot open", cfg.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", cfg.string(), e.what());
  }
  auto ct = j.find("chat_template");
  if (ct == j.end() || ct->is_null()) return std::nullopt;
  if (ct->is_string()) return ct->get<std::string>();
  if (ct->is_array()) {
    for (const auto& e : *ct) {
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
          e["template"].is_string()) {
        return e["template"].get<std::string>();
      }
    }
    fail("{}: chat_template is a list without an entry named 'default'", cfg.string());
  }
  fail("{}: chat_template must be a string or a list, not {}", cfg.string(), ct->type_name());
}

ChatTemplate resolve_chat_template(const std::filesystem::path& model_dir, std::string_view name,
                                   bool enable_thinking) {
  if (!name.empty()) return ChatTemplate::from_name(name, enable_thinking);
  auto text = read_model_chat_template(model_dir);
  if (!text) {
    fail(
        "{} has no chat template (chat_template.jinja or tokenizer_config.json "
        "\"chat_template\"); name one with --template (chatml, qwen3, llama3)",
        model_dir.string());
  }
  auto family = detect_template_family(*text);
  if (!family) {
    fail(
        "cannot tell which built-in template the chat template of {} is; name it with "
        "--template (chatml, qwen3, llama3) after checking that it renders the same text",
        model_dir.string());
  }
  ChatTemplate t;
  t.family = *family;
  DFLASH_CHECK(!enable_thinking || t.family == TemplateFamily::qwen3,
               "enable_thinking applies to the qwen3 template only (detected '{}' in {})", t.name(),
               model_dir.string());
  t.enable_thinking = enable_thinking;
  return t;
}

}  // namespace dflash
