// dflash.cpp — the CUDA stages of the pipeline's workers (train/pipeline.hpp): a target stage and a
// drafter stage per worker, each with a CudaContext of its own (stream, cuBLASLt handle,
// allocator, GEMM plans, graphs) and an arena on its GPU, made and driven by the worker's thread.
// Several stages may share one GPU (colocated workers, or several drafter replicas on one GPU).
//
// Memory: each stage allocates ONE arena from its worker's plan (train/memory_plan.hpp:
// plan_target_worker_memory, plan_drafter_worker_memory; the trainer checked that the plans of the
// workers sharing a GPU fit it together) and takes every device buffer from it by name, op scratch
// included (the context's allocator pool); a planned buffer left untaken is an error.
//
// Target stage: stages the batch's context (drafter_batch_stage_context) into pinned buffers, runs
// TargetCuda::forward_taps (one CUDA graph per context length and, with the cuDNN prefill of
// runtime.target_prefill, per bucket of documents: cuda_target_prefill_select) into a fixed taps
// buffer, copies the
// taps into a free buffer of its feature pool and waits for the stream: the features it returns are
// complete. A pool buffer goes back to the pool when its CudaFeatures object is destroyed (on any
// thread). The pool holds opts.feature_buffers buffers, as many as the pipeline can have alive
// (train/trainer.cpp sizes it), so a forward never waits for one; running out is an error.
//
// Drafter stage: its own bf16 copies of the target's embedding and LM head, a DrafterCuda, pinned
// staging of the block rows (drafter_batch_stage); step() copies the features into the drafter's
// feature buffer (cudaMemcpyPeerAsync: a peer copy when the GPUs allow it, else the driver stages
// it through host memory; a plain device copy on the same GPU), enqueues the forward/backward (one
// graph per (context length, block rows) shape) and reads the results back. With several replicas,
// update() all-reduces the gradient on the device (train/collective_cuda.cpp), recomputes its norm
// and shares the skip decision, then runs AdamW with the factor clip/normaliser of the whole step
// (DrafterBatch::loss_normaliser: Σw, or the step's sequences for the D-PACE losses).
//
// Invariants: the step math is CudaTrainBackend's (same kernels, same padding: context rows·L,
// block rows a multiple of kBlockRowsMultiple blocks), gradients computed unscaled and scaled in
// AdamW; the D-PACE losses (DrafterCudaInputs::objective) run only here, one loss per run. A
// CudaTargetStage outlives every CudaFeatures it made (the pipeline releases a target worker only
// after every queue is drained and every drafter has left its loop).
#include <memory>

#include "core/error.hpp"
#include "train/train_backend.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/graph.hpp"
#include "backend/cuda/pinned.hpp"
#include "core/dtype.hpp"
#include "model/dflash2_head_cuda.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/drafter_cuda.hpp"
#include "model/dspark_head_cuda.hpp"
#include "model/step_plan.hpp"
#include "model/target_cuda.hpp"
#include "train/cuda_train.hpp"
#include "train/memory_plan.hpp"

namespace dflash {

namespace {

constexpr size_t kBf16 = 2;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::optional<DeviceMemory> memory_of_current_device() {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  return DeviceMemory{total - free, total};
}

// bf16 bits of a float tensor (as stored when bf16, rounded to nearest even otherwise), uploaded
// into the arena's buffer `name`.
const uint16_t* upload_bf16_table(cuda::DeviceArena& arena, const char* name, const Tensor& t) {
  std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::bf16) {
    std::copy_n(t.data<uint16_t>(), bits.size(), bits.begin());
  } else {
    const std::vector<float> f = t.to_f32_vector();
    for (size_t i = 0; i < f.size(); ++i) bits[i] = f32_to_bf16_bits(f[i]);
  }
  void* b = arena.get_bytes(name, bits.size() * kBf16);
  DFLASH_CUDA_CHECK(cudaMemcpy(b, bits.data(), bits.size() * kBf16, cudaMemcpyHostToDevice));
  return static_cast<const uint16_t*>(b);
}

// Context rows of a batch on the device: its rows·L (the batcher's shape), as CudaTrainBackend.
int64_t context_rows(const DrafterBatch& b) {
  return b.rows * b.row_length;
}

// Block rows of a batch on the device: its blocks padded to a multiple of kBlockRowsMultiple.
int64_t block_rows(const DrafterBatch& b) {
  return padded_block_rows(b.N(), b.block_size);
}

// One staged input: the arena's buffer `name` and its pinned host twin (copies from it can be
// captured).
struct Staged {
  Staged() = default;
  Staged(cuda::DeviceArena& arena, const char* name, size_t bytes)
      : dev(arena.get_bytes(name, bytes)), host(bytes) {}
  void upload(cudaStream_t s, size_t bytes) const {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dev, host.as<void>(), bytes, cudaMemcpyHostToDevice, s));
  }
  template <typename T>
  T* device() const {
    return static_cast<T*>(dev);
  }
  void* dev = nullptr;
  cuda::PinnedBuffer host;
};

