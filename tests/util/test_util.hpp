// dflash.cpp — helpers shared by the C++ tests: fixture paths, temporary folders, running the
// `dflash` binary, tolerance checks and guard regions.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/config.hpp"
#include "model/drafter_io.hpp"
#include "model/target.hpp"

namespace dflash::test {

namespace fs = std::filesystem;

/// The repository root: $DFLASH_TEST_SOURCE_DIR if set (binaries run on another machine), else
/// the compile-time path.
fs::path source_dir();
/// The shared fixtures folder: $DFLASH_SHARED_DIR if set, else the configured ../shared. Fails the
/// test (fatal) when it does not exist.
fs::path shared_dir();
/// The project's embedded assets: source_dir()/assets.
fs::path assets_dir();
/// A fresh, empty temporary folder removed when the returned object is destroyed (by the process
/// that made it: a forked child that runs destructors leaves it alone).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
  pid_t owner_;
};

/// The dflash binary the tests run: $DFLASH_TEST_BINARY, else the one built beside the tests.
std::string dflash_binary();

/// Result of running the dflash binary.
struct RunResult {
  int exit_code = -1;
  std::string out;  ///< stdout
  std::string err;  ///< stderr
};
/// Runs the `dflash` binary ($DFLASH_TEST_BINARY if set, else the one built with the tests) with
/// `args` (shell-quoted for you), optional stdin text.
RunResult run_dflash(const std::vector<std::string>& args, const std::string& stdin_text = "");

/// `dflash eval` and `generate --backend cuda` with `drafter` on the tiny target do not refuse it:
/// each either decodes (exit 0, on a GPU machine) or stops for want of a device or of CUDA in the
/// build, and its error never contains `refusal` (the text of a refusal by drafter kind).
void expect_cuda_decoding_accepted(const fs::path& drafter, const std::string& refusal);

/// Starts the `dflash` binary (as run_dflash) with `args` in the background, its stderr (and
/// stdout) into `log`, with `env` entries ("KEY=VALUE") added to its environment; returns its pid.
/// The child is killed (SIGKILL) when the test process dies, so a test killed by its timeout leaves
/// no run behind.
pid_t spawn_dflash(const std::vector<std::string>& args, const fs::path& log,
                   const std::vector<std::string>& env = {});

/// Starts `program` with `args` as spawn_dflash starts the dflash binary (output into `log`,
/// `env` added, killed when the test process dies); returns its pid.
pid_t spawn_program(const std::string& program, const std::vector<std::string>& args,
                    const fs::path& log, const std::vector<std::string>& env = {});

/// Limits on a spawned run (wait_exit): how long it may take and how large its log may grow.
struct RunLimits {
  double timeout_s = 300;                   ///< seconds from the call to the exit
  std::uintmax_t max_log_bytes = 1u << 20;  ///< a larger log counts as runaway output
};
/// Waits for process `pid` to end; its exit code, or 128 + the signal that killed it. A run that
/// passes a limit of `limits` (its log `log`, when given, larger than max_log_bytes; still running
/// after timeout_s) is killed with SIGKILL, reaped, and the test fails (non-fatal) saying which
/// limit; the return is then 128 + SIGKILL.
int wait_exit(pid_t pid, const fs::path& log = {}, const RunLimits& limits = {});

/// Writes `bytes` to `path` (binary).
void write_file(const fs::path& path, const std::string& bytes);
/// Reads a whole file.
std::string read_file(const fs::path& path);
/// Reads and decompresses a whole .xz file (e.g. the real Qwen3 tokenizer fixture); throws
/// std::runtime_error naming the file when it is not a valid xz stream.
std::string xz_decompress(const fs::path& path);

/// A plain JSONL file holding the first 200 conversations of the bundled corpus
/// (assets/data/train.jsonl.xz), written once per process into a temporary folder that lives until
/// exit: small training runs for the trainer tests.
const fs::path& small_corpus();

/// Relative Frobenius error ||a-b|| / max(||b||, tiny), computed in double. Shapes must match.
double rel_error(const Tensor& a, const Tensor& b);
double rel_error(const std::vector<float>& a, const std::vector<float>& b);

/// Guard region: a buffer of `n` payload floats followed by `guard` floats holding a fixed
/// pattern; `intact()` checks that nothing was written past the payload.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t n, size_t guard = 64);
  float* data() { return buf_.data(); }
  size_t size() const { return n_; }
  bool intact() const;

 private:
  size_t n_;
  std::vector<float> buf_;
};

/// Saves an untrained drafter for `target` into `dir` in the export format (f32): `layers`
/// layers of `sizes`, mask id 8000, tap ids `taps` (the default ones when absent), parameters from
/// drafter_init with `seed`. For decoding tests that need a drafter, not a good one.
void save_random_drafter(const fs::path& dir, const ModelConfig& target, int layers,
                         const DrafterSizes& sizes, uint64_t seed,
                         std::optional<std::vector<int>> taps = std::nullopt);

/// The records of RUN_DIR/metrics.jsonl, in file order, without the fields that depend on wall
/// time (throughput, seconds per step and phase, resident memory, busy fractions, queue depths):
/// what two runs of the same data and seed must agree on. Fails the test on an unreadable file.
std::vector<nlohmann::json> deterministic_metrics(const std::filesystem::path& run_dir);

/// Whether this build has CUDA and a CUDA device is visible (tests of `--backend cuda` paths
/// that need no GPU check the error they give without one).
bool gpu_visible();

/// The tiny Qwen3 fixture's folder (assets/tiny-qwen3: a real 6-layer checkpoint and tokenizer).
const fs::path& tiny_qwen3_dir();
/// The tiny Qwen3 target loaded once per test process with f32 weight copies (the same results
/// as the bf16 views, without per-call conversion): the decoding tests' reference target.
const TargetModel& tiny_qwen3_f32();

/// The upper 1e-4 quantile of the chi-square distribution with `df` degrees of freedom, by the
/// Wilson–Hilferty cube-root normal approximation (Wilson & Hilferty 1931): the critical value
/// of the sampling tests' Pearson statistic.
double chi2_critical_1e4(int df);

/// Pearson's chi-square statistic Σ (O − E)² / E of `counts` (observed per category) against
/// `probs` (expected probability per category, same length) over `n` draws. A category with
/// E = 0 but some observation gives +∞ (a draw the distribution cannot produce); E = 0 and O = 0
/// adds nothing.
double chi2_stat(const std::vector<int64_t>& counts, const std::vector<double>& probs, int64_t n);

}  // namespace dflash::test
