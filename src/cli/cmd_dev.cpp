// `dflash dev ...`: developer tools that expose internals to the reference tests
// (tests/reference/*_test.py). Not part of the user interface: inputs and outputs are plain
// safetensors files with fixed names, described in each tool's help.
//
// `dflash dev drafter-step IN.safetensors OUT.safetensors`: one DFlash training step of the CPU
// drafter on one packed row (block_targets + drafter_train_step<float> over a one-row DrafterBatch,
// gradient of Σw·CE/Σw).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/json_util.hpp"
#include "model/drafter.hpp"
#include "model/drafter_io.hpp"
#include "model/objective.hpp"
#include "model/safetensors.hpp"

namespace dflash::cli {

namespace {

/// Tensor `name` of `f` with dtype `dt` and the given shape (-1 = any size); errors name both.
Tensor input(const SafetensorsFile& f, const std::string& name, DType dt, const Shape& shape) {
  DFLASH_CHECK(f.contains(name), "{}: missing tensor '{}'", f.path().string(), name);
  const TensorInfo& info = f.info(name);
  DFLASH_CHECK(info.dtype == dt, "{}: tensor '{}' has dtype {}, expected {}", f.path().string(),
               name, dtype_name(info.dtype), dtype_name(dt));
  bool ok = info.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == info.shape[i];
  DFLASH_CHECK(ok, "{}: tensor '{}' has shape {}, expected {} (-1: any)", f.path().string(), name,
               shape_str(info.shape), shape_str(shape));
  return f.get(name).contiguous();
}

template <typename T>
std::vector<T> values(const Tensor& t) {
  const T* p = t.data<T>();
  return std::vector<T>(p, p + t.numel());
}

void run_drafter_step(const std::string& in_path, const std::string& out_path) {
  SafetensorsFile f(in_path);
  const auto& meta = f.metadata();
  auto meta_at = [&](const std::string& k) -> const std::string& {
    auto it = meta.find(k);
    DFLASH_CHECK(it != meta.end(), "{}: missing metadata key '{}'", in_path, k);
    return it->second;
  };
  const DrafterConfig cfg =
      drafter_config_from_json(json_parse_strict(meta_at("config"), in_path + ": metadata config"),
                               in_path + ": metadata config");
  double gamma = 0;
  try {
    gamma = std::stod(meta_at("gamma"));
  } catch (const std::logic_error&) {
    fail("{}: metadata 'gamma' is not a number: '{}'", in_path, meta_at("gamma"));
  }
  const DrafterLayout layout(cfg);
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, K = cfg.block_size;

  std::vector<float> params(static_cast<size_t>(layout.total));
  for (const ParamInfo& p : layout.params) {
    Tensor t = input(f, "params." + p.name, DType::f32, p.shape);
    std::copy(t.data<float>(), t.data<float>() + p.numel, params.begin() + p.offset);
  }
  std::set<std::string> expected = {"embed",     "lm_head",     "features", "tokens",
                                    "loss_mask", "doc_offsets", "anchors"};
  for (const ParamInfo& p : layout.params) expected.insert("params." + p.name);
  for (const std::string& n : f.names()) {
    DFLASH_CHECK(expected.count(n), "{}: unexpected tensor '{}'", in_path, n);
  }
  const std::vector<float> embed = values<float>(input(f, "embed", DType::f32, {V, H}));
  const std::vector<float> head = values<float>(input(f, "lm_head", DType::f32, {V, H}));
  const Tensor feat_t = input(f, "features", DType::f32, {-1, cfg.n_taps() * H});
  const int64_t T = feat_t.dim(0);
  const std::vector<float> features = values<float>(feat_t);
  const std::vector<int32_t> tokens = values<int32_t>(input(f, "tokens", DType::i32, {T}));
  const std::vector<uint8_t> loss_mask = values<uint8_t>(input(f, "loss_mask", DType::u8, {T}));
  const std::vector<int32_t> doc_offsets =
      values<int32_t>(input(f, "doc_offsets", DType::i32, {-1}));
  const std::vector<int32_t> anchor_raw = values<int32_t>(input(f, "anchors", DType::i32, {-1, 2}));
  for (int32_t t : tokens) {
    DFLASH_CHECK(t >= 0 && t < V, "{}: token {} outside the vocabulary [0, {})", in_path, t, V);
  }
  check_doc_offsets(doc_offsets, T);
  std::vector<Anchor> anchors(anchor_raw.size() / 2);
  for (size_t b = 0; b < anchors.size(); ++b)
    anchors[b] = {anchor_raw[2 * b], anchor_raw[2 * b + 1]};
  const int64_t N = static_cast<int64_t>(anchors.size());

  const BlockTargets targets =
      block_targets(tokens, loss_mask, doc_offsets, anchors, static_cast<int>(K), gamma);
  // Tokens past the last document are padding: in a DrafterBatch they become one more document
  // without anchors, which no block sees (so it changes no loss and no gradient).
  std::vector<int32_t> batch_offsets = doc_offsets;
  if (batch_offsets.back() < T) batch_offsets.push_back(static_cast<int32_t>(T));
  DrafterBatch batch(static_cast<int>(K));
  batch.append_row(tokens, batch_offsets, anchors, targets);
  DFLASH_CHECK(batch.weight_sum > 0, "{}: the anchors supervise no slot (Σw = 0)", in_path);
  std::vector<float> grads(static_cast<size_t>(layout.total), 0.0f);
  DrafterWorkspace<float> ws;
  const DrafterTrainResult res = drafter_train_step<float>(
      cfg, layout, params.data(), grads.data(), DrafterTables<float>{embed.data(), head.data()},
      batch, features.data(), 1.0 / batch.weight_sum, ws);

  ObjectiveMetrics m(static_cast<int>(K));
  accumulate_metrics(m, targets, res.argmax, {});
  std::vector<float> slot_acc(static_cast<size_t>(K));
  for (int k = 0; k < K; ++k) slot_acc[k] = static_cast<float>(m.slot_accuracy(k));

  std::vector<std::pair<std::string, Tensor>> out;
  auto scalar = [](double v) { return Tensor::from_f32({static_cast<float>(v)}, {1}); };
  out.emplace_back("loss", scalar(res.loss_sum / res.weight_sum));
  out.emplace_back("accuracy", scalar(m.accuracy()));
  out.emplace_back("tau", scalar(m.tau()));
  out.emplace_back("slot_accuracy", Tensor::from_f32(slot_acc, {K}));
  {
    // argmax of every slot from the full logits (the training step computes only the
    // supervised slots'; the first maximum, as the CE's).
    const DrafterTables<float> tables{embed.data(), head.data()};
    std::vector<float> logits =
        drafter_block_logits<float>(cfg, layout, params.data(), tables, batch, features.data(), ws);
    Tensor am = Tensor::empty({N, K}, DType::i32);
    for (int64_t i = 0; i < N * K; ++i) {
      const float* z = logits.data() + i * V;
      const int32_t a = static_cast<int32_t>(std::max_element(z, z + V) - z);
      am.data<int32_t>()[i] = a;
    }
    out.emplace_back("argmax", am);
    out.emplace_back("logits", Tensor::from_f32(logits, {N, K, cfg.vocab_size}));
  }
  for (const ParamInfo& p : layout.params) {
    std::vector<float> g(grads.begin() + p.offset, grads.begin() + p.offset + p.numel);
    out.emplace_back("grad." + p.name, Tensor::from_f32(g, p.shape));
  }
  safetensors_write(out_path, out);
  fmt::print(
      "drafter-step: {} blocks of {} slots, loss {:.6f}, accuracy {:.4f}, tau {:.4f} -> {}\n", N, K,
      res.loss_sum / res.weight_sum, m.accuracy(), m.tau(), out_path);
}

}  // namespace

void add_dev_command(CLI::App& app) {
  CLI::App* dev = app.add_subcommand(
      "dev", "Developer tools for the reference tests (internal; inputs and outputs may change)");
  dev->require_subcommand(1);

  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  CLI::App* step = dev->add_subcommand(
      "drafter-step",
      "One CPU training step of a DFlash drafter on one packed row (developer tool).\n"
      "IN.safetensors: metadata 'config' (drafter config.json text) and 'gamma'; tensors\n"
      "'params.<export name>' f32, 'embed' [V,H] f32, 'lm_head' [V,H] f32, 'features' [T,F] f32,\n"
      "'tokens' [T] i32, 'loss_mask' [T] u8, 'doc_offsets' [n+1] i32, 'anchors' [N,2] i32\n"
      "(position, document).\n"
      "OUT.safetensors: 'loss' [1] (Σw·CE/Σw), 'accuracy' [1], 'tau' [1], 'slot_accuracy' [K]\n"
      "(NaN where unsupervised), 'argmax' [N,K] i32, 'logits' [N,K,V] f32, 'grad.<export name>' "
      "f32 (gradient of loss).");
  step->add_option("IN", *in, "input safetensors file")->required();
  step->add_option("OUT", *out, "output safetensors file")->required();
  step->callback([in, out] { run_drafter_step(*in, *out); });
}

}  // namespace dflash::cli
