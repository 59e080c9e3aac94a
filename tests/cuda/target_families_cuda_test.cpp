// TargetCuda::forward_taps against the CPU target (and HF's goldens where they exist) for every
// family of tests/fixtures/models, on packed documents (positions restart, nothing crosses
// documents, a one-token document):
//   * qwen3-moe, qwen3-moe-window, gpt-oss, gpt-oss-mxfp4: the committed HF checkpoints (head_dim
//     64), on the goldens' prompts, whose routing decisions are no near-ties (min_router_gap);
//   * qwen2-bias, llama3-rope, llama-yarn (head_dim 16/32, which the CUDA attention does not run):
//     their configs with head_dim 64 and random bf16 weights, random tokens; plus qwen2-bias with
//     a sliding window of 8 from layer 1 on (use_sliding_window, max_window_layers).
// The CPU runs fp32 on the same bf16 weights; the GPU adds bf16 activations at GEMM inputs, so
// every tap must agree within tol::kTargetTaps (2e-2, as the tiny-qwen3 check in
// train_step_cuda_test), and the MoE families must route every token as the CPU does (checked
// through the taps). Random weights made on the device (`dflash bench`'s) fill every tensor of
// each family and of the qwen2.5-32b preset's first layers. The prefill on cuDNN's fused attention
// (TargetCuda::use_cudnn_prefill) matches the CPU too, and is refused by name for sliding-window
// and sink targets.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cuda/context.hpp"
#include "core/error.hpp"
#include "cuda/cuda_test_util.hpp"
#include "cuda/tolerances.hpp"
#include "model/presets.hpp"
#include "model/safetensors.hpp"
#include "model/target.hpp"
#include "model/target_cuda.hpp"
#include "model/weights.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using namespace dflash::test;
using json = nlohmann::json;

namespace {

fs::path models() {
  return source_dir() / "tests" / "fixtures" / "models";
}

// A checkpoint for `cfg` (written to dir/config.json) with random bf16 weights of O(1)
// activations: embeddings N(0,1), matrices N(0, 1/fan_in), norms 1 + N(0, 0.2²), biases
// N(0, 0.2²), sinks N(0,1) (the scheme of tools/make_model_goldens.py).
void write_random_checkpoint(const fs::path& dir, const json& cfg, uint32_t seed) {
  fs::create_directories(dir);
  write_file(dir / "config.json", cfg.dump(2));
  const ModelConfig c = model_config_load(dir);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const WeightSpec& s : expected_weights(c)) {
    EXPECT_EQ(s.format, WeightFormat::float_any) << s.name;
    Tensor t = Tensor::empty(s.shape, DType::bf16);
    const bool norm = s.name.ends_with("norm.weight");
    const bool bias = s.name.ends_with("bias");
    const bool unit = s.name.ends_with("sinks") || s.name.find("embed_tokens") != std::string::npos;
    const double fan_in = s.shape.size() >= 2 ? static_cast<double>(s.shape[1]) : 1.0;
    uint16_t* p = t.data<uint16_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float r = n01(rng);
      const float v = norm   ? 1.0f + 0.2f * r
                      : bias ? 0.2f * r
                      : unit ? r
                             : r / static_cast<float>(std::sqrt(fan_in));
      p[i] = f32_to_bf16_bits(v);
    }
    tensors.emplace_back(s.name, t);
  }
  safetensors_write(dir / "model.safetensors", tensors);
}

struct Docs {
  std::vector<std::vector<int32_t>> docs;
};

