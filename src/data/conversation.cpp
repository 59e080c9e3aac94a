// dflash.cpp — conversation record parsing (see conversation.hpp for the accepted forms).
#include "data/conversation.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace dflash {

using nlohmann::json;

std::string_view role_name(Role r) {
  switch (r) {
    case Role::system:
      return "system";
    case Role::user:
      return "user";
    case Role::assistant:
      return "assistant";
  }
  return "?";
}

std::string_view record_error_kind_name(RecordErrorKind k) {
  switch (k) {
    case RecordErrorKind::invalid_json:
      return "invalid_json";
    case RecordErrorKind::missing_field:
      return "missing_field";
    case RecordErrorKind::invalid_field:
      return "invalid_field";
    case RecordErrorKind::unknown_role:
      return "unknown_role";
    case RecordErrorKind::empty_content:
      return "empty_content";
    case RecordErrorKind::wrong_alternation:
      return "wrong_alternation";
  }
  return "?";
}

namespace {

template <typename... Args>
[[noreturn]] void reject(RecordErrorKind kind, std::string_view where,
                         fmt::format_string<Args...> f, Args&&... args) {
  throw RecordError(kind,
                    fmt::format("{}: {}", where, fmt::format(f, std::forward<Args>(args)...)));
}

bool is_blank(std::string_view s) {
  for (char c : s) {
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\f' && c != '\v') return false;
  }
  return true;
}

}  // namespace

void validate_conversation(const Conversation& conv, std::string_view where,
                           const ParseOptions& opts, std::string_view list_name) {
  const auto& m = conv.messages;
  if (m.empty()) reject(RecordErrorKind::empty_content, where, "'{}' is empty", list_name);
  for (size_t i = 0; i < m.size(); ++i) {
    if (is_blank(m[i].content)) {
      reject(RecordErrorKind::empty_content, where, "{}[{}] ({}): empty content", list_name, i,
             role_name(m[i].role));
    }
  }
  size_t first = (m[0].role == Role::system) ? 1 : 0;
  for (size_t i = first; i < m.size(); ++i) {
    Role want = ((i - first) % 2 == 0) ? Role::user : Role::assistant;
    if (m[i].role != want) {
      if (m[i].role == Role::system) {
        reject(RecordErrorKind::wrong_alternation, where,
               "{}[{}]: a system message is only allowed first", list_name, i);
      }
      reject(RecordErrorKind::wrong_alternation, where,
             "{}[{}]: expected a {} turn, got {} (turns must alternate user, assistant, "
             "starting with user)",
             list_name, i, role_name(want), role_name(m[i].role));
    }
  }
  if (m.size() == first) {
    reject(RecordErrorKind::wrong_alternation, where, "the conversation has only a system message");
  }
  if (m.back().role != Role::assistant && !opts.allow_trailing_user) {
    reject(RecordErrorKind::wrong_alternation, where,
           "the conversation ends with a user turn (no assistant reply to train on)");
  }
}