// Hands the arena's "workspace.op_scratch" to the context's allocator (every op's scratch comes
// from it) and checks that every planned buffer was taken.
void arena_finish(cuda::CudaContext& ctx, cuda::DeviceArena& a, const char* stage) {
  const char* pool = "workspace.op_scratch";
  const uint64_t pool_bytes = a.planned_bytes(pool);
  ctx.allocator().use_pool(a.get_bytes(pool, pool_bytes), pool_bytes);
  const std::vector<std::string> unused = a.untaken();
  DFLASH_CHECK(unused.empty(),
               "memory plan: {} planned buffers are not used by the {} (e.g. '{}'): the plan and "
               "the code disagree",
               unused.size(), stage, unused.empty() ? "" : unused.front());
}

class CudaTargetStage;

// Features of a CudaTargetStage (see the file comment).
class CudaFeatures final : public TargetFeatures {
 public:
  CudaFeatures(CudaTargetStage* owner, int slot, const uint16_t* data, int device, int64_t rows,
               int64_t cols, uint64_t batch)
      : owner(owner),
        slot(slot),
        data(data),
        device(device),
        rows(rows),
        cols(cols),
        batch(batch) {}
  ~CudaFeatures() override;
  CudaTargetStage* owner;
  int slot;
  const uint16_t* data;  ///< [rows, cols] bf16 on `device`
  int device;
  int64_t rows, cols;
  uint64_t batch;  ///< DrafterBatch::fingerprint
};

