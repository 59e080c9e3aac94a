// dflash.cpp — which OpenBLAS kernel family runs our GEMMs, and the repair of a known OpenBLAS
// mis-detection (internal to the CPU backend and the `dflash` entry point).
//
// Background: a DYNAMIC_ARCH OpenBLAS picks its kernels once, when the library is loaded, from
// the CPU model number, unless the environment variable OPENBLAS_CORETYPE names them. OpenBLAS
// releases before 0.3.25 fall back to the generic SSE3 "Prescott" kernels on any Intel CPU model
// they do not know (OpenBLAS issue #4267, fixed by PR #4268), e.g. Emerald Rapids (family 6,
// model 207) with Debian 12's OpenBLAS 0.3.21: GEMMs then run about 2× slower than with the
// AVX-512 kernels. Since the choice is made before main() runs, the only repair is to set
// OPENBLAS_CORETYPE and execute the program again.
//
// Invariants: a core type set by the user in OPENBLAS_CORETYPE is never overridden; an override
// is proposed only for the documented "Prescott" fallback and only for a kernel family whose
// instructions the CPU reports (the choice itself never changes results beyond float rounding).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace dflash::cpu {

/// The SIMD features of the running CPU that OpenBLAS's x86-64 kernel families need.
struct CpuFeatures {
  bool avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  /// The running CPU's features (__builtin_cpu_supports; all false on non-x86 builds).
  static CpuFeatures detect();
};

/// OpenBLAS's current kernel family (openblas_get_corename(), e.g. "SkylakeX", "Haswell").
std::string blas_core_name();

/// The OPENBLAS_CORETYPE value that repairs OpenBLAS's generic fallback: "SkylakeX" when `core`
/// is "Prescott" and the CPU has AVX-512 F/BW/DQ/VL, "Haswell" when it is "Prescott" and the CPU
/// has AVX2 and FMA; nullopt otherwise (a recognised CPU, or one the generic kernels suit).
std::optional<std::string> blas_core_override(std::string_view core, const CpuFeatures& cpu);

/// Called first thing in main(): when OPENBLAS_CORETYPE is unset and blas_core_override() proposes
/// a core type for this CPU, sets OPENBLAS_CORETYPE to it and replaces the process with a fresh
/// run of the same executable (/proc/self/exe) and arguments, so that OpenBLAS loads with the right
/// kernels. Returns only when nothing is to be done or the re-execution failed (then the reason is
/// in the returned string, for the caller to log; the program keeps working, more slowly).
std::optional<std::string> blas_repair_core_detection(char** argv);

}  // namespace dflash::cpu
