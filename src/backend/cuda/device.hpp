// dflash.cpp — CUDA device discovery and error checking (host-side API; usable from .cpp files).
#pragma once

#include <string>

namespace dflash::cuda {

/// Number of CUDA devices visible to this process; 0 when there is no driver, no device, or the
/// build has no CUDA backend. Never throws.
int device_count();

/// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `index`; throws dflash::Error on a bad index or
/// when CUDA is not available.
std::string device_description(int index);

}  // namespace dflash::cuda
