#!/usr/bin/env bash
# Installs what the project needs, builds it (with CUDA when nvcc exists), creates the Python
# virtual environment of the reference tests and runs the whole test suite with ctest.
# Then builds once more under ASan+UBSan (CPU backend) and runs the C++ tests there, under
# ThreadSanitizer (CPU backend, only the pipeline's tests and what they need), and runs each
# libFuzzer harness of tests/fuzz for 20 s (scripts/fuzz.sh).
#   DFLASH_SKIP_SANITIZE=1  skip the sanitizer passes (quicker local runs)
#   DFLASH_SKIP_FUZZ=1      skip the fuzz step
#   DFLASH_WERROR=ON        warnings as errors (CI sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

bash scripts/setup.sh

# Python reference environment (tests only; pinned versions).
REQ=tests/reference/requirements.txt
if [ ! -f .venv/.req-hash ] || [ "$(sha256sum <"$REQ")" != "$(cat .venv/.req-hash)" ]; then
  rm -rf .venv
  /usr/bin/python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r "$REQ"
  sha256sum <"$REQ" >.venv/.req-hash
fi

WERROR=${DFLASH_WERROR:-OFF}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_WERROR="$WERROR"
cmake --build build -j "$JOBS"
(cd build && ctest --output-on-failure -j "$JOBS")

if [ "${DFLASH_SKIP_SANITIZE:-0}" != "1" ]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DDFLASH_CUDA=OFF \
    -DDFLASH_SANITIZE=address -DDFLASH_BUILD_BENCH=OFF -DDFLASH_WERROR="$WERROR"
  cmake --build build-asan -j "$JOBS"
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --output-on-failure --no-tests=error -j "$JOBS" -L unit)
fi
if [ "${DFLASH_SKIP_SANITIZE:-0}" != "1" ]; then
  # The multi-threaded pipeline under TSan. OpenBLAS's own threads are not instrumented (their
  # accesses are invisible to TSan); one BLAS thread keeps the run quick on small machines.
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDFLASH_CUDA=OFF \
    -DDFLASH_SANITIZE=thread -DDFLASH_BUILD_BENCH=OFF -DDFLASH_WERROR="$WERROR"
  cmake --build build-tsan -j "$JOBS" --target dflash pipeline_test pipeline_train_test
  (cd build-tsan && OPENBLAS_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    ctest --output-on-failure --no-tests=error -j "$JOBS" -L pipeline)
fi

if [ "${DFLASH_SKIP_FUZZ:-0}" != "1" ]; then
  DFLASH_WERROR="$WERROR" FUZZ_JOBS="$JOBS" bash scripts/fuzz.sh 20
fi
