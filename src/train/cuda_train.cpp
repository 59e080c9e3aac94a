// dflash.cpp — CudaTrainBackend (see cuda_train.hpp) and cuda_train_backend_create, which fails
// clearly in a build without CUDA.
#include "train/cuda_train.hpp"

#include "core/error.hpp"
#include "train/train_backend.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/graph.hpp"
#include "backend/cuda/pinned.hpp"
#include "model/dflash2_head_cuda.hpp"
#include "model/domino_head_cuda.hpp"
#include "model/drafter_cuda.hpp"
#include "model/dspark_head_cuda.hpp"
#include "model/step_plan.hpp"
#include "model/target_cuda.hpp"

namespace dflash {

namespace {

using cuda::PinnedBuffer;

// One staged input: device buffer (from the arena) plus its pinned host twin.
struct Staged {
  void* dev = nullptr;
  PinnedBuffer host;
  template <typename T>
  void fill(const std::vector<T>& src) {
    const size_t bytes = src.size() * sizeof(T);
    DFLASH_CHECK(bytes <= host.bytes(), "CudaTrainBackend: {} bytes of input for a buffer of {}",
                 bytes, host.bytes());
    if (bytes) std::memcpy(host.as<void>(), src.data(), bytes);
  }
  // Enqueues the copy of elements [first, first+n) of T to the device.
  template <typename T>
  void upload(cudaStream_t s, int64_t first, int64_t n) const {
    if (n <= 0) return;
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(static_cast<T*>(dev) + first, host.as<T>() + first,
                                      static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice,
                                      s));
  }
};

Staged make_staged(cuda::DeviceArena& arena, const char* name, size_t bytes) {
  Staged st;
  st.dev = arena.get_bytes(name, bytes);
  st.host = PinnedBuffer(bytes);
  return st;
}

// total − free device memory of the current device.
uint64_t used_device_memory() {
  size_t free = 0, total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total - free;
}

}  // namespace

void cuda_target_use_cudnn(TargetCuda& target) {
  try {
    target.use_cudnn_prefill();
  } catch (const Error& e) {
    fail(
        "runtime.target_prefill cudnn: {} (runtime.target_prefill: kernels runs the prefill on "
        "the project's attention kernels)",
        e.what());
  }
}

int64_t cuda_target_prefill_select(TargetCuda& target, int64_t docs, int64_t longest) {
  if (!target.cudnn_prefill()) return 0;
  const int64_t bucket = TargetCuda::cudnn_prefill_bucket(docs);
  try {
    target.cudnn_prefill_select(bucket, longest);
  } catch (const Error& e) {
    fail(
        "runtime.target_prefill cudnn: the graph of {} document slots of at most {} rows: {} "
        "(runtime.target_prefill: kernels runs the prefill on the project's attention kernels)",
        bucket, longest, e.what());
  }
  return bucket;
}

struct CudaTrainBackend::Inputs {
  Staged tokens, target_ranges, pos, block_tokens, block_ranges, labels, weights;
  Staged dspark_prev, dspark_tpos, dspark_order, dspark_seg;  // DSpark's DsparkRowIndex
  Staged domino_tok, domino_lambda;                           // Domino's DominoRowIndex
  Staged dflash2_prev, dflash2_alpha;  // DFlash2's predecessor tokens and the step's α_sel
  float* final_norm = nullptr;  // DSpark: the target's final-norm weight [H] (the teacher)
  Objective objective;          // the staged batch's loss
  cudaEvent_t start = nullptr, after_target = nullptr, end = nullptr;
  cudaEvent_t opt_start = nullptr, opt_end = nullptr;            // around the AdamW update
  cuda::GraphCache<std::pair<int64_t, int64_t>> target_graphs;   // by (T, document bucket)
  cuda::GraphCache<std::pair<int64_t, int64_t>> drafter_graphs;  // by (T, NK)
};

// Features of a CudaTrainBackend: they live in its drafter's feature buffer; `ticket` names the
// forward_taps() call that wrote them.
class CudaTargetFeatures final : public TargetFeatures {
 public:
  CudaTargetFeatures(const CudaTrainBackend* owner, int64_t ticket)
      : owner(owner), ticket(ticket) {}
  const CudaTrainBackend* owner;
  int64_t ticket;
};

