#include "util/test_util.hpp"

#include <lzma.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "model/drafter_io.hpp"

#ifdef DFLASH_HAVE_CUDA
#include "backend/cuda/device.hpp"
#endif

namespace dflash::test {

fs::path source_dir() {
  const char* env = std::getenv("DFLASH_TEST_SOURCE_DIR");
  return fs::path(env && *env ? env : DFLASH_SOURCE_DIR);
}

std::string dflash_binary() {
  const char* env = std::getenv("DFLASH_TEST_BINARY");
  return env && *env ? env : DFLASH_BINARY_PATH;
}

fs::path shared_dir() {
  const char* env = std::getenv("DFLASH_SHARED_DIR");
  fs::path p = env ? fs::path(env) : fs::path(DFLASH_SHARED_DIR_DEFAULT);
  if (!fs::exists(p / "fixtures")) {
    ADD_FAILURE() << "shared fixtures not found at " << p
                  << " (set DFLASH_SHARED_DIR or -DDFLASH_SHARED_DIR=...)";
    throw std::runtime_error("shared fixtures missing");
  }
  return p;
}

fs::path assets_dir() {
  return source_dir() / "assets";
}

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "dflash-test-XXXXXX").string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  char* p = mkdtemp(buf.data());
  if (!p) throw std::runtime_error("mkdtemp failed");
  path_ = p;
  owner_ = ::getpid();
}

TempDir::~TempDir() {
  if (::getpid() != owner_) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
}

namespace {
std::string shell_quote(const std::string& s) {
  std::string r = "'";
  for (char c : s) {
    if (c == '\'')
      r += "'\\''";
    else
      r += c;
  }
  return r + "'";
}
}  // namespace

RunResult run_dflash(const std::vector<std::string>& args, const std::string& stdin_text) {
  TempDir tmp;
  std::string cmd = shell_quote(dflash_binary());
  for (const auto& a : args) cmd += " " + shell_quote(a);
  write_file(tmp / "in", stdin_text);
  cmd += " <" + shell_quote((tmp / "in").string()) + " >" + shell_quote((tmp / "out").string()) +
         " 2>" + shell_quote((tmp / "err").string());
  int st = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.out = read_file(tmp / "out");
  r.err = read_file(tmp / "err");
  return r;
}

void expect_cuda_decoding_accepted(const fs::path& drafter, const std::string& refusal) {
  for (const std::string cmd : {"eval", "generate"}) {
    std::vector<std::string> args = {cmd,         "--target",         tiny_qwen3_dir().string(),
                                     "--drafter", drafter.string(),   "--backend",
                                     "cuda",      "--max-new-tokens", "4"};
    if (cmd == "eval") {
      args.insert(args.end(), {"--prompts", (assets_dir() / "data" / "eval_prompts.jsonl").string(),
                               "--limit", "2"});
    } else {
      args.insert(args.end(), {"--prompt", "hi"});
    }
    const RunResult r = run_dflash(args);
    EXPECT_EQ(r.err.find(refusal), std::string::npos) << cmd << ": " << r.err;
    if (r.exit_code != 0)
      EXPECT_TRUE(r.err.find("no CUDA device is visible") != std::string::npos ||
                  r.err.find("built without CUDA") != std::string::npos)
          << cmd << ": " << r.err;
  }
}

pid_t spawn_dflash(const std::vector<std::string>& args, const fs::path& log,
                   const std::vector<std::string>& env) {
  return spawn_program(dflash_binary(), args, log, env);
}

pid_t spawn_program(const std::string& program, const std::vector<std::string>& args,
                    const fs::path& log, const std::vector<std::string>& env) {
  std::vector<std::string> argv_s = {program};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s = env;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Dies with the test process (and not after it: the parent may be gone already).
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) std::_Exit(125);
    for (auto& e : env_s) ::putenv(e.data());
    if (std::freopen(log.c_str(), "w", stderr) == nullptr) std::_Exit(126);
    ::dup2(::fileno(stderr), STDOUT_FILENO);
    ::execv(argv[0], argv.data());
    std::_Exit(127);
  }
  return pid;
}

