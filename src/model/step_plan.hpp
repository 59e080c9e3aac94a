// dflash.cpp — the plan of one training step on a device: its buffers as memory-plan entries
// (core/arena_plan), and its FLOPs. The buffers: the target's weights and tap-forward activations
// (TargetCuda), the drafter's state, saved activations and workspaces (DrafterCuda) and the pool
// of per-op scratch. Host code only, so the plan can be printed and tested without a GPU; the CUDA
// classes take every buffer from an arena packed from these same entries (by name, checked against
// the planned size), so the plan is the allocation.
//
// What the drafter keeps for its backward, always: per layer q_raw, k_raw, v, o, lse
// (attention), h_mid and h_out (fp32 residual stream), gu (gate|up). The rest of what the
// backward reads is either recomputed there from what is kept (DrafterActivations::recompute:
// the block rows of norm(x_in) from x_in, q and k after norm + RoPE from q_raw and k_raw,
// norm(h_mid) from h_mid, SwiGLU(gu), and the block embeddings h0, a table lookup; cost: 4
// elementwise kernels and 3 norms per layer, no GEMM) or kept from the forward as well
// (DrafterActivations::keep: per layer its own kvin [ctx ; norm(x_in)], q, k, hn2 and act, and h0
// live until the backward). Recomputing runs the forward's kernels on the forward's inputs, so
// both give the same bits; keep costs memory ((TK + NK)·H + NK·QD + TK·KD + NK·I bf16 values per
// layer), recompute costs time. The context rows ctx = hidden_norm(fc(features)) are computed
// once per step (copied into each layer's kvin when kept).
//
// Phases (StepPhase) are the order of work in one step; a buffer's phase set is every phase from
// its first write to its last read, so buffers of disjoint sets can share memory.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/arena_plan.hpp"
#include "model/config.hpp"
#include "model/drafter.hpp"
#include "ops/cross_entropy.hpp"

