// dflash.cpp — checkpoint I/O of `dflash train` (see checkpoint.hpp).
#include "train/checkpoint.hpp"

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/digest.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_util.hpp"
#include "model/drafter_io.hpp"
#include "model/safetensors.hpp"
#include "train/run_config.hpp"

namespace dflash {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kStateFormat = "dflash-trainer-state-1";
constexpr const char* kMarkerFormat = "dflash-checkpoint-marker-1";
// The files a checkpoint consists of, relative to its folder; the marker lists each of them.
constexpr const char* kCheckpointFiles[] = {"config.json", "model.safetensors",
                                            "trainer_state/optimizer.safetensors",
                                            "trainer_state/state.json"};

// The COMPLETE marker of checkpoint `step` whose files lie in `dir`.
std::string marker_text(const fs::path& dir, int64_t step) {
  json files = json::object();
  for (const char* name : kCheckpointFiles) {
    const FileDigest d = file_digest(dir / name);
    files[name] = {{"bytes", d.bytes}, {"xxh3", digest_hex(d.xxh3)}};
  }
  const json m = {{"format", kMarkerFormat}, {"step", step}, {"files", files}};
  return m.dump(1) + "\n";
}

// The step in a checkpoint folder's name ("checkpoint-12" → 12, see RunDir::checkpoint_name).
int64_t step_of_folder(const fs::path& dir) {
  const std::string name = dir.filename().string();
  const std::string prefix = "checkpoint-";
  const std::string num = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : "";
  DFLASH_CHECK(!num.empty() && num.find_first_not_of("0123456789") == std::string::npos,
               "'{}' is not a checkpoint folder (checkpoint-STEP)", dir.string());
  return std::stoll(num);
}

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
  json sj = {{"format", kStateFormat},
             {"step", st.step},
             {"skipped", st.skipped},
             {"consecutive_skips", st.consecutive_skips},
             {"data_cursor", st.cursor.to_json()},
             {"interval", st.interval.to_json()},
             {"config", st.config_yaml}};
  if (st.ranks > 1) sj["ranks"] = st.ranks;
  write_file_atomic(tmp / "trainer_state" / "state.json", sj.dump(1) + "\n");
  fsync_path(tmp / "trainer_state");
  fsync_path(tmp);
  // Test hook: die here (as on SIGKILL) while checkpoint STEP is half written.
  if (const char* crash = std::getenv("DFLASH_TEST_CRASH_IN_CHECKPOINT")) {
    if (std::to_string(st.step) == crash) std::_Exit(86);
  }
  const std::string marker = marker_text(tmp, st.step);
  fs::rename(tmp, final_dir);
  fsync_path(rd.path());
  write_file_atomic(final_dir / "COMPLETE", marker);
  rd.prune_checkpoints(keep_last);
  return final_dir;
}

CheckpointCheck checkpoint_verify(const fs::path& dir) {
  const fs::path mp = dir / "COMPLETE";
  DFLASH_CHECK(fs::exists(mp), "{}: no COMPLETE marker", dir.string());
  const std::string text = read_file_text(mp);
  const int64_t step = step_of_folder(dir);
  if (text == fmt::format("step {}\n", step)) return CheckpointCheck::legacy_marker;
  json files;
  try {
    const json m = json::parse(text);
    DFLASH_CHECK(m.at("format") == kMarkerFormat, "format '{}', expected '{}'",
                 m.at("format").dump(), kMarkerFormat);
    DFLASH_CHECK(m.at("step").get<int64_t>() == step, "step {}, but the folder is step {}",
                 m.at("step").get<int64_t>(), step);
    files = m.at("files");
    for (const char* name : kCheckpointFiles) {
      DFLASH_CHECK(files.contains(name), "'{}' is not listed", name);
      (void)files.at(name).at("bytes").get<int64_t>();
      (void)digest_hex_parse(files.at(name).at("xxh3").get<std::string>());
    }
  } catch (const json::exception& e) {
    fail("{}: malformed marker: {}", mp.string(), e.what());
  } catch (const Error& e) {
    throw e.with_context(fmt::format("{}: malformed marker", mp.string()));
  }
  // Sizes first (cheap), then the digests.
  for (const char* name : kCheckpointFiles) {
    const fs::path p = dir / name;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    DFLASH_CHECK(!ec, "{}: missing or unreadable ({})", p.string(), ec.message());
    const auto want = files.at(name).at("bytes").get<int64_t>();
    DFLASH_CHECK(static_cast<int64_t>(size) == want, "{}: {} bytes, the marker lists {}",
                 p.string(), size, want);
  }
  for (const char* name : kCheckpointFiles) {
    const fs::path p = dir / name;
    const FileDigest d = file_digest(p);
    const uint64_t want = digest_hex_parse(files.at(name).at("xxh3").get<std::string>());
    DFLASH_CHECK(d.xxh3 == want,
                 "{}: content differs from the marker's digest (xxh3 {}, listed {})", p.string(),
                 digest_hex(d.xxh3), digest_hex(want));
  }
  return CheckpointCheck::verified;
}

