// dflash.cpp — the `dflash` subcommands. Each `add_*_command` registers one subcommand (its flags
// and a callback that runs it) on the root CLI11 app. A callback reports failures by throwing
// dflash::Error; main() prints the message and exits with status 1.
#pragma once

#include <CLI/CLI.hpp>

namespace dflash::cli {

/// `dflash inspect MODEL_DIR`: architecture, sizes, parameter count, dtypes, shards, default taps
/// (a DFlash drafter: its sizes, block size, mask id and taps).
void add_inspect_command(CLI::App& app);

/// `dflash data prepare --model DIR --data FILE [--template NAME] [--max-length N] ...`: writes
/// (or reuses) the token cache and prints its figures (src/cli/cmd_data.cpp).
void add_data_command(CLI::App& app);

/// `dflash status RUN_DIR`: alive or not, phase, step, loss, τ, tokens/s, ETA (from status.json).
void add_status_command(CLI::App& app);

/// `dflash tokenize --model DIR`: one JSON line of token ids per stdin line (`--jsonl` records,
/// `--verbose` token strings, `--offsets` byte ranges, `--decode` the reverse).
void add_tokenize_command(CLI::App& app);

/// `dflash dev drafter-step IN OUT`: developer tools used by the reference tests (internal).
void add_dev_command(CLI::App& app);

/// `dflash generate --target DIR --drafter DIR --prompt TEXT [--chat] [--batch-size N]`:
/// speculative decoding of one prompt, streamed, or of several together; then tokens, steps, τ,
/// tokens/s (src/cli/cmd_generate.cpp).
void add_generate_command(CLI::App& app);

/// `dflash eval --target DIR --drafter DIR --prompts FILE.jsonl`: τ, histogram, τ per source,
/// tokens/s, speedup, losslessness, JSON report; `--batch-size N` requests in flight
/// (src/cli/cmd_eval.cpp).
void add_eval_command(CLI::App& app);

/// `dflash regenerate --target DIR --data IN.jsonl --out OUT.jsonl [--drafter DIR] ...`: the
/// corpus's assistant turns replaced by the target's answers (src/cli/cmd_regenerate.cpp).
void add_regenerate_command(CLI::App& app);

/// `dflash train [--config FILE] [overrides]` and `dflash init-config --target DIR`
/// (src/cli/cmd_train.cpp).
void add_train_command(CLI::App& app);

/// `dflash bench [--preset NAME | --config FILE] [--plan] [--json FILE]`: the training step at
/// real shapes with random weights, phase by phase, and its hot kernels (src/cli/cmd_bench.cpp).
void add_bench_command(CLI::App& app);

/// The embedded assets folder (tiny-qwen3 and data): $DFLASH_ASSETS, else <binary>/../assets,
/// else ./assets. Throws dflash::Error when none exists.
std::string find_assets_dir();

}  // namespace dflash::cli
