// dflash.cpp — tokenized dataset and its cache file (see dataset.hpp for the invariants and
// layout).
#include "data/dataset.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/log.hpp"
#include "data/conversation.hpp"
#include "data/jsonl.hpp"

namespace dflash {

static_assert(std::endian::native == std::endian::little, "the cache format is little-endian");

namespace {

constexpr char kMagic[8] = {'D', 'F', 'T', 'O', 'K', 'v', '1', '\0'};
constexpr int kFormat = 1;
constexpr size_t kAlign = 64;
constexpr size_t kMaxExamples = 10;

size_t align_up(size_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}

std::string hex64(uint64_t h) {
  return fmt::format("{:016x}", h);
}

uint64_t parse_hex64(const nlohmann::json& j, const char* key) {
  const std::string s = json_string(j, key, "cache key");
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  DFLASH_CHECK(s.size() == 16 && ec == std::errc() && end == s.data() + s.size(),
               "cache key: '{}' must be 16 hex digits, got '{}'", key, s);
  return v;
}

}  // namespace

// ------------------------------------------------------------------ masks and hashing

std::vector<uint8_t> loss_mask_from_spans(const std::vector<std::pair<size_t, size_t>>& offsets,
                                          const std::vector<ByteSpan>& spans) {
  std::vector<uint8_t> mask(offsets.size(), 0);
  for (size_t i = 0; i < offsets.size(); ++i) {
    auto [b, e] = offsets[i];
    // The last span starting at or before b.
    auto it = std::upper_bound(spans.begin(), spans.end(), b,
                               [](size_t v, const ByteSpan& s) { return v < s.begin; });
    if (it == spans.begin()) continue;
    --it;
    bool inside = (b < e) ? (e <= it->end) : (b < it->end);
    mask[i] = inside ? 1 : 0;
  }
  return mask;
}

TokenizedDoc tokenize_rendered(const RenderedChat& chat, const EncodeFn& encode) {
  std::vector<std::pair<size_t, size_t>> offsets;
  TokenizedDoc d;
  d.tokens = encode(chat.text, &offsets);
  DFLASH_ASSERT(offsets.size() == d.tokens.size());
  d.loss_mask = loss_mask_from_spans(offsets, chat.supervised);
  return d;
}

uint64_t hash_bytes(std::string_view bytes, uint64_t h) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t hash_file(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  DFLASH_CHECK(f.good(), "{}: cannot open", path.string());
  std::string buf(1 << 20, '\0');
  uint64_t h = 0xcbf29ce484222325ull;
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h = hash_bytes(std::string_view(buf.data(), static_cast<size_t>(f.gcount())), h);
  }
  DFLASH_CHECK(f.eof(), "{}: read error", path.string());
  return h;
}

// ------------------------------------------------------------------ key and stats

bool CacheKey::matches(const CacheKey& o) const {
  return data_hash == o.data_hash && tokenizer_hash == o.tokenizer_hash &&
         template_fingerprint == o.template_fingerprint && max_length == o.max_length &&
         format == o.format;
}

std::string CacheKey::diff(const CacheKey& req) const {
  std::vector<std::string> d;
  if (format != req.format) d.push_back(fmt::format("cache format {} -> {}", format, req.format));
  if (data_hash != req.data_hash) d.push_back("data file contents");
  if (tokenizer_hash != req.tokenizer_hash) d.push_back("tokenizer.json");
  if (template_fingerprint != req.template_fingerprint) {
    d.push_back(fmt::format("template {} -> {}", template_fingerprint, req.template_fingerprint));
  }
  if (max_length != req.max_length) {
    d.push_back(fmt::format("max length {} -> {}", max_length, req.max_length));
  }
  std::string out;
  for (const auto& s : d) out += (out.empty() ? "" : ", ") + s;
  return out;
}

nlohmann::json CacheKey::to_json() const {
  return {{"data_file", data_file},
          {"data_hash", hex64(data_hash)},
          {"tokenizer_hash", hex64(tokenizer_hash)},
          {"template", template_fingerprint},
          {"max_length", max_length},
          {"format", format}};
}

CacheKey CacheKey::from_json(const nlohmann::json& j) {
  const std::string src = "cache key";
  CacheKey k;
  k.data_file = json_string(j, "data_file", src);
  k.data_hash = parse_hex64(j, "data_hash");
  k.tokenizer_hash = parse_hex64(j, "tokenizer_hash");
  k.template_fingerprint = json_string(j, "template", src);
  k.max_length = json_int(j, "max_length", src, 1);
  k.format = static_cast<int>(json_int(j, "format", src, 0, INT32_MAX));
  return k;
}

