// dflash.cpp — fuzz targets (see fuzz_targets.hpp for the contract).
//
// File parsers read their input through one memfd per process (/proc/self/fd/N), so the real
// open/mmap code runs without touching the disk; folders the parsers need (index shards, a model
// folder) live in one scratch folder under /dev/shm (else $TMPDIR) removed at exit.
#include "fuzz/fuzz_targets.hpp"

#include <fcntl.h>
#include <lzma.h>
#include <sys/mman.h>
#include <unistd.h>
#include <utf8proc.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string_view>

#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/tensor.hpp"
#include "data/batcher.hpp"
#include "data/chat_template.hpp"
#include "data/conversation.hpp"
#include "data/dataset.hpp"
#include "data/jsonl.hpp"
#include "data/tokenizer.hpp"
#include "data/utf8.hpp"
#include "model/config.hpp"
#include "model/drafter.hpp"
#include "model/drafter_io.hpp"
#include "model/safetensors.hpp"
#include "model/target.hpp"
#include "ops/rope.hpp"
#include "train/checkpoint.hpp"
#include "train/run_config.hpp"

namespace dflash::fuzz {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void finding(const std::string& msg) {
  throw FuzzFailure(msg);
}

/// A dflash::Error is a clean rejection unless it reports a broken internal invariant.
void expect_clean(const Error& e) {
  if (e.internal()) finding(std::string("internal assertion failed: ") + e.what());
}

/// Runs `f`, swallowing clean rejections (dflash::Error).
template <typename F>
void guarded(F&& f) {
  try {
    f();
  } catch (const FuzzFailure&) {
    throw;
  } catch (const Error& e) {
    expect_clean(e);
  }
}

std::string as_text(std::span<const uint8_t> d) {
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

/// The process's scratch folder (created on first use, removed at exit).
const fs::path& scratch_dir() {
  static const fs::path dir = [] {
    std::string base = fs::is_directory("/dev/shm") ? "/dev/shm" : fs::temp_directory_path();
    std::string tmpl = base + "/dflash-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) finding("cannot create a scratch folder in " + base);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(scratch_dir(), ec);
    });
    return fs::path(tmpl);
  }();
  return dir;
}

void write_bytes(const fs::path& p, std::string_view bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f.good()) finding("cannot write scratch file " + p.string());
}

/// `data` as the contents of an in-memory file, readable by path.
class MemFile {
 public:
  explicit MemFile(std::span<const uint8_t> data) {
    static const int fd = [] {
      int f = ::memfd_create("dflash-fuzz", MFD_CLOEXEC);
      if (f < 0) finding(std::string("memfd_create: ") + std::strerror(errno));
      return f;
    }();
    if (::ftruncate(fd, 0) != 0) finding("ftruncate of the memfd failed");
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t w =
          ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(done));
      if (w <= 0) finding("pwrite to the memfd failed");
      done += static_cast<size_t>(w);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

/// A checksum that makes every byte of `t` be read.
uint64_t touch(const Tensor& t) {
  uint64_t h = 0;
  const auto* p = static_cast<const uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) h = h * 31 + p[i];
  return h;
}

/// Ids and offsets of an encoding must agree with the text they came from.
void check_encoding(const Tokenizer& tok, std::string_view text, const std::vector<int32_t>& ids,
                    const std::vector<std::pair<size_t, size_t>>& offsets) {
  if (offsets.size() != ids.size()) finding("encode: offsets and ids differ in length");
  size_t prev_begin = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= tok.vocab_size()) finding("encode: id outside the vocabulary");
    const auto [b, e] = offsets[i];
    if (b > e || e > text.size()) finding("encode: offsets outside the text");
    if (b < prev_begin) finding("encode: offsets go backwards");
    prev_begin = b;
  }
}

/// NFC of valid UTF-8 (utf8proc; NUL bytes included).
std::string nfc(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  const std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  if (n < 0) finding("utf8proc refused valid UTF-8");
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
}

