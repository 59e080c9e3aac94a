// dflash.cpp — CUDA error checking usable from .cu and .cpp files alike (no fmt in this header, so
// nvcc never sees fmt's consteval checks).
#pragma once

#include <cuda_runtime.h>

namespace dflash::cuda {

/// Throws dflash::Error "CUDA error in <what> at <file>:<line>: <cudaGetErrorString(e)>".
[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);

}  // namespace dflash::cuda

/// Evaluates a CUDA runtime call and throws dflash::Error when it does not return cudaSuccess.
#define DFLASH_CUDA_CHECK(call)                                                  \
  do {                                                                           \
    cudaError_t _e = (call);                                                     \
    if (_e != cudaSuccess) ::dflash::cuda::throw_cuda_error(_e, #call, __FILE__, __LINE__); \
  } while (0)