int wait_exit(pid_t pid, const fs::path& log, const RunLimits& limits) {
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + std::chrono::duration<double>(limits.timeout_s);
  int st = 0;
  for (;;) {
    const pid_t done = ::waitpid(pid, &st, WNOHANG);
    if (done == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::error_code ec;
    const std::uintmax_t bytes = log.empty() ? 0 : fs::file_size(log, ec);
    const bool runaway = !ec && bytes > limits.max_log_bytes;
    if (runaway || Clock::now() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      if (runaway) {
        ADD_FAILURE() << "dflash (pid " << pid << ") wrote more than " << limits.max_log_bytes
                      << " bytes to " << log << "; killed";
      } else {
        ADD_FAILURE() << "dflash (pid " << pid << ") still running after " << limits.timeout_s
                      << " s; killed";
      }
      return 128 + SIGKILL;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string xz_decompress(const fs::path& p) {
  const std::string in = read_file(p);
  lzma_stream s = LZMA_STREAM_INIT;
  if (lzma_stream_decoder(&s, UINT64_MAX, 0) != LZMA_OK) throw std::runtime_error("lzma init");
  std::string out;
  std::vector<uint8_t> buf(1 << 20);
  s.next_in = reinterpret_cast<const uint8_t*>(in.data());
  s.avail_in = in.size();
  lzma_ret r = LZMA_OK;
  while (r == LZMA_OK) {
    s.next_out = buf.data();
    s.avail_out = buf.size();
    r = lzma_code(&s, LZMA_FINISH);
    out.append(reinterpret_cast<const char*>(buf.data()), buf.size() - s.avail_out);
  }
  lzma_end(&s);
  if (r != LZMA_STREAM_END) throw std::runtime_error("xz decode failed: " + p.string());
  return out;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

const fs::path& small_corpus() {
  static TempDir dir;  // removed at exit
  static const fs::path path = [] {
    const std::string text = xz_decompress(assets_dir() / "data" / "train.jsonl.xz");
    size_t pos = 0;  // just past the last newline taken
    for (int lines = 0; lines < 200; ++lines) {
      const size_t nl = text.find('\n', pos);
      if (nl == std::string::npos) throw std::runtime_error("the corpus has fewer than 200 lines");
      pos = nl + 1;
    }
    fs::path out = dir.path() / "small.jsonl";
    write_file(out, text.substr(0, pos));
    return out;
  }();
  return path;
}

double rel_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape()) << a.str() << " vs " << b.str();
  return rel_error(a.to_f32_vector(), b.to_f32_vector());
}

GuardedBuffer::GuardedBuffer(size_t n, size_t guard) : n_(n), buf_(n + guard) {
  for (size_t i = n; i < buf_.size(); ++i) {
    uint32_t bits = 0x7fc0beefu ^ static_cast<uint32_t>(i);
    std::memcpy(&buf_[i], &bits, 4);
  }
}

bool GuardedBuffer::intact() const {
  for (size_t i = n_; i < buf_.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &buf_[i], 4);
    if (bits != (0x7fc0beefu ^ static_cast<uint32_t>(i))) return false;
  }
  return true;
}

void save_random_drafter(const fs::path& dir, const ModelConfig& target, int layers,
                         const DrafterSizes& sizes, uint64_t seed,
                         std::optional<std::vector<int>> taps) {
  const DrafterConfig c = drafter_config_for_target(target, layers, sizes, 8000, std::move(taps));
  const DrafterLayout layout(c);
  std::vector<float> params(static_cast<size_t>(layout.total));
  drafter_init(params, layout, seed);
  drafter_save(dir, c, layout, params, DType::f32);
}

std::vector<nlohmann::json> deterministic_metrics(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::istringstream in(read_file(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    for (const char* k : {"tokens_per_s", "supervised_tokens_per_s", "s_per_step", "s_data",
                          "s_target", "s_drafter", "rss_bytes", "target_busy", "drafter_busy",
                          "queue_depth", "checkpoint_state_s"}) {
      j.erase(k);
    }
    out.push_back(j);
  }
  return out;
}

bool gpu_visible() {
#ifdef DFLASH_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

const fs::path& tiny_qwen3_dir() {
  static const fs::path p = assets_dir() / "tiny-qwen3";
  return p;
}

const TargetModel& tiny_qwen3_f32() {
  static const TargetModel m =
      TargetModel::load(tiny_qwen3_dir(), TargetLoadOptions{.f32_weights = true});
  return m;
}

double chi2_critical_1e4(int df) {
  const double z = 3.7190164854556804;  // the standard normal's upper 1e-4 quantile
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

double chi2_stat(const std::vector<int64_t>& counts, const std::vector<double>& probs, int64_t n) {
  double s = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probs[i] * static_cast<double>(n);
    if (e <= 0) {
      if (counts[i] > 0) return INFINITY;
      continue;
    }
    s += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
  }
  return s;
}

}  // namespace dflash::test
