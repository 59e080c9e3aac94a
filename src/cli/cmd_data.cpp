// `dflash data prepare`: tokenizes a conversation corpus for a target model into the binary token
// cache that training reads (reused when nothing changed), and prints its figures: conversations,
// tokens, supervised tokens, skipped, truncated, length histogram, and the packing waste of the
// batch shapes.
#include <chrono>
#include <optional>

#include "cli/cli_util.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "data/batcher.hpp"
#include "data/chat_template.hpp"
#include "data/dataset.hpp"
#include "data/tokenizer.hpp"
#include "train/run_config.hpp"

namespace dflash::cli {

namespace {

struct PrepareArgs {
  std::string config;
  std::string model, data, template_name, cache;
  int64_t max_length = 2048;
  bool enable_thinking = false, skip_invalid = false, force = false;
  int threads = 0;
  int64_t token_budget = 8192, rows = 1;
  int num_shapes = 4;
  bool sort_by_length = false;
};

void run_prepare(PrepareArgs a, const CLI::App& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<RunConfig> run_config;
  if (!a.config.empty()) {
    // Values from the run config, unless given on the command line.
    RunConfig cfg = RunConfig::load(a.config);
    auto unset = [&](const char* flag) { return cmd.count(flag) == 0; };
    if (unset("--model")) a.model = cfg.model.target;
    if (unset("--data")) a.data = cfg.data.train_file;
    if (unset("--template")) a.template_name = cfg.data.template_name;
    if (unset("--max-length")) a.max_length = cfg.data.max_length;
    if (unset("--skip-invalid")) a.skip_invalid = cfg.data.skip_invalid;
    if (unset("--token-budget")) a.token_budget = cfg.data.token_budget;
    if (unset("--rows")) a.rows = cfg.data.rows_per_step;
    if (unset("--sort-by-length")) a.sort_by_length = cfg.data.sort_by_length;
    run_config = std::move(cfg);
  }
  DFLASH_CHECK(!a.model.empty(), "data prepare: give --model (or --config with model.target)");
  DFLASH_CHECK(!a.data.empty(), "data prepare: give --data (or --config with data.train_file)");
  const std::filesystem::path model = a.model;
  const std::filesystem::path tok_file = model / "tokenizer.json";
  DFLASH_CHECK(std::filesystem::exists(tok_file), "{}: no tokenizer.json in the model folder",
               model.string());
  Tokenizer tok = Tokenizer::load(tok_file);
  PrepareOptions o;
  o.data = a.data;
  o.chat_template = resolve_chat_template(model, a.template_name, a.enable_thinking);
  o.max_length = a.max_length;
  if (!a.cache.empty()) {
    o.cache = a.cache;
  } else if (run_config) {  // the file `dflash train` with this config reads
    o.cache = run_cache_path(run_config->data.cache_dir, run_config->output_dir, o.data, model,
                             o.chat_template, o.max_length);
  } else {
    o.cache = default_cache_path(o.data, model, o.chat_template, o.max_length);
  }
  o.skip_invalid = a.skip_invalid;
  o.skip_invalid_hint = "pass --skip-invalid or set data.skip_invalid: true in the --config file";
  o.threads = a.threads;
  o.force = a.force;
  o.tokenizer_hash = hash_file(tok_file);
  o.tokenizer_file = tok_file.string();
  o.encode = [&tok](std::string_view text, std::vector<std::pair<size_t, size_t>>* offsets) {
    return tok.encode(text, offsets);
  };
  PrepareResult r = prepare_dataset(o);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  fmt::print("data       {}\n", o.data.string());
  fmt::print("model      {} (template {})\n", model.string(), o.chat_template.fingerprint());
  fmt::print("cache      {} ({})\n", o.cache.string(),
             r.reused ? "reused: nothing changed" : "built: " + r.reason);
  fmt::print("max length {}\n", o.max_length);
  fmt::print("{}", r.dataset.stats().report());

  BatcherOptions bo;
  bo.token_budget = a.token_budget;
  bo.rows = a.rows;
  bo.num_shapes = a.num_shapes;
  bo.sort_by_length = a.sort_by_length;
  Batcher batcher(r.dataset, bo);
  PackingStats ps = batcher.epoch_stats(0);
  fmt::print(
      "packing (epoch 0, {} row(s) x budget {}): {} batches, {} tokens in {} slots, "
      "padding waste {:.2f} %\n",
      bo.rows, bo.token_budget, ps.batches, ps.tokens, ps.slots, 100.0 * ps.waste());
  for (auto it = ps.batches_per_shape.rbegin(); it != ps.batches_per_shape.rend(); ++it) {
    fmt::print("  shape [{} x {}]: {} batches\n", bo.rows, it->first, it->second);
  }
  fmt::print("time       {}\n", format_duration(secs));
}

}  // namespace

void add_data_command(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Training data: tokenize and cache conversations");
  data->require_subcommand(1);
  auto args = std::make_shared<PrepareArgs>();
  auto* p = data->add_subcommand(
      "prepare", "Render, tokenize and cache a conversation corpus; print its figures");
  p->add_option("--config", args->config,
                "Run config (YAML): model.target and the data section give the defaults");
  p->add_option("--model", args->model, "Target model folder (tokenizer.json, chat template)");
  p->add_option("--data", args->data, "Conversations: .jsonl, .jsonl.xz or .jsonl.zst");
  p->add_option("--template", args->template_name,
                "Chat template: chatml (alias qwen), qwen3, llama3 (default: detected)");
  p->add_flag("--enable-thinking", args->enable_thinking, "qwen3: thinking mode");
  p->add_option("--max-length", args->max_length,
                "Tokens per conversation; longer ones are "
                "truncated")
      ->capture_default_str()
      ->check(at_least(1));
  p->add_option("--cache", args->cache,
                "Cache file (default: with --config the file `dflash train` reads, else under "
                "~/.cache/dflash)");
  p->add_flag("--skip-invalid", args->skip_invalid, "Skip and count bad records");
  p->add_flag("--force", args->force, "Rebuild the cache even when it is up to date");
  p->add_option("--threads", args->threads, "Tokenizer threads (0 = all cores)")
      ->capture_default_str()
      ->check(at_least(0));
  p->add_option("--token-budget", args->token_budget, "Tokens per packed row (for the report)")
      ->capture_default_str()
      ->check(at_least(1));
  p->add_option("--rows", args->rows, "Rows per batch (for the report)")
      ->capture_default_str()
      ->check(at_least(1));
  p->add_flag("--sort-by-length", args->sort_by_length,
              "Pack conversations longest first inside each window (the report's packing)");
  p->add_option("--shapes", args->num_shapes, "Number of row lengths budget/2^k (for the report)")
      ->capture_default_str()
      ->check(at_least(1));
  p->callback([args, p] { run_prepare(*args, *p); });
}

}  // namespace dflash::cli
