// dflash.cpp — the DFlash drafter (DESIGN.md §1): a Qwen3-style decoder over a block of K tokens
// that attends to target features of the context through shared k/v projections.
//
//   ctx = hidden_norm(fc(features))                      features [T, n_taps·H] (frozen target)
//   h   = embed([x_anchor, MASK × (K−1)])                 target's frozen embedding
//   per layer: h += o_proj(Attn(q = block rows, k/v = [ctx rows ; block rows]))
//              h += down(silu(gate(norm(h))) · up(norm(h)))
//   logits = lm_head(norm(h))                              target's frozen LM head
// q/k per-head RMSNorm (every k row, ctx and block), RoPE with positions relative to the document
// start (ctx row p → p − doc_start; block slot j → anchor − doc_start + j), GQA, bidirectional
// inside a block. Block b's queries see ctx rows [doc_start, anchor) and the K rows of block b.
//
// Invariants: parameters live in one flat array in export order (DrafterLayout); parameter
// gradients ACCUMULATE (+=) into a flat array of the same layout, so several calls add up;
// activation gradients are overwritten. A training step's input is a DrafterBatch (all rows of a
// step as one packed sequence of documents; drafter_batch.hpp). The step code is templated on the
// scalar (float for training, double for finite-difference checks) and allocates only inside its
// workspace, whose buffers keep their capacity between calls.
// The loss is the batch's (DrafterBatch::objective): dflash weighs slots by targets.weights; the
// D-PACE losses weigh each supervised slot by dpace_block_weights of the step's own CE values,
// held constant (no gradient through the weights), and the caller's grad_scale is 1 / the number
// of sequences (DrafterBatch::loss_normaliser); DFlash2 does the same on its unary logits and
// weighs its selector's CE alike (model/dflash2_selector.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/rng.hpp"
#include "model/dflash2_conv.hpp"
#include "model/domino_config.hpp"
#include "model/drafter_batch.hpp"
#include "model/objective.hpp"
#include "ops/attention.hpp"
#include "ops/rope.hpp"