CudaTrainBackend::CudaTrainBackend(int device, const TargetModel& target, const DrafterConfig& cfg,
                                   const DrafterLayout& layout, const TrainMemoryPlan& plan,
                                   bool use_graphs, const AdamWConfig& adam, double clip_grad_norm,
                                   TargetPrefill prefill)
    : cfg_(cfg),
      param_count_(layout.total),
      taps_(cfg.target_layer_ids),
      max_ctx_(plan.T),
      max_rows_(plan.NK),
      use_graphs_(use_graphs),
      adam_(adam),
      clip_grad_norm_(clip_grad_norm),
      planned_context_bytes_(plan.context_bytes + plan.cublaslt_bytes) {
  const int n = cuda::device_count();
  DFLASH_CHECK(device >= 0 && device < n,
               "runtime.devices: CUDA device {} does not exist ({} visible)", device, n);
  description_ = fmt::format("cuda:{} {}, CUDA graphs {}", device, cuda::device_description(device),
                             use_graphs ? "on" : "off");
  ctx_ = std::make_unique<cuda::CudaContext>(device);
  context_bytes_ = used_device_memory();  // context, library handles, cuBLASLt workspace
  arena_ = std::make_unique<cuda::DeviceArena>(*ctx_, plan.arena);
  target_ = std::make_unique<TargetCuda>(*ctx_, target, plan.T, plan.target_layers, arena_.get());
  if (prefill == TargetPrefill::cudnn) cuda_target_use_cudnn(*target_);
  drafter_ = std::make_unique<DrafterCuda>(*ctx_, cfg, layout, plan.T, plan.NK, target_->embed(),
                                           target_->lm_head(), arena_.get(), kDrafterCeChunkRows,
                                           plan.activations);
  in_ = std::make_unique<Inputs>();
  const auto T = static_cast<size_t>(plan.T), NK = static_cast<size_t>(plan.NK);
  cuda::DeviceArena& a = *arena_;
  in_->tokens = make_staged(a, "inputs.tokens", T * sizeof(int32_t));
  in_->target_ranges = make_staged(a, "inputs.target_ranges", T * sizeof(AttnRange));
  in_->pos = make_staged(a, "inputs.pos", (T + NK) * sizeof(int32_t));
  in_->block_tokens = make_staged(a, "inputs.block_tokens", NK * sizeof(int32_t));
  in_->block_ranges = make_staged(a, "inputs.block_ranges", NK * sizeof(AttnRange));
  in_->labels = make_staged(a, "inputs.labels", NK * sizeof(int32_t));
  in_->weights = make_staged(a, "inputs.weights", NK * sizeof(float));
  if (cfg.dspark.enabled) {
    in_->dspark_prev = make_staged(a, kInputDsparkPrev, NK * sizeof(int32_t));
    in_->dspark_tpos = make_staged(a, kInputDsparkTeacherPos, NK * sizeof(int32_t));
    in_->dspark_order = make_staged(a, kInputDsparkW1Order, NK * sizeof(int32_t));
    in_->dspark_seg = make_staged(a, kInputDsparkW1Seg, (NK + 1) * sizeof(int32_t));
    const std::vector<float>& w = target.final_norm_weight();
    in_->final_norm = a.get<float>(kTargetFinalNorm, static_cast<int64_t>(w.size()));
    DFLASH_CUDA_CHECK(
        cudaMemcpy(in_->final_norm, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  if (cfg.domino.enabled) {
    in_->domino_tok = make_staged(a, kInputDominoGruTok, NK * sizeof(int32_t));
    in_->domino_lambda = make_staged(a, kInputDominoLambda, sizeof(double));
  }
  if (cfg.dflash2.enabled) {
    in_->dflash2_prev = make_staged(a, kInputDflash2Prev, NK * sizeof(int32_t));
    in_->dflash2_alpha = make_staged(a, kInputDflash2Alpha, sizeof(double));
  }
  const char* pool = "workspace.op_scratch";
  const uint64_t pool_bytes = a.planned_bytes(pool);
  ctx_->allocator().use_pool(a.get_bytes(pool, pool_bytes), pool_bytes);
  const std::vector<std::string> unused = a.untaken();
  DFLASH_CHECK(unused.empty(),
               "memory plan: {} planned buffers are not used by the CUDA step (e.g. '{}'): the "
               "plan and the code disagree",
               unused.size(), unused.empty() ? "" : unused.front());
  in_->start = ctx_->new_event(true);
  in_->after_target = ctx_->new_event(true);
  in_->end = ctx_->new_event(true);
  in_->opt_start = ctx_->new_event(true);
  in_->opt_end = ctx_->new_event(true);
}

uint64_t CudaTrainBackend::device_memory_used() const {
  ctx_->make_current();
  return used_device_memory();
}

std::string CudaTrainBackend::memory_report() const {
  const double gb = static_cast<double>(target_->upload_bytes()) / 1e9;
  const double s = target_->upload_seconds();
  return fmt::format(
      "device memory: context, handles and cuBLASLt workspace {} (planned {}), arena {}, in use "
      "now {}; target weights {:.2f} GB uploaded in {:.2f} s ({:.2f} GB/s)",
      format_bytes(context_bytes_), format_bytes(planned_context_bytes_),
      format_bytes(arena_->bytes()), format_bytes(device_memory_used()), gb, s,
      s > 0 ? gb / s : 0.0);
}

CudaTrainBackend::~CudaTrainBackend() = default;

int64_t CudaTrainBackend::graphs_captured() const {
  return static_cast<int64_t>(in_->target_graphs.size() + in_->drafter_graphs.size());
}

std::string CudaTrainBackend::summary() const {
  if (!use_graphs_) return "cuda: CUDA graphs off";
  return fmt::format("cuda: {} step shapes captured as CUDA graphs", graphs_captured());
}

void CudaTrainBackend::enqueue_target(int64_t T) {
  cudaStream_t s = ctx_->stream();
  in_->tokens.upload<int32_t>(s, 0, T);
  in_->target_ranges.upload<AttnRange>(s, 0, T);
  in_->pos.upload<int32_t>(s, 0, T);
  const auto* tokens = static_cast<int32_t*>(in_->tokens.dev);
  const auto* pos = static_cast<int32_t*>(in_->pos.dev);
  const auto* ranges = static_cast<AttnRange*>(in_->target_ranges.dev);
  if (in_->final_norm) {  // DSpark: the taps [T, F], then the teacher's final-norm rows [T, H]
    uint16_t* f = drafter_->features();
    target_->forward_taps_final(f, f + T * cfg_.n_taps() * cfg_.hidden_size, in_->final_norm,
                                tokens, pos, ranges, T, taps_);
  } else {
    target_->forward_taps(drafter_->features(), tokens, pos, ranges, T, taps_);
  }
}

void CudaTrainBackend::enqueue_drafter(int64_t T, int64_t NK) {
  cudaStream_t s = ctx_->stream();
  in_->pos.upload<int32_t>(s, T, NK);
  in_->block_tokens.upload<int32_t>(s, 0, NK);
  in_->block_ranges.upload<AttnRange>(s, 0, NK);
  in_->labels.upload<int32_t>(s, 0, NK);
  in_->weights.upload<float>(s, 0, NK);
  DrafterCudaInputs di;
  di.T = T;
  di.NK = NK;
  di.features = drafter_->features();
  di.pos = static_cast<int32_t*>(in_->pos.dev);
  di.block_tokens = static_cast<int32_t*>(in_->block_tokens.dev);
  di.ranges = static_cast<AttnRange*>(in_->block_ranges.dev);
  di.labels = static_cast<int32_t*>(in_->labels.dev);
  di.weights = static_cast<float*>(in_->weights.dev);
  di.objective = in_->objective;
  if (cfg_.dspark.enabled) {
    in_->dspark_prev.upload<int32_t>(s, 0, NK);
    in_->dspark_tpos.upload<int32_t>(s, 0, NK);
    in_->dspark_order.upload<int32_t>(s, 0, NK);
    in_->dspark_seg.upload<int32_t>(s, 0, NK + 1);
    di.dspark_prev = static_cast<int32_t*>(in_->dspark_prev.dev);
    di.dspark_teacher_pos = static_cast<int32_t*>(in_->dspark_tpos.dev);
    di.dspark_w1_order = static_cast<int32_t*>(in_->dspark_order.dev);
    di.dspark_w1_seg = static_cast<int32_t*>(in_->dspark_seg.dev);
  }
  if (cfg_.domino.enabled) {
    in_->domino_tok.upload<int32_t>(s, 0, NK);
    in_->domino_lambda.upload<double>(s, 0, 1);
    di.domino_gru_tok = static_cast<int32_t*>(in_->domino_tok.dev);
    di.domino_lambda = static_cast<double*>(in_->domino_lambda.dev);
  }
  if (cfg_.dflash2.enabled) {
    in_->dflash2_prev.upload<int32_t>(s, 0, NK);
    in_->dflash2_alpha.upload<double>(s, 0, 1);
    di.dflash2_prev = static_cast<int32_t*>(in_->dflash2_prev.dev);
    di.dflash2_alpha = static_cast<double*>(in_->dflash2_alpha.dev);
  }
  drafter_->forward_backward(di, 1.0);  // unscaled: the step's 1/Σw is applied by adamw()
}

std::unique_ptr<TargetFeatures> CudaTrainBackend::forward_taps(const DrafterBatch& b) {
  DFLASH_CHECK(staged_consumed_,
               "CudaTrainBackend: forward_taps() again before step() used the previous features "
               "(this backend holds one step in flight)");
  DFLASH_CHECK(b.block_size == cfg_.block_size,
               "CudaTrainBackend: a batch of block size {} for a drafter of block size {}",
               b.block_size, cfg_.block_size);
  const int64_t K = cfg_.block_size, multiple = kBlockRowsMultiple * K;
  const int64_t T = b.rows * b.row_length;
  const int64_t NK = std::max<int64_t>(multiple, (b.N() * K + multiple - 1) / multiple * multiple);
  DFLASH_CHECK(T > 0 && T <= max_ctx_ && NK <= max_rows_,
               "CudaTrainBackend: a step of {} rows of {} tokens and {} block rows exceeds the "
               "planned {} tokens and {} block rows",
               b.rows, b.row_length, NK, max_ctx_, max_rows_);
  // The pinned staging buffers are reused: the previous step's copies from them must be done
  // (they are: step() and update() wait for the device; this also covers a skipped step).
  ctx_->synchronize();
  const auto T_ = static_cast<size_t>(T), NK_ = static_cast<size_t>(NK);
  DrafterStaging st;
  st.tokens = {in_->tokens.host.as<int32_t>(), T_};
  st.context_ranges = {in_->target_ranges.host.as<AttnRange>(), T_};
  st.positions = {in_->pos.host.as<int32_t>(), T_ + NK_};
  st.block_tokens = {in_->block_tokens.host.as<int32_t>(), NK_};
  st.block_ranges = {in_->block_ranges.host.as<AttnRange>(), NK_};
  st.labels = {in_->labels.host.as<int32_t>(), NK_};
  st.weights = {in_->weights.host.as<float>(), NK_};
  const int64_t docs = drafter_batch_stage(b, cfg_.mask_token_id, 0, st);
  const int64_t bucket = cuda_target_prefill_select(*target_, docs, b.row_length);
  in_->objective = b.objective;
  if (cfg_.dspark.enabled) {
    const DsparkRowIndex x = dspark_row_index(b, NK, cfg_.vocab_size);
    in_->dspark_prev.fill(x.prev);
    in_->dspark_tpos.fill(x.teacher_pos);
    in_->dspark_order.fill(x.w1_order);
    in_->dspark_seg.fill(x.w1_seg);
  }
  if (cfg_.domino.enabled) {
    const DominoRowIndex x = domino_row_index(cfg_, b, NK);
    in_->domino_tok.fill(x.gru_tok);
    in_->domino_lambda.fill(std::vector<double>{x.lambda});
  }
  if (cfg_.dflash2.enabled) {  // teacher-forced predecessors; α_sel read on the device
    in_->dflash2_prev.fill(dflash2_prev_tokens(b, NK, cfg_.vocab_size));
    in_->dflash2_alpha.fill(std::vector<double>{b.objective.dflash2_selector_alpha});
  }
  staged_T_ = T;
  staged_NK_ = NK;
  staged_batch_ = b.fingerprint();
  staged_consumed_ = false;
  ++staged_ticket_;
  cudaStream_t s = ctx_->stream();
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->start, s));
  if (use_graphs_) {
    in_->target_graphs.run(std::pair<int64_t, int64_t>(T, bucket), s, [&] { enqueue_target(T); });
  } else {
    enqueue_target(T);
  }
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->after_target, s));
  return std::make_unique<CudaTargetFeatures>(this, staged_ticket_);
}

