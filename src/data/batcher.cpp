// dflash.cpp — packing batcher (see batcher.hpp for the invariants).
#include "data/batcher.hpp"

#include <algorithm>
#include <charconv>
#include <numeric>

#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/rng.hpp"

namespace dflash {

std::vector<int64_t> deterministic_permutation(int64_t n, uint64_t seed, uint64_t stream) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  Rng rng(derive_seed(seed, {0x6461746121ull /* "data!" */, stream}));
  for (int64_t i = n - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

nlohmann::json DataCursor::to_json() const {
  return {{"seed", seed},
          {"epoch", epoch},
          {"batch", batch},
          {"dataset", fmt::format("{:016x}", dataset)},
          {"config", config}};
}

DataCursor DataCursor::from_json(const nlohmann::json& j) {
  const std::string src = "data cursor";
  DataCursor c;
  c.seed = json_uint(j, "seed", src);
  c.epoch = json_int(j, "epoch", src, 0);
  c.batch = json_int(j, "batch", src, 0);
  const std::string hex = json_string(j, "dataset", src);
  const char* end = hex.data() + hex.size();
  const auto [ptr, ec] = std::from_chars(hex.data(), end, c.dataset, 16);
  DFLASH_CHECK(hex.size() == 16 && ec == std::errc() && ptr == end,
               "data cursor: key 'dataset' must be 16 hex digits, got '{}'", hex);
  c.config = json_string(j, "config", src);
  return c;
}

Batcher::Batcher(TokenDataset data, BatcherOptions opts) : data_(std::move(data)), opts_(opts) {
  DFLASH_CHECK(opts_.token_budget > 0, "token budget must be positive (got {})",
               opts_.token_budget);
  DFLASH_CHECK(opts_.rows > 0, "rows per batch must be positive (got {})", opts_.rows);
  DFLASH_CHECK(opts_.num_shapes >= 1 && opts_.num_shapes <= 16,
               "number of batch shapes must be 1..16 (got {})", opts_.num_shapes);
  DFLASH_CHECK(opts_.window_rows >= 1, "packing window must be at least 1 row (got {})",
               opts_.window_rows);
  const int64_t div = int64_t{1} << (opts_.num_shapes - 1);
  DFLASH_CHECK(opts_.token_budget % div == 0,
               "token budget {} must be divisible by {} for {} shapes (budget/2^k)",
               opts_.token_budget, div, opts_.num_shapes);
  DFLASH_CHECK(data_.num_docs() > 0, "the dataset has no documents");
  DFLASH_CHECK(opts_.block_budget >= 0, "block budget must be >= 0 (got {})", opts_.block_budget);
  if (block_budget_binds()) {
    DFLASH_CHECK(static_cast<int64_t>(opts_.doc_blocks.size()) == data_.num_docs(),
                 "block budget {}: {} per-document block counts for {} documents",
                 opts_.block_budget, opts_.doc_blocks.size(), data_.num_docs());
    for (int64_t i = 0; i < data_.num_docs(); ++i) {
      const int32_t b = opts_.doc_blocks[static_cast<size_t>(i)];
      DFLASH_CHECK(b >= 0 && b <= opts_.block_budget,
                   "document {} (line {}) yields {} training blocks, outside [0, block budget "
                   "{}]: raise the block budget to at least the anchors per document",
                   i, data_.doc_source_line(i), b, opts_.block_budget);
    }
  }
  for (int k = 0; k < opts_.num_shapes; ++k) shapes_.push_back(opts_.token_budget >> k);
  for (int64_t i = 0; i < data_.num_docs(); ++i) {
    DFLASH_CHECK(data_.doc_length(i) <= opts_.token_budget,
                 "document {} (line {}) has {} tokens, more than the token budget {}: lower the "
                 "max length of the data or raise the budget",
                 i, data_.doc_source_line(i), data_.doc_length(i), opts_.token_budget);
  }
}

bool Batcher::block_budget_binds() const {
  return opts_.block_budget > 0 && opts_.block_budget < opts_.token_budget;
}

std::string Batcher::config_string() const {
  std::string s = fmt::format("budget={};rows={};shapes={};window={};pad={};sort={}",
                              opts_.token_budget, opts_.rows, opts_.num_shapes, opts_.window_rows,
                              opts_.pad_token, opts_.sort_by_length ? 1 : 0);
  // Only a budget that can bind changes the plan (so cursors of earlier runs stay valid).
  if (block_budget_binds()) s += fmt::format(";blocks={}", opts_.block_budget);
  return s;
}

void Batcher::plan_epoch(int64_t epoch) {
  if (planned_epoch_ == epoch) return;
  const uint64_t stream = static_cast<uint64_t>(epoch) * 2;
  const std::vector<int64_t> order =
      deterministic_permutation(data_.num_docs(), opts_.seed, stream);
  const int64_t budget = opts_.token_budget;
  const int64_t window_tokens = opts_.window_rows * budget;

  std::vector<Row> rows;
  size_t pos = 0;
  while (pos < order.size()) {
    // One window of documents in shuffled order.
    std::vector<int64_t> win;
    int64_t tokens = 0;
    while (pos < order.size() && (win.empty() || tokens < window_tokens)) {
      tokens += data_.doc_length(order[pos]);
      win.push_back(order[pos++]);
    }
    // First-fit in shuffled order, or first-fit decreasing (stable: equal lengths keep their
    // shuffled order).
    if (opts_.sort_by_length) {
      std::stable_sort(win.begin(), win.end(), [&](int64_t a, int64_t b) {
        return data_.doc_length(a) > data_.doc_length(b);
      });
    }
    const size_t first_row = rows.size();
    const bool bound = block_budget_binds();
    for (int64_t d : win) {
      const int64_t len = data_.doc_length(d);
      const int64_t blocks = bound ? opts_.doc_blocks[static_cast<size_t>(d)] : 0;
      auto fits = [&](const Row& row) {
        return row.used + len <= budget && (!bound || row.blocks + blocks <= opts_.block_budget);
      };
      size_t r = first_row;
      while (r < rows.size() && !fits(rows[r])) ++r;
      if (r == rows.size()) rows.emplace_back();
      rows[r].docs.push_back(d);
      rows[r].used += len;
      rows[r].blocks += blocks;
    }
  }
  // Group rows of similar fill into batches (so that short rows share the small shapes).
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return a.used > b.used; });
  std::vector<PlannedBatch> batches;
  for (size_t r = 0; r < rows.size(); r += static_cast<size_t>(opts_.rows)) {
    PlannedBatch b;
    int64_t fullest = 0;
    for (size_t k = r; k < std::min(rows.size(), r + static_cast<size_t>(opts_.rows)); ++k) {
      fullest = std::max(fullest, rows[k].used);
      b.rows.push_back(std::move(rows[k]));
    }
    b.rows.resize(static_cast<size_t>(opts_.rows));  // empty rows in the epoch's last batch
    b.length = shapes_[0];
    for (int64_t s : shapes_) {
      if (s >= fullest) b.length = s;
    }
    batches.push_back(std::move(b));
  }
  const std::vector<int64_t> border =
      deterministic_permutation(static_cast<int64_t>(batches.size()), opts_.seed, stream + 1);
  plan_.clear();
  plan_.reserve(batches.size());
  for (int64_t i : border) plan_.push_back(std::move(batches[static_cast<size_t>(i)]));
  planned_epoch_ = epoch;
}

