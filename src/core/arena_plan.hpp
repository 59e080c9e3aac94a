// dflash.cpp — static memory plans: named buffers, each live during a set of phases of a step,
// packed into one arena before anything is allocated (DESIGN.md §3, "planned once per shape in an
// arena"). The plan is pure host arithmetic, so it can be printed and tested without a device.
//
// Invariants of a finished ArenaPlan:
//   * it is a pure function of the buffers added (names, sizes, phase sets, order);
//   * two buffers whose phase sets intersect never share a byte, so a buffer keeps its contents
//     for as long as it is live; buffers of disjoint phase sets may overlap;
//   * every offset is a multiple of kArenaAlign, and arena_bytes ≥ offset + bytes of every
//     buffer (arena_bytes is itself a multiple of kArenaAlign);
//   * live_peak_bytes = max over phases of Σ (bytes rounded to kArenaAlign) of the buffers live in
//     that phase: no packing can use less, so arena_bytes − live_peak_bytes is what the packing
//     loses to fragmentation.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dflash {

/// Alignment of every buffer in an arena, in bytes (cuBLASLt and 16-byte vector loads need less).
inline constexpr uint64_t kArenaAlign = 256;

/// `bytes` rounded up to a multiple of kArenaAlign.
constexpr uint64_t arena_round(uint64_t bytes) {
  return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
}

/// A set of phases: bit p set = live in phase p (at most 32 phases).
using PhaseMask = uint32_t;

/// One planned buffer.
struct PlanBuffer {
  std::string name;      ///< unique, e.g. "drafter.layers.2.gu"
  std::string group;     ///< summary row it belongs to, e.g. "saved activations"
  uint64_t bytes = 0;    ///< requested size (the arena reserves arena_round(bytes))
  PhaseMask phases = 0;  ///< phases in which it is live (non-empty)
  uint64_t offset = 0;   ///< byte offset in the arena (set by ArenaPlanner::finish)
};

/// A finished plan (see the file invariants).
struct ArenaPlan {
  std::vector<PlanBuffer> buffers;       ///< in the order they were added
  std::vector<std::string> phase_names;  ///< [n_phases]
  std::vector<uint64_t> live_per_phase;  ///< [n_phases] bytes live in each phase
  uint64_t arena_bytes = 0;
  uint64_t live_peak_bytes = 0;

  /// The buffer called `name`; throws dflash::Error naming it when the plan has none.
  const PlanBuffer& find(std::string_view name) const;
  /// The buffer called `name`, or nullptr.
  const PlanBuffer* try_find(std::string_view name) const;
  /// Σ of arena_round(bytes) over the buffers of `group` (what the group would need unshared).
  uint64_t group_bytes(std::string_view group) const;
  /// The groups in the order of their first buffer.
  std::vector<std::string> groups() const;
  /// Index of the phase whose live bytes are largest (the first on ties).
  int peak_phase() const;
};

/// Collects buffers, then packs them (see finish()).
class ArenaPlanner {
 public:
  /// `phase_names` names the phases, in step order (1 to 32 of them).
  explicit ArenaPlanner(std::vector<std::string> phase_names);
  /// Adds a buffer. Throws dflash::Error for a repeated or empty name, an empty phase set or a
  /// phase outside the planner's.
  void add(std::string name, std::string group, uint64_t bytes, PhaseMask phases);
  /// Packs the buffers: largest first (ties in the order added), each at the lowest aligned offset
  /// where it overlaps no placed buffer that shares a phase with it. Deterministic.
  ArenaPlan finish() const;

 private:
  std::vector<std::string> phase_names_;
  std::vector<PlanBuffer> buffers_;
};

/// The same buffers packed with no sharing at all (every buffer live in every phase): for tests
/// that check that sharing by phase changes no result.
ArenaPlan arena_plan_without_sharing(const ArenaPlan& plan);

/// "12.34 GiB" / "512.0 MiB" / "3.0 KiB" / "17 B".
std::string format_bytes(uint64_t bytes);

}  // namespace dflash