class CudaTargetStage final : public TargetStage {
 public:
  // `plan`: plan_target_worker_memory of this worker, `buffers` its feature buffers.
  CudaTargetStage(int device, const TargetModel& model, const DrafterConfig& cfg,
                  const TrainMemoryPlan& plan, bool graphs, int64_t buffers, TargetPrefill prefill)
      : taps_(cfg.target_layer_ids),
        block_size_(cfg.block_size),
        tap_cols_(cfg.n_taps() * cfg.hidden_size),
        cols_(drafter_feature_cols(cfg)),
        max_ctx_(plan.T),
        use_graphs_(graphs) {
    DFLASH_CHECK(buffers >= 1, "cuda target stage: {} feature buffers", buffers);
    ctx_ = std::make_unique<cuda::CudaContext>(device);
    arena_ = std::make_unique<cuda::DeviceArena>(*ctx_, plan.arena);
    cuda::DeviceArena& a = *arena_;
    target_ = std::make_unique<TargetCuda>(*ctx_, model, plan.T, plan.target_layers, &a);
    if (prefill == TargetPrefill::cudnn) cuda_target_use_cudnn(*target_);
    if (cfg.dspark.enabled) {  // the teacher's final norm (features: taps, then its rows)
      const std::vector<float>& w = model.final_norm_weight();
      final_norm_ = a.get<float>(kTargetFinalNorm, static_cast<int64_t>(w.size()));
      DFLASH_CUDA_CHECK(
          cudaMemcpy(final_norm_, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    const auto T = static_cast<size_t>(plan.T);
    tokens_ = Staged(a, "inputs.tokens", T * sizeof(int32_t));
    pos_ = Staged(a, "inputs.pos", T * sizeof(int32_t));
    ranges_ = Staged(a, "inputs.target_ranges", T * sizeof(AttnRange));
    const size_t features = T * static_cast<size_t>(cols_);
    taps_out_ = a.get<uint16_t>(kTargetOnlyFeatures, static_cast<int64_t>(features));
    for (int64_t i = 0; i < buffers; ++i) {
      const std::string name = fmt::format("taps.pool.{}", i);
      pool_.push_back(a.get<uint16_t>(name, static_cast<int64_t>(features)));
      free_.push_back(static_cast<int>(i));
    }
    arena_finish(*ctx_, a, "cuda target stage");
    ev_start_ = ctx_->new_event(true);
    ev_end_ = ctx_->new_event(true);
  }

  std::unique_ptr<TargetFeatures> forward_taps(const DrafterBatch& b) override {
    DFLASH_CHECK(b.block_size == block_size_,
                 "cuda target stage: a batch of block size {} for a drafter of block size {}",
                 b.block_size, block_size_);
    const int64_t T = context_rows(b);
    DFLASH_CHECK(T > 0 && T <= max_ctx_,
                 "cuda target stage: a step of {} rows of {} tokens exceeds the planned {} tokens",
                 b.rows, b.row_length, max_ctx_);
    const auto Ts = static_cast<size_t>(T);
    const int64_t docs = drafter_batch_stage_context(b, 0, {tokens_.host.as<int32_t>(), Ts},
                                                     {pos_.host.as<int32_t>(), Ts},
                                                     {ranges_.host.as<AttnRange>(), Ts});
    const int64_t bucket = cuda_target_prefill_select(*target_, docs, b.row_length);
    const int slot = acquire();
    cudaStream_t s = ctx_->stream();
    auto enqueue = [&] {
      tokens_.upload(s, T * sizeof(int32_t));
      pos_.upload(s, T * sizeof(int32_t));
      ranges_.upload(s, T * sizeof(AttnRange));
      if (final_norm_) {
        target_->forward_taps_final(taps_out_, taps_out_ + T * tap_cols_, final_norm_,
                                    tokens_.device<int32_t>(), pos_.device<int32_t>(),
                                    ranges_.device<AttnRange>(), T, taps_);
      } else {
        target_->forward_taps(taps_out_, tokens_.device<int32_t>(), pos_.device<int32_t>(),
                              ranges_.device<AttnRange>(), T, taps_);
      }
    };
    float ms = 0;
    try {
      DFLASH_CUDA_CHECK(cudaEventRecord(ev_start_, s));
      if (use_graphs_) {
        graphs_.run(std::pair<int64_t, int64_t>(T, bucket), s, enqueue);
      } else {
        enqueue();
      }
      const size_t bytes = Ts * static_cast<size_t>(cols_) * kBf16;
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(pool_[static_cast<size_t>(slot)], taps_out_, bytes,
                                        cudaMemcpyDeviceToDevice, s));
      DFLASH_CUDA_CHECK(cudaEventRecord(ev_end_, s));
      ctx_->synchronize();  // the staging buffers are reused next time; the features are complete
      DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, ev_start_, ev_end_));
    } catch (...) {
      release(slot);
      throw;
    }
    auto f = std::make_unique<CudaFeatures>(this, slot, pool_[static_cast<size_t>(slot)],
                                            ctx_->device(), T, cols_, b.fingerprint());
    f->device_s = ms * 1e-3;  // the forward and the copy into the pool
    return f;
  }

  void fill_nan(TargetFeatures& features) override {
    auto* f = dynamic_cast<CudaFeatures*>(&features);
    DFLASH_CHECK(f != nullptr && f->owner == this,
                 "cuda target stage: fill_nan() of features another stage made");
    const size_t bytes = static_cast<size_t>(f->rows * f->cols) * kBf16;
    DFLASH_CUDA_CHECK(cudaMemsetAsync(pool_[static_cast<size_t>(f->slot)], 0xFF, bytes,
                                      ctx_->stream()));  // bf16 0xFFFF is a NaN
    ctx_->synchronize();
  }

  std::optional<DeviceMemory> device_memory() const override { return memory_of_current_device(); }

  // A pool buffer comes back (any thread).
  void release(int slot) {
    std::lock_guard<std::mutex> lk(pool_mu_);
    free_.push_back(slot);
  }

 private:
  int acquire() {
    std::lock_guard<std::mutex> lk(pool_mu_);
    DFLASH_CHECK(!free_.empty(),
                 "cuda target stage: all {} feature buffers are in use (internal error: the "
                 "pipeline holds more features than it planned)",
                 pool_.size());
    const int slot = free_.back();
    free_.pop_back();
    return slot;
  }

  std::unique_ptr<cuda::CudaContext> ctx_;
  std::unique_ptr<cuda::DeviceArena> arena_;  // every device buffer below
  std::unique_ptr<TargetCuda> target_;
  std::vector<int> taps_;
  int block_size_;
  int64_t tap_cols_, cols_, max_ctx_;  // the taps' columns, the features' (drafter_feature_cols)
  float* final_norm_ = nullptr;        // DSpark: the target's final-norm weight [H]
  bool use_graphs_;
  Staged tokens_, pos_, ranges_;
  uint16_t* taps_out_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_end_ = nullptr;     // around a forward (owned by ctx_)
  cuda::GraphCache<std::pair<int64_t, int64_t>> graphs_;  // by (T, document bucket)
  std::vector<uint16_t*> pool_;
  std::mutex pool_mu_;
  std::vector<int> free_;
};

