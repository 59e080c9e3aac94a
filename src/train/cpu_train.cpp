// dflash.cpp — the CPU backend of the step contract (train_backend.hpp): the reference path.
//
// Target stage: TargetModel::forward_taps over the batch's packed context (f32 features); for a
// DSpark drafter one forward gives the taps and the final norm's output (the teacher's input).
// Drafter stage: drafter_train_step<float> over the whole DrafterBatch (one packed sequence; equal
// to the sum over its rows, tests/drafter_batch_test.cpp), gradient norm in double in index order
// (sum_squares_cpu), AdamW of src/ops/adamw.hpp on fp32 master weights.
//
// Data parallelism: with a collective (several replicas), each replica computes the gradient of its
// batch's Σw·CE divided by the whole step's normaliser (DrafterBatch::loss_normaliser: Σw for
// dflash, the step's documents for the D-PACE losses), update() sums the
// replicas' gradients in rank order (train/collective.hpp), takes the norm of the sum and makes the
// skip decision together with the other replicas, so every replica applies the same update.
//
// Invariants: everything is computed synchronously on the calling thread (and parallel_for's
// workers), in a fixed order, so two runs from the same state give identical bits; the frozen
// tables are f32 copies owned by the drafter stage; step() allocates only inside its workspace,
// whose buffers keep their capacity. Any CPU target stage's features feed any CPU drafter stage
// (the target model is shared read-only between target stages).
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "model/target.hpp"
#include "train/train_backend.hpp"

namespace dflash {

namespace {

class CpuTargetStage;

// Features made by a CpuTargetStage: f32 [T, n_taps·H] in host memory, and for a DSpark drafter
// the target's final-norm hidden states [T, H] (DSpark's teacher).
class CpuTargetFeatures final : public TargetFeatures {
 public:
  CpuTargetFeatures(const CpuTargetStage* source, uint64_t batch, Tensor taps, Tensor final_norm)
      : source_(source), batch_(batch), taps_(std::move(taps)), final_(std::move(final_norm)) {}
  const CpuTargetStage* source() const { return source_; }
  uint64_t batch() const { return batch_; }  ///< DrafterBatch::fingerprint of their batch
  const Tensor& taps() const { return taps_; }
  Tensor& taps() { return taps_; }
  /// [T, H] for a DSpark drafter; undefined otherwise.
  const Tensor& final_norm() const { return final_; }
  Tensor& final_norm() { return final_; }

 private:
  const CpuTargetStage* source_;
  uint64_t batch_;
  Tensor taps_;
  Tensor final_;
};

class CpuTargetStage final : public TargetStage {
 public:
  CpuTargetStage(const TargetModel& target, std::vector<int> taps, bool final_norm)
      : target_(target), taps_(std::move(taps)), final_norm_(final_norm) {}

  std::unique_ptr<TargetFeatures> forward_taps(const DrafterBatch& batch) override {
    const int64_t H = target_.hidden_size();
    const int64_t F = static_cast<int64_t>(taps_.size()) * H;
    Tensor taps = Tensor::empty({0, F}, DType::f32);
    Tensor final_norm = final_norm_ ? Tensor::empty({0, H}, DType::f32) : Tensor();
    if (batch.T() > 0 && !final_norm_) {
      taps = target_.forward_taps(batch.tokens, batch.doc_offsets, taps_);
    } else if (batch.T() > 0) {
      // DSpark: the taps and the final norm's output of one forward (no logits).
      ForwardOptions o;
      o.tap_layers = taps_;
      o.logits = LogitsRows::none;
      o.final_norm = true;
      ForwardResult r = target_.forward(batch.tokens, batch.doc_offsets, o);
      taps = std::move(r.taps);
      final_norm = std::move(r.final_norm);
    }
    return std::make_unique<CpuTargetFeatures>(this, batch.fingerprint(), std::move(taps),
                                               std::move(final_norm));
  }

  void fill_nan(TargetFeatures& features) override {
    auto* f = dynamic_cast<CpuTargetFeatures*>(&features);
    DFLASH_CHECK(f != nullptr && f->source() == this,
                 "cpu target stage: fill_nan() of features another stage made");
    float* p = f->taps().data<float>();
    std::fill(p, p + f->taps().numel(), std::numeric_limits<float>::quiet_NaN());
  }

