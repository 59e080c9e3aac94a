// dflash.cpp — the libFuzzer entry point of one fuzz target, chosen at compile time by
// DFLASH_FUZZ_TARGET (the function name in fuzz_targets.hpp; tests/fuzz/CMakeLists.txt builds one
// executable fuzz_<name> per target). A FuzzFailure or any exception other than dflash::Error
// (which the targets swallow) aborts, so libFuzzer saves the input as a crash.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <typeinfo>

#include "core/log.hpp"
#include "fuzz/fuzz_targets.hpp"

#define DFLASH_STRINGIFY2(x) #x
#define DFLASH_STRINGIFY(x) DFLASH_STRINGIFY2(x)

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  dflash::log_init("off");
  dflash::fuzz::warm_up(DFLASH_STRINGIFY(DFLASH_FUZZ_TARGET));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    dflash::fuzz::DFLASH_FUZZ_TARGET(std::span<const uint8_t>(data, size));
  } catch (const dflash::fuzz::FuzzFailure& e) {
    std::fprintf(stderr, "fuzz finding: %s\n", e.what());
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz finding: uncaught %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  }
  return 0;
}