ResumePoint checkpoint_select(const fs::path& run_dir) {
  const auto complete = RunDir::complete_checkpoints(run_dir);
  DFLASH_CHECK(!complete.empty(), "{}: no complete checkpoint to resume from", run_dir.string());
  ResumePoint rp;
  for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
    try {
      rp.check = checkpoint_verify(it->second);
      rp.dir = it->second;
      rp.step = it->first;
      return rp;
    } catch (const Error& e) {
      rp.rejected.push_back({it->second, e.what()});
    }
  }
  std::string list;
  for (const auto& r : rp.rejected) list += "\n  " + r.reason;
  fail("{}: no checkpoint passes verification:{}", run_dir.string(), list);
}

fs::path checkpoint_set_aside(const fs::path& dir) {
  const fs::path aside = dir.parent_path() / ("rejected-" + dir.filename().string());
  std::error_code ec;
  fs::remove_all(aside, ec);
  DFLASH_CHECK(!ec, "cannot remove '{}': {}", aside.string(), ec.message());
  fs::rename(dir, aside, ec);
  DFLASH_CHECK(!ec, "cannot move '{}' aside to '{}': {}", dir.string(), aside.string(),
               ec.message());
  fsync_path(dir.parent_path());
  return aside;
}

TrainerState checkpoint_state_parse(std::string_view text, const std::string& source) {
  const json j = json_parse_strict(text, source);
  TrainerState st;
  const std::string format = json_string(j, "format", source);
  DFLASH_CHECK(format == kStateFormat, "{}: format '{}' is not one this dflash reads ({})", source,
               format, kStateFormat);
  st.config_yaml = json_string(j, "config", source);
  const RunConfig saved = RunConfig::from_yaml(st.config_yaml, source + " (key 'config')");
  st.step = json_int(j, "step", source, 0);
  st.skipped = json_int(j, "skipped", source, 0, st.step);
  st.consecutive_skips = json_int(j, "consecutive_skips", source, 0, st.skipped);
  st.ranks = j.contains("ranks") ? json_int(j, "ranks", source, 2, 1 << 20) : 1;
  try {
    st.cursor = DataCursor::from_json(json_member(j, "data_cursor", source));
  } catch (const Error& e) {
    throw e.with_context(source);
  }
  st.interval = IntervalMetrics::from_json(json_member(j, "interval", source),
                                           source + " (key 'interval')", saved.training.block_size);
  return st;
}

TrainerState checkpoint_read_state(const fs::path& dir) {
  const fs::path sp = dir / "trainer_state" / "state.json";
  return checkpoint_state_parse(read_file_text(sp), sp.string());
}

void checkpoint_read_drafter(const fs::path& dir, const DrafterLayout& layout,
                             const TrainerState& st, DrafterState& drafter) {
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
  drafter.updates = st.step - st.skipped;
}

void checkpoint_read(const fs::path& dir, const DrafterLayout& layout, DrafterState& drafter,
                     TrainerState& st) {
  st = checkpoint_read_state(dir);
  checkpoint_read_drafter(dir, layout, st, drafter);
}

}  // namespace dflash
