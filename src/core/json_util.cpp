#include "core/json_util.hpp"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "core/error.hpp"

namespace dflash {

nlohmann::json json_parse_strict(std::string_view text, const std::string& source) {
  using nlohmann::json;
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default: break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    fail("{}: malformed JSON: {}", source, e.what());
  }
  DFLASH_CHECK(duplicate.empty(), "{}: duplicate key '{}' in a JSON object", source, duplicate);
  return j;
}

nlohmann::json json_load_file(const std::filesystem::path& path) {
  std::error_code ec;
  DFLASH_CHECK(std::filesystem::is_regular_file(path, ec), "{} does not exist or is not a file",
               path.string());
  std::ifstream f(path, std::ios::binary);
  DFLASH_CHECK(f.good(), "cannot open {}", path.string());
  std::stringstream ss;
  ss << f.rdbuf();
  DFLASH_CHECK(!f.bad(), "cannot read {}", path.string());
  return json_parse_strict(ss.str(), path.string());
}

const nlohmann::json& json_member(const nlohmann::json& j, std::string_view key,
                                  const std::string& source) {
  DFLASH_CHECK(j.is_object(), "{}: expected a JSON object holding key '{}', got a JSON {}", source,
               key, json_type(j));
  const auto it = j.find(key);
  DFLASH_CHECK(it != j.end(), "{}: missing key '{}'", source, key);
  return *it;
}

int64_t json_int(const nlohmann::json& j, std::string_view key, const std::string& source,
                 int64_t min_v, int64_t max_v) {
  const nlohmann::json& v = json_member(j, key, source);
  DFLASH_CHECK(v.is_number_integer(), "{}: key '{}' must be an integer, got {}", source, key,
               v.dump());
  const bool too_big =
      v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t x = too_big ? INT64_MAX : v.get<int64_t>();
  DFLASH_CHECK(!too_big && x >= min_v && x <= max_v, "{}: key '{}' must be in [{}, {}], got {}",
               source, key, min_v, max_v, v.dump());
  return x;
}

uint64_t json_uint(const nlohmann::json& j, std::string_view key, const std::string& source) {
  const nlohmann::json& v = json_member(j, key, source);
  DFLASH_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
               "{}: key '{}' must be a non-negative integer, got {}", source, key, v.dump());
  return v.get<uint64_t>();
}

double json_double(const nlohmann::json& j, std::string_view key, const std::string& source) {
  const nlohmann::json& v = json_member(j, key, source);
  DFLASH_CHECK(v.is_number(), "{}: key '{}' must be a number, got {}", source, key, v.dump());
  const double d = v.get<double>();
  DFLASH_CHECK(std::isfinite(d), "{}: key '{}' must be finite, got {}", source, key, v.dump());
  return d;
}

std::string json_string(const nlohmann::json& j, std::string_view key, const std::string& source) {
  const nlohmann::json& v = json_member(j, key, source);
  DFLASH_CHECK(v.is_string(), "{}: key '{}' must be a string, got {}", source, key, v.dump());
  return v.get<std::string>();
}

}  // namespace dflash
