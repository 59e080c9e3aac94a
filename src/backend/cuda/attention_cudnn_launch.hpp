// dflash.cpp — raw-pointer launcher of the cuDNN prefill's index kernel (attention_cudnn.cu),
// checked entry point in backend/cuda/attention_cudnn.cpp (contract: src/ops/attention_cudnn.hpp).
// Internal to the backend. No fmt in this header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention.hpp"

namespace dflash::cuda::launch {

/// The document slots of causal varlen `ranges` [T] (DEVICE) for a cuDNN graph of `slots` slots of
/// at most `max_len` rows: seq_len [slots] (document lengths, 0 for unused slots), q_offset and
/// kv_offset [slots + 1] (element offsets doc_start·q_row and doc_start·kv_row; unused slots and
/// the last entry at T), doc_start [slots + 1] scratch. One CTA, T rows in chunks of its threads.
/// A range not of the form {doc_start, t+1, 0, 0}, more than `slots` documents or a document
/// longer than `max_len` prints the row and traps (the stream's next synchronisation fails).
void attention_cudnn_documents(int32_t* seq_len, int32_t* q_offset, int32_t* kv_offset,
                               int32_t* doc_start, const AttnRange* ranges, int64_t T,
                               int64_t slots, int64_t max_len, int64_t q_row, int64_t kv_row,
                               cudaStream_t s);

}  // namespace dflash::cuda::launch