int64_t Batcher::batches_in_epoch(int64_t epoch) {
  plan_epoch(epoch);
  return static_cast<int64_t>(plan_.size());
}

PackingStats Batcher::epoch_stats(int64_t epoch) {
  plan_epoch(epoch);
  PackingStats st;
  for (const auto& b : plan_) {
    ++st.batches;
    ++st.batches_per_shape[b.length];
    st.slots += b.length * opts_.rows;
    for (const auto& r : b.rows) {
      st.docs += static_cast<int64_t>(r.docs.size());
      st.tokens += r.used;
    }
  }
  return st;
}

Batch Batcher::batch_at(int64_t epoch, int64_t index) {
  plan_epoch(epoch);
  DFLASH_CHECK(index >= 0 && index < static_cast<int64_t>(plan_.size()),
               "batch {} is outside epoch {} ({} batches)", index, epoch, plan_.size());
  const PlannedBatch& pb = plan_[static_cast<size_t>(index)];
  const int64_t R = opts_.rows, L = pb.length;
  Batch b;
  b.epoch = epoch;
  b.index = index;
  b.row_length = L;
  b.tokens = Tensor::empty({R, L}, DType::i32);
  b.loss_mask = Tensor::zeros({R, L}, DType::boolean);
  b.positions = Tensor::zeros({R, L}, DType::i32);
  b.segments = Tensor::empty({R, L}, DType::i32);
  auto* tok = b.tokens.data<int32_t>();
  auto* msk = b.loss_mask.data<uint8_t>();
  auto* pos = b.positions.data<int32_t>();
  auto* seg = b.segments.data<int32_t>();
  std::fill(tok, tok + R * L, opts_.pad_token);
  std::fill(seg, seg + R * L, -1);
  b.row_doc_offsets.push_back(0);
  b.doc_offsets.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    int64_t col = 0;
    auto& offs = b.doc_offsets[static_cast<size_t>(r)];
    offs.push_back(0);
    for (int64_t d : pb.rows[static_cast<size_t>(r)].docs) {
      auto t = data_.doc_tokens(d);
      auto m = data_.doc_loss_mask(d);
      const auto len = static_cast<int64_t>(t.size());
      const int64_t base = r * L + col;
      const auto s = static_cast<int32_t>(b.docs.size());
      for (int64_t k = 0; k < len; ++k) {
        tok[base + k] = t[static_cast<size_t>(k)];
        msk[base + k] = m[static_cast<size_t>(k)];
        pos[base + k] = static_cast<int32_t>(k);
        seg[base + k] = s;
        b.n_supervised += m[static_cast<size_t>(k)];
      }
      b.docs.push_back(
          {static_cast<int32_t>(r), static_cast<int32_t>(col), static_cast<int32_t>(len), d});
      col += len;
      offs.push_back(static_cast<int32_t>(col));
      b.n_tokens += len;
    }
    DFLASH_ASSERT(col <= L);
    b.row_doc_offsets.push_back(static_cast<int32_t>(b.docs.size()));
  }
  b.n_docs = static_cast<int64_t>(b.docs.size());
  return b;
}

