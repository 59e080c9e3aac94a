#!/bin/bash
# The device run of issue 13's layout split and the recompute/keep choice (branch kern): every
# CUDA test binary after the split of the CUDA ops into one file pair per op family, and
# `dflash bench --preset qwen3-8b` with the drafter backward keeping its forward activations
# (--recompute auto: the plan keeps them when it fits) and recomputing them (--recompute always).
#
#   bash tools/kern_device_run.sh --stage DIR   (here) stage the stripped binaries of BUILD_DIR
#                                                (default build), the OpenBLAS/utf8proc libraries
#                                                they load (LIBS, a libs tar.xz) and this script
#   bash DIR/kern_device_run.sh DIR             (on the GPU machine, from the repository root)
#
# What to read in $OUT/summary.txt: the two bench tables (drafter backward ms, step ms, plan vs
# measured memory; the header says which way the backward ran), then one line per test binary
# (rc=0 and PASSED counts; TrainStepCuda.KeepingTheForwardActivationsChangesNoBit must pass).
set -u
if [[ "${1:-}" == "--stage" ]]; then
  set -e
  dir=${2:?usage: kern_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build}
  mkdir -p "$dir/bin"
  strip -o "$dir/bin/dflash" "$build/dflash"
  for t in $(cd tests/cuda && ls *_test.cpp | sed 's/\.cpp$//'); do strip -o "$dir/bin/$t" "$build/tests/$t"; done
  tar -C "$dir" -cJf "$dir/bin.tar.xz" bin && rm -r "$dir/bin"
  cp "${LIBS:?LIBS: a tar.xz of the Debian runtime libraries the binaries load}" "$dir/libs.tar.xz"
  cp "$0" "$dir/kern_device_run.sh"
  exit 0
fi
D=$(realpath "${1:?usage: kern_device_run.sh DIR}"); R=${OUT:-/tmp/kern-result}; L=/tmp/kern-out
mkdir -p "$R" "$L" /tmp/kern/libs
START=$(date +%s)
log() { echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a $L/summary.txt; cp $L/summary.txt "$R/"; }
tar -C /tmp/kern -xJf "$D/bin.tar.xz"; tar -C /tmp/kern/libs -xJf "$D/libs.tar.xz"
export LD_LIBRARY_PATH=/tmp/kern/libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=/tmp/kern/bin/dflash NCCL_NVLS_ENABLE=0
B=/tmp/kern/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L/summary.txt
run_test() {  # binary, timeout in s
  local s=$(date +%s); timeout "$2" $B/$1 --gtest_color=no > $L/$1.log 2>&1; local rc=$?
  echo "$1 rc=$rc $(($(date +%s) - s)) s $(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' $L/$1.log | tr '\n' ' ')" >> $L/summary.txt
  grep -E "^\[  FAILED  \]|Failure$|Expected|Which is|Value of|Actual" $L/$1.log | head -12 >> $L/summary.txt
  cp $L/summary.txt "$R/"
}
log "train_step_cuda_test (the new keep-vs-recompute test first)"
run_test train_step_cuda_test 60
# The recompute run times graphs off only (the phase times; the step with graphs on is the auto
# run's headline).
for mode in auto always; do
  extra=""; [[ $mode == always ]] && extra="--graphs off"
  log "dflash bench --preset qwen3-8b --recompute $mode $extra"
  timeout 90 $B/dflash bench --preset qwen3-8b --recompute $mode $extra --json $L/bench_$mode.json > $L/bench_$mode.txt 2>&1
  echo "bench $mode exit $?" >> $L/summary.txt; cat $L/bench_$mode.txt >> $L/summary.txt
  cp $L/bench_$mode.json "$R/" 2>/dev/null
done
log "the other CUDA tests"
for t in $(cd $B && ls *_test | grep -v -e '^train_step_cuda_test$' -e '^pipeline_cuda_test$'); do run_test $t 60; done
run_test pipeline_cuda_test 90
log done
tar -C /tmp -cJf "$R/logs.tar.xz" kern-out 2>/dev/null
