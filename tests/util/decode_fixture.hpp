// dflash.cpp — what the objective decode tests share (dspark_decode_test, dflash2_decode_test,
// domino_decode_test): a seeded drafter for the tiny target saved in the export format, one
// speculative step beside the same block drafted by hand, and the greedy losslessness check.
//
// Invariants: everything runs on the CPU decoder with the tiny Qwen3 fixture (test_util); a seed
// gives the same drafter every time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "model/drafter.hpp"
#include "model/drafter_io.hpp"

namespace dflash::test {

/// Saves (drafter_save, f32) into dir/name a one-layer drafter for the tiny target: block size K,
/// intermediate 128, mask id 8000, `set_heads` applied to its config (the objective's head keys),
/// drafter_init's parameters for `seed`, then `shape` applied to them when not null (e.g. a head
/// scaled up so that it moves the argmax). Returns the folder. Throws dflash::Error as the config
/// validation or drafter_save do.
std::filesystem::path save_tiny_drafter(
    const std::filesystem::path& dir, const std::string& name, int K, uint64_t seed,
    const std::function<void(DrafterConfig&)>& set_heads,
    const std::function<void(const DrafterConfig&, const DrafterLayout&, std::vector<float>&)>&
        shape = {});

/// One greedy speculative step of `d` on the tiny target from the prompt "The history of the
/// river", and the same block drafted by hand from the drafter cache the step started with.
struct HandDraft {
  std::vector<int32_t> proposals;  ///< the step's proposals (SpecState::last_proposals)
  int32_t anchor = 0;              ///< the anchor token of the step
  DrafterWorkspace<float> ws;      ///< the hand draft's workspace: ws.hf [K, H] final-norm rows
  std::vector<float> embed;        ///< the tiny target's embedding = its tied LM head [V, H]
  std::vector<float> logits;       ///< the block's base logits [K, V]
};
/// Runs HandDraft's step (12 new tokens at most). Throws as the decoder does.
HandDraft draft_one_block(const LoadedDrafter& d);

/// Greedy speculative decoding with `d` of the first 4 mixed eval prompts (24 new tokens each):
/// expects the output to equal the target's own greedy output and every acceptance length to lie
/// in [1, max_accept]; `what` names the case in failure messages.
void expect_greedy_decoding_lossless(const LoadedDrafter& d, int max_accept,
                                     const std::string& what);

}  // namespace dflash::test