 private:
  const TargetModel& target_;
  std::vector<int> taps_;
  bool final_norm_;  // also the final norm's output (a DSpark drafter's teacher)
};

class CpuDrafterStage final : public DrafterStage {
 public:
  CpuDrafterStage(const TrainBackendOptions& opts, const TargetModel& target,
                  const DrafterConfig& cfg, const DrafterLayout& layout,
                  std::unique_ptr<Collective> collective)
      : cfg_(cfg),
        layout_(layout),
        adam_(opts.adam),
        clip_grad_norm_(opts.clip_grad_norm),
        collective_(std::move(collective)),
        embed_(target.embedding_f32()),
        head_(target.config().tie_word_embeddings ? std::vector<float>() : target.lm_head_f32()) {
    const auto n = static_cast<size_t>(layout.total);
    state_.params.assign(n, 0.0f);
    state_.adam_m.assign(n, 0.0f);
    state_.adam_v.assign(n, 0.0f);
    grads_.assign(n, 0.0f);
    tables_ = {embed_.data(), head_.empty() ? embed_.data() : head_.data()};
  }

  void step(const DrafterBatch& batch, const TargetFeatures& features) override {
    DFLASH_CHECK(!queue_.waiting_for_update(),
                 "cpu drafter stage: step() called twice without update() in between");
    DFLASH_CHECK(batch.block_size == cfg_.block_size,
                 "cpu drafter stage: a batch of block size {} for a drafter of block size {}",
                 batch.block_size, cfg_.block_size);
    const auto* f = dynamic_cast<const CpuTargetFeatures*>(&features);
    DFLASH_CHECK(f != nullptr,
                 "cpu drafter stage: the features come from another backend's target stage");
    DFLASH_CHECK(f->batch() == batch.fingerprint(),
                 "cpu drafter stage: the features were computed for another batch");
    const int64_t F = cfg_.n_taps() * cfg_.hidden_size;
    DFLASH_CHECK(
        f->taps().dtype() == DType::f32 && f->taps().dim(0) == batch.T() && f->taps().dim(1) == F,
        "cpu drafter stage: features {} for a batch of {} tokens and {} tap columns",
        shape_str(f->taps().shape()), batch.T(), F);
    const float* target_final = nullptr;
    if (cfg_.dspark.enabled && batch.T() > 0) {
      const Tensor& fin = f->final_norm();
      DFLASH_CHECK(fin.defined() && fin.dtype() == DType::f32 && fin.dim(0) == batch.T() &&
                       fin.dim(1) == cfg_.hidden_size,
                   "cpu drafter stage: a DSpark step needs the target's final hidden states "
                   "[{}, {}], the features have {}",
                   batch.T(), cfg_.hidden_size,
                   fin.defined() ? shape_str(fin.shape()) : std::string("none"));
      target_final = fin.data<float>();
    }
    DrafterStepResult r;
    r.metrics = ObjectiveMetrics(cfg_.block_size);
    // A step without a supervised slot is one on every replica alike: all of them skip, none
    // all-reduces.
    if (!batch.step_supervises()) {
      r.skip = StepSkip::no_supervised_slot;
      queue_.stepped(std::move(r));
      return;
    }
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    if (batch.weight_sum > 0) {  // else: this replica's batch adds nothing to the step's gradient
      const DrafterTrainResult out = drafter_train_step<float>(
          cfg_, layout_, state_.params.data(), grads_.data(), tables_, batch,
          f->taps().data<float>(), 1.0 / batch.loss_normaliser(), ws_, target_final);
      accumulate_metrics(r.metrics, batch.targets, out.argmax, {});
      r.metrics.loss_weighted_sum = out.loss_sum;
      r.metrics.weight_sum = out.weight_sum;
      r.metrics.dspark_ce_sum = out.dspark_ce_sum;
      r.metrics.dspark_l1_sum = out.dspark_l1_sum;
      r.metrics.dspark_bce_sum = out.dspark_bce_sum;
      r.metrics.dspark_acc_sum = out.dspark_acc_sum;
      r.metrics.domino_final_ce_sum = out.domino_final_ce_sum;
      r.metrics.domino_base_ce_sum = out.domino_base_ce_sum;
    }
    r.metrics.dspark = batch.objective.dspark();
    r.metrics.domino = batch.objective.domino();
    // D-PACE's loss is divided by the sequences, this batch's documents (supervised or not).
    if (batch.objective.dpace()) r.metrics.weight_sum = batch.loss_denominator();
    if (!collective_) r.grad_norm = std::sqrt(sum_squares_cpu(grads_.data(), layout_.total));
    queue_.stepped(std::move(r));
  }