void CudaTrainBackend::fill_nan(TargetFeatures& features) {
  const auto* f = dynamic_cast<const CudaTargetFeatures*>(&features);
  DFLASH_CHECK(f != nullptr && f->owner == this && f->ticket == staged_ticket_,
               "CudaTrainBackend: fill_nan() of features this backend does not hold");
  const size_t bytes = static_cast<size_t>(staged_T_ * drafter_feature_cols(cfg_)) * 2;
  DFLASH_CUDA_CHECK(cudaMemsetAsync(drafter_->features(), 0xFF, bytes, ctx_->stream()));
}

void CudaTrainBackend::step(const DrafterBatch& b, const TargetFeatures& features) {
  DFLASH_CHECK(!queue_.waiting_for_update(),
               "CudaTrainBackend: step() called twice without update() in between");
  DFLASH_CHECK(!b.objective.dpace(),
               "CudaTrainBackend: training.loss_type {} is not implemented here (it computes the "
               "dflash loss; dflash train runs D-PACE through the pipeline's cuda stages)",
               loss_type_name(b.objective.loss));
  const auto* f = dynamic_cast<const CudaTargetFeatures*>(&features);
  DFLASH_CHECK(f != nullptr && f->owner == this,
               "CudaTrainBackend: the features come from another backend's target stage");
  DFLASH_CHECK(
      f->ticket == staged_ticket_ && !staged_consumed_,
      "CudaTrainBackend: stale features (forward_taps call {}, the buffer holds call {}{})",
      f->ticket, staged_ticket_, staged_consumed_ ? ", already used" : "");
  DFLASH_CHECK(b.fingerprint() == staged_batch_,
               "CudaTrainBackend: step() of batch {} of epoch {} with the features of another "
               "batch",
               b.index, b.epoch);
  staged_consumed_ = true;
  DrafterStepResult r;
  r.metrics = ObjectiveMetrics(cfg_.block_size);
  if (!(b.weight_sum > 0)) {
    r.skip = StepSkip::no_supervised_slot;
    queue_.stepped(std::move(r));
    return;
  }
  const int64_t T = staged_T_, NK = staged_NK_;
  cudaStream_t s = ctx_->stream();
  if (use_graphs_) {
    in_->drafter_graphs.run(std::pair<int64_t, int64_t>(T, NK), s, [&] { enqueue_drafter(T, NK); });
  } else {
    enqueue_drafter(T, NK);
  }
  DFLASH_CUDA_CHECK(cudaEventRecord(in_->end, s));
  const auto wait0 = std::chrono::steady_clock::now();
  const DrafterCuda::Results res = drafter_->fetch_results(NK);  // waits for the device
  r.host_wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait0).count();
  pending_scale_ = 1.0 / b.weight_sum;
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
  r.metrics.weight_sum = res.weight_sum;
  r.grad_norm = res.grad_norm * pending_scale_;
  float ms_t = 0, ms_d = 0;
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms_t, in_->start, in_->after_target));
  DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms_d, in_->after_target, in_->end));
  r.target_device_s = ms_t * 1e-3;
  r.drafter_device_s = ms_d * 1e-3;
  queue_.stepped(std::move(r));
}

