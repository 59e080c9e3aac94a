// dflash.cpp — the settings, parameter offsets, λ schedule and scratch of Domino's GRU prefix head
// (../shared/OBJECTIVES.md §1.2; SpecForge `modeling/draft/domino.py`, `OnlineDominoModel` and
// `linear_lambda_base`). The head itself is model/domino_head.hpp; this header is what
// DrafterConfig, DrafterLayout and DrafterWorkspace hold.
//
// Invariants: a drafter without the head has DominoHead{} (enabled false) and all DominoOffsets
// −1; the head's four tensors follow every other tensor of the flat layout, in DominoOffsets
// order; the workspace's buffers keep their capacity between calls.
#pragma once

#include <cstdint>
#include <vector>

namespace dflash {

/// Domino's head of a drafter (export `dflash_config`: projector_type "domino", emb_dim,
/// gru_hidden_dim, pure_draft_prefix_len, shift_label). A drafter without it (enabled false) is a
/// plain DFlash drafter.
struct DominoHead {
  bool enabled = false;           ///< projector_type domino
  int64_t emb_dim = 0;            ///< E, the width of embed_proj's hidden layer
  int64_t gru_hidden_dim = 0;     ///< G, the GRU's state width
  int pure_draft_prefix_len = 0;  ///< P: the first P proposals of a block are base-only
  bool shift_label = false;       ///< slot k predicts x[a+k+1] (else x[a+k])
  /// The first slot whose logits the head corrects: P with shift_label, else 1 + P (SpecForge
  /// `suffix_start`).
  int suffix_start() const {
    return shift_label ? pure_draft_prefix_len : 1 + pure_draft_prefix_len;
  }
  /// The GRU steps of a block: K with shift_label (it reads x[a..a+K−1]), else K − 1.
  int gru_steps(int K) const { return shift_label ? K : K - 1; }
  /// The GRU state that slot k's correction reads: g_k with shift_label, else g_{k−1} (g_j is the
  /// state after reading x[a..a+j]).
  int state_of_slot(int k) const { return shift_label ? k : k - 1; }
  bool operator==(const DominoHead&) const = default;
};

/// Offsets of the head's tensors in the flat parameter array (−1 without the head), named as in
/// SpecForge's export.
struct DominoOffsets {
  int64_t gru_ih = -1;  ///< prefix_gru.weight_ih_l0 [3G, H] (gate rows r, z, n)
  int64_t gru_hh = -1;  ///< prefix_gru.weight_hh_l0 [3G, G] (gate rows r, z, n)
  int64_t proj1 = -1;   ///< embed_proj.0.weight [E, H+G] (W1)
  int64_t proj2 = -1;   ///< embed_proj.2.weight [V, E] (W2)
};

/// λ of optimizer step `step` (the number of steps taken before it) of a run of `total_steps`
/// (SpecForge `linear_lambda_base`): clip(λ0·(1 − min(step / max(1, ⌊total·r⌋), 1)), 0, 1), with
/// λ0 = `start` and r = `decay_ratio`. total_steps ≤ 0 (no horizon) gives 0, as SpecForge.
double domino_lambda(int64_t step, int64_t total_steps, double start, double decay_ratio);

/// Scratch of the Domino head (model/domino_head.cpp; capacity kept between calls).
template <typename S>
struct DominoWorkspace {
  std::vector<S> emb;      ///< one block's GRU inputs [steps, H]
  std::vector<S> gates;    ///< per step [r, z, n, hh_n] [steps, 4G]
  std::vector<S> states;   ///< g_j [steps, G]
  std::vector<S> dstates;  ///< ∂/∂g_j [steps, G]
  std::vector<S> xi, hh;   ///< one step's W_ih·e and W_hh·g [3G]
  std::vector<S> dxi, dhh, dg;
  std::vector<S> base, fin;                            ///< one block's U and F [K, V]
  std::vector<S> head_in, head_a, head_s, head_delta;  ///< one row's [h; g], W1·in, SiLU, W2·s
  std::vector<S> dbase, dfin, dhead_s, dhead_a, dhead_in, dhf;
};

}  // namespace dflash
