#include <cuda_runtime.h>
#include <fmt/format.h>

#include "backend/cuda/device.hpp"
#include "core/error.hpp"

namespace dflash::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string device_description(int index) {
  cudaDeviceProp p{};
  cudaError_t e = cudaGetDeviceProperties(&p, index);
  DFLASH_CHECK(e == cudaSuccess, "cuda:{}: {}", index, cudaGetErrorString(e));
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", p.name, p.major, p.minor,
                     static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace dflash::cuda

#include "backend/cuda/check.hpp"

namespace dflash::cuda {

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  fail("CUDA error in {} at {}:{}: {}", what, file, line, cudaGetErrorString(e));
}

}  // namespace dflash::cuda
