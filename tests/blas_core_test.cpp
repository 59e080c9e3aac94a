// dflash.cpp — tests of the OpenBLAS kernel-family repair (backend/cpu/blas_core.hpp): the
// decision table, and the `dflash` binary running with the repaired kernels while respecting a
// user's OPENBLAS_CORETYPE.
#include "backend/cpu/blas_core.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "util/test_util.hpp"

namespace dflash {
namespace {

using cpu::blas_core_override;
using cpu::CpuFeatures;

CpuFeatures avx512() {
  CpuFeatures f;
  f.avx2 = f.fma = f.avx512f = f.avx512bw = f.avx512dq = f.avx512vl = true;
  return f;
}

TEST(BlasCore, OverrideOnlyRepairsThePrescottFallback) {
  CpuFeatures avx2;
  avx2.avx2 = avx2.fma = true;
  EXPECT_EQ(blas_core_override("Prescott", avx512()), std::optional<std::string>("SkylakeX"));
  EXPECT_EQ(blas_core_override("Prescott", avx2), std::optional<std::string>("Haswell"));
  // AVX-512 F without BW/DQ/VL (Knights Landing) does not run the SkylakeX kernels.
  CpuFeatures knl = avx2;
  knl.avx512f = true;
  EXPECT_EQ(blas_core_override("Prescott", knl), std::optional<std::string>("Haswell"));
  // AVX2 without FMA, or no AVX2 at all: the generic kernels are the right ones.
  CpuFeatures no_fma;
  no_fma.avx2 = true;
  EXPECT_EQ(blas_core_override("Prescott", no_fma), std::nullopt);
  EXPECT_EQ(blas_core_override("Prescott", CpuFeatures{}), std::nullopt);
  // A recognised CPU keeps OpenBLAS's own choice.
  for (const char* core : {"SkylakeX", "Haswell", "Zen", "SapphireRapids", "Sandybridge"}) {
    EXPECT_EQ(blas_core_override(core, avx512()), std::nullopt) << core;
  }
}

// The core named by `dflash --version` ("... OpenBLAS <core> kernels)").
std::string binary_core() {
  const test::RunResult r = test::run_dflash({"--version"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string key = "OpenBLAS ";
  const size_t b = r.out.find(key);
  const size_t e = r.out.find(" kernels", b);
  EXPECT_TRUE(b != std::string::npos && e != std::string::npos) << r.out;
  if (b == std::string::npos || e == std::string::npos) return "";
  EXPECT_EQ(r.err, "") << "the repair must be silent when it works";
  return r.out.substr(b + key.size(), e - b - key.size());
}

class EnvGuard {
 public:
  explicit EnvGuard(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v;
  }
  ~EnvGuard() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  const std::optional<std::string>& old() const { return old_; }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(BlasCore, BinaryRunsWithTheRepairedKernels) {
  EnvGuard env("OPENBLAS_CORETYPE");
  if (env.old()) GTEST_SKIP() << "OPENBLAS_CORETYPE is set: this process's core is not detected";
  // This test process loaded OpenBLAS with its own detection; the binary must end up with the
  // repaired choice (the same when detection worked).
  const std::string detected = cpu::blas_core_name();
  const std::string want = blas_core_override(detected, CpuFeatures::detect()).value_or(detected);
  EXPECT_EQ(binary_core(), want) << "OpenBLAS detected " << detected << " in this process";
}

TEST(BlasCore, BinaryKeepsTheUsersCoreType) {
  EnvGuard env("OPENBLAS_CORETYPE");
  ::setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  EXPECT_EQ(binary_core(), "Prescott");
}

}  // namespace
}  // namespace dflash