void CudaTrainBackend::update(double lr) {
  DrafterStepResult r = queue_.take_stepped();
  if (step_decide_update(r, clip_grad_norm_)) {
    updates_ += 1;
    cudaStream_t s = ctx_->stream();
    DFLASH_CUDA_CHECK(cudaEventRecord(in_->opt_start, s));
    const auto wait0 = std::chrono::steady_clock::now();
    drafter_->adamw(adam_, lr, updates_, r.clip * pending_scale_);  // waits for the device
    DFLASH_CUDA_CHECK(cudaEventRecord(in_->opt_end, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(in_->opt_end));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, in_->opt_start, in_->opt_end));
    r.optimizer_device_s = ms * 1e-3;
    r.host_wait_s = r.host_wait_s.value_or(0.0) +
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - wait0).count();
  }
  queue_.finish(std::move(r));
}

void CudaTrainBackend::save_state(DrafterState& out) {
  DFLASH_CHECK(!queue_.waiting_for_update(),
               "CudaTrainBackend: save_state() between step() and update()");
  const auto n = static_cast<size_t>(param_count_);
  out.params.resize(n);
  out.adam_m.resize(n);
  out.adam_v.resize(n);
  drafter_->download_state(out.params, out.adam_m, out.adam_v);
  out.updates = updates_;
}

