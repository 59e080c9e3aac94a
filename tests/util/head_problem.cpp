// dflash.cpp — the CUDA head tests' shared set-up (head_problem.hpp).
#include "util/head_problem.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <utility>

#include "core/dtype.hpp"

namespace dflash::test {

DrafterConfig head_test_config(int64_t H, int64_t V, int K) {
  DrafterConfig c;
  c.hidden_size = H;
  c.intermediate_size = 32;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.vocab_size = V;
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 10000.0;
  c.block_size = K;
  c.mask_token_id = static_cast<int32_t>(V - 1);
  c.target_layer_ids = {0};
  c.num_target_layers = 2;
  return c;
}

std::vector<float> head_test_params(const DrafterLayout& layout, Rng& rng) {
  std::vector<float> params(static_cast<size_t>(layout.total));
  for (float& x : params) {
    x = bf16_bits_to_f32(f32_to_bf16_bits(static_cast<float>(0.3 * rng.normal())));
  }
  return params;
}

HeadTestRow head_test_row() {
  HeadTestRow r;
  r.docs = {0, 29, 47, 53};
  r.mask.assign(static_cast<size_t>(r.T()), 1);
  r.mask[9] = 0;
  for (int32_t a = 0; a + 1 < 29; a += 2) r.anchors.push_back({a, 0});
  for (int32_t a = 29; a + 1 < 47; a += 3) r.anchors.push_back({a, 1});
  r.anchors.push_back({48, 2});
  return r;
}

void head_test_append_row(DrafterBatch& batch, const std::vector<int32_t>& tokens,
                          const HeadTestRow& row, BlockTargets targets) {
  batch.append_row(tokens, row.docs, row.anchors, std::move(targets));
  batch.weight_sum = 0;
  for (float w : batch.targets.weights) batch.weight_sum += w;
  batch.validate();
}

HeadTestTargets head_test_targets(const DrafterBatch& batch, int64_t R) {
  HeadTestTargets t;
  t.labels.assign(static_cast<size_t>(R), -5);
  t.weights.assign(static_cast<size_t>(R), 0.0f);
  std::copy(batch.targets.labels.begin(), batch.targets.labels.end(), t.labels.begin());
  std::copy(batch.targets.weights.begin(), batch.targets.weights.end(), t.weights.begin());
  return t;
}

std::vector<float> head_test_slice(const std::vector<float>& v, int64_t offset, int64_t n) {
  return {v.begin() + offset, v.begin() + offset + n};
}

bool head_test_top_two_apart(const std::vector<float>& logits, int64_t row, int64_t V,
                             float margin) {
  std::vector<float> r(logits.begin() + row * V, logits.begin() + (row + 1) * V);
  std::partial_sort(r.begin(), r.begin() + 2, r.end(), std::greater<>());
  return !(r[0] - r[1] < margin);
}

void head_test_expect_zero_from(const std::vector<float>& v, int64_t from, const char* what) {
  for (auto j = static_cast<size_t>(from); j < v.size(); ++j) {
    ASSERT_EQ(v[j], 0.0f) << what << " element " << j;
  }
}

void head_test_expect_untouched_zero(const std::vector<float>& grads,
                                     const std::vector<uint8_t>& touched) {
  for (size_t j = 0; j < grads.size(); ++j) {
    if (!touched[j]) {
      ASSERT_EQ(grads[j], 0.0f) << "parameter element " << j;
    }
  }
}

}  // namespace dflash::test