/// Whole contents of an .xz file.
std::string xz_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  const std::string in((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  lzma_stream s = LZMA_STREAM_INIT;
  if (lzma_stream_decoder(&s, UINT64_MAX, 0) != LZMA_OK) finding("lzma_stream_decoder failed");
  std::string out;
  s.next_in = reinterpret_cast<const uint8_t*>(in.data());
  s.avail_in = in.size();
  std::vector<uint8_t> buf(1 << 20);
  lzma_ret r = LZMA_OK;
  while (r == LZMA_OK) {
    s.next_out = buf.data();
    s.avail_out = buf.size();
    r = lzma_code(&s, LZMA_FINISH);
    out.append(reinterpret_cast<const char*>(buf.data()), buf.size() - s.avail_out);
  }
  lzma_end(&s);
  if (r != LZMA_STREAM_END) finding("cannot decompress " + p.string());
  return out;
}

fs::path source_dir() {
  return DFLASH_SOURCE_DIR;
}

fs::path shared_dir() {
  if (const char* e = std::getenv("DFLASH_SHARED_DIR"); e && *e) return e;
  return DFLASH_SHARED_DIR_DEFAULT;
}

/// The tokenizers of tokenizer_encode: tiny-qwen3 (assets) and, when the shared fixtures are
/// present, the real Qwen3 one.
const Tokenizer& fixed_tokenizer(bool qwen3) {
  static const Tokenizer tiny = Tokenizer::load(source_dir() / "assets/tiny-qwen3/tokenizer.json");
  static const std::optional<Tokenizer> real = []() -> std::optional<Tokenizer> {
    const fs::path xz = shared_dir() / "fixtures/qwen3-tokenizer/tokenizer.json.xz";
    if (!fs::exists(xz)) return std::nullopt;
    const fs::path json = scratch_dir() / "qwen3-tokenizer.json";
    write_bytes(json, xz_file(xz));
    return Tokenizer::load(json);
  }();
  return qwen3 && real ? *real : tiny;
}

const char* const kSamples[] = {
    "Hello, world! 123",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80  \t\n\n  trailing   ",
    "bad \xff\xfe utf-8 \xc3",
    "",
};

}  // namespace

// ------------------------------------------------------------------ targets

void safetensors(std::span<const uint8_t> data) {
  const MemFile file(data);
  guarded([&] {
    const SafetensorsFile st(file.path());
    if (st.header_size() > st.file_size() - 8) finding("safetensors: header past the file end");
    const uint64_t buffer = st.file_size() - 8 - st.header_size();
    for (const TensorInfo& t : st.tensors()) {
      if (t.data_offsets.first > t.data_offsets.second || t.data_offsets.second > buffer) {
        finding("safetensors: tensor '" + t.name + "' reaches outside the buffer");
      }
      if (static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype) != t.nbytes()) {
        finding("safetensors: byte size of '" + t.name + "' contradicts its shape");
      }
      const Tensor raw = st.get(t.name);
      if (raw.nbytes() != t.nbytes()) finding("safetensors: get() returned another size");
      (void)touch(raw);
      guarded([&] { (void)touch(st.get_as(t.name, DType::f32)); });
    }
  });
}

void safetensors_index(std::span<const uint8_t> data) {
  static const fs::path dir = [] {
    const fs::path d = scratch_dir() / "index";
    fs::create_directories(d);
    safetensors_write(d / "a.safetensors",
                      {{"x", Tensor::from_f32({1.0f, 2.0f}, {2})},
                       {"y", Tensor::from_f32({1.0f, 2.0f, 3.0f}, {3, 1})}},
                      {{"format", "pt"}});
    safetensors_write(d / "b.safetensors", {{"z", Tensor::from_f32({4.0f}, {1})}});
    return d;
  }();
  write_bytes(dir / "model.safetensors.index.json", as_text(data));
  guarded([&] {
    const SafetensorsCheckpoint ck(dir);
    for (const std::string& name : ck.names()) {
      const TensorInfo& info = ck.info(name);
      if (&ck.shard_of(name).info(name) != &info) finding("index: shard_of disagrees with info");
      (void)touch(ck.get_as(name, DType::f32));
    }
    (void)ck.index_metadata();
  });
}