namespace dflash {

/// DSpark's Markov bias head (OBJECTIVES.md §1.3, SpecForge `dspark.py`): with e = W1[prev]
/// (W1 [V, r]) and W2 [V, r], the bias added to slot k's logits is
///   vanilla: W2·e_k
///   gated:   W2·(σ(Wg·[h_k; e_k] + bg) ⊙ e_k)                      Wg [r, H+r], bg [r]
///   rnn:     (g, c, o) = split(J·[s_{k−1}; e_k; h_k] + bJ), s_k = σ(g)⊙s_{k−1} + (1−σ(g))⊙tanh c,
///            bias W2·tanh o, s_{−1} = 0 in every block              J [3r, 2r+H], bJ [3r]
/// (h_k: the drafter's final hidden state after its final norm).
enum class MarkovHeadType { vanilla, gated, rnn };

/// The MarkovHeadType of a `markov_head_type` value (vanilla, gated, rnn); nullopt otherwise.
std::optional<MarkovHeadType> markov_head_type_parse(std::string_view name);
/// The config spelling of `t`.
const char* markov_head_type_name(MarkovHeadType t);

/// The DSpark heads of a drafter (export `dflash_config`: projector_type "dspark", markov_rank,
/// markov_head_type, enable_confidence_head, confidence_head_with_markov). A drafter without them
/// (enabled false) is a plain DFlash drafter.
struct DsparkHeads {
  bool enabled = false;  ///< projector_type dspark: shifted labels, all K slots draft
  int markov_rank = 0;   ///< r; 0: no Markov head
  MarkovHeadType markov_type = MarkovHeadType::vanilla;
  /// The confidence head c_k = wc·x_k + bc (x_k = h_k, or [h_k; e_k] with confidence_with_markov).
  bool confidence_head = false;
  bool confidence_with_markov = false;
  /// Width of the confidence head's input: H, or H + r with confidence_with_markov.
  int64_t confidence_in(int64_t H) const { return H + (confidence_with_markov ? markov_rank : 0); }
  bool operator==(const DsparkHeads&) const = default;
};

/// DFlash2's additions to a drafter (OBJECTIVES.md §1.4; export `dflash_config` keys of the same
/// names): the grouped dynamic causal conv around every attention and MLP sublayer
/// (model/dflash2_conv.hpp) and the candidate selector (model/dflash2_selector.hpp). A drafter
/// without them (enabled false) is a plain DFlash drafter.
struct Dflash2Heads {
  bool enabled = false;                ///< architectures DFlash2DraftModel
  int conv_kernel_size = 0;            ///< T, in [1, block_size]
  int conv_group_size = 0;             ///< g channels per group; divides hidden_size
  int selector_rank = 0;               ///< r of the codebooks A, Bs [V, r] and P_h [r, H]
  int selector_top_k = 0;              ///< K candidates per slot, in [1, vocab_size]
  double output_multiplier = 1.0;      ///< m of the unary logits softcap(m·U); > 0
  double final_logit_softcapping = 0;  ///< c of softcap(z) = c·tanh(z/c); 0: none
  /// Whether the unary logits ū differ from the LM head's U (m ≠ 1 or a softcap): then the CUDA
  /// selector head computes the base CE itself, else the fused CE does (model/drafter_cuda.hpp).
  bool base_in_head() const {
    return enabled && (output_multiplier != 1 || final_logit_softcapping != 0);
  }
  bool operator==(const Dflash2Heads&) const = default;
};

/// Sizes and settings of a drafter (the Qwen3 fields of its export config.json plus DFlash's).
struct DrafterConfig {
  int64_t hidden_size = 0;        ///< H, equal to the target's
  int64_t intermediate_size = 0;  ///< I
  int64_t num_layers = 1;         ///< drafter decoder layers
  int64_t num_heads = 0;          ///< NH
  int64_t num_kv_heads = 0;       ///< NKV (NH % NKV == 0)
  int64_t head_dim = 0;           ///< D
  int64_t vocab_size = 0;         ///< V of the target's embedding / LM head
  double rms_norm_eps = 1e-6;
  RopeParams rope;                ///< copied from the target
  int64_t max_position_embeddings = 0;
  int block_size = 16;            ///< K
  int mask_token_id = -1;
  std::vector<int> target_layer_ids;
  int num_target_layers = 0;
  DsparkHeads dspark;             ///< DSpark's heads (enabled false: a DFlash drafter)
  Dflash2Heads dflash2;           ///< DFlash2's conv and selector (enabled false: none)
  DominoHead domino;              ///< Domino's GRU head (enabled false: none)

