// Tests of the run configuration (src/train/run_config) and run directory (src/train/run_dir).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "train/run_config.hpp"
#include "train/run_dir.hpp"
#include "util/test_util.hpp"

using namespace dflash;

namespace {
const char* kYaml = R"(model:
  target: /models/tiny
  drafter_layers: 2
  mask_token_id: 8000
  target_layer_ids: [1, 3]
data:
  train_file: data.jsonl
  token_budget: 4096
training:
  max_steps: 1200
  lr: 6.0e-4
  gamma: 7
runtime:
  backend: cpu
output_dir: runs/x
)";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST(RunConfig, ParsesSectionsAndKeepsDefaults) {
  RunConfig c = RunConfig::from_yaml(kYaml, "run.yaml");
  EXPECT_EQ(c.model.drafter_layers, 2);
  EXPECT_EQ(c.model.target_layer_ids, (std::vector<int>{1, 3}));
  EXPECT_EQ(c.model.mask_token_id, 8000);
  EXPECT_FALSE(c.model.intermediate_size.has_value());
  EXPECT_EQ(c.data.token_budget, 4096);
  EXPECT_EQ(c.training.max_steps, 1200);
  EXPECT_DOUBLE_EQ(c.training.gamma, 7.0);
  EXPECT_EQ(c.training.block_size, 16);  // default
  EXPECT_EQ(c.output_dir, "runs/x");
}

TEST(RunConfig, UnknownKeysAndSectionsNameTheLine) {
  std::string y = kYaml;
  y.replace(y.find("  lr: 6.0e-4"), 12, "  lrr: 6e-4");
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(y, "run.yaml"); })
                .find("run.yaml:11: unknown key 'training.lrr'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(std::string(kYaml) + "extra:\n  a: 1\n", "r.yaml"); })
                .find("unknown section 'extra'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml("model: [1\n", "bad.yaml"); }).find("bad.yaml:"),
            std::string::npos);
}

TEST(RunConfig, KeysThatAreNotWordsNameTheLine) {
  // A mapping used as a section name (found by the run_config fuzz harness: yaml-cpp's
  // TypedBadConversion escaped as an internal error).
  EXPECT_NE(error_of([] {
              RunConfig::from_yaml("{m1_file: f}: o}\n", "r.yaml");
            }).find("r.yaml:1: a section name must be a plain word"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              RunConfig::from_yaml("model:\n  [a, b]: 1\n", "r.yaml");
            }).find("r.yaml:2: a key of section 'model' must be a plain word"),
            std::string::npos);
}

TEST(RunConfig, TypeAndRangeErrorsNameTheKey) {
  std::string y = kYaml;
  y.replace(y.find("max_steps: 1200"), 15, "max_steps: lots");
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(y, "run.yaml"); })
                .find("training.max_steps must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", {"training.lr=-1"}); })
                .find("training.lr must be > 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", {"runtime.backend=tpu"}); })
                .find("runtime.backend must be cpu or cuda"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", {"data.max_length=9000"}); })
                .find("data.max_length"),
            std::string::npos);
}

