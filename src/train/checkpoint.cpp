// dflash.cpp — checkpoint I/O of `dflash train` (see checkpoint.hpp).
#include "train/checkpoint.hpp"

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "model/drafter_io.hpp"
#include "model/safetensors.hpp"

namespace dflash {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kStateFormat = "dflash-trainer-state-1";

}  // namespace

fs::path checkpoint_write(RunDir& rd, const DrafterConfig& cfg, const DrafterLayout& layout,
                          const DrafterState& drafter, const TrainerState& st, DType export_dtype,
                          int keep_last) {
  drafter_state_check(drafter, layout.total);
  DFLASH_CHECK(drafter.updates == st.step - st.skipped,
               "checkpoint {}: the drafter applied {} updates but {} steps minus {} skipped were "
               "run",
               st.step, drafter.updates, st.step, st.skipped);
  const fs::path final_dir = rd.path() / RunDir::checkpoint_name(st.step);
  const fs::path tmp = rd.path() / (".tmp-" + RunDir::checkpoint_name(st.step));
  fs::remove_all(tmp);
  fs::remove_all(final_dir);  // an incomplete folder of the same step (a torn earlier write)
  fs::create_directories(tmp / "trainer_state");
  drafter_save(tmp, cfg, layout, drafter.params, export_dtype);
  const int64_t n = layout.total;
  auto view = [n](const std::vector<float>& x) {
    return Tensor::from_blob(const_cast<float*>(x.data()), {n}, DType::f32);
  };
  safetensors_write(tmp / "trainer_state" / "optimizer.safetensors",
                    {{"master", view(drafter.params)},
                     {"adam_m", view(drafter.adam_m)},
                     {"adam_v", view(drafter.adam_v)}},
                    {{"format", kStateFormat}});
  const json sj = {{"format", kStateFormat},
                   {"step", st.step},
                   {"skipped", st.skipped},
                   {"consecutive_skips", st.consecutive_skips},
                   {"data_cursor", st.cursor.to_json()},
                   {"interval", st.interval.to_json()},
                   {"config", st.config_yaml}};
  write_file_atomic(tmp / "trainer_state" / "state.json", sj.dump(1) + "\n");
  fsync_path(tmp / "trainer_state");
  fsync_path(tmp);
  // Test hook: die here (as on SIGKILL) while checkpoint STEP is half written.
  if (const char* crash = std::getenv("DFLASH_TEST_CRASH_IN_CHECKPOINT")) {
    if (std::to_string(st.step) == crash) std::_Exit(86);
  }
  fs::rename(tmp, final_dir);
  fsync_path(rd.path());
  write_file_atomic(final_dir / "COMPLETE", fmt::format("step {}\n", st.step));
  rd.prune_checkpoints(keep_last);
  return final_dir;
}

void checkpoint_read(const fs::path& dir, const DrafterLayout& layout, DrafterState& drafter,
                     TrainerState& st) {
  SafetensorsFile f(dir / "trainer_state" / "optimizer.safetensors");
  auto load = [&](const char* name, std::vector<float>& out) {
    Tensor t = f.get_as(name, DType::f32);
    DFLASH_CHECK(t.numel() == layout.total, "{}: tensor '{}' has {} values, the drafter {}",
                 f.path().string(), name, t.numel(), layout.total);
    out.assign(t.data<float>(), t.data<float>() + layout.total);
  };
  load("master", drafter.params);
  load("adam_m", drafter.adam_m);
  load("adam_v", drafter.adam_v);
  const fs::path sp = dir / "trainer_state" / "state.json";
  try {
    const json j = json::parse(read_file_text(sp));
    st.step = j.at("step");
    st.skipped = j.at("skipped");
    st.consecutive_skips = j.at("consecutive_skips");
    st.cursor = DataCursor::from_json(j.at("data_cursor"));
    st.interval = IntervalMetrics::from_json(j.at("interval"));
    st.config_yaml = j.at("config");
  } catch (const json::exception& e) {
    fail("{}: {}", sp.string(), e.what());
  } catch (const Error& e) {
    throw e.with_context(sp.string());
  }
  DFLASH_CHECK(st.skipped >= 0 && st.skipped <= st.step, "{}: {} skipped steps of {}", sp.string(),
               st.skipped, st.step);
  drafter.updates = st.step - st.skipped;
}

}  // namespace dflash
