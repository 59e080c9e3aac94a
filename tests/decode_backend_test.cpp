// Tests of the decoding commands' `--backend` flag where no GPU decodes (src/cli/cuda_decoder.hpp):
// `--backend cuda` fails with a clear error naming the backend (built without CUDA, or no device
// visible), before any weight is loaded; an unknown backend and `--show-steps` with cuda are
// refused; `eval --backend cuda` fails the same way as generate. The GPU path itself is tested in
// tests/cuda/decoder_cuda_test.cpp.
#include <gtest/gtest.h>

#include "model/drafter_io.hpp"
#include "model/target.hpp"
#include "util/test_util.hpp"

namespace dflash {
namespace {

class DecodeBackendCli : public ::testing::Test {
 protected:
  void SetUp() override {
    const ModelConfig tc = model_config_load(test::assets_dir() / "tiny-qwen3");
    DrafterSizes sizes;
    sizes.block_size = 4;
    sizes.intermediate_size = 64;
    test::save_random_drafter(dir_ / "drafter", tc, 1, sizes, 3);
  }
  test::RunResult run(const std::string& cmd, std::vector<std::string> extra) {
    std::vector<std::string> args = {cmd,
                                     "--target",
                                     (test::assets_dir() / "tiny-qwen3").string(),
                                     "--drafter",
                                     (dir_ / "drafter").string(),
                                     "--max-new-tokens",
                                     "4"};
    args.insert(args.end(), extra.begin(), extra.end());
    return test::run_dflash(args);
  }
  test::TempDir dir_;
};

TEST_F(DecodeBackendCli, CudaWithoutAGpuIsAClearError) {
  if (test::gpu_visible())
    GTEST_SKIP() << "a GPU is visible: tests/cuda/decoder_cuda_test covers it";
  const std::string prompts = (test::assets_dir() / "data" / "eval_prompts.jsonl").string();
  for (const auto& [cmd, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"generate", {"--prompt", "hi", "--backend", "cuda"}},
           {"eval", {"--prompts", prompts, "--limit", "1", "--backend", "cuda"}}}) {
    const test::RunResult r = run(cmd, extra);
    EXPECT_NE(r.exit_code, 0) << cmd;
#ifdef DFLASH_HAVE_CUDA
    EXPECT_NE(r.err.find("--backend cuda: no CUDA device is visible"), std::string::npos)
        << cmd << ": " << r.err;
#else
    EXPECT_NE(r.err.find("--backend cuda: this dflash was built without CUDA"), std::string::npos)
        << cmd << ": " << r.err;
#endif
    EXPECT_EQ(r.out, "") << cmd << ": nothing may be decoded";
  }
}

TEST_F(DecodeBackendCli, BadBackendsAndCombinationsAreRefused) {
  const test::RunResult tpu = run("generate", {"--prompt", "hi", "--backend", "tpu"});
  EXPECT_NE(tpu.exit_code, 0);
  EXPECT_NE(tpu.err.find("--backend"), std::string::npos) << tpu.err;
  const test::RunResult steps =
      run("generate", {"--prompt", "hi", "--backend", "cuda", "--show-steps"});
  EXPECT_NE(steps.exit_code, 0);
  EXPECT_NE(steps.err.find("--show-steps is not available with --backend cuda"), std::string::npos)
      << steps.err;
  // The CPU backend is the default and still decodes.
  const test::RunResult cpu = run("generate", {"--prompt", "hi", "--backend", "cpu"});
  EXPECT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_NE(cpu.out.find("tokens: "), std::string::npos) << cpu.out;
}

}  // namespace
}  // namespace dflash
