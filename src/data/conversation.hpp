// dflash.cpp — conversation records (one JSONL line each) and their validation.
//
// Accepted forms (both carry an `id`, a string or an integer, and an optional `source` string):
//   ShareGPT: {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}
//   OpenAI:   {"messages"|"conversations": [{"role": "user"|"assistant"|"system",
//                                            "content": "..."}, ...]}
// Invariants of a parsed Conversation: an optional system message first, then turns alternating
// user, assistant, user, ... (a user turn first), ending with an assistant turn unless the caller
// allows a trailing user turn (prompts); no empty (or whitespace-only) content. Every violation
// throws a RecordError whose kind says which rule broke and whose message names `file:line` and the
// field (e.g. "train.jsonl:17: conversations[2].from: unknown role 'bot'").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace dflash {

/// Speaker of a message.
enum class Role : uint8_t { system, user, assistant };

/// "system", "user" or "assistant".
std::string_view role_name(Role r);

/// One message of a conversation.
struct Message {
  Role role = Role::user;
  std::string content;
};

/// A validated conversation record.
struct Conversation {
  std::string id;      ///< the record's `id` (integers are printed in decimal)
  std::string source;  ///< the record's optional `source` ("" when absent)
  std::vector<Message> messages;
};

/// Why a record was rejected.
enum class RecordErrorKind : uint8_t {
  invalid_json,       ///< the line is not valid JSON (or not valid UTF-8), or not a JSON object
  missing_field,      ///< `id`, the message list, or a message's role/content field is absent
  invalid_field,      ///< a field has the wrong type, or the record mixes forms / has both lists
  unknown_role,       ///< a role outside the accepted names of the record's form
  empty_content,      ///< an empty message list, or a message whose content is empty/whitespace
  wrong_alternation,  ///< system not first, user/assistant not alternating, no final assistant
};

/// Short name of a kind ("invalid_json", ...), used in reports.
std::string_view record_error_kind_name(RecordErrorKind k);

/// A rejected record: a dflash::Error that also carries its kind.
class RecordError : public Error {
 public:
  RecordError(RecordErrorKind kind, const std::string& msg) : Error(msg), kind_(kind) {}
  RecordErrorKind kind() const { return kind_; }

 private:
  RecordErrorKind kind_;
};

/// Options of parse_conversation().
struct ParseOptions {
  /// Accept a conversation that ends with a user turn (a prompt awaiting a reply).
  bool allow_trailing_user = false;
};

/// Parses and validates one JSONL record (`line` is the line's text, `file` and `line_no` only name
/// the place in error messages). Throws RecordError (see RecordErrorKind) on any violation.
Conversation parse_conversation(std::string_view line, std::string_view file, int64_t line_no,
                                const ParseOptions& opts = {});

/// Checks the turn structure of `conv` (see the file comment); throws RecordError of kind
/// wrong_alternation/empty_content with `where` ("file:line") as the message prefix and
/// `list_name[i]` naming the offending message.
void validate_conversation(const Conversation& conv, std::string_view where,
                           const ParseOptions& opts = {}, std::string_view list_name = "messages");

}  // namespace dflash
