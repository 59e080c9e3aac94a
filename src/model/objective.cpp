#include "model/objective.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"

namespace dflash {

void check_doc_offsets(std::span<const int32_t> off, int64_t T) {
  DFLASH_CHECK(!off.empty(), "doc_offsets is empty (expected n_docs+1 entries starting at 0)");
  DFLASH_CHECK(off[0] == 0, "doc_offsets[0] = {} (expected 0)", off[0]);
  for (size_t i = 1; i < off.size(); ++i) {
    DFLASH_CHECK(off[i] >= off[i - 1], "doc_offsets[{}] = {} < doc_offsets[{}] = {}", i, off[i],
                 i - 1, off[i - 1]);
  }
  DFLASH_CHECK(off.back() <= T, "doc_offsets ends at {} beyond the row of {} tokens", off.back(),
               T);
}

std::vector<int32_t> anchor_candidates(std::span<const uint8_t> mask, int32_t s, int32_t e) {
  std::vector<int32_t> c;
  for (int32_t p = s; p + 1 < e; ++p) {
    if (mask[p] && mask[p + 1]) c.push_back(p);
  }
  return c;
}

int32_t document_blocks(std::span<const uint8_t> mask, int num_anchors) {
  DFLASH_CHECK(num_anchors > 0, "num_anchors must be positive (got {})", num_anchors);
  const size_t n = anchor_candidates(mask, 0, static_cast<int32_t>(mask.size())).size();
  return static_cast<int32_t>(std::min<size_t>(n, static_cast<size_t>(num_anchors)));
}

std::vector<Anchor> sample_anchors(std::span<const uint8_t> mask, std::span<const int32_t> off,
                                   int num_anchors, Rng& rng) {
  DFLASH_CHECK(num_anchors > 0, "num_anchors must be positive (got {})", num_anchors);
  check_doc_offsets(off, static_cast<int64_t>(mask.size()));
  std::vector<Anchor> out;
  for (size_t d = 0; d + 1 < off.size(); ++d) {
    std::vector<int32_t> c = anchor_candidates(mask, off[d], off[d + 1]);
    size_t take = std::min(c.size(), static_cast<size_t>(num_anchors));
    if (take < c.size()) {
      for (size_t i = 0; i < take; ++i) {
        size_t j = i + static_cast<size_t>(rng.below(c.size() - i));
        std::swap(c[i], c[j]);
      }
      c.resize(take);
      std::sort(c.begin(), c.end());
    }
    for (int32_t p : c) out.push_back({p, static_cast<int32_t>(d)});
  }
  return out;
}

double slot_decay(int k, double gamma) {
  if (k <= 0) return 0.0;
  if (gamma <= 0) return 1.0;
  return std::exp(-static_cast<double>(k - 1) / gamma);
}

BlockTargets block_targets(std::span<const int32_t> tokens, std::span<const uint8_t> mask,
                           std::span<const int32_t> off, std::span<const Anchor> anchors, int K,
                           double gamma) {
  DFLASH_CHECK(K >= 2, "block size must be at least 2 (got {})", K);
  DFLASH_CHECK(tokens.size() == mask.size(), "tokens ({}) and loss_mask ({}) differ in length",
               tokens.size(), mask.size());
  check_doc_offsets(off, static_cast<int64_t>(tokens.size()));
  BlockTargets t;
  t.K = K;
  const size_t n = anchors.size() * static_cast<size_t>(K);
  t.labels.assign(n, -1);
  t.weights.assign(n, 0.0f);
  t.counted.assign(n, 0);
  for (size_t b = 0; b < anchors.size(); ++b) {
    const Anchor& a = anchors[b];
    DFLASH_CHECK(a.doc >= 0 && static_cast<size_t>(a.doc) + 1 < off.size(),
                 "anchor {} names document {} of {}", b, a.doc, off.size() - 1);
    const int32_t s = off[a.doc], e = off[a.doc + 1];
    DFLASH_CHECK(a.pos >= s && a.pos < e,
                 "anchor {} at position {} is outside its document [{}, {})", b, a.pos, s, e);
    for (int k = 0; k < K; ++k) {
      const int64_t p = static_cast<int64_t>(a.pos) + k;
      const size_t i = b * K + k;
      if (p >= e) continue;
      t.labels[i] = tokens[p];
      if (k >= 1 && mask[p]) {
        t.weights[i] = static_cast<float>(slot_decay(k, gamma));
        t.counted[i] = 1;
      }
    }
  }
  return t;
}

BlockTargets dspark_block_targets(std::span<const int32_t> tokens, std::span<const uint8_t> mask,
                                  std::span<const int32_t> off, std::span<const Anchor> anchors,
                                  int K, double gamma) {
  BlockTargets t = block_targets(tokens, mask, off, anchors, K, gamma);  // checks the inputs
  t.first_slot = 0;
  std::fill(t.labels.begin(), t.labels.end(), -1);
  std::fill(t.weights.begin(), t.weights.end(), 0.0f);
  std::fill(t.counted.begin(), t.counted.end(), uint8_t(0));
  for (size_t b = 0; b < anchors.size(); ++b) {
    const Anchor& a = anchors[b];
    const int32_t e = off[a.doc + 1];
    bool prefix = true;  // e_k: every label up to slot k is in the document and supervised
    for (int k = 0; k < K; ++k) {
      const int64_t p = static_cast<int64_t>(a.pos) + 1 + k;
      const size_t i = b * K + k;
      if (p >= e) break;
      t.labels[i] = tokens[p];
      prefix = prefix && mask[p];
      if (!prefix) continue;
      t.weights[i] = gamma > 0 ? static_cast<float>(std::exp(-static_cast<double>(k) / gamma))
                               : 1.0f;
      t.counted[i] = 1;
    }
  }
  return t;
}

BlockTargets domino_block_targets(std::span<const int32_t> tokens, std::span<const uint8_t> mask,
                                  std::span<const int32_t> off, std::span<const Anchor> anchors,
                                  int K, double gamma, bool shift_label) {
  BlockTargets t = block_targets(tokens, mask, off, anchors, K, gamma);  // checks the inputs
  if (!shift_label) return t;
  t.first_slot = 0;
  std::fill(t.labels.begin(), t.labels.end(), -1);
  std::fill(t.weights.begin(), t.weights.end(), 0.0f);
  std::fill(t.counted.begin(), t.counted.end(), uint8_t(0));
  for (size_t b = 0; b < anchors.size(); ++b) {
    const Anchor& a = anchors[b];
    const int32_t e = off[a.doc + 1];
    for (int k = 0; k < K; ++k) {
      const int64_t p = static_cast<int64_t>(a.pos) + 1 + k;
      const size_t i = b * K + k;
      if (p >= e) break;
      t.labels[i] = tokens[p];
      if (!mask[p]) continue;  // each slot its own mask (SpecForge gathers loss_mask[a+k+1])
      t.weights[i] = gamma > 0 ? static_cast<float>(std::exp(-static_cast<double>(k) / gamma))
                               : 1.0f;
      t.counted[i] = 1;
    }
  }
  return t;
}

std::optional<ObjectiveKind> objective_kind_parse(std::string_view name) {
  for (ObjectiveKind k : {ObjectiveKind::dflash, ObjectiveKind::dspark, ObjectiveKind::dflash2,
                          ObjectiveKind::domino}) {
    if (name == objective_kind_name(k)) return k;
  }
  return std::nullopt;
}

const char* objective_kind_name(ObjectiveKind k) {
  switch (k) {
    case ObjectiveKind::dflash:
      return "dflash";
    case ObjectiveKind::dspark:
      return "dspark";
    case ObjectiveKind::dflash2:
      return "dflash2";
    case ObjectiveKind::domino:
      return "domino";
  }
  fail("objective {} is not an ObjectiveKind", static_cast<int>(k));
}

std::optional<LossType> loss_type_parse(std::string_view name) {
  for (LossType t : {LossType::dflash, LossType::dpace, LossType::dpace_cumulative_confidence_only,
                     LossType::dpace_continuation_value_only}) {
    if (name == loss_type_name(t)) return t;
  }
  return std::nullopt;
}

const char* loss_type_name(LossType t) {
  switch (t) {
    case LossType::dflash:
      return "dflash";
    case LossType::dpace:
      return "dpace";
    case LossType::dpace_cumulative_confidence_only:
      return "dpace-cumulative-confidence-only";
    case LossType::dpace_continuation_value_only:
      return "dpace-continuation-value-only";
  }
  fail("loss type {} is not a LossType", static_cast<int>(t));
}

double ObjectiveMetrics::accuracy() const {
  int64_t c = 0, n = 0;
  for (int k = 0; k < K; ++k) {
    c += slot_correct[k];
    n += slot_count[k];
  }
  return n ? static_cast<double>(c) / static_cast<double>(n) : 0.0;
}

double ObjectiveMetrics::slot_accuracy(int k) const {
  if (k < 0 || k >= K || slot_count[k] == 0) return std::numeric_limits<double>::quiet_NaN();
  return static_cast<double>(slot_correct[k]) / static_cast<double>(slot_count[k]);
}

void ObjectiveMetrics::merge(const ObjectiveMetrics& o) {
  if (K == 0) *this = ObjectiveMetrics(o.K);
  DFLASH_CHECK(o.K == K, "merging metrics of block size {} into {}", o.K, K);
  loss_weighted_sum += o.loss_weighted_sum;
  weight_sum += o.weight_sum;
  for (int k = 0; k < K; ++k) {
    slot_correct[k] += o.slot_correct[k];
    slot_count[k] += o.slot_count[k];
  }
  accept_len_sum += o.accept_len_sum;
  blocks += o.blocks;
  dspark = dspark || o.dspark;
  dspark_ce_sum += o.dspark_ce_sum;
  dspark_l1_sum += o.dspark_l1_sum;
  dspark_bce_sum += o.dspark_bce_sum;
  dspark_acc_sum += o.dspark_acc_sum;
  domino = domino || o.domino;
  domino_final_ce_sum += o.domino_final_ce_sum;
  domino_base_ce_sum += o.domino_base_ce_sum;
}

void accumulate_metrics(ObjectiveMetrics& m, const BlockTargets& t, std::span<const int32_t> argmax,
                        std::span<const float> ce) {
  if (m.K == 0) m = ObjectiveMetrics(t.K);
  DFLASH_CHECK(m.K == t.K, "metrics of block size {} given targets of block size {}", m.K, t.K);
  DFLASH_CHECK(argmax.size() == t.labels.size(), "argmax has {} entries, targets {}",
               argmax.size(), t.labels.size());
  DFLASH_CHECK(ce.empty() || ce.size() == t.labels.size(), "ce has {} entries, targets {}",
               ce.size(), t.labels.size());
  const int K = t.K;
  const int64_t N = t.num_blocks();
  DFLASH_CHECK(t.first_slot == 0 || t.first_slot == 1, "targets' first slot is {} (0 or 1)",
               t.first_slot);
  for (int64_t b = 0; b < N; ++b) {
    bool leading = true;
    int accepted = 0;
    for (int k = t.first_slot; k < K; ++k) {
      const size_t i = static_cast<size_t>(b * K + k);
      const bool ok = t.counted[i] && argmax[i] == t.labels[i];
      if (t.counted[i]) {
        m.slot_count[k] += 1;
        m.slot_correct[k] += ok ? 1 : 0;
      }
      if (leading && ok) {
        ++accepted;
      } else {
        leading = false;
      }
      if (!ce.empty()) {
        m.loss_weighted_sum += static_cast<double>(t.weights[i]) * ce[i];
        m.weight_sum += t.weights[i];
      }
    }
    m.accept_len_sum += 1 + accepted;
    m.blocks += 1;
  }
}

}  // namespace dflash
