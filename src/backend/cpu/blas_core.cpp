// dflash.cpp — OpenBLAS kernel family and its repair (see blas_core.hpp).
#include "backend/cpu/blas_core.hpp"

#include <cblas.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace dflash::cpu {

CpuFeatures CpuFeatures::detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

std::string blas_core_name() {
  const char* name = openblas_get_corename();
  return name ? std::string(name) : std::string("unknown");
}

std::optional<std::string> blas_core_override(std::string_view core, const CpuFeatures& cpu) {
  if (core != "Prescott") return std::nullopt;
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512dq && cpu.avx512vl) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return "Haswell";
  return std::nullopt;
}

std::optional<std::string> blas_repair_core_detection(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return std::nullopt;
  const std::string core = blas_core_name();
  const std::optional<std::string> want = blas_core_override(core, CpuFeatures::detect());
  if (!want) return std::nullopt;
  if (::setenv("OPENBLAS_CORETYPE", want->c_str(), 1) != 0) {
    return fmt::format(
        "OpenBLAS uses its generic {} kernels on this CPU; setting "
        "OPENBLAS_CORETYPE={} failed ({})",
        core, *want, std::strerror(errno));
  }
  ::execv("/proc/self/exe", argv);
  const int err = errno;  // execv returns only on failure
  ::unsetenv("OPENBLAS_CORETYPE");
  return fmt::format(
      "OpenBLAS uses its generic {} kernels on this CPU; running again with "
      "OPENBLAS_CORETYPE={} failed ({}); set it yourself for about 2x faster GEMMs",
      core, *want, std::strerror(err));
}

}  // namespace dflash::cpu