CudaFeatures::~CudaFeatures() {
  owner->release(slot);
}

class CudaDrafterStage final : public DrafterStage {
 public:
  // `plan`: plan_drafter_worker_memory of this worker.
  CudaDrafterStage(int device, const TargetModel& model, const DrafterConfig& cfg,
                   const DrafterLayout& layout, const TrainMemoryPlan& plan, bool graphs,
                   const AdamWConfig& adam, double clip,
                   const std::shared_ptr<CollectiveGroup>& group, int replica)
      : cfg_(cfg),
        params_(layout.total),
        max_ctx_(plan.T),
        max_rows_(plan.NK),
        use_graphs_(graphs),
        adam_(adam),
        clip_grad_norm_(clip) {
    ctx_ = std::make_unique<cuda::CudaContext>(device);
    arena_ = std::make_unique<cuda::DeviceArena>(*ctx_, plan.arena);
    cuda::DeviceArena& a = *arena_;
    const uint16_t* embed = upload_bf16_table(a, kDrafterWorkerEmbed, model.embed_tokens());
    const bool tied = model.config().tie_word_embeddings;
    const uint16_t* head =
        tied ? embed : upload_bf16_table(a, kDrafterWorkerLmHead, model.lm_head());
    drafter_ = std::make_unique<DrafterCuda>(*ctx_, cfg, layout, max_ctx_, max_rows_, embed, head,
                                             &a, kDrafterCeChunkRows, plan.activations);
    const auto T = static_cast<size_t>(max_ctx_), NK = static_cast<size_t>(max_rows_);
    tokens_.resize(T);
    context_ranges_.resize(T);
    pos_ = Staged(a, "inputs.pos", (T + NK) * sizeof(int32_t));
    block_tokens_ = Staged(a, "inputs.block_tokens", NK * sizeof(int32_t));
    block_ranges_ = Staged(a, "inputs.block_ranges", NK * sizeof(AttnRange));
    labels_ = Staged(a, "inputs.labels", NK * sizeof(int32_t));
    weights_ = Staged(a, "inputs.weights", NK * sizeof(float));
    if (cfg.dspark.enabled) {
      dspark_prev_ = Staged(a, kInputDsparkPrev, NK * sizeof(int32_t));
      dspark_tpos_ = Staged(a, kInputDsparkTeacherPos, NK * sizeof(int32_t));
      dspark_order_ = Staged(a, kInputDsparkW1Order, NK * sizeof(int32_t));
      dspark_seg_ = Staged(a, kInputDsparkW1Seg, (NK + 1) * sizeof(int32_t));
    }
    if (cfg.domino.enabled) {
      domino_tok_ = Staged(a, kInputDominoGruTok, NK * sizeof(int32_t));
      domino_lambda_ = Staged(a, kInputDominoLambda, sizeof(double));
    }
    if (cfg.dflash2.enabled) {
      dflash2_prev_ = Staged(a, kInputDflash2Prev, NK * sizeof(int32_t));
      dflash2_alpha_ = Staged(a, kInputDflash2Alpha, sizeof(double));
    }
    arena_finish(*ctx_, a, "cuda drafter stage");
    if (group) collective_ = cuda_collective_member(group, replica, ctx_->stream());
    for (cudaEvent_t* e : {&ev_step_start_, &ev_step_end_, &ev_opt_start_, &ev_opt_end_}) {
      *e = ctx_->new_event(true);
    }
  }