Conversation parse_conversation(std::string_view line, std::string_view file, int64_t line_no,
                                const ParseOptions& opts) {
  const std::string where = fmt::format("{}:{}", file, line_no);
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {  // a syntax error, or a number too large (out_of_range)
    reject(RecordErrorKind::invalid_json, where, "invalid JSON: {}", e.what());
  }
  if (!j.is_object()) {
    reject(RecordErrorKind::invalid_json, where, "the record is a JSON {}, not an object",
           j.type_name());
  }
  Conversation conv;
  // id
  auto id = j.find("id");
  if (id == j.end()) reject(RecordErrorKind::missing_field, where, "missing field 'id'");
  if (id->is_string()) {
    conv.id = id->get<std::string>();
  } else if (id->is_number_integer()) {
    conv.id = id->dump();
  } else {
    reject(RecordErrorKind::invalid_field, where,
           "field 'id' must be a string or an integer, not {}", id->type_name());
  }
  if (auto src = j.find("source"); src != j.end()) {
    if (!src->is_string()) {
      reject(RecordErrorKind::invalid_field, where, "field 'source' must be a string, not {}",
             src->type_name());
    }
    conv.source = src->get<std::string>();
  }
  // message list
  auto msgs = j.find("messages");
  auto convs = j.find("conversations");
  if (msgs != j.end() && convs != j.end()) {
    reject(RecordErrorKind::invalid_field, where,
           "the record has both 'messages' and 'conversations'");
  }
  if (msgs == j.end() && convs == j.end()) {
    reject(RecordErrorKind::missing_field, where, "missing field 'conversations' (or 'messages')");
  }
  const std::string list_name = (msgs != j.end()) ? "messages" : "conversations";
  const json& list = (msgs != j.end()) ? *msgs : *convs;
  if (!list.is_array()) {
    reject(RecordErrorKind::invalid_field, where, "field '{}' must be an array, not {}", list_name,
           list.type_name());
  }
  enum class Form { unknown, sharegpt, openai } form = Form::unknown;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& e = list[i];
    const std::string field = fmt::format("{}[{}]", list_name, i);
    if (!e.is_object()) {
      reject(RecordErrorKind::invalid_field, where, "{} must be an object, not {}", field,
             e.type_name());
    }
    Form f = Form::unknown;
    if (e.contains("from") || e.contains("value")) f = Form::sharegpt;
    if (e.contains("role") || e.contains("content")) {
      if (f == Form::sharegpt) {
        reject(RecordErrorKind::invalid_field, where,
               "{} mixes ShareGPT ('from'/'value') and OpenAI ('role'/'content') fields", field);
      }
      f = Form::openai;
    }
    if (f == Form::unknown) {
      reject(RecordErrorKind::missing_field, where,
             "{}: missing field 'role' (OpenAI form) or 'from' (ShareGPT form)", field);
    }
    if (form == Form::unknown) form = f;
    if (f != form) {
      reject(RecordErrorKind::invalid_field, where,
             "{} is in {} form but earlier messages are in {} form", field,
             f == Form::sharegpt ? "ShareGPT" : "OpenAI",
             form == Form::sharegpt ? "ShareGPT" : "OpenAI");
    }
    const char* role_key = (f == Form::sharegpt) ? "from" : "role";
    const char* content_key = (f == Form::sharegpt) ? "value" : "content";
    auto r = e.find(role_key);
    if (r == e.end())
      reject(RecordErrorKind::missing_field, where, "{}: missing field '{}'", field, role_key);
    if (!r->is_string()) {
      reject(RecordErrorKind::invalid_field, where, "{}.{} must be a string, not {}", field,
             role_key, r->type_name());
    }
    auto c = e.find(content_key);
    if (c == e.end()) {
      reject(RecordErrorKind::missing_field, where, "{}: missing field '{}'", field, content_key);
    }
    if (!c->is_string()) {
      reject(RecordErrorKind::invalid_field, where, "{}.{} must be a string, not {}", field,
             content_key, c->type_name());
    }
    const std::string& rs = r->get_ref<const std::string&>();
    Message m;
    if (f == Form::sharegpt) {
      if (rs == "human")
        m.role = Role::user;
      else if (rs == "gpt")
        m.role = Role::assistant;
      else if (rs == "system")
        m.role = Role::system;
      else {
        reject(RecordErrorKind::unknown_role, where,
               "{}.from: unknown role '{}' (expected human, gpt or system)", field, rs);
      }
    } else {
      if (rs == "user")
        m.role = Role::user;
      else if (rs == "assistant")
        m.role = Role::assistant;
      else if (rs == "system")
        m.role = Role::system;
      else {
        reject(RecordErrorKind::unknown_role, where,
               "{}.role: unknown role '{}' (expected user, assistant or system)", field, rs);
      }
    }
    m.content = c->get<std::string>();
    conv.messages.push_back(std::move(m));
  }
  validate_conversation(conv, where, opts, list_name);
  return conv;
}

}  // namespace dflash