void CudaTrainBackend::load_state(const DrafterState& in) {
  DFLASH_CHECK(!queue_.waiting_for_update(),
               "CudaTrainBackend: load_state() between step() and update()");
  drafter_state_check(in, param_count_);
  drafter_->upload_state(in.params, in.adam_m, in.adam_v);
  updates_ = in.updates;
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA

namespace dflash {

void cuda_train_backend_check(const TrainBackendOptions& opts) {
#ifdef DFLASH_HAVE_CUDA
  if (opts.topology.targets() > 0) {
    topology_check_devices(opts.topology, cuda::device_count());
    return;
  }
  DFLASH_CHECK(opts.devices.size() == 1,
               "runtime.devices lists {} devices; this build trains on exactly one GPU",
               opts.devices.size());
  const int n = cuda::device_count();
  DFLASH_CHECK(opts.devices[0] >= 0 && opts.devices[0] < n,
               "runtime.devices: CUDA device {} does not exist ({} visible)", opts.devices[0], n);
#else
  (void)opts;
  fail(
      "runtime.backend 'cuda' is not available: this dflash was built without the CUDA backend "
      "(configure with -DDFLASH_CUDA=ON), so it trains on the cpu backend only");
#endif
}

TrainBackend cuda_train_backend_create(const TrainBackendOptions& opts, const TargetModel& target,
                                       const DrafterConfig& cfg, const DrafterLayout& layout) {
  cuda_train_backend_check(opts);
#ifdef DFLASH_HAVE_CUDA
  TrainMemoryPlan plan = plan_train_memory(
      target.config(), cfg, layout, TrainStepCapacity{opts.max_context_tokens, opts.max_blocks},
      opts.device_memory_gib, kDrafterCeChunkRows, opts.drafter_activations);
  plan_target_prefill(plan, opts.target_prefill);
  DFLASH_CHECK(plan.fits(),
               "the training step does not fit the device: it needs {} and "
               "runtime.device_memory_gib allows {} (dflash train --plan names the largest token "
               "budget that fits)",
               format_bytes(plan.total_bytes()), format_bytes(plan.device_bytes));
  auto b = std::make_shared<CudaTrainBackend>(opts.devices[0], target, cfg, layout, plan,
                                              opts.cuda_graphs, opts.adam, opts.clip_grad_norm,
                                              opts.target_prefill);
  TrainBackend out;
  out.description = b->description();
  out.memory_report = b->memory_report();
  out.target = b;
  out.drafter = b;
  return out;
#else
  (void)target, (void)cfg, (void)layout;
  fail("internal error: no CUDA backend in this build");
#endif
}

}  // namespace dflash