  void step(const DrafterBatch& b, const TargetFeatures& features) override {
    DFLASH_CHECK(!queue_.waiting_for_update(),
                 "cuda drafter stage: step() called twice without update() in between");
    // The loss is part of the captured step graphs: one per run. Domino's λ and DFlash2's α_sel
    // change per step and are read on the device (staged with the step's inputs), so they are not
    // part of it; every other field (kind, loss, D-PACE's γ, DSpark's weights, stop_gradient) is.
    if (!objective_) objective_ = b.objective;
    Objective fixed = b.objective;
    fixed.domino_lambda = objective_->domino_lambda;
    fixed.dflash2_selector_alpha = objective_->dflash2_selector_alpha;
    DFLASH_CHECK(fixed == *objective_,
                 "cuda drafter stage: a batch with objective {} (loss {}) after batches with "
                 "objective {} (loss {}): one objective per run",
                 objective_kind_name(b.objective.kind), loss_type_name(b.objective.loss),
                 objective_kind_name(objective_->kind), loss_type_name(objective_->loss));
    DFLASH_CHECK(b.block_size == cfg_.block_size,
                 "cuda drafter stage: a batch of block size {} for a drafter of block size {}",
                 b.block_size, cfg_.block_size);
    const auto* f = dynamic_cast<const CudaFeatures*>(&features);
    DFLASH_CHECK(f != nullptr,
                 "cuda drafter stage: the features come from another backend's target stage");
    DFLASH_CHECK(f->batch == b.fingerprint(),
                 "cuda drafter stage: the features were computed for another batch");
    const int64_t T = context_rows(b), NK = block_rows(b);
    DFLASH_CHECK(f->rows == T && f->cols == drafter_feature_cols(cfg_),
                 "cuda drafter stage: features [{}, {}] for {} context rows and {} feature columns",
                 f->rows, f->cols, T, drafter_feature_cols(cfg_));
    DFLASH_CHECK(
        T <= max_ctx_ && NK <= max_rows_,
        "cuda drafter stage: a step of {} context and {} block rows exceeds the planned {} "
        "and {}",
        T, NK, max_ctx_, max_rows_);
    DrafterStepResult r;
    r.metrics = ObjectiveMetrics(cfg_.block_size);
    if (!b.step_supervises()) {  // the same on every replica: all skip, none all-reduces
      r.skip = StepSkip::no_supervised_slot;
      queue_.stepped(std::move(r));
      return;
    }
    pending_scale_ = 1.0 / b.loss_normaliser();
    // D-PACE's loss is divided by the sequences, this batch's documents (supervised or not).
    if (b.objective.dpace()) r.metrics.weight_sum = b.loss_denominator();
    if (!(b.weight_sum > 0)) {
      // This replica's share adds nothing to the step's gradient (e.g. the empty row of an
      // epoch's last batch): a zero gradient joins the all-reduce, as on the CPU stage.
      DFLASH_CUDA_CHECK(cudaMemsetAsync(
          drafter_->grads(), 0, static_cast<size_t>(params_) * sizeof(float), ctx_->stream()));
      queue_.stepped(std::move(r));
      return;
    }
    stage(b, T, NK);
    cudaStream_t s = ctx_->stream();
    const size_t bytes = static_cast<size_t>(T * f->cols) * kBf16;
    check_peer(f->device);
    DFLASH_CUDA_CHECK(
        cudaMemcpyPeerAsync(drafter_->features(), ctx_->device(), f->data, f->device, bytes, s));
    auto enqueue = [&] { enqueue_step(T, NK); };
    DFLASH_CUDA_CHECK(cudaEventRecord(ev_step_start_, s));
    if (use_graphs_) {
      graphs_.run(std::pair<int64_t, int64_t>(T, NK), s, enqueue);
    } else {
      enqueue();
    }
    DFLASH_CUDA_CHECK(cudaEventRecord(ev_step_end_, s));
    // Synchronises the stream: the feature copy is complete when step() returns.
    const auto wait0 = std::chrono::steady_clock::now();
    const DrafterCuda::Results res = drafter_->fetch_results(NK);
    r.host_wait_s = seconds_since(wait0);
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, ev_step_start_, ev_step_end_));
    r.drafter_device_s = ms * 1e-3;  // forward, CE and backward (the feature copy before it)
    const size_t real_rows = static_cast<size_t>(b.N()) * static_cast<size_t>(cfg_.block_size);
    accumulate_metrics(r.metrics, b.targets, std::span<const int32_t>(res.argmax.data(), real_rows),
                       {});
    r.metrics.loss_weighted_sum = res.loss_sum;
    r.metrics.dspark = b.objective.dspark();
    r.metrics.domino = b.objective.domino();
    r.metrics.domino_final_ce_sum = res.domino_final_ce_sum;
    r.metrics.domino_base_ce_sum = res.domino_base_ce_sum;
    r.metrics.dspark_ce_sum = res.dspark_ce_sum;
    r.metrics.dspark_l1_sum = res.dspark_l1_sum;
    r.metrics.dspark_bce_sum = res.dspark_bce_sum;
    r.metrics.dspark_acc_sum = res.dspark_acc_sum;
    r.metrics.weight_sum = b.objective.dpace() ? b.loss_denominator() : res.weight_sum;
    if (!collective_) r.grad_norm = res.grad_norm * pending_scale_;
    queue_.stepped(std::move(r));
  }

  void update(double lr) override {
    DrafterStepResult r = queue_.take_stepped();
    bool peer_non_finite = false;
    if (collective_ && !r.skipped()) {
      collective_->all_reduce_sum(drafter_->grads(), params_);
      r.grad_norm = drafter_->grad_norm() * pending_scale_;
      peer_non_finite = replicas_non_finite(*collective_, r);
    }
    if (step_decide_update(r, clip_grad_norm_, peer_non_finite)) {
      updates_ += 1;
      cudaStream_t s = ctx_->stream();
      DFLASH_CUDA_CHECK(cudaEventRecord(ev_opt_start_, s));
      const auto wait0 = std::chrono::steady_clock::now();
      drafter_->adamw(adam_, lr, updates_, r.clip * pending_scale_);  // waits for the device
      DFLASH_CUDA_CHECK(cudaEventRecord(ev_opt_end_, s));
      DFLASH_CUDA_CHECK(cudaEventSynchronize(ev_opt_end_));
      float ms = 0;
      DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, ev_opt_start_, ev_opt_end_));
      r.optimizer_device_s = ms * 1e-3;
      r.host_wait_s = r.host_wait_s.value_or(0.0) + seconds_since(wait0);
    }
    queue_.finish(std::move(r));
  }

  DrafterStepResult result() override { return queue_.pop(); }

  void save_state(DrafterState& out) override {
    DFLASH_CHECK(!queue_.waiting_for_update(),
                 "cuda drafter stage: save_state() between step() and update()");
    const auto n = static_cast<size_t>(params_);
    out.params.resize(n);
    out.adam_m.resize(n);
    out.adam_v.resize(n);
    drafter_->download_state(out.params, out.adam_m, out.adam_v);
    out.updates = updates_;
  }

  void load_state(const DrafterState& in) override {
    DFLASH_CHECK(!queue_.waiting_for_update(),
                 "cuda drafter stage: load_state() between step() and update()");
    drafter_state_check(in, params_);
    drafter_->upload_state(in.params, in.adam_m, in.adam_v);
    updates_ = in.updates;
  }

  void inject_nan() override { queue_.poison_next(); }

  std::optional<DeviceMemory> device_memory() const override { return memory_of_current_device(); }

  std::string summary() const override {
    std::string s =
        use_graphs_
            ? fmt::format("cuda drafter: {} step shapes captured as CUDA graphs", graphs_.size())
            : std::string("cuda drafter: CUDA graphs off");
    for (const auto& [device, how] : peers_) {
      s += fmt::format("; features from GPU {}: {}", device, how);
    }
    if (collective_) s += "; collective " + collective_->describe();
    return s;
  }

 private:
  // The block rows (and the positions of all rows) into the pinned buffers.
  void stage(const DrafterBatch& b, int64_t T, int64_t NK) {
    const auto Ts = static_cast<size_t>(T), NKs = static_cast<size_t>(NK);
    DrafterStaging st;
    st.tokens = {tokens_.data(), Ts};
    st.context_ranges = {context_ranges_.data(), Ts};
    st.positions = {pos_.host.as<int32_t>(), Ts + NKs};
    st.block_tokens = {block_tokens_.host.as<int32_t>(), NKs};
    st.block_ranges = {block_ranges_.host.as<AttnRange>(), NKs};
    st.labels = {labels_.host.as<int32_t>(), NKs};
    st.weights = {weights_.host.as<float>(), NKs};
    drafter_batch_stage(b, cfg_.mask_token_id, 0, st);
    if (cfg_.domino.enabled) {
      const DominoRowIndex x = domino_row_index(cfg_, b, NK);
      std::memcpy(domino_tok_.host.as<int32_t>(), x.gru_tok.data(), NKs * sizeof(int32_t));
      std::memcpy(domino_lambda_.host.as<double>(), &x.lambda, sizeof(double));
    }
    if (cfg_.dflash2.enabled) {  // teacher-forced predecessors; α_sel read on the device
      const std::vector<int32_t> prev = dflash2_prev_tokens(b, NK, cfg_.vocab_size);
      const double alpha = b.objective.dflash2_selector_alpha;
      std::memcpy(dflash2_prev_.host.as<int32_t>(), prev.data(), NKs * sizeof(int32_t));
      std::memcpy(dflash2_alpha_.host.as<double>(), &alpha, sizeof(double));
    }
    if (!cfg_.dspark.enabled) return;
    const DsparkRowIndex x = dspark_row_index(b, NK, cfg_.vocab_size);
    std::memcpy(dspark_prev_.host.as<int32_t>(), x.prev.data(), NKs * sizeof(int32_t));
    std::memcpy(dspark_tpos_.host.as<int32_t>(), x.teacher_pos.data(), NKs * sizeof(int32_t));
    std::memcpy(dspark_order_.host.as<int32_t>(), x.w1_order.data(), NKs * sizeof(int32_t));
    std::memcpy(dspark_seg_.host.as<int32_t>(), x.w1_seg.data(), (NKs + 1) * sizeof(int32_t));
  }

  void enqueue_step(int64_t T, int64_t NK) {
    cudaStream_t s = ctx_->stream();
    pos_.upload(s, static_cast<size_t>(T + NK) * sizeof(int32_t));
    block_tokens_.upload(s, static_cast<size_t>(NK) * sizeof(int32_t));
    block_ranges_.upload(s, static_cast<size_t>(NK) * sizeof(AttnRange));
    labels_.upload(s, static_cast<size_t>(NK) * sizeof(int32_t));
    weights_.upload(s, static_cast<size_t>(NK) * sizeof(float));
    DrafterCudaInputs in;
    in.T = T;
    in.NK = NK;
    in.features = drafter_->features();
    in.pos = pos_.device<int32_t>();
    in.block_tokens = block_tokens_.device<int32_t>();
    in.ranges = block_ranges_.device<AttnRange>();
    in.labels = labels_.device<int32_t>();
    in.weights = weights_.device<float>();
    in.objective = *objective_;
    if (cfg_.dspark.enabled) {
      const auto n = static_cast<size_t>(NK) * sizeof(int32_t);
      dspark_prev_.upload(s, n);
      dspark_tpos_.upload(s, n);
      dspark_order_.upload(s, n);
      dspark_seg_.upload(s, n + sizeof(int32_t));
      in.dspark_prev = dspark_prev_.device<int32_t>();
      in.dspark_teacher_pos = dspark_tpos_.device<int32_t>();
      in.dspark_w1_order = dspark_order_.device<int32_t>();
      in.dspark_w1_seg = dspark_seg_.device<int32_t>();
    }
    if (cfg_.domino.enabled) {
      domino_tok_.upload(s, static_cast<size_t>(NK) * sizeof(int32_t));
      domino_lambda_.upload(s, sizeof(double));
      in.domino_gru_tok = domino_tok_.device<int32_t>();
      in.domino_lambda = domino_lambda_.device<double>();
    }
    if (cfg_.dflash2.enabled) {
      dflash2_prev_.upload(s, static_cast<size_t>(NK) * sizeof(int32_t));
      dflash2_alpha_.upload(s, sizeof(double));
      in.dflash2_prev = dflash2_prev_.device<int32_t>();
      in.dflash2_alpha = dflash2_alpha_.device<double>();
    }
    drafter_->forward_backward(in, 1.0);  // unscaled: the step's 1/Σw is applied by adamw()
  }

  // Peer access to the GPU of a target stage, once per GPU; how its features travel (for the log).
  void check_peer(int device) {
    const int mine = ctx_->device();
    if (device == mine || peers_.count(device)) return;
    int can = 0;
    DFLASH_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, mine, device));
    if (can) {
      const cudaError_t e = cudaDeviceEnablePeerAccess(device, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear it
      } else {
        DFLASH_CUDA_CHECK(e);
      }
    }
    peers_[device] = can ? "peer copy" : "copied through host memory (no peer access)";
  }

  std::unique_ptr<cuda::CudaContext> ctx_;
  std::unique_ptr<cuda::DeviceArena> arena_;  // every device buffer (embedding and head copies too)
  std::unique_ptr<DrafterCuda> drafter_;
  DrafterConfig cfg_;
  int64_t params_;
  int64_t max_ctx_, max_rows_;
  bool use_graphs_;
  AdamWConfig adam_;
  double clip_grad_norm_;
  int64_t updates_ = 0;
  double pending_scale_ = 1.0;          // 1/Σw of the step waiting for update()
  std::optional<Objective> objective_;  // the run's loss, fixed by the first batch
  // Around the step's forward/backward and around AdamW (owned by ctx_).
  cudaEvent_t ev_step_start_ = nullptr, ev_step_end_ = nullptr;
  cudaEvent_t ev_opt_start_ = nullptr, ev_opt_end_ = nullptr;
  std::vector<int32_t> tokens_;            // host only (the target stage uploads the context)
  std::vector<AttnRange> context_ranges_;  // host only
  Staged pos_, block_tokens_, block_ranges_, labels_, weights_;
  Staged dspark_prev_, dspark_tpos_, dspark_order_, dspark_seg_;  // DSpark's DsparkRowIndex
  Staged domino_tok_, domino_lambda_;                             // Domino's DominoRowIndex
  Staged dflash2_prev_, dflash2_alpha_;  // DFlash2's predecessor tokens and the step's α_sel
  cuda::GraphCache<std::pair<int64_t, int64_t>> graphs_;
  std::map<int, std::string> peers_;
  std::unique_ptr<Collective> collective_;
  StepQueue queue_;
};

}  // namespace

