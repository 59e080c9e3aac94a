// dflash.cpp — runtime.target_prefill on the CUDA backend: how the trainer's target stages
// (train/cuda_train.cpp, train/cuda_stages.cpp) and `dflash bench` turn the key into TargetCuda's
// cuDNN prefill (model/target_cuda.hpp), and the errors that name the key.
//
// Invariants: with cudnn, every forward runs on the cuDNN graph of its staged context's
// power-of-two document bucket (documents of at most one row), selected before the forward and
// its CUDA-graph capture; a target or a shape cuDNN cannot run is an error naming
// runtime.target_prefill and the value that selects the kernels, never a fallback.
#pragma once

#ifdef DFLASH_HAVE_CUDA

#include <cstdint>

namespace dflash {

class TargetCuda;

/// runtime.target_prefill cudnn for `target`: TargetCuda::use_cudnn_prefill, its refusal (a
/// sliding-window or sink target, no cuDNN for the GPU) rethrown as dflash::Error naming
/// runtime.target_prefill and the value that selects the kernels.
void cuda_target_use_cudnn(TargetCuda& target);
/// Before a forward over a staged context of `docs` documents (real and padding) of at most
/// `longest` rows: with the cuDNN prefill on, selects the graph of its power-of-two bucket
/// (TargetCuda::cudnn_prefill_select; built the first time, not capturable) and returns the
/// bucket, which keys the forward's CUDA graph with the context length; returns 0 with the
/// kernels. Throws dflash::Error as cudnn_prefill_select, naming runtime.target_prefill.
int64_t cuda_target_prefill_select(TargetCuda& target, int64_t docs, int64_t longest);

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
