#!/bin/bash
# Builds the CUDA op tests (tests/cuda/*_test.cpp, one GoogleTest binary each) and runs them on the
# GPU of this machine; every test compares a CUDA op with its CPU reference and skips itself when no
# GPU is visible. Exit code 0 = all passed.
#   bash scripts/cuda_tests.sh               build (CUDA on, static deps) and run here
# For a GPU machine without build tools, tools/device_run.sh stages the binaries with their
# libraries (--stage DIR) and runs them there (DIR tests).
# Environment: BUILD_DIR (default build-cuda), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-cuda}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
      -DDFLASH_STATIC_DEPS=ON -DDFLASH_BUILD_BENCH=OFF > /dev/null
targets=$(cd tests/cuda && ls *_test.cpp | sed 's/\.cpp$//')
# shellcheck disable=SC2086
cmake --build "$build" -j"${JOBS:-2}" --target $targets

fails=""
for t in $targets; do "$build/tests/$t" --gtest_color=no || fails="$fails $t"; done
echo "FAILED:${fails:- none}"
[[ -z "$fails" ]]
