#!/usr/bin/env bash
# Installs what the project needs, builds it (with CUDA when nvcc exists), creates the Python
# virtual environment of the reference tests and runs the whole test suite with ctest.
# Then builds once more under ASan+UBSan (CPU backend) and runs the C++ tests there, and runs
# each libFuzzer harness of tests/fuzz for 20 s (scripts/fuzz.sh).
#   DFLASH_SKIP_SANITIZE=1  skip the sanitizer pass (quicker local runs)
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
    ctest --output-on-failure -j "$JOBS" -L unit)
fi

if [ "${DFLASH_SKIP_FUZZ:-0}" != "1" ]; then
  DFLASH_WERROR="$WERROR" FUZZ_JOBS="$JOBS" bash scripts/fuzz.sh 20
fi
