// dflash.cpp — strict JSON reading for model files (safetensors headers, index.json, config.json).
//
// Invariant: a document parsed here has no duplicate key in any object (nlohmann::json would keep
// the last one silently), and every error names the source (file) and the byte offset or key.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
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

}  // namespace dflash