TEST(RunConfig, LossTypeAndDPaceAlphaAreValidatedNamingTheKey) {
  const RunConfig def = RunConfig::from_yaml(kYaml, "run.yaml");
  EXPECT_EQ(def.training.loss_type, "dflash");
  EXPECT_EQ(def.training.dpace_alpha, 0.5);
  EXPECT_EQ(objective_of(def.training), (Objective{LossType::dflash, 0.5}));
  const RunConfig c = RunConfig::from_yaml(
      kYaml, "run.yaml",
      {"training.loss_type=dpace-continuation-value-only", "training.dpace_alpha=0"});
  EXPECT_EQ(objective_of(c.training), (Objective{LossType::dpace_continuation_value_only, 0.0}));
  // The resolved YAML keeps them, and a changed loss is a resume incompatibility.
  EXPECT_EQ(RunConfig::from_yaml(c.to_yaml(), "resolved.yaml").training.loss_type,
            "dpace-continuation-value-only");
  ASSERT_EQ(def.resume_incompatibilities(c).size(), 2u);
  EXPECT_NE(def.resume_incompatibilities(c)[0].find("training.loss_type"), std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", {"training.loss_type=pace"}); })
                .find("training.loss_type must be dflash, dpace, "
                      "dpace-cumulative-confidence-only or dpace-continuation-value-only, got "
                      "'pace'"),
            std::string::npos);
  for (const char* alpha : {"1.5", "-0.1", ".nan"}) {
    EXPECT_NE(error_of([&] {
                RunConfig::from_yaml(kYaml, "run.yaml",
                                     {std::string("training.dpace_alpha=") + alpha});
              }).find("training.dpace_alpha must be in [0, 1]"),
              std::string::npos)
        << alpha;
  }
  std::string y = kYaml;
  y.replace(y.find("gamma: 7"), 8, "dpace_alpha: x");
  EXPECT_NE(error_of([&] {
              RunConfig::from_yaml(y, "run.yaml");
            }).find("run.yaml:12: training.dpace_alpha must be a number"),
            std::string::npos);
  // Both backends compute the D-PACE losses.
  EXPECT_EQ(
      RunConfig::from_yaml(kYaml, "run.yaml", {"training.loss_type=dpace", "runtime.backend=cuda"})
          .training.loss_type,
      "dpace");
}

