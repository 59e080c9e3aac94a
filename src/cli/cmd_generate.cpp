// `dflash generate --target DIR --drafter DIR --prompt TEXT [--chat] [--batch-size N]`:
// speculative decoding with a DFlash drafter. One prompt: the text is streamed to stdout as tokens
// are accepted (special tokens included; a partial UTF-8 character is held back until complete).
// Several --prompt: decoded together (N in flight), each output printed in order after a
// "[prompt I]" line. Then one summary line per figure over all prompts: "tokens", "steps", "tau"
// (over steps), "tokens/s" (over the wall time of the decoding) (stable keys, tests grep them).
// With --chat the prompt is one user turn rendered with the chat template and the generation
// prompt; without it the prompt is raw text. With --show-steps each speculative step also prints
// one line to stderr: its acceptance length, the anchor and the drafted tokens (accepted ones in
// [brackets]) and the token the target put in their place (CPU backend only). With --backend cuda
// the decoding runs on GPU 0 (infer/decoder_cuda.hpp) and streams the same text.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <optional>

#include "cli/commands.hpp"
#include "cli/cuda_decoder.hpp"
#include "cli/decode_args.hpp"
#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/conversation.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder_cpu.hpp"
#include "model/drafter_io.hpp"

namespace dflash::cli {

namespace {

struct GenerateArgs {
  DecodeArgs d;
  std::vector<std::string> prompts;
  bool chat = false;
  bool show_steps = false;
};

/// One token as a quoted, escaped string ("'\\n'" for a newline; "<id N>" for an id the
/// tokenizer lacks, e.g. the mask token an untrained drafter may propose).
std::string token_text(const Tokenizer& tok, int32_t id) {
  if (id < 0 || id >= tok.vocab_size()) return fmt::format("<id {}>", id);
  std::string out = "'";
  for (char c : tok.decode(std::vector<int32_t>{id})) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\'')
      out += "\\'";
    else
      out += c;
  }
  return out + "'";
}

// The summary lines of a call (stable keys): tokens, steps, τ over steps, tokens/s over the wall
// time of the call.
void print_summary(std::span<const DecodeResult> results, double seconds) {
  int64_t tokens = 0, steps = 0, accepted = 0;
  for (const DecodeResult& r : results) {
    tokens += static_cast<int64_t>(r.tokens.size());
    steps += static_cast<int64_t>(r.accept_lengths.size());
    for (int x : r.accept_lengths) accepted += x;
  }
  fmt::print("\n\ntokens: {}\nsteps: {}\ntau: {:.3f}\ntokens/s: {:.1f}\n", tokens, steps,
             steps ? static_cast<double>(accepted) / static_cast<double>(steps) : 0.0,
             static_cast<double>(tokens) / seconds);
}

