// dflash.cpp — the index kernel of the cuDNN causal prefill (contract: src/ops/attention_cudnn.hpp,
// launcher: attention_cudnn_launch.hpp): causal varlen key ranges -> cuDNN's per-slot document
// lengths and ragged element offsets.
// Invariants: one CTA of kThreads threads walks the T rows in order, chunk by chunk, so document
// slots are numbered in row order; every check that fails prints the row and traps (no partial
// index is ever used: the trap poisons the context, the next synchronisation throws).
#include <cub/block/block_scan.cuh>

#include "backend/cuda/attention_cudnn_launch.hpp"
#include "backend/cuda/check.hpp"

namespace dflash::cuda::launch {

namespace {

constexpr int kThreads = 1024;

/// Max of two ints (the scan operator of the running document start).
struct MaxOp {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

__global__ void __launch_bounds__(kThreads)
    documents_kernel(int32_t* seq_len, int32_t* q_offset, int32_t* kv_offset, int32_t* doc_start,
                     const AttnRange* ranges, int T, int slots, int max_len, int q_row,
                     int kv_row) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  int count = 0;        // documents started before this chunk
  int last_start = -1;  // first row of the document open at the end of the previous chunk
  for (int base = 0; base < T; base += kThreads) {
    const int t = base + static_cast<int>(threadIdx.x);
    const bool row = t < T;
    const AttnRange r = row ? ranges[t] : AttnRange{};
    const int starts = row && r.lo1 == t ? 1 : 0;
    int before = 0, chunk_docs = 0;
    Scan(temp).ExclusiveSum(starts, before, chunk_docs);
    __syncthreads();
    int open = 0, chunk_max = 0;
    Scan(temp).InclusiveScan(starts ? t : -1, open, MaxOp{}, chunk_max);
    __syncthreads();
    open = open > last_start ? open : last_start;
    if (row && (open < 0 || r.lo1 != open || r.hi1 != t + 1 || r.lo2 != r.hi2)) {
      printf(
          "cuDNN causal prefill: row %d has range {%d, %d, %d, %d}, not the causal varlen form "
          "{doc_start, row+1, 0, 0}\n",
          t, r.lo1, r.hi1, r.lo2, r.hi2);
      __trap();
    }
    if (starts) {
      const int slot = count + before;
      if (slot >= slots) {
        printf(
            "cuDNN causal prefill: row %d starts document %d; the graph has %d document "
            "slots\n",
            t, slot + 1, slots);
        __trap();
      }
      doc_start[slot] = t;
    }
    count += chunk_docs;
    last_start = chunk_max > last_start ? chunk_max : last_start;
  }
  __syncthreads();  // doc_start written by every thread is visible to the block
  for (int b = static_cast<int>(threadIdx.x); b <= slots; b += kThreads) {
    const int begin = b < count ? doc_start[b] : T;
    if (b < slots) {
      const int end = b + 1 < count ? doc_start[b + 1] : T;
      const int len = b < count ? end - begin : 0;
      if (len > max_len) {
        printf(
            "cuDNN causal prefill: document %d (rows %d..%d) has %d rows; the graph's "
            "longest is %d\n",
            b, begin, end - 1, len, max_len);
        __trap();
      }
      seq_len[b] = len;
    }
    q_offset[b] = begin * q_row;
    kv_offset[b] = begin * kv_row;
  }
}

}  // namespace

void attention_cudnn_documents(int32_t* seq_len, int32_t* q_offset, int32_t* kv_offset,
                               int32_t* doc_start, const AttnRange* ranges, int64_t T,
                               int64_t slots, int64_t max_len, int64_t q_row, int64_t kv_row,
                               cudaStream_t s) {
  documents_kernel<<<1, kThreads, 0, s>>>(
      seq_len, q_offset, kv_offset, doc_start, ranges, static_cast<int>(T), static_cast<int>(slots),
      static_cast<int>(max_len), static_cast<int>(q_row), static_cast<int>(kv_row));
  DFLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dflash::cuda::launch
