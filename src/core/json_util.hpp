// dflash.cpp — strict JSON reading for model files (safetensors headers, index.json, config.json).
//
// Invariant: a document parsed here has no duplicate key in any object (nlohmann::json would keep
// the last one silently), and every error names the source (file) and the byte offset or key.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dflash {

/// Parses `text` as JSON. Throws dflash::Error "<source>: malformed JSON: <detail>" on a syntax
/// error and "<source>: duplicate key '<k>' in a JSON object" when an object repeats a key.
nlohmann::json json_parse_strict(std::string_view text, const std::string& source);

/// Reads and parses a whole JSON file with json_parse_strict; the error names the file.
nlohmann::json json_load_file(const std::filesystem::path& path);

/// "number", "string", "object", … (nlohmann's type_name) for error messages.
inline std::string json_type(const nlohmann::json& j) { return j.type_name(); }

/// Integer member `key` of object `j`, in [min_v, max_v]. Throws dflash::Error
/// "<source>: key '<key>' ..." when `j` is not an object, the key is absent, the value is not a
/// JSON integer (a float such as 1e300 is refused, never cast) or lies outside the range.
int64_t json_int(const nlohmann::json& j, std::string_view key, const std::string& source,
                 int64_t min_v = INT64_MIN, int64_t max_v = INT64_MAX);
/// Unsigned integer member `key` of object `j` (any value of uint64_t); errors as json_int.
uint64_t json_uint(const nlohmann::json& j, std::string_view key, const std::string& source);
/// Finite number member `key` of object `j`; errors as json_int (NaN/inf cannot occur in JSON
/// text, but a number too large for a double parses as inf and is refused).
double json_double(const nlohmann::json& j, std::string_view key, const std::string& source);
/// String member `key` of object `j`; errors as json_int.
std::string json_string(const nlohmann::json& j, std::string_view key, const std::string& source);
/// Member `key` of object `j` (any type); throws "<source>: missing key '<key>'" when absent.
const nlohmann::json& json_member(const nlohmann::json& j, std::string_view key,
                                  const std::string& source);

}  // namespace dflash
