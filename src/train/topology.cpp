// dflash.cpp — the pipeline topology (see topology.hpp).
#include "train/topology.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "core/error.hpp"

namespace dflash {

std::string PipelineTopology::worker_name(WorkerStage stage, int index) {
  return fmt::format("{}{}", stage == WorkerStage::target ? "target" : "drafter", index);
}

std::string PipelineTopology::device_name(WorkerStage stage, int index) const {
  const auto& list = stage == WorkerStage::target ? target_devices : drafter_devices;
  const int d = list.at(static_cast<size_t>(index));
  return d < 0 ? std::string("cpu") : fmt::format("cuda:{}", d);
}

bool PipelineTopology::drafters_share_a_device() const {
  std::set<int> seen;
  for (int d : drafter_devices) {
    if (d >= 0 && !seen.insert(d).second) return true;
  }
  return false;
}

std::string PipelineTopology::describe() const {
  if (backend == "cpu") {
    return fmt::format("cpu: {} target worker{}, {} drafter worker{}, queue depth {}", targets(),
                       targets() == 1 ? "" : "s", drafters(), drafters() == 1 ? "" : "s",
                       queue_depth);
  }
  std::set<int> t(target_devices.begin(), target_devices.end());
  const bool shared = std::any_of(drafter_devices.begin(), drafter_devices.end(),
                                  [&](int d) { return t.count(d) > 0; });
  return fmt::format(
      "{}: target workers on GPUs [{}], drafter workers on GPUs [{}]{}, queue depth {}", backend,
      fmt::join(target_devices, ", "), fmt::join(drafter_devices, ", "),
      shared ? " (colocated)" : "", queue_depth);
}

void topology_check_keys(const RuntimeSection& rt) {
  const bool lists = !rt.target_devices.empty() || !rt.drafter_devices.empty();
  if (rt.backend != "cuda") {
    DFLASH_CHECK(!lists,
                 "runtime.{} applies to the cuda backend; on the {} backend set "
                 "runtime.target_workers and runtime.drafter_workers",
                 rt.target_devices.empty() ? "drafter_devices" : "target_devices", rt.backend);
    DFLASH_CHECK(!rt.colocated,
                 "runtime.colocated applies to the cuda backend (the {} backend "
                 "has no devices to share)",
                 rt.backend);
    return;
  }
  DFLASH_CHECK(rt.target_workers == 1 && rt.drafter_workers == 1,
               "runtime.{} applies to the cpu backend; on cuda list one GPU per worker in "
               "runtime.target_devices and runtime.drafter_devices",
               rt.target_workers != 1 ? "target_workers" : "drafter_workers");
  if (!lists) {
    DFLASH_CHECK(rt.devices.size() == 1,
                 "runtime.devices lists {} devices; it names the one GPU of a one-GPU run (for "
                 "more, list one GPU per worker in runtime.target_devices and "
                 "runtime.drafter_devices)",
                 rt.devices.size());
    return;
  }
  DFLASH_CHECK(!rt.target_devices.empty() && !rt.drafter_devices.empty(),
               "runtime.{} is empty while runtime.{} is set: list one GPU per worker in both",
               rt.target_devices.empty() ? "target_devices" : "drafter_devices",
               rt.target_devices.empty() ? "drafter_devices" : "target_devices");
  DFLASH_CHECK(rt.devices == std::vector<int>{0},
               "runtime.devices and runtime.target_devices/drafter_devices are both set: use "
               "runtime.devices for one GPU, or the two lists");
  const std::set<int> t(rt.target_devices.begin(), rt.target_devices.end());
  int shared = -1;
  for (int d : rt.drafter_devices) {
    if (t.count(d)) shared = d;
  }
  DFLASH_CHECK(shared < 0 || rt.colocated,
               "GPU {} is in both runtime.target_devices and runtime.drafter_devices: set "
               "runtime.colocated: true to share GPUs between the stages",
               shared);
  DFLASH_CHECK(shared >= 0 || !rt.colocated,
               "runtime.colocated is true but no GPU is in both runtime.target_devices and "
               "runtime.drafter_devices");
}

PipelineTopology topology_of(const RuntimeSection& rt) {
  PipelineTopology t;
  t.backend = rt.backend;
  t.queue_depth = rt.queue_depth;
  t.stall_timeout_s = rt.stall_timeout_s;
  if (rt.backend != "cuda") {
    t.target_devices.assign(static_cast<size_t>(rt.target_workers), -1);
    t.drafter_devices.assign(static_cast<size_t>(rt.drafter_workers), -1);
  } else if (rt.target_devices.empty()) {
    t.target_devices = rt.devices;
    t.drafter_devices = rt.devices;
    t.target_key = t.drafter_key = "runtime.devices";
  } else {
    t.target_devices = rt.target_devices;
    t.drafter_devices = rt.drafter_devices;
    t.target_key = "runtime.target_devices";
    t.drafter_key = "runtime.drafter_devices";
  }
  return t;
}

void topology_check_devices(const PipelineTopology& t, int visible) {
  if (t.backend != "cuda") return;
  for (int d : t.target_devices) {
    DFLASH_CHECK(d >= 0 && d < visible, "{}: CUDA device {} does not exist ({} visible)",
                 t.target_key, d, visible);
  }
  for (int d : t.drafter_devices) {
    DFLASH_CHECK(d >= 0 && d < visible, "{}: CUDA device {} does not exist ({} visible)",
                 t.drafter_key, d, visible);
  }
}

}  // namespace dflash
