#include "model/json_util.hpp"

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

}  // namespace dflash