Batch Batcher::next() {
  if (batch_ >= batches_in_epoch(epoch_)) {
    ++epoch_;
    batch_ = 0;
  }
  Batch b = batch_at(epoch_, batch_);
  ++batch_;
  return b;
}

DataCursor Batcher::cursor() const {
  return DataCursor{opts_.seed, epoch_, batch_, data_.fingerprint(), config_string()};
}

void Batcher::restore(const DataCursor& c) {
  DFLASH_CHECK(c.dataset == data_.fingerprint(),
               "data cursor belongs to another dataset ({:016x}, this one is {:016x}): the data, "
               "tokenizer, template or max length changed since the checkpoint",
               c.dataset, data_.fingerprint());
  DFLASH_CHECK(c.seed == opts_.seed, "data cursor has seed {}, the run has seed {}", c.seed,
               opts_.seed);
  DFLASH_CHECK(c.config == config_string(),
               "data cursor was made with packing '{}', the run uses '{}'", c.config,
               config_string());
  DFLASH_CHECK(c.epoch >= 0 && c.batch >= 0 && c.batch <= batches_in_epoch(c.epoch),
               "data cursor points at batch {} of epoch {}, which has {} batches", c.batch, c.epoch,
               batches_in_epoch(c.epoch));
  epoch_ = c.epoch;
  batch_ = c.batch;
}

}  // namespace dflash
