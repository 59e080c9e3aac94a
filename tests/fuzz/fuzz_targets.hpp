// dflash.cpp — fuzz targets: one function per parser of outside input, shared by the libFuzzer
// harnesses (tests/fuzz/harness.cpp, built with -DDFLASH_FUZZ=ON by scripts/fuzz.sh) and by
// tests/fuzz_replay_test.cpp, which runs every saved input (seed corpus and regressions) through
// them in the normal build and under ASan+UBSan.
//
// Contract of a target: it hands `data` to its parser as that parser's outside input (file bytes,
// JSON/YAML text, a JSONL line, text to encode). A dflash::Error is the expected answer to a bad
// input and is swallowed. Everything else is a finding and throws FuzzFailure: another exception
// type, a DFLASH_ASSERT ("internal error"), or a property that a successful parse must satisfy
// (ranges inside the file, round trips, sorted spans). Crashes, leaks, undefined behaviour and
// hangs are the sanitizers' and libFuzzer's to report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace dflash::fuzz {

/// A finding of a fuzz target that is not a crash: the message says which rule broke.
class FuzzFailure : public std::logic_error {
 public:
  explicit FuzzFailure(const std::string& msg) : std::logic_error(msg) {}
};

/// A fuzz target: parses `data` (see the file comment); throws FuzzFailure on a finding.
using TargetFn = void (*)(std::span<const uint8_t> data);

/// A target and the name of its harness, corpus folder (tests/fuzz/corpus/<name>) and regression
/// folder (tests/fuzz/regressions/<name>).
struct NamedTarget {
  const char* name;
  TargetFn fn;
};

/// Every target, in a fixed order.
const std::vector<NamedTarget>& all_targets();

/// The target called `name`; throws std::invalid_argument when there is none.
TargetFn find_target(const std::string& name);

/// Loads what target `name` reads on every input but builds only once (the fixed tokenizers of
/// tokenizer_encode), so that libFuzzer's per-input timeout does not count it. Optional: the
/// targets load it on first use otherwise.
void warm_up(const std::string& name);

/// `model.safetensors` bytes: SafetensorsFile, then every tensor read raw and as f32.
void safetensors(std::span<const uint8_t> data);
/// `model.safetensors.index.json` text over two fixed shards: SafetensorsCheckpoint, every tensor.
void safetensors_index(std::span<const uint8_t> data);
/// `config.json` text: the target parser, the drafter parser (with an export round trip and the
/// parameter layout), default taps, and the same text as `generation_config.json`.
void model_config(std::span<const uint8_t> data);
/// `tokenizer.json` text: Tokenizer::load, then encode/decode of fixed strings.
void tokenizer_load(std::span<const uint8_t> data);
/// Text for the tiny-qwen3 tokenizer (first byte even) or the real Qwen3 one (odd): encode with
/// offsets in both invalid-UTF-8 modes, decode round trip, decode of ids taken from the bytes.
void tokenizer_encode(std::span<const uint8_t> data);
/// A conversation record rendered by every built-in template (spans sorted and inside the text),
/// the bytes as a Jinja template (family detection, python_strip) and as tokenizer_config.json.
void chat_template(std::span<const uint8_t> data);
/// A JSONL corpus file (plain, xz or zstd) read line by line, each line a conversation record.
void jsonl(std::span<const uint8_t> data);
/// Run YAML up to the first NUL byte, then NUL-separated `section.key=value` overrides:
/// RunConfig::from_yaml, and the resolved YAML must parse back to itself.
void run_config(std::span<const uint8_t> data);
/// `.dftok` token cache bytes: TokenDataset::open, every document, the stats report, the key,
/// and a Batcher's epoch plan over the documents.
void token_cache(std::span<const uint8_t> data);
/// A checkpoint's `trainer_state/state.json` text: checkpoint_state_parse.
void trainer_state(std::span<const uint8_t> data);

}  // namespace dflash::fuzz