std::vector<uint16_t> cuda_features_download(const TargetFeatures& features) {
  const auto* f = dynamic_cast<const CudaFeatures*>(&features);
  DFLASH_CHECK(f != nullptr, "cuda_features_download: the features of another kind of stage");
  std::vector<uint16_t> out(static_cast<size_t>(f->rows * f->cols));
  DFLASH_CUDA_CHECK(cudaSetDevice(f->device));
  DFLASH_CUDA_CHECK(
      cudaMemcpy(out.data(), f->data, out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  return out;
}

std::string cuda_backend_describe(const TrainBackendOptions& opts) {
  std::set<int> devices(opts.topology.target_devices.begin(), opts.topology.target_devices.end());
  devices.insert(opts.topology.drafter_devices.begin(), opts.topology.drafter_devices.end());
  if (devices.empty()) devices.insert(opts.devices.begin(), opts.devices.end());
  std::string s =
      fmt::format("cuda, CUDA graphs {}, target prefill {}", opts.cuda_graphs ? "on" : "off",
                  target_prefill_name(opts.target_prefill));
  for (int d : devices) s += fmt::format("; GPU {}: {}", d, cuda::device_description(d));
  return s;
}

std::unique_ptr<TargetStage> cuda_target_stage_create(const TrainBackendOptions& opts, int device,
                                                      const TargetModel& target,
                                                      const DrafterConfig& cfg) {
  const int n = cuda::device_count();
  DFLASH_CHECK(device >= 0 && device < n,
               "cuda target stage: CUDA device {} does not exist ({} "
               "visible)",
               device, n);
  TrainMemoryPlan plan = plan_target_worker_memory(target.config(), cfg, opts.max_context_tokens,
                                                   opts.feature_buffers, opts.device_memory_gib);
  plan_target_prefill(plan, opts.target_prefill);
  return std::make_unique<CudaTargetStage>(device, target, cfg, plan, opts.cuda_graphs,
                                           opts.feature_buffers, opts.target_prefill);
}

std::unique_ptr<DrafterStage> cuda_drafter_stage_create(
    const TrainBackendOptions& opts, int device, const TargetModel& target,
    const DrafterConfig& cfg, const DrafterLayout& layout,
    const std::shared_ptr<CollectiveGroup>& group, int replica) {
  const int n = cuda::device_count();
  DFLASH_CHECK(device >= 0 && device < n,
               "cuda drafter stage: CUDA device {} does not exist ({} visible)", device, n);
  const TrainMemoryPlan plan = plan_drafter_worker_memory(
      target.config(), cfg, layout, TrainStepCapacity{opts.max_context_tokens, opts.max_blocks},
      opts.device_memory_gib, kDrafterCeChunkRows, opts.drafter_activations);
  return std::make_unique<CudaDrafterStage>(device, target, cfg, layout, plan, opts.cuda_graphs,
                                            opts.adam, opts.clip_grad_norm, group, replica);
}

}  // namespace dflash

#else  // no CUDA

namespace dflash {

std::string cuda_backend_describe(const TrainBackendOptions&) {
  fail(
      "runtime.backend 'cuda' is not available: this dflash was built without the CUDA backend "
      "(configure with -DDFLASH_CUDA=ON)");
}

std::unique_ptr<TargetStage> cuda_target_stage_create(const TrainBackendOptions&, int,
                                                      const TargetModel&, const DrafterConfig&) {
  fail(
      "runtime.backend 'cuda' is not available: this dflash was built without the CUDA backend "
      "(configure with -DDFLASH_CUDA=ON)");
}

std::unique_ptr<DrafterStage> cuda_drafter_stage_create(const TrainBackendOptions&, int,
                                                        const TargetModel&, const DrafterConfig&,
                                                        const DrafterLayout&,
                                                        const std::shared_ptr<CollectiveGroup>&,
                                                        int) {
  fail(
      "runtime.backend 'cuda' is not available: this dflash was built without the CUDA backend "
      "(configure with -DDFLASH_CUDA=ON)");
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
