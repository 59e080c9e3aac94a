// dflash.cpp — the cuDNN causal varlen prefill (contract: src/ops/attention_cudnn.hpp).
// Invariants: the cuDNN graph is built once in the constructor (shape fixed; heuristics mode A,
// cuDNN's first supported engine); forward() only binds pointers and enqueues it; the index arrays
// of the documents live in one cudaMalloc'ed block owned by the object; every cuDNN or frontend
// failure throws dflash::Error with cuDNN's message, never a fallback to the other kernels.
#include "ops/attention_cudnn.hpp"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <cmath>
#include <unordered_map>

#include "backend/cuda/attention_cudnn_launch.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "backend/cuda/entry.hpp"
#include "core/error.hpp"

namespace dflash {

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the graph (cuDNN's variant pack keys).
enum Uid : int64_t { kQ = 1, kK, kV, kO, kSeqQ, kSeqKv, kRaggedQ, kRaggedKv };

/// Throws dflash::Error "<what>: <cuDNN's message> (cuDNN <version>)" when `e` is not OK.
void check_fe(const fe::error_t& e, const char* what) {
  if (e.is_good()) return;
  fail("cuDNN causal prefill: {} failed: {} (cuDNN {} loaded, built against {})", what, e.err_msg,
       cudnnGetVersion(), CUDNN_VERSION);
}

/// Throws dflash::Error naming the call when a cuDNN backend call fails.
void check_cudnn(cudnnStatus_t s, const char* what) {
  DFLASH_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN causal prefill: {} failed: {} (cuDNN {})", what,
               cudnnGetErrorString(s), cudnnGetVersion());
}

/// A [n, 1, 1, 1] int32 graph tensor (slot lengths, ragged offsets).
std::shared_ptr<fe::graph::Tensor_attributes> index_tensor(fe::graph::Graph& g, const char* name,
                                                           int64_t uid, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

/// A [B, heads, S, D] bf16 tensor in the packed row layout [T, heads, D] (rows of a slot start at
/// its ragged offset).
std::shared_ptr<fe::graph::Tensor_attributes> rows_tensor(fe::graph::Graph& g, const char* name,
                                                          int64_t uid, const CudnnPrefillShape& s,
                                                          int64_t heads) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({s.max_docs, heads, s.max_doc_len, s.D})
                      .set_stride({s.max_doc_len * heads * s.D, s.D, heads * s.D, 1}));
}

}  // namespace

CudnnHandle::CudnnHandle(cuda::CudaContext& ctx) {
  ctx.make_current();
  check_cudnn(cudnnCreate(&handle_), "cudnnCreate");
}

CudnnHandle::~CudnnHandle() {
  if (handle_) cudnnDestroy(handle_);
}

struct CudnnCausalPrefill::Impl {
  cuda::CudaContext* ctx = nullptr;
  CudnnPrefillShape shape;
  std::shared_ptr<CudnnHandle> owner;  // keeps `handle` alive
  cudnnHandle_t handle = nullptr;
  fe::graph::Graph graph;
  void* index = nullptr;      // seq_len [B] | q_offset [B+1] | kv_offset [B+1] | doc_start [B+1]
  void* workspace = nullptr;  // cuDNN's
  int64_t workspace_bytes = 0;
  int64_t T = 0;  // rows of the last set_documents (0: none yet)

  int32_t* seq_len() const { return static_cast<int32_t*>(index); }
  int32_t* q_offset() const { return seq_len() + shape.max_docs; }
  int32_t* kv_offset() const { return q_offset() + shape.max_docs + 1; }
  int32_t* doc_start() const { return kv_offset() + shape.max_docs + 1; }

  ~Impl() {
    cudaFree(index);
    cudaFree(workspace);
  }

  void build() {
    const CudnnPrefillShape& s = shape;
    graph.set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto rag_q = index_tensor(graph, "ragged_q", kRaggedQ, s.max_docs + 1);
    auto rag_kv = index_tensor(graph, "ragged_kv", kRaggedKv, s.max_docs + 1);
    auto q = rows_tensor(graph, "q", kQ, s, s.NH);
    auto k = rows_tensor(graph, "k", kK, s, s.NKV);
    auto v = rows_tensor(graph, "v", kV, s, s.NKV);
    q->set_ragged_offset(rag_q);
    k->set_ragged_offset(rag_kv);
    v->set_ragged_offset(rag_kv);
    auto seq_q = index_tensor(graph, "seq_len_q", kSeqQ, s.max_docs);
    auto seq_kv = index_tensor(graph, "seq_len_kv", kSeqKv, s.max_docs);
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("causal_prefill")
                    .set_generate_stats(false)
                    .set_attn_scale(static_cast<float>(s.scale))
                    .set_padding_mask(true)
                    .set_seq_len_q(seq_q)
                    .set_seq_len_kv(seq_kv)
                    .set_causal_mask(true);  // top-left: row i of a slot sees its keys 0..i
    auto [o, stats] = graph.sdpa(q, k, v, opts);
    (void)stats;  // null: no statistics (forward only)
    o->set_output(true)
        .set_uid(kO)
        .set_dim({s.max_docs, s.NH, s.max_doc_len, s.D})
        .set_stride({s.max_doc_len * s.NH * s.D, s.D, s.NH * s.D, 1})
        .set_ragged_offset(rag_q);
    check_fe(graph.validate(), "graph validation");
    check_fe(graph.build_operation_graph(handle), "operation graph");
    check_fe(graph.create_execution_plans({fe::HeurMode_t::A}), "execution plans");
    check_fe(graph.check_support(handle), "support check");
    check_fe(graph.build_plans(handle), "plan build");
    check_fe(graph.get_workspace_size(workspace_bytes), "workspace size");
  }
};