// Taps of every layer: GPU over the packed documents vs the CPU per document. Returns the worst
// relative error; `golden` (may be null) adds HF's layer outputs for documents 1 and 2 (the
// goldens' prompts p0 and p1). With `cudnn` the GPU's prefill runs on cuDNN's fused attention
// (TargetCuda::use_cudnn_prefill, a graph of exactly the documents' count and longest length).
double compare(const TargetModel& m, const Docs& d, const SafetensorsFile* golden,
               bool cudnn = false) {
  const int64_t H = m.hidden_size(), L = m.num_layers();
  std::vector<int> layers(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) layers[static_cast<size_t>(l)] = l;
  std::vector<int32_t> tokens, pos, offsets{0};
  for (const auto& doc : d.docs) {
    for (size_t i = 0; i < doc.size(); ++i) {
      tokens.push_back(doc[i]);
      pos.push_back(static_cast<int32_t>(i));
    }
    offsets.push_back(static_cast<int32_t>(tokens.size()));
  }
  const int64_t T = static_cast<int64_t>(tokens.size());
  const auto ranges =
      attention_causal_varlen_ranges(offsets.data(), static_cast<int64_t>(d.docs.size()), T);
  cuda::CudaContext ctx(0);
  TargetCuda tc(ctx, m, T + 5);
  if (cudnn) {
    size_t longest = 0;
    for (const auto& doc : d.docs) longest = std::max(longest, doc.size());
    tc.use_cudnn_prefill(static_cast<int64_t>(d.docs.size()), static_cast<int64_t>(longest));
  }
  DeviceGuarded<int32_t> dt(tokens), dp(pos);
  DeviceGuarded<AttnRange> dr(ranges);
  DeviceGuarded<uint16_t> out(static_cast<size_t>(T * L * H));
  tc.forward_taps(out.get(), dt.get(), dp.get(), dr.get(), T, layers);
  ctx.synchronize();
  EXPECT_TRUE(out.guard_intact());
  const std::vector<float> gpu = from_bf16(out.download());
  double worst = 0;
  for (size_t i = 0; i < d.docs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(d.docs[i].size()), t0 = offsets[i];
    const Tensor cpu =
        m.forward_taps(d.docs[i], std::vector<int32_t>{0, static_cast<int32_t>(n)}, layers);
    for (int64_t l = 0; l < L; ++l) {
      std::vector<float> g, c;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < H; ++h) {
          g.push_back(gpu[static_cast<size_t>(((t0 + t) * L + l) * H + h)]);
          c.push_back(cpu.data<float>()[(t * L + l) * H + h]);
        }
      const double e = rel_error(g, c);
      EXPECT_LT(e, tol::kTargetTaps) << "document " << i << " (" << n << " tokens), layer " << l;
      worst = std::max(worst, e);
      if (golden && (i == 1 || i == 2)) {
        const Tensor hf = golden->get(fmt::format("p{}.layer{}.out", i - 1, l));
        const double eh = rel_error(g, hf.to_f32_vector());
        EXPECT_LT(eh, tol::kTargetTaps) << "vs HF: prompt " << i - 1 << ", layer " << l;
        worst = std::max(worst, eh);
      }
    }
  }
  return worst;
}

std::vector<int32_t> ids_of(const SafetensorsFile& g, const std::string& name) {
  const Tensor t = g.get_as(name, DType::i32);
  return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(V) - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

}  // namespace

TEST(TargetCudaFamilies, HfCheckpointsMatchCpuAndGoldens) {
  DFLASH_REQUIRE_GPU();
  for (const char* name : {"qwen3-moe", "qwen3-moe-window", "gpt-oss", "gpt-oss-mxfp4"}) {
    SCOPED_TRACE(name);
    const TargetModel m = TargetModel::load(models() / name);
    const SafetensorsFile g(models() / name / "golden.safetensors");
    const std::vector<int32_t> p0 = ids_of(g, "p0.input_ids"), p1 = ids_of(g, "p1.input_ids");
    // A one-token document (p0's first token: routed as in p0), then p0 and p1.
    const Docs d{{{p0[0]}, p0, p1}};
    const double worst = compare(m, d, &g);
    std::printf("%s: worst tap error %.3g (GPU vs CPU and HF, %lld layers)\n", name, worst,
                static_cast<long long>(m.num_layers()));
  }
}

TEST(TargetCudaFamilies, DenseFamiliesWithHeadDim64MatchCpu) {
  DFLASH_REQUIRE_GPU();
  struct Variant {
    const char* name;
    const char* fixture;
    json patch;
  };
  const std::vector<Variant> variants = {
      {"qwen2-bias", "qwen2-bias", json{{"head_dim", 64}}},
      {"qwen2-window", "qwen2-bias",
       json{{"head_dim", 64},
            {"use_sliding_window", true},
            {"sliding_window", 8},
            {"max_window_layers", 1},
            {"layer_types", nullptr}}},
      {"llama3-rope", "llama3-rope", json{{"head_dim", 64}}},
      {"llama-yarn", "llama-yarn", json{{"head_dim", 64}}},
  };
  uint32_t seed = 1;
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir dir;
    json cfg = json::parse(read_file(models() / v.fixture / "config.json"));
    cfg.merge_patch(v.patch);
    write_random_checkpoint(dir.path(), cfg, seed++);
    const TargetModel m = TargetModel::load(dir.path());
    if (std::string(v.name) == "qwen2-window") {
      EXPECT_EQ(m.config().num_sliding_layers(), 2);
    }
    const int64_t V = m.vocab_size();
    const Docs d{{random_tokens(1, V, seed), random_tokens(40, V, seed + 1),
                  random_tokens(29, V, seed + 2), random_tokens(13, V, seed + 3)}};
    const double worst = compare(m, d, nullptr);
    std::printf("%s: worst tap error %.3g (GPU vs CPU)\n", v.name, worst);
  }
}