  void update(double lr) override {
    DrafterStepResult r = queue_.take_stepped();
    bool peer_non_finite = false;
    if (collective_ && !r.skipped()) {
      collective_->all_reduce_sum(grads_.data(), layout_.total);
      r.grad_norm = std::sqrt(sum_squares_cpu(grads_.data(), layout_.total));
      peer_non_finite = replicas_non_finite(*collective_, r);
    }
    if (step_decide_update(r, clip_grad_norm_, peer_non_finite)) {
      state_.updates += 1;
      adamw_step_cpu(state_.params.data(), state_.adam_m.data(), state_.adam_v.data(),
                     grads_.data(), layout_.total, adam_, lr, state_.updates, r.clip);
    }
    queue_.finish(std::move(r));
  }

  DrafterStepResult result() override { return queue_.pop(); }

  void save_state(DrafterState& out) override {
    DFLASH_CHECK(!queue_.waiting_for_update(),
                 "cpu drafter stage: save_state() between step() and update()");
    out = state_;
  }

  void load_state(const DrafterState& in) override {
    DFLASH_CHECK(!queue_.waiting_for_update(),
                 "cpu drafter stage: load_state() between step() and update()");
    drafter_state_check(in, layout_.total);
    state_ = in;
  }

  void inject_nan() override { queue_.poison_next(); }

 private:
  DrafterConfig cfg_;
  DrafterLayout layout_;
  AdamWConfig adam_;
  double clip_grad_norm_;
  std::unique_ptr<Collective> collective_;  // null: a single replica
  std::vector<float> embed_, head_;  // f32 copies of the frozen tables (head_ empty when tied)
  DrafterTables<float> tables_;
  DrafterState state_;
  std::vector<float> grads_;
  DrafterWorkspace<float> ws_;
  StepQueue queue_;
};

void check_sizes(const TargetModel& target, const DrafterConfig& cfg) {
  cfg.validate();
  DFLASH_CHECK(cfg.hidden_size == target.hidden_size() && cfg.vocab_size == target.vocab_size(),
               "cpu backend: a drafter of hidden size {} and vocabulary {} for a target of {} and "
               "{}",
               cfg.hidden_size, cfg.vocab_size, target.hidden_size(), target.vocab_size());
}

}  // namespace

std::unique_ptr<TargetStage> cpu_target_stage_create(const TargetModel& target,
                                                     const DrafterConfig& cfg) {
  check_sizes(target, cfg);
  return std::make_unique<CpuTargetStage>(target, cfg.target_layer_ids, cfg.dspark.enabled);
}

std::unique_ptr<DrafterStage> cpu_drafter_stage_create(const TrainBackendOptions& opts,
                                                       const TargetModel& target,
                                                       const DrafterConfig& cfg,
                                                       const DrafterLayout& layout,
                                                       std::unique_ptr<Collective> collective) {
  check_sizes(target, cfg);
  return std::make_unique<CpuDrafterStage>(opts, target, cfg, layout, std::move(collective));
}

TrainBackend cpu_train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                      const DrafterConfig& cfg, const DrafterLayout& layout) {
  TrainBackend b;
  b.target = cpu_target_stage_create(target, cfg);
  b.drafter = cpu_drafter_stage_create(opts, target, cfg, layout, nullptr);
  b.description = fmt::format("cpu, {} threads", parallel_threads());
  return b;
}

}  // namespace dflash