void model_config(std::span<const uint8_t> data) {
  const std::string text = as_text(data);
  guarded([&] {
    const nlohmann::json j = json_parse_strict(text, "config.json");
    guarded([&] {
      const ModelConfig m = model_config_from_json(j, "config.json");
      if (m.hidden_size <= 0 || m.intermediate_size <= 0 || m.num_attention_heads <= 0 ||
          m.num_key_value_heads <= 0 || m.head_dim <= 0 || m.num_hidden_layers <= 0 ||
          m.vocab_size <= 0 || m.max_position_embeddings <= 0) {
        finding("config: a size is not positive");
      }
      if (m.num_attention_heads % m.num_key_value_heads != 0 || m.head_dim % 2 != 0) {
        finding("config: heads or head_dim inconsistent");
      }
      if (static_cast<int64_t>(m.layer_types.size()) != m.num_hidden_layers) {
        finding("config: layer_types size differs from num_hidden_layers");
      }
      if (m.num_sliding_layers() > 0 && m.sliding_window <= 0) {
        finding("config: sliding layers without a window");
      }
      guarded([&] {
        // What loading the model computes from these fields: the RoPE frequencies.
        const RopeParams rp = rope_params_from_config(m.rope, "config.json");
        (void)rope_inv_freq(rp, m.head_dim);
        (void)rope_attention_scaling(rp);
      });
      for (int n : {1, 5}) {
        guarded([&] {
          for (int id : default_target_layer_ids(static_cast<int>(m.num_hidden_layers), n)) {
            if (id < 0 || id >= m.num_hidden_layers) finding("config: default tap out of range");
          }
        });
      }
      // The same text read as the folder's generation_config.json.
      const fs::path gen = scratch_dir() / "generation";
      fs::create_directories(gen);
      write_bytes(gen / "generation_config.json", text);
      guarded([&] { (void)generation_eos_ids(gen, m); });
    });
    guarded([&] {
      const DrafterConfig c = drafter_config_from_json(j, "config.json");
      const DrafterLayout layout(c);
      int64_t sum = 0;
      for (const ParamInfo& p : layout.params) sum += p.numel;
      if (sum != layout.total) finding("drafter: layout total differs from the sum of parameters");
      const DrafterConfig back = drafter_config_from_json(drafter_export_config(c), "export");
      if (back.hidden_size != c.hidden_size || back.intermediate_size != c.intermediate_size ||
          back.num_layers != c.num_layers || back.num_heads != c.num_heads ||
          back.num_kv_heads != c.num_kv_heads || back.head_dim != c.head_dim ||
          back.vocab_size != c.vocab_size || back.block_size != c.block_size ||
          back.mask_token_id != c.mask_token_id || back.target_layer_ids != c.target_layer_ids ||
          back.num_target_layers != c.num_target_layers ||
          back.max_position_embeddings != c.max_position_embeddings) {
        finding("drafter: export config does not parse back to the same config");
      }
    });
  });
}

void tokenizer_load(std::span<const uint8_t> data) {
  const MemFile file(data);
  guarded([&] {
    const Tokenizer tok = Tokenizer::load(file.path());
    for (const char* s : kSamples) {
      std::vector<std::pair<size_t, size_t>> offsets;
      guarded([&] {
        const std::vector<int32_t> ids = tok.encode(s, &offsets, InvalidUtf8::replace);
        check_encoding(tok, s, ids, offsets);
        (void)tok.decode(ids);
        (void)tok.decode(ids, /*skip_special=*/true);
      });
    }
    const int32_t n = std::min<int32_t>(tok.vocab_size(), 256);
    for (int32_t id = 0; id < n; ++id) {
      guarded([&] { (void)tok.id_to_token(id); });
      guarded([&] { (void)tok.decode({id}); });
    }
    (void)tok.token_to_id("<|im_start|>");
  });
}

