// dflash.cpp — ArenaPlanner (see arena_plan.hpp).
#include "core/arena_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/error.hpp"

namespace dflash {

const PlanBuffer* ArenaPlan::try_find(std::string_view name) const {
  for (const PlanBuffer& b : buffers) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

const PlanBuffer& ArenaPlan::find(std::string_view name) const {
  const PlanBuffer* b = try_find(name);
  DFLASH_CHECK(b != nullptr, "memory plan: no buffer named '{}'", name);
  return *b;
}

uint64_t ArenaPlan::group_bytes(std::string_view group) const {
  uint64_t s = 0;
  for (const PlanBuffer& b : buffers) {
    if (b.group == group) s += arena_round(b.bytes);
  }
  return s;
}

std::vector<std::string> ArenaPlan::groups() const {
  std::vector<std::string> g;
  for (const PlanBuffer& b : buffers) {
    if (std::find(g.begin(), g.end(), b.group) == g.end()) g.push_back(b.group);
  }
  return g;
}

int ArenaPlan::peak_phase() const {
  const auto it = std::max_element(live_per_phase.begin(), live_per_phase.end());
  return it == live_per_phase.end() ? 0 : static_cast<int>(it - live_per_phase.begin());
}

ArenaPlanner::ArenaPlanner(std::vector<std::string> phase_names)
    : phase_names_(std::move(phase_names)) {
  DFLASH_CHECK(!phase_names_.empty() && phase_names_.size() <= 32,
               "memory plan: 1 to 32 phases (got {})", phase_names_.size());
}

void ArenaPlanner::add(std::string name, std::string group, uint64_t bytes, PhaseMask phases) {
  DFLASH_CHECK(!name.empty(), "memory plan: a buffer without a name");
  const PhaseMask all =
      phase_names_.size() == 32 ? ~PhaseMask{0} : (PhaseMask{1} << phase_names_.size()) - 1;
  DFLASH_CHECK(phases != 0 && (phases & ~all) == 0,
               "memory plan: buffer '{}' has phase set {:#x} (phases 0..{})", name, phases,
               phase_names_.size() - 1);
  for (const PlanBuffer& b : buffers_) {
    DFLASH_CHECK(b.name != name, "memory plan: buffer '{}' added twice", name);
  }
  buffers_.push_back(PlanBuffer{std::move(name), std::move(group), bytes, phases, 0});
}

ArenaPlan ArenaPlanner::finish() const {
  ArenaPlan plan;
  plan.buffers = buffers_;
  plan.phase_names = phase_names_;
  plan.live_per_phase.assign(phase_names_.size(), 0);
  for (const PlanBuffer& b : plan.buffers) {
    for (size_t p = 0; p < phase_names_.size(); ++p) {
      if (b.phases & (PhaseMask{1} << p)) plan.live_per_phase[p] += arena_round(b.bytes);
    }
  }
  plan.live_peak_bytes = plan.live_per_phase[static_cast<size_t>(plan.peak_phase())];

  // Largest first; stable, so equal sizes keep the order they were added in.
  std::vector<size_t> order(plan.buffers.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return arena_round(plan.buffers[a].bytes) > arena_round(plan.buffers[b].bytes);
  });
  std::vector<size_t> placed;
  for (size_t i : order) {
    PlanBuffer& b = plan.buffers[i];
    const uint64_t size = arena_round(b.bytes);
    // The placed buffers this one may not overlap, by offset.
    std::vector<const PlanBuffer*> conflicts;
    for (size_t j : placed) {
      if (plan.buffers[j].phases & b.phases) conflicts.push_back(&plan.buffers[j]);
    }
    std::sort(conflicts.begin(), conflicts.end(),
              [](const PlanBuffer* x, const PlanBuffer* y) { return x->offset < y->offset; });
    // Lowest gap that holds `size` bytes.
    uint64_t at = 0;
    for (const PlanBuffer* c : conflicts) {
      if (c->offset >= at + size) break;  // the gap [at, c->offset) holds it
      at = std::max(at, c->offset + arena_round(c->bytes));
    }
    b.offset = at;
    plan.arena_bytes = std::max(plan.arena_bytes, at + size);
    placed.push_back(i);
  }
  return plan;
}

ArenaPlan arena_plan_without_sharing(const ArenaPlan& plan) {
  ArenaPlanner p(plan.phase_names);
  const size_t n = plan.phase_names.size();
  const PhaseMask all = n == 32 ? ~PhaseMask{0} : (PhaseMask{1} << n) - 1;
  for (const PlanBuffer& b : plan.buffers) p.add(b.name, b.group, b.bytes, all);
  return p.finish();
}

std::string format_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1u << 30));
  if (bytes >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1u << 20));
  if (bytes >= (uint64_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1u << 10));
  return fmt::format("{} B", bytes);
}

}  // namespace dflash