TEST(TargetCudaFamilies, TheCudnnPrefillMatchesCpuAndRefusesWindowsAndSinks) {
  DFLASH_REQUIRE_GPU();
  {
    SCOPED_TRACE("qwen3-moe on cuDNN");
    const TargetModel m = TargetModel::load(models() / "qwen3-moe");
    const SafetensorsFile g(models() / "qwen3-moe" / "golden.safetensors");
    const std::vector<int32_t> p0 = ids_of(g, "p0.input_ids"), p1 = ids_of(g, "p1.input_ids");
    const double worst = compare(m, Docs{{{p0[0]}, p0, p1}}, &g, true);
    std::printf("qwen3-moe, cuDNN prefill: worst tap error %.3g\n", worst);
  }
  for (const char* fixture : {"qwen2-bias", "llama3-rope"}) {
    SCOPED_TRACE(std::string(fixture) + " on cuDNN");
    TempDir dir;
    json cfg = json::parse(read_file(models() / fixture / "config.json"));
    cfg.merge_patch(json{{"head_dim", 64}});
    write_random_checkpoint(dir.path(), cfg, 7);
    const TargetModel m = TargetModel::load(dir.path());
    const int64_t V = m.vocab_size();
    const Docs d{{random_tokens(1, V, 8), random_tokens(40, V, 9), random_tokens(29, V, 10),
                  random_tokens(13, V, 11)}};
    const double worst = compare(m, d, nullptr, true);
    std::printf("%s, cuDNN prefill: worst tap error %.3g\n", fixture, worst);
  }
  cuda::CudaContext ctx(0);
  for (auto [fixture, reason] :
       {std::pair{"qwen3-moe-window", "sliding-window layers"}, {"gpt-oss", "attention sinks"}}) {
    const TargetModel m = TargetModel::load(models() / fixture);
    TargetCuda tc(ctx, m, 16);
    try {
      tc.use_cudnn_prefill(2, 8);
      ADD_FAILURE() << fixture << ": use_cudnn_prefill did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  }
}

TEST(TargetCudaFamilies, RandomWeightsFillEveryTensorOfEachFamily) {
  // `dflash bench` builds TargetCuda from a config with random weights made on the device; the
  // constructor checks that the fills cover every planned weight byte (biases, sinks, routers,
  // experts), so a tensor the filler misses throws. Each family's tiny config (qwen2-bias with
  // head_dim 64), and the first 2 layers of the qwen2.5-32b preset (q/k/v biases, untied head),
  // then a forward over 3 documents whose taps must be finite and not all zero.
  DFLASH_REQUIRE_GPU();
  std::vector<std::pair<std::string, ModelConfig>> configs;
  for (const char* name : {"qwen3-moe", "qwen3-moe-window", "gpt-oss"}) {
    configs.emplace_back(name, model_config_load(models() / name));
  }
  json q2 = json::parse(read_file(models() / "qwen2-bias" / "config.json"));
  q2.merge_patch(json{{"head_dim", 64}});
  configs.emplace_back("qwen2-bias", model_config_from_json(q2, "qwen2-bias"));
  configs.emplace_back("qwen2.5-32b", model_preset("qwen2.5-32b").config);
  for (const auto& [name, c] : configs) {
    SCOPED_TRACE(name);
    const int64_t layers = std::min<int64_t>(c.num_hidden_layers, 2), H = c.hidden_size;
    const std::vector<int32_t> offsets{0, 1, 41, 70};
    const int64_t T = offsets.back();
    const std::vector<int32_t> tokens = random_tokens(T, c.vocab_size, 7);
    std::vector<int32_t> pos;
    for (size_t d = 0; d + 1 < offsets.size(); ++d) {
      for (int32_t t = offsets[d]; t < offsets[d + 1]; ++t) pos.push_back(t - offsets[d]);
    }
    const auto ranges = attention_causal_varlen_ranges(offsets.data(), 3, T);
    cuda::CudaContext ctx(0);
    TargetCuda tc(ctx, c, 11, T, layers);
    const std::vector<int> taps{0, static_cast<int>(layers - 1)};
    DeviceGuarded<int32_t> dt(tokens), dp(pos);
    DeviceGuarded<AttnRange> dr(ranges);
    DeviceGuarded<uint16_t> out(static_cast<size_t>(T * 2 * H));
    tc.forward_taps(out.get(), dt.get(), dp.get(), dr.get(), T, taps);
    ctx.synchronize();
    EXPECT_TRUE(out.guard_intact());
    const std::vector<float> v = from_bf16(out.download());
    EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); }));
    EXPECT_TRUE(std::any_of(v.begin(), v.end(), [](float x) { return x != 0.0f; }));
  }
}
