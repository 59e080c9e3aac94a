// Tests of the reader of a checkpoint's trainer_state/state.json (checkpoint_state_parse, the code
// `dflash train --resume` reads it with): a state written by dflash is accepted, and each kind of
// damage is refused with the key named, never cast (a float step), never sized from the file (a
// metric vector of the wrong length) and never a crash.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.hpp"
#include "train/checkpoint.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

using nlohmann::json;

// A state.json written by `dflash train` (one step of a 1-layer drafter, block size 8).
json written_state() {
  return json::parse(
      test::read_file(test::source_dir() / "tests/fuzz/corpus/trainer_state/step1.json"));
}

std::string error_of(const json& j) {
  try {
    (void)checkpoint_state_parse(j.dump(), "ckpt/state.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_refused(const std::function<void(json&)>& damage, const std::string& part) {
  json j = written_state();
  damage(j);
  const std::string msg = error_of(j);
  EXPECT_NE(msg.find("ckpt/state.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find(part), std::string::npos) << "'" << msg << "' lacks '" << part << "'";
}

TEST(TrainerState, WrittenStateIsAccepted) {
  EXPECT_EQ(error_of(written_state()), "(no error)");
}

// The rank count of an MPI job's checkpoint (issue 15): absent means one process.
TEST(TrainerState, TheRankCountIsReadAndCheckedWhenPresent) {
  EXPECT_EQ(checkpoint_state_parse(written_state().dump(), "s.json").ranks, 1);
  json j = written_state();
  j["ranks"] = 4;
  EXPECT_EQ(checkpoint_state_parse(j.dump(), "s.json").ranks, 4);
  expect_refused([](json& j) { j["ranks"] = 1; }, "key 'ranks' must be in [2,");
  expect_refused([](json& j) { j["ranks"] = 2.5; }, "key 'ranks' must be an integer");
}

TEST(TrainerState, EachDamageIsRefusedNamingTheKey) {
  expect_refused([](json& j) { j["format"] = "dflash-trainer-state-0"; }, "format");
  expect_refused([](json& j) { j["step"] = 1e300; }, "key 'step' must be an integer");
  expect_refused([](json& j) { j["step"] = -1; }, "key 'step'");
  expect_refused([](json& j) { j["skipped"] = 5; }, "key 'skipped' must be in [0, 1]");
  expect_refused([](json& j) { j.erase("consecutive_skips"); }, "missing key 'consecutive_skips'");
  expect_refused([](json& j) { j["interval"]["K"] = 1000000000; }, "key 'K' must be in [8, 8]");
  expect_refused(
      [](json& j) {
        j["interval"]["slot_count"] = json::array({1, 2});
      },
      "key 'slot_count' must be a list of 8 counts");
  expect_refused([](json& j) { j["interval"]["slot_correct"][3] = -2; },
                 "key 'slot_correct' must hold non-negative integers");
  expect_refused(
      [](json& j) {
        j["interval"]["slot_correct"][3] = 5;
        j["interval"]["slot_count"][3] = 4;
      },
      "slot 3 has more correct predictions (5) than predictions (4)");
  expect_refused([](json& j) { j["interval"]["t_total"] = "fast"; }, "key 't_total'");
  expect_refused([](json& j) { j["data_cursor"]["dataset"] = "12zz"; },
                 "key 'dataset' must be 16 hex digits");
  expect_refused([](json& j) { j["data_cursor"]["seed"] = -3; }, "key 'seed'");
  expect_refused([](json& j) { j["config"] = "model: [1"; }, "YAML");
  expect_refused([](json& j) { j["config"] = 7; }, "key 'config' must be a string");
  expect_refused([](json& j) { j = json::array(); }, "expected a JSON object");
  try {
    (void)checkpoint_state_parse(R"({"format": "dflash-trainer-state-1", "format": "x"})",
                                 "s.json");
    ADD_FAILURE() << "a duplicate key was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("s.json: duplicate key 'format'"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dflash
