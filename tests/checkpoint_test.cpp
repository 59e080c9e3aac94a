// Checkpoint I/O of `dflash train` (src/train/checkpoint.hpp) on its own: a checkpoint written and
// read back restores the drafter state (weights, moments, update count) and the trainer state
// exactly; a state whose update count disagrees with its steps is refused before anything is
// written; reading into another drafter's layout names the file and the tensor; a checkpoint's
// marker lists its files' sizes and digests, and resume picks the newest checkpoint that matches
// its marker, naming the fault of each newer one.
#include "train/checkpoint.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "train/run_config.hpp"
#include "util/test_util.hpp"

using namespace dflash;
namespace fs = std::filesystem;

namespace {

DrafterConfig small_drafter(int layers) {
  DrafterConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = layers;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.vocab_size = 50;
  c.max_position_embeddings = 128;
  c.block_size = 4;
  c.mask_token_id = 49;
  c.target_layer_ids = {0};
  c.num_target_layers = 2;
  c.validate();
  return c;
}

DrafterState random_state(const DrafterLayout& layout, int64_t updates) {
  Rng rng(5);
  DrafterState s;
  for (auto* v : {&s.params, &s.adam_m, &s.adam_v}) {
    v->resize(static_cast<size_t>(layout.total));
    for (float& x : *v) x = static_cast<float>(rng.normal());
  }
  s.updates = updates;
  return s;
}

// Writes checkpoints at `steps` (keeping all of them) into run directory `rd`.
void write_checkpoints(RunDir& rd, const std::vector<int64_t>& steps) {
  const DrafterConfig cfg = small_drafter(1);
  const DrafterLayout layout(cfg);
  for (int64_t step : steps) {
    TrainerState st;
    st.step = step;
    st.interval = IntervalMetrics(cfg.block_size);
    checkpoint_write(rd, cfg, layout, random_state(layout, step), st, DType::f32, 10);
  }
}

// The error message of checkpoint_verify(dir) ("" when it passes).
std::string verify_error(const fs::path& dir) {
  try {
    checkpoint_verify(dir);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TrainerState some_trainer_state() {
  TrainerState st;
  st.step = 7;
  st.skipped = 2;
  st.consecutive_skips = 1;
  st.cursor.seed = 3;
  st.cursor.epoch = 1;
  st.cursor.batch = 4;
  st.cursor.dataset = 0x1234abcdULL;
  st.cursor.config = "budget=256;rows=2";
  st.interval = IntervalMetrics(4);
  st.interval.obj.loss_weighted_sum = 12.5;
  st.interval.obj.weight_sum = 3.25;
  st.interval.obj.slot_correct = {0, 3, 2, 1};
  st.interval.obj.slot_count = {0, 5, 5, 4};
  st.interval.obj.blocks = 6;
  st.interval.obj.accept_len_sum = 8;
  st.interval.steps = 2;
  st.interval.tokens = 500;
  st.interval.t_total = 1.5;
  // The saved config must parse, and its block size is the interval's K.
  RunConfig run = RunConfig::embedded_default(test::assets_dir().string());
  run.training.block_size = 4;
  st.config_yaml = run.to_yaml();
  return st;
}

}  // namespace

TEST(Checkpoint, WrittenAndReadBackExactly) {
  test::TempDir tmp;
  const DrafterConfig cfg = small_drafter(2);
  const DrafterLayout layout(cfg);
  RunDir rd(tmp / "run");
  const TrainerState st = some_trainer_state();
  const DrafterState ds = random_state(layout, st.step - st.skipped);
  const fs::path dir = checkpoint_write(rd, cfg, layout, ds, st, DType::bf16, 3);
  EXPECT_EQ(dir.filename(), "checkpoint-7");
  EXPECT_TRUE(fs::exists(dir / "COMPLETE"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "config.json"));
  EXPECT_FALSE(fs::exists(tmp / "run" / ".tmp-checkpoint-7"));

  DrafterState back;
  TrainerState st2;
  checkpoint_read(dir, layout, back, st2);
  EXPECT_EQ(back.params, ds.params);
  EXPECT_EQ(back.adam_m, ds.adam_m);
  EXPECT_EQ(back.adam_v, ds.adam_v);
  EXPECT_EQ(back.updates, 5);
  EXPECT_EQ(st2.step, 7);
  EXPECT_EQ(st2.skipped, 2);
  EXPECT_EQ(st2.consecutive_skips, 1);
  EXPECT_EQ(st2.cursor, st.cursor);
  EXPECT_EQ(st2.interval.to_json(), st.interval.to_json());
  EXPECT_EQ(st2.config_yaml, st.config_yaml);
}

TEST(Checkpoint, RefusesAStateWhoseUpdatesDisagreeWithItsSteps) {
  test::TempDir tmp;
  const DrafterConfig cfg = small_drafter(1);
  const DrafterLayout layout(cfg);
  RunDir rd(tmp / "run");
  const TrainerState st = some_trainer_state();
  try {
    checkpoint_write(rd, cfg, layout, random_state(layout, 7), st, DType::f32, 3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("applied 7 updates"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(RunDir::complete_checkpoints(tmp / "run").empty());
  EXPECT_FALSE(fs::exists(tmp / "run" / ".tmp-checkpoint-7"));
}

TEST(Checkpoint, ReadingIntoAnotherLayoutNamesTheFileAndTensor) {
  test::TempDir tmp;
  const DrafterConfig cfg = small_drafter(1);
  const DrafterLayout layout(cfg);
  RunDir rd(tmp / "run");
  const TrainerState st = some_trainer_state();
  const fs::path dir =
      checkpoint_write(rd, cfg, layout, random_state(layout, 5), st, DType::f32, 3);
  const DrafterLayout bigger(small_drafter(2));
  DrafterState back;
  TrainerState st2;
  try {
    checkpoint_read(dir, bigger, back, st2);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("optimizer.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'master'"), std::string::npos) << msg;
  }
}

TEST(Checkpoint, MarkerCatchesEveryMissingResizedOrAlteredFile) {
  test::TempDir tmp;
  RunDir rd(tmp / "run");
  write_checkpoints(rd, {1});
  const fs::path dir = tmp / "run" / "checkpoint-1";
  EXPECT_EQ(checkpoint_verify(dir), CheckpointCheck::verified);
  for (const char* name : {"config.json", "model.safetensors",
                           "trainer_state/optimizer.safetensors", "trainer_state/state.json"}) {
    const fs::path p = dir / name;
    const std::string good = test::read_file(p);
    fs::remove(p);
    EXPECT_NE(verify_error(dir).find(p.string() + ": missing"), std::string::npos) << name;
    test::write_file(p, good + " ");
    EXPECT_NE(verify_error(dir).find(fmt::format("{}: {} bytes, the marker lists {}", p.string(),
                                                 good.size() + 1, good.size())),
              std::string::npos)
        << verify_error(dir);
    std::string altered = good;
    altered[altered.size() / 2] ^= 0x01;
    test::write_file(p, altered);
    EXPECT_NE(verify_error(dir).find(p.string() + ": content differs from the marker's digest"),
              std::string::npos)
        << verify_error(dir);
    test::write_file(p, good);
    EXPECT_EQ(verify_error(dir), "");
  }
  // A marker that is not a marker, or of another step, is named as malformed.
  const std::string marker = test::read_file(dir / "COMPLETE");
  test::write_file(dir / "COMPLETE", "{\"format\": \"dflash-checkpoint-marker-1\"}");
  EXPECT_NE(verify_error(dir).find("COMPLETE: malformed marker"), std::string::npos)
      << verify_error(dir);
  std::string other = marker;
  other.replace(other.find("\"step\": 1"), 9, "\"step\": 2");
  test::write_file(dir / "COMPLETE", other);
  EXPECT_NE(verify_error(dir).find("step 2, but the folder is step 1"), std::string::npos)
      << verify_error(dir);
  // The bare "step N" marker of older checkpoints has nothing to verify against.
  test::write_file(dir / "COMPLETE", "step 1\n");
  EXPECT_EQ(checkpoint_verify(dir), CheckpointCheck::legacy_marker);
}

TEST(Checkpoint, SelectTakesTheNewestThatVerifiesAndListsTheOthersNewestFirst) {
  test::TempDir tmp;
  const fs::path run = tmp / "run";
  RunDir rd(run);
  write_checkpoints(rd, {2, 4, 6});
  EXPECT_EQ(checkpoint_select(run).step, 6);
  fs::remove(run / "checkpoint-6" / "model.safetensors");
  fs::resize_file(run / "checkpoint-4" / "trainer_state" / "optimizer.safetensors", 10);
  const ResumePoint rp = checkpoint_select(run);
  EXPECT_EQ(rp.step, 2);
  EXPECT_EQ(rp.dir, run / "checkpoint-2");
  EXPECT_EQ(rp.check, CheckpointCheck::verified);
  ASSERT_EQ(rp.rejected.size(), 2u);
  EXPECT_EQ(rp.rejected[0].dir, run / "checkpoint-6");
  EXPECT_NE(rp.rejected[0].reason.find("model.safetensors: missing"), std::string::npos);
  EXPECT_EQ(rp.rejected[1].dir, run / "checkpoint-4");
  EXPECT_NE(rp.rejected[1].reason.find("optimizer.safetensors: 10 bytes"), std::string::npos);

  // Set aside, a rejected checkpoint no longer counts (nor is pruned) as one.
  EXPECT_EQ(checkpoint_set_aside(run / "checkpoint-6"), run / "rejected-checkpoint-6");
  EXPECT_TRUE(fs::exists(run / "rejected-checkpoint-6" / "COMPLETE"));
  EXPECT_EQ(RunDir::complete_checkpoints(run).back().first, 4);

  fs::remove(run / "checkpoint-2" / "config.json");
  try {
    checkpoint_select(run);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("no checkpoint passes verification"), std::string::npos) << msg;
    EXPECT_NE(msg.find("optimizer.safetensors: 10 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("config.json: missing"), std::string::npos) << msg;
  }
}