void tokenizer_encode(std::span<const uint8_t> data) {
  if (data.empty()) return;
  const Tokenizer& tok = fixed_tokenizer((data[0] & 1) != 0);
  const InvalidUtf8 mode = (data[0] & 2) != 0 ? InvalidUtf8::replace : InvalidUtf8::error;
  const std::string text = as_text(data.subspan(1));
  const bool valid = utf8::find_invalid(text) == std::string::npos;
  std::vector<std::pair<size_t, size_t>> offsets;
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text, &offsets, mode);
  } catch (const Error& e) {
    expect_clean(e);
    if (valid || mode == InvalidUtf8::replace) {
      finding(std::string("encode refused acceptable text: ") + e.what());
    }
    return;
  }
  check_encoding(tok, text, ids, offsets);
  const std::string back = tok.decode(ids);
  // Byte-level BPE is lossless up to the NFC normalizer; no added token starts without '<'.
  if (valid && text.find('<') == std::string::npos && back != nfc(text)) {
    finding("decode(encode(text)) differs from NFC(text)");
  }
  // Any valid ids decode.
  std::vector<int32_t> some;
  for (size_t i = 1; i + 4 <= data.size(); i += 4) {
    uint32_t v;
    std::memcpy(&v, data.data() + i, 4);
    some.push_back(static_cast<int32_t>(v % static_cast<uint32_t>(tok.vocab_size())));
  }
  try {
    (void)tok.decode(some);
    (void)tok.decode(some, /*skip_special=*/true);
  } catch (const Error& e) {
    finding(std::string("decode refused valid ids: ") + e.what());
  }
}

void chat_template(std::span<const uint8_t> data) {
  const std::string text = as_text(data);
  (void)detect_template_family(text);
  const std::string_view stripped = python_strip(text);
  if (stripped.data() < text.data() ||
      stripped.data() + stripped.size() > text.data() + text.size())
    finding("python_strip: result outside its input");
  if (python_strip(stripped) != stripped) finding("python_strip is not idempotent");

  guarded([&] {
    const Conversation conv =
        parse_conversation(text, "fuzz.jsonl", 1, ParseOptions{.allow_trailing_user = true});
    for (const char* name : {"chatml", "qwen3", "llama3"}) {
      for (bool thinking : {false, true}) {
        if (thinking && std::string_view(name) != "qwen3") continue;
        for (bool gen : {false, true}) {
          const RenderedChat r = render_chat(ChatTemplate::from_name(name, thinking), conv, gen);
          size_t prev_end = 0;
          for (const ByteSpan& s : r.supervised) {
            if (s.begin >= s.end || s.begin < prev_end || s.end > r.text.size()) {
              finding(std::string("render_chat(") + name +
                      "): supervised spans not sorted, "
                      "disjoint, non-empty and inside the text");
            }
            prev_end = s.end;
          }
        }
      }
    }
  });

  static const fs::path model = [] {
    const fs::path d = scratch_dir() / "model";
    fs::create_directories(d);
    return d;
  }();
  write_bytes(model / "tokenizer_config.json", text);
  guarded([&] { (void)read_model_chat_template(model); });
  guarded([&] { (void)resolve_chat_template(model, ""); });
}

void jsonl(std::span<const uint8_t> data) {
  const MemFile file(data);
  guarded([&] {
    LineReader reader(file.path());
    std::string line;
    int64_t bytes = 0;
    // Bounded: a small compressed input may expand to a lot of text.
    while (bytes < (int64_t{1} << 22) && reader.next(line)) {
      bytes += static_cast<int64_t>(line.size()) + 1;
      const bool prompts = reader.line_number() % 2 == 0;
      guarded([&] {
        const Conversation c = parse_conversation(line, "fuzz.jsonl", reader.line_number(),
                                                  ParseOptions{.allow_trailing_user = prompts});
        if (c.messages.empty()) finding("jsonl: a parsed conversation has no message");
        const Role last = c.messages.back().role;
        if (last != Role::assistant && !(prompts && last == Role::user)) {
          finding("jsonl: a parsed conversation does not end with an assistant turn");
        }
        for (size_t i = 1; i < c.messages.size(); ++i) {
          if (c.messages[i].role == Role::system) finding("jsonl: system message after the first");
        }
      });
    }
  });
}