void run_generate(const GenerateArgs& a) {
  // Every argument is checked before the target's weights are loaded.
  if (a.d.backend == "cuda") {
    DFLASH_CHECK(!a.show_steps,
                 "--show-steps is not available with --backend cuda (the steps run on the device)");
    check_cuda_backend();
  }
  DFLASH_CHECK(!a.show_steps || a.prompts.size() == 1,
               "--show-steps traces one prompt ({} --prompt given)", a.prompts.size());
  const ModelConfig target_cfg = model_config_load(a.d.target);
  const DecodeOptions opts = decode_options_from(a.d, target_cfg);
  const LoadedDrafter drafter = drafter_load(a.d.drafter);
  const Tokenizer tok = Tokenizer::load(a.d.target);
  std::optional<ChatTemplate> tmpl;
  if (a.chat) tmpl = resolve_chat_template(a.d.target, a.d.chat_template);
  check_decoding_inputs(a.d, target_cfg, drafter.config, tok, tmpl ? &*tmpl : nullptr);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < a.prompts.size(); ++i) {
    std::string text = a.prompts[i];
    if (tmpl) {
      Conversation conv;
      conv.messages.push_back(Message{Role::user, a.prompts[i]});
      text = render_chat(*tmpl, conv, /*add_generation_prompt=*/true).text;
    }
    prompts.push_back(tok.encode(text));
    DFLASH_CHECK(!prompts.back().empty(),
                 "--prompt {} (of {}): the prompt is empty (it encodes to no token)", i + 1,
                 a.prompts.size());
  }
  const TargetModel target = TargetModel::load(a.d.target, target_load_options());
  std::optional<DecoderCpu> cpu;
  std::unique_ptr<Decoder> cuda;
  if (a.d.backend == "cuda") {
    cuda = make_cuda_decoder(target, drafter, prompts, opts.max_new_tokens, a.d.batch_size);
  } else {
    cpu.emplace(target, &drafter);
  }
  Decoder& dec = cuda ? *cuda : static_cast<Decoder&>(*cpu);

  // One prompt: its text streams as tokens are accepted.
  std::vector<int32_t> out;
  size_t printed = 0;
  auto flush_text = [&](bool final) {
    const std::string s = tok.decode(out);
    size_t end = s.size();
    // Hold back a trailing U+FFFD (EF BF BD): possibly a character split over tokens.
    if (!final && end >= 3 && s.compare(end - 3, 3, "\xEF\xBF\xBD") == 0) end -= 3;
    if (end > printed) {
      std::fwrite(s.data() + printed, 1, end - printed, stdout);
      std::fflush(stdout);
      printed = end;
    }
  };
  const TokenCallback on_tokens = [&](std::span<const int32_t> toks) {
    out.insert(out.end(), toks.begin(), toks.end());
    flush_text(false);
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&t0] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (a.show_steps) {  // step by step on the CPU decoder, tracing each step
    const SpeculativeDecoder& sd = *cpu->speculative();
    SpecState st = sd.start(prompts[0], opts, on_tokens);
    while (!st.done) {
      const int32_t anchor = st.anchor;
      const size_t before = out.size();
      sd.step(st, opts, on_tokens);
      const int n = st.result.accept_lengths.back() - 1;  // accepted drafts
      std::string line =
          fmt::format("step {}: accepted {}/{}, anchor {}, drafts", st.result.accept_lengths.size(),
                      n, st.last_proposals.size(), token_text(tok, anchor));
      for (size_t k = 0; k < st.last_proposals.size(); ++k) {
        const std::string t = token_text(tok, st.last_proposals[k]);
        line += static_cast<int>(k) < n ? " [" + t + "]" : " " + t;
      }
      if (before + n < out.size()) line += ", target " + token_text(tok, out[before + n]);
      fmt::print(stderr, "{}\n", line);
    }
    flush_text(true);
    print_summary(std::span<const DecodeResult>(&st.result, 1), elapsed());
    return;
  }
  if (prompts.size() == 1) {
    const auto r = dec.generate(prompts, opts, a.d.batch_size,
                                [&](size_t, std::span<const int32_t> t) { on_tokens(t); });
    flush_text(true);
    print_summary(r, elapsed());
    return;
  }
  // Several prompts: decoded together, each output printed after its header, in prompt order.
  const auto r = dec.generate(prompts, opts, a.d.batch_size);
  const double seconds = elapsed();
  for (size_t i = 0; i < r.size(); ++i)
    fmt::print("{}[prompt {}]\n{}", i ? "\n\n" : "", i + 1, tok.decode(r[i].tokens));
  print_summary(r, seconds);
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "generate", "Speculative decoding of one prompt with a DFlash drafter (streams the text)");
  auto a = std::make_shared<GenerateArgs>();
  add_decode_args(sub, a->d);
  sub->add_option("--prompt", a->prompts,
                  "Prompt text (repeatable: the prompts are decoded together, --batch-size at a "
                  "time, and printed in order after a '[prompt N]' line)")
      ->required();
  sub->add_flag("--chat", a->chat,
                "Render the prompt as a user turn with the chat template and generation prompt");
  sub->add_flag("--show-steps", a->show_steps,
                "Print each speculative step to stderr: acceptance length, anchor, drafted tokens "
                "(accepted ones in [brackets]) and the target's token in their place");
  sub->callback([a] { run_generate(*a); });
}

}  // namespace dflash::cli