nlohmann::json DatasetStats::to_json() const {
  return {{"records", records},
          {"conversations", conversations},
          {"skipped_invalid", skipped_invalid},
          {"zero_supervised", zero_supervised},
          {"truncated", truncated},
          {"truncated_tokens", truncated_tokens},
          {"tokens", tokens},
          {"supervised_tokens", supervised_tokens},
          {"min_length", min_length},
          {"max_length", max_length},
          {"invalid_by_kind", invalid_by_kind},
          {"invalid_examples", invalid_examples},
          {"zero_supervised_examples", zero_supervised_examples},
          {"hist_upper", hist_upper},
          {"hist_count", hist_count}};
}

DatasetStats DatasetStats::from_json(const nlohmann::json& j) {
  const std::string src = "cache stats";
  auto count = [&](const char* key) { return json_int(j, key, src, 0); };
  auto counts = [&](const char* key) {
    const nlohmann::json& a = json_member(j, key, src);
    DFLASH_CHECK(a.is_array(), "{}: key '{}' must be a list of counts", src, key);
    std::vector<int64_t> v;
    for (const auto& x : a) {
      DFLASH_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0,
                   "{}: key '{}' must hold non-negative integers, got {}", src, key, x.dump());
      v.push_back(x.get<int64_t>());
    }
    return v;
  };
  auto strings = [&](const char* key) {
    const nlohmann::json& a = json_member(j, key, src);
    DFLASH_CHECK(a.is_array() &&
                     std::all_of(a.begin(), a.end(), [](const auto& x) { return x.is_string(); }),
                 "{}: key '{}' must be a list of strings", src, key);
    return a.get<std::vector<std::string>>();
  };
  DatasetStats s;
  s.records = count("records");
  s.conversations = count("conversations");
  s.skipped_invalid = count("skipped_invalid");
  s.zero_supervised = count("zero_supervised");
  s.truncated = count("truncated");
  s.truncated_tokens = count("truncated_tokens");
  s.tokens = count("tokens");
  s.supervised_tokens = count("supervised_tokens");
  s.min_length = count("min_length");
  s.max_length = count("max_length");
  const nlohmann::json& kinds = json_member(j, "invalid_by_kind", src);
  DFLASH_CHECK(kinds.is_object(), "{}: key 'invalid_by_kind' must be an object", src);
  for (const auto& [kind, n] : kinds.items())
    s.invalid_by_kind[kind] = json_int(kinds, kind, src, 0);
  s.invalid_examples = strings("invalid_examples");
  s.zero_supervised_examples = strings("zero_supervised_examples");
  s.hist_upper = counts("hist_upper");
  s.hist_count = counts("hist_count");
  DFLASH_CHECK(s.hist_upper.size() == s.hist_count.size(),
               "{}: the length histogram has {} bounds but {} counts", src, s.hist_upper.size(),
               s.hist_count.size());
  return s;
}

std::string DatasetStats::report() const {
  std::string r;
  auto pct = [](int64_t a, int64_t b) { return b > 0 ? 100.0 * static_cast<double>(a) / b : 0.0; };
  r += fmt::format("records read        {:>12}\n", records);
  r += fmt::format("conversations kept  {:>12}\n", conversations);
  r += fmt::format("tokens              {:>12}\n", tokens);
  r += fmt::format("supervised tokens   {:>12}  ({:.1f} % of tokens)\n", supervised_tokens,
                   pct(supervised_tokens, tokens));
  r += fmt::format("skipped (invalid)   {:>12}", skipped_invalid);
  for (const auto& [k, n] : invalid_by_kind) r += fmt::format("  {}={}", k, n);
  r += "\n";
  r += fmt::format("zero supervised     {:>12}  (left out)\n", zero_supervised);
  r += fmt::format("truncated           {:>12}  ({} tokens cut)\n", truncated, truncated_tokens);
  if (conversations > 0) {
    r += fmt::format("length min/mean/max {:>6} / {:.1f} / {}\n", min_length,
                     static_cast<double>(tokens) / conversations, max_length);
  }
  r += "length histogram (tokens per conversation):\n";
  int64_t lo = 0;
  int64_t peak = 1;
  for (int64_t c : hist_count) peak = std::max(peak, c);
  for (size_t k = 0; k < hist_upper.size(); ++k) {
    if (hist_count[k] > 0) {
      int bar = static_cast<int>(40.0 * static_cast<double>(hist_count[k]) / peak + 0.5);
      r += fmt::format("  {:>6} - {:<6} {:>10}  {:5.1f} % {}\n", lo + 1, hist_upper[k],
                       hist_count[k], pct(hist_count[k], conversations), std::string(bar, '#'));
    }
    lo = hist_upper[k];
  }
  for (const auto& e : invalid_examples) r += "  invalid: " + e + "\n";
  for (const auto& e : zero_supervised_examples) r += "  no supervised token: " + e + "\n";
  return r;
}

