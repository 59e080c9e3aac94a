// Replays every saved fuzz input through its target (tests/fuzz/fuzz_targets.hpp) without
// libFuzzer: the seed corpus (tests/fuzz/corpus/<name>/) and the inputs that once made a harness
// crash, leak, hang or break a property (tests/fuzz/regressions/<name>/, one file per finding,
// named after what it found). In the ASan+UBSan build this reruns each finding under the same
// sanitizers that caught it.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "fuzz/fuzz_targets.hpp"
#include "util/test_util.hpp"

namespace fs = std::filesystem;
using dflash::fuzz::NamedTarget;

namespace {

std::vector<fs::path> inputs_of(const std::string& name) {
  std::vector<fs::path> files;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = dflash::test::source_dir() / "tests/fuzz" / kind / name;
    if (!fs::is_directory(dir)) continue;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

class FuzzReplay : public ::testing::TestWithParam<NamedTarget> {};

TEST_P(FuzzReplay, EverySavedInputIsHandled) {
  const NamedTarget t = GetParam();
  const std::vector<fs::path> files = inputs_of(t.name);
  ASSERT_FALSE(files.empty()) << "no seed corpus for fuzz target " << t.name;
  for (const fs::path& f : files) {
    const std::string bytes = dflash::test::read_file(f);
    try {
      t.fn(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    } catch (const std::exception& e) {
      ADD_FAILURE() << f.string() << ": " << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzReplay, ::testing::ValuesIn(dflash::fuzz::all_targets()),
                         [](const ::testing::TestParamInfo<NamedTarget>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
