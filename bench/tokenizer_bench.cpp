// Tokenizer throughput on the training corpus: encode every conversation of train.jsonl.xz
// (rendered as ChatML, "<|im_start|>{role}\n{content}<|im_end|>\n" per turn, the same strings
// bench/tokenizer_hf_bench.py gives HF tokenizers) with 1 thread and with all cores (threads take
// documents from a shared counter). Reports MB/s of UTF-8 input and tokens/s, best of --runs.
// Each run starts fresh threads, so the per-thread piece caches start cold every run.
//
// Usage: tokenizer_bench [--model DIR|tokenizer.json|tokenizer.json.xz] [--corpus train.jsonl.xz]
//                        [--runs N] [--threads N] [--hf-python PYTHON]
// Defaults: the real Qwen3 tokenizer and the corpus under ../shared. With --hf-python, the same
// run then executes bench/tokenizer_hf_bench.py with that interpreter (a venv holding
// `tokenizers`, optionally `bpe-qwen`) on the same model and corpus, so the figures sit together.
#include <lzma.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data/tokenizer.hpp"

namespace {

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string maybe_unxz(const std::string& path) {
  std::string in = read_all(path);
  if (path.size() < 3 || path.compare(path.size() - 3, 3, ".xz") != 0) return in;
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
  if (r != LZMA_STREAM_END) throw std::runtime_error("xz decode failed: " + path);
  return out;
}

struct Result {
  double seconds;
  size_t tokens;
};

Result run(const dflash::Tokenizer& tok, const std::vector<std::string>& docs, int threads) {
  std::atomic<size_t> next{0}, tokens{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      size_t local = 0;
      for (size_t i; (i = next.fetch_add(64)) < docs.size();)
        for (size_t k = i; k < std::min(i + 64, docs.size()); ++k)
          local += tok.encode(docs[k]).size();
      tokens += local;
    });
  }
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {s, tokens.load()};
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path src = std::filesystem::path(__FILE__).parent_path().parent_path();
  std::string model = (src / "../shared/fixtures/qwen3-tokenizer/tokenizer.json.xz").string();
  std::string corpus = (src / "../shared/data/train.jsonl.xz").string();
  std::string hf_python;
  int runs = 3;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--model")
      model = v;
    else if (a == "--corpus")
      corpus = v;
    else if (a == "--runs")
      runs = std::stoi(v);
    else if (a == "--threads")
      threads = std::stoi(v);
    else if (a == "--hf-python")
      hf_python = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  // The tokenizer: a folder, a tokenizer.json, or a tokenizer.json.xz (decompressed to /tmp).
  std::string tok_path = model;
  std::filesystem::path tmp;
  if (model.size() > 3 && model.compare(model.size() - 3, 3, ".xz") == 0) {
    tmp = std::filesystem::temp_directory_path() /
          ("dflash-tokbench-" + std::to_string(::getpid()) + ".json");
    std::ofstream(tmp, std::ios::binary) << maybe_unxz(model);
    tok_path = tmp.string();
  }
  const auto tl0 = std::chrono::steady_clock::now();
  const dflash::Tokenizer tok = dflash::Tokenizer::load(tok_path);
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - tl0).count();
  if (!tmp.empty()) std::filesystem::remove(tmp);

  std::vector<std::string> docs;
  size_t bytes = 0;
  {
    std::istringstream lines(maybe_unxz(corpus));
    std::string line;
    while (std::getline(lines, line)) {
      const auto j = nlohmann::json::parse(line);
      std::string d;
      for (const auto& turn : j.at("conversations"))
        d += "<|im_start|>" + turn.at("role").get<std::string>() + "\n" +
             turn.at("content").get<std::string>() + "<|im_end|>\n";
      bytes += d.size();
      docs.push_back(std::move(d));
    }
  }
  std::printf("tokenizer %s (load %.2f s), corpus %s: %zu documents, %.2f MB\n", model.c_str(),
              load_s, corpus.c_str(), docs.size(), bytes / 1e6);
  std::vector<int> counts = {1};
  if (threads > 1) counts.push_back(threads);
  for (int th : counts) {
    Result best{1e30, 0};
    for (int r = 0; r < runs; ++r) {
      const Result res = run(tok, docs, th);
      if (res.seconds < best.seconds) best = res;
    }
    std::printf(
        "dflash  threads %2d: %8.2f MB/s  %10.0f tokens/s  (%zu tokens, best of %d: %.3f s)\n", th,
        bytes / 1e6 / best.seconds, best.tokens / best.seconds, best.tokens, runs, best.seconds);
  }
  if (!hf_python.empty()) {
    std::fflush(stdout);
    const std::string cmd = "'" + hf_python + "' '" +
                            (src / "bench/tokenizer_hf_bench.py").string() + "' --model '" + model +
                            "' --corpus '" + corpus + "' --runs " + std::to_string(runs);
    return std::system(cmd.c_str()) == 0 ? 0 : 1;
  }
  return 0;
}
