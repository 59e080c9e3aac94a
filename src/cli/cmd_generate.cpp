// `dflash generate --target DIR --drafter DIR --prompt TEXT [--chat]`: speculative decoding of one
// prompt with a DFlash drafter. The text is streamed to stdout as tokens are accepted (special
// tokens included; a partial UTF-8 character is held back until complete), then one summary line
// per figure: "tokens", "steps", "tau", "tokens/s" (stable keys, tests grep them).
// With --chat the prompt is one user turn rendered with the chat template and the generation
// prompt; without it the prompt is raw text. With --show-steps each speculative step also prints
// one line to stderr: its acceptance length, the anchor and the drafted tokens (accepted ones in
// [brackets]) and the token the target put in their place (CPU backend only). With --backend cuda
// the decoding runs on GPU 0 (infer/decoder_cuda.hpp) and streams the same text.
#include <fmt/format.h>

#include <cstdio>
#include <optional>

#include "cli/commands.hpp"
#include "cli/cuda_decoder.hpp"
#include "cli/decode_args.hpp"
#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "data/conversation.hpp"
#include "data/tokenizer.hpp"
#include "infer/speculative.hpp"
#include "model/drafter_io.hpp"

namespace dflash::cli {

namespace {

struct GenerateArgs {
  DecodeArgs d;
  std::string prompt;
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

// The CPU decoding loop of one prompt, with the --show-steps lines.
DecodeResult generate_cpu(const SpeculativeDecoder& dec, std::span<const int32_t> ids,
                          const DecodeOptions& opts, const TokenCallback& on_tokens,
                          bool show_steps, const Tokenizer& tok) {
  std::vector<int32_t> out;
  const TokenCallback record = [&](std::span<const int32_t> toks) {
    out.insert(out.end(), toks.begin(), toks.end());
    on_tokens(toks);
  };
  SpecState st = dec.start(ids, opts, record);
  while (!st.done) {
    const int32_t anchor = st.anchor;
    const size_t before = out.size();
    dec.step(st, opts, record);
    if (!show_steps) continue;
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
  return std::move(st.result);
}

void run_generate(const GenerateArgs& a) {
  // Every argument is checked before the target's weights are loaded.
  if (a.d.backend == "cuda") {
    DFLASH_CHECK(!a.show_steps,
                 "--show-steps is not available with --backend cuda (the steps run on the device)");
    check_cuda_backend();
  }
  const ModelConfig target_cfg = model_config_load(a.d.target);
  const DecodeOptions opts = decode_options_from(a.d, target_cfg);
  const LoadedDrafter drafter = drafter_load(a.d.drafter);
  const Tokenizer tok = Tokenizer::load(a.d.target);
  std::optional<ChatTemplate> tmpl;
  if (a.chat) tmpl = resolve_chat_template(a.d.target, a.d.chat_template);
  check_decoding_inputs(a.d, target_cfg, drafter.config, tok, tmpl ? &*tmpl : nullptr);
  std::string text = a.prompt;
  if (tmpl) {
    Conversation conv;
    conv.messages.push_back(Message{Role::user, a.prompt});
    text = render_chat(*tmpl, conv, /*add_generation_prompt=*/true).text;
  }
  const std::vector<int32_t> ids = tok.encode(text);
  DFLASH_CHECK(!ids.empty(), "--prompt: the prompt is empty (it encodes to no token)");
  const TargetModel target = TargetModel::load(a.d.target, target_load_options());

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
  DecodeResult r;
  if (a.d.backend == "cuda") {
    const std::vector<std::vector<int32_t>> one = {ids};
    const auto dec_cuda = make_cuda_decoder(target, drafter, one, opts.max_new_tokens, 1);
    r = std::move(
        dec_cuda->generate(one, opts, 1, [&](size_t, std::span<const int32_t> t) { on_tokens(t); })
            .front());
  } else {
    const SpeculativeDecoder dec(target, drafter);
    r = generate_cpu(dec, ids, opts, on_tokens, a.show_steps, tok);
  }
  flush_text(true);
  const double secs = r.prefill_seconds + r.decode_seconds;
  fmt::print("\n\ntokens: {}\nsteps: {}\ntau: {:.3f}\ntokens/s: {:.1f}\n", r.tokens.size(),
             r.accept_lengths.size(), r.tau(), secs > 0 ? r.tokens.size() / secs : 0.0);
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "generate", "Speculative decoding of one prompt with a DFlash drafter (streams the text)");
  auto a = std::make_shared<GenerateArgs>();
  add_decode_args(sub, a->d);
  sub->add_option("--prompt", a->prompt, "Prompt text")->required();
  sub->add_flag("--chat", a->chat,
                "Render the prompt as a user turn with the chat template and generation prompt");
  sub->add_flag("--show-steps", a->show_steps,
                "Print each speculative step to stderr: acceptance length, anchor, drafted tokens "
                "(accepted ones in [brackets]) and the target's token in their place");
  sub->callback([a] { run_generate(*a); });
}

}  // namespace dflash::cli
