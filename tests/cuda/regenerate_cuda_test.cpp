// Tests of `dflash regenerate --backend cuda` (src/cli/cmd_regenerate.cpp, infer/regenerate.hpp,
// the CUDA decoder made with and without a drafter) on the tiny fixture and corpus records, one of
// them two-turn with a system message (the repo's assets: the device has no ../shared): greedy
// target-only output == greedy speculative output (byte for byte), batch 1 == batch 4, a sampled
// run (temperature 0.7) is reproduced by a rerun and by batch 1, and a plan too small for the
// prompts (--max-context) stops the run naming IN:line or, under --skip-invalid, skips every
// record. Skipped without a GPU.
#include <gtest/gtest.h>

#include <fstream>

#include "cuda_test_util.hpp"
#include "data/jsonl.hpp"
#include "model/drafter_io.hpp"
#include "model/target.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMaxNew = "32";

class RegenerateCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::dflash::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const ModelConfig tc = model_config_load(test::assets_dir() / "tiny-qwen3");
    DrafterSizes sizes;
    sizes.block_size = 4;
    sizes.intermediate_size = 256;
    test::save_random_drafter(dir_ / "drafter", tc, 1, sizes, 5);
    // The corpus's first 6 records and a two-turn record with a system message.
    LineReader r(test::assets_dir() / "data" / "train.jsonl.xz");
    std::string line, text;
    for (int i = 0; i < 6 && r.next(line); ++i) text += line + "\n";
    text +=
        R"({"id": "multi-1", "source": "hand", "messages": [{"role": "system", "content": "You answer briefly."}, )"
        R"({"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "x"}, )"
        R"({"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "y"}]})"
        "\n";
    std::ofstream(dir_ / "in.jsonl", std::ios::binary) << text;
  }
  // Runs regenerate on cuda into OUT `name` with `extra` options; returns OUT's bytes.
  std::string regen(const std::string& name, std::vector<std::string> extra,
                    test::RunResult* result = nullptr) {
    std::vector<std::string> args = {
        "regenerate",           "--target",         tiny(),  "--data",    in(),  "--out",
        (dir_ / name).string(), "--max-new-tokens", kMaxNew, "--backend", "cuda"};
    args.insert(args.end(), extra.begin(), extra.end());
    const test::RunResult r = test::run_dflash(args);
    if (result != nullptr)
      *result = r;
    else
      EXPECT_EQ(r.exit_code, 0) << name << ": " << r.err;
    return fs::exists(dir_ / name) ? test::read_file(dir_ / name) : std::string();
  }
  std::string tiny() const { return (test::assets_dir() / "tiny-qwen3").string(); }
  std::string in() const { return (dir_ / "in.jsonl").string(); }
  std::string drafter() const { return (dir_ / "drafter").string(); }
  test::TempDir dir_;
};

TEST_F(RegenerateCuda, GreedySpeculativeEqualsTargetOnlyAtAnyBatchSize) {
  test::RunResult r;
  const std::string target_b1 = regen("t1.jsonl", {"--batch-size", "1"}, &r);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("written: 7\n"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("target-only decoding on cuda"), std::string::npos) << r.err;
  EXPECT_FALSE(target_b1.empty());
  EXPECT_EQ(regen("t4.jsonl", {"--batch-size", "4"}), target_b1);
  EXPECT_EQ(regen("s1.jsonl", {"--batch-size", "1", "--drafter", drafter()}), target_b1);
  EXPECT_EQ(regen("s4.jsonl", {"--batch-size", "4", "--drafter", drafter()}, &r), target_b1);
  EXPECT_NE(r.err.find("speculative decoding on cuda"), std::string::npos) << r.err;
}

TEST_F(RegenerateCuda, SampledRunIsReproducedByARerunAndAtBatchOne) {
  for (const bool speculative : {false, true}) {
    std::vector<std::string> o = {"--temperature", "0.7", "--seed", "11"};
    if (speculative) o.insert(o.end(), {"--drafter", drafter()});
    const std::string tag = speculative ? "s" : "t";
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.begin(), o.begin(), o.end());
      return more;
    };
    const std::string first = regen(tag + "a.jsonl", with({"--batch-size", "4"}));
    EXPECT_FALSE(first.empty());
    EXPECT_EQ(regen(tag + "b.jsonl", with({"--batch-size", "4"})), first) << tag;
    EXPECT_EQ(regen(tag + "c.jsonl", with({"--batch-size", "1"})), first) << tag;
  }
}

TEST_F(RegenerateCuda, PromptOverThePlanStopsTheRunOrIsSkipped) {
  // --max-context 32 + 1 + 4: prompts of up to 4 tokens, shorter than any record's.
  test::RunResult r;
  regen("x.jsonl", {"--max-context", "37"}, &r);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(in() + ":1: record "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("over the 4 the decoder was planned for"), std::string::npos) << r.err;
  const std::string out = regen("y.jsonl", {"--max-context", "37", "--skip-invalid"}, &r);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("invalid skipped: 7\n"), std::string::npos) << r.out;
  EXPECT_EQ(out, "");
}

}  // namespace
}  // namespace dflash