void run_config(std::span<const uint8_t> data) {
  const std::string text = as_text(data);
  const size_t nul = text.find('\0');
  const std::string yaml = text.substr(0, nul);
  std::vector<std::string> overrides;
  if (nul != std::string::npos) {
    size_t start = nul + 1;
    while (start <= text.size()) {
      const size_t end = std::min(text.find('\0', start), text.size());
      overrides.push_back(text.substr(start, end - start));
      start = end + 1;
    }
  }
  guarded([&] {
    const RunConfig c = RunConfig::from_yaml(yaml, "fuzz.yaml", overrides);
    const std::string resolved = c.to_yaml();
    RunConfig back;
    try {
      back = RunConfig::from_yaml(resolved, "resolved.yaml");
    } catch (const Error& e) {
      finding(std::string("the resolved YAML does not parse back: ") + e.what() + "\n" + resolved);
    }
    if (back.to_yaml() != resolved) finding("the resolved YAML is not a fixed point:\n" + resolved);
    if (!c.resume_incompatibilities(back).empty()) finding("a config differs from its own YAML");
  });
}

void token_cache(std::span<const uint8_t> data) {
  const MemFile file(data);
  (void)read_cache_key(file.path());
  guarded([&] {
    const TokenDataset ds = TokenDataset::open(file.path());
    int64_t longest = 0, tokens = 0;
    uint64_t h = 0;
    for (int64_t i = 0; i < ds.num_docs(); ++i) {
      const int64_t len = ds.doc_length(i);
      if (len <= 0) finding("token cache: an empty document was accepted");
      const auto toks = ds.doc_tokens(i);
      const auto mask = ds.doc_loss_mask(i);
      if (static_cast<int64_t>(toks.size()) != len || static_cast<int64_t>(mask.size()) != len) {
        finding("token cache: document spans differ from its length");
      }
      for (int64_t k = 0; k < len; ++k) {
        if (toks[static_cast<size_t>(k)] < 0) finding("token cache: a negative token id");
        if (mask[static_cast<size_t>(k)] > 1) finding("token cache: a loss mask value above 1");
        h = h * 31 + static_cast<uint64_t>(toks[static_cast<size_t>(k)]);
      }
      (void)ds.doc_source_line(i);
      longest = std::max(longest, len);
      tokens += len;
    }
    if (tokens != ds.num_tokens()) finding("token cache: documents do not cover the tokens");
    (void)ds.stats().report();
    (void)ds.fingerprint();
    (void)ds.key().to_json();
    BatcherOptions bo;
    bo.token_budget = 8;
    while (bo.token_budget < longest) bo.token_budget *= 2;
    bo.num_shapes = 2;
    Batcher batcher(ds, bo);
    const PackingStats ps = batcher.epoch_stats(0);
    if (ps.tokens != ds.num_tokens()) finding("token cache: the epoch plan loses tokens");
  });
}

void trainer_state(std::span<const uint8_t> data) {
  const std::string text = as_text(data);
  guarded([&] { (void)checkpoint_state_parse(text, "state.json"); });
}

// ------------------------------------------------------------------ registry

const std::vector<NamedTarget>& all_targets() {
  static const std::vector<NamedTarget> targets = {
      {"safetensors", &safetensors},
      {"safetensors_index", &safetensors_index},
      {"model_config", &model_config},
      {"tokenizer_load", &tokenizer_load},
      {"tokenizer_encode", &tokenizer_encode},
      {"chat_template", &chat_template},
      {"jsonl", &jsonl},
      {"run_config", &run_config},
      {"token_cache", &token_cache},
      {"trainer_state", &trainer_state},
  };
  return targets;
}

TargetFn find_target(const std::string& name) {
  for (const NamedTarget& t : all_targets()) {
    if (name == t.name) return t.fn;
  }
  throw std::invalid_argument("no fuzz target named '" + name + "'");
}

void warm_up(const std::string& name) {
  (void)scratch_dir();
  if (name == "tokenizer_encode") {
    (void)fixed_tokenizer(false);
    (void)fixed_tokenizer(true);
  }
}

}  // namespace dflash::fuzz