namespace dflash {

/// Phases of one training step on a device, in order.
enum StepPhase : int {
  kPhaseTarget = 0,  ///< target tap forward
  kPhaseDrafterCtx,  ///< zero gradients, ctx = hidden_norm(fc(features)), block embeddings
  kPhaseFwdAttn,     ///< per layer: input norm, q/k/v, attention, o_proj
  kPhaseFwdMlp,      ///< per layer: post norm, gate|up, SwiGLU, down
  kPhaseHead,        ///< final norm, fused LM-head CE, final norm backward
  kPhaseBwdMlp,      ///< per layer (last first): backward of the MLP half
  kPhaseBwdAttn,     ///< per layer: backward of the attention half
  kPhaseBwdCtx,      ///< hidden_norm and fc backward, gradient sum of squares
  kPhaseOptimizer,   ///< AdamW, bf16 weight refresh
  kNumStepPhases
};

/// Names of the StepPhase values ("target", "drafter ctx", ...), in order.
std::vector<std::string> step_phase_names();
/// The set of the given phases.
PhaseMask step_phases(std::initializer_list<StepPhase> phases);
/// Every phase from `first` to `last` (inclusive).
PhaseMask step_phase_range(StepPhase first, StepPhase last);
/// Every phase.
PhaseMask step_all_phases();

/// Rows per chunk of the drafter's fused LM-head CE (its workspace is rows·V·6 bytes).
inline constexpr int64_t kDrafterCeChunkRows = 8192;

/// How the drafter's backward gets the activations the forward computes but need not keep (see the
/// file comment): recomputed in the backward, or kept from the forward.
enum class DrafterActivations { recompute, keep };
/// "recompute" or "keep".
const char* drafter_activations_name(DrafterActivations a);

/// Largest shapes a drafter step is planned for, and what its backward keeps.
struct DrafterStepSizes {
  int64_t max_ctx = 0;        ///< context rows T
  int64_t max_rows = 0;       ///< block rows NK (a multiple of the block size)
  int64_t ce_chunk_rows = 0;  ///< rows per chunk of the fused LM-head CE
  DrafterActivations activations = DrafterActivations::recompute;
};

/// The fused LM-head CE of a drafter step over `rows` block rows (hidden size, vocabulary, chunks
/// of `ce_chunk_rows`; grad_scale 1, the step sets its own). Where the targets are block_targets
/// (dflash, the D-PACE losses and DFlash2's base: slot 0 is never supervised) every block's first
/// row is skipped (skip_first_of = block size: 1/K of the CE's GEMMs saved; DFlash2's selector
/// reads none of the CE's outputs of that row). A DSpark or Domino drafter has no fused CE:
/// skip_first_of 0.
FusedCeParams drafter_ce_params(const DrafterConfig& c, int64_t rows, int64_t ce_chunk_rows);

/// Group names used in the tables.
inline constexpr const char* kGroupTargetWeights = "target weights (bf16)";
inline constexpr const char* kGroupTargetActs = "target activations";
inline constexpr const char* kGroupDrafterState =
    "drafter state (fp32 master, Adam m, v; bf16 copy)";
inline constexpr const char* kGroupDrafterGrads = "drafter gradients (fp32)";
inline constexpr const char* kGroupSaved = "saved activations (per layer)";
inline constexpr const char* kGroupStep = "step buffers (features, ctx, embeddings)";
inline constexpr const char* kGroupLayerScratch = "layer scratch (recomputed in backward)";
inline constexpr const char* kGroupHead = "LM-head CE";
inline constexpr const char* kGroupBackward = "backward scratch";
inline constexpr const char* kGroupOpScratch = "op scratch pool";
inline constexpr const char* kGroupInputs = "step inputs";

/// What the CUDA kernels cannot run of this target: one line per unsupported setting, naming the
/// config field, its value and the config's source (empty: the CUDA backend runs all of it).
/// head_dim other than 64 or 128 (the attention kernels); for MoE targets hidden_size or the
/// expert width not a multiple of 8 (the expert GEMMs), more than 1024 experts or top-k above 32
/// (the router). TargetCuda refuses these at construction; the memory plans report them first.
std::vector<std::string> cuda_target_unsupported(const ModelConfig& c);
/// The same for a drafter (DrafterCuda's constructor refuses these; the memory plans report them
/// first): head_dim other than 64 or 128 (DrafterCuda's attention), and for a DFlash2 drafter the
/// CUDA selector's limits (dflash2_cuda_unsupported). Every objective's head (DSpark, Domino,
/// DFlash2's conv and selector) runs on CUDA.
std::vector<std::string> cuda_drafter_unsupported(const DrafterConfig& c);

/// Columns per context row of the features a target forward hands the drafter step: the taps
/// [n_taps·H], and for a DSpark drafter (cfg.dspark.enabled) also the target's final-norm hidden
/// states [H] (the teacher). The features of T rows are laid out as the taps [T, n_taps·H]
/// followed by the final-norm rows [T, H] (two blocks, so the taps keep their row stride).
int64_t drafter_feature_cols(const DrafterConfig& c);
/// Target layers a training step uploads and runs: the deepest tap + 1, or every layer for a
/// DSpark drafter (the final norm reads the last layer's output). Throws as target_layers_needed.
int64_t target_layers_for_drafter(const ModelConfig& target, const DrafterConfig& drafter);
/// Name of the target's final-norm weight f32 [H] in a training step's plan (DSpark drafters only).
inline constexpr const char* kTargetFinalNorm = "target.final_norm";

/// Number of target layers a tap forward runs: the deepest tap + 1 (layers after it are never
/// uploaded). Throws dflash::Error for an empty list or a tap outside [0, num_hidden_layers).
int64_t target_layers_needed(const ModelConfig& c, const std::vector<int>& taps);

/// Which kinds of layer the first `n_layers` layers of a target hold (what their tap forward needs
/// on the device beyond the attention blocks).
struct TargetLayerMix {
  bool dense = false;    ///< some layer has a dense MLP (config.moe_layers[l] false)
  bool moe = false;      ///< some layer has a sparse MoE block
  bool sliding = false;  ///< some layer is a sliding_attention layer
};
/// The mix of layers [0, n_layers). Throws dflash::Error for n_layers outside
/// [0, num_hidden_layers].
TargetLayerMix target_layer_mix(const ModelConfig& c, int64_t n_layers);

/// Device scratch of the target's tap forward per op call (ops do not nest): the MoE dispatch's
/// counts when a MoE layer runs (moe_dispatch_cuda_scratch_bytes), 0 for dense targets (their
/// ops take no scratch). Bytes.
uint64_t target_op_scratch_bytes(const ModelConfig& c, int64_t n_layers);

/// TargetCuda's weights for layers [0, n_layers), all live in the phases `live`:
///   "target.embed", "target.lm_head" (untied only) bf16 [V, H]; "target.inv_freq" f32 [D/2];
///   per layer "target.layers.{l}.":
///     wqkv bf16 [(NH + 2·NKV)·D, H] = [Wq; Wk; Wv] (one GEMM projects q, k and v), wo
///     [H, NH·D] bf16; in_norm, post_norm f32 [H]; q_norm, k_norm f32 [D] (qk_norm); bqkv f32
///     [(NH + 2·NKV)·D] = [bq; bk; bv] (attention_bias);
///     bo f32 [H] (o_proj_bias); sinks f32 [NH] (attention_sinks);
///     dense MLP layers: wgu bf16 [2I, H] = [gate; up], wdown [H, I]; bgu f32 [2I] = [bgate; bup]
///     and bdown f32 [H] (mlp_bias);
///     MoE layers (E experts of width EI): moe.router bf16 [E, H]; moe.router_bias f32 [E]
///     (router_bias); moe.wgu bf16 [E, 2·EI, H] (expert e's [gate; up]), moe.wdown [E, H, EI];
///     moe.gu_ptrs, moe.down_ptrs: device arrays of E pointers into them (the grouped GEMM's
///     operand lists); moe.gate_bias, moe.up_bias f32 [E·EI] and moe.down_bias [E·H]
///     (expert_bias).
/// `live`: the phases they are live in (every step phase; a plan of the target forward alone has
/// only the target phase). Throws dflash::Error for n_layers outside [0, num_hidden_layers].
void plan_target_weights(ArenaPlanner& p, const ModelConfig& c, int64_t n_layers,
                         PhaseMask live = step_all_phases());
/// TargetCuda::forward_taps activations of layers [0, n_layers) for up to `max_tokens` tokens,
/// phase target only: "target.act.{x (f32 residual stream), hn, qkv (the fused projection's
/// output [T, (NH + 2·NKV)·D] bf16), q, k, v, o, tap}"; with a dense
/// layer "target.act.{gu, act}"; with a sliding layer "target.act.win" (the window ranges
/// [T] AttnRange); with a MoE layer the sparse block's workspace over R = max_tokens·top-k rows:
/// "target.act.moe.{logits [T, E] f32, ids, weights, perm, slot, row_expert [R], offsets [E+1],
/// xs [R, H] bf16, gu [R, 2·EI] bf16, act [R, EI] bf16, ys [R, H] f32}".
void plan_target_activations(ArenaPlanner& p, const ModelConfig& c, int64_t n_layers,
                             int64_t max_tokens);
/// DrafterCuda's state, activations and workspaces ("drafter.*"), see the file comment.
/// "drafter.features" [max_ctx, drafter_feature_cols] bf16 is written by the target phase. A
/// DSpark drafter's head phase uses "drafter.dspark.workspace", "drafter.dspark.rows" (model/
/// dspark_head_cuda.hpp) and "drafter.dspark.sums" f64 [6] instead of the fused CE's workspace; a
/// Domino drafter's "drafter.domino.workspace", "drafter.domino.rows" (model/domino_head_cuda.hpp)
/// and "drafter.domino.sums" f64 [4].
void plan_drafter_step(ArenaPlanner& p, const DrafterConfig& c, const DrafterLayout& layout,
                       const DrafterStepSizes& s);
/// The pool every op's internal scratch comes from during a step ("workspace.op_scratch"): the
/// largest scratch of any one op call of the step (ops do not nest): the target's tap forward over
/// its first `target_layers` layers (target_op_scratch_bytes) and the drafter step. Every phase.
void plan_op_scratch(ArenaPlanner& p, const ModelConfig& target, int64_t target_layers,
                     const DrafterConfig& c, const DrafterStepSizes& s);

/// FLOPs of the drafter step's GEMMs at T context rows and NK block rows (forward, backward and
/// the LM-head CE's two GEMMs; 2 per multiply-add; attention's own FLOPs excluded: see
/// drafter_attention_flops). For throughput figures.
struct DrafterFlops {
  double fwd_gemm = 0;  ///< fc, q/k/v/o, gate|up, down
  double head = 0;      ///< logits GEMM + d_hidden GEMM of the fused CE (its head rows only;
                        ///< 0 when DFlash2's head computes the base CE: Dflash2Heads::base_in_head)
  double bwd_gemm = 0;  ///< input and weight gradients of every trained GEMM
  double attn_fwd = 0;  ///< useful attention FLOPs (visible keys only), forward
  double attn_bwd = 0;  ///< the same for the backward (2.5× the forward's)
};
/// `visible_keys` = Σ over block rows of the keys each sees (context prefix + its block).
DrafterFlops drafter_step_flops(const DrafterConfig& c, int64_t T, int64_t NK, double visible_keys);
/// FLOPs of the target's tap forward over T tokens in documents whose causal attention sees
/// `visible_keys` keys in all (Σ over tokens of their position + 1): GEMMs of layers
/// [0, n_layers) (dense MLP: gate, up, down of width I; MoE layer: the router and the top-k
/// experts' gate, up, down of width EI per token) plus causal attention (QK and PV, 4·D per
/// visible key and head; sliding layers are counted as full ones, an upper bound).
double target_forward_flops(const ModelConfig& c, int64_t n_layers, int64_t T, double visible_keys);

}  // namespace dflash