CudnnCausalPrefill::CudnnCausalPrefill(cuda::CudaContext& ctx, const CudnnPrefillShape& s,
                                       std::shared_ptr<CudnnHandle> handle)
    : impl_(std::make_unique<Impl>()) {
  DFLASH_CHECK(s.max_docs >= 1 && s.max_doc_len >= 1 && s.NH > 0 && s.NKV > 0 &&
                   s.NH % s.NKV == 0 && s.D > 0 && std::isfinite(s.scale) && s.scale > 0,
               "cuDNN causal prefill: bad shape: {} document slots of at most {} rows, NH={} "
               "NKV={} D={} scale={} (NH must be a multiple of NKV)",
               s.max_docs, s.max_doc_len, s.NH, s.NKV, s.D, s.scale);
  DFLASH_CHECK(s.max_docs < (1 << 30) && s.max_doc_len < (1 << 30),
               "cuDNN causal prefill: {} slots of {} rows exceed int32 indices", s.max_docs,
               s.max_doc_len);
  Impl& m = *impl_;
  m.ctx = &ctx;
  m.shape = s;
  ctx.make_current();
  m.owner = handle ? std::move(handle) : std::make_shared<CudnnHandle>(ctx);
  m.handle = m.owner->get();
  m.build();
  DFLASH_CUDA_CHECK(cudaMalloc(&m.index, static_cast<size_t>(index_bytes())));
  if (m.workspace_bytes > 0)
    DFLASH_CUDA_CHECK(cudaMalloc(&m.workspace, static_cast<size_t>(m.workspace_bytes)));
}

CudnnCausalPrefill::~CudnnCausalPrefill() = default;

const CudnnPrefillShape& CudnnCausalPrefill::shape() const {
  return impl_->shape;
}
int64_t CudnnCausalPrefill::workspace_bytes() const {
  return impl_->workspace_bytes;
}
int64_t CudnnCausalPrefill::index_bytes() const {
  return (4 * impl_->shape.max_docs + 3) * static_cast<int64_t>(sizeof(int32_t));
}
int64_t CudnnCausalPrefill::cudnn_version() {
  return static_cast<int64_t>(cudnnGetVersion());
}

void CudnnCausalPrefill::set_documents(const AttnRange* ranges, int64_t T) {
  Impl& m = *impl_;
  const CudnnPrefillShape& s = m.shape;
  DFLASH_CHECK(T >= 1 && ranges, "cuDNN causal prefill: set_documents of {} rows, ranges {}", T,
               ranges ? "set" : "null");
  DFLASH_CHECK(T * s.NH * s.D < (int64_t{1} << 31),
               "cuDNN causal prefill: {} rows of {}x{} elements exceed the int32 ragged offsets", T,
               s.NH, s.D);
  cuda::launch::attention_cudnn_documents(m.seq_len(), m.q_offset(), m.kv_offset(), m.doc_start(),
                                          ranges, T, s.max_docs, s.max_doc_len, s.NH * s.D,
                                          s.NKV * s.D, m.ctx->stream());
  m.T = T;
}

void CudnnCausalPrefill::forward(uint16_t* o, const uint16_t* q, const uint16_t* k,
                                 const uint16_t* v) {
  Impl& m = *impl_;
  DFLASH_CHECK(m.T > 0, "cuDNN causal prefill: forward before set_documents");
  DFLASH_CHECK(o && q && k && v, "cuDNN causal prefill: null pointer");
  DFLASH_CHECK(cuda::aligned16(o) && cuda::aligned16(q) && cuda::aligned16(k) && cuda::aligned16(v),
               "cuDNN causal prefill: o, q, k, v must be 16-byte aligned");
  check_cudnn(cudnnSetStream(m.handle, m.ctx->stream()), "cudnnSetStream");
  // The frontend's variant pack takes non-const pointers; q, k, v are only read.
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<uint16_t*>(q)}, {kK, const_cast<uint16_t*>(k)},
      {kV, const_cast<uint16_t*>(v)}, {kO, o},
      {kSeqQ, m.seq_len()},           {kSeqKv, m.seq_len()},
      {kRaggedQ, m.q_offset()},       {kRaggedKv, m.kv_offset()}};
  check_fe(m.graph.execute(m.handle, pack, m.workspace), "execute");
}

}  // namespace dflash
