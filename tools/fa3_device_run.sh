#!/bin/bash
# The device run of issue 13's Hopper attention kernels (branch fa3, src/backend/cuda/
# attention_wgmma.cu): the attention test (every kernel family against the CPU reference, wgmma
# included) plain and under compute-sanitizer memcheck, the GPU training-step test, and
# `dflash bench --preset qwen3-8b` twice: the committed binary and `dflash_wg`, the same source
# with the drafter's and the target's attention set to wgmma explicitly (a local, uncommitted
# change; before the default became `automatic`, this gave the step time with wgmma).
#
#   bash tools/fa3_device_run.sh --stage DIR   (here) stage the stripped binaries of BUILD_DIR
#                                               (default build; WG_DFLASH: the dflash_wg binary),
#                                               the runtime libraries (LIBS, a tar.xz) and this
#                                               script
#   bash DIR/fa3_device_run.sh DIR             (on the GPU machine, from the repository root)
#
# What to read in $OUT/summary.txt: rc=0 and PASSED counts of the tests, "ERROR SUMMARY: 0
# errors" of memcheck, the bench tables (the wgmma rows against the mma.sync rows; the step ms
# of both).
set -u
if [[ "${1:-}" == "--stage" ]]; then
  set -e
  dir=${2:?usage: fa3_device_run.sh --stage DIR}
  build=${BUILD_DIR:-build}
  mkdir -p "$dir/bin"
  strip -o "$dir/bin/dflash" "$build/dflash"
  strip -o "$dir/bin/dflash_wg" "${WG_DFLASH:?WG_DFLASH: dflash built with the wgmma forward}"
  for t in attention_cuda_test train_step_cuda_test; do strip -o "$dir/bin/$t" "$build/tests/$t"; done
  tar -C "$dir" -cJf "$dir/bin.tar.xz" bin && rm -r "$dir/bin"
  cp "${LIBS:?LIBS: a tar.xz of the Debian runtime libraries the binaries load}" "$dir/libs.tar.xz"
  cp "$0" "$dir/fa3_device_run.sh"
  exit 0
fi
D=$(realpath "${1:?usage: fa3_device_run.sh DIR}"); R=${OUT:-/tmp/fa3-result}; L=/tmp/fa3-out
mkdir -p "$R" "$L" /tmp/fa3/libs
START=$(date +%s)
log() { echo "=== $(date +%T) +$(($(date +%s) - START)) s $*" | tee -a $L/summary.txt; cp $L/summary.txt "$R/"; }
tar -C /tmp/fa3 -xJf "$D/bin.tar.xz"; tar -C /tmp/fa3/libs -xJf "$D/libs.tar.xz"
export LD_LIBRARY_PATH=/tmp/fa3/libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DFLASH_TEST_SOURCE_DIR=$PWD DFLASH_TEST_BINARY=/tmp/fa3/bin/dflash NCCL_NVLS_ENABLE=0
B=/tmp/fa3/bin
ldd $B/dflash $B/attention_cuda_test | grep "not found" >> $L/summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L/summary.txt
run_test() {  # binary, timeout in s
  local s=$(date +%s); timeout "$2" $B/$1 --gtest_color=no > $L/$1.log 2>&1; local rc=$?
  echo "$1 rc=$rc $(($(date +%s) - s)) s $(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' $L/$1.log | tr '\n' ' ')" >> $L/summary.txt
  grep -E "^\[  FAILED  \]|Failure$|Expected|Which is|Value of|Actual|wgmma|tensor_core|ffma" $L/$1.log | head -24 >> $L/summary.txt
  cp $L/summary.txt "$R/"
}
log "attention_cuda_test"
run_test attention_cuda_test 30
log "dflash bench --preset qwen3-8b (tensor_core default; wgmma kernel rows)"
timeout 45 $B/dflash bench --preset qwen3-8b --json $L/bench.json > $L/bench.txt 2>&1
echo "bench exit $?" >> $L/summary.txt; cat $L/bench.txt >> $L/summary.txt
log "dflash_wg bench --preset qwen3-8b --graphs off (drafter and target forward on wgmma)"
timeout 30 $B/dflash_wg bench --preset qwen3-8b --graphs off --json $L/bench_wg.json > $L/bench_wg.txt 2>&1
echo "bench_wg exit $?" >> $L/summary.txt; cat $L/bench_wg.txt >> $L/summary.txt
log "train_step_cuda_test"
run_test train_step_cuda_test 15
log "compute-sanitizer memcheck, attention_cuda_test (DFlash and odd-shape cases)"
timeout 20 compute-sanitizer --tool memcheck $B/attention_cuda_test --gtest_color=no \
  --gtest_filter='*DFlash*:*OddShapes*:*EmptyRows*:*Sinks*:*KvCache*' > $L/memcheck.log 2>&1
echo "memcheck rc=$?" >> $L/summary.txt
grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" $L/memcheck.log >> $L/summary.txt
log done
cp $L/bench.json $L/bench_wg.json "$R/" 2>/dev/null
tar -C /tmp -cJf "$R/logs.tar.xz" fa3-out 2>/dev/null