// ------------------------------------------------------------------ TokenDataset

struct TokenDataset::Impl {
  const int32_t* tokens = nullptr;
  const uint8_t* mask = nullptr;
  const int64_t* offsets = nullptr;  // n_docs + 1
  const int64_t* lines = nullptr;    // n_docs (may be null)
  int64_t n_docs = 0;
  int64_t n_tokens = 0;
  DatasetStats stats;
  CacheKey key;
  std::shared_ptr<void> keepalive;  // the mapping or the in-memory vectors
};

namespace {

struct Mapping {
  void* addr = nullptr;
  size_t len = 0;
  ~Mapping() {
    if (addr && addr != MAP_FAILED) munmap(addr, len);
  }
};

struct MemoryDocs {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets;
};

}  // namespace

TokenDataset TokenDataset::open(const std::filesystem::path& path) {
  const std::string p = path.string();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK(fd >= 0, "{}: cannot open: {}", p, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fail("{}: cannot stat", p);
  }
  auto map = std::make_shared<Mapping>();
  map->len = static_cast<size_t>(st.st_size);
  if (map->len < 16) {
    ::close(fd);
    fail("{}: not a dflash token cache (file too short)", p);
  }
  map->addr = mmap(nullptr, map->len, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  DFLASH_CHECK(map->addr != MAP_FAILED, "{}: mmap failed: {}", p, std::strerror(errno));
  const char* base = static_cast<const char*>(map->addr);
  DFLASH_CHECK(std::memcmp(base, kMagic, 8) == 0, "{}: not a dflash token cache (bad magic)", p);
  uint64_t json_len;
  std::memcpy(&json_len, base + 8, 8);
  DFLASH_CHECK(json_len <= map->len - 16, "{}: truncated cache header", p);
  const nlohmann::json h =
      json_parse_strict(std::string_view(base + 16, json_len), p + " (header)");
  auto impl = std::make_shared<Impl>();
  try {
    impl->key = CacheKey::from_json(json_member(h, "key", "cache header"));
    impl->stats = DatasetStats::from_json(json_member(h, "stats", "cache header"));
    DFLASH_CHECK(impl->key.format == kFormat, "cache format {} (this build reads {})",
                 impl->key.format, kFormat);
    // Counts no larger than the file could hold, so that no size below overflows.
    const auto max_count = static_cast<int64_t>(map->len);
    impl->n_docs = json_int(h, "n_docs", "cache header", 0, max_count);
    impl->n_tokens = json_int(h, "n_tokens", "cache header", 0, max_count);
    const size_t data_start = align_up(16 + json_len);
    const nlohmann::json& sec = json_member(h, "sections", "cache header");
    auto section = [&](const char* name, size_t elem, int64_t count) -> const char* {
      const nlohmann::json& e = json_member(sec, name, "cache sections");
      const uint64_t off = json_uint(e, "offset", name), bytes = json_uint(e, "bytes", name);
      const uint64_t want = elem * static_cast<uint64_t>(count);
      DFLASH_CHECK(bytes == want, "section '{}' has {} bytes, want {}", name, bytes, want);
      DFLASH_CHECK(off % kAlign == 0 && data_start <= map->len && off <= map->len - data_start &&
                       bytes <= map->len - data_start - off,
                   "section '{}' lies outside the file (truncated cache?)", name);
      return base + data_start + off;
    };
    impl->tokens = reinterpret_cast<const int32_t*>(section("tokens", 4, impl->n_tokens));
    impl->mask = reinterpret_cast<const uint8_t*>(section("loss_mask", 1, impl->n_tokens));
    impl->offsets = reinterpret_cast<const int64_t*>(section("doc_offsets", 8, impl->n_docs + 1));
    impl->lines = reinterpret_cast<const int64_t*>(section("source_lines", 8, impl->n_docs));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: corrupt cache header: {}", p, e.what());
  } catch (const Error& e) {
    throw e.with_context(p);
  }
  DFLASH_CHECK(impl->offsets[0] == 0 && impl->offsets[impl->n_docs] == impl->n_tokens,
               "{}: corrupt cache (document offsets do not span the tokens)", p);
  for (int64_t i = 0; i < impl->n_docs; ++i) {
    DFLASH_CHECK(impl->offsets[i] < impl->offsets[i + 1],
                 "{}: corrupt cache (document {} is empty or offsets decrease)", p, i);
  }
  // Token ids index embedding rows and mask values weight the loss: both are checked once here
  // (the vocabulary bound is the trainer's, which knows the target).
  for (int64_t t = 0; t < impl->n_tokens; ++t) {
    DFLASH_CHECK(impl->tokens[t] >= 0 && impl->mask[t] <= 1,
                 "{}: corrupt cache (token {} has id {} and loss mask {})", p, t, impl->tokens[t],
                 impl->mask[t]);
  }
  impl->keepalive = map;
  TokenDataset d;
  d.impl_ = std::move(impl);
  return d;
}

TokenDataset TokenDataset::from_docs(const std::vector<TokenizedDoc>& docs) {
  auto mem = std::make_shared<MemoryDocs>();
  mem->offsets.push_back(0);
  auto impl = std::make_shared<Impl>();
  uint64_t h = hash_bytes("in-memory");
  for (const auto& d : docs) {
    DFLASH_CHECK(!d.tokens.empty() && d.tokens.size() == d.loss_mask.size(),
                 "from_docs: document {} is empty or its mask length differs",
                 mem->offsets.size() - 1);
    mem->tokens.insert(mem->tokens.end(), d.tokens.begin(), d.tokens.end());
    mem->mask.insert(mem->mask.end(), d.loss_mask.begin(), d.loss_mask.end());
    mem->offsets.push_back(static_cast<int64_t>(mem->tokens.size()));
    h = hash_bytes(
        std::string_view(reinterpret_cast<const char*>(d.tokens.data()), d.tokens.size() * 4), h);
    h = hash_bytes(
        std::string_view(reinterpret_cast<const char*>(d.loss_mask.data()), d.loss_mask.size()), h);
    h = hash_bytes("|", h);
  }
  impl->tokens = mem->tokens.data();
  impl->mask = mem->mask.data();
  impl->offsets = mem->offsets.data();
  impl->n_docs = static_cast<int64_t>(docs.size());
  impl->n_tokens = static_cast<int64_t>(mem->tokens.size());
  impl->key.data_file = "<memory>";
  impl->key.data_hash = h;
  impl->stats.conversations = impl->n_docs;
  impl->stats.tokens = impl->n_tokens;
  for (uint8_t m : mem->mask) impl->stats.supervised_tokens += m;
  impl->keepalive = mem;
  TokenDataset d;
  d.impl_ = std::move(impl);
  return d;
}

int64_t TokenDataset::num_docs() const {
  return impl_ ? impl_->n_docs : 0;
}
int64_t TokenDataset::num_tokens() const {
  return impl_ ? impl_->n_tokens : 0;
}
int64_t TokenDataset::doc_length(int64_t i) const {
  DFLASH_ASSERT(impl_ && i >= 0 && i < impl_->n_docs);
  return impl_->offsets[i + 1] - impl_->offsets[i];
}
std::span<const int32_t> TokenDataset::doc_tokens(int64_t i) const {
  return {impl_->tokens + impl_->offsets[i], static_cast<size_t>(doc_length(i))};
}
std::span<const uint8_t> TokenDataset::doc_loss_mask(int64_t i) const {
  return {impl_->mask + impl_->offsets[i], static_cast<size_t>(doc_length(i))};
}
int64_t TokenDataset::doc_source_line(int64_t i) const {
  DFLASH_ASSERT(impl_ && i >= 0 && i < impl_->n_docs);
  return impl_->lines ? impl_->lines[i] : 0;
}
const DatasetStats& TokenDataset::stats() const {
  DFLASH_ASSERT(impl_);
  return impl_->stats;
}
const CacheKey& TokenDataset::key() const {
  DFLASH_ASSERT(impl_);
  return impl_->key;
}
uint64_t TokenDataset::fingerprint() const {
  DFLASH_ASSERT(impl_);
  const CacheKey& k = impl_->key;
  uint64_t h = hash_bytes(hex64(k.data_hash));
  h = hash_bytes(hex64(k.tokenizer_hash), h);
  h = hash_bytes(k.template_fingerprint, h);
  return hash_bytes(std::to_string(k.max_length), h);
}

// ------------------------------------------------------------------ cache I/O

std::filesystem::path default_cache_path(const std::filesystem::path& data,
                                         const std::filesystem::path& model_dir,
                                         const ChatTemplate& t, int64_t max_length) {
  std::filesystem::path dir;
  if (const char* d = std::getenv("DFLASH_CACHE_DIR"); d && *d) {
    dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    dir = std::filesystem::path(x) / "dflash";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    dir = std::filesystem::path(h) / ".cache" / "dflash";
  } else {
    fail("no cache folder: set DFLASH_CACHE_DIR or HOME, or pass --cache");
  }
  return cache_path_in(dir, data, model_dir, t, max_length);
}

std::filesystem::path cache_path_in(const std::filesystem::path& dir,
                                    const std::filesystem::path& data,
                                    const std::filesystem::path& model_dir, const ChatTemplate& t,
                                    int64_t max_length) {
  uint64_t h = hash_bytes(std::filesystem::absolute(data).lexically_normal().string());
  h = hash_bytes("\n" + std::filesystem::absolute(model_dir).lexically_normal().string(), h);
  h = hash_bytes("\n" + t.fingerprint(), h);
  h = hash_bytes(fmt::format("\nmax_length={}", max_length), h);
  return dir / fmt::format("{}-{:016x}.dftok", data.filename().string(), h);
}

std::filesystem::path run_cache_path(const std::string& cache_dir,
                                     const std::filesystem::path& output_dir,
                                     const std::filesystem::path& data,
                                     const std::filesystem::path& model_dir, const ChatTemplate& t,
                                     int64_t max_length) {
  const std::filesystem::path dir =
      cache_dir.empty() ? output_dir / "cache" : std::filesystem::path(cache_dir);
  return cache_path_in(dir, data, model_dir, t, max_length);
}

std::optional<CacheKey> read_cache_key(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f.good()) return std::nullopt;
  char magic[8];
  uint64_t json_len = 0;
  if (!f.read(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) return std::nullopt;
  if (!f.read(reinterpret_cast<char*>(&json_len), 8) || json_len > (1u << 30)) return std::nullopt;
  std::string js(json_len, '\0');
  if (!f.read(js.data(), static_cast<std::streamsize>(json_len))) return std::nullopt;
  try {
    return CacheKey::from_json(nlohmann::json::parse(js).at("key"));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

namespace {

struct Built {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> lines;
  DatasetStats stats;
};

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    DFLASH_CHECK(w > 0, "{}: write failed: {}", path, std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void write_cache(const std::filesystem::path& path, const CacheKey& key, const Built& b) {
  struct Sec {
    const char* name;
    const void* data;
    size_t bytes;
    size_t offset = 0;
  };
  std::vector<Sec> secs = {
      {"tokens", b.tokens.data(), b.tokens.size() * 4},
      {"loss_mask", b.mask.data(), b.mask.size()},
      {"doc_offsets", b.offsets.data(), b.offsets.size() * 8},
      {"source_lines", b.lines.data(), b.lines.size() * 8},
  };
  size_t off = 0;
  nlohmann::json sj = nlohmann::json::object();
  for (auto& s : secs) {
    s.offset = off;
    sj[s.name] = {{"offset", off}, {"bytes", s.bytes}};
    off = align_up(off + s.bytes);
  }
  nlohmann::json h = {{"key", key.to_json()},
                      {"stats", b.stats.to_json()},
                      {"n_docs", static_cast<int64_t>(b.lines.size())},
                      {"n_tokens", static_cast<int64_t>(b.tokens.size())},
                      {"sections", sj}};
  const std::string js = h.dump();
  const uint64_t json_len = js.size();
  const size_t data_start = align_up(16 + js.size());

  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  const std::string tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DFLASH_CHECK(fd >= 0, "{}: cannot create: {}", tmp, std::strerror(errno));
  try {
    const std::string zeros(kAlign, '\0');
    write_all(fd, kMagic, 8, tmp);
    write_all(fd, &json_len, 8, tmp);
    write_all(fd, js.data(), js.size(), tmp);
    write_all(fd, zeros.data(), data_start - 16 - js.size(), tmp);
    size_t pos = 0;
    for (const auto& s : secs) {
      write_all(fd, zeros.data(), s.offset - pos, tmp);
      write_all(fd, s.data, s.bytes, tmp);
      pos = s.offset + s.bytes;
    }
    DFLASH_CHECK(::fsync(fd) == 0, "{}: fsync failed: {}", tmp, std::strerror(errno));
  } catch (...) {
    ::close(fd);
    std::filesystem::remove(tmp);
    throw;
  }
  ::close(fd);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    fail("{}: cannot rename the new cache into place: {}", path.string(), ec.message());
  }
}

bool is_blank_line(const std::string& s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// One record's outcome, computed by a worker thread.
struct Outcome {
  bool ok = false;
  RecordErrorKind kind = RecordErrorKind::invalid_json;
  std::string error;
  std::string id;
  TokenizedDoc doc;
};

Built build(const PrepareOptions& opts) {
  Built b;
  DatasetStats& st = b.stats;
  const int64_t max_len = opts.max_length;
  std::vector<int64_t> uppers;
  for (int64_t u = 16;; u *= 2) {
    uppers.push_back(std::min(u, max_len));
    if (u >= max_len) break;
  }
  st.hist_upper = uppers;
  st.hist_count.assign(uppers.size(), 0);

  int threads =
      opts.threads > 0 ? opts.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(threads, 1);
  LineReader reader(opts.data);
  const std::string file = opts.data.string();
  constexpr size_t kBatch = 8192;
  std::vector<std::pair<int64_t, std::string>> lines;
  std::vector<Outcome> out;
  std::string line;
  ProgressBar bar("tokenizing " + opts.data.filename().string(), 0, "conversations");
  bool more = true;
  while (more) {
    lines.clear();
    while (lines.size() < kBatch && (more = reader.next(line))) {
      if (is_blank_line(line)) continue;
      lines.emplace_back(reader.line_number(), line);
    }
    if (lines.empty()) break;
    out.assign(lines.size(), Outcome{});
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (;;) {
        size_t i = next.fetch_add(16);
        if (i >= lines.size()) return;
        for (size_t k = i; k < std::min(i + 16, lines.size()); ++k) {
          Outcome& o = out[k];
          try {
            Conversation c = parse_conversation(lines[k].second, file, lines[k].first);
            o.id = c.id;
            o.doc = tokenize_rendered(render_chat(opts.chat_template, c, false), opts.encode);
            o.ok = true;
          } catch (const RecordError& e) {
            o.kind = e.kind();
            o.error = e.what();
          } catch (const Error& e) {
            if (e.internal()) throw;  // a bug, not a bad record
            // Rendering/tokenizing failures (e.g. invalid UTF-8) are bad records too.
            o.kind = RecordErrorKind::invalid_field;
            o.error = fmt::format("{}:{}: {}", file, lines[k].first, e.what());
          }
        }
      }
    };
    // Unexpected exceptions (not bad records) are carried out of the threads and rethrown.
    std::vector<std::exception_ptr> failures(static_cast<size_t>(threads));
    auto guarded = [&](size_t t) {
      try {
        work();
      } catch (...) {
        failures[t] = std::current_exception();
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(guarded, static_cast<size_t>(t));
    guarded(0);
    for (auto& t : pool) t.join();
    for (auto& f : failures) {
      if (f) std::rethrow_exception(f);
    }

    for (size_t k = 0; k < out.size(); ++k) {
      Outcome& o = out[k];
      ++st.records;
      if (!o.ok) {
        if (!opts.skip_invalid) {
          fail("{} [{}]{}", o.error, record_error_kind_name(o.kind),
               opts.skip_invalid_hint.empty()
                   ? ""
                   : fmt::format("; to skip and count bad records, {}", opts.skip_invalid_hint));
        }
        ++st.skipped_invalid;
        ++st.invalid_by_kind[std::string(record_error_kind_name(o.kind))];
        if (st.invalid_examples.size() < kMaxExamples) st.invalid_examples.push_back(o.error);
        continue;
      }
      auto& toks = o.doc.tokens;
      auto& mask = o.doc.loss_mask;
      if (static_cast<int64_t>(toks.size()) > max_len) {
        ++st.truncated;
        st.truncated_tokens += static_cast<int64_t>(toks.size()) - max_len;
        toks.resize(static_cast<size_t>(max_len));
        mask.resize(static_cast<size_t>(max_len));
      }
      int64_t sup = 0;
      for (uint8_t m : mask) sup += m;
      if (sup == 0) {
        ++st.zero_supervised;
        if (st.zero_supervised_examples.size() < kMaxExamples) {
          st.zero_supervised_examples.push_back(
              fmt::format("{}:{} (id {})", file, lines[k].first, o.id));
        }
        continue;
      }
      const auto len = static_cast<int64_t>(toks.size());
      b.tokens.insert(b.tokens.end(), toks.begin(), toks.end());
      b.mask.insert(b.mask.end(), mask.begin(), mask.end());
      b.offsets.push_back(static_cast<int64_t>(b.tokens.size()));
      b.lines.push_back(lines[k].first);
      ++st.conversations;
      st.tokens += len;
      st.supervised_tokens += sup;
      st.min_length = (st.conversations == 1) ? len : std::min(st.min_length, len);
      st.max_length = std::max(st.max_length, len);
      size_t bin =
          static_cast<size_t>(std::lower_bound(uppers.begin(), uppers.end(), len) - uppers.begin());
      ++st.hist_count[std::min(bin, uppers.size() - 1)];
    }
    bar.advance(static_cast<int64_t>(out.size()));
  }
  bar.finish();
  if (st.conversations == 0) {
    fail(
        "{}: nothing to train on: {} records, {} invalid (skipped), {} without any supervised "
        "(assistant) token{}",
        file, st.records, st.skipped_invalid, st.zero_supervised,
        st.zero_supervised > 0 ? fmt::format(" (first: {})", st.zero_supervised_examples[0])
                               : std::string());
  }
  return b;
}

}  // namespace

void check_template_tokens(const ChatTemplate& t, const EncodeFn& encode,
                           const std::string& tokenizer) {
  std::vector<std::string> missing;
  for (std::string_view marker : chat_template_markers(t)) {
    std::vector<std::pair<size_t, size_t>> offsets;
    const size_t n = encode(marker, &offsets).size();
    if (n != 1) missing.push_back(fmt::format("{} ({} tokens)", marker, n));
  }
  DFLASH_CHECK(missing.empty(),
               "chat template '{}' writes special tokens that the tokenizer {} does not have: {}; "
               "they would be tokenized as plain text, which the target never saw. Use the "
               "target's own template (--template / data.template; chatml, qwen3, llama3)",
               t.name(), tokenizer.empty() ? std::string("in use") : tokenizer,
               fmt::join(missing, ", "));
}

PrepareResult prepare_dataset(const PrepareOptions& opts) {
  DFLASH_CHECK(opts.encode, "prepare_dataset: no tokenizer given");
  check_template_tokens(opts.chat_template, opts.encode, opts.tokenizer_file);
  DFLASH_CHECK(opts.max_length > 0, "max length must be positive (got {})", opts.max_length);
  DFLASH_CHECK(!opts.cache.empty(), "prepare_dataset: no cache path given");
  DFLASH_CHECK(std::filesystem::exists(opts.data), "{}: no such data file", opts.data.string());
  CacheKey want;
  want.data_file = std::filesystem::absolute(opts.data).string();
  want.data_hash = hash_file(opts.data);
  want.tokenizer_hash = opts.tokenizer_hash;
  want.template_fingerprint = opts.chat_template.fingerprint();
  want.max_length = opts.max_length;
  want.format = kFormat;

  PrepareResult r;
  if (opts.force) {
    r.reason = "rebuild forced";
  } else if (!std::filesystem::exists(opts.cache)) {
    r.reason = "no cache yet";
  } else if (auto have = read_cache_key(opts.cache); !have) {
    r.reason = "the existing file is not a readable cache";
  } else if (!have->matches(want)) {
    r.reason = "changed: " + have->diff(want);
  } else {
    try {
      r.dataset = TokenDataset::open(opts.cache);
      r.reused = true;
      return r;
    } catch (const Error& e) {
      if (e.internal()) throw;  // a bug, not a damaged file
      r.reason = fmt::format("the existing cache is damaged ({})", e.what());
    }
  }
  spdlog::info("building token cache {} ({})", opts.cache.string(), r.reason);
  Built b = build(opts);
  write_cache(opts.cache, want, b);
  r.dataset = TokenDataset::open(opts.cache);
  return r;
}

}  // namespace dflash
