#!/bin/bash
# The CUDA tests and `dflash bench` on the GPU machine, built here (its Ubuntu lacks utf8proc and has
# another yaml-cpp/spdlog, so the binaries link the Debian libraries carried with them).
#
#   bash tools/cuda_device_run.sh --stage DIR   here: build dflash and every CUDA test binary
#                                               (Release, sm_90a; BUILD_DIR default build, JOBS
#                                               default 2) and copy into DIR (an ignored folder,
#                                               e.g. .dev/cuda) the stripped binaries (bin.tar.xz)
#                                               and the shared libraries they link that are not
#                                               the CUDA toolkit's or glibc's (libs.tar.xz)
#   bash tools/cuda_device_run.sh DIR [PART...] on the GPU machine, from the repository root, with
#                                               DIR carried (carry [".dev/cuda"]): PART is tests,
#                                               bench or all (default); logs and summary.txt under
#                                               $OUT
#
# Tests run with DFLASH_TEST_SOURCE_DIR (this tree: assets, configs, fixtures) and
# DFLASH_TEST_BINARY (the carried dflash), so they work wherever the binaries were built. TESTS
# ("a_cuda_test b_cuda_test") narrows the test binaries; each gets TEST_TIMEOUT seconds (default
# 150). What to read in $OUT/summary.txt: one "NAME rc=0 ... [ PASSED ]" line per binary (the
# NCCL test skips on one GPU), then the bench's table (per-phase ms, TFLOP/s, memory plan vs
# measured).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--stage" ]]; then
  set -e
  dir=${2:?usage: cuda_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build}
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=ON \
        -DDFLASH_CUDA_ARCHS=90a > /dev/null
  cmake --build "$build" -j"${JOBS:-2}"
  mapfile -t tests < <(cd "$build/tests" && ls -- *_cuda_test)
  mkdir -p "$dir"
  stage=$(mktemp -d)
  strip -o "$stage/dflash" "$build/dflash"
  for t in "${tests[@]}"; do strip -o "$stage/$t" "$build/tests/$t"; done
  tar -C "$stage" -cJf "$dir/bin.tar.xz" .
  # Every library the binaries link, except glibc's, the CUDA toolkit's (the machine has CUDA 13)
  # and the compiler runtime's.
  libs=$(ldd "$stage"/* | awk '/=> \// {print $3}' | sort -u |
         grep -vE '/libc\.so|/libm\.so|/libstdc\+\+|/libgcc_s|/ld-linux|/libpthread|/libdl\.|/librt\.|cuda|/libnccl|/libcublas|/libcudnn')
  # shellcheck disable=SC2086
  tar -chJf "$dir/libs.tar.xz" --transform 's|.*/||' $libs
  rm -rf "$stage"
  du -sh "$dir"/*
  echo "staged in $dir: on the GPU machine run 'bash tools/cuda_device_run.sh $dir'"
  exit 0
fi

dir=$(cd "${1:?usage: cuda_device_run.sh DIR [tests|bench|all]...}" && pwd)
shift
parts=("${@:-all}")
out=${OUT:?set OUT to the folder for the logs}
summary="$out/summary.txt"
work=$(mktemp -d)
mkdir -p "$work/bin" "$work/libs"
tar -C "$work/bin" -xJf "$dir/bin.tar.xz"
tar -C "$work/libs" -xJf "$dir/libs.tar.xz"
export LD_LIBRARY_PATH=$work/libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
B=$work/bin
missing=$(ldd "$B"/* | awk '/not found/ {print $1}' | sort -u)
if [[ -n "$missing" ]]; then
  echo "libraries not found on this machine: $missing" | tee -a "$summary"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
want() {
  local p
  for p in "${parts[@]}"; do [[ "$p" == all || "$p" == "$1" ]] && return 0; done
  return 1
}

if want tests; then
  export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=$B/dflash
  for t in ${TESTS:-$(cd "$B" && ls -- *_cuda_test)}; do
    s=$(date +%s)
    timeout "${TEST_TIMEOUT:-150}" "$B/$t" --gtest_color=no > "$out/$t.log" 2>&1
    rc=$?
    echo "$t rc=$rc $(($(date +%s) - s)) s $(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' \
      "$out/$t.log" | tr '\n' ' ')" >> "$summary"
    grep -E '^\[  FAILED  \]|Failure$|Expected|Which is|Value of|Actual' "$out/$t.log" |
      head -12 >> "$summary"
  done
fi

if want bench; then
  timeout 200 "$B/dflash" bench --preset qwen3-8b --json "$out/bench.json" > "$out/bench.txt" 2>&1
  echo "bench rc=$?" >> "$summary"
  tail -30 "$out/bench.txt" >> "$summary"
fi
rm -rf "$work"
cat "$summary"