  /// Number of tapped target layers (features are [T, n_taps·H]).
  int64_t n_taps() const { return static_cast<int64_t>(target_layer_ids.size()); }
  /// Throws dflash::Error naming the field when sizes are inconsistent, tap ids are outside
  /// [0, num_target_layers), mask_token_id is outside [0, vocab_size), or the DSpark heads are
  /// inconsistent (markov_rank < 0, a gated/rnn or Markov confidence head without a Markov rank,
  /// DSpark fields on a drafter that is not DSpark), or the DFlash2 fields are (a DFlash2 key
  /// outside its range, named; DFlash2 together with DSpark), or the Domino head is (emb_dim or
  /// gru_hidden_dim ≤ 0, pure_draft_prefix_len outside [0, block_size − suffix], both heads).
  void validate() const;
};

/// How drafter_init fills a parameter.
enum class ParamInit {
  normal,         ///< N(0, 0.02²) (norms 1 and biases 0 through is_norm / is_bias)
  zero,           ///< 0, draws nothing (DFlash2's kernel_projection and successor_codebook)
  conv_identity,  ///< DFlash2's base_kernel [2, T, H]: tap 0 is 1, the others 0; draws nothing
};

/// Where one named parameter lives in the flat parameter array.
struct ParamInfo {
  std::string name;            ///< export name, e.g. "layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  ///< [OUT, IN] for linears, [n] for norms
  int64_t offset = 0;          ///< elements from the start of the flat array
  int64_t numel = 0;
  bool is_norm = false;        ///< RMSNorm weight (initialised to 1)
  bool is_bias = false;        ///< a linear's bias (initialised to 0)
  ParamInit init = ParamInit::normal;
};

/// Offsets (elements from the start of the flat array) of one decoder layer's parameters, named
/// as in the export (`layers.{i}.self_attn.q_proj.weight` → q_proj, ...).
struct DrafterLayerOffsets {
  int64_t input_layernorm = 0, q_proj = 0, k_proj = 0, v_proj = 0, o_proj = 0, q_norm = 0,
          k_norm = 0, post_attention_layernorm = 0, gate_proj = 0, up_proj = 0, down_proj = 0;
};

/// Offsets of the DSpark heads' parameters (−1 where the config has no such parameter), named as
/// in the export (OBJECTIVES.md §1.3, DeepSeek's dspark_qwen3_4b_block7).
struct DsparkOffsets {
  int64_t markov_w1 = -1;  ///< markov_head.markov_w1.weight [V, r] (the embedding W1)
  int64_t markov_w2 = -1;  ///< markov_head.markov_w2.weight [V, r] (the projection W2)
  int64_t gate_w = -1;     ///< markov_head.gate_proj.weight [r, H+r] (gated)
  int64_t gate_b = -1;     ///< markov_head.gate_proj.bias [r]
  int64_t joint_w = -1;    ///< markov_head.joint_proj.weight [3r, 2r+H] (rnn)
  int64_t joint_b = -1;    ///< markov_head.joint_proj.bias [3r]
  int64_t conf_w = -1;     ///< confidence_head.proj.weight [1, H(+r)]
  int64_t conf_b = -1;     ///< confidence_head.proj.bias [1]
};

/// Offsets of DFlash2's parameters (empty / −1 for a drafter without them), named as in the
/// export (OBJECTIVES.md §1.4).
struct Dflash2Offsets {
  /// Per layer: layers.{i}.attention_conv.base_kernel [2, T, H], ….kernel_projection.weight
  /// [2·T·Gc, H], and the same two of mlp_conv.
  std::vector<int64_t> attn_base, attn_kp, mlp_base, mlp_kp;
  int64_t predecessor = -1;  ///< candidate_selector.predecessor_codebook A [V, r]
  int64_t successor = -1;    ///< candidate_selector.successor_codebook Bs [V, r]
  int64_t hidden_proj = -1;  ///< candidate_selector.hidden_projection.weight P_h [r, H]
};

/// The flat parameter layout of a config, in export order:
/// fc, hidden_norm, per layer {input_layernorm, q, k, v, o, q_norm, k_norm,
/// post_attention_layernorm, gate, up, down}, norm, then the DSpark heads' tensors (DsparkOffsets
/// order) that the config has, then DFlash2's (per layer attention_conv.{base_kernel,
/// kernel_projection.weight}, mlp_conv.{…}; then the selector's predecessor, successor codebooks
/// and hidden projection), then the Domino head's (DominoOffsets order). gate_proj and up_proj of
/// a layer are adjacent
/// (up follows gate), so the two can be read as one [2I, H] matrix. Code reaches a parameter
/// through the named offsets below (resolved by export name at construction), never by its index in
/// `params`.
struct DrafterLayout {
  std::vector<ParamInfo> params;
  int64_t total = 0;
  int64_t fc = 0;                           ///< offset of fc.weight [H, n_taps·H]
  int64_t hidden_norm = 0;                  ///< offset of hidden_norm.weight [H]
  int64_t norm = 0;                         ///< offset of the final norm.weight [H]
  std::vector<DrafterLayerOffsets> layers;  ///< per decoder layer
  DsparkOffsets dspark;                     ///< the DSpark heads (all −1 for a DFlash drafter)
  Dflash2Offsets dflash2;                   ///< DFlash2's conv and selector (empty for DFlash)
  DominoOffsets domino;                     ///< the Domino head (all −1 without it)
  /// Throws dflash::Error when the parameter count of `c` overflows int64 (corrupt sizes).
  explicit DrafterLayout(const DrafterConfig& c);
  /// A parameter by export name; throws dflash::Error naming it if unknown.
  const ParamInfo& find(const std::string& name) const;
};

/// Fills `params` (layout.total values): linear and embedding weights ~ N(0, 0.02²) from `seed`
/// in layout order, norm weights 1, biases 0 (HF's initializer_range 0.02). Reproducible bit for
/// bit from the seed; a DFlash drafter's values do not depend on whether DSpark heads follow.
/// ParamInit::zero and ::conv_identity tensors draw nothing (DFlash2's identity start).
void drafter_init(std::span<float> params, const DrafterLayout& layout, uint64_t seed);

/// Result of a forward (and backward) over one DrafterBatch.
struct DrafterTrainResult {
  double loss_sum = 0;          ///< Σ w·CE over the batch's blocks (w: dflash's or D-PACE's)
  double weight_sum = 0;        ///< Σ w (the same weights)
  std::vector<int32_t> argmax;  ///< [N·K] drafter argmax per supervised slot (-1 elsewhere:
                                ///< rows of weight 0 skip the LM head)
  /// DSpark only: Σ w·CE, Σ w·L1, Σ w·BCE and Σ w·acc of the step's rows (loss_sum is their
  /// αce/αl1/αconf combination).
  double dspark_ce_sum = 0, dspark_l1_sum = 0, dspark_bce_sum = 0, dspark_acc_sum = 0;
  /// DSpark only, per block row [N·K]: confidence logit and acc (DsparkSums::conf, ::acc).
  std::vector<double> dspark_conf, dspark_acc;
  /// DFlash2 only: Σ w·CE of the unary logits, Σ w·CE_sel of the selector (over the slots whose
  /// gold is among the candidates), Σ w of those slots (loss_sum = base + α_sel·selector).
  double dflash2_base_sum = 0, dflash2_selector_sum = 0, dflash2_in_topk_weight = 0;
  /// Domino only: Σ w·CE(F) and Σ w·CE(U) of the step's rows (loss_sum is their (1−λ)/λ blend).
  double domino_final_ce_sum = 0, domino_base_ce_sum = 0;
};

/// Per-layer activations kept for the backward (internal to the drafter step).
template <typename S>
struct LayerActs {
  std::vector<S> x_in, hn, q_raw, q, k_raw, k, v, o, lse, h_mid, hn2, gate_up, act;
  Dflash2ConvActs<S> attn_conv, mlp_conv;  ///< DFlash2 only (model/dflash2_conv.hpp)
};

/// Scratch of the DSpark head (model/dspark_head.hpp; capacity kept between calls).
template <typename S>
struct DsparkWorkspace {
  std::vector<S> logits, teacher, tlogits, emb, z, gate_in, gate_pre, rnn_in, rnn_u, rnn_s;
  std::vector<S> conf_in, conf, dconf, dconf_in, dz, demb, dgate_pre, dgate_in, du, din;
  std::vector<int32_t> prev;
};

/// Scratch of the DFlash2 selector (model/dflash2_selector.hpp; capacity kept between calls).
template <typename S>
struct Dflash2Workspace {
  std::vector<S> logits, dunary, hin, dhin, dhsel, proj, dproj, e, score;
  std::vector<S> row_max, row_sum;         // a chunk's max ū and Σ exp(ū − max) per row
  std::vector<double> row_ce, row_weight;  // a chunk's base CE and loss weight per row
  std::vector<int32_t> rows, cand;
  /// Rows per LM-head chunk (at least the block size; 0: about 16 MiB of logits). Chunks hold
  /// whole blocks, so the step's loss and gradients do not depend on it (tests vary it).
  int64_t chunk_rows = 0;
};

/// Scratch buffers of the step (capacity kept between calls; one per thread).
template <typename S>
struct DrafterWorkspace {
  std::vector<S> ctx_pre, ctx, h, hf, dh, dhn, dtmp, dctx, dctx_pre, logits;
  std::vector<S> d_o, dq, dk, dv, dq_n, dk_n, dq_raw, dk_raw, d_act, d_gate_up, dhn2, dbuf;
  std::vector<LayerActs<S>> layers;
  std::vector<int32_t> pos_kv, pos_q, block_tokens, labels;
  std::vector<S> weights, lse_out;
  std::vector<int32_t> ce_rows, ce_argmax;  // the supervised rows sent to the LM-head CE
  std::vector<S> ce_in, ce_grad;            // their final hidden states and gradients
  std::vector<S> ce_loss;                   // their CE (D-PACE: with weight 1)
  std::vector<double> dpace_ce, dpace_w;    // the CE rows' CE and D-PACE weights [ce_rows]
  std::vector<S> inv_freq;
  std::vector<AttnRange> ranges;
  DsparkWorkspace<S> dspark;                // the DSpark head's scratch
  std::vector<S> conv_ddelta, conv_dtmp, conv_dy;  // DFlash2 conv backward scratch
  Dflash2Workspace<S> dflash2;                     // the DFlash2 selector's scratch
  DominoWorkspace<S> domino;                // the Domino head's scratch
};


/// Frozen target tables the drafter borrows: embedding [V, H] and LM head [V, H] (the same array
/// when the target ties them).
template <typename S>
struct DrafterTables {
  const S* embed = nullptr;
  const S* lm_head = nullptr;
};

/// Training forward over a whole DrafterBatch (all its rows as one packed sequence) given the
/// target features of its context, `features` [T, n_taps·H]; when `grads` is not null, also the
/// backward, accumulating parameter gradients (+=) scaled by `grad_scale` (use
/// 1/batch.loss_normaliser() so that the gradient is that of the step's loss: Σw·CE/Σw for
/// dflash, Σ m·w·CE / sequences for D-PACE with w held constant, DSpark's numerator / Σw).
/// For objective domino (cfg.domino.enabled) the loss is model/domino_head.hpp's, with the batch's
/// objective.domino_lambda.
/// For objective dspark (cfg.dspark.enabled) `target_final` [T, H] holds the target's
/// final-norm hidden states of the batch's context (the teacher, model/dspark_head.hpp). Throws
/// dflash::Error on inconsistent inputs (naming them), a DSpark batch for a drafter without DSpark
/// heads or the reverse. `ws` must not be shared between threads.
template <typename S>
DrafterTrainResult drafter_train_step(const DrafterConfig& cfg, const DrafterLayout& layout,
                                      const S* params, S* grads, const DrafterTables<S>& tables,
                                      const DrafterBatch& batch, const S* features,
                                      double grad_scale, DrafterWorkspace<S>& ws,
                                      const S* target_final = nullptr);

/// Logits [N·K, V] of the blocks of `batch` (training layout; no loss): for a DSpark drafter
/// the draft logits D with teacher-forced previous tokens (dspark_block_logits), for a DFlash2
/// drafter the unary logits ū (dflash2_unary_logits), for a Domino drafter the corrected logits F
/// with teacher-forced GRU inputs (domino_block_logits). ws.hf holds the
/// final-norm rows [N·K, H] afterwards. For tests and tools.
template <typename S>
std::vector<S> drafter_block_logits(const DrafterConfig& cfg, const DrafterLayout& layout,
                                    const S* params, const DrafterTables<S>& tables,
                                    const DrafterBatch& batch, const S* features,
                                    DrafterWorkspace<S>& ws);

/// Drafter KV cache for decoding: per layer the k (normed, roped) and v rows of the accepted
/// context, positions 0..len-1 of one request.
struct DrafterCache {
  std::vector<std::vector<float>> k, v;  ///< per layer [len, NKV·D]
  int64_t len = 0;
  /// Drops rows past `new_len` (the buffers keep their capacity); throws dflash::Error if
  /// new_len > len or < 0.
  void truncate(int64_t new_len);
};

/// Appends `n` context rows to the cache: ctx = hidden_norm(fc(features [n, n_taps·H])) at
/// positions cache.len .. cache.len+n-1, through every layer's k/v projections, k_norm and RoPE.
/// `ws` is scratch (one per thread; its buffers are reused, so a decoding loop allocates only
/// when the cache outgrows its capacity).
void drafter_cache_append(DrafterCache& cache, const DrafterConfig& cfg,
                          const DrafterLayout& layout, const float* params, const float* features,
                          int64_t n, DrafterWorkspace<float>& ws);

/// Inference layout: the block [anchor_token, MASK × (K−1)] at positions cache.len ..
/// cache.len+K−1, attending to every cache row and to itself. Returns logits [K, V] (for a DSpark
/// drafter the base logits U, before the Markov bias of dspark_slot_logits; for a Domino drafter
/// U, before domino_slot_logits' correction), a view of
/// `ws.logits` valid until `ws` is used again; ws.hf then holds the K final-norm rows [K, H]. The cache keeps its rows and length: its buffers
/// are borrowed for the block's k/v rows (no copy of the context) and handed back, also when an
/// error is thrown. Throws dflash::Error when a cache layer does not hold len rows.
std::span<const float> drafter_draft_block(DrafterCache& cache, const DrafterConfig& cfg,
                                           const DrafterLayout& layout, const float* params,
                                           const DrafterTables<float>& tables, int32_t anchor_token,
                                           DrafterWorkspace<float>& ws);

}  // namespace dflash