TEST(RunConfig, Dflash2KeysAreValidatedNamingTheKey) {
  auto err = [](std::vector<std::string> o) {
    return error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", o); });
  };
  const std::vector<std::string> sizes = {
      "training.objective=dflash2", "training.conv_kernel_size=2", "training.conv_group_size=16",
      "training.selector_rank=8", "training.selector_top_k=4"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> o = sizes;
    o.insert(o.end(), more.begin(), more.end());
    return o;
  };
  const RunConfig def = RunConfig::from_yaml(kYaml, "run.yaml");
  EXPECT_FALSE(dflash2_heads_of(def.training).enabled);
  const RunConfig c = RunConfig::from_yaml(kYaml, "run.yaml", sizes);
  const Objective o = objective_of(c.training);
  EXPECT_TRUE(o.dflash2());
  EXPECT_FALSE(o.dflash2_stop_gradient);
  EXPECT_EQ(dflash2_heads_of(c.training), (Dflash2Heads{true, 2, 16, 8, 4, 1.0, 0.0}));
  // SpecForge's schedule defaults: α 1, no warmup, no ramp.
  EXPECT_EQ(c.training.dflash2_selector_loss_alpha, 1.0);
  EXPECT_EQ(c.training.dflash2_selector_warmup_ratio, 0.0);
  EXPECT_EQ(c.training.dflash2_selector_ramp_ratio, 0.0);
  const RunConfig r = RunConfig::from_yaml(
      kYaml, "run.yaml",
      with({"training.output_multiplier=0.25", "training.final_logit_softcapping=20",
            "training.dflash2_selector_stop_gradient=true", "training.selector_rank=4"}));
  EXPECT_EQ(dflash2_heads_of(r.training), (Dflash2Heads{true, 2, 16, 4, 4, 0.25, 20.0}));
  EXPECT_TRUE(objective_of(r.training).dflash2_stop_gradient);
  // The resolved YAML keeps them; the conv and selector sizes change the parameter shapes.
  const RunConfig back = RunConfig::from_yaml(r.to_yaml(), "resolved.yaml");
  EXPECT_EQ(dflash2_heads_of(back.training), dflash2_heads_of(r.training));
  EXPECT_TRUE(back.shape_changes(r).empty());
  ASSERT_FALSE(c.shape_changes(r).empty());
  EXPECT_NE(c.shape_changes(r)[0].find("training.selector_rank"), std::string::npos);
  EXPECT_NE(def.shape_changes(c)[0].find("training.objective"), std::string::npos);
  // Errors name the key.
  EXPECT_NE(err({"training.objective=dflash2"})
                .find("training.conv_kernel_size must be set to an integer >= 1 for "
                      "training.objective dflash2"),
            std::string::npos);
  EXPECT_NE(err({"training.selector_rank=4"})
                .find("training.selector_rank applies only to training.objective: dflash2"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.dflash2_selector_loss_alpha=0.5"})
                .find("training.dflash2_selector_loss_alpha applies only to training.objective: "
                      "dflash2 (the objective is dspark)"),
            std::string::npos);
  EXPECT_NE(err(with({"training.conv_kernel_size=17"}))
                .find("training.conv_kernel_size 17 must be <= training.block_size"),
            std::string::npos);
  EXPECT_NE(err(with({"training.output_multiplier=0"})).find("training.output_multiplier must"),
            std::string::npos);
  EXPECT_NE(err(with({"training.final_logit_softcapping=-1"}))
                .find("training.final_logit_softcapping must"),
            std::string::npos);
  EXPECT_NE(err(with({"training.dflash2_selector_loss_alpha=-1"}))
                .find("training.dflash2_selector_loss_alpha must"),
            std::string::npos);
  EXPECT_NE(err(with({"training.dflash2_selector_ramp_ratio=1.5"}))
                .find("training.dflash2_selector_ramp_ratio must be in [0, 1], got 1.5"),
            std::string::npos);
  // The base loss takes each D-PACE loss type (plain D-PACE's weights and denominator), on both
  // backends.
  for (const char* loss :
       {"dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"}) {
    SCOPED_TRACE(loss);
    const RunConfig d = RunConfig::from_yaml(
        kYaml, "run.yaml",
        with({std::string("training.loss_type=") + loss, "training.dpace_alpha=0.25"}));
    const Objective od = objective_of(d.training);
    EXPECT_TRUE(od.dflash2());
    EXPECT_EQ(od.loss, *loss_type_parse(loss));
    EXPECT_EQ(od.dpace_alpha, 0.25);
    EXPECT_EQ(err(with({std::string("training.loss_type=") + loss, "runtime.backend=cuda"})),
              "(no error)");
  }
  // DFlash2 trains on the cuda backend too.
  EXPECT_EQ(err(with({"runtime.backend=cuda"})), "(no error)");
}

TEST(RunConfig, DSparkKeysAreValidatedNamingTheKey) {
  auto err = [](std::vector<std::string> o) {
    return error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", o); });
  };
  const RunConfig def = RunConfig::from_yaml(kYaml, "run.yaml");
  EXPECT_EQ(def.training.objective, "dflash");
  EXPECT_FALSE(dspark_heads_of(def.training).enabled);
  // Defaults of SpecForge's OnlineDSparkModel; the confidence head is on when its alpha is > 0.
  const RunConfig c = RunConfig::from_yaml(kYaml, "run.yaml", {"training.objective=dspark"});
  const Objective o = objective_of(c.training);
  EXPECT_TRUE(o.dspark());
  EXPECT_EQ(o.dspark_ce_alpha, 0.1);
  EXPECT_EQ(o.dspark_l1_alpha, 0.9);
  EXPECT_EQ(o.dspark_conf_alpha, 1.0);
  const DsparkHeads h = dspark_heads_of(c.training);
  EXPECT_TRUE(h.enabled && h.confidence_head && !h.confidence_with_markov);
  EXPECT_EQ(h.markov_rank, 0);
  EXPECT_FALSE(dspark_heads_of(RunConfig::from_yaml(kYaml, "run.yaml",
                                                    {"training.objective=dspark",
                                                     "training.dspark_confidence_head_alpha=0"})
                                   .training)
                   .confidence_head);
  const RunConfig r = RunConfig::from_yaml(
      kYaml, "run.yaml",
      {"training.objective=dspark", "training.markov_rank=8", "training.markov_head_type=rnn",
       "training.confidence_head_with_markov=true", "training.enable_confidence_head=true"});
  EXPECT_EQ(dspark_heads_of(r.training),
            (DsparkHeads{true, 8, MarkovHeadType::rnn, true, true}));
  // The resolved YAML keeps them; the heads change the parameter shapes (resume refuses them).
  const RunConfig back = RunConfig::from_yaml(r.to_yaml(), "resolved.yaml");
  EXPECT_EQ(dspark_heads_of(back.training), dspark_heads_of(r.training));
  EXPECT_TRUE(back.shape_changes(r).empty());
  EXPECT_FALSE(c.shape_changes(r).empty());
  EXPECT_NE(c.shape_changes(r)[0].find("training.markov_rank"), std::string::npos);
  EXPECT_NE(def.shape_changes(c)[0].find("training.objective"), std::string::npos);
  // Errors name the key.
  EXPECT_NE(err({"training.objective=spark"})
                .find("training.objective must be dflash, dspark, dflash2 or domino, got "
                      "'spark'"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.loss_type=dpace"})
                .find("training.loss_type dpace is a loss of the dflash objective"),
            std::string::npos);
  EXPECT_NE(err({"training.markov_rank=4"})
                .find("training.markov_rank applies only to training.objective: dspark"),
            std::string::npos);
  EXPECT_NE(err({"training.dspark_l1_loss_alpha=0.5"})
                .find("training.dspark_l1_loss_alpha applies only to training.objective: dspark"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.markov_rank=-1"})
                .find("training.markov_rank must be >= 0"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.markov_head_type=gru"})
                .find("training.markov_head_type must be vanilla, gated or rnn, got 'gru'"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.markov_head_type=gated"})
                .find("training.markov_head_type gated needs training.markov_rank > 0"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.confidence_head_with_markov=true"})
                .find("training.confidence_head_with_markov needs training.markov_rank > 0"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.markov_rank=2",
                 "training.confidence_head_with_markov=true",
                 "training.enable_confidence_head=false"})
                .find("training.confidence_head_with_markov needs the confidence head"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.dspark_ce_loss_alpha=-1"})
                .find("training.dspark_ce_loss_alpha must be a number >= 0, got -1"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.dspark_ce_loss_alpha=0",
                 "training.dspark_l1_loss_alpha=0", "training.dspark_confidence_head_alpha=0"})
                .find("the DSpark loss would be 0"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.enable_confidence_head=maybe"})
                .find("training.enable_confidence_head must be true or false"),
            std::string::npos);
  // The CUDA backend runs every Markov head type (any rank) and the confidence heads.
  for (const char* t : {"vanilla", "gated", "rnn"}) {
    EXPECT_NO_THROW(RunConfig::from_yaml(
        kYaml, "run.yaml",
        {"training.objective=dspark", "runtime.backend=cuda", "training.markov_rank=3",
         std::string("training.markov_head_type=") + t}))
        << t;
  }
}

TEST(RunConfig, DominoKeysAreValidatedNamingTheKey) {
  auto err = [](std::vector<std::string> o) {
    return error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", o); });
  };
  const std::vector<std::string> dims = {"training.objective=domino", "training.emb_dim=32",
                                         "training.gru_hidden_dim=48"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> o = dims;
    o.insert(o.end(), more.begin(), more.end());
    return o;
  };
  const RunConfig def = RunConfig::from_yaml(kYaml, "run.yaml");
  EXPECT_FALSE(domino_head_of(def.training).enabled);
  // SpecForge's defaults: P 0, shift_label false, λ0 1, decay ratio 0.5.
  const RunConfig c = RunConfig::from_yaml(kYaml, "run.yaml", dims);
  const Objective o = objective_of(c.training);
  EXPECT_TRUE(o.domino());
  EXPECT_FALSE(o.domino_shift_label);
  EXPECT_EQ(o.first_slot(), 1);
  EXPECT_EQ(c.training.lambda_base_start, 1.0);
  EXPECT_EQ(c.training.lambda_base_decay_ratio, 0.5);
  EXPECT_EQ(domino_head_of(c.training), (DominoHead{true, 32, 48, 0, false}));
  const RunConfig r = RunConfig::from_yaml(
      kYaml, "run.yaml",
      with({"training.pure_draft_prefix_len=1", "training.shift_label=true",
            "training.lambda_base_start=0.5", "training.lambda_base_decay_ratio=0.25"}));
  EXPECT_EQ(domino_head_of(r.training), (DominoHead{true, 32, 48, 1, true}));
  EXPECT_TRUE(objective_of(r.training).domino_shift_label);
  EXPECT_EQ(objective_of(r.training).first_slot(), 0);
  // The resolved YAML keeps them; emb_dim and gru_hidden_dim change the parameter shapes.
  const RunConfig back = RunConfig::from_yaml(r.to_yaml(), "resolved.yaml");
  EXPECT_EQ(domino_head_of(back.training), domino_head_of(r.training));
  EXPECT_EQ(back.training.lambda_base_decay_ratio, 0.25);
  EXPECT_TRUE(back.shape_changes(r).empty());
  EXPECT_TRUE(c.shape_changes(r).empty());  // P and shift_label keep the shapes
  EXPECT_FALSE(c.resume_incompatibilities(r).empty());
  const RunConfig wider = RunConfig::from_yaml(kYaml, "run.yaml", with({"training.emb_dim=64"}));
  ASSERT_EQ(c.shape_changes(wider).size(), 1u);
  EXPECT_NE(c.shape_changes(wider)[0].find("training.emb_dim"), std::string::npos);
  EXPECT_NE(def.shape_changes(c)[0].find("training.objective"), std::string::npos);
  // Errors name the key.
  EXPECT_NE(err({"training.objective=domino", "training.gru_hidden_dim=48"})
                .find("training.emb_dim is required by training.objective domino"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=domino", "training.emb_dim=48"})
                .find("training.gru_hidden_dim is required by training.objective domino"),
            std::string::npos);
  EXPECT_NE(err(with({"training.emb_dim=0"})).find("training.emb_dim must be > 0, got 0"),
            std::string::npos);
  EXPECT_NE(err(with({"training.loss_type=dpace"}))
                .find("training.loss_type dpace is a loss of the dflash objective; "
                      "training.objective domino"),
            std::string::npos);
  EXPECT_NE(err({"training.emb_dim=4"})
                .find("training.emb_dim applies only to training.objective: domino"),
            std::string::npos);
  EXPECT_NE(err({"training.objective=dspark", "training.shift_label=true"})
                .find("training.shift_label applies only to training.objective: domino"),
            std::string::npos);
  EXPECT_NE(err({"training.lambda_base_start=0.5"})
                .find("training.lambda_base_start applies only to training.objective: domino"),
            std::string::npos);
  EXPECT_NE(err(with({"training.pure_draft_prefix_len=15"}))
                .find("training.pure_draft_prefix_len must be in [0, 14]"),
            std::string::npos);
  EXPECT_NE(err(with({"training.lambda_base_start=1.5"}))
                .find("training.lambda_base_start must be in [0, 1], got 1.5"),
            std::string::npos);
  EXPECT_NE(err(with({"training.lambda_base_decay_ratio=0"}))
                .find("training.lambda_base_decay_ratio must be in (0, 1], got 0"),
            std::string::npos);
  EXPECT_NE(err(with({"training.shift_label=maybe"})).find("training.shift_label"),
            std::string::npos);
  // The CUDA backend trains the Domino head (model/domino_head_cuda).
  const RunConfig on_cuda = RunConfig::from_yaml(kYaml, "run.yaml", with({"runtime.backend=cuda"}));
  EXPECT_EQ(domino_head_of(on_cuda.training), (DominoHead{true, 32, 48, 0, false}));
}

TEST(RunConfig, OverridesApplyAndUnknownPathsFail) {
  RunConfig c = RunConfig::from_yaml(kYaml, "run.yaml",
                                     {"training.lr=1e-3", "model.target_layer_ids=[2]",
                                      "output_dir=elsewhere"});
  EXPECT_DOUBLE_EQ(c.training.lr, 1e-3);
  EXPECT_EQ(c.model.target_layer_ids, (std::vector<int>{2}));
  EXPECT_EQ(c.output_dir, "elsewhere");
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", {"training.nope=1"}); })
                .find("unknown key 'training.nope'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunConfig::from_yaml(kYaml, "run.yaml", {"training.lr"}); })
                .find("section.key=value"),
            std::string::npos);
}

TEST(RunConfig, ResolvedYamlRoundTripsAndResumeDiffsListKeys) {
  RunConfig c = RunConfig::from_yaml(kYaml, "run.yaml");
  RunConfig back = RunConfig::from_yaml(c.to_yaml(), "resolved.yaml");
  EXPECT_EQ(back.to_yaml(), c.to_yaml());
  EXPECT_TRUE(c.resume_incompatibilities(back).empty());
  RunConfig d = RunConfig::from_yaml(kYaml, "run.yaml",
                                     {"training.seed=5", "training.log_interval=1"});
  auto diffs = c.resume_incompatibilities(d);
  ASSERT_EQ(diffs.size(), 1u);  // log_interval does not change the model or the data order
  EXPECT_NE(diffs[0].find("training.seed"), std::string::npos);
  RunConfig def = RunConfig::embedded_default("assets");
  EXPECT_EQ(def.model.target, "assets/tiny-qwen3");
}

TEST(RunConfig, BlockBudgetDefaultsToTheBlocksOfFullLengthDocuments) {
  // The reference batch: 512 anchors, 8192 tokens per row, conversations of up to 2048 tokens:
  // four full-length conversations of 512 blocks each.
  RunConfig ref =
      RunConfig::from_yaml(kYaml, "run.yaml", {"data.token_budget=8192", "data.max_length=2048"});
  EXPECT_EQ(ref.block_budget(), 2048);
  EXPECT_EQ(ref.data.block_budget, 2048);  // resolved, so config.resolved.yaml records it
  // The tiny reference run (short conversations): 512 · 4096 / 512 = 4096, which cannot bind.
  RunConfig tiny = RunConfig::from_yaml(kYaml, "run.yaml", {"data.max_length=512"});
  EXPECT_EQ(tiny.block_budget(), 4096);
  // Rounded up: 512 · 8192 / 3000 = 1398.1.
  RunConfig odd =
      RunConfig::from_yaml(kYaml, "run.yaml", {"data.token_budget=8192", "data.max_length=3000"});
  EXPECT_EQ(odd.block_budget(), 1399);
  RunConfig set = RunConfig::from_yaml(kYaml, "run.yaml", {"data.block_budget=1000"});
  EXPECT_EQ(set.block_budget(), 1000);
  EXPECT_NE(error_of([&] {
              RunConfig::from_yaml(kYaml, "run.yaml", {"data.block_budget=100"});
            }).find("data.block_budget (100) must be at least training.num_anchors (512)"),
            std::string::npos);
  // The embedded default keeps its packing (short conversations, 4 anchors each).
  const RunConfig def = RunConfig::embedded_default("assets");
  EXPECT_EQ(def.block_budget(), def.data.token_budget);
}

TEST(RunConfig, ResumeCheckRefusesDrafterShapeChangesEvenForced) {
  const RunConfig saved = RunConfig::from_yaml(kYaml, "run.yaml");
  const RunConfig more_layers =
      RunConfig::from_yaml(kYaml, "run.yaml", {"model.drafter_layers=3", "training.lr=1e-4"});
  for (bool force : {false, true}) {
    const std::string msg = error_of([&] { resume_check(saved, more_layers, force, "runs/x"); });
    EXPECT_NE(msg.find("--resume runs/x"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.drafter_layers: 2 -> 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not even with --force"), std::string::npos) << msg;
  }
  for (const char* ov : {"model.intermediate_size=64", "model.head_dim=32",
                         "model.num_key_value_heads=1", "model.target_layer_ids=[1]"}) {
    const RunConfig other = RunConfig::from_yaml(kYaml, "run.yaml", {ov});
    EXPECT_EQ(saved.shape_changes(other).size(), 1u) << ov;
  }
  // Other taps with as many of them keep the shapes: refused, but --force may resume.
  const RunConfig other_taps = RunConfig::from_yaml(
      kYaml, "run.yaml", {"model.target_layer_ids=[2, 4]", "training.lr=1e-4"});
  EXPECT_TRUE(saved.shape_changes(other_taps).empty());
  const std::string msg = error_of([&] { resume_check(saved, other_taps, false, "runs/x"); });
  EXPECT_NE(msg.find("use --force"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.target_layer_ids"), std::string::npos) << msg;
  EXPECT_NE(msg.find("training.lr"), std::string::npos) << msg;
  EXPECT_EQ(resume_check(saved, other_taps, true, "runs/x").size(), 2u);
  // Default taps are one per drafter layer: [] for 2 layers is [1, 3]'s shape.
  const RunConfig default_taps =
      RunConfig::from_yaml(kYaml, "run.yaml", {"model.target_layer_ids=[]"});
  EXPECT_TRUE(saved.shape_changes(default_taps).empty());
  EXPECT_TRUE(resume_check(saved, saved, false, "runs/x").empty());
}

TEST(RunDir, ResumableOnlyWhenItIsARunDirectory) {
  test::TempDir tmp;
  std::filesystem::create_directories(tmp / "plain");
  EXPECT_NE(
      error_of([&] { run_dir_check_resumable(tmp / "plain"); }).find("not a dflash run directory"),
      std::string::npos);
  EXPECT_NE(error_of([&] { run_dir_check_resumable(tmp / "nope"); }).find("no such directory"),
            std::string::npos);
  test::write_file(tmp / "file", "x");
  EXPECT_NE(error_of([&] { run_dir_check_resumable(tmp / "file"); }).find("not a directory"),
            std::string::npos);
  std::filesystem::create_directories(tmp / "run" / "checkpoint-2");
  EXPECT_EQ(error_of([&] { run_dir_check_resumable(tmp / "run"); }), "(no error)");
  std::filesystem::create_directories(tmp / "run2");
  test::write_file(tmp / "run2" / "config.resolved.yaml", "model: {}\n");
  EXPECT_EQ(error_of([&] { run_dir_check_resumable(tmp / "run2"); }), "(no error)");
}

TEST(RunDir, LockedWhileInUseAndStatusIsAtomic) {
  test::TempDir tmp;
  auto dir = tmp / "run";
  {
    RunDir rd(dir);
    const std::string msg = error_of([&] { RunDir second(dir); });
    EXPECT_NE(msg.find("is in use by process " + std::to_string(::getpid())), std::string::npos)
        << msg;
    rd.write_status({{"phase", "training"}, {"step", 3}});
    EXPECT_EQ(read_status(dir)["step"], 3);
    rd.append_metrics({{"step", 1}});
    rd.append_metrics({{"step", 2}});
    EXPECT_EQ(test::read_file(dir / "metrics.jsonl"), "{\"step\":1}\n{\"step\":2}\n");
  }
  RunDir again(dir);  // released with the first object
  EXPECT_THROW(read_status(tmp / "nothing"), Error);
}

TEST(RunDir, OnlyCompleteCheckpointsCountAndPruneKeepsNewest) {
  test::TempDir tmp;
  RunDir rd(tmp.path());
  for (int s : {10, 20, 30, 40}) {
    auto p = tmp / RunDir::checkpoint_name(s);
    std::filesystem::create_directories(p);
    if (s != 40) test::write_file(p / "COMPLETE", "");  // 40 is torn
  }
  auto cps = RunDir::complete_checkpoints(tmp.path());
  ASSERT_EQ(cps.size(), 3u);
  EXPECT_EQ(cps.back().first, 30);
  rd.prune_checkpoints(2);
  cps = RunDir::complete_checkpoints(tmp.path());
  ASSERT_EQ(cps.size(), 2u);
  EXPECT_EQ(cps.front().first, 20);
}

TEST(RunDir, CheckpointNamesOutsideInt64AreNoCheckpoints) {
  test::TempDir tmp;
  for (const char* name : {"checkpoint-99999999999999999999", "checkpoint-7", "checkpoint--1"}) {
    std::filesystem::create_directories(tmp / name);
    test::write_file(tmp / name / "COMPLETE", "");
  }
  const auto cps = RunDir::complete_checkpoints(tmp.path());  // threw std::out_of_range once
  ASSERT_EQ(cps.size(), 1u);
  EXPECT_EQ(cps[0].first, 7);
}

TEST(Fs, CheckFileWritableNamesTheFlagAndTheReason) {
  test::TempDir tmp;
  EXPECT_EQ(error_of([&] { check_file_writable(tmp / "r.json", "--output"); }), "(no error)");
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));  // the probe file is gone
  const std::string missing =
      error_of([&] { check_file_writable(tmp / "no" / "r.json", "--output"); });
  EXPECT_NE(missing.find("--output '" + (tmp / "no" / "r.json").string() + "' cannot be written"),
            std::string::npos)
      << missing;
  EXPECT_NE(missing.find("No such file or directory"), std::string::npos) << missing;
  EXPECT_NE(error_of([&] { check_file_writable(tmp.path(), "--output"); }).find("is a folder"),
            std::string::npos);
}

TEST(Fs, AtomicWriteReplacesWholeFile) {
  test::TempDir tmp;
  write_file_atomic(tmp / "f.txt", "first");
  write_file_atomic(tmp / "f.txt", "second version");
  EXPECT_EQ(read_file_text(tmp / "f.txt"), "second version");
  const auto perms = std::filesystem::status(tmp / "f.txt").permissions();
  EXPECT_TRUE((perms & std::filesystem::perms::others_read) != std::filesystem::perms::none);
  size_t n = 0;
  for (auto& e : std::filesystem::directory_iterator(tmp.path())) {
    (void)e;
    ++n;
  }
  EXPECT_EQ(n, 1u);  // no temporary files left behind
  EXPECT_THROW(write_file_atomic(tmp / "missing-dir" / "f", "x"), Error);
}

TEST(RunConfig, StringSettingsAreUtf8TextWithoutControlCharacters) {
  // A fuzz finding: a lone carriage return (and bytes of another encoding) in output_dir could not
  // be written to config.resolved.yaml and read back as the same value.
  auto with_output_dir = [](const std::string& value) {
    std::string y = kYaml;
    const std::string key = "output_dir: runs/x";
    y.replace(y.find(key), key.size(), "output_dir: " + value);
    return y;
  };
  const std::string cr =
      error_of([&] { RunConfig::from_yaml(with_output_dir(R"("runs/x\r")"), "run.yaml"); });
  EXPECT_NE(cr.find("output_dir must not contain control characters, got 0x0d"), std::string::npos)
      << cr;
  const std::string bad = error_of(
      [&] { RunConfig::from_yaml(with_output_dir("runs/\xff"), "run.yaml"); });
  EXPECT_NE(bad.find("output_dir must be UTF-8 text, got an invalid byte 0xff"), std::string::npos)
      << bad;
  const RunConfig ok =
      RunConfig::from_yaml(with_output_dir("runs/\xc3\xa9t\xc3\xa9"), "run.yaml");
  EXPECT_EQ(ok.output_dir, "runs/\xc3\xa9t\xc3\xa9");
}
